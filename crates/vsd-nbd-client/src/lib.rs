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
use std::sync::Arc;
use std::time::Duration;

pub use handshake::{Export, HandshakeError};
pub use queue::NbdQueue;
pub use vsd_nbd_proto::Address;
use vsd_net::{ClientCreds, Stream, Wire};

use link::Shared;

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
    })
}
