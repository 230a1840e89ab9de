//! QMP's dirty bitmap commands (`block-dirty-bitmap-*`), with QEMU's
//! argument shapes and error wording.

use std::sync::Arc;

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use vsd_block::BlockNode;
use vsd_block::dirty::{Bitmap, BitmapInfo, BitmapOptions, BusyGuard, DirtyBitmaps};
use vsd_control::qmp::QmpError;

use crate::daemon::Daemon;

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct BitmapAdd {
    node: String,
    name: String,
    granularity: Option<u64>,
    #[serde(default)]
    persistent: bool,
    #[serde(default)]
    disabled: bool,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct BitmapName {
    node: String,
    name: String,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct BitmapMerge {
    node: String,
    target: String,
    bitmaps: Vec<MergeSource>,
}

/// A bitmap to merge: by name on the target's node, or on any node.
#[derive(Deserialize, JsonSchema)]
#[serde(untagged)]
enum MergeSource {
    Local(String),
    Elsewhere(BitmapName),
}

/// What the commands that change one bitmap do to it.
#[derive(Clone, Copy)]
pub(crate) enum Change {
    Clear,
    Enable,
    Disable,
}

/// A bitmap action done, as a transaction undoes or finishes it.
pub(crate) enum Done {
    Added {
        bitmaps: Arc<DirtyBitmaps>,
        name: String,
    },
    /// Removal finishes at commit: until then the bitmap is held.
    Removing {
        node: Arc<dyn BlockNode>,
        guard: BusyGuard,
    },
    Cleared {
        bitmap: Arc<Bitmap>,
        bits: Vec<u64>,
    },
    Switched {
        bitmaps: Arc<DirtyBitmaps>,
        bitmap: Arc<Bitmap>,
        was: bool,
    },
    Merged {
        bitmap: Arc<Bitmap>,
        bits: Vec<u64>,
    },
}

impl Done {
    /// Finishes the action; returns the node whose image must then forget
    /// a persistent bitmap (I/O, which recording waits for: do it after
    /// the batch, see [`remove_from_image`]).
    pub(crate) fn commit(self) -> Option<Arc<dyn BlockNode>> {
        let Done::Removing { node, guard } = self else { return None };
        let persistent = guard.bitmap().info().persistent;
        node.dirty_bitmaps()?.remove_held(guard);
        persistent.then_some(node)
    }

    pub(crate) fn abort(self) {
        match self {
            Done::Added { bitmaps, name } => {
                if let Ok(bitmap) = bitmaps.get(&name).and_then(|b| b.hold()) {
                    bitmaps.remove_held(bitmap);
                }
            }
            Done::Removing { .. } => {} // the guard lets it go
            Done::Cleared { bitmap, bits } => bitmap.add_back(&bits),
            Done::Switched { bitmaps, bitmap, was } => {
                let _ = bitmaps.set_enabled(&bitmap, was);
            }
            Done::Merged { bitmap, bits } => bitmap.put_back(&bits),
        }
    }
}

/// Makes `node`'s image forget the persistent bitmaps removed from it.
pub(crate) fn remove_from_image(node: &dyn BlockNode) {
    if let Err(e) = node.persistent_bitmap_removed() {
        // The image keeps them flagged in use: they load inconsistent.
        log::warn!("node '{}': cannot remove bitmaps from the image: {e}", node.name());
    }
}

fn failed(e: impl std::fmt::Display) -> QmpError {
    QmpError::generic(e.to_string())
}

impl Daemon {
    /// The node called `name`; `missing` words the error.
    fn bitmap_node(&self, name: &str, missing: impl Fn() -> String) -> Result<Arc<dyn BlockNode>, QmpError> {
        let node = self.state().graph.get(name).filter(|n| n.dirty_bitmaps().is_some());
        node.ok_or_else(|| QmpError::generic(missing()))
    }

    /// A bitmap as the commands other than `-add` look it up.
    fn bitmap(&self, node: &str, name: &str) -> Result<(Arc<DirtyBitmaps>, Arc<Bitmap>), QmpError> {
        let node = self.bitmap_node(node, || format!("Node '{node}' not found"))?;
        let bitmaps = node.dirty_bitmaps().cloned().unwrap_or_default();
        let bitmap = bitmaps.get(name).map_err(failed)?;
        Ok((bitmaps, bitmap))
    }

    pub(crate) fn bitmap_add(&self, args: BitmapAdd) -> Result<Done, QmpError> {
        let name = &args.node;
        let node = self.bitmap_node(name, || format!("Cannot find device='{name}' nor node-name='{name}'"))?;
        if args.persistent && !node.can_store_bitmaps() {
            return Err(QmpError::generic(format!(
                "Can't store persistent bitmaps to {name}: Operation not supported"
            )));
        }
        let options = BitmapOptions {
            granularity: args.granularity.unwrap_or_else(|| node.default_bitmap_granularity()),
            persistent: args.persistent,
            enabled: !args.disabled,
        };
        let bitmaps = node.dirty_bitmaps().cloned().unwrap_or_default();
        bitmaps.add(&args.name, node.size(), options).map_err(failed)?;
        Ok(Done::Added { bitmaps, name: args.name })
    }

    pub(crate) fn bitmap_remove(&self, args: BitmapName) -> Result<Done, QmpError> {
        let node = self.bitmap_node(&args.node, || format!("Node '{}' not found", args.node))?;
        let (_, bitmap) = self.bitmap(&args.node, &args.name)?;
        let guard = bitmap.hold().map_err(failed)?;
        Ok(Done::Removing { node, guard })
    }

    pub(crate) fn bitmap_change(&self, args: BitmapName, change: Change) -> Result<Done, QmpError> {
        let (bitmaps, bitmap) = self.bitmap(&args.node, &args.name)?;
        bitmap.usable().map_err(failed)?;
        let done = match change {
            Change::Clear => Done::Cleared { bits: bitmap.copy_bits(), bitmap: bitmap.clone() },
            Change::Enable | Change::Disable => {
                Done::Switched { bitmaps: bitmaps.clone(), was: bitmap.info().recording, bitmap: bitmap.clone() }
            }
        };
        match change {
            Change::Clear => bitmap.clear(),
            Change::Enable => bitmaps.set_enabled(&bitmap, true),
            Change::Disable => bitmaps.set_enabled(&bitmap, false),
        }
        .map_err(failed)?;
        Ok(done)
    }

    /// Merges every source into the target, all found and checked before
    /// the target changes.
    pub(crate) fn bitmap_merge(&self, args: BitmapMerge) -> Result<Done, QmpError> {
        let (_, target) = self.bitmap(&args.node, &args.target)?;
        target.usable().map_err(failed)?;
        let sources = args
            .bitmaps
            .iter()
            .map(|source| match source {
                MergeSource::Local(name) => self.bitmap(&args.node, name),
                MergeSource::Elsewhere(other) => self.bitmap(&other.node, &other.name),
            })
            .collect::<Result<Vec<_>, _>>()?;
        for (_, source) in &sources {
            source.usable().map_err(failed)?;
            target.check_merge(source).map_err(failed)?;
        }
        let bits = target.copy_bits();
        for (_, source) in &sources {
            target.merge(source).map_err(failed)?;
        }
        Ok(Done::Merged { bitmap: target, bits })
    }
}

/// `query-named-block-nodes`' `dirty-bitmaps` of a node, if it has any.
pub(crate) fn listed(node: &dyn BlockNode) -> Option<Value> {
    let bitmaps = node.dirty_bitmaps()?.all();
    (!bitmaps.is_empty()).then(|| bitmaps.iter().map(|b| info_json(&b.info())).collect())
}

fn info_json(info: &BitmapInfo) -> Value {
    let mut entry = json!({
        "name": info.name,
        "count": info.count,
        "granularity": info.granularity,
        "recording": info.recording,
        "busy": info.busy,
        "persistent": info.persistent,
    });
    // QEMU shows the member only when it is true.
    if info.inconsistent {
        entry["inconsistent"] = json!(true);
    }
    entry
}
