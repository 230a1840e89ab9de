//! Mounting a FUSE connection over the file: mount(2) as root, Debian's
//! `fusermount3` (setuid) otherwise, as libfuse does.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

/// A mounted connection: the descriptor of `/dev/fuse` that serves it.
pub(crate) struct Mount {
    pub(crate) fd: OwnedFd,
    path: String,
    /// Mounted by `fusermount3`, which must unmount it too.
    helper: bool,
}

/// The mount options both ways take; `max_read` limits reads as
/// `max_write` (set in `FUSE_INIT`) limits writes.
fn options(allow_other: bool, max_io: usize) -> String {
    let other = if allow_other { ",allow_other" } else { "" };
    format!("default_permissions,max_read={max_io}{other}")
}

/// What `strerror` says of `e`, without Rust's "(os error N)".
pub(crate) fn strerror(e: &io::Error) -> String {
    let text = e.to_string();
    text.split(" (os error").next().unwrap_or(&text).to_string()
}

/// Checks that `path` is a regular file to mount over, in QEMU's words.
/// A FUSE mount left there by a daemon that died (its file answers
/// ENOTCONN) is unmounted first, so that the next start is not blocked.
pub(crate) fn check_mountpoint(path: &str) -> Result<(), String> {
    let mut stat = std::fs::metadata(path);
    if let Err(e) = &stat
        && e.raw_os_error() == Some(libc::ENOTCONN)
    {
        log::warn!("'{path}': a FUSE mount whose daemon is gone; unmounting it");
        unmount(path, !is_root());
        stat = std::fs::metadata(path);
    }
    match stat {
        Err(e) => Err(format!("Failed to stat '{path}': {}", strerror(&e))),
        Ok(m) if !m.is_file() => Err(format!("'{path}' is not a regular file")),
        Ok(_) => Ok(()),
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

impl Mount {
    /// Opens a FUSE connection and mounts it over the file at `path`.
    pub(crate) fn new(path: &str, allow_other: bool, max_io: usize) -> io::Result<Self> {
        let options = options(allow_other, max_io);
        if is_root() {
            let fd = File::options().read(true).write(true).open("/dev/fuse")?.into();
            mount_directly(path, &fd, &options)?;
            Ok(Self { fd, path: path.into(), helper: false })
        } else {
            Ok(Self { fd: fusermount(path, &options)?, path: path.into(), helper: true })
        }
    }

    /// Unmounts it, lazily: files still open keep the connection until
    /// its descriptors close. A file unmounted already is left alone.
    pub(crate) fn unmount(&self) {
        unmount(&self.path, self.helper);
    }
}

fn mount_directly(path: &str, fd: &OwnedFd, options: &str) -> io::Result<()> {
    let mode = std::fs::metadata(path)?.mode() & libc::S_IFMT;
    // SAFETY: getuid and getgid have no preconditions.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let data = format!("fd={},rootmode={mode:o},user_id={uid},group_id={gid},{options}", fd.as_raw_fd());
    let target = CString::new(path).map_err(|_| io::ErrorKind::InvalidInput)?;
    let data = CString::new(data).map_err(|_| io::ErrorKind::InvalidInput)?;
    let flags = libc::MS_NOSUID | libc::MS_NODEV;
    // SAFETY: every pointer is a live NUL-terminated string.
    let ret = unsafe { libc::mount(c"vsd".as_ptr(), target.as_ptr(), c"fuse".as_ptr(), flags, data.as_ptr().cast()) };
    if ret < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// Mounts through `fusermount3`, which opens `/dev/fuse`, mounts it and
/// hands the descriptor back over the socket named by `_FUSE_COMMFD`.
fn fusermount(path: &str, options: &str) -> io::Result<OwnedFd> {
    let (ours, theirs) = UnixStream::pair()?;
    let theirs_fd = theirs.as_raw_fd();
    let mut command = Command::new("fusermount3");
    command.args(["-o", options, "--", path]).env("_FUSE_COMMFD", theirs_fd.to_string());
    // SAFETY: between fork and exec only fcntl runs, which is
    // async-signal-safe; it keeps the socket across exec.
    unsafe {
        command.pre_exec(move || {
            if libc::fcntl(theirs_fd, libc::F_SETFD, 0) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        })
    };
    let output = command.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).output()?;
    drop(theirs);
    if !output.status.success() {
        let said = String::from_utf8_lossy(&output.stderr);
        return Err(io::Error::other(said.trim().strip_prefix("fusermount3: ").unwrap_or(said.trim()).to_string()));
    }
    receive_fd(&ours)
}

/// Receives one descriptor sent with SCM_RIGHTS.
fn receive_fd(socket: &UnixStream) -> io::Result<OwnedFd> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
    // Room for one control message holding one descriptor, aligned for it.
    let mut control = [0u64; 4];
    // SAFETY: an all-zero msghdr is valid; the fields set point to live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = size_of_val(&control);
    // SAFETY: msg describes live buffers of the sizes given.
    if unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: msg was filled by recvmsg; CMSG_FIRSTHDR checks the length.
    let header = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    if header.is_null() {
        return Err(io::Error::other("fusermount3 sent no FUSE descriptor"));
    }
    // SAFETY: a non-null header lies inside `control`.
    let kind = unsafe { ((*header).cmsg_level, (*header).cmsg_type) };
    if kind != (libc::SOL_SOCKET, libc::SCM_RIGHTS) {
        return Err(io::Error::other("fusermount3 sent no FUSE descriptor"));
    }
    // SAFETY: an SCM_RIGHTS message's data is a descriptor now ours.
    Ok(unsafe { OwnedFd::from_raw_fd(std::ptr::read_unaligned(libc::CMSG_DATA(header).cast())) })
}

/// Unmounts the FUSE mount at `path` lazily, itself or through
/// `fusermount3`; nothing mounted there is no error.
fn unmount(path: &str, helper: bool) {
    let result = if helper {
        Command::new("fusermount3").args(["-u", "-z", "-q", "--", path]).status().map(drop)
    } else {
        CString::new(Path::new(path).as_os_str().as_bytes()).map_err(|_| io::ErrorKind::InvalidInput.into()).and_then(
            |target| {
                // SAFETY: target is a live NUL-terminated string.
                let ret = unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) };
                if ret < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
            },
        )
    };
    match result {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
        Err(e) => log::warn!("unmounting '{path}': {e}"),
        Ok(()) => {}
    }
}
