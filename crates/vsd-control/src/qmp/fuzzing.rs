//! Not part of vsd's API: the input side of a QMP connection without its
//! socket, for the fuzz target `qmp_input` in `fuzz/` and for tests that
//! replay what it found. It runs the code a connection runs: the JSON
//! streamer, the session (capabilities negotiation, command checks) and
//! the dispatcher, in that order, one reply per message.

use std::io;
use std::sync::{Arc, Mutex, PoisonError};

use serde_json::Value;

use super::Dispatch;
use super::inband::Sink;
use super::server::Inbound;
use super::stream::JsonStreamer;

/// The longest message a connection accepts.
pub const MAX_VALUE_LEN: usize = super::stream::MAX_VALUE_LEN;

/// The most a connection reads from its client at once.
pub const READ_SIZE: usize = super::server::READ_SIZE;

/// The input side of one connection, as it starts: in capabilities
/// negotiation mode, nothing buffered. In-band commands run on the
/// calling thread even once `oob` is enabled, so that every reply is
/// there when `receive` returns.
pub struct Connection {
    inbound: Inbound,
    replies: Arc<Replies>,
}

/// The replies sent, with the session's negotiation state after each.
#[derive(Default)]
struct Replies(Mutex<Vec<(Value, bool)>>);

impl Sink for Replies {
    fn send(&self, message: &Value, negotiated: bool) -> io::Result<()> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).push((message.clone(), negotiated));
        Ok(())
    }
}

impl Connection {
    /// A connection's input side, with the real limits.
    pub fn new(dispatch: Arc<dyn Dispatch>) -> Self {
        Self::with_input(dispatch, JsonStreamer::default())
    }

    /// The same with messages limited to `max_len` bytes, so that short
    /// inputs reach the limit.
    pub fn with_max_value_len(dispatch: Arc<dyn Dispatch>, max_len: usize) -> Self {
        Self::with_input(dispatch, JsonStreamer::with_max_len(max_len))
    }

    fn with_input(dispatch: Arc<dyn Dispatch>, input: JsonStreamer) -> Self {
        let replies = Arc::new(Replies::default());
        Self { inbound: Inbound::new(dispatch, input, replies.clone(), None), replies }
    }

    /// Takes bytes as read from the client, handing each reply to `send`
    /// with whether the session has negotiated after it.
    pub fn receive(&mut self, bytes: &[u8], mut send: impl FnMut(&Value, bool) -> io::Result<()>) -> io::Result<()> {
        self.inbound.receive(bytes)?;
        let replies = std::mem::take(&mut *self.replies.0.lock().unwrap_or_else(PoisonError::into_inner));
        replies.into_iter().try_for_each(|(reply, negotiated)| send(&reply, negotiated))
    }

    /// Bytes of input held for a message not complete yet.
    pub fn buffered(&self) -> usize {
        self.inbound.buffered()
    }
}
