//! QMP's `transaction`: several actions done all or none, as one change
//! for the writers of the nodes they touch (libvirt makes a checkpoint by
//! adding a bitmap and disabling the previous one, and starts a backup
//! with the bitmap of its next checkpoint, in one transaction). The bitmap
//! commands and `blockdev-backup` are transactions of one action.
//!
//! `blockdev-snapshot` and `blockdev-snapshot-internal-sync` actions are
//! checked before any action runs and taken after all the others have
//! succeeded: both stop the node's exports, whose queues cannot stop
//! while the other actions hold the node's writers
//! (`vsd_block::dirty::batch`). A `blockdev-snapshot-sync` first makes
//! and opens its overlay, before any action runs, then is taken as a
//! `blockdev-snapshot`; its overlay goes again if the transaction fails.

use std::sync::Arc;

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use vsd_control::qmp::QmpError;
use vsd_job::{Group, Job};

use crate::bitmaps::{self, BitmapAdd, BitmapMerge, BitmapName, Change, remove_from_image};
use crate::daemon::Daemon;
use crate::drive::{DriveBackupArgs, SnapshotSyncArgs};
use crate::internal_snapshot::InternalSnapshotArgs;
use crate::jobs::BackupArgs;
use crate::qapi;
use crate::snapshot::SnapshotArgs;

/// One action, as QMP names it (`type`) with its arguments (`data`).
pub(crate) enum Action {
    AddBitmap(BitmapAdd),
    RemoveBitmap(BitmapName),
    ClearBitmap(BitmapName),
    EnableBitmap(BitmapName),
    DisableBitmap(BitmapName),
    MergeBitmaps(BitmapMerge),
    Backup(BackupArgs),
    DriveBackup(DriveBackupArgs),
    Snapshot(SnapshotArgs),
    InternalSnapshot(InternalSnapshotArgs),
    SnapshotSync(SnapshotSyncArgs),
}

/// An action as it comes.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct Envelope {
    r#type: String,
    data: Value,
}

impl Action {
    /// Action `at` of a transaction, its arguments checked as QEMU's QAPI
    /// visitor checks them (errors name `actions[N].data.MEMBER`).
    fn parse(at: usize, action: Value) -> Result<(Self, String), QmpError> {
        let Envelope { r#type: kind, data } = qapi::parse_member(&format!("actions[{at}]"), action)?;
        let path = format!("actions[{at}].data");
        let action = match kind.as_str() {
            "block-dirty-bitmap-add" => Action::AddBitmap(qapi::parse_member(&path, data)?),
            "block-dirty-bitmap-remove" => Action::RemoveBitmap(qapi::parse_member(&path, data)?),
            "block-dirty-bitmap-clear" => Action::ClearBitmap(qapi::parse_member(&path, data)?),
            "block-dirty-bitmap-enable" => Action::EnableBitmap(qapi::parse_member(&path, data)?),
            "block-dirty-bitmap-disable" => Action::DisableBitmap(qapi::parse_member(&path, data)?),
            "block-dirty-bitmap-merge" => Action::MergeBitmaps(qapi::parse_member(&path, data)?),
            "blockdev-backup" => Action::Backup(qapi::parse_member(&path, data)?),
            "blockdev-snapshot" => Action::Snapshot(qapi::parse_member(&path, data)?),
            "blockdev-snapshot-internal-sync" => Action::InternalSnapshot(qapi::parse_member(&path, data)?),
            "drive-backup" => Action::DriveBackup(qapi::parse_member(&path, data)?),
            "blockdev-snapshot-sync" => Action::SnapshotSync(qapi::parse_member(&path, data)?),
            _ => return Err(QmpError::generic(format!("Parameter 'type' does not accept value '{kind}'"))),
        };
        Ok((action, kind))
    }
}

/// An action done, as the transaction finishes or undoes it.
enum Done {
    Bitmap(bitmaps::Done),
    /// A job started: cancelled if the transaction fails.
    Job(Arc<Job>),
}

impl Done {
    fn commit(self) -> Option<Arc<dyn vsd_block::BlockNode>> {
        match self {
            Done::Bitmap(done) => done.commit(),
            Done::Job(_) => None,
        }
    }

