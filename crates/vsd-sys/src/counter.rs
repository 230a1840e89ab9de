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

/// Adds 1 to an eventfd counter, waking whoever waits on it.
pub fn signal_counter(fd: BorrowedFd<'_>) -> io::Result<()> {
    let one: u64 = 1;
    // SAFETY: write reads 8 bytes from `one`, a live local.
    let ret = unsafe { libc::write(fd.as_raw_fd(), (&raw const one).cast(), 8) };
    check(ret as libc::c_long).map(drop)
}
