//! The listener, its connections and the exports they may choose.
//!
//! One thread accepts clients while fewer than `max-connections` are
//! connected, or some of them are still negotiating; the rest wait in the
//! listen backlog. Unfinished handshakes (a TLS handshake included) have a
//! smaller budget within `max-connections` ([`handshake_budget`]): a
//! newcomer that would pass it, or `max-connections`, drops one of them,
//! never a connection that finished its handshake. The one dropped is the
//! oldest of the source with the most ([`victim`]: a process on a unix
//! socket, a host over TCP), so a flood drops its own connections, and a
//! real client, the newest, gets through at once (CVE-2024-7409 was idle
//! half-open connections locking real clients out; OpenSSH's `MaxStartups`
//! drops unauthenticated connections early in the same way). Each client
//! gets a thread of its own: the handshake, bounded by
//! `handshake-max-seconds` (a client that stalls inside TLS is cut like one
//! that stalls between options), then the transmission phase
//! ([`crate::conn`]). Every connection is tracked, so that removing an
//! export, or stopping the server, cuts each one it concerns and waits for
//! its requests in flight. An export's connections can be held stopped at
//! a request boundary and moved onto another node (a block job's switch,
//! a live snapshot): [`NbdExport::replace_node_after`].

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::io::{self, Read, Write};
use std::net::{IpAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::Instant;

use rustls::ServerConnection;
use vsd_net::{ServerCreds, Stream};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};
use vsd_block::BlockNode;
use vsd_block::dirty::{Bitmap, BusyGuard};
use vsd_sys::ListenError;
use vsd_sys::activation::{self, Family};
use vsd_trace::{ExportSnapshot, QueueSnapshot, QueueStats};

use crate::config::{Address, ExportConfig, ServerConfig};
use crate::conn::{self, MAX_PAYLOAD};
use crate::negotiate::{Agreement, Catalog, ExportInfo, Negotiation};
use crate::proto::tx_flag;

/// Why the server or an export could not start.
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    /// The listening socket could not be created.
    #[error("cannot listen on {addr}")]
    Listen {
        /// The address, for people.
        addr: String,
        /// The host's answer.
        #[source]
        source: io::Error,
    },
    /// Another export already has that name.
    #[error("export '{id}': an NBD export named '{name}' already exists")]
    NameTaken {
        /// The export.
        id: String,
        /// The name.
        name: String,
    },
    /// The node cannot be served as configured.
    #[error("export '{id}': {reason}")]
    Invalid {
        /// The export.
        id: String,
        /// What is wrong.
        reason: String,
    },
}

/// A running NBD server; dropping it stops it.
pub struct NbdServer {
    shared: Arc<Shared>,
}

struct Shared {
    config: ServerConfig,
    /// Clients must start TLS with these before anything else.
    tls: Option<Arc<ServerCreds>>,
    exports: RwLock<BTreeMap<String, Arc<Export>>>,
    conns: Mutex<Conns>,
    /// Written to stop the accepting thread.
    stop: EventFd,
    /// Written when a connection ends: the accepting thread may take another.
    ended: EventFd,
    accept: Mutex<Option<JoinHandle<()>>>,
}

#[derive(Default)]
struct Conns {
    next_id: u64,
    live: BTreeMap<u64, Conn>,
}

/// A connection, as the control side sees it.
struct Conn {
    /// A second handle on the socket, to cut it.
    stream: Stream,
    stage: Stage,
    /// Set once the client is gone (it disconnected, or the connection
    /// failed), while the thread may still be finishing its requests: it
    /// no longer keeps a safe `block-export-del` from going ahead.
    client_gone: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// How far a connection has gone.
enum Stage {
    /// Negotiating: it may be dropped to admit a newcomer.
    Negotiating(Source),
    /// Dropped for a newcomer; its thread is ending.
    Dropped,
    /// The handshake is over: it serves this export.
    Serving(Arc<Export>),
}

/// Where a connection comes from, as the handshake budget counts them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Source {
    /// A process on the unix socket (its pid, from `SO_PEERCRED`; 0 if
    /// unknown): per user would put a flooding process with the clients of
    /// the same user (often root), per socket would count them all as one.
    Process(i32),
    /// A TCP peer: an IPv4 address, or an IPv6 /64 (one host's share).
    Host(IpAddr),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Process(pid) => write!(f, "process {pid}"),
            Source::Host(host) => write!(f, "{host}"),
        }
    }
}