    fn abort(self) {
        match self {
            Done::Bitmap(done) => done.abort(),
            Done::Job(job) => {
                if let Err(e) = job.cancel() {
                    log::warn!("job '{}' of a failed transaction: {e}", job.id());
                }
            }
        }
    }
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Transaction {
    #[schemars(with = "Vec<ActionSchema>")]
    actions: Vec<Value>,
    #[serde(default)]
    properties: Properties,
}

#[derive(Deserialize, JsonSchema, Default)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct Properties {
    /// `individual` (QEMU's default): each job completes on its own;
    /// `grouped`: the jobs succeed or fail together.
    #[serde(default)]
    completion_mode: Option<CompletionMode>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
enum CompletionMode {
    Individual,
    Grouped,
}

/// The schema of an action: each kind [`Action::parse`] takes, with the
/// type it reads the kind's data into (QEMU's TransactionAction).
#[derive(JsonSchema)]
#[serde(tag = "type", content = "data", rename_all = "kebab-case")]
#[allow(dead_code)] // Described, never built.
enum ActionSchema {
    BlockDirtyBitmapAdd(BitmapAdd),
    BlockDirtyBitmapRemove(BitmapName),
    BlockDirtyBitmapClear(BitmapName),
    BlockDirtyBitmapEnable(BitmapName),
    BlockDirtyBitmapDisable(BitmapName),
    BlockDirtyBitmapMerge(BitmapMerge),
    BlockdevBackup(BackupArgs),
    BlockdevSnapshot(SnapshotArgs),
    BlockdevSnapshotInternalSync(InternalSnapshotArgs),
    DriveBackup(DriveBackupArgs),
    BlockdevSnapshotSync(SnapshotSyncArgs),
}

impl Transaction {
    /// The actions, each checked as QEMU's QAPI visitor would, and the
    /// group their jobs form if the completion mode is `grouped`.
    pub(crate) fn parts(self) -> Result<(Vec<Action>, Option<Arc<Group>>), QmpError> {
        let group = match self.properties.completion_mode {
            None | Some(CompletionMode::Individual) => None,
            Some(CompletionMode::Grouped) => Some(Group::new()),
        };
        let (actions, kinds): (Vec<Action>, Vec<String>) = self
            .actions
            .into_iter()
            .enumerate()
            .map(|(at, action)| Action::parse(at, action))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .unzip();
        if group.is_some() {
            // Only jobs can complete as a group (QEMU's words).
            let job = |action: &Action| matches!(action, Action::Backup(_) | Action::DriveBackup(_));
            let single = actions.iter().zip(&kinds).find(|(action, _)| !job(action));
            if let Some((_, kind)) = single {
                return Err(QmpError::generic(format!(
                    "Action '{kind}' does not support transaction property completion-mode = grouped"
                )));
            }
        }
        Ok((actions, group))
    }
}

impl Daemon {
    /// Does `actions` in order; if one fails, undoes those done before it,
    /// last first, and answers its error. The jobs started join `group`.
    pub(crate) fn transaction(&self, actions: Vec<Action>, group: Option<Arc<Group>>) -> Result<Value, QmpError> {
        let (mut snapshots, mut internal, mut overlays, mut others) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for action in actions {
            match action {
                Action::Snapshot(args) => snapshots.push(args),
                Action::InternalSnapshot(args) => internal.push(args),
                Action::SnapshotSync(args) => match self.open_overlay(args) {
                    Ok(made) => overlays.push(made),
                    Err(e) => {
                        self.release_overlays(&overlays);
                        return Err(e);
                    }
                },
                other => others.push(other),
            }
        }
        let done = self.transaction_of(others, snapshots.iter().chain(&overlays).collect(), &internal, group);
        self.release_overlays(&overlays);
        done
    }

    /// A transaction's actions, its snapshots taken last.
    fn transaction_of(
        &self,
        actions: Vec<Action>,
        snapshots: Vec<&SnapshotArgs>,
        internal: &[InternalSnapshotArgs],
        group: Option<Arc<Group>>,
    ) -> Result<Value, QmpError> {
        self.check_snapshots(&snapshots)?;
        self.check_internal_snapshots(internal)?;
        let images = vsd_block::dirty::batch(|| {
            let mut done = Vec::with_capacity(actions.len());
            for action in actions {
                match self.act(action, &group) {
                    Ok(action) => done.push(action),
                    Err(e) => {
                        done.into_iter().rev().for_each(Done::abort);
                        return Err(e);
                    }
                }
            }
            Ok(done.into_iter().filter_map(Done::commit).collect::<Vec<_>>())
        })?;
        images.iter().for_each(|node| remove_from_image(&**node));
        for args in snapshots {
            self.blockdev_snapshot(args)?;
        }
        self.take_internal_snapshots(internal)?;
        if let Some(group) = group {
            group.seal();
        }
        Ok(json!({}))
    }

    fn act(&self, action: Action, group: &Option<Arc<Group>>) -> Result<Done, QmpError> {
        match action {
            Action::AddBitmap(args) => self.bitmap_add(args).map(Done::Bitmap),
            Action::RemoveBitmap(args) => self.bitmap_remove(args).map(Done::Bitmap),
            Action::ClearBitmap(args) => self.bitmap_change(args, Change::Clear).map(Done::Bitmap),
            Action::EnableBitmap(args) => self.bitmap_change(args, Change::Enable).map(Done::Bitmap),
            Action::DisableBitmap(args) => self.bitmap_change(args, Change::Disable).map(Done::Bitmap),
            Action::MergeBitmaps(args) => self.bitmap_merge(args).map(Done::Bitmap),
            Action::Backup(args) => self.blockdev_backup(args, group.clone()).map(Done::Job),
            Action::DriveBackup(args) => self.drive_backup(args, group.clone()).map(Done::Job),
            Action::Snapshot(_) | Action::InternalSnapshot(_) | Action::SnapshotSync(_) => {
                Err(QmpError::generic("snapshots are taken after the other actions"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The schema lists the kinds `Action::parse` takes, and only those.
    #[test]
    fn the_schema_names_every_kind_of_action_parse_takes() {
        let schema = schemars::schema_for!(ActionSchema).to_value();
        let kinds: Vec<&str> = schema["oneOf"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["properties"]["type"]["const"].as_str().unwrap())
            .collect();
        assert_eq!(kinds.len(), 11);
        for kind in kinds {
            let error = Action::parse(0, json!({"type": kind, "data": {}})).err().map(|e| e.desc).unwrap_or_default();
            assert!(!error.contains("'type' does not accept"), "{kind}: {error}");
        }
        let error = Action::parse(0, json!({"type": "x", "data": {}})).err().unwrap().desc;
        assert!(error.contains("'type' does not accept"), "{error}");
    }
}
