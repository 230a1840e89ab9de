//! The daemon's state: the block graph and the exports serving it, changed
//! by the command line at startup and by QMP commands while running.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use vsd_block::options::OptionMap;
use vsd_block::{ActivationError, BlockGraph, BlockNode, ClaimGuard, LockError, Perms, User, UserGuard, Users};
use vsd_control::qmp::Events;
use vsd_export::{ExportConfig, ExportSnapshot, VhostUserBlkExport};
use vsd_fuse::FuseExport;
use vsd_nbd::{NbdExport, NbdServer, ServerConfig};
use vsd_trace::HistogramSnapshot;

use crate::objects::Objects;

/// The export types `--export` and `block-export-add` take.
pub const EXPORT_TYPES: &[&str] = &["vhost-user-blk", "nbd", "fuse"];

/// Everything the daemon serves.
pub struct Daemon {
    /// Shared with the jobs that change the graph from their own thread
    /// (a mirror's switch).
    state: Arc<Mutex<State>>,
    /// Signalled when an export being deleted has stopped.
    export_stopped: Condvar,
    pub(crate) events: Events,
    /// `--object`s; nodes take their secrets from here.
    pub(crate) objects: Arc<Objects>,
    /// Block jobs (`blockdev-backup`). Never waited for under the state lock.
    pub(crate) jobs: vsd_job::Jobs,
}

pub(crate) struct State {
    pub(crate) graph: BlockGraph,
    /// By id, in id order (as `query-block-exports` lists them).
    pub(crate) exports: BTreeMap<String, Export>,
    /// Exports being deleted, waiting for their requests in flight, with
    /// the node each serves and their type: their id stays taken and their
    /// node busy.
    pub(crate) stopping: BTreeMap<String, (String, &'static str)>,
    /// The NBD server (`--nbd-server`, `nbd-server-start`), if started.
    pub(crate) nbd: Option<NbdServer>,
    /// `block-latency-histogram-set` boundaries, by export id.
    pub(crate) histograms: BTreeMap<String, LatencyBins>,
    /// What each export holds of its node, by export id, until it has
    /// stopped.
    claims: BTreeMap<String, Hold>,
    /// Every node's users inside the daemon (exports, jobs).
    pub(crate) users: Arc<Users>,
}

/// Locks the daemon's state (see [`Daemon::state`]).
pub(crate) fn lock_state(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// An export as a user of its node: it reads, and writes if writable,
/// sharing both, as a QEMU export's BlockBackend, which QEMU's errors name
/// so.
pub(crate) fn export_user(writable: bool) -> User {
    let held = if writable { Perms::READ.with(Perms::WRITE) } else { Perms::READ };
    block_backend(held, Perms::ALL)
}

/// A user as QEMU's errors name a BlockBackend without a device: an
/// export's, or the one a job writes its target through.
pub(crate) fn block_backend(held: Perms, shared: Perms) -> User {
    User { who: "an unnamed block device".into(), role: "root", held, shared, above_users: false }
}

/// What a user holds of a node while it lives: its place among the node's
/// users, and what it needs of the images below (their locks; an
/// `auto-read-only` file is open for writing while a user writes it).
pub(crate) struct Hold {
    _locks: Vec<ClaimGuard>,
    _user: UserGuard,
}

/// Why a hold was refused: another user of the node inside the daemon, or
/// another process holding the image.
#[derive(Debug)]
pub(crate) enum HoldError {
    Conflict(String),
    Lock(LockError),
}

impl std::fmt::Display for HoldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HoldError::Conflict(text) => f.write_str(text),
            HoldError::Lock(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for HoldError {
    /// A lock error's own cause (the host's answer), as its chain shows it.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            HoldError::Conflict(_) => None,
            HoldError::Lock(e) => e.source(),
        }
    }
}

impl HoldError {
    /// As QMP words it (a lock error without its command-line hint).
    pub(crate) fn qmp_text(&self) -> String {
        match self {
            HoldError::Conflict(text) => text.clone(),
            HoldError::Lock(e) => e.qmp_text(),
        }
    }
}

/// Takes `user`'s place on `node`, unless it conflicts with another user
/// or another process.
pub(crate) fn hold(users: &Arc<Users>, node: &Arc<dyn BlockNode>, user: User) -> Result<Hold, HoldError> {
    let claim = user.claim();
    let user = users.attach(node.name(), user).map_err(HoldError::Conflict)?;
    let locks = node.claim(claim).map_err(HoldError::Lock)?;
    Ok(Hold { _locks: locks, _user: user })
}

impl State {
    /// Replaces what export `id` holds (its node changed).
    pub(crate) fn set_claims(&mut self, id: &str, hold: Hold) {
        self.claims.insert(id.to_string(), hold);
    }
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
        let objects = Arc::new(Objects::default());
        let events = Events::new();
        let mut graph = BlockGraph::new();
        graph.set_objects(objects.clone());
        let sink = events.clone();
        graph.set_events(Arc::new(move |name: &str, data| sink.emit(name, data)));
        let state = State {
            graph,
            exports: BTreeMap::new(),
            stopping: BTreeMap::new(),
            nbd: None,
            histograms: BTreeMap::new(),
            claims: BTreeMap::new(),
            users: Arc::default(),
        };
        let sink = events.clone();
        let jobs = vsd_job::Jobs::new(Arc::new(move |name: &str, data| sink.emit(name, data)));
        Self { state: Arc::new(Mutex::new(state)), export_stopped: Condvar::new(), events, objects, jobs }
    }

