//! A connection's writing half.

use std::io::{self, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::{Mutex, MutexGuard, PoisonError};

use serde_json::Value;

/// Where a connection's messages and events go, one whole line at a time so
/// that an event never splits a message.
pub(crate) struct Output {
    state: Mutex<State>,
}

struct State {
    stream: UnixStream,
    /// Capabilities negotiation is complete: events flow.
    negotiated: bool,
}

impl Output {
    pub(crate) fn new(stream: UnixStream) -> Self {
        Self { state: Mutex::new(State { stream, negotiated: false }) }
    }

    /// Sends a message from the session, `negotiated` being the session's
    /// state after it. Both change together so that events start right
    /// after the reply to `qmp_capabilities`: a client can neither miss one
    /// emitted after it read that reply nor see one before.
    pub(crate) fn send(&self, message: &Value, negotiated: bool) -> io::Result<()> {
        let mut state = self.lock();
        state.write_line(&format!("{message}\n"))?;
        state.negotiated = negotiated;
        Ok(())
    }

    /// Sends a serialized event, newline included, if negotiation is complete.
    pub(crate) fn send_event(&self, line: &str) -> io::Result<()> {
        let mut state = self.lock();
        if state.negotiated { state.write_line(line) } else { Ok(()) }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl State {
    /// A failed write may leave part of a line behind, which the client
    /// could not parse past: the connection is shut down.
    fn write_line(&mut self, line: &str) -> io::Result<()> {
        self.stream.write_all(line.as_bytes()).inspect_err(|_| {
            let _ = self.stream.shutdown(Shutdown::Both);
        })
    }
}
