//! Sockets and TLS for vsd's NBD server and client.
//!
//! ```text
//!   Stream (unix or TCP) ──▶ Wire: what a connection's transmission phase
//!                              speaks on, non-blocking: the socket itself,
//!                              or TlsStream (rustls) over it
//!   ServerCreds / ClientCreds: tls-creds-x509 directories, QEMU's file names
//! ```

#![deny(missing_docs)]

mod stream;
mod tls;

pub use stream::{Stream, Wire};
pub use tls::{ClientCreds, ServerCreds, TlsError, TlsStream};
