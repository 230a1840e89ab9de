//! Thin wrappers around the Linux system calls vsd makes directly.
//!
//! Every call returns `io::Result`, so callers never look at `errno`
//! themselves, and every `unsafe` block of that kind lives here. Also the
//! few text parsers every tool shares ([`size`], [`parse_cpu_list`]).

#![deny(missing_docs)]

pub mod interrupt;
pub mod size;

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

/// `fallocate(2)` modes used by the engines.
pub mod falloc {
    /// Allocate the range (a plain `fallocate`).
    pub const ALLOCATE: i32 = 0;
    /// Deallocate the range; reads return zeroes afterwards.
    pub const PUNCH_HOLE: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    /// Zero the range, keeping it allocated.
    pub const ZERO_RANGE: i32 = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
}

fn check(ret: libc::c_long) -> io::Result<usize> {
    if ret < 0 { Err(io::Error::last_os_error()) } else { Ok(ret as usize) }
}

/// `fallocate(2)` on `fd`; `mode` is one of [`falloc`].
pub fn fallocate(fd: BorrowedFd<'_>, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    let (offset, len) = (to_off(offset)?, to_off(len)?);
    // SAFETY: fallocate reads no memory of ours; fd is a live borrowed descriptor.
    let ret = unsafe { libc::fallocate(fd.as_raw_fd(), mode, offset, len) };
    check(ret.into()).map(drop)
}

/// Where the data at or after `offset` begins (`lseek(2)` `SEEK_DATA`), or
/// `None` if only a hole is left up to the end of the file. With `hole`,
/// where the hole at or after `offset` begins instead (`SEEK_HOLE`; the
/// end of the file counts as one). File systems without holes report all
/// data.
pub fn seek_data_or_hole(fd: BorrowedFd<'_>, offset: u64, hole: bool) -> io::Result<Option<u64>> {
    let whence = if hole { libc::SEEK_HOLE } else { libc::SEEK_DATA };
    // SAFETY: lseek reads no memory of ours; fd is a live borrowed
    // descriptor. It moves the file offset, which vsd never uses: every
    // transfer is positional.
    let ret = unsafe { libc::lseek(fd.as_raw_fd(), to_off(offset)?, whence) };
    match check(ret) {
        Ok(at) => Ok(Some(at as u64)),
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => Ok(None),
        Err(e) => Err(e),
    }
}

/// `fdatasync(2)`.
pub fn fdatasync(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: fdatasync reads no memory of ours; fd is a live borrowed descriptor.
    let ret = unsafe { libc::fdatasync(fd.as_raw_fd()) };
    check(ret.into()).map(drop)
}

/// `preadv2(2)`: reads into the buffers `iov` names.
///
/// # Safety
/// Every iovec must describe memory that is valid for writes of its length
/// and that nothing else accesses during the call.
pub unsafe fn preadv2(fd: BorrowedFd<'_>, iov: &[libc::iovec], offset: u64, flags: i32) -> io::Result<usize> {
    let offset = to_off(offset)?;
    // SAFETY: the caller guarantees the buffers are writable; the iovec
    // array itself is a live slice.
    let ret = unsafe { libc::preadv2(fd.as_raw_fd(), iov.as_ptr(), iov_count(iov)?, offset, flags) };
    check(ret as libc::c_long)
}

/// `pwritev2(2)`: writes the buffers `iov` names; `flags` may hold `RWF_DSYNC`.
///
/// # Safety
/// Every iovec must describe memory that is valid for reads of its length.
pub unsafe fn pwritev2(fd: BorrowedFd<'_>, iov: &[libc::iovec], offset: u64, flags: i32) -> io::Result<usize> {
    let offset = to_off(offset)?;
    // SAFETY: the caller guarantees the buffers are readable; the iovec
    // array itself is a live slice.
    let ret = unsafe { libc::pwritev2(fd.as_raw_fd(), iov.as_ptr(), iov_count(iov)?, offset, flags) };
    check(ret as libc::c_long)
}

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

/// The size in bytes of a regular file or a block device.
pub fn file_size(file: &File) -> io::Result<u64> {
    let meta = file.metadata()?;
    if !std::os::unix::fs::FileTypeExt::is_block_device(&meta.file_type()) {
        return Ok(meta.len());
    }
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points
    // at a live local.
    let ret = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size) };
    check(ret.into())?;
    Ok(size)
}

