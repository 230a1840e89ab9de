//! Error type of the client API.

use std::fmt;
use std::time::Duration;

/// Result alias of the client API.
pub type Result<T> = std::result::Result<T, Error>;

/// The kind of a block request, used in error reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `VIRTIO_BLK_T_IN`.
    Read,
    /// `VIRTIO_BLK_T_OUT`.
    Write,
    /// `VIRTIO_BLK_T_FLUSH`.
    Flush,
    /// `VIRTIO_BLK_T_DISCARD`.
    Discard,
    /// `VIRTIO_BLK_T_WRITE_ZEROES`.
    WriteZeroes,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Discard => "discard",
            Op::WriteZeroes => "write-zeroes",
        })
    }
}

/// Errors of the client API.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A libblkio setup call (connect, property access, start, memory mapping)
    /// failed.
    #[error("{context}: {message} (errno {errno})")]
    Setup {
        /// What was being done.
        context: String,
        /// Positive errno reported by libblkio.
        errno: i32,
        /// libblkio's message.
        message: String,
    },
    /// The device offers `VIRTIO_BLK_F_RO` but the client did not ask for
    /// `read_only`.
    #[error("device is read-only (VIRTIO_BLK_F_RO); connect with read_only = true")]
    DeviceReadOnly,
    /// A request completed with an error status.
    #[error("{op} at offset {offset}, length {len} failed: {message} (errno {errno})")]
    Request {
        /// The request kind.
        op: Op,
        /// Byte offset of the request (0 for flush).
        offset: u64,
        /// Byte length of the request (0 for flush).
        len: u64,
        /// Positive errno taken from the completion's negative `ret`.
        errno: i32,
        /// libblkio's message if it failed the request locally, else the
        /// errno's description.
        message: String,
    },
    /// A request did not complete in time; the queue is now broken.
    #[error("{op} on queue {queue} did not complete within {timeout:?}; the queue is now unusable")]
    Timeout {
        /// The request kind.
        op: Op,
        /// Index of the queue.
        queue: usize,
        /// The timeout that expired.
        timeout: Duration,
    },
    /// The queue saw a timeout or a libblkio failure earlier and cannot be
    /// used any more (a stale completion could be mistaken for a new one).
    #[error("queue {0} is unusable after an earlier timeout or failure")]
    QueueBroken(usize),
    /// An argument was rejected before anything was submitted.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl Error {
    /// The positive errno of a failed setup call or request, if any.
    ///
    /// Timeouts report `ETIME`, broken queues `EIO`, invalid arguments
    /// `EINVAL`, [`Error::DeviceReadOnly`] `EROFS`.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Setup { errno, .. } | Error::Request { errno, .. } => *errno,
            Error::DeviceReadOnly => libc::EROFS,
            Error::Timeout { .. } => libc::ETIME,
            Error::QueueBroken(_) => libc::EIO,
            Error::InvalidArgument(_) => libc::EINVAL,
        }
    }

    /// Wraps a libblkio error with what was being done.
    pub(crate) fn setup(context: impl Into<String>, err: &blkio::Error) -> Self {
        Error::Setup { context: context.into(), errno: err.errno().raw_os_error(), message: err.message().to_owned() }
    }
}

/// Describes a positive errno with the C library's text.
pub(crate) fn errno_text(errno: i32) -> String {
    let text = std::io::Error::from_raw_os_error(errno).to_string();
    // std appends " (os error N)"; the callers print the errno themselves.
    match text.find(" (os error") {
        Some(end) => text[..end].to_owned(),
        None => text,
    }
}
