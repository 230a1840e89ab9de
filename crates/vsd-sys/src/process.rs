//! The process itself: its page size, the CPU time it has used, and its
//! threads as the kernel describes them.

use std::io;
use std::mem::MaybeUninit;
use std::time::Duration;

/// The system page size (4 KiB if it cannot be determined).
pub fn page_size() -> usize {
    // SAFETY: sysconf only reads a configuration value and has no
    // memory-safety preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).ok().filter(|&s| s > 0).unwrap_or(4096)
}

/// User plus system CPU time consumed so far by all threads of this process
/// (`getrusage(RUSAGE_SELF)`).
pub fn cpu_time() -> io::Result<Duration> {
    let mut usage = MaybeUninit::<libc::rusage>::uninit();
    // SAFETY: `usage` points to writable memory large enough for a
    // `struct rusage`, which getrusage fills completely on success.
    let ret = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: getrusage returned 0, so it initialised `usage`.
    let usage = unsafe { usage.assume_init() };
    Ok(timeval_to_duration(usage.ru_utime) + timeval_to_duration(usage.ru_stime))
}

fn timeval_to_duration(tv: libc::timeval) -> Duration {
    let secs = u64::try_from(tv.tv_sec).unwrap_or(0);
    let micros = u32::try_from(tv.tv_usec).unwrap_or(0);
    Duration::new(secs, micros.saturating_mul(1000))
}

/// One thread of this process as `/proc/self/task/TID/status` describes it.
pub struct ThreadStatus(String);

impl ThreadStatus {
    /// The value of a field (`"Name"`, `"Uid"`, `"CapEff"`...), trimmed;
    /// empty if the kernel does not show it.
    pub fn field(&self, key: &str) -> &str {
        let line = self.0.lines().find_map(|line| line.strip_prefix(key)?.strip_prefix(':'));
        line.unwrap_or_default().trim()
    }
}

/// Every thread of this process now; those that exit meanwhile are left out.
pub fn thread_statuses() -> io::Result<Vec<ThreadStatus>> {
    let mut threads = Vec::new();
    for task in std::fs::read_dir("/proc/self/task")? {
        match std::fs::read_to_string(task?.path().join("status")) {
            Ok(status) => threads.push(ThreadStatus(status)),
            // Gone (ENOENT), or between its exit and its reaping (ESRCH).
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESRCH)) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(threads)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_a_power_of_two_and_cpu_time_only_grows() {
        assert!(page_size().is_power_of_two());
        let a = cpu_time().expect("getrusage");
        let b = cpu_time().expect("getrusage");
        assert!(b >= a);
    }
}
