//! QMP's `blockdev-snapshot`: a new qcow2 overlay goes on top of a running
//! disk. The node becomes the overlay's backing node, and every export of
//! the node serves the overlay from then on: its queues stop at a request
//! boundary (the requests in flight complete on the node), the overlay
//! takes their place, and the next requests go to it. A throttle filter
//! over the node takes the overlay as its child the same way, its exports
//! stopped meanwhile.

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use vsd_block::RemoveError;
use vsd_control::qmp::QmpError;

use crate::chain::{Node, swaps_child};
use crate::daemon::{Daemon, State};
use crate::writers::switch_exports;

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct SnapshotArgs {
    pub(crate) node: String,
    pub(crate) overlay: String,
}

fn generic(text: String) -> QmpError {
    QmpError::generic(text)
}

impl Daemon {
    pub(crate) fn blockdev_snapshot(&self, args: &SnapshotArgs) -> Result<Value, QmpError> {
        let mut guard = self.state();
        let state = &mut *guard;
        let (node, overlay) = self.snapshot_nodes(state, args)?;
        let filters = filters_above(state, &args.node)?;
        self.inactivate_overlay_of(state, &node, &overlay)?;
        overlay.attach_backing(node).map_err(|e| generic(e.to_string()))?;
        switch_exports(state, &args.node, Some(&overlay), None).map_err(generic)?;
        for filter in filters {
            let mut replace = || filter.replace_filtered(overlay.clone()).map_err(|e| e.to_string());
            switch_exports(state, filter.name(), Some(&filter), Some(&mut replace)).map_err(generic)?;
        }
        Ok(json!({}))
    }

    /// Checks the snapshots of a transaction before any action runs: each
    /// as `blockdev-snapshot` would, and no node or overlay twice.
    pub(crate) fn check_snapshots(&self, snapshots: &[&SnapshotArgs]) -> Result<(), QmpError> {
        let state = self.state();
        for (i, args) in snapshots.iter().enumerate() {
            self.snapshot_nodes(&state, args)?;
            let named = |name: &str| snapshots[..i].iter().any(|a| a.node == name || a.overlay == name);
            if named(&args.node) || named(&args.overlay) {
                return Err(generic(format!(
                    "Node '{}' is busy: another snapshot of this transaction uses it",
                    args.node
                )));
            }
        }
        Ok(())
    }

    /// The node and the overlay of a snapshot, if it may be taken.
    fn snapshot_nodes(&self, state: &State, args: &SnapshotArgs) -> Result<(Node, Node), QmpError> {
        let find = |name: &str| {
            state.graph.get(name).ok_or_else(|| generic(format!("Cannot find device='{name}' nor node-name='{name}'")))
        };
        let (node, overlay) = (find(&args.node)?, find(&args.overlay)?);
        // QEMU's checks, in its order: the node, then the overlay.
        filters_above(state, &args.node)?;
        if let Some((job, _)) = self.jobs.user_of(&args.node) {
            return Err(generic(crate::jobs::busy(&args.node, &job)));
        }
        if args.overlay == args.node || self.in_use(state, &args.overlay) {
            return Err(generic("The overlay is already in use".into()));
        }
        if overlay.children().iter().any(|(role, _)| *role == "backing") {
            return Err(generic("The overlay already has a backing image".into()));
        }
        if overlay.driver() != "qcow2" {
            return Err(generic("The overlay does not support backing images".into()));
        }
        if overlay.size() != node.size() {
            return Err(generic(format!(
                "The overlay has {} bytes and node '{}' {}: vsd takes overlays of the node's size",
                overlay.size(),
                args.node,
                node.size()
            )));
        }
        Ok((node, overlay))
    }

    /// Whether an export, another node or a job uses node `name`.
    pub(crate) fn in_use(&self, state: &State, name: &str) -> bool {
        state.exports.values().any(|e| e.node().name() == name)
            || state.stopping.values().any(|(node, _)| node == name)
            || state.graph.parent(name).is_some()
            || self.jobs.user_of(name).is_some()
    }
}

/// The filters right above node `name`, which a snapshot puts over the
/// overlay (QEMU puts the overlay in the node's place in every parent).
/// vsd's throttle filters can take another child; other parents refuse,
/// in QEMU's words for a backing link.
fn filters_above(state: &State, name: &str) -> Result<Vec<Node>, QmpError> {
    let above = |name: &str| -> Vec<Node> {
        state.graph.nodes().filter(|p| p.children().iter().any(|(_, child)| child.name() == name)).cloned().collect()
    };
    let filters = above(name);
    if let Some(other) = filters.iter().find(|p| !swaps_child(p)) {
        let role =
            other.children().into_iter().find(|(_, child)| child.name() == name).map_or("child", |(role, _)| role);
        let used = RemoveError::Child { role, parent: other.name().to_string() };
        return Err(generic(format!("Node '{name}' is busy: {used}")));
    }
    if let Some(filter) = filters.iter().find(|f| !above(f.name()).is_empty()) {
        return Err(generic(format!(
            "Node '{}' is busy: vsd does not snapshot below a filter another node uses",
            filter.name()
        )));
    }
    Ok(filters)
}
