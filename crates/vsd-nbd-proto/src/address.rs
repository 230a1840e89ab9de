//! Where an NBD server listens, as QEMU's `SocketAddress` names it.

use std::fmt;
use std::path::PathBuf;

/// A server's socket: `type=unix,path=PATH` or `type=inet,host=H,port=N`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Address {
    /// A unix socket.
    Unix(PathBuf),
    /// A TCP socket.
    Inet {
        /// Host name or address.
        host: String,
        /// Port (a number; QAPI passes it as a string).
        port: u16,
    },
}

impl fmt::Display for Address {
    /// As QEMU's messages name it: `'PATH'` or `HOST:PORT`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Unix(path) => write!(f, "'{}'", path.display()),
            Address::Inet { host, port } => write!(f, "{host}:{port}"),
        }
    }
}
