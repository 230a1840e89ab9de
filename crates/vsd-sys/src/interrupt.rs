//! Interrupting a thread blocked in a system call: a signal whose handler
//! does nothing, installed without `SA_RESTART`, so that the call it lands
//! in fails with EINTR and the thread can look at why it was woken.

use std::io;
use std::os::unix::thread::JoinHandleExt;
use std::sync::OnceLock;
use std::thread::JoinHandle;

/// The signal, installed for the whole process on first use; `None` if the
/// handler could not be installed.
fn interrupting_signal() -> Option<libc::c_int> {
    static SIGNAL: OnceLock<Option<libc::c_int>> = OnceLock::new();
    *SIGNAL.get_or_init(|| {
        extern "C" fn interrupted(_: libc::c_int) {}
        // Real-time signals above those glibc and the Rust runtime use.
        let signal = libc::SIGRTMIN() + 4;
        // SAFETY: a zeroed sigaction is valid; the handler does nothing,
        // which is async-signal-safe; the mask is initialised.
        let installed = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = interrupted as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut()) == 0
        };
        installed.then_some(signal)
    })
}

fn installed() -> io::Result<libc::c_int> {
    interrupting_signal().ok_or_else(|| io::Error::other("cannot install the interrupting signal's handler"))
}

/// Installs the handler now, before any thread may need interrupting.
pub fn prepare_interrupts() -> io::Result<()> {
    installed().map(drop)
}

/// Interrupts the system call `thread` is blocked in, if any: it fails with
/// EINTR. A thread that is not in one only runs the empty handler.
pub fn interrupt<T>(thread: &JoinHandle<T>) -> io::Result<()> {
    let signal = installed()?;
    // SAFETY: the handle is not joined (we borrow it), so the thread's id
    // is valid; the signal's handler is installed.
    let ret = unsafe { libc::pthread_kill(thread.as_pthread_t(), signal) };
    if ret == 0 { Ok(()) } else { Err(io::Error::from_raw_os_error(ret)) }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::unix::net::UnixStream;
    use std::sync::mpsc;

    use super::*;

    #[test]
    fn a_thread_blocked_in_a_read_is_woken_with_eintr() {
        prepare_interrupts().unwrap();
        let (mut quiet, _other) = UnixStream::pair().unwrap();
        let (tx, rx) = mpsc::channel();
        let blocked = std::thread::spawn(move || {
            let result = quiet.read(&mut [0u8; 1]);
            tx.send(result.map_err(|e| e.kind())).unwrap();
        });
        // Until it answers, it may not have reached the read yet: retry.
        let answer = loop {
            interrupt(&blocked).unwrap();
            if let Ok(answer) = rx.recv_timeout(std::time::Duration::from_millis(20)) {
                break answer;
            }
        };
        assert_eq!(answer, Err(io::ErrorKind::Interrupted));
        blocked.join().unwrap();
    }
}
