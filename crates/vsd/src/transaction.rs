//! QMP's `transaction`: several actions done all or none, as one change
//! for the writers of the bitmaps they touch (libvirt makes a checkpoint
//! by adding a bitmap and disabling the previous one in one transaction).
//! The bitmap commands are transactions of one action.

use serde::Deserialize;
use serde_json::{Value, json};
use vsd_control::qmp::QmpError;

use crate::bitmaps::{BitmapAdd, BitmapMerge, BitmapName, Change, Done, remove_from_image};
use crate::daemon::Daemon;

/// One action, as QMP names it (`type`) with its arguments (`data`).
#[derive(Deserialize)]
#[serde(tag = "type", content = "data", deny_unknown_fields)]
pub(crate) enum Action {
    #[serde(rename = "block-dirty-bitmap-add")]
    AddBitmap(BitmapAdd),
    #[serde(rename = "block-dirty-bitmap-remove")]
    RemoveBitmap(BitmapName),
    #[serde(rename = "block-dirty-bitmap-clear")]
    ClearBitmap(BitmapName),
    #[serde(rename = "block-dirty-bitmap-enable")]
    EnableBitmap(BitmapName),
    #[serde(rename = "block-dirty-bitmap-disable")]
    DisableBitmap(BitmapName),
    #[serde(rename = "block-dirty-bitmap-merge")]
    MergeBitmaps(BitmapMerge),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Transaction {
    actions: Vec<Value>,
    /// `completion-mode` only matters to jobs, which no action starts.
    #[serde(default, rename = "properties")]
    _properties: Option<Value>,
}

impl Transaction {
    /// The actions, each checked as QEMU's QAPI visitor would.
    pub(crate) fn actions(self) -> Result<Vec<Action>, QmpError> {
        self.actions
            .into_iter()
            .map(|action| {
                let kind = action.get("type").and_then(Value::as_str).unwrap_or_default().to_string();
                serde_json::from_value(action).map_err(|e| match e.to_string().starts_with("unknown variant") {
                    true => QmpError::generic(format!("Parameter 'type' does not accept value '{kind}'")),
                    false => QmpError::generic(format!("Invalid parameters: {e}")),
                })
            })
            .collect()
    }
}

impl Daemon {
    /// Does `actions` in order; if one fails, undoes those done before it,
    /// last first, and answers its error.
    pub(crate) fn transaction(&self, actions: Vec<Action>) -> Result<Value, QmpError> {
        let images = vsd_block::dirty::batch(|| {
            let mut done = Vec::with_capacity(actions.len());
            for action in actions {
                match self.act(action) {
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
        Ok(json!({}))
    }

    fn act(&self, action: Action) -> Result<Done, QmpError> {
        match action {
            Action::AddBitmap(args) => self.bitmap_add(args),
            Action::RemoveBitmap(args) => self.bitmap_remove(args),
            Action::ClearBitmap(args) => self.bitmap_change(args, Change::Clear),
            Action::EnableBitmap(args) => self.bitmap_change(args, Change::Enable),
            Action::DisableBitmap(args) => self.bitmap_change(args, Change::Disable),
            Action::MergeBitmaps(args) => self.bitmap_merge(args),
        }
    }
}