/// How a file's data is held, for deciding whether I/O on it can block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Residence {
    /// Opened with O_DIRECT: every transfer waits for the device.
    pub direct: bool,
    /// On a file system that keeps its files in memory (tmpfs, ramfs,
    /// hugetlbfs): transfers never wait for a device.
    pub in_memory: bool,
}

/// Where `file`'s data lives (see [`Residence`]).
pub fn residence(file: &File) -> io::Result<Residence> {
    // SAFETY: F_GETFL on a descriptor the file keeps open.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    check(flags.into())?;
    let mut fs = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: fstatfs fills the statfs structure it is given.
    check(unsafe { libc::fstatfs(file.as_raw_fd(), fs.as_mut_ptr()) }.into())?;
    // SAFETY: fstatfs succeeded, so it initialised the structure.
    let kind = unsafe { fs.assume_init() }.f_type;
    // ramfs' magic number is not in libc (linux/magic.h: RAMFS_MAGIC).
    const IN_MEMORY: [libc::__fsword_t; 3] = [libc::TMPFS_MAGIC, 0x8584_58f6, libc::HUGETLBFS_MAGIC];
    Ok(Residence { direct: flags & libc::O_DIRECT != 0, in_memory: IN_MEMORY.contains(&kind) })
}

/// `_IOR(0x12, 114, size_t)`: the size of a block device in bytes.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

/// Why [`listen_unix`] refused a path.
#[derive(Debug)]
pub enum ListenError {
    /// Something other than a socket is there; it is never replaced.
    NotASocket,
    /// A live process listens there.
    InUse,
    /// A stale socket of another user is there; it is not replaced.
    NotOwned {
        /// Its owner.
        uid: u32,
    },
    /// The host refused (creating, binding, renaming).
    Io(io::Error),
}

/// Listens on a unix socket at `path` whose file has permissions `mode`
/// from the start: it is bound in a private directory (mode 0700), given
/// `mode`, and renamed into place, so nobody can connect in between. A
/// stale socket at `path` is replaced only if this user owns it; a symbolic
/// link is never followed.
pub fn listen_unix(path: &Path, mode: u32) -> Result<UnixListener, ListenError> {
    listen_unix_owned(path, mode, None, None)
}

/// As [`listen_unix`], the socket file also owned by user `owner` and
/// group `group` (`None`: the daemon's own). Like `mode`, ownership is set
/// in the private directory, so the socket never appears at `path` with
/// other permissions. A stale socket owned by `owner` is replaced too: it
/// is what an earlier run with the same options left.
pub fn listen_unix_owned(
    path: &Path,
    mode: u32,
    owner: Option<u32>,
    group: Option<u32>,
) -> Result<UnixListener, ListenError> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(ListenError::NotASocket);
        }
        if UnixStream::connect(path).is_ok() {
            return Err(ListenError::InUse);
        }
        // SAFETY: geteuid cannot fail and touches no memory.
        let ours = meta.uid() == unsafe { libc::geteuid() } || Some(meta.uid()) == owner;
        if !ours {
            return Err(ListenError::NotOwned { uid: meta.uid() });
        }
    }
    static PRIVATE: AtomicUsize = AtomicUsize::new(0);
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let n = PRIVATE.fetch_add(1, Ordering::Relaxed);
    let private = parent.join(format!(".vsd-{}-{n}", std::process::id()));
    std::fs::DirBuilder::new().mode(0o700).create(&private).map_err(ListenError::Io)?;
    let staged = private.join("s");
    let placed = UnixListener::bind(&staged).and_then(|listener| {
        if owner.is_some() || group.is_some() {
            // The path, not the descriptor: fchown on a socket changes the
            // socket, not the file that names it.
            std::os::unix::fs::lchown(&staged, owner, group)?;
        }
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(mode))?;
        std::fs::rename(&staged, path)?;
        Ok(listener)
    });
    let _ = std::fs::remove_file(&staged);
    let _ = std::fs::remove_dir(&private);
    placed.map_err(ListenError::Io)
}