    /// The state, for one command at a time. A panic while holding it
    /// cannot leave it half-changed in a way later commands could not
    /// handle, so a poisoned lock is taken over.
    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        lock_state(&self.state)
    }

    /// The state's lock, for a job's thread.
    pub(crate) fn shared_state(&self) -> Arc<Mutex<State>> {
        self.state.clone()
    }

    /// Adds a node (`--blockdev`, `blockdev-add`).
    pub fn add_blockdev(&self, opts: OptionMap) -> Result<()> {
        self.state().graph.add(opts)?;
        Ok(())
    }

    /// Starts an export (`--export`, `block-export-add`) of any type.
    pub fn add_export(&self, mut opts: OptionMap) -> Result<()> {
        let kind = opts.require_choice("type", EXPORT_TYPES)?;
        // Each type's options read it again.
        opts.insert("type", kind);
        let config = match kind {
            "nbd" => ExportOptions::Nbd(vsd_nbd::ExportConfig::from_options(&mut opts)?),
            "fuse" => ExportOptions::Fuse(vsd_fuse::ExportConfig::from_options(&mut opts)?),
            _ => ExportOptions::VhostUserBlk(ExportConfig::from_options(&mut opts)?),
        };
        opts.finish()?;
        let mut state = self.state();
        let (id, node_name) = config.names();
        if state.exports.contains_key(id) || state.stopping.contains_key(id) {
            anyhow::bail!("block export id '{id}' is already in use");
        }
        let node = state.graph.get(node_name).with_context(|| format!("export '{id}': no node named '{node_name}'"))?;
        if !node.active() && !config.allows_inactive() {
            // As QEMU: an export that does not allow an inactive node takes
            // the image over.
            state.graph.set_active(Some(node.name()), true, |_| false)?;
        }
        // Formats below take what they need of their images themselves.
        let claims = hold(&state.users, &node, export_user(config.writable()))?;
        let id = id.to_string();
        let export = match config {
            ExportOptions::VhostUserBlk(config) => {
                let iothreads = config.iothreads.iter().map(|id| self.objects.iothread(id)).collect::<Result<_, _>>();
                let export = VhostUserBlkExport::start(config, node, iothreads.map_err(anyhow::Error::msg)?)?;
                log::info!("export '{id}' listening on {}", export.config().addr);
                Export::VhostUserBlk(export)
            }
            ExportOptions::Nbd(config) => {
                if let Some(thread) = &config.iothread {
                    self.objects.iothread(thread).map_err(anyhow::Error::msg)?;
                }
                let server = state.nbd.as_ref().context("NBD server not running")?;
                let export = server.add_export(config, node)?;
                log::info!("export '{id}' offered over NBD as '{}'", export.config().name);
                Export::Nbd(export)
            }
            ExportOptions::Fuse(config) => {
                if let Some(thread) = &config.iothread {
                    self.objects.iothread(thread).map_err(anyhow::Error::msg)?;
                }
                let export = FuseExport::start(config, node).map_err(anyhow::Error::msg)?;
                log::info!("export '{id}' mounted on '{}'", export.config().mountpoint);
                Export::Fuse(export)
            }
        };
        state.claims.insert(id.clone(), claims);
        state.exports.insert(id, export);
        Ok(())
    }

    /// Activates or inactivates node `name` (every node if `None`), with
    /// every vhost-user-blk export's queues stopped meanwhile, as QEMU
    /// drains all I/O first; queues of nodes left inactive stay stopped,
    /// their requests waiting in the rings; connections of NBD exports
    /// with `allow-inactive` are stopped too, and open their queues again.
    /// A node served by an export without `allow-inactive` cannot be
    /// inactivated.
    pub(crate) fn set_active(&self, name: Option<&str>, active: bool) -> Result<(), ActivationError> {
        let state = self.state();
        let pinned = |node: &str| self.pinned_active(&state, node);
        let queues: Vec<&VhostUserBlkExport> = state
            .exports
            .values()
            .filter_map(|e| match e {
                Export::VhostUserBlk(e) => Some(e),
                _ => None,
            })
            .collect();
        let connections: Vec<&NbdExport> = state
            .exports
            .values()
            .filter_map(|e| match e {
                Export::Nbd(e) if e.config().allow_inactive => Some(e),
                _ => None,
            })
            .collect();
        with_queues_stopped(&queues, || {
            with_connections_reopened(&connections, || state.graph.set_active(name, active, pinned))
        })
    }

    /// Whether node `name` must stay active: an export without
    /// `allow-inactive` serves it, or an export being deleted or a job
    /// uses it.
    pub(crate) fn pinned_active(&self, state: &State, name: &str) -> bool {
        state.exports.values().any(|e| !e.allows_inactive() && e.node().name() == name)
            || state.stopping.values().any(|(stopping, _)| stopping == name)
            || self.jobs.user_of(name).is_some()
    }

    /// Starts the NBD server (`--nbd-server`, `nbd-server-start`).
    pub fn start_nbd_server(&self, mut opts: OptionMap) -> Result<()> {
        let config = ServerConfig::from_options(&mut opts)?;
        opts.finish()?;
        let mut state = self.state();
        if state.nbd.is_some() {
            anyhow::bail!("NBD server already running");
        }
        let tls = config.tls_creds.as_deref().map(|id| self.objects.tls_creds(id)).transpose();
        state.nbd = Some(NbdServer::start(config, tls.map_err(anyhow::Error::msg)?)?);
        Ok(())
    }

    /// Stops the NBD server (`nbd-server-stop`): its exports are deleted
    /// first, as QEMU does; returns their ids.
    pub fn stop_nbd_server(&self) -> Result<Vec<String>> {
        let mut state = self.state();
        let server = state.nbd.take().context("NBD server not running")?;
        let ids: Vec<String> =
            state.exports.iter().filter(|(_, e)| matches!(e, Export::Nbd(_))).map(|(id, _)| id.clone()).collect();
        for id in &ids {
            state = self.delete_export(state, id);
        }
        drop(state);
        server.stop();
        Ok(ids)
    }

    /// Deletes export `id` (which `state` must hold) and waits until it has
    /// stopped: its requests in flight complete first. The state lock is
    /// released meanwhile, so that other commands and metrics are served;
    /// the export's id and node stay taken until it has stopped. Returns
    /// the state, locked again.
    pub(crate) fn delete_export<'a>(&'a self, mut state: MutexGuard<'a, State>, id: &str) -> MutexGuard<'a, State> {
        let Some(export) = state.exports.remove(id) else { return state };
        state.histograms.remove(id);
        state.stopping.insert(id.to_string(), (export.node().name().to_string(), export.kind()));
        drop(state);
        export.stop();
        let mut state = self.state();
        state.stopping.remove(id);
        state.claims.remove(id);
        self.export_stopped.notify_all();
        state
    }

    /// Cancels every job, deletes every export (their requests in flight
    /// complete first; BLOCK_EXPORT_DELETED for each, as QSD sends them),
    /// then writes back what nodes cache (qcow2 metadata). An export whose
    /// requests do not complete within [`STOP_LIMIT`] (its back-end stopped
    /// answering: a frozen Ceph cluster or NBD server) is left behind with
    /// the nodes below it, so that it delays neither the others nor the
    /// daemon's exit; it is named in the result, and its requests in flight
    /// were never acknowledged.
    pub fn shutdown(&self) -> Vec<String> {
        let deadline = Instant::now() + STOP_LIMIT;
        // First: guest writes may be waiting for a backup to copy.
        self.jobs.shutdown();
        let mut state = self.state();
        // Each on a thread of its own: one that hangs holds up no other.
        let stopping: Vec<_> = std::mem::take(&mut state.exports)
            .into_iter()
            .map(|(id, export)| {
                let node = export.node();
                let (done, stopped) = std::sync::mpsc::channel();
                std::thread::spawn(move || {
                    export.stop();
                    let _ = done.send(());
                });
                (id, node, stopped)
            })
            .collect();
        let mut hung = Vec::new();
        for (id, node, stopped) in stopping {
            match stopped.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(()) => self.events.emit("BLOCK_EXPORT_DELETED", serde_json::json!({ "id": id })),
                Err(_) => hung.push((id, node)),
            }
        }
        if let Some(server) = state.nbd.take() {
            server.stop();
        }
        // An export being deleted meanwhile may still use its node.
        while !state.stopping.is_empty() && Instant::now() < deadline {
            let wait = deadline.saturating_duration_since(Instant::now());
            state = self.export_stopped.wait_timeout(state, wait).unwrap_or_else(|poisoned| poisoned.into_inner()).0;
        }
        let mut left: Vec<Arc<dyn BlockNode>> = hung.iter().map(|(_, node)| node.clone()).collect();
        left.extend(state.stopping.values().filter_map(|(node, _)| state.graph.get(node)));
        let left = below(left);
        for node in state.graph.nodes().filter(|node| !left.iter().any(|l| Arc::ptr_eq(l, node))) {
            if let Err(e) = node.close() {
                log::error!("node '{}': writing back cached state failed: {e}", node.name());
            }
        }
        // The image locks go now, not when the kernel has torn the engines'
        // rings down after the process exits, which takes a while: a user
        // starting the next program at once finds the images free.
        state.claims.clear();
        state.graph = BlockGraph::new();
        // Dropping them would wait for their back-end: the process's exit
        // takes them.
        std::mem::forget(left);
        hung.into_iter().map(|(id, _)| id).chain(state.stopping.keys().cloned()).collect()
    }
}

