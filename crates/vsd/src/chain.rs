//! A node's backing chain as the jobs that reshape it see it.

use std::sync::Arc;

use vsd_block::BlockNode;

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

/// The file a node's image lives in, as a header names a backing file.
pub(crate) fn image_filename(node: &Node) -> Option<String> {
    node.filename().map(str::to_string).or_else(|| {
        let file = node.children().into_iter().find(|(role, _)| *role == "file")?.1;
        image_filename(&file)
    })
}

/// The format a header names for `node` as a backing file.
pub(crate) fn backing_format(node: &Node) -> &'static str {
    if node.driver() == "qcow2" { "qcow2" } else { "raw" }
}
