//! Guest flushes that have metadata to write, done on a thread of the
//! node's own: writing the changed tables, with a barrier between each
//! step, blocks, and the queue that asked goes on with its other requests
//! meanwhile (QEMU's qcow2 yields its coroutine the same way). Requests
//! that arrive while a flush runs are served together by the next one,
//! which starts after them, so each covers every write completed before
//! it was asked. The thread starts with the first such flush: an image
//! never flushed with changed metadata costs none.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Waker;
use std::thread::JoinHandle;

use vsd_engine::Completion;
use vsd_qcow2::{CorruptMetadata, Image, ImageIo, SyncIo};

use super::health::Health;
use crate::BlockNode;
use crate::drivers::child::ChildQueue;

/// A queue's flush, handed over.
pub(crate) struct Request {
    pub(crate) image: Arc<Image>,
    pub(crate) health: Arc<Health>,
    /// The guest request's tag, for its completion.
    pub(crate) tag: u32,
    pub(crate) answers: Arc<Answers>,
}

/// Where the flusher answers one queue: the completions, and a waker of
/// the queue's owner (an eventfd in its epoll set).
pub(crate) struct Answers {
    done: Mutex<Vec<Completion>>,
    waker: Waker,
}

impl Answers {
    pub(crate) fn new(waker: Waker) -> Self {
        Self { done: Mutex::default(), waker }
    }

    /// The flushes answered since the last call.
    pub(crate) fn take(&self) -> Vec<Completion> {
        std::mem::take(&mut *self.done.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn post(&self, done: Completion) {
        self.done.lock().unwrap_or_else(PoisonError::into_inner).push(done);
        self.waker.wake_by_ref();
    }
}

/// The node's flushing thread, started by the first request.
pub(crate) struct Flusher {
    file: Arc<dyn BlockNode>,
    data: Option<Arc<dyn BlockNode>>,
    thread: Mutex<Option<(Sender<Request>, JoinHandle<()>)>>,
}

impl Flusher {
    /// A flusher for an image in `file` (its data in `data`, if external).
    pub(crate) fn new(file: Arc<dyn BlockNode>, data: Option<Arc<dyn BlockNode>>) -> Self {
        Self { file, data, thread: Mutex::default() }
    }

    /// Hands `request` to the thread, started if need be; its completion
    /// comes through its answers. If no thread can be started, the request
    /// is given back.
    pub(crate) fn flush(&self, request: Request) -> Result<(), Request> {
        let mut thread = self.thread.lock().unwrap_or_else(PoisonError::into_inner);
        if thread.is_none() {
            let (sender, requests) = channel();
            let (file, data) = (self.file.clone(), self.data.clone());
            let spawned = std::thread::Builder::new().name("vsd-qcow2-flush".into()).spawn(move || {
                serve(&*file, data.as_deref(), requests);
            });
            match spawned {
                Ok(handle) => *thread = Some((sender, handle)),
                Err(e) => {
                    log::warn!("qcow2: cannot start a thread for flushes ({e}); the queue flushes itself");
                    return Err(request);
                }
            }
        }
        let (sender, _) = thread.as_ref().expect("started above");
        // The thread ends only when the sender is dropped (below).
        sender.send(request).map_err(|e| e.0)
    }
}

impl Drop for Flusher {
    fn drop(&mut self) {
        let thread = self.thread.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        if let Some((sender, handle)) = thread {
            drop(sender);
            let _ = handle.join();
        }
    }
}

/// The thread: flushes for whatever requests came, then answers them.
fn serve(file: &dyn BlockNode, data: Option<&dyn BlockNode>, requests: Receiver<Request>) {
    let channels = ChildQueue::open(file, 1, u64::MAX)
        .and_then(|file| Ok((file, data.map(|d| ChildQueue::open(d, 1, u64::MAX)).transpose()?)));
    let mut channels = channels.map_err(|e| log::error!("qcow2: the flushing thread cannot reach the image: {e}"));
    while let Ok(first) = requests.recv() {
        let mut batch = vec![first];
        batch.extend(requests.try_iter());
        // Queues opened at different times may hold different images
        // (the node reopened): one flush per image.
        let mut flushed: Vec<(Arc<Image>, i32)> = Vec::new();
        for request in batch {
            let errno = match flushed.iter().find(|(image, _)| Arc::ptr_eq(image, &request.image)) {
                Some(&(_, errno)) => errno,
                None => {
                    let errno = match &mut channels {
                        Ok((file, data)) => flush(&request, file, data.as_mut()),
                        Err(()) => libc::EIO,
                    };
                    flushed.push((request.image.clone(), errno));
                    errno
                }
            };
            request.answers.post(Completion { tag: request.tag, errno });
        }
    }
}

/// Flushes `request`'s image; its errno (0: done). Corrupt metadata is
/// handled as the queues handle it.
fn flush(request: &Request, file: &mut ChildQueue, data: Option<&mut ChildQueue>) -> i32 {
    let result =
        request.image.flush(&mut ImageIo { meta: file, data: data.map(|d| d as &mut dyn SyncIo), backing: None });
    let Err(e) = result else { return 0 };
    if let Some(what) = CorruptMetadata::of(&e) {
        request.health.corrupted(what, &request.image, file);
    }
    e.raw_os_error().unwrap_or(libc::EIO)
}
