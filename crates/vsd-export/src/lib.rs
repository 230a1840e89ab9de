//! vsd's vhost-user-blk export.
//!
//! ```text
//!  front-end (QEMU, libblkio) ── unix socket ──▶ Session (vhost-user messages)
//!                                                   │ starts/stops
//!                         kick eventfd ──▶ Worker thread ──▶ IoQueue per virtqueue ──▶ host
//!                         call eventfd ◀──┘  (queue q: thread q % num-threads)
//! ```
//!
//! One thread accepts front-ends for every export ([`acceptor`]); each
//! export serves one connection at a time, on a thread of its own, and
//! when it closes, its workers finish the requests in flight and the
//! export accepts the next front-end.

#![deny(missing_docs)]

mod acceptor;
mod channel;
mod config;
mod device;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod inflight;
mod iothread;
mod poll;
mod session;
mod worker;

use std::io;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use vhost::vhost_user::BackendReqHandler;
use vsd_block::BlockNode;
use vsd_sys::ListenError;
use vsd_sys::activation::{self, Family};
pub use vsd_trace::ExportSnapshot;

use acceptor::{Acceptor, Listening};
use channel::{BackendChannel, Intercepted};
pub use config::{Address, ExportConfig, MAX_QUEUE_SIZE, MAX_QUEUES};
use device::BlkDevice;
pub use iothread::IoThread;
pub use poll::PollConfig;
use session::Session;