/// How long the daemon's stop waits for an export's requests in flight.
pub const STOP_LIMIT: Duration = Duration::from_secs(5);

/// `nodes` and every node below them.
fn below(mut nodes: Vec<Arc<dyn BlockNode>>) -> Vec<Arc<dyn BlockNode>> {
    let mut found: Vec<Arc<dyn BlockNode>> = Vec::new();
    while let Some(node) = nodes.pop() {
        if !found.iter().any(|f| Arc::ptr_eq(f, &node)) {
            nodes.extend(node.children().into_iter().map(|(_, child)| child));
            found.push(node);
        }
    }
    found
}

/// An export's options, by type.
enum ExportOptions {
    VhostUserBlk(ExportConfig),
    Nbd(vsd_nbd::ExportConfig),
    Fuse(vsd_fuse::ExportConfig),
}

impl ExportOptions {
    /// Whether the node may stay inactive (`allow-inactive`).
    fn allows_inactive(&self) -> bool {
        match self {
            ExportOptions::VhostUserBlk(c) => c.allow_inactive,
            ExportOptions::Nbd(c) => c.allow_inactive,
            ExportOptions::Fuse(c) => c.allow_inactive,
        }
    }

    /// Whether the guest or client may write.
    fn writable(&self) -> bool {
        match self {
            ExportOptions::VhostUserBlk(c) => c.writable,
            ExportOptions::Nbd(c) => c.writable,
            ExportOptions::Fuse(c) => c.writable,
        }
    }