/// What connections to one export share.
pub(crate) struct Export {
    pub(crate) config: ExportConfig,
    control: Mutex<Control>,
    /// `control.epoch`, for connections to look at each round without the
    /// lock.
    epoch: AtomicU64,
    /// Written on every change of `control`: it wakes idle connections
    /// (each watches it edge-triggered), which catch up with it.
    pub(crate) changed: EventFd,
    caught_up: Condvar,
    pub(crate) info: ExportInfo,
    /// The bitmaps of `config.bitmaps`, held busy while the export lives.
    pub(crate) bitmaps: Vec<BusyGuard>,
    /// Set once the export is being removed: no connection may join it.
    closed: AtomicBool,
    stats: Mutex<ExportStats>,
}

/// What an export's connections are told to do, and how far each has
/// followed.
struct Control {
    /// Counts the changes below; connections catch up with each.
    epoch: u64,
    /// How many times the node was replaced (a live snapshot's overlay, a
    /// mirror's target took its place).
    generation: u64,
    node: Arc<dyn BlockNode>,
    /// How many callers hold the connections stopped.
    holds: usize,
    /// By connection, the epoch it has caught up with.
    caught_up: BTreeMap<u64, u64>,
    next_seat: u64,
}

impl Control {
    fn orders(&self) -> Orders {
        Orders { epoch: self.epoch, generation: self.generation, node: self.node.clone(), held: self.holds > 0 }
    }
}

/// What a connection is told when it joins an export or catches up with it.
pub(crate) struct Orders {
    pub(crate) epoch: u64,
    /// Which of the export's nodes `node` is.
    pub(crate) generation: u64,
    pub(crate) node: Arc<dyn BlockNode>,
    /// No request may go to the node until the next change.
    pub(crate) held: bool,
}

/// Each live connection's statistics, and the sum of those that ended.
#[derive(Default)]
struct ExportStats {
    live: Vec<Arc<QueueStats>>,
    ended: QueueSnapshot,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves its data consistent.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Export {
    /// The node served.
    pub(crate) fn node(&self) -> Arc<dyn BlockNode> {
        lock(&self.control).node.clone()
    }

    /// The number of changes so far: a connection that has caught up with
    /// it has nothing to do but serve.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// What connections are to do now.
    pub(crate) fn orders(&self) -> Orders {
        lock(&self.control).orders()
    }

    /// A new connection: its seat, and its orders, which it has caught up
    /// with. Under the lock, so that a change either waits for it or is in
    /// its orders.
    pub(crate) fn join(&self) -> (u64, Orders) {
        let mut control = lock(&self.control);
        let seat = control.next_seat;
        control.next_seat += 1;
        let epoch = control.epoch;
        control.caught_up.insert(seat, epoch);
        (seat, control.orders())
    }

    /// Connection `seat` has caught up with `epoch`: it follows the orders
    /// of then, and has no request in flight on another node, nor any at
    /// all if they hold it.
    pub(crate) fn caught_up(&self, seat: u64, epoch: u64) {
        lock(&self.control).caught_up.insert(seat, epoch);
        self.caught_up.notify_all();
    }

    /// A connection ended, its requests done.
    pub(crate) fn leave(&self, seat: u64) {
        lock(&self.control).caught_up.remove(&seat);
        self.caught_up.notify_all();
    }

    /// Applies `change` and tells the connections; returns once each has
    /// caught up with it. Only requests in flight can delay that: an idle
    /// connection is woken, and one reading the socket does not block.
    fn change(&self, change: impl FnOnce(&mut Control)) {
        let mut control = lock(&self.control);
        change(&mut control);
        control.epoch += 1;
        let epoch = control.epoch;
        self.epoch.store(epoch, Ordering::Release);
        if let Err(e) = self.changed.write(1) {
            log::error!("NBD export '{}': cannot wake its connections: {e}", self.config.id);
        }
        let behind = |control: &mut Control| control.caught_up.values().any(|&at| at < epoch);
        drop(self.caught_up.wait_while(control, behind).unwrap_or_else(PoisonError::into_inner));
    }

    /// Serves `node` from the next change on; only while connections are
    /// held, so that none has a request in flight on the old node.
    fn set_node(&self, node: Arc<dyn BlockNode>) {
        let mut control = lock(&self.control);
        control.generation += 1;
        control.node = node;
    }

    /// A connection's statistics, counted in the export's from now on.
    pub(crate) fn attach_stats(&self, stats: Arc<QueueStats>) {
        lock(&self.stats).live.push(stats);
    }

    /// A connection that ended: its figures join the export's total.
    pub(crate) fn detach_stats(&self, stats: &Arc<QueueStats>) {
        let mut all = lock(&self.stats);
        all.live.retain(|s| !Arc::ptr_eq(s, stats));
        all.ended.merge(&stats.snapshot());
    }
}

/// An export served by an [`NbdServer`].
#[derive(Clone)]
pub struct NbdExport {
    export: Arc<Export>,
    server: Arc<Shared>,
}

impl NbdServer {
    /// Listens and starts accepting clients; with `tls`, only over TLS.
    pub fn start(config: ServerConfig, tls: Option<Arc<ServerCreds>>) -> Result<Self, NbdError> {
        let addr = config.addr.to_string();
        let error = |source| NbdError::Listen { addr: addr.clone(), source };
        let listener = Listener::bind(&config.addr).map_err(error)?;
        let shared = Arc::new(Shared {
            config,
            tls,
            exports: RwLock::default(),
            conns: Mutex::default(),
            stop: EventFd::new(EFD_NONBLOCK).map_err(error)?,
            ended: EventFd::new(EFD_NONBLOCK).map_err(error)?,
            accept: Mutex::default(),
        });
        let accepting = shared.clone();
        let thread = std::thread::Builder::new()
            .name("vsd-nbd-accept".into())
            .spawn(move || accept_loop(listener, &accepting))
            .map_err(error)?;
        *lock(&shared.accept) = Some(thread);
        Ok(Self { shared })
    }

