//! The writers of a node, its exports: stopped and moved onto another
//! node, as a live snapshot and a mirror's switch need.

use std::sync::{Arc, Mutex};

use vsd_block::BlockNode;
use vsd_job::mirror::Writers;

use crate::daemon::{Export, State, export_user, hold, lock_state};

type Work<'a> = &'a mut dyn FnMut() -> Result<(), String>;

/// Runs `work` (if any) with every export of node `from` stopped (the
/// vhost-user-blk queues, the NBD connections and the FUSE readers, at a
/// request boundary);
/// if it succeeds, moves them onto `to` (if any), each holding what it
/// needs of `to`'s images.
pub(crate) fn switch_exports(
    state: &mut State,
    from: &str,
    to: Option<&Arc<dyn BlockNode>>,
    work: Option<Work<'_>>,
) -> Result<(), String> {
    let exports: Vec<&Export> = state.exports.values().filter(|e| e.node().name() == from).collect();
    // What `to` grants first: a refusal changes nothing.
    let mut claims = Vec::new();
    if let Some(to) = to {
        for export in &exports {
            let granted = hold(&state.users, to, export_user(export.writable())).map_err(|e| e.to_string())?;
            claims.push((export.id().to_string(), granted));
        }
    }
    let mut no_work = || Ok(());
    stopped(&exports, to, work.unwrap_or(&mut no_work))?;
    for (id, granted) in claims {
        log::info!("export '{id}' serves node '{}' from now on", to.map_or(from, |to| to.name()));
        state.set_claims(&id, granted);
    }
    Ok(())
}

/// Runs `work` with every export of `exports` stopped, one inside the
/// other; if it succeeds, each serves `to` (if any) as it restarts.
fn stopped(exports: &[&Export], to: Option<&Arc<dyn BlockNode>>, work: Work<'_>) -> Result<(), String> {
    let Some((first, rest)) = exports.split_first() else { return work() };
    let inner = || stopped(rest, to, work);
    match (first, to) {
        (Export::VhostUserBlk(e), Some(to)) => e.replace_node_after(to.clone(), inner),
        (Export::VhostUserBlk(e), None) => e.with_queues_stopped(inner),
        (Export::Nbd(e), Some(to)) => e.replace_node_after(to.clone(), inner),
        (Export::Nbd(e), None) => e.with_connections_stopped(inner),
        (Export::Fuse(e), to) => e.with_readers_stopped(to.cloned(), inner),
    }
}

/// The exports of a mirror's source, as the job sees them.
pub(crate) struct SourceWriters {
    pub(crate) state: Arc<Mutex<State>>,
    pub(crate) source: String,
}

impl Writers for SourceWriters {
    fn stopped(&self, switch_to: Option<&Arc<dyn BlockNode>>, work: Work<'_>) -> Result<(), String> {
        switch_exports(&mut lock_state(&self.state), &self.source, switch_to, Some(work))
    }
}
