//! Byte-range locks on open file descriptions (`F_OFD_SETLK`), as QEMU
//! uses them to tell processes sharing an image what each of them does.
//! They belong to the open file, not the process: a second open of the
//! same file conflicts even within one process, and closing any other
//! descriptor of the file keeps them.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use crate::check;

fn byte(at: u64, kind: libc::c_int) -> io::Result<libc::flock> {
    // SAFETY: flock is plain data; all-zero is a valid value to fill in.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = libc::off_t::try_from(at).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    lock.l_len = 1;
    Ok(lock)
}

/// Takes a shared lock on byte `at` of the file (`locked`), or drops it.
/// Shared locks conflict only with exclusive ones, which nobody takes:
/// taking one does not wait and does not fail for others' locks.
pub fn share_byte(fd: BorrowedFd<'_>, at: u64, locked: bool) -> io::Result<()> {
    let lock = byte(at, if locked { libc::F_RDLCK } else { libc::F_UNLCK })?;
    // SAFETY: F_OFD_SETLK reads the flock, a live local.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_SETLK, &lock) }.into()).map(drop)
}

/// Whether another open file description holds a lock on byte `at` (the
/// probe asks for an exclusive lock, which any shared one but ours would
/// prevent).
pub fn byte_locked_elsewhere(fd: BorrowedFd<'_>, at: u64) -> io::Result<bool> {
    let mut lock = byte(at, libc::F_WRLCK)?;
    // SAFETY: F_OFD_GETLK reads and fills the flock, a live local.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_GETLK, &mut lock) }.into())?;
    Ok(i32::from(lock.l_type) != libc::F_UNLCK)
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::os::fd::AsFd;

    use super::*;

    #[test]
    fn locks_belong_to_the_open_file_not_the_process() {
        let path = std::env::temp_dir().join(format!("vsd-sys-lock-{}", std::process::id()));
        let first = File::options().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        let second = File::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        share_byte(first.as_fd(), 101, true).unwrap();
        assert!(byte_locked_elsewhere(second.as_fd(), 101).unwrap(), "another open sees it");
        assert!(!byte_locked_elsewhere(first.as_fd(), 101).unwrap(), "its own never conflicts");
        assert!(!byte_locked_elsewhere(second.as_fd(), 100).unwrap(), "one byte only");
        share_byte(second.as_fd(), 101, true).unwrap();
        share_byte(first.as_fd(), 101, false).unwrap();
        assert!(!byte_locked_elsewhere(second.as_fd(), 101).unwrap(), "dropped");
        assert!(byte_locked_elsewhere(first.as_fd(), 101).unwrap(), "the other's stays");
    }
}