    /// The server's configuration.
    pub fn config(&self) -> &ServerConfig {
        &self.shared.config
    }

    /// Offers `node` to clients under the export's name.
    pub fn add_export(&self, config: ExportConfig, node: Arc<dyn BlockNode>) -> Result<NbdExport, NbdError> {
        let invalid = |reason: String| NbdError::Invalid { id: config.id.clone(), reason };
        if config.writable && node.read_only() {
            return Err(invalid(format!("node '{}' is read-only; the export cannot be writable", node.name())));
        }
        let info = export_info(&config, &*node, self.shared.config.max_connections != 1);
        let mut exports = self.shared.exports.write().unwrap_or_else(PoisonError::into_inner);
        if exports.contains_key(&config.name) {
            return Err(NbdError::NameTaken { id: config.id.clone(), name: config.name.clone() });
        }
        let bitmaps = exported_bitmaps(&config, &node).map_err(invalid)?;
        let changed = EventFd::new(EFD_NONBLOCK).map_err(|e| invalid(format!("cannot make an eventfd: {e}")))?;
        let control = Control { epoch: 0, generation: 0, node, holds: 0, caught_up: BTreeMap::new(), next_seat: 0 };
        let export = Arc::new(Export {
            config,
            control: Mutex::new(control),
            epoch: AtomicU64::new(0),
            changed,
            caught_up: Condvar::new(),
            info,
            bitmaps,
            closed: AtomicBool::new(false),
            stats: Mutex::default(),
        });
        exports.insert(export.config.name.clone(), export.clone());
        Ok(NbdExport { export, server: self.shared.clone() })
    }

