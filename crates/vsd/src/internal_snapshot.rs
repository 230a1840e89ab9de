//! QMP's internal snapshots, as qemu-storage-daemon has them:
//! `blockdev-snapshot-internal-sync` takes one of a qcow2 image in use
//! (also as a `transaction` action), `blockdev-snapshot-delete-internal-sync`
//! deletes one. The node's exports stop at a request boundary meanwhile
//! (their requests in flight complete first), as QEMU drains the node.

use std::time::{SystemTime, UNIX_EPOCH};

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use vsd_control::qmp::QmpError;
use vsd_qcow2::SnapshotInfo;

use crate::chain::Node;
use crate::daemon::{Daemon, State};
use crate::writers::switch_exports;

/// `blockdev-snapshot-internal-sync`'s arguments (QEMU's
/// BlockdevSnapshotInternal).
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct InternalSnapshotArgs {
    device: String,
    name: String,
}

/// `blockdev-snapshot-delete-internal-sync`'s arguments.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct DeleteInternalSnapshotArgs {
    device: String,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    name: Option<String>,
}

fn generic(text: String) -> QmpError {
    QmpError::generic(text)
}

/// What `e` says, as C's strerror says it (QEMU's `error_setg_errno`).
fn strerror(e: &std::io::Error) -> String {
    let text = e.to_string();
    match text.rfind(" (os error ") {
        Some(at) => text[..at].to_string(),
        None => text,
    }
}

/// The node of `node`'s chain whose image holds its snapshots, as QEMU
/// finds it: the node itself if its format has them, else the one child
/// a filter or format passes everything to.
fn snapshot_holder(node: &Node) -> Option<Node> {
    if node.internal_snapshots().is_some() {
        return Some(node.clone());
    }
    match &node.children()[..] {
        [("file", child)] => snapshot_holder(child),
        _ => None,
    }
}

/// QEMU's SnapshotInfo.
fn snapshot_info(info: &SnapshotInfo) -> Value {
    let mut value = json!({
        "id": info.id,
        "name": info.name,
        "vm-state-size": info.vm_state_size,
        "date-sec": info.date_sec,
        "date-nsec": info.date_nsec,
        "vm-clock-sec": info.vm_clock_nsec / 1_000_000_000,
        "vm-clock-nsec": info.vm_clock_nsec % 1_000_000_000,
    });
    if let Some(icount) = info.icount {
        value["icount"] = json!(icount);
    }
    value
}

/// Now, as QEMU dates a snapshot: microseconds of the real-time clock.
fn now() -> (u32, u32) {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    (since.as_secs() as u32, since.subsec_micros() * 1000)
}

impl Daemon {
    pub(crate) fn blockdev_snapshot_internal_sync(&self, args: InternalSnapshotArgs) -> Result<Value, QmpError> {
        self.take_internal_snapshots(&[args]).map(|()| json!({}))
    }

    /// Checks the snapshots of a transaction before any action runs, as
    /// QEMU checks each.
    pub(crate) fn check_internal_snapshots(&self, list: &[InternalSnapshotArgs]) -> Result<(), QmpError> {
        self.holders(&self.state(), list).map(drop)
    }