/// A user's ids, as the user database (`/etc/passwd`, NSS) has them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UserIds {
    /// The user id.
    pub uid: u32,
    /// The user's primary group.
    pub gid: u32,
}

/// Looks user `name` up (`getpwnam_r`); `None` if there is no such user.
pub fn user_by_name(name: &str) -> io::Result<Option<UserIds>> {
    let Ok(name) = CString::new(name) else { return Ok(None) };
    // SAFETY: passwd is plain data (ints and pointers); all-zero is valid.
    let mut entry: libc::passwd = unsafe { std::mem::zeroed() };
    let found = with_lookup_buffer(|buf| {
        let mut result = std::ptr::null_mut();
        // SAFETY: name is NUL-terminated; entry, result and buf (of the
        // length passed) are live and only written by the call.
        let ret =
            unsafe { libc::getpwnam_r(name.as_ptr(), &mut entry, buf.as_mut_ptr().cast(), buf.len(), &mut result) };
        (ret, !result.is_null())
    })?;
    Ok(found.then_some(UserIds { uid: entry.pw_uid, gid: entry.pw_gid }))
}

/// Looks group `name` up (`getgrnam_r`); its id, or `None` if there is no
/// such group.
pub fn group_by_name(name: &str) -> io::Result<Option<u32>> {
    let Ok(name) = CString::new(name) else { return Ok(None) };
    // SAFETY: group is plain data (ints and pointers); all-zero is valid.
    let mut entry: libc::group = unsafe { std::mem::zeroed() };
    let found = with_lookup_buffer(|buf| {
        let mut result = std::ptr::null_mut();
        // SAFETY: as in user_by_name, for getgrnam_r.
        let ret =
            unsafe { libc::getgrnam_r(name.as_ptr(), &mut entry, buf.as_mut_ptr().cast(), buf.len(), &mut result) };
        (ret, !result.is_null())
    })?;
    Ok(found.then_some(entry.gr_gid))
}

/// Runs a `get*nam_r` lookup with a scratch buffer for the entry's strings,
/// growing it while the lookup says it is too small; whether an entry was
/// found.
fn with_lookup_buffer(mut lookup: impl FnMut(&mut [u8]) -> (libc::c_int, bool)) -> io::Result<bool> {
    let mut buf = vec![0u8; 1024];
    loop {
        match lookup(&mut buf) {
            (0, found) => return Ok(found),
            // Some NSS modules say "not found" with an error number.
            (libc::ENOENT | libc::ESRCH, _) => return Ok(false),
            (libc::ERANGE, _) if buf.len() < 1 << 20 => buf.resize(buf.len() * 2, 0),
            (err, _) => return Err(io::Error::from_raw_os_error(err)),
        }
    }
}

/// The groups user `name` is a member of, with `gid` (its primary group)
/// among them: what `initgroups(3)` would give it (`getgrouplist`).
pub fn group_list(name: &str, gid: u32) -> io::Result<Vec<u32>> {
    let name = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut groups = vec![0; 32];
    loop {
        let mut count = libc::c_int::try_from(groups.len()).map_err(|_| io::Error::other("too many groups"))?;
        // SAFETY: name is NUL-terminated; groups has room for `count` ids,
        // and count is a live local the call updates.
        let ret = unsafe { libc::getgrouplist(name.as_ptr(), gid, groups.as_mut_ptr(), &mut count) };
        let count = usize::try_from(count).unwrap_or(0);
        if ret >= 0 {
            groups.truncate(count);
            return Ok(groups);
        }
        // Too small: count is how many there are.
        if count <= groups.len() {
            return Err(io::Error::other(format!("getgrouplist for user {name:?} failed")));
        }
        groups.resize(count, 0);
    }
}

