//! QMP `query-block`, and the node description (QAPI's `BlockDeviceInfo`)
//! it shares with `query-named-block-nodes`.
//!
//! qemu-storage-daemon answers `query-block` with an empty list: its
//! exports are not guest devices, and it lists only those. vsd lists each
//! of its exports as QEMU lists a guest's disk on a `-blockdev` node (no
//! device name; `qdev` is the export's id, as in `query-blockstats`), its
//! node under `inserted`.

use std::sync::Arc;

use serde_json::{Map, Value, json};
use vsd_block::BlockNode;

use crate::daemon::Daemon;

/// What QMP shows of `node` (QAPI's `BlockDeviceInfo`, with vsd's
/// `children`).
pub(crate) fn device_info(node: &Arc<dyn BlockNode>) -> Value {
    let children: Map<String, Value> =
        node.children().into_iter().map(|(role, child)| (role.to_string(), child.name().into())).collect();
    let mut entry = json!({
        "node-name": node.name(),
        "drv": node.driver(),
        "ro": node.read_only(),
        "active": node.active(),
        // Nodes write back; only an export's writethrough differs.
        "cache": { "writeback": true, "direct": node.cache().direct, "no-flush": node.cache().no_flush },
        "file": filename(&**node),
        "encrypted": false,
        "detect_zeroes": "off",
        "backing_file_depth": backing_depth(&**node),
        "write_threshold": crate::threshold::shown(&**node),
        "image": { "filename": filename(&**node), "format": node.driver(), "virtual-size": node.size() },
        "children": children,
    });
    // QEMU's legacy throttling limits, which vsd has as throttle nodes.
    for limit in ["bps", "bps_rd", "bps_wr", "iops", "iops_rd", "iops_wr"] {
        entry[limit] = json!(0);
    }
    if let Some(bitmaps) = crate::bitmaps::listed(&**node) {
        entry["dirty-bitmaps"] = bitmaps;
    }
    entry
}

/// The file a node's data is in: its own, or its `file` child's, as QEMU
/// shows a format node's.
fn filename(node: &dyn BlockNode) -> String {
    match node.filename() {
        Some(name) => name.to_string(),
        None => node
            .children()
            .into_iter()
            .find(|(role, _)| *role == "file")
            .map_or_else(String::new, |(_, file)| filename(&*file)),
    }
}

/// How many backing files are below a node.
fn backing_depth(node: &dyn BlockNode) -> u64 {
    let backing = node.children().into_iter().find(|(role, _)| *role == "backing");
    backing.map_or(0, |(_, child)| 1 + backing_depth(&*child))
}

impl Daemon {
    /// Every export as a disk (QAPI's `BlockInfo`), in id order.
    pub(crate) fn query_block(&self) -> Value {
        let state = self.state();
        let disk = |id: &str, node: &Arc<dyn BlockNode>| {
            json!({
                "device": "",
                "qdev": id,
                "type": "unknown",
                "removable": false,
                "locked": false,
                "io-status": "ok",
                "inserted": device_info(node),
            })
        };
        state.exports.values().map(|export| disk(export.id(), &export.node())).collect()
    }
}