    /// Stops listening and cuts every connection, handshaking or not; their
    /// requests in flight complete first. Exports should be removed first.
    pub fn stop(&self) {
        if let Some(thread) = lock(&self.shared.accept).take() {
            if let Err(e) = self.shared.stop.write(1) {
                log::error!("NBD server: cannot stop accepting: {e}");
            }
            let _ = thread.join();
        }
        // The accepting thread's listener removed its socket file.
        self.shared.cut(|_| true);
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

impl NbdExport {
    /// The export's configuration.
    pub fn config(&self) -> &ExportConfig {
        &self.export.config
    }

    /// The node it serves.
    pub fn node(&self) -> Arc<dyn BlockNode> {
        self.export.node()
    }

    /// Serves `node` instead (a live snapshot's overlay), with the
    /// connections stopped meanwhile: requests in flight complete on the
    /// old node, the next ones go to the new one.
    pub fn replace_node(&self, node: Arc<dyn BlockNode>) {
        self.with_connections_stopped(|| self.export.set_node(node));
    }

    /// Runs `work` with the connections stopped (as
    /// [`Self::with_connections_stopped`]); if it succeeds, serves `node`
    /// from then on (a mirror's switch).
    pub fn replace_node_after<E>(
        &self,
        node: Arc<dyn BlockNode>,
        work: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), E> {
        self.with_connections_stopped(|| {
            work()?;
            self.export.set_node(node);
            Ok(())
        })
    }

    /// Runs `f` with every connection stopped: their requests in flight
    /// complete first, and none is sent to the node until `f` returns
    /// (clients' next requests wait, unread or parsed, to go on after).
    /// Returns once every connection has caught up again.
    pub fn with_connections_stopped<T>(&self, f: impl FnOnce() -> T) -> T {
        let _held = Held::new(&self.export);
        f()
    }

    /// Whether a client is connected to it.
    pub fn has_client(&self) -> bool {
        lock(&self.server.conns).live.values().any(|c| self.serves(c) && !c.client_gone.load(Ordering::Acquire))
    }

    fn serves(&self, conn: &Conn) -> bool {
        matches!(&conn.stage, Stage::Serving(e) if Arc::ptr_eq(e, &self.export))
    }

    /// Every connection's statistics, ended ones summed as one.
    pub fn stats(&self) -> ExportSnapshot {
        let all = lock(&self.export.stats);
        let live = all.live.iter().map(|s| s.snapshot());
        ExportSnapshot::from_queues(std::iter::once(all.ended.clone()).chain(live).collect())
    }

    /// Withdraws the export and cuts its clients; returns once their
    /// requests in flight have completed.
    pub fn stop(&self) {
        self.export.closed.store(true, Ordering::SeqCst);
        let mut exports = self.server.exports.write().unwrap_or_else(PoisonError::into_inner);
        if exports.get(&self.export.config.name).is_some_and(|e| Arc::ptr_eq(e, &self.export)) {
            exports.remove(&self.export.config.name);
        }
        drop(exports);
        self.server.cut(|conn| self.serves(conn));
    }
}

/// Holds an export's connections stopped while it lives (also if the work
/// done meanwhile panics: they must not stay stopped).
struct Held<'a>(&'a Export);

impl<'a> Held<'a> {
    fn new(export: &'a Export) -> Self {
        export.change(|control| control.holds += 1);
        Self(export)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.change(|control| control.holds -= 1);
    }
}

impl Shared {
    /// Cuts the connections `which` selects and waits for their threads.
    fn cut(&self, which: impl Fn(&Conn) -> bool) {
        let threads: Vec<JoinHandle<()>> = lock(&self.conns)
            .live
            .values_mut()
            .filter(|c| which(c))
            .filter_map(|c| {
                c.stream.shutdown();
                c.thread.take()
            })
            .collect();
        for thread in threads {
            let _ = thread.join();
        }
    }

    /// Ties connection `id` to the export it chose, unless the export is
    /// being removed or the connection was dropped; from then on it is
    /// never dropped for a newcomer.
    fn join(&self, id: u64, export: &Arc<Export>) -> io::Result<()> {
        let mut conns = lock(&self.conns);
        let Some(conn) = conns.live.get_mut(&id) else { return Err(io::ErrorKind::NotConnected.into()) };
        if matches!(conn.stage, Stage::Dropped) {
            return Err(dropped());
        }
        conn.stage = Stage::Serving(export.clone());
        // Checked under the lock a removal takes after setting the flag:
        // either it sees this connection or this sees the flag.
        if export.closed.load(Ordering::SeqCst) {
            return Err(io::Error::other(format!("export '{}' is being removed", export.config.id)));
        }
        Ok(())
    }

    fn was_dropped(&self, id: u64) -> bool {
        lock(&self.conns).live.get(&id).is_some_and(|c| matches!(c.stage, Stage::Dropped))
    }
}

fn dropped() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "dropped to admit a newer client")
}

/// How many clients may be negotiating at once: half of `max-connections`
/// (the rest is left to connections past their handshake), or 64 without
/// a limit; at least 16, so that a client opening several connections at
/// once (nbdcopy's four, say) is not dropped under a small limit.
fn handshake_budget(max_connections: u32) -> usize {
    match max_connections {
        0 => 64,
        max => (max as usize / 2).max(16),
    }
}

