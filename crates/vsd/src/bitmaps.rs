//! QMP's dirty bitmap commands (`block-dirty-bitmap-*`), with QEMU's
//! argument shapes and error wording.

use std::sync::Arc;

use serde::Deserialize;
use serde_json::{Value, json};
use vsd_block::BlockNode;
use vsd_block::dirty::{Bitmap, BitmapInfo, BitmapOptions, DirtyBitmaps};
use vsd_control::qmp::QmpError;

use crate::daemon::Daemon;

type Reply = Result<Value, QmpError>;

#[derive(Deserialize)]
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BitmapName {
    node: String,
    name: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BitmapMerge {
    node: String,
    target: String,
    bitmaps: Vec<MergeSource>,
}

/// A bitmap to merge: by name on the target's node, or on any node.
#[derive(Deserialize)]
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

fn failed(e: impl std::fmt::Display) -> QmpError {
    QmpError::generic(e.to_string())
}

impl Daemon {
    /// The node called `name` and its bitmaps; `missing` words the error.
    fn bitmaps_of(&self, name: &str, missing: impl Fn() -> String) -> Result<Arc<DirtyBitmaps>, QmpError> {
        let node = self.state().graph.get(name).ok_or_else(|| QmpError::generic(missing()))?;
        node.dirty_bitmaps().cloned().ok_or_else(|| QmpError::generic(missing()))
    }

    /// A bitmap as the commands other than `-add` look it up.
    fn bitmap(&self, node: &str, name: &str) -> Result<(Arc<DirtyBitmaps>, Arc<Bitmap>), QmpError> {
        let bitmaps = self.bitmaps_of(node, || format!("Node '{node}' not found"))?;
        let bitmap = bitmaps.get(name).map_err(failed)?;
        Ok((bitmaps, bitmap))
    }

    pub(crate) fn bitmap_add(&self, args: BitmapAdd) -> Reply {
        let node = &args.node;
        let graph_node = self.state().graph.get(node);
        let missing = || QmpError::generic(format!("Cannot find device='{node}' nor node-name='{node}'"));
        let graph_node = graph_node.ok_or_else(missing)?;
        let bitmaps = graph_node.dirty_bitmaps().ok_or_else(missing)?;
        if args.persistent && !graph_node.can_store_bitmaps() {
            return Err(QmpError::generic(format!(
                "Can't store persistent bitmaps to {node}: Operation not supported"
            )));
        }
        let options = BitmapOptions {
            granularity: args.granularity.unwrap_or_else(|| graph_node.default_bitmap_granularity()),
            persistent: args.persistent,
            enabled: !args.disabled,
        };
        bitmaps.add(&args.name, graph_node.size(), options).map_err(failed)?;
        Ok(json!({}))
    }

    pub(crate) fn bitmap_remove(&self, args: BitmapName) -> Reply {
        let missing = || QmpError::generic(format!("Node '{}' not found", args.node));
        let node = self.state().graph.get(&args.node).ok_or_else(missing)?;
        let removed = node.dirty_bitmaps().ok_or_else(missing)?.remove(&args.name).map_err(failed)?;
        if removed.info().persistent {
            node.persistent_bitmap_removed().map_err(|e| {
                QmpError::generic(format!("Failed to remove bitmap '{}' from the image: {e}", args.name))
            })?;
        }
        Ok(json!({}))
    }

    pub(crate) fn bitmap_change(&self, args: BitmapName, change: Change) -> Reply {
        let (bitmaps, bitmap) = self.bitmap(&args.node, &args.name)?;
        match change {
            Change::Clear => bitmap.clear(),
            Change::Enable => bitmaps.set_enabled(&bitmap, true),
            Change::Disable => bitmaps.set_enabled(&bitmap, false),
        }
        .map_err(failed)?;
        Ok(json!({}))
    }

    /// Merges every source into the target, all found and checked before
    /// the target changes.
    pub(crate) fn bitmap_merge(&self, args: BitmapMerge) -> Reply {
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
        for (_, source) in &sources {
            target.merge(source).map_err(failed)?;
        }
        Ok(json!({}))
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
