//! A node's backing chain as the jobs that reshape it see it.

use std::sync::Arc;

use vsd_block::BlockNode;
use vsd_control::qmp::QmpError;

use crate::daemon::State;
use crate::jobs::generic;

pub(crate) type Node = Arc<dyn BlockNode>;

/// The node's backing chain, from the node itself down.
pub(crate) fn chain(top: &Node) -> Vec<Node> {
    let mut chain = vec![top.clone()];
    while let Some(backing) = backing_of(chain.last().expect("never empty")) {
        chain.push(backing);
    }
    chain
}

pub(crate) fn backing_of(node: &Node) -> Option<Node> {
    node.children().into_iter().find(|(role, _)| *role == "backing").map(|(_, child)| child)
}

/// Node `name`, looked up by node name only, as QEMU looks up the nodes
/// of a job's chain.
pub(crate) fn lookup(state: &State, name: &str) -> Result<Node, QmpError> {
    state.graph.get(name).ok_or_else(|| generic(format!("Cannot find device='' nor node-name='{name}'")))
}

/// Where node `name` is in `chain`, if it is there.
pub(crate) fn place_of_node(state: &State, chain: &[Node], name: &str) -> Result<Option<usize>, QmpError> {
    let node = lookup(state, name)?;
    Ok(chain.iter().position(|n| n.name() == node.name()))
}

/// Where the image in file `file` is in `chain`, if it is there.
pub(crate) fn place_of_file(chain: &[Node], file: &str) -> Option<usize> {
    chain.iter().position(|n| image_filename(n).as_deref() == Some(file))
}

/// The file a node's image lives in, as a header names a backing file.
pub(crate) fn image_filename(node: &Node) -> Option<String> {
    node.filename().map(str::to_string).or_else(|| {
        let file = node.children().into_iter().find(|(role, _)| *role == "file")?.1;
        image_filename(&file)
    })
}

/// Whether QEMU counts `node`'s driver as a filter: a chain passes through
/// it to its first child (`file`), and it is never a layer of its own.
pub(crate) fn is_filter(node: &Node) -> bool {
    vsd_block::FILTERS.contains(&node.driver())
}

/// Whether `node` is a filter that can pass its requests to another child
/// ([`BlockNode::replace_filtered`]): vsd's throttle, not its blkdebug.
pub(crate) fn swaps_child(node: &Node) -> bool {
    node.driver() == "throttle"
}

/// `node`, or below its filters the node they pass requests on to.
pub(crate) fn skip_filters(node: &Node) -> Node {
    match node.children().into_iter().next() {
        Some((_, child)) if is_filter(node) => skip_filters(&child),
        _ => node.clone(),
    }
}

/// Whether `node`'s driver reaches storage itself (QEMU's protocol
/// drivers): an image there has no format layer.
fn is_protocol(node: &Node) -> bool {
    matches!(node.driver(), "file" | "host_device" | "nbd" | "rbd" | "null-co" | "blkdebug")
}

/// The format a header names for `node` as a backing file. QEMU writes
/// its driver's name, or "raw" for a protocol node with `mask_protocol`
/// (QMP's `backing-mask-protocol`).
pub(crate) fn backing_format(node: &Node, mask_protocol: bool) -> &'static str {
    let qemu = if mask_protocol && is_protocol(node) { "raw" } else { node.driver() };
    // vsd opens only these from a header; "raw" reads any other node's bytes.
    if matches!(qemu, "qcow2" | "raw" | "file") { qemu } else { "raw" }
}
