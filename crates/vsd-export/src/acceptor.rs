//! One thread accepts front-ends for every export: an export nobody is
//! connected to costs a listening socket, not a thread (a host runs
//! hundreds of exports, most of them idle at any moment).
//!
//! Each listener is watched one-shot: once a front-end is accepted, the
//! export's connection gets a thread of its own, and its listener is
//! watched again only when that connection ends, so that an export serves
//! one front-end at a time and the next waits in the socket's backlog.

use std::collections::HashMap;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread::JoinHandle;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use crate::Shared;
use crate::device::BlkDevice;

/// An export waiting for, or serving, a front-end.
pub(crate) struct Listening {
    pub(crate) listener: UnixListener,
    pub(crate) device: Arc<BlkDevice>,
    pub(crate) shared: Arc<Shared>,
    /// The thread serving the current front-end, if one was accepted.
    connection: Mutex<Option<JoinHandle<()>>>,
}

impl Listening {
    pub(crate) fn new(listener: UnixListener, device: Arc<BlkDevice>, shared: Arc<Shared>) -> Self {
        Self { listener, device, shared, connection: Mutex::new(None) }
    }

    /// Waits for the thread serving the current front-end, if any, to end
    /// (the caller has cut the connection).
    pub(crate) fn join_connection(&self) {
        let handle = self.connection.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }
}

/// The accepting thread and the exports it listens for, by epoll token.
pub(crate) struct Acceptor {
    epoll: Epoll,
    exports: Mutex<Exports>,
}

#[derive(Default)]
struct Exports {
    by_token: HashMap<u64, Arc<Listening>>,
    next_token: u64,
}

/// What a listener is watched for: one front-end, then not until re-armed.
fn one_shot(token: u64) -> EpollEvent {
    EpollEvent::new(EventSet::IN | EventSet::ONE_SHOT, token)
}

impl Acceptor {
    /// The daemon's acceptor, started by the first export.
    pub(crate) fn get() -> io::Result<&'static Acceptor> {
        static ACCEPTOR: OnceLock<Acceptor> = OnceLock::new();
        // Whether its thread runs: a failure to start it is the starting
        // export's error, and the next export tries again.
        static RUNNING: Mutex<bool> = Mutex::new(false);
        let mut running = RUNNING.lock().unwrap_or_else(PoisonError::into_inner);
        let acceptor = match ACCEPTOR.get() {
            Some(acceptor) => acceptor,
            None => {
                let epoll = Epoll::new()?;
                ACCEPTOR.get_or_init(|| Acceptor { epoll, exports: Mutex::default() })
            }
        };
        if !*running {
            std::thread::Builder::new().name("vsd-accept".into()).spawn(|| acceptor.run())?;
            *running = true;
        }
        Ok(acceptor)
    }

    fn exports(&self) -> MutexGuard<'_, Exports> {
        // Entries are inserted and removed whole.
        self.exports.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts accepting front-ends for `export`; returns its token.
    pub(crate) fn add(&self, export: Listening) -> io::Result<u64> {
        let mut exports = self.exports();
        let token = exports.next_token;
        self.epoll.ctl(ControlOperation::Add, export.listener.as_raw_fd(), one_shot(token))?;
        exports.next_token += 1;
        exports.by_token.insert(token, Arc::new(export));
        Ok(token)
    }

    /// Stops accepting for the export of `token`: no front-end is accepted
    /// for it once this returns. Its current connection, if any, goes on.
    pub(crate) fn remove(&self, token: u64) -> Option<Arc<Listening>> {
        let export = self.exports().by_token.remove(&token)?;
        if let Err(e) = self.epoll.ctl(ControlOperation::Delete, export.listener.as_raw_fd(), EpollEvent::default()) {
            log::warn!("export '{}': cannot stop watching its socket: {e}", export.device.config.id);
        }
        Some(export)
    }

    /// Watches the listener of `token` again, after its connection ended.
    fn rearm(&self, token: u64) {
        let exports = self.exports();
        let Some(export) = exports.by_token.get(&token) else { return };
        if let Err(e) = self.epoll.ctl(ControlOperation::Modify, export.listener.as_raw_fd(), one_shot(token)) {
            log::error!("export '{}': cannot accept front-ends any more: {e}", export.device.config.id);
        }
    }

    fn run(&'static self) {
        let mut events = vec![EpollEvent::default(); 64];
        loop {
            let n = match self.epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    log::error!("accepting front-ends failed: {e}");
                    return;
                }
            };
            for event in &events[..n] {
                self.accept(event.data());
            }
        }
    }

    /// Accepts a front-end of the export of `token` and serves it on a
    /// thread of its own. Under the exports' lock, so that an export being
    /// removed either has its connection thread recorded or gets none.
    fn accept(&'static self, token: u64) {
        let exports = self.exports();
        let Some(export) = exports.by_token.get(&token).cloned() else { return };
        let id = &export.device.config.id;
        let stream = match export.listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) => {
                if e.kind() != io::ErrorKind::WouldBlock {
                    log::error!("export '{id}': accept failed: {e}");
                }
                drop(exports);
                return self.rearm(token);
            }
        };
        log::info!("export '{id}': front-end connected");
        let serving = export.clone();
        let spawned = std::thread::Builder::new().name(format!("vsd-{id}-conn")).spawn(move || {
            crate::serve_connection(stream, serving.device.clone(), &serving.shared);
            log::info!("export '{}': front-end disconnected", serving.device.config.id);
            self.rearm(token);
        });
        match spawned {
            Ok(handle) => *export.connection.lock().unwrap_or_else(PoisonError::into_inner) = Some(handle),
            Err(e) => {
                log::error!("export '{id}': refusing a front-end: {e}");
                drop(exports);
                self.rearm(token);
            }
        }
    }
}
