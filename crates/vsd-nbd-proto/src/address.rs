//! Where an NBD server listens, as QEMU's `SocketAddress` names it.

use std::fmt;
use std::path::PathBuf;

/// A server's socket: `type=unix,path=PATH`, `type=inet,host=H,port=N` or
/// `type=fd,str=FD`.
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
    /// A socket someone else opened and passed: a descriptor number, or
    /// the name socket activation gave it (`str`, as given).
    Fd(String),
}

impl fmt::Display for Address {
    /// As QEMU's messages name it: `'PATH'` or `HOST:PORT`; `fd 'STR'`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Unix(path) => write!(f, "'{}'", path.display()),
            Address::Inet { host, port } => write!(f, "{host}:{port}"),
            Address::Fd(fd) => write!(f, "fd '{fd}'"),
        }
    }
}
