//! A connection's writing half: replies and events go into one queue, in
//! order, whole lines only, and the connection's own writer thread sends
//! them. Whoever emits an event never waits for a client's socket; a reply
//! is written before the session goes on (a `quit` takes effect once its
//! reply is out), so only the connection's own threads wait for its
//! client. Once more than [`MAX_QUEUED`] bytes wait for a client, it is
//! disconnected.

use std::collections::VecDeque;
use std::io::{self, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::inband::Sink;
use super::pretty::render;
use super::transport::Transport;

/// The most bytes that may wait for one client: QEMU's monitor keeps all it
/// owes a client; vsd keeps this much, which is thousands of events.
pub(crate) const MAX_QUEUED: usize = 4 << 20;

pub(crate) struct Output {
    state: Mutex<State>,
    /// Wakes the writer: a line is queued, or the connection ends.
    queued: Condvar,
    /// Wakes a reply's sender: lines were written, or the connection ended.
    written: Condvar,
    /// Ends the connection from any thread (the writer may be blocked in a
    /// write, the reader in a read).
    hang_up: Box<dyn Fn() + Send + Sync>,
    /// Messages are pretty-printed (`--monitor pretty=on`).
    pretty: bool,
}

struct State {
    lines: VecDeque<String>,
    /// Bytes in `lines`.
    bytes: usize,
    /// Lines queued and lines written so far.
    queued_lines: u64,
    written_lines: u64,
    /// Capabilities negotiation is complete: events flow.
    negotiated: bool,
    /// Nothing more is queued: the client is done sending; what waits is
    /// still written.
    finishing: bool,
    /// Nothing more is sent: a write failed, too much waited, or the
    /// connection failed.
    closed: bool,
}

impl Output {
    /// The writing half of `stream`, with its writer thread started.
    pub(crate) fn start<T: Transport>(stream: T, name: String, pretty: bool) -> io::Result<Arc<Self>> {
        let state = State {
            lines: VecDeque::new(),
            bytes: 0,
            queued_lines: 0,
            written_lines: 0,
            negotiated: false,
            finishing: false,
            closed: false,
        };
        let handle = stream.duplicate()?;
        let hang_up = Box::new(move || handle.hang_up());
        let output = Arc::new(Self {
            state: Mutex::new(state),
            queued: Condvar::new(),
            written: Condvar::new(),
            hang_up,
            pretty,
        });
        let writer = output.clone();
        thread::Builder::new().name(name).spawn(move || writer.write_all(stream))?;
        Ok(output)
    }

    /// Sends a message from the session, `negotiated` being the session's
    /// state after it, and returns once it is written. Both change together
    /// so that events start right after the reply to `qmp_capabilities`: a
    /// client can neither miss one emitted after it read that reply nor see
    /// one before.
    pub(crate) fn send(&self, message: &Value, negotiated: bool) -> io::Result<()> {
        let mut state = self.lock();
        self.queue(&mut state, render(message, self.pretty))?;
        state.negotiated = negotiated;
        let line = state.queued_lines;
        while state.written_lines < line && !state.closed {
            state = self.written.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
        match state.written_lines >= line {
            true => Ok(()),
            false => Err(io::Error::new(io::ErrorKind::BrokenPipe, "the QMP connection is closed")),
        }
    }

    /// Queues an event if negotiation is complete.
    pub(crate) fn send_event(&self, event: &Value) -> io::Result<()> {
        let mut state = self.lock();
        if state.negotiated { self.queue(&mut state, render(event, self.pretty)) } else { Ok(()) }
    }

    /// The client is done sending: what waits is written, then the
    /// connection ends.
    pub(crate) fn finish(&self) {
        self.lock().finishing = true;
        self.queued.notify_one();
    }

    /// As [`Output::finish`], then waits at most `timeout` for what waits
    /// to be written.
    pub(crate) fn finish_within(&self, timeout: Duration) {
        let mut state = self.lock();
        state.finishing = true;
        self.queued.notify_one();
        let deadline = Instant::now() + timeout;
        while state.written_lines < state.queued_lines && !state.closed {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else { return };
            state = self.written.wait_timeout(state, left).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    /// Ends the connection now: the writer stops, what waited is dropped.
    pub(crate) fn close(&self) {
        let mut state = self.lock();
        self.end(&mut state);
    }

    fn queue(&self, state: &mut State, line: String) -> io::Result<()> {
        if state.closed || state.finishing {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "the QMP connection is closed"));
        }
        if state.bytes + line.len() > MAX_QUEUED {
            log::warn!("QMP: a client left {} bytes unread: disconnected", state.bytes);
            self.end(state);
            return Err(io::Error::new(io::ErrorKind::WouldBlock, "the QMP client stopped reading"));
        }
        state.bytes += line.len();
        state.lines.push_back(line);
        state.queued_lines += 1;
        self.queued.notify_one();
        Ok(())
    }

    fn end(&self, state: &mut State) {
        state.closed = true;
        state.lines.clear();
        state.bytes = 0;
        // Frees the writer from a write and the reader from a read.
        (self.hang_up)();
        self.queued.notify_one();
        self.written.notify_all();
    }

    /// The writer thread: sends the queued lines in order until the
    /// connection ends.
    fn write_all(&self, mut stream: impl Write) {
        loop {
            let line = {
                let mut state = self.lock();
                while state.lines.is_empty() && !state.closed && !state.finishing {
                    state = self.queued.wait(state).unwrap_or_else(PoisonError::into_inner);
                }
                match state.lines.pop_front() {
                    Some(line) if !state.closed => line,
                    _ => return self.end(&mut state),
                }
            };
            // Flushed for standard output, which buffers.
            let written = stream.write_all(line.as_bytes()).and_then(|()| stream.flush());
            let mut state = self.lock();
            state.bytes = state.bytes.saturating_sub(line.len());
            state.written_lines += 1;
            self.written.notify_all();
            if written.is_err() {
                // Part of a line may have gone, which the client could not
                // parse past.
                self.end(&mut state);
                return;
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Sink for Output {
    fn send(&self, message: &Value, negotiated: bool) -> io::Result<()> {
        Output::send(self, message, negotiated)
    }
}