/// Which unfinished handshake (of `negotiating`, by id: the oldest first)
/// to drop for a newcomer from `newcomer`: the oldest of the source with
/// the most, the newcomer counted. A flooding source loses its own; a
/// newcomer loses none of its own unless its source is the largest.
fn victim(negotiating: &[(u64, Source)], newcomer: Source) -> Option<u64> {
    let mut counts: HashMap<Source, usize> = HashMap::new();
    for &(_, source) in negotiating.iter().chain([&(u64::MAX, newcomer)]) {
        *counts.entry(source).or_default() += 1;
    }
    negotiating.iter().max_by_key(|(id, source)| (counts[source], Reverse(*id))).map(|&(id, _)| id)
}

/// What a client is told about an export.
fn export_info(config: &ExportConfig, node: &dyn BlockNode, multi_conn: bool) -> ExportInfo {
    use tx_flag::*;
    let mut flags = HAS_FLAGS | SEND_FLUSH | SEND_FUA | SEND_CACHE;
    flags |= if config.writable { SEND_TRIM | SEND_WRITE_ZEROES | SEND_FAST_ZERO } else { READ_ONLY };
    // Flushes reach the node, not a connection's cache: they cover every
    // connection's writes, which is what multi-conn promises.
    if multi_conn {
        flags |= CAN_MULTI_CONN;
    }
    // QEMU's request_alignment: smaller requests are bounced, at the
    // cost of a copy and, for writes, a read.
    let min = node.request_alignment();
    ExportInfo {
        name: config.name.clone(),
        description: config.description.clone(),
        // As QEMU: whole sectors only.
        size: node.size() & !511,
        flags,
        block_sizes: [min, min.max(4096), MAX_PAYLOAD as u32],
        bitmaps: config.bitmaps.clone(),
        allocation_depth: config.allocation_depth,
    }
}

/// Takes the bitmaps an export shows, as QEMU: each found on the node or
/// down its backing chain, not busy nor inconsistent, and not recording
/// if clients cannot write but someone else can (the guest).
fn exported_bitmaps(config: &ExportConfig, node: &Arc<dyn BlockNode>) -> Result<Vec<BusyGuard>, String> {
    config
        .bitmaps
        .iter()
        .map(|name| {
            let bitmap = find_bitmap(node, name).ok_or_else(|| format!("Bitmap '{name}' is not found"))?;
            let taken = bitmap.take().map_err(|e| e.to_string())?;
            if !config.writable && !node.read_only() && bitmap.info().recording {
                return Err(format!("Enabled bitmap '{name}' incompatible with readonly export"));
            }
            Ok(taken)
        })
        .collect()
}

fn find_bitmap(node: &Arc<dyn BlockNode>, name: &str) -> Option<Arc<Bitmap>> {
    node.dirty_bitmaps().and_then(|bitmaps| bitmaps.get(name).ok()).or_else(|| {
        let (_, backing) = node.children().into_iter().find(|(role, _)| *role == "backing")?;
        find_bitmap(&backing, name)
    })
}

/// The server's listening socket. A unix socket vsd bound has its path,
/// removed when it stops; a passed one (`addr.type=fd`) is its owner's.
enum Listener {
    Unix(UnixListener, Option<PathBuf>),
    Tcp(TcpListener),
}

impl Listener {
    fn bind(addr: &Address) -> io::Result<Self> {
        let listener = match addr {
            Address::Unix(path) => {
                let listener = vsd_sys::listen_unix(path, 0o600).map_err(|e| match e {
                    ListenError::Io(e) => e,
                    ListenError::InUse => io::Error::other("the socket is in use by another process"),
                    ListenError::NotASocket => io::Error::other("the path exists and is not a socket"),
                    ListenError::NotOwned { uid } => {
                        io::Error::other(format!("a stale socket of user {uid} is there; vsd replaces only its own"))
                    }
                })?;
                Listener::Unix(listener, Some(path.clone()))
            }
            Address::Inet { host, port } => Listener::Tcp(TcpListener::bind((host.as_str(), *port))?),
            Address::Fd(name) => match activation::take_listener(name, &[Family::Unix, Family::Inet])? {
                (fd, Family::Unix) => Listener::Unix(fd.into(), None),
                (fd, Family::Inet) => Listener::Tcp(fd.into()),
            },
        };
        match &listener {
            Listener::Unix(l, _) => l.set_nonblocking(true)?,
            Listener::Tcp(l) => l.set_nonblocking(true)?,
        }
        Ok(listener)
    }

    fn accept(&self) -> io::Result<(Stream, Source)> {
        Ok(match self {
            Listener::Unix(l, _) => {
                let (s, _) = l.accept()?;
                let pid = peer_pid(&s).unwrap_or(0);
                (Stream::Unix(s), Source::Process(pid))
            }
            Listener::Tcp(l) => {
                let (s, peer) = l.accept()?;
                // Replies go out as soon as they are written.
                s.set_nodelay(true)?;
                (Stream::Tcp(s), Source::Host(host_of(peer.ip())))
            }
        })
    }

