//! Becoming a daemon as QEMU's `--daemonize` does: the process that was
//! started waits until the daemon says it serves, then exits 0, or 1 if
//! the daemon failed to start (its error already printed on the terminal).

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::check;

/// The daemon's end of the pipe its first parent waits on.
pub struct Detached {
    ready: File,
}

/// Forks twice, with a new session between, so that the daemon is no
/// session leader and never takes a terminal again. The caller's process
/// waits for [`Detached::ready`] and exits with what it says; only the
/// daemon returns. Call it before any thread starts: `fork` copies the
/// calling thread alone.
pub fn daemonize() -> io::Result<Detached> {
    let (waiting, ready) = pipe()?;
    if fork()? != 0 {
        drop(ready);
        std::process::exit(wait_for_daemon(waiting));
    }
    drop(waiting);
    // SAFETY: setsid has no memory-safety preconditions.
    check(unsafe { libc::setsid() }.into())?;
    if fork()? != 0 {
        // The session leader goes; its child, the daemon, holds the pipe.
        std::process::exit(0);
    }
    // SAFETY: umask has no memory-safety preconditions. As QEMU's daemon:
    // what it creates is not written by others.
    unsafe { libc::umask(0o027) };
    Ok(Detached { ready })
}

impl Detached {
    /// Says the daemon serves: its standard input, output and error go to
    /// /dev/null (it has no terminal any more), and the first parent exits
    /// 0. The working directory is the caller's to leave.
    pub fn ready(mut self) -> io::Result<()> {
        let null = File::options().read(true).write(true).open("/dev/null")?;
        for fd in 0..=2 {
            // SAFETY: dup3 only changes the descriptor table; `null` is open.
            check(unsafe { libc::dup3(null.as_raw_fd(), fd, 0) }.into())?;
        }
        self.ready.write_all(&[0])
    }
}

/// The first parent's exit status: 0 once the daemon wrote its zero byte,
/// 1 if the pipe closed first (the daemon exited).
fn wait_for_daemon(mut waiting: File) -> i32 {
    let mut status = [1u8];
    match waiting.read(&mut status) {
        Ok(1) if status[0] == 0 => 0,
        _ => 1,
    }
}

fn fork() -> io::Result<libc::pid_t> {
    // SAFETY: the caller runs no other thread (see `daemonize`), so the
    // child's copy of the address space is consistent.
    let pid = unsafe { libc::fork() };
    check(pid.into()).map(|_| pid)
}

/// A close-on-exec pipe: (read end, write end).
fn pipe() -> io::Result<(File, File)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    check(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }.into())?;
    // SAFETY: pipe2 succeeded, so both descriptors are open and ours.
    let [read, write] = fds.map(|fd| File::from(unsafe { OwnedFd::from_raw_fd(fd) }));
    Ok((read, write))
}
