//! Not part of vsd's API: the input side of a QMP connection without its
//! socket, for the fuzz target `qmp_input` in `fuzz/` and for tests that
//! replay what it found. It runs the code a connection runs: the JSON
//! streamer, the session (capabilities negotiation, command checks) and
//! the dispatcher, in that order, one reply per message.

use std::io;
use std::sync::Arc;

use serde_json::Value;

use super::Dispatch;
use super::server::Inbound;
use super::stream::JsonStreamer;

/// The longest message a connection accepts.
pub const MAX_VALUE_LEN: usize = super::stream::MAX_VALUE_LEN;

/// The most a connection reads from its client at once.
pub const READ_SIZE: usize = super::server::READ_SIZE;

/// The input side of one connection, as it starts: in capabilities
/// negotiation mode, nothing buffered.
pub struct Connection(Inbound);

impl Connection {
    /// A connection's input side, with the real limits.
    pub fn new(dispatch: Arc<dyn Dispatch>) -> Self {
        Self(Inbound::new(dispatch, JsonStreamer::default()))
    }

    /// The same with messages limited to `max_len` bytes, so that short
    /// inputs reach the limit.
    pub fn with_max_value_len(dispatch: Arc<dyn Dispatch>, max_len: usize) -> Self {
        Self(Inbound::new(dispatch, JsonStreamer::with_max_len(max_len)))
    }

    /// Takes bytes as read from the client, handing each reply to `send`
    /// with whether the session has negotiated after it.
    pub fn receive(&mut self, bytes: &[u8], send: impl FnMut(&Value, bool) -> io::Result<()>) -> io::Result<()> {
        self.0.receive(bytes, send)
    }

    /// Bytes of input held for a message not complete yet.
    pub fn buffered(&self) -> usize {
        self.0.buffered()
    }
}
