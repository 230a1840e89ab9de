//! Unix sockets: listening with the right owner and mode from the start,
//! and peeking at a message with the descriptors it carries.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::check;

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

/// Shuts a socket down both ways. On a listening socket, a thread blocked
/// in `accept(2)` on it wakes up with EINVAL: how an accepting thread is
/// told to stop.
pub fn shut_down(sock: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: shutdown(2) touches no memory; `sock` is a live descriptor.
    check(unsafe { libc::shutdown(sock.as_raw_fd(), libc::SHUT_RDWR) }.into()).map(drop)
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

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;

    #[test]
    fn peek_returns_copies_of_passed_descriptors() {
        use std::io::Read;
        let (a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let passed = crate::memfd("vsd-sys-peek").unwrap();
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
}
