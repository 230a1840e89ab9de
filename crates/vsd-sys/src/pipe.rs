//! Pipes and `splice(2)`: moving a file's cached pages to a socket by
//! reference, without copying them through a buffer; and `cachestat(2)`,
//! which says whether a range of a file is in the page cache.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::check;

/// `cachestat(2)`'s number: one number on every architecture (Linux 6.5+);
/// the libc crate does not name it for x86_64.
pub const SYS_CACHESTAT: libc::c_long = 451;

/// A pipe, both ends close-on-exec and non-blocking.
#[derive(Debug)]
pub struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
}

impl Pipe {
    /// A new pipe (`pipe2(2)`, `O_CLOEXEC | O_NONBLOCK`).
    pub fn new() -> io::Result<Self> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: pipe2 writes two descriptors into `fds`, a live local array of two.
        let ret = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) };
        check(ret.into())?;
        // SAFETY: pipe2 just returned these descriptors; nothing else owns them.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        Ok(Self { read, write })
    }

    /// Asks for a capacity of `bytes` (`F_SETPIPE_SZ`) and returns what the
    /// pipe has then: what was granted (the kernel rounds up to a power of
    /// two pages), or, refused (above `/proc/sys/fs/pipe-max-size` for an
    /// unprivileged user, or over the user's pipe quota), what it had.
    pub fn set_capacity(&self, bytes: usize) -> io::Result<usize> {
        let bytes = libc::c_int::try_from(bytes).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: fcntl on a descriptor the pipe owns; F_SETPIPE_SZ takes an int.
        let ret = unsafe { libc::fcntl(self.write.as_raw_fd(), libc::F_SETPIPE_SZ, bytes) };
        if let Ok(granted) = check(ret.into()) {
            return Ok(granted);
        }
        // SAFETY: as above; F_GETPIPE_SZ takes no argument.
        let ret = unsafe { libc::fcntl(self.write.as_raw_fd(), libc::F_GETPIPE_SZ) };
        check(ret.into())
    }

    /// Moves up to `len` bytes of `file` at `offset` into the pipe (by
    /// reference to the file's cached pages), without moving the file's
    /// position; 0 at the end of the file. The pipe being non-blocking,
    /// `WouldBlock` if it is full.
    pub fn fill_from(&self, file: BorrowedFd<'_>, offset: u64, len: usize) -> io::Result<usize> {
        let mut off_in = libc::loff_t::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: splice reads and updates `off_in`, a live local; it
        // touches no other memory of ours, and both descriptors are live.
        let ret = unsafe {
            libc::splice(file.as_raw_fd(), &mut off_in, self.write.as_raw_fd(), std::ptr::null_mut(), len, 0)
        };
        check(ret as libc::c_long)
    }

    /// Moves up to `len` bytes from the pipe to `socket`, without waiting
    /// (`SPLICE_F_NONBLOCK | SPLICE_F_MOVE`): `WouldBlock` when the socket
    /// takes no more (or the pipe is empty).
    pub fn drain_to(&self, socket: BorrowedFd<'_>, len: usize) -> io::Result<usize> {
        let flags = libc::SPLICE_F_NONBLOCK | libc::SPLICE_F_MOVE;
        // SAFETY: splice with no offsets touches no memory of ours; both
        // descriptors are live.
        let ret = unsafe {
            libc::splice(
                self.read.as_raw_fd(),
                std::ptr::null_mut(),
                socket.as_raw_fd(),
                std::ptr::null_mut(),
                len,
                flags,
            )
        };
        check(ret as libc::c_long)
    }

    /// Reads what the pipe holds into `buf` (`WouldBlock` if nothing).
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: read writes at most `buf.len()` bytes into `buf`, a live
        // exclusive slice.
        let ret = unsafe { libc::read(self.read.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        check(ret as libc::c_long)
    }

    /// Writes `buf` into the pipe (`WouldBlock` if it is full).
    pub fn write(&self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: write reads `buf.len()` bytes from `buf`, a live slice.
        let ret = unsafe { libc::write(self.write.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
        check(ret as libc::c_long)
    }

    /// The pipe's read end.
    pub fn read_end(&self) -> BorrowedFd<'_> {
        self.read.as_fd()
    }
}

/// `struct cachestat_range` of `<linux/mman.h>`.
#[repr(C)]
struct CachestatRange {
    off: u64,
    len: u64,
}

/// `struct cachestat` of `<linux/mman.h>`: counts in pages.
#[repr(C)]
#[derive(Default)]
struct Cachestat {
    nr_cache: u64,
    nr_dirty: u64,
    nr_writeback: u64,
    nr_evicted: u64,
    nr_recently_evicted: u64,
}

/// Whether every page of `len` bytes (at least 1) of `file` at `offset`
/// is in the page cache (`cachestat(2)`), so that reading them does not
/// wait for a device. Pages past the end of the file are not. ENOSYS
/// before Linux 6.5; EPERM on a file the caller could not write, on
/// kernels that restrict it so.
pub fn fully_cached(file: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<bool> {
    if len == 0 {
        return Ok(true);
    }
    let page = page_size();
    let pages = (offset + len - 1) / page - offset / page + 1;
    let range = CachestatRange { off: offset, len };
    let mut stat = Cachestat::default();
    let fd = libc::c_uint::try_from(file.as_raw_fd()).map_err(|_| io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: cachestat reads `range` and writes `stat`, live locals laid
    // out as the kernel's structures (#[repr(C)], five and two u64s).
    let ret = unsafe { libc::syscall(SYS_CACHESTAT, fd, &raw const range, &raw mut stat, 0 as libc::c_uint) };
    check(ret)?;
    Ok(stat.nr_cache >= pages)
}

/// The size of a page, which the page cache counts in.
pub fn page_size() -> u64 {
    // SAFETY: sysconf reads no memory of ours.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 { size as u64 } else { 4096 }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::path::Path;

    use super::*;
    use crate::file::tests::{tempfile, tempfile_in};

    #[test]
    fn file_pages_go_through_the_pipe_and_the_position_stays() {
        let mut file = tempfile();
        let data: Vec<u8> = (0..3 * 4096u32).map(|i| (i * 7 + i / 4096) as u8).collect();
        file.write_all(&data).unwrap();
        let pipe = Pipe::new().unwrap();
        let capacity = pipe.set_capacity(1 << 20).unwrap();
        assert!(capacity >= 64 << 10, "{capacity}");
        assert_eq!(pipe.fill_from(file.as_fd(), 100, 5000).unwrap(), 5000);
        let mut out = vec![0u8; 8192];
        assert_eq!(pipe.read(&mut out).unwrap(), 5000);
        assert_eq!(&out[..5000], &data[100..5100]);
        assert_eq!(pipe.read(&mut out).unwrap_err().kind(), io::ErrorKind::WouldBlock, "empty, non-blocking");
        // Past the end: what there is, then nothing.
        assert_eq!(pipe.fill_from(file.as_fd(), 3 * 4096 - 10, 100).unwrap(), 10);
        assert_eq!(pipe.fill_from(file.as_fd(), 3 * 4096, 100).unwrap(), 0);
        assert_eq!(pipe.read(&mut out).unwrap(), 10);
        // SAFETY: lseek with SEEK_CUR 0 only reports the position.
        let position = unsafe { libc::lseek(file.as_raw_fd(), 0, libc::SEEK_CUR) };
        assert_eq!(position, data.len() as i64, "splice with an offset leaves the position alone");
    }

    #[test]
    fn the_pipe_drains_into_a_socket() {
        let mut file = tempfile();
        file.write_all(&[0x5a; 8192]).unwrap();
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let pipe = Pipe::new().unwrap();
        assert_eq!(pipe.fill_from(file.as_fd(), 0, 8192).unwrap(), 8192);
        assert_eq!(pipe.write(b"tail").unwrap(), 4);
        let mut sent = 0;
        while sent < 8196 {
            sent += pipe.drain_to(a.as_fd(), 8196 - sent).unwrap();
        }
        let mut got = vec![0u8; 8196];
        std::io::Read::read_exact(&mut &b, &mut got).unwrap();
        assert!(got[..8192].iter().all(|&x| x == 0x5a));
        assert_eq!(&got[8192..], b"tail");
    }

    #[test]
    fn cachestat_tells_cached_pages() {
        // tmpfs keeps every page in memory: all cached once written.
        let mut file = tempfile_in(Path::new("/dev/shm"), 0);
        file.write_all(&[1u8; 64 << 10]).unwrap();
        match fully_cached(file.as_fd(), 0, 64 << 10) {
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                eprintln!("skipped: no cachestat (Linux < 6.5)");
                return;
            }
            other => assert!(other.unwrap()),
        }
        assert!(fully_cached(file.as_fd(), 100, 4096).unwrap());
        assert!(!fully_cached(file.as_fd(), 60 << 10, 8192).unwrap(), "a page past the end is not cached");
        // O_DIRECT writes on a disk's file system leave nothing cached.
        let disk = tempfile_in(Path::new(env!("CARGO_MANIFEST_DIR")), libc::O_DIRECT);
        let mut buf = vec![0u8; 8192 + 4096];
        let at = buf.as_ptr().align_offset(4096);
        let iov = [libc::iovec { iov_base: buf[at..].as_mut_ptr().cast(), iov_len: 8192 }];
        // SAFETY: iov names 8192 bytes of `buf`, a live local.
        unsafe { crate::pwritev2(disk.as_fd(), &iov, 0, 0) }.unwrap();
        assert!(!fully_cached(disk.as_fd(), 0, 8192).unwrap());
    }
}
