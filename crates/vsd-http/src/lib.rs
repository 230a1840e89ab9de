//! Read-only images on a web server, as QEMU's curl driver reads them:
//! the size from a `HEAD`, every read a `Range` request, what a read
//! fetched and the readahead after it kept for the reads that follow.
//!
//! The client is ureq: blocking calls suit a pool of worker threads (the
//! node's queues hand them requests and reap through a [`Mailbox`]), it
//! pools keep-alive connections, and it runs on the workspace's rustls
//! (no OpenSSL); hyper would need an async runtime for the same.
//!
//! [`Mailbox`]: vsd_engine::Mailbox

mod cache;
mod queue;
mod remote;

use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

pub use queue::HttpQueue;
use remote::Remote;

/// QEMU's curl driver has this many transfers at once (`CURL_NUM_STATES`):
/// as many worker threads, and as many readahead buffers.
const TRANSFERS: usize = 8;

/// How to reach an image, with the options of QEMU's curl driver.
#[derive(Clone, Debug)]
pub struct Config {
    /// `url`: `http://` or `https://`.
    pub url: String,
    /// `readahead`: bytes fetched after each read that misses the cache.
    pub readahead: u64,
    /// `timeout`: the longest one transfer may take; zero for no limit.
    pub timeout: Duration,
    /// `sslverify`: check the server's certificate and name.
    pub sslverify: bool,
    /// `cookie` (or the secret `cookie-secret` names): sent with each request.
    pub cookie: Option<String>,
    /// `username` and the `password-secret`'s password: HTTP basic auth.
    pub username: Option<String>,
    pub password: Option<String>,
    /// `proxy-username` and `proxy-password-secret`: for the proxy the
    /// environment names (`https_proxy`, `http_proxy`, `all_proxy`).
    pub proxy_username: Option<String>,
    pub proxy_password: Option<String>,
}

/// Why an image could not be opened, in QEMU's words.
#[derive(Debug, thiserror::Error)]
#[error("CURL: Error opening file: {0}")]
pub struct OpenError(String);

/// One read handed to a worker.
struct Job {
    tag: u32,
    offset: u64,
    len: u64,
    iov: vsd_engine::IoVecs,
    done: Arc<vsd_engine::Mailbox>,
}

/// An open image: its size, and the workers that fetch its bytes. The
/// workers stop once the image and all its queues are dropped.
pub struct Image {
    remote: Arc<Remote>,
    jobs: mpsc::Sender<Job>,
}

impl Image {
    /// Asks the server for the image's size and whether it serves ranges,
    /// and starts the workers.
    pub fn open(config: &Config) -> Result<Self, OpenError> {
        let remote = Arc::new(Remote::open(config)?);
        let (jobs, inbox) = mpsc::channel::<Job>();
        let inbox = Arc::new(Mutex::new(inbox));
        for _ in 0..TRANSFERS {
            let (remote, inbox) = (remote.clone(), inbox.clone());
            std::thread::Builder::new()
                .name("vsd-http".into())
                .spawn(move || work(&remote, &inbox))
                .map_err(|e| OpenError(format!("cannot start a worker thread: {e}")))?;
        }
        Ok(Self { remote, jobs })
    }

    /// The image's size in bytes, as the server gave it at open.
    pub fn size(&self) -> u64 {
        self.remote.size()
    }

    /// A queue for at most `depth` requests in flight.
    pub fn open_queue(&self, depth: u16) -> std::io::Result<HttpQueue> {
        HttpQueue::new(self.jobs.clone(), self.size(), depth)
    }
}

/// A worker: takes reads until every sender is gone.
fn work(remote: &Remote, inbox: &Mutex<mpsc::Receiver<Job>>) {
    loop {
        // A worker that panicked holding the lock left the receiver whole.
        let job = inbox.lock().unwrap_or_else(std::sync::PoisonError::into_inner).recv();
        let Ok(job) = job else { return };
        let errno = match remote.read(job.offset, job.len, &job.iov) {
            Ok(()) => 0,
            Err(e) => {
                log::error!("curl: {e}");
                libc::EIO
            }
        };
        job.done.post(vsd_engine::Completion { tag: job.tag, errno });
    }
}
