//! The writers of a node, its exports: stopped and moved onto another
//! node, as a live snapshot and a mirror's switch need.

use std::sync::{Arc, Mutex};

use vsd_block::{BlockNode, Claim, Perms};
use vsd_export::VhostUserBlkExport;
use vsd_job::mirror::Writers;

use crate::daemon::{Export, State, export_claim, lock_state};

type Work<'a> = &'a mut dyn FnMut() -> Result<(), String>;

/// Runs `work` (if any) with every export of node `from` stopped; if it
/// succeeds, moves them onto `to` (if any), each holding what it needs of
/// `to`'s images. A writable NBD export cannot be stopped (its connections
/// only move at request boundaries): with `work`, it is refused.
pub(crate) fn switch_exports(
    state: &mut State,
    from: &str,
    to: Option<&Arc<dyn BlockNode>>,
    work: Option<Work<'_>>,
) -> Result<(), String> {
    let exports: Vec<&Export> = state.exports.values().filter(|e| e.node().name() == from).collect();
    if work.is_some()
        && let Some(nbd) = exports.iter().find(|e| matches!(e, Export::Nbd(_)) && e.writable())
    {
        return Err(format!(
            "vsd cannot stop the writes of NBD export '{}' to node '{from}': make it read-only or delete it first",
            nbd.id()
        ));
    }
    // What `to` grants first: a refusal changes nothing.
    let mut claims = Vec::new();
    if let Some(to) = to {
        for export in &exports {
            let held = export_claim(export.writable());
            let granted = to.claim(Claim { held, unshared: Perms::NONE }).map_err(|e| e.to_string())?;
            claims.push((export.id().to_string(), granted));
        }
    }
    let vhost: Vec<&VhostUserBlkExport> = exports
        .iter()
        .filter_map(|e| match e {
            Export::VhostUserBlk(e) => Some(e),
            Export::Nbd(_) => None,
        })
        .collect();
    let mut no_work = || Ok(());
    let work = work.unwrap_or(&mut no_work);
    let mut last = || {
        work()?;
        if let Some(to) = to {
            for export in &exports {
                if let Export::Nbd(nbd) = export {
                    nbd.replace_node(to.clone());
                }
            }
        }
        Ok(())
    };
    stopped(&vhost, to, &mut last)?;
    for (id, granted) in claims {
        log::info!("export '{id}' serves node '{}' from now on", to.map_or(from, |to| to.name()));
        state.set_claims(&id, granted);
    }
    Ok(())
}

/// Runs `work` with every export of `exports` stopped, one inside the
/// other; if it succeeds, each serves `to` (if any) as it restarts.
fn stopped(exports: &[&VhostUserBlkExport], to: Option<&Arc<dyn BlockNode>>, work: Work<'_>) -> Result<(), String> {
    let Some((first, rest)) = exports.split_first() else { return work() };
    let inner = || stopped(rest, to, work);
    match to {
        Some(to) => first.replace_node_after(to.clone(), inner),
        None => first.with_queues_stopped(inner),
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
