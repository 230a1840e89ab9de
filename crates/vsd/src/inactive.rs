//! What QEMU refuses, or does otherwise, while a node is inactive (its
//! image belongs to another process, the other end of a live migration):
//! the checks the job, snapshot and graph commands make, in QEMU's words.
//! The rule underneath is the graph's: no active node uses an inactive one
//! (`vsd_block::InactiveChild`). QEMU's jobs put an active filter node over
//! the nodes they work on, so a job on an inactive node is refused where
//! QEMU adds that filter, some before the job is made, some after.

use vsd_block::{GraphError, InactiveChild};
use vsd_control::qmp::QmpError;
use vsd_job::{Job, JobBody, JobSpec};

use crate::chain::Node;
use crate::daemon::{Daemon, State};
use crate::jobs::generic;

/// How QEMU puts a job's filter node in, which its error shows.
pub(crate) enum Filter {
    /// Opened from options (the stream's copy-on-read filter, the
    /// backup's copy-before-write): "Could not create node: ...".
    Opened,
    /// Made by the job and appended over the node (the mirror's and
    /// commit's top filters): the refusal alone.
    Appended,
}

/// Refuses a job whose filter, active as QEMU opens it, would take an
/// inactive node among `children` (role and node, in QEMU's order). The
/// filter would be named as QEMU names it, `#block<n>`.
pub(crate) fn refuse_filter_over(
    state: &mut State,
    children: &[(&str, &Node)],
    filter: Filter,
) -> Result<(), QmpError> {
    let Some((role, child)) = children.iter().find(|(_, node)| !node.active()) else { return Ok(()) };
    let refusal = over(child, role, state.graph.implicit_name());
    Err(generic(match filter {
        Filter::Opened => format!("Could not create node: {refusal}"),
        Filter::Appended => refusal.to_string(),
    }))
}

fn over(child: &Node, role: &str, parent: String) -> InactiveChild {
    InactiveChild { child: child.name().into(), role: role.into(), parent }
}

/// Refuses to use `node` in a way that needs `permission` while it is
/// inactive (QEMU's permission check).
pub(crate) fn require_active(node: &Node, permission: &str) -> Result<(), QmpError> {
    if node.active() { Ok(()) } else { Err(generic(unavailable(permission))) }
}

/// QEMU's refusal of `permission` (or several, `write, resize`) on an
/// inactive node.
pub(crate) fn unavailable(permission: &str) -> String {
    format!("Permission '{permission}' unavailable on inactive node")
}

/// `blockdev-add`'s error over QMP: an inactive child is refused in
/// QEMU's words alone, which name no option string.
pub(crate) fn added_node_error(e: anyhow::Error) -> QmpError {
    match e.downcast_ref::<GraphError>() {
        Some(GraphError::InactiveChild { refusal, .. }) => generic(refusal.to_string()),
        _ => generic(format!("{e:#}")),
    }
}

/// A job QEMU makes before it finds its refusal: made, then dropped.
struct Refused(String);

impl JobBody for Refused {
    fn prepare(&mut self, _job: &std::sync::Arc<Job>) -> Result<(), String> {
        Err(self.0.clone())
    }

    fn run(&mut self, _job: &std::sync::Arc<Job>) -> Result<(), String> {
        Err(self.0.clone())
    }
}

impl Daemon {
    /// Refuses with `refusal` as QEMU does once it has made the job: the
    /// job is made and dropped (`created`, then `null`), unless its id is
    /// taken, which is the error then.
    fn refuse_made_job(&self, spec: &JobSpec, refusal: String) -> Result<(), QmpError> {
        let made = self.jobs.start(spec.clone(), Box::new(Refused(refusal.clone())));
        Err(generic(made.err().unwrap_or(refusal)))
    }

    /// A mirror onto an inactive target: QEMU's job, once made, asks to
    /// write it.
    pub(crate) fn refuse_inactive_target(&self, spec: &JobSpec, target: &Node) -> Result<(), QmpError> {
        if target.active() {
            return Ok(());
        }
        self.refuse_made_job(spec, unavailable("write"))
    }

    /// A commit of an inactive intermediate `top`: QEMU's job, once made,
    /// appends its filter over the top.
    pub(crate) fn refuse_inactive_commit_top(
        &self,
        state: &mut State,
        spec: &JobSpec,
        top: &Node,
    ) -> Result<(), QmpError> {
        if top.active() {
            return Ok(());
        }
        let refusal = over(top, "backing", state.graph.implicit_name());
        self.refuse_made_job(spec, refusal.to_string())
    }

    /// `blockdev-snapshot` of an inactive node: an active overlay is made
    /// inactive first, as QEMU does (older QEMUs let an active overlay sit
    /// on an inactive node, and a snapshot of a stopped VM's disks after a
    /// migration to a file relies on it). With its children that nothing
    /// else keeps active; one that an export serves is refused, its
    /// requests could not be stopped here.
    pub(crate) fn inactivate_overlay_of(&self, state: &State, node: &Node, overlay: &Node) -> Result<(), QmpError> {
        if node.active() || !overlay.active() {
            return Ok(());
        }
        let served = |name: &str| state.exports.values().any(|e| e.node().name() == name);
        let pinned = |name: &str| served(name) || self.pinned_active(state, name);
        state.graph.set_active(Some(overlay.name()), false, pinned).map_err(|e| generic(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blockdev_add_names_no_option_string_for_an_inactive_child() {
        let refusal = InactiveChild { child: "n".into(), role: "file".into(), parent: "o".into() };
        let e = anyhow::Error::from(GraphError::InactiveChild { context: "blockdev-add node-name=o".into(), refusal });
        assert_eq!(added_node_error(e).desc, "Inactive 'n' can't be a file child of active 'o'");
        let other = anyhow::anyhow!("blockdev-add node-name=o: a node named 'o' already exists");
        assert_eq!(added_node_error(other).desc, "blockdev-add node-name=o: a node named 'o' already exists");
    }
}