/// Becomes user `uid`, group `gid`, with exactly the supplementary
/// `groups`, for good: the real, effective and saved ids all change, and
/// `setuid(0)` is tried afterwards, which must fail.
///
/// Every thread changes, not only the caller: glibc's wrappers have each
/// thread of the process make the same call (POSIX semantics; the kernel
/// changes only the calling thread). Kernel threads of the process, such
/// as io_uring's workers, are not glibc's and keep the ids they started
/// with.
pub fn drop_privileges(uid: u32, gid: u32, groups: &[u32]) -> io::Result<()> {
    // Groups before the user id: changing them takes CAP_SETGID, which
    // leaves with the user id.
    // SAFETY: setgroups reads groups.len() ids from a live slice.
    check(unsafe { libc::setgroups(groups.len(), groups.as_ptr()) }.into())?;
    // SAFETY: setresgid takes no pointers.
    check(unsafe { libc::setresgid(gid, gid, gid) }.into())?;
    // SAFETY: setresuid takes no pointers.
    check(unsafe { libc::setresuid(uid, uid, uid) }.into())?;
    // SAFETY: setuid takes no pointers; it must fail now.
    if unsafe { libc::setuid(0) } == 0 {
        return Err(io::Error::other("setuid(0) still succeeds: the privileges were not dropped"));
    }
    Ok(())
}

/// A list of CPUs such as `0-3,8`: single numbers and inclusive ranges,
/// joined by `separator` (`,` on a command line of its own; `:` inside a
/// QEMU-style option string, where `,` separates the options).
pub fn parse_cpu_list(text: &str, separator: char) -> Result<Vec<usize>, String> {
    let cpu = |t: &str| t.trim().parse::<usize>().map_err(|_| format!("{t:?} is not a CPU number"));
    let mut cpus = Vec::new();
    for part in text.split(separator) {
        let (first, last) = match part.split_once('-') {
            Some((a, b)) => (cpu(a)?, cpu(b)?),
            None => (cpu(part)?, cpu(part)?),
        };
        if first > last {
            return Err(format!("CPU range {part:?} is reversed"));
        }
        cpus.extend(first..=last);
    }
    Ok(cpus)
}

/// The CPUs the calling thread may run on.
pub fn allowed_cpus() -> io::Result<Vec<usize>> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: set is a live cpu_set_t of the size passed.
    let ret = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    check(ret.into())?;
    // SAFETY: CPU_ISSET reads the set, for numbers below CPU_SETSIZE.
    Ok((0..libc::CPU_SETSIZE as usize).filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) }).collect())
}

/// Pins the calling thread to `cpus`.
pub fn set_thread_affinity(cpus: &[usize]) -> io::Result<()> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        if cpu >= libc::CPU_SETSIZE as usize {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "cpu number too large"));
        }
        // SAFETY: cpu is below CPU_SETSIZE, checked above.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: set is a live, initialised cpu_set_t of the size passed.
    let ret = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    check(ret.into()).map(drop)
}

/// Blocks SIGINT and SIGTERM in the calling thread and the threads it
/// starts afterwards, so that [`wait_for_termination`] receives them.
pub fn block_termination_signals() -> io::Result<()> {
    let set = termination_set();
    // SAFETY: `set` is an initialised signal set; the old mask is not wanted.
    let ret = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if ret != 0 {
        return Err(io::Error::from_raw_os_error(ret));
    }
    Ok(())
}

/// Waits for SIGINT or SIGTERM (blocked beforehand) and returns it.
pub fn wait_for_termination() -> io::Result<i32> {
    let set = termination_set();
    let mut signal = 0;
    // SAFETY: both pointers name live locals.
    let ret = unsafe { libc::sigwait(&set, &mut signal) };
    if ret != 0 {
        return Err(io::Error::from_raw_os_error(ret));
    }
    Ok(signal)
}

/// Sends SIGTERM to this process, so that the thread waiting in
/// [`wait_for_termination`] shuts the daemon down as for any other stop.
pub fn raise_termination() {
    // SAFETY: kill takes no pointers.
    unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
}

fn termination_set() -> libc::sigset_t {
    // SAFETY: sigemptyset initialises the zeroed set; sigaddset adds valid
    // signal numbers to it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        set
    }
}

/// Descriptors one peek can return.
const PEEK_MAX_FDS: usize = 8;

