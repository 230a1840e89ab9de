//! The accept thread shared by the QMP and metrics servers.

use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// How long to wait before accepting again after a failure, most likely
/// running out of file descriptors: long enough not to spin.
const RETRY_DELAY: Duration = Duration::from_millis(100);

/// A listening socket.
pub(crate) trait Listener: AsFd + Send + Sync + 'static {
    /// A connection.
    type Stream: Send + 'static;

    /// Waits for the next connection.
    fn accept_stream(&self) -> io::Result<Self::Stream>;
}

impl Listener for UnixListener {
    type Stream = UnixStream;

    fn accept_stream(&self) -> io::Result<UnixStream> {
        self.accept().map(|(stream, _)| stream)
    }
}

impl Listener for TcpListener {
    type Stream = TcpStream;

    fn accept_stream(&self) -> io::Result<TcpStream> {
        self.accept().map(|(stream, _)| stream)
    }
}

/// A thread accepting connections until dropped.
pub(crate) struct AcceptLoop<L: Listener> {
    /// Shared with the thread so that the descriptor stays open, and cannot
    /// be reused, until both are done with it.
    listener: Arc<L>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl<L: Listener> AcceptLoop<L> {
    /// Hands every connection to `serve`, on a thread called `name`.
    pub(crate) fn spawn(name: &str, listener: L, serve: impl FnMut(L::Stream) + Send + 'static) -> io::Result<Self> {
        let listener = Arc::new(listener);
        let stop = Arc::new(AtomicBool::new(false));
        let thread = thread::Builder::new().name(name.to_owned()).spawn({
            let (listener, stop) = (listener.clone(), stop.clone());
            move || accept_until_stopped(&*listener, &stop, serve)
        })?;
        Ok(Self { listener, stop, thread: Some(thread) })
    }
}

fn accept_until_stopped<L: Listener>(listener: &L, stop: &AtomicBool, mut serve: impl FnMut(L::Stream)) {
    loop {
        let accepted = listener.accept_stream();
        if stop.load(Ordering::Acquire) {
            return;
        }
        match accepted {
            Ok(stream) => serve(stream),
            Err(e) => {
                log::warn!("{}: accept failed: {e}", thread::current().name().unwrap_or_default());
                thread::sleep(RETRY_DELAY);
            }
        }
    }
}

impl<L: Listener> Drop for AcceptLoop<L> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // A listening socket that is shut down fails accept(2) with EINVAL,
        // which wakes the thread up to see `stop`.
        if let Err(e) = vsd_sys::socket::shut_down(self.listener.as_fd()) {
            log::error!("cannot stop accepting connections: {e}");
            return;
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
