//! The daemon's stop: SIGINT and SIGTERM, blocked in every thread and
//! waited for by one.

use std::io;

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