/// Reads the start of the next message on a stream socket without
/// consuming it. With `fds`, the descriptors the message carries are
/// returned too: Linux installs copies of them for a peek, while the
/// message keeps its own for whoever reads it.
pub fn peek(sock: BorrowedFd<'_>, buf: &mut [u8], fds: bool) -> io::Result<(usize, Vec<OwnedFd>)> {
    // u64 elements keep the control buffer aligned for cmsghdr.
    let mut control = [0u64; 16];
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE((PEEK_MAX_FDS * size_of::<libc::c_int>()) as u32) } as usize;
    debug_assert!(space <= size_of_val(&control));
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if fds {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space;
    }
    let flags = libc::MSG_PEEK | libc::MSG_CMSG_CLOEXEC;
    // SAFETY: msg points at `iov` (naming `buf`) and `control`, all live
    // locals sized as msg says.
    let n = check(unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, flags) } as libc::c_long)?;
    let mut received = Vec::new();
    // SAFETY: the kernel filled msg's control buffer; the CMSG macros walk
    // it within msg_controllen.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: cmsg points at a header inside the control buffer.
        let header = unsafe { &*cmsg };
        if header.cmsg_level == libc::SOL_SOCKET && header.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: as above; the data of an SCM_RIGHTS message is ints.
            let data = unsafe { libc::CMSG_DATA(cmsg) }.cast::<libc::c_int>();
            // SAFETY: CMSG_LEN(0) only computes a size.
            let count = (header.cmsg_len as usize - unsafe { libc::CMSG_LEN(0) } as usize) / size_of::<libc::c_int>();
            for i in 0..count {
                // SAFETY: the kernel installed these descriptors for us; we
                // own them from here on. Read unaligned: CMSG_DATA need not
                // be aligned for c_int.
                received.push(unsafe { OwnedFd::from_raw_fd(data.add(i).read_unaligned()) });
            }
        }
        // SAFETY: as for CMSG_FIRSTHDR.
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    Ok((n, received))
}