    fn as_raw_fd(&self) -> i32 {
        match self {
            Listener::Unix(l, _) => l.as_raw_fd(),
            Listener::Tcp(l) => l.as_raw_fd(),
        }
    }
}

/// The pid of the process at the other end of a unix socket.
fn peer_pid(socket: &std::os::unix::net::UnixStream) -> Option<i32> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of the size given.
    let rc = unsafe {
        libc::getsockopt(socket.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&raw mut cred).cast(), &raw mut len)
    };
    (rc == 0).then_some(cred.pid)
}

/// What a TCP peer's address counts as: IPv4 as is, IPv6 by its /64, which
/// one host may fill with addresses.
fn host_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !u128::from(u64::MAX)).into()),
        },
        v4 => v4,
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, Some(path)) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

const TOKEN_LISTEN: u64 = 0;
const TOKEN_STOP: u64 = 1;
const TOKEN_ENDED: u64 = 2;

fn accept_loop(listener: Listener, shared: &Arc<Shared>) {
    if let Err(e) = accept_clients(&listener, shared) {
        log::error!("NBD server: accepting clients failed: {e}");
    }
}

fn accept_clients(listener: &Listener, shared: &Arc<Shared>) -> io::Result<()> {
    let epoll = Epoll::new()?;
    epoll.ctl(ControlOperation::Add, shared.stop.as_raw_fd(), EpollEvent::new(EventSet::IN, TOKEN_STOP))?;
    epoll.ctl(ControlOperation::Add, shared.ended.as_raw_fd(), EpollEvent::new(EventSet::IN, TOKEN_ENDED))?;
    let mut listening = false;
    let mut events = [EpollEvent::default(); 3];
    loop {
        let room = shared.admission(&lock(&shared.conns)).is_some();
        // Without room the listener leaves epoll: clients wait in the backlog.
        if room != listening {
            let op = if room { ControlOperation::Add } else { ControlOperation::Delete };
            epoll.ctl(op, listener.as_raw_fd(), EpollEvent::new(EventSet::IN, TOKEN_LISTEN))?;
            listening = room;
        }
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        for event in &events[..n] {
            match event.data() {
                TOKEN_STOP => return Ok(()),
                TOKEN_ENDED => {
                    let _ = shared.ended.read();
                }
                _ => admit(listener, shared),
            }
        }
    }
}

/// Whether a newcomer may be admitted, as `conns` stand.
enum Admission {
    /// There is room.
    Free,
    /// Only by dropping an unfinished handshake.
    Dropping,
}

impl Shared {
    fn admission(&self, conns: &Conns) -> Option<Admission> {
        let max = self.config.max_connections as usize;
        let (mut active, mut negotiating) = (0, 0);
        for conn in conns.live.values() {
            match conn.stage {
                Stage::Negotiating(_) => (active, negotiating) = (active + 1, negotiating + 1),
                Stage::Serving(_) => active += 1,
                // Its thread is ending.
                Stage::Dropped => {}
            }
        }
        let full = max != 0 && active >= max;
        match (full || negotiating >= handshake_budget(self.config.max_connections), negotiating > 0) {
            (false, _) => Some(Admission::Free),
            (true, true) => Some(Admission::Dropping),
            (true, false) => None,
        }
    }

    /// Drops the unfinished handshake [`victim`] chooses for a newcomer.
    fn drop_one(&self, conns: &mut Conns, newcomer: Source) {
        let negotiating: Vec<(u64, Source)> = conns
            .live
            .iter()
            .filter_map(|(&id, c)| match c.stage {
                Stage::Negotiating(source) => Some((id, source)),
                _ => None,
            })
            .collect();
        let Some(id) = victim(&negotiating, newcomer) else { return };
        let Some(conn) = conns.live.get_mut(&id) else { return };
        if let Stage::Negotiating(source) = conn.stage {
            log::info!("NBD server: too many unfinished handshakes; dropping the oldest from {source}");
        }
        conn.stage = Stage::Dropped;
        conn.stream.shutdown();
    }
}