/// Why an export could not start.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// Another process is listening on the socket path.
    #[error("export '{id}': socket '{path}' is in use by another process")]
    SocketInUse {
        /// The export.
        id: String,
        /// The path.
        path: PathBuf,
    },
    /// The path exists and is not a socket: it is never replaced.
    #[error("export '{id}': '{path}' exists and is not a socket")]
    NotASocket {
        /// The export.
        id: String,
        /// The path.
        path: PathBuf,
    },
    /// The socket could not be created or taken over.
    #[error("export '{id}': cannot listen on {addr}")]
    Listen {
        /// The export.
        id: String,
        /// Its socket.
        addr: Address,
        /// The host's answer.
        #[source]
        source: io::Error,
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

/// A running vhost-user-blk export.
pub struct VhostUserBlkExport {
    device: Arc<BlkDevice>,
    shared: Arc<Shared>,
    /// Its token with the acceptor, until it stops.
    accepting: Option<(&'static Acceptor, u64)>,
}

/// What the connection's thread shares with the export's owner.
pub(crate) struct Shared {
    /// Set when the export stops: a front-end accepted just before is not served.
    stopping: AtomicBool,
    /// The front-end being served, if any.
    client: Mutex<Option<Client>>,
}

/// A connected front-end, as the control side sees it.
struct Client {
    /// A second handle on the connection, to cut it (`mode=hard`).
    stream: UnixStream,
    /// The back-end request channel, once the front-end has sent one.
    channel: Option<BackendChannel>,
    /// The connection's rings and workers.
    session: Arc<Mutex<Session>>,
}

impl VhostUserBlkExport {
    /// Binds the socket and starts accepting front-ends. The socket is
    /// ready when this returns. `iothreads` are the I/O threads that
    /// `config.iothreads` names, in that order.
    pub fn start(
        config: ExportConfig,
        node: Arc<dyn BlockNode>,
        iothreads: Vec<Arc<IoThread>>,
    ) -> Result<Self, ExportError> {
        let invalid = |reason: String| ExportError::Invalid { id: config.id.clone(), reason };
        if config.writable && node.read_only() {
            return Err(invalid(format!("node '{}' is read-only; the export cannot be writable", node.name())));
        }
        if node.size() < u64::from(config.logical_block_size) {
            return Err(invalid(format!("node '{}' is smaller than one block", node.name())));
        }
        if !config.cpu_affinity.is_empty() {
            let allowed = vsd_sys::allowed_cpus().unwrap_or_default();
            if let Some(cpu) = config.cpu_affinity.iter().find(|cpu| !allowed.contains(cpu)) {
                return Err(invalid(format!(
                    "cpu-affinity: CPU {cpu} is not available to vsd (it may use {allowed:?})"
                )));
            }
        }
        let listen_error = |source| ExportError::Listen { id: config.id.clone(), addr: config.addr.clone(), source };
        let acceptor = Acceptor::get().map_err(listen_error)?;
        let listener = bind(&config)?;
        let shared = Arc::new(Shared { stopping: AtomicBool::new(false), client: Mutex::default() });
        if !config.iothreads.iter().map(String::as_str).eq(iothreads.iter().map(|io| io.id())) {
            return Err(invalid("the I/O threads given are not the ones the options name".into()));
        }
        let device = Arc::new(BlkDevice::new(config.clone(), node, iothreads));
        let token = match acceptor.add(Listening::new(listener, device.clone(), shared.clone())) {
            Ok(token) => token,
            Err(e) => {
                remove_socket_file(&config.addr);
                return Err(listen_error(e));
            }
        };
        Ok(Self { device, shared, accepting: Some((acceptor, token)) })
    }

    /// The export's configuration.
    pub fn config(&self) -> &ExportConfig {
        &self.device.config
    }

    /// The node it serves.
    pub fn node(&self) -> Arc<dyn BlockNode> {
        self.device.node()
    }

    /// Serves `node` instead (a live snapshot's overlay), with the queues
    /// stopped meanwhile: requests in flight complete on the old node, the
    /// next ones go to the new one.
    pub fn replace_node(&self, node: Arc<dyn BlockNode>) {
        self.with_queues_stopped(|| self.device.set_node(node));
    }

    /// Runs `work` with the queues stopped (as [`Self::with_queues_stopped`]);
    /// if it succeeds, serves `node` from then on (a mirror's switch).
    pub fn replace_node_after<E>(
        &self,
        node: Arc<dyn BlockNode>,
        work: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), E> {
        self.with_queues_stopped(|| {
            work()?;
            self.device.set_node(node);
            Ok(())
        })
    }

    /// Whether a front-end is connected.
    pub fn has_client(&self) -> bool {
        self.shared.client.lock().is_ok_and(|c| c.is_some())
    }

    /// Every queue's statistics, as of now.
    pub fn stats(&self) -> ExportSnapshot {
        self.device.snapshot()
    }

    /// Takes the node's new size and tells the front-end, which re-reads
    /// the config space and tells the guest. Returns the new capacity.
    pub fn capacity_changed(&self) -> io::Result<u64> {
        let capacity = self.device.refresh_capacity();
        // A copy of the channel, written outside the lock: a front-end that
        // does not read it must not hold up the export's other users.
        let channel = {
            let client = self.shared.client.lock().map_err(|_| io::Error::other("client lock poisoned"))?;
            client.as_ref().and_then(|c| c.channel.as_ref()).map(BackendChannel::try_clone).transpose()?
        };
        if let Some(mut channel) = channel {
            channel.config_changed()?;
        }
        Ok(capacity)
    }

    /// Runs `f` with the export's queues stopped: their requests in flight
    /// complete first, and none is taken until `f` returns. Queues of an
    /// inactive node stay stopped after, their requests waiting in the
    /// rings until the node is activated and this is called again.
    pub fn with_queues_stopped<T>(&self, f: impl FnOnce() -> T) -> T {
        let session = self.shared.client.lock().ok().and_then(|client| Some(client.as_ref()?.session.clone()));
        match session {
            Some(session) => session.lock().unwrap_or_else(PoisonError::into_inner).with_queues_stopped(f),
            None => f(),
        }
    }

    /// Stops accepting front-ends, disconnects the one being served (its
    /// requests in flight complete first) and removes the socket file it
    /// bound.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let Some((acceptor, token)) = self.accepting.take() else { return };
        let listening = acceptor.remove(token);
        self.shared.stopping.store(true, Ordering::Relaxed);
        if let Ok(Some(client)) = self.shared.client.lock().as_deref() {
            let _ = client.stream.shutdown(std::net::Shutdown::Both);
        }
        if let Some(listening) = listening {
            listening.join_connection();
        }
        remove_socket_file(&self.config().addr);
    }
}

impl Drop for VhostUserBlkExport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Creates the listening socket with the configured mode, replacing only
/// a stale socket file of this user, or takes over the one passed. It
/// does not block: a front-end gone before it is accepted, or taken by
/// another holder of a passed socket, leaves nothing to wait for.
fn bind(config: &ExportConfig) -> Result<UnixListener, ExportError> {
    let listen_error = |source| ExportError::Listen { id: config.id.clone(), addr: config.addr.clone(), source };
    let listener: UnixListener = match &config.addr {
        Address::Unix(path) => bind_path(config, path)?,
        Address::Fd(name) => activation::take_listener(name, &[Family::Unix]).map_err(listen_error)?.0.into(),
        Address::Inet { .. } => {
            return Err(ExportError::Invalid { id: config.id.clone(), reason: config::UNIX_OR_FD_ONLY.into() });
        }
    };
    listener.set_nonblocking(true).map_err(listen_error)?;
    Ok(listener)
}

fn bind_path(config: &ExportConfig, path: &Path) -> Result<UnixListener, ExportError> {
    let (id, path) = (config.id.clone(), path.to_path_buf());
    let listening = vsd_sys::listen_unix_owned(&path, config.socket_mode, config.socket_owner, config.socket_group);
    listening.map_err(|e| match e {
        ListenError::NotASocket => ExportError::NotASocket { id, path },
        ListenError::InUse => ExportError::SocketInUse { id, path },
        ListenError::NotOwned { uid } => ExportError::Invalid {
            reason: format!("'{}' is a stale socket of user {uid}; vsd replaces only its own", path.display()),
            id,
        },
        ListenError::Io(source) => ExportError::Listen { id, addr: config.addr.clone(), source },
    })
}

/// Removes the socket file vsd bound; a passed socket's file, if it has
/// one, is its owner's.
fn remove_socket_file(addr: &Address) {
    if let Address::Unix(path) = addr {
        let _ = std::fs::remove_file(path);
    }
}

/// Serves one front-end until it disconnects or the export stops.
fn serve_connection(stream: UnixStream, device: Arc<BlkDevice>, shared: &Shared) {
    let id = device.config.id.clone();
    // One handle to cut the connection, one to peek at its messages.
    let (control, peek) = match (stream.try_clone(), stream.try_clone()) {
        (Ok(control), Ok(peek)) => (control, peek),
        (Err(e), _) | (_, Err(e)) => {
            log::error!("export '{id}': refusing a front-end: {e}");
            return;
        }
    };
    let session = Arc::new(Mutex::new(Session::new(device)));
    if !set_client(shared, Some(Client { stream: control, channel: None, session: session.clone() })) {
        return;
    }
    let mut handler = BackendReqHandler::from_stream(stream, session.clone());
    loop {
        match channel::intercept(&peek, &session) {
            Ok(Intercepted::Channel(channel)) => {
                if let Ok(Some(client)) = shared.client.lock().as_deref_mut() {
                    client.channel = Some(channel);
                }
            }
            Ok(Intercepted::Taken) => continue,
            Ok(Intercepted::Nothing) => {}
            Err(e) => log::warn!("export '{id}': cannot look at the next message: {e}"),
        }
        match handler.handle_request() {
            Ok(()) => {}
            Err(vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage) => break,
            Err(e) => {
                // A front-end that breaks the protocol loses its connection;
                // the daemon and other exports carry on.
                log::error!("export '{id}': closing the connection: {e}");
                break;
            }
        }
    }
    set_client(shared, None);
    // Dropping the session stops its workers after their requests complete.
    drop(handler);
    drop(session);
}

/// Records the front-end being served (or none); false if the export is
/// stopping, which the lock orders against [`VhostUserBlkExport::stop`]
/// cutting the recorded one.
fn set_client(shared: &Shared, client: Option<Client>) -> bool {
    let Ok(mut slot) = shared.client.lock() else { return false };
    if client.is_some() && shared.stopping.load(Ordering::Relaxed) {
        return false;
    }
    *slot = client;
    true
}