    /// Takes the snapshots of `list` in order, checked again; if one
    /// fails, those taken are deleted again.
    pub(crate) fn take_internal_snapshots(&self, list: &[InternalSnapshotArgs]) -> Result<(), QmpError> {
        let mut state = self.state();
        let holders = self.holders(&state, list)?;
        let mut taken: Vec<(usize, SnapshotInfo)> = Vec::new();
        for (i, (args, holder)) in list.iter().zip(&holders).enumerate() {
            match take(&mut state, args, holder) {
                Ok(info) => taken.push((i, info)),
                Err(e) => {
                    for (i, info) in taken.iter().rev() {
                        if let Err(e) = delete(&mut state, &list[*i].device, &holders[*i], Some(&info.id), None) {
                            log::warn!("snapshot '{}' of a failed transaction stays: {e:?}", info.name);
                        }
                    }
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// The nodes holding the snapshots of `list`, each checked as QEMU
    /// does; a name an earlier one of the list takes counts as taken.
    fn holders(&self, state: &State, list: &[InternalSnapshotArgs]) -> Result<Vec<Node>, QmpError> {
        let mut holders: Vec<Node> = Vec::with_capacity(list.len());
        for (i, args) in list.iter().enumerate() {
            let holder = self.snapshot_node(state, args)?;
            let earlier = list[..i].iter().zip(&holders).any(|(a, h)| a.name == args.name && h.name() == holder.name());
            if earlier {
                return Err(generic(format!(
                    "Snapshot with name '{}' already exists on device '{}'",
                    args.name, args.device
                )));
            }
            holders.push(holder);
        }
        Ok(holders)
    }

    /// The node holding `args.device`'s snapshots, if one named
    /// `args.name` may be taken: QEMU's checks, in its order.
    fn snapshot_node(&self, state: &State, args: &InternalSnapshotArgs) -> Result<Node, QmpError> {
        let device = &args.device;
        let node = self.root_node(state, device)?;
        if node.read_only() {
            return Err(generic(format!("Device '{device}' is read only")));
        }
        let holder = snapshot_holder(&node).filter(|h| h.active() && !h.read_only()).ok_or_else(|| {
            generic(format!(
                "Block format '{}' used by device '{device}' does not support internal snapshots",
                node.driver()
            ))
        })?;
        if args.name.is_empty() {
            return Err(generic("Name is empty".into()));
        }
        if holder.internal_snapshots().is_some_and(|s| s.list().iter().any(|s| s.name == args.name)) {
            return Err(generic(format!("Snapshot with name '{}' already exists on device '{device}'", args.name)));
        }
        Ok(holder)
    }

    /// Node `device`, if it exists, no node uses it and no job.
    fn root_node(&self, state: &State, device: &str) -> Result<Node, QmpError> {
        let node = state
            .graph
            .get(device)
            .ok_or_else(|| generic(format!("Cannot find device='{device}' nor node-name='{device}'")))?;
        if state.graph.parent(device).is_some() {
            return Err(generic("Need a root block node".into()));
        }
        if let Some((job, _)) = self.jobs.user_of(device) {
            return Err(generic(crate::jobs::busy(device, &job)));
        }
        Ok(node)
    }

    pub(crate) fn blockdev_snapshot_delete_internal_sync(
        &self,
        args: DeleteInternalSnapshotArgs,
    ) -> Result<Value, QmpError> {
        let mut state = self.state();
        let device = &args.device;
        let node = self.root_node(&state, device)?;
        let (id, name) = (args.id.as_deref(), args.name.as_deref());
        if id.is_none() && name.is_none() {
            return Err(generic("Name or id must be provided".into()));
        }
        let holder = snapshot_holder(&node)
            .ok_or_else(|| generic("Failed to get a snapshot list: Operation not supported".into()))?;
        let snapshots = holder.internal_snapshots().map(|s| s.list()).unwrap_or_default();
        let found = snapshots.iter().any(|s| id.is_none_or(|id| s.id == id) && name.is_none_or(|name| s.name == name));
        if !found {
            let or_null = |s: Option<&str>| s.unwrap_or("null").to_string();
            return Err(generic(format!(
                "Snapshot with id '{}' and name '{}' does not exist on device '{device}'",
                or_null(id),
                or_null(name)
            )));
        }
        delete(&mut state, device, &holder, id, name).map(|info| snapshot_info(&info))
    }
}

/// Takes snapshot `args.name` of `holder` with the exports of
/// `args.device` stopped.
fn take(state: &mut State, args: &InternalSnapshotArgs, holder: &Node) -> Result<SnapshotInfo, QmpError> {
    let mut taken = None;
    let mut work = || {
        let snapshots = holder.internal_snapshots().ok_or("no snapshots")?;
        let info = snapshots.create(&args.name, now()).map_err(|e| strerror(&e))?;
        taken = Some(info);
        Ok(())
    };
    switch_exports(state, &args.device, None, Some(&mut work))
        .map_err(|e| generic(format!("Failed to create snapshot '{}' on device '{}': {e}", args.name, args.device)))?;
    log::info!("node '{}': internal snapshot '{}' taken", holder.name(), args.name);
    taken.ok_or_else(|| generic("the snapshot was not taken".into()))
}

/// Deletes the snapshot of `holder` with this id and name, the exports of
/// `device` stopped.
fn delete(
    state: &mut State,
    device: &str,
    holder: &Node,
    id: Option<&str>,
    name: Option<&str>,
) -> Result<SnapshotInfo, QmpError> {
    let mut deleted = None;
    let mut work = || {
        let snapshots = holder.internal_snapshots().ok_or("no snapshots")?;
        if holder.read_only() {
            return Err(strerror(&std::io::Error::from_raw_os_error(libc::EPERM)));
        }
        deleted = Some(snapshots.delete(id, name).map_err(|e| strerror(&e))?);
        Ok(())
    };
    switch_exports(state, device, None, Some(&mut work))
        .map_err(|e| generic(format!("Failed to remove snapshot from snapshot list: {e}")))?;
    deleted.ok_or_else(|| generic("the snapshot was not deleted".into()))
}