fn to_off(value: u64) -> io::Result<libc::off_t> {
    libc::off_t::try_from(value).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

fn iov_count(iov: &[libc::iovec]) -> io::Result<libc::c_int> {
    libc::c_int::try_from(iov.len()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// A new anonymous file in memory (`memfd_create(2)`, close-on-exec), empty:
/// size it with `set_len`, whose new bytes read as zeroes.
pub fn memfd(name: &str) -> io::Result<File> {
    let name = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `name` is a NUL-terminated string that outlives the call.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    check(libc::c_long::from(fd))?;
    // SAFETY: memfd_create just returned this descriptor; nothing else owns it.
    Ok(unsafe { File::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::fs::OpenOptionsExt;

    #[test]
    fn residence_tells_memory_and_direct_files() {
        let shm = tempfile_in(Path::new("/dev/shm"), 0);
        assert_eq!(residence(&shm).unwrap(), Residence { direct: false, in_memory: true });
        // The source tree is on a disk, whose file system takes O_DIRECT.
        let disk = tempfile_in(Path::new(env!("CARGO_MANIFEST_DIR")), libc::O_DIRECT);
        assert_eq!(residence(&disk).unwrap(), Residence { direct: true, in_memory: false });
    }

    #[test]
    fn punch_hole_reads_back_zeroes() {
        let mut file = tempfile();
        file.write_all(&[0xaa; 8192]).unwrap();
        fallocate(file.as_fd(), falloc::PUNCH_HOLE, 0, 4096).unwrap();
        let mut buf = [0xffu8; 8192];
        let iov = [libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() }];
        // SAFETY: iov names `buf`, a live local array.
        let n = unsafe { preadv2(file.as_fd(), &iov, 0, 0) }.unwrap();
        assert_eq!(n, 8192);
        assert!(buf[..4096].iter().all(|&b| b == 0));
        assert!(buf[4096..].iter().all(|&b| b == 0xaa));
        assert_eq!(file_size(&file).unwrap(), 8192);
    }

    #[test]
    fn cpu_lists_take_numbers_and_ranges() {
        assert_eq!(parse_cpu_list("0-2:5", ':').unwrap(), vec![0, 1, 2, 5]);
        assert_eq!(parse_cpu_list("3", ',').unwrap(), vec![3]);
        assert!(parse_cpu_list("2-1", ',').unwrap_err().contains("reversed"));
        assert!(parse_cpu_list("x", ',').unwrap_err().contains("not a CPU"));
        assert!(parse_cpu_list("1,2", ':').is_err(), "the other separator is not one");
    }

    #[test]
    fn negative_offsets_are_refused() {
        let file = tempfile();
        let err = fallocate(file.as_fd(), falloc::ALLOCATE, u64::MAX, 1).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
    }

    #[test]
    fn peek_returns_copies_of_passed_descriptors() {
        use std::io::Read;
        let (a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let passed = tempfile();
        send_with_fd(&a, b"hello", passed.as_raw_fd());
        let mut buf = [0u8; 2];
        let (n, fds) = peek(b.as_fd(), &mut buf, true).unwrap();
        assert_eq!((n, &buf), (2, b"he"));
        assert_eq!(fds.len(), 1);
        assert_ne!(fds[0].as_raw_fd(), passed.as_raw_fd());
        // The message itself is still there.
        let mut all = [0u8; 5];
        b.read_exact(&mut all).unwrap();
        assert_eq!(&all, b"hello");
    }

    fn send_with_fd(sock: &std::os::unix::net::UnixStream, data: &[u8], fd: i32) {
        let mut control = [0u64; 4];
        let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut _, iov_len: data.len() };
        // SAFETY: as in `peek`: a zeroed msghdr pointing at live locals.
        unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(4) as usize;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(4) as usize;
            libc::CMSG_DATA(cmsg).cast::<i32>().write_unaligned(fd);
            assert_eq!(libc::sendmsg(sock.as_raw_fd(), &msg, 0), data.len() as isize);
        }
    }

    #[test]
    fn sockets_get_their_mode_and_refuse_what_they_must_not_replace() {
        let dir = std::env::temp_dir().join(format!("vsd-sys-listen-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let path = dir.join("a.sock");
        let listener = listen_unix(&path, 0o600).unwrap();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert!(matches!(listen_unix(&path, 0o600), Err(ListenError::InUse)));
        drop(listener);
        let again = listen_unix(&path, 0o660).expect("a stale socket of ours is replaced");
        assert_eq!(std::fs::symlink_metadata(&path).unwrap().permissions().mode() & 0o777, 0o660);
        drop(again);
        let file = dir.join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(listen_unix(&file, 0o600), Err(ListenError::NotASocket)));
        let link = dir.join("link");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(matches!(listen_unix(&link, 0o600), Err(ListenError::NotASocket)), "links are not followed");
        // SAFETY: geteuid touches no memory.
        if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::chown(&path, Some(4321), None).unwrap();
            assert!(matches!(listen_unix(&path, 0o600), Err(ListenError::NotOwned { uid: 4321 })));
        }
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 3, "no private directory left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn users_and_groups_are_looked_up_by_name() {
        assert_eq!(user_by_name("root").unwrap(), Some(UserIds { uid: 0, gid: 0 }));
        assert_eq!(group_by_name("root").unwrap(), Some(0));
        assert_eq!(user_by_name("no-such-user-vsd").unwrap(), None);
        assert_eq!(group_by_name("no-such-group-vsd").unwrap(), None);
        assert_eq!(user_by_name("nul\0inside").unwrap(), None);
        assert!(group_list("root", 0).unwrap().contains(&0), "the primary group is in the list");
    }

    #[test]
    fn sockets_get_their_owner_before_they_appear() {
        // SAFETY: geteuid touches no memory.
        if unsafe { libc::geteuid() } != 0 {
            return; // only root gives files away
        }
        let dir = std::env::temp_dir().join(format!("vsd-sys-owned-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let path = dir.join("a.sock");
        let listener = listen_unix_owned(&path, 0o660, Some(4321), Some(4322)).unwrap();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert_eq!((meta.uid(), meta.gid(), meta.permissions().mode() & 0o777), (4321, 4322, 0o660));
        drop(listener);
        let again = listen_unix_owned(&path, 0o600, Some(4321), None).expect("a stale socket of the owner is replaced");
        drop(again);
        assert!(matches!(listen_unix(&path, 0o600), Err(ListenError::NotOwned { uid: 4321 })));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile() -> File {
        tempfile_in(&std::env::temp_dir(), 0)
    }

    fn tempfile_in(dir: &Path, flags: i32) -> File {
        let path = dir.join(format!("vsd-sys-{}-{:?}", std::process::id(), std::thread::current().id()));
        let file =
            File::options().read(true).write(true).create(true).truncate(true).custom_flags(flags).open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        file
    }
}
