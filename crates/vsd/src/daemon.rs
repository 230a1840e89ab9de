//! The daemon's state: the block graph and the exports serving it, changed
//! by the command line at startup and by QMP commands while running.

use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex, MutexGuard};

use anyhow::{Context, Result};
use vsd_block::options::OptionMap;
use vsd_block::{ActivationError, BlockGraph};
use vsd_control::qmp::Events;
use vsd_export::{ExportConfig, VhostUserBlkExport};
use vsd_trace::HistogramSnapshot;

/// Everything the daemon serves.
pub struct Daemon {
    state: Mutex<State>,
    /// Signalled when an export being deleted has stopped.
    export_stopped: Condvar,
    pub(crate) events: Events,
}

pub(crate) struct State {
    pub(crate) graph: BlockGraph,
    /// By id, in id order (as `query-block-exports` lists them).
    pub(crate) exports: BTreeMap<String, VhostUserBlkExport>,
    /// Exports being deleted, waiting for their requests in flight, with
    /// the node each serves: their id stays taken and their node busy.
    pub(crate) stopping: BTreeMap<String, String>,
    /// `block-latency-histogram-set` boundaries, by export id.
    pub(crate) histograms: BTreeMap<String, LatencyBins>,
}

/// The bins a user asked for on one export, per request kind, with the
/// histogram as it was then: bins count only what came after.
#[derive(Default)]
pub(crate) struct LatencyBins {
    pub(crate) read: Option<Bins>,
    pub(crate) write: Option<Bins>,
    pub(crate) flush: Option<Bins>,
}

pub(crate) struct Bins {
    pub(crate) boundaries_ns: Vec<u64>,
    pub(crate) baseline: HistogramSnapshot,
}

impl Daemon {
    pub fn new() -> Self {
        let state = State {
            graph: BlockGraph::new(),
            exports: BTreeMap::new(),
            stopping: BTreeMap::new(),
            histograms: BTreeMap::new(),
        };
        Self { state: Mutex::new(state), export_stopped: Condvar::new(), events: Events::new() }
    }

    /// The state, for one command at a time. A panic while holding it
    /// cannot leave it half-changed in a way later commands could not
    /// handle, so a poisoned lock is taken over.
    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Adds a node (`--blockdev`, `blockdev-add`).
    pub fn add_blockdev(&self, opts: OptionMap) -> Result<()> {
        self.state().graph.add(opts)?;
        Ok(())
    }

    /// Starts an export (`--export`, `block-export-add`).
    pub fn add_export(&self, mut opts: OptionMap) -> Result<()> {
        let config = ExportConfig::from_options(&mut opts)?;
        opts.finish()?;
        let mut state = self.state();
        if state.exports.contains_key(&config.id) || state.stopping.contains_key(&config.id) {
            anyhow::bail!("block export id '{}' is already in use", config.id);
        }
        let node = state
            .graph
            .get(&config.node_name)
            .with_context(|| format!("export '{}': no node named '{}'", config.id, config.node_name))?;
        if !node.active() && !config.allow_inactive {
            // As QEMU: an export that does not allow an inactive node takes
            // the image over.
            state.graph.set_active(Some(node.name()), true, |_| false)?;
        }
        let export = VhostUserBlkExport::start(config, node)?;
        log::info!("export '{}' listening on {}", export.config().id, export.config().socket.display());
        state.exports.insert(export.config().id.clone(), export);
        Ok(())
    }

    /// Activates or inactivates node `name` (every node if `None`), with
    /// every export's queues stopped meanwhile, as QEMU drains all I/O
    /// first; queues of nodes left inactive stay stopped, their requests
    /// waiting in the rings. A node served by an export without
    /// `allow-inactive` cannot be inactivated.
    pub(crate) fn set_active(&self, name: Option<&str>, active: bool) -> Result<(), ActivationError> {
        let state = self.state();
        let pinned = |node: &str| {
            state.exports.values().any(|e| !e.config().allow_inactive && e.node().name() == node)
                || state.stopping.values().any(|stopping| stopping == node)
        };
        let exports: Vec<&VhostUserBlkExport> = state.exports.values().collect();
        with_queues_stopped(&exports, || state.graph.set_active(name, active, pinned))
    }

    /// Deletes export `id` (which `state` must hold) and waits until it has
    /// stopped: its requests in flight complete first. The state lock is
    /// released meanwhile, so that other commands and metrics are served;
    /// the export's id and node stay taken until it has stopped.
    pub(crate) fn delete_export(&self, mut state: MutexGuard<'_, State>, id: &str) {
        let Some(export) = state.exports.remove(id) else { return };
        state.histograms.remove(id);
        state.stopping.insert(id.to_string(), export.node().name().to_string());
        drop(state);
        export.stop();
        self.state().stopping.remove(id);
        self.export_stopped.notify_all();
    }

    /// Stops every export (their requests in flight complete first), then
    /// writes back what nodes cache (qcow2 metadata).
    pub fn shutdown(&self) {
        let mut state = self.state();
        for (_, export) in std::mem::take(&mut state.exports) {
            export.stop();
        }
        // An export being deleted meanwhile may still use its node.
        while !state.stopping.is_empty() {
            state = self.export_stopped.wait(state).unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        for node in state.graph.nodes() {
            if let Err(e) = node.close() {
                log::error!("node '{}': writing back cached state failed: {e}", node.name());
            }
        }
    }
}

/// Runs `f` with the queues of every export in `exports` stopped.
fn with_queues_stopped<T>(exports: &[&VhostUserBlkExport], f: impl FnOnce() -> T) -> T {
    match exports.split_first() {
        None => f(),
        Some((first, rest)) => first.with_queues_stopped(|| with_queues_stopped(rest, f)),
    }
}
