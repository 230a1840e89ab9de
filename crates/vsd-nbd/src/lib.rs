//! vsd's NBD server: block nodes exported over the Network Block Device
//! protocol, as qemu-storage-daemon's `--nbd-server` and `--export type=nbd`.
//!
//! ```text
//!  client ── unix or TCP socket ──▶ accept thread (max-connections, handshake timeout)
//!                                        │ a thread per connection
//!                                        ▼
//!              negotiate.rs (options, bytes in, bytes out) ──▶ conn.rs (transmission:
//!              request slots, IoQueue of its own, batched submits, writev replies)
//!                 │ after NBD_OPT_STARTTLS, both over
//!                 ▼
//!              vsd-net (rustls: X.509 credentials, a session per connection)
//! ```
//!
//! The protocol is written here, not taken from a crate: none implements a
//! server with structured replies, block status and extended headers.
//! [`proto`] and [`negotiate`] do no I/O, so that they can be fed
//! arbitrary bytes in arbitrary chunks (tests, fuzzing).

#![deny(missing_docs)]

pub mod negotiate;
/// The protocol's numbers and layouts, shared with vsd's NBD client.
pub use vsd_nbd_proto as proto;

mod config;
mod conn;
mod server;

pub use config::{Address, ExportConfig, ServerConfig};
pub use server::{NbdError, NbdExport, NbdServer};
pub use vsd_net::{ServerCreds, TlsError};