    /// The export's id and the node it serves.
    fn names(&self) -> (&str, &str) {
        match self {
            ExportOptions::VhostUserBlk(c) => (&c.id, &c.node_name),
            ExportOptions::Nbd(c) => (&c.id, &c.node_name),
            ExportOptions::Fuse(c) => (&c.id, &c.node_name),
        }
    }
}

/// An export of either type, as the export table holds them.
pub(crate) enum Export {
    VhostUserBlk(VhostUserBlkExport),
    Nbd(NbdExport),
    Fuse(FuseExport),
}

impl Export {
    /// Its `type=`, as `query-block-exports` names it.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Export::VhostUserBlk(_) => "vhost-user-blk",
            Export::Nbd(_) => "nbd",
            Export::Fuse(_) => "fuse",
        }
    }

    pub(crate) fn id(&self) -> &str {
        match self {
            Export::VhostUserBlk(e) => &e.config().id,
            Export::Nbd(e) => &e.config().id,
            Export::Fuse(e) => &e.config().id,
        }
    }

    pub(crate) fn node(&self) -> Arc<dyn BlockNode> {
        match self {
            Export::VhostUserBlk(e) => e.node(),
            Export::Nbd(e) => e.node(),
            Export::Fuse(e) => e.node(),
        }
    }

    /// Whether the guest or client may write.
    pub(crate) fn writable(&self) -> bool {
        match self {
            Export::VhostUserBlk(e) => e.config().writable,
            Export::Nbd(e) => e.config().writable,
            Export::Fuse(e) => e.config().writable,
        }
    }

    /// Whether its node may be inactive (`allow-inactive`).
    pub(crate) fn allows_inactive(&self) -> bool {
        match self {
            Export::VhostUserBlk(e) => e.config().allow_inactive,
            Export::Nbd(e) => e.config().allow_inactive,
            Export::Fuse(e) => e.config().allow_inactive,
        }
    }

    pub(crate) fn has_client(&self) -> bool {
        match self {
            Export::VhostUserBlk(e) => e.has_client(),
            Export::Nbd(e) => e.has_client(),
            // Open files hold no state a deletion could lose.
            Export::Fuse(_) => false,
        }
    }

    /// Statistics: per queue for vhost-user-blk, per connection for NBD
    /// (those that ended summed as the first), per reader thread for FUSE.
    pub(crate) fn stats(&self) -> ExportSnapshot {
        match self {
            Export::VhostUserBlk(e) => e.stats(),
            Export::Nbd(e) => e.stats(),
            Export::Fuse(e) => e.stats(),
        }
    }

    /// Tells the front-end about a new size. NBD clients learn the size
    /// when they connect: the protocol has no message for it; a FUSE
    /// file's size is asked for at every stat.
    pub(crate) fn capacity_changed(&self) -> std::io::Result<()> {
        match self {
            Export::VhostUserBlk(e) => e.capacity_changed().map(drop),
            Export::Nbd(_) | Export::Fuse(_) => Ok(()),
        }
    }

    /// Stops serving; requests in flight complete first.
    pub(crate) fn stop(self) {
        match self {
            Export::VhostUserBlk(e) => e.stop(),
            Export::Nbd(e) => e.stop(),
            Export::Fuse(e) => e.stop(),
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

/// Runs `f` with the connections of these NBD exports stopped; if it
/// succeeds, they open their queues again (a node activated or
/// inactivated keeps nothing a queue opened before may rely on).
fn with_connections_reopened<E>(exports: &[&NbdExport], f: impl FnOnce() -> Result<(), E>) -> Result<(), E> {
    match exports.split_first() {
        None => f(),
        Some((first, rest)) => first.replace_node_after(first.node(), || with_connections_reopened(rest, f)),
    }
}
