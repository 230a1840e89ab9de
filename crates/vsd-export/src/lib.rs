//! vsd's vhost-user-blk export.
//!
//! ```text
//!  front-end (QEMU, libblkio) ── unix socket ──▶ Session (vhost-user messages)
//!                                                   │ starts/stops
//!                         kick eventfd ──▶ Worker per virtqueue ──▶ IoQueue ──▶ host
//!                         call eventfd ◀──┘
//! ```
//!
//! One connection is served at a time; when it closes, its workers finish
//! the requests in flight and the export accepts the next front-end.

#![deny(missing_docs)]

mod config;
mod device;
pub mod request;
mod session;
mod worker;

use std::io;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use vhost::vhost_user::BackendReqHandler;
use vsd_block::BlockNode;

pub use config::{ExportConfig, MAX_QUEUE_SIZE, MAX_QUEUES};
use device::BlkDevice;
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
    /// The socket could not be created.
    #[error("export '{id}': cannot listen on '{path}'")]
    Listen {
        /// The export.
        id: String,
        /// The path.
        path: PathBuf,
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
    config: ExportConfig,
}

impl VhostUserBlkExport {
    /// Binds the socket and starts accepting front-ends on a thread of its
    /// own. The socket is ready when this returns.
    pub fn start(config: ExportConfig, node: Arc<dyn BlockNode>) -> Result<Self, ExportError> {
        let invalid = |reason: String| ExportError::Invalid { id: config.id.clone(), reason };
        if config.writable && node.read_only() {
            return Err(invalid(format!("node '{}' is read-only; the export cannot be writable", node.name())));
        }
        if node.size() < u64::from(config.logical_block_size) {
            return Err(invalid(format!("node '{}' is smaller than one block", node.name())));
        }
        let listener = bind(&config)?;
        let device = Arc::new(BlkDevice::new(config.clone(), node));
        std::thread::Builder::new()
            .name(format!("vsd-{}-accept", config.id))
            .spawn(move || serve(listener, device))
            .map_err(|source| ExportError::Listen { id: config.id.clone(), path: config.socket.clone(), source })?;
        Ok(Self { config })
    }

    /// The export's configuration.
    pub fn config(&self) -> &ExportConfig {
        &self.config
    }
}

/// Creates the listening socket, replacing only a stale socket file.
fn bind(config: &ExportConfig) -> Result<UnixListener, ExportError> {
    let (id, path) = (config.id.clone(), config.socket.clone());
    if let Ok(meta) = std::fs::symlink_metadata(&path) {
        if !meta.file_type().is_socket() {
            return Err(ExportError::NotASocket { id, path });
        }
        if UnixStream::connect(&path).is_ok() {
            return Err(ExportError::SocketInUse { id, path });
        }
        std::fs::remove_file(&path).map_err(|source| ExportError::Listen {
            id: id.clone(),
            path: path.clone(),
            source,
        })?;
    }
    UnixListener::bind(&path).map_err(|source| ExportError::Listen { id, path, source })
}

fn serve(listener: UnixListener, device: Arc<BlkDevice>) {
    let id = device.config.id.clone();
    for stream in listener.incoming() {
        let stream = match stream {
            Ok(stream) => stream,
            Err(e) => {
                log::error!("export '{id}': accept failed: {e}");
                continue;
            }
        };
        log::info!("export '{id}': front-end connected");
        serve_connection(stream, device.clone());
        log::info!("export '{id}': front-end disconnected");
    }
}

fn serve_connection(stream: UnixStream, device: Arc<BlkDevice>) {
    let id = device.config.id.clone();
    let session = Arc::new(Mutex::new(Session::new(device)));
    let mut handler = BackendReqHandler::from_stream(stream, session.clone());
    loop {
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
    // Dropping the session stops its workers after their requests complete.
    drop(handler);
    drop(session);
}
