//! vsd's NBD client: an export on an NBD server (vsd, qemu-storage-daemon,
//! qemu-nbd, nbdkit) read and written as a block device, for QEMU's
//! `driver=nbd`.
//!
//! ```text
//!   queue (per worker thread) ──commands──▶ link.rs: the node's connection thread
//!        ▲                                    │ one socket, non-blocking: sends, reads
//!        └────── Mailbox (completions) ◀──────┘ replies, dials again when it breaks
//! ```
//!
//! The protocol is written here, not taken from a crate: the NBD crates of
//! crates.io block the caller per request, where vsd's queues must submit
//! and reap without waiting. Numbers and layouts come from
//! `vsd-nbd-proto`, which vsd's server shares.

#![deny(missing_docs)]

mod handshake;
mod link;
mod queue;

use std::io;
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

pub use handshake::{Export, HandshakeError};
pub use queue::NbdQueue;
pub use vsd_nbd_proto::Address;
use vsd_net::{ClientCreds, Stream, Wire};

use link::{Command, Data, Shared};
use vsd_engine::Mailbox;
use vsd_nbd_proto::{cmd, cmd_flag};

/// The longest range one block status asks about: a power of two, so
/// aligned to any block size, below 32 bits.
const MAX_STATUS: u64 = 1 << 31;
/// How long a connection's handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Which export to read and write, and how to keep its connection.
#[derive(Clone, Debug)]
pub struct Config {
    /// The server's socket.
    pub server: Address,
    /// The export's name (`export`; QEMU's default is the empty name).
    pub export: String,
    /// `reconnect-delay`: how long requests wait for a broken connection to
    /// come back before they fail (0: they fail at once).
    pub reconnect_delay: Duration,
    /// `tls-creds`: TLS with these credentials, else none.
    pub tls: Option<Tls>,
}

/// A node's TLS: its credentials and the name the server's certificate
/// must hold.
#[derive(Clone, Debug)]
pub struct Tls {
    /// A `tls-creds-x509` object with `endpoint=client`.
    pub creds: Arc<ClientCreds>,
    /// `tls-hostname`, else the host of an inet address; `None` (a unix
    /// socket) checks the certificate's chain but no name, as QEMU does.
    pub hostname: Option<String>,
}

/// Why a node could not reach its export.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The server's socket did not answer, in QEMU's words.
    #[error("Failed to connect to {server}: {source}")]
    Dial {
        /// The socket.
        server: Address,
        /// The host's answer.
        source: io::Error,
    },
    /// The server did not agree to serve the export.
    #[error(transparent)]
    Handshake(#[from] HandshakeError),
    /// The client could not start (a descriptor, a thread).
    #[error("{0}")]
    Io(io::Error),
}

/// A remote export and the connection to it.
pub struct NbdClient {
    shared: Arc<Shared>,
}

impl NbdClient {
    /// Connects and negotiates; the connection's thread runs until the
    /// client and all its queues are gone.
    pub fn connect(config: Config) -> Result<Self, ConnectError> {
        Ok(Self { shared: link::start(config)? })
    }

    /// What the server said about the export.
    pub fn export(&self) -> Export {
        self.shared.export
    }

    /// The `base:allocation` flags (`vsd_nbd_proto::state`) of the bytes
    /// from `offset` and how many of them share those (1 to `len`), as the
    /// server says: `None` if it cannot say (no `base:allocation`, or no
    /// usable extent in its answer).
    ///
    /// Blocks the caller for one round trip, which goes through the
    /// connection's thread with the queues' requests (a job's or the
    /// server's thread asks, not a guest's queue): NBD_CMD_BLOCK_STATUS
    /// with REQ_ONE, as QEMU's client sends it. Fails as a request does
    /// when the connection does not come back, or with EIO when the server's
    /// answer breaks the protocol.
    pub fn block_status(&self, offset: u64, len: u64) -> io::Result<Option<(u64, u32)>> {
        if self.shared.export.allocation_context.is_none() || len == 0 {
            return Ok(None);
        }
        let len = len.min(MAX_STATUS);
        let mailbox = Arc::new(Mailbox::new(1)?);
        let slot = Arc::new(Mutex::new(None));
        let command = Command {
            mailbox: mailbox.clone(),
            tag: 0,
            kind: cmd::BLOCK_STATUS,
            flags: cmd_flag::REQ_ONE,
            offset,
            len: len as u32,
            data: Data::Status(slot.clone()),
            then_flush: false,
        };
        self.shared.send(&mut vec![command]);
        let mut done = Vec::with_capacity(1);
        while mailbox.take(&mut done) == 0 {
            mailbox.wait();
        }
        if done[0].errno != 0 {
            return Err(io::Error::from_raw_os_error(done[0].errno));
        }
        let extent = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
        // A longer extent than asked for is cut to the request, as QEMU does.
        Ok(extent.filter(|&(n, _)| n > 0).map(|(n, flags)| (u64::from(n).min(len), flags)))
    }

    /// A queue for one thread with at most `depth` requests in flight.
    pub fn open_queue(&self, depth: u16) -> io::Result<NbdQueue> {
        NbdQueue::new(self.shared.clone(), depth)
    }
}

impl Drop for NbdClient {
    fn drop(&mut self) {
        self.shared.leave();
    }
}

/// Connects to the server and negotiates the export.
fn dial(config: &Config) -> Result<(Box<dyn Wire>, Export), ConnectError> {
    let dial_error = |source| ConnectError::Dial { server: config.server.clone(), source };
    let stream = connect(&config.server).map_err(dial_error)?;
    stream.set_timeouts(Some(HANDSHAKE_TIMEOUT)).map_err(ConnectError::Io)?;
    Ok(handshake::negotiate(stream, &config.export, config.tls.as_ref())?)
}

fn connect(server: &Address) -> io::Result<Stream> {
    Ok(match server {
        Address::Unix(path) => Stream::Unix(UnixStream::connect(path)?),
        Address::Inet { host, port } => {
            let stream = TcpStream::connect((host.as_str(), *port))?;
            // Requests are small and latency-bound: no Nagle delay.
            stream.set_nodelay(true)?;
            Stream::Tcp(stream)
        }
        // A connected socket serves one connection; the client dials again
        // whenever the server goes away.
        Address::Fd(_) => {
            let why = "vsd's NBD client cannot use a passed socket: it dials the server itself, again after each \
                       disconnect (server.type=unix or inet)";
            return Err(io::Error::new(io::ErrorKind::Unsupported, why));
        }
    })
}
