//! The QMP monitor: QEMU's machine protocol (`docs/interop/qmp-spec.rst`).
//!
//! ```text
//!  client ── Transport ────▶ JsonStreamer ──▶ Session ──▶ Dispatch::execute
//!         ◀── replies ────────────── Output ◀──────────┘
//!         ◀── events ─────────────── Output ◀── Events::emit
//! ```
//!
//! A connection starts in capabilities negotiation mode, where only
//! `qmp_capabilities` is accepted; the monitor answers that one itself.
//! Each connection has a thread that reads and runs commands, and one that
//! writes what its `Output` queues, so that no emitter waits for a client.

mod events;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod inband;
mod output;
mod pretty;
mod server;
mod session;
mod stream;
mod transport;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub use events::Events;
pub use server::{Monitor, QmpListener, QmpServer, Served};
pub use transport::{Stdio, Transport};

/// A QMP error: class + description, serialized as `{"class": "...", "desc": "..."}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[error("{desc}")]
pub struct QmpError {
    /// What kind of error, for programs.
    pub class: ErrorClass,
    /// What went wrong, for humans.
    pub desc: String,
}

impl QmpError {
    /// An error of class `GenericError`, which is what almost every error is.
    pub fn generic(desc: impl Into<String>) -> Self {
        Self::new(ErrorClass::GenericError, desc)
    }

    /// An error of class `class`.
    pub fn new(class: ErrorClass, desc: impl Into<String>) -> Self {
        Self { class, desc: desc.into() }
    }
}

/// QEMU's error classes, serialized under QEMU's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorClass {
    /// The command does not exist, or cannot run yet.
    CommandNotFound,
    /// The device exists but is not active.
    DeviceNotActive,
    /// No device has that name.
    DeviceNotFound,
    /// KVM lacks a capability the command needs.
    KVMMissingCap,
    /// Any error without a class of its own; also what a class unknown to
    /// vsd, from another server, reads as (`other` must be the last variant).
    #[serde(other)]
    GenericError,
}

/// The QEMU release whose QMP vsd speaks, as the greeting and
/// `query-version` name it, with vsd's own version as the package.
pub fn version() -> Value {
    serde_json::json!({
        "qemu": {"major": 10, "minor": 0, "micro": 0},
        "package": concat!("vsd ", env!("CARGO_PKG_VERSION")),
    })
}

/// What executes commands.
pub trait Dispatch: Send + Sync + 'static {
    /// Runs one command. It is called from connection threads, possibly
    /// concurrently. Unknown names must return `CommandNotFound` "The command
    /// NAME has not been found". A `Null` return is sent as `{}`.
    fn execute(&self, command: &str, arguments: Map<String, Value>) -> Result<Value, QmpError>;

    /// Runs one command out-of-band (`exec-oob`): on the connection's
    /// reading thread, while its in-band commands may be running, so it
    /// must not wait on what they hold. Unknown names must return
    /// `CommandNotFound` as [`Dispatch::execute`] does, others that may
    /// not run so "The command NAME does not support OOB". By default no
    /// command may (and unknown ones read as such).
    fn execute_oob(&self, command: &str, _arguments: Map<String, Value>) -> Result<Value, QmpError> {
        Err(QmpError::generic(format!("The command {command} does not support OOB")))
    }

    /// Called once the successful reply to `command` has been sent (or has
    /// failed to send): `quit`, for one, must not exit before its client
    /// has the reply.
    fn after_reply(&self, _command: &str) {}
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn errors_serialize_with_qemu_names() {
        let error = QmpError::new(ErrorClass::KVMMissingCap, "no");
        assert_eq!(serde_json::to_value(&error).unwrap(), json!({"class": "KVMMissingCap", "desc": "no"}));
        assert_eq!(error.to_string(), "no");
    }

    #[test]
    fn unknown_error_class_reads_as_generic() {
        let error: QmpError = serde_json::from_value(json!({"class": "MigrationExpected", "desc": "x"})).unwrap();
        assert_eq!(error, QmpError::generic("x"));
        let error: QmpError = serde_json::from_value(json!({"class": "DeviceNotActive", "desc": "y"})).unwrap();
        assert_eq!(error.class, ErrorClass::DeviceNotActive);
    }
}
