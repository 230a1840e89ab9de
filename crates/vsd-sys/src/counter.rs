//! Event counters (eventfd, timerfd): how threads and the front-end wake
//! each other.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use crate::check;

/// Reads and resets an eventfd or timerfd counter; 0 if it was not set
/// (when the descriptor is non-blocking).
pub fn read_counter(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut value: u64 = 0;
    // SAFETY: read writes at most 8 bytes into `value`, a live local.
    let ret = unsafe { libc::read(fd.as_raw_fd(), (&raw mut value).cast(), 8) };
    match check(ret as libc::c_long) {
        Ok(_) => Ok(value),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
        Err(e) => Err(e),
    }
}

/// Adds 1 to an eventfd counter, waking whoever waits on it. A counter
/// too full to take it (non-blocking) is already signalled.
pub fn signal_counter(fd: BorrowedFd<'_>) -> io::Result<()> {
    let one: u64 = 1;
    // SAFETY: write reads 8 bytes from `one`, a live local.
    let ret = unsafe { libc::write(fd.as_raw_fd(), (&raw const one).cast(), 8) };
    match check(ret as libc::c_long) {
        Err(e) if e.kind() != io::ErrorKind::WouldBlock => Err(e),
        _ => Ok(()),
    }
}

/// Makes reads and writes of `fd` fail with WouldBlock rather than wait:
/// for counters another process hands over, which it could otherwise
/// leave empty under a reader or full under a writer, holding the thread.
/// The flag belongs to the open file, so the other process sees it too.
pub fn set_nonblocking(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller holds open; F_GETFL and
    // F_SETFL take and return plain integers.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    check(flags.into())?;
    // SAFETY: as above.
    let ret = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) };
    check(ret.into()).map(drop)
}
