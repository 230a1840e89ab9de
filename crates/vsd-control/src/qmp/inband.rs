//! Where a connection's in-band requests run once its client enabled
//! out-of-band commands: on a thread of their own, in order, so that the
//! reading thread stays free to answer an `exec-oob` while a command
//! blocks (a `blockdev-add` waiting on a server that does not answer).

use std::io;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::{self, JoinHandle};

use serde_json::Value;

use super::Dispatch;
use super::session::Request;

/// In-band requests that may wait to run. As QEMU's monitor (8), it stops
/// reading a client that queues more, so that it cannot queue without end.
const QUEUE_LEN: usize = 8;

/// Where a connection's replies go.
pub(crate) trait Sink: Send + Sync {
    /// Sends `message`, `negotiated` being the session's state after it,
    /// and returns once it is written.
    fn send(&self, message: &Value, negotiated: bool) -> io::Result<()>;
}

/// Runs `request`, sends its reply and then tells the dispatcher that it
/// went out.
pub(crate) fn respond(request: Request, dispatch: &dyn Dispatch, sink: &dyn Sink) -> io::Result<()> {
    let (reply, succeeded) = request.run(dispatch);
    let sent = sink.send(&reply, true);
    if let Some(command) = succeeded {
        dispatch.after_reply(&command);
    }
    sent
}

/// The thread that runs a connection's in-band requests; dropping it lets
/// the requests queued run, then joins it.
pub(crate) struct InBand {
    requests: Option<SyncSender<Request>>,
    thread: Option<JoinHandle<()>>,
}

impl InBand {
    pub(crate) fn start(name: String, dispatch: Arc<dyn Dispatch>, sink: Arc<dyn Sink>) -> io::Result<Self> {
        let (requests, queue) = sync_channel(QUEUE_LEN);
        let thread = thread::Builder::new().name(name).spawn(move || run(&queue, &*dispatch, &*sink))?;
        Ok(Self { requests: Some(requests), thread: Some(thread) })
    }

    /// Queues `request`, waiting while the queue is full.
    pub(crate) fn push(&self, request: Request) -> io::Result<()> {
        let requests = self.requests.as_ref().expect("requests are taken only when dropped");
        requests.send(request).map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the QMP connection is closed"))
    }
}

/// Runs requests until the connection ends or a reply cannot go out.
fn run(queue: &Receiver<Request>, dispatch: &dyn Dispatch, sink: &dyn Sink) {
    while let Ok(request) = queue.recv() {
        if respond(request, dispatch, sink).is_err() {
            return;
        }
    }
}

impl Drop for InBand {
    fn drop(&mut self) {
        drop(self.requests.take());
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            log::error!("QMP: a command panicked");
        }
    }
}
