//! Thin wrappers over the few libc calls the crate needs.

use std::io;
use std::mem::MaybeUninit;
use std::time::Duration;

/// The system page size (4 KiB if it cannot be determined).
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf only reads a configuration value and has no
    // memory-safety preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).ok().filter(|&s| s > 0).unwrap_or(4096)
}

/// Rounds `len` up to a whole number of pages, `None` on overflow.
pub(crate) fn round_up_to_page(len: usize) -> Option<usize> {
    let page = page_size();
    len.checked_add(page - 1).map(|l| l / page * page)
}

/// User plus system CPU time consumed so far by all threads of this process
/// (`getrusage(RUSAGE_SELF)`).
pub(crate) fn process_cpu_time() -> io::Result<Duration> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_to_pages() {
        let page = page_size();
        assert_eq!(round_up_to_page(1), Some(page));
        assert_eq!(round_up_to_page(page), Some(page));
        assert_eq!(round_up_to_page(page + 1), Some(2 * page));
        assert_eq!(round_up_to_page(usize::MAX), None);
    }

    #[test]
    fn cpu_time_is_monotonic() {
        let a = process_cpu_time().expect("getrusage");
        let b = process_cpu_time().expect("getrusage");
        assert!(b >= a);
    }
}