/// Accepts a client if there is room, dropping an unfinished handshake if
/// it takes that. Under the lock, so that no handshake ends in between.
fn admit(listener: &Listener, shared: &Arc<Shared>) {
    let mut conns = lock(&shared.conns);
    let Some(admission) = shared.admission(&conns) else { return };
    let (stream, source) = match listener.accept() {
        Ok(accepted) => accepted,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
        Err(e) => return log::warn!("NBD server: accept failed: {e}"),
    };
    if let Admission::Dropping = admission {
        shared.drop_one(&mut conns, source);
    }
    start_connection(shared, &mut conns, stream, source);
}

fn start_connection(shared: &Arc<Shared>, conns: &mut Conns, stream: Stream, source: Source) {
    let control = match stream.try_clone() {
        Ok(control) => control,
        Err(e) => return log::warn!("NBD server: refusing a client: {e}"),
    };
    let id = conns.next_id;
    conns.next_id += 1;
    let serving = shared.clone();
    let client_gone = Arc::new(AtomicBool::new(false));
    let gone = client_gone.clone();
    let thread =
        std::thread::Builder::new().name(format!("vsd-nbd-{id}")).spawn(move || serve(&serving, id, stream, &gone));
    match thread {
        Ok(thread) => {
            let stage = Stage::Negotiating(source);
            conns.live.insert(id, Conn { stream: control, stage, client_gone, thread: Some(thread) });
        }
        Err(e) => log::warn!("NBD server: cannot start a thread for a client: {e}"),
    }
}

/// A connection's whole life, on its own thread.
fn serve(shared: &Arc<Shared>, id: u64, stream: Stream, client_gone: &AtomicBool) {
    match handshake(shared, id, &stream) {
        Ok(Handshake { agreement, early, tls }) => {
            let name = agreement.export.config.id.clone();
            if let Err(e) = conn::serve(stream, tls, agreement, &early, client_gone) {
                log::info!("NBD export '{name}': connection closed: {e}");
            }
        }
        // Its drop was logged.
        Err(_) if shared.was_dropped(id) => {}
        Err(e) => log::info!("NBD server: handshake failed: {e}"),
    }
    // The entry is registered by the acceptor before it lets go of the lock.
    lock(&shared.conns).live.remove(&id);
    let _ = shared.ended.write(1);
}

/// The exports, as negotiation looks them up.
struct Offered<'a>(&'a Shared);

impl Catalog for Offered<'_> {
    type Export = Arc<Export>;

    fn find(&self, name: &str) -> Option<(Arc<Export>, ExportInfo)> {
        let exports = self.0.exports.read().unwrap_or_else(PoisonError::into_inner);
        let export = exports.get(name)?.clone();
        // The size as it is now: the node may have been resized.
        let info = ExportInfo { size: export.node().size() & !511, ..export.info.clone() };
        Some((export, info))
    }

    fn list(&self) -> Vec<(String, String)> {
        let exports = self.0.exports.read().unwrap_or_else(PoisonError::into_inner);
        exports.values().map(|e| (e.config.name.clone(), e.config.description.clone())).collect()
    }
}

fn too_long() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "the handshake took too long")
}

/// The end of a handshake that reached the transmission phase.
struct Handshake {
    agreement: Agreement<Arc<Export>>,
    /// Bytes the client sent after it (decrypted, with TLS).
    early: Vec<u8>,
    /// The TLS session, if the client started one.
    tls: Option<ServerConnection>,
}

/// When the handshake must be over; each blocking read or write on the
/// socket gets what is left of it.
struct Deadline(Option<Instant>);

impl Deadline {
    fn arm(&self, stream: &Stream) -> io::Result<()> {
        let Some(deadline) = self.0 else { return Ok(()) };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(too_long());
        }
        stream.set_timeouts(Some(left))
    }
}

/// A socket read or write that timed out ran past the deadline.
fn timed_out(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::WouldBlock { too_long() } else { e }
}

/// The handshake's side of the socket: plain, then maybe TLS.
struct HandshakeWire<'a> {
    stream: &'a Stream,
    deadline: Deadline,
    tls: Option<ServerConnection>,
}

impl HandshakeWire<'_> {
    fn write_all(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        let Some(tls) = &mut self.tls else {
            self.deadline.arm(self.stream)?;
            return (&*self.stream).write_all(bytes).map_err(timed_out);
        };
        while !bytes.is_empty() {
            let n = tls.writer().write(bytes)?;
            bytes = &bytes[n..];
            send_records(tls, self.stream, &self.deadline)?;
        }
        Ok(())
    }

    /// Reads some bytes (decrypted, with TLS); 0 at the end.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(tls) = &mut self.tls else {
            self.deadline.arm(self.stream)?;
            return (&*self.stream).read(buf).map_err(timed_out);
        };
        loop {
            match tls.reader().read(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            // Whatever TLS handshake messages are due go before waiting.
            send_records(tls, self.stream, &self.deadline)?;
            self.deadline.arm(self.stream)?;
            if tls.read_tls(&mut &*self.stream).map_err(timed_out)? == 0 {
                return Ok(0);
            }
            process_records(tls, self.stream, &self.deadline)?;
        }
    }

    /// Starts TLS; `early` is what the client sent after STARTTLS.
    fn start_tls(&mut self, creds: &ServerCreds, mut early: &[u8]) -> io::Result<()> {
        let tls = self.tls.insert(creds.accept()?);
        while !early.is_empty() {
            tls.read_tls(&mut early)?;
            process_records(tls, self.stream, &self.deadline)?;
        }
        Ok(())
    }
}

/// Sends the TLS records rustls has queued.
fn send_records(tls: &mut ServerConnection, stream: &Stream, deadline: &Deadline) -> io::Result<()> {
    while tls.wants_write() {
        deadline.arm(stream)?;
        tls.write_tls(&mut &*stream).map_err(timed_out)?;
    }
    Ok(())
}

fn process_records(tls: &mut ServerConnection, stream: &Stream, deadline: &Deadline) -> io::Result<()> {
    if let Err(e) = tls.process_new_packets() {
        // The alert saying why, if it goes out in time.
        let _ = send_records(tls, stream, deadline);
        return Err(io::Error::new(io::ErrorKind::InvalidData, e));
    }
    Ok(())
}

/// Runs the handshake of connection `id` with blocking I/O under the
/// deadline.
fn handshake(shared: &Shared, id: u64, stream: &Stream) -> io::Result<Handshake> {
    let deadline = Deadline(shared.config.handshake_max.map(|max| Instant::now() + max));
    let mut negotiation = Negotiation::new(Offered(shared), shared.tls.is_some());
    let mut wire = HandshakeWire { stream, deadline, tls: None };
    let mut buf = vec![0u8; 16 << 10];
    // Bytes read and not consumed by the negotiation.
    let mut rest = Vec::new();
    loop {
        let output = negotiation.take_output();
        let outcome = negotiation.outcome();
        if let Some(Ok(agreement)) = &outcome {
            // Serving before the client hears it is, so that it cannot be
            // dropped once it has.
            shared.join(id, &agreement.export)?;
        }
        wire.write_all(&output)?;
        if let Some(outcome) = outcome {
            stream.set_timeouts(None)?;
            let agreement = outcome.map_err(io::Error::other)?;
            return Ok(Handshake { agreement, early: rest, tls: wire.tls });
        }
        if negotiation.take_starttls()
            && let Some(creds) = &shared.tls
        {
            wire.start_tls(creds, &std::mem::take(&mut rest))?;
            continue;
        }
        let n = match wire.read(&mut buf)? {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n => n,
        };
        let used = negotiation.feed(&buf[..n]);
        // Not empty only once the handshake has ended, or STARTTLS came.
        rest = buf[used..n].to_vec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_loses_its_own_oldest_handshake() {
        let (flood, client, other) = (Source::Process(7), Source::Process(8), Source::Process(9));
        let negotiating = [(1, client), (2, flood), (3, flood), (4, other)];
        assert_eq!(victim(&negotiating, other), Some(2), "the largest source's oldest");
        assert_eq!(victim(&negotiating, flood), Some(2));
        // Ties go to the oldest; the newcomer counts for its source.
        assert_eq!(victim(&[(5, client), (6, flood)], flood), Some(6));
        assert_eq!(victim(&[(5, client), (6, flood)], other), Some(5));
        assert_eq!(victim(&[], flood), None);
    }

    #[test]
    fn an_ipv6_host_counts_by_its_64() {
        let host = |s: &str| host_of(s.parse().unwrap());
        assert_eq!(host("2001:db8:1:2:aaaa::1"), host("2001:db8:1:2:bbbb::2"));
        assert_ne!(host("2001:db8:1:2::1"), host("2001:db8:1:3::1"));
        assert_eq!(host("::ffff:192.0.2.1"), host("192.0.2.1"));
        assert_eq!(host("192.0.2.1").to_string(), "192.0.2.1");
    }
}
