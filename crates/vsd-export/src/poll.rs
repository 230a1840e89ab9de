//! How long a queue worker polls before it sleeps.
//!
//! Polling saves the guest a kick and the worker a wake-up (25-30 µs when
//! the kick comes from another CPU on these machines), but burns a CPU
//! while it waits. The window adapts as QEMU's iothreads adapt theirs
//! (`poll-max-ns`, `poll-grow`, `poll-shrink`): after a sleep, if the
//! work came later than the window but within the ceiling, the window
//! doubles (from 4 µs); if it came later than the ceiling, the window
//! halves, down to nothing. An idle queue therefore stops polling after a
//! few sleeps and costs no CPU.
//!
//! A thread polls only while the daemon's worker threads awake are no
//! more than its CPUs ([`Awake`]): with more, the CPU a poller spins on is
//! one another thread with work waiting needs (8 busy exports on one CPU,
//! say), and a sleep costs less than the wait it causes.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Worker threads of the daemon that are not asleep in their epoll.
static AWAKE: AtomicUsize = AtomicUsize::new(0);
/// The CPUs the daemon may run on, as it started.
static CPUS: OnceLock<usize> = OnceLock::new();

/// A worker thread counted as awake for as long as this lives, except
/// within [`Awake::asleep`].
pub(crate) struct Awake(());

impl Awake {
    /// Counts the calling thread in. The first call learns the daemon's
    /// CPUs, so it must come before any thread pins itself: from the
    /// thread that starts workers, not from a worker.
    pub(crate) fn count_in() -> Self {
        CPUS.get_or_init(|| vsd_sys::allowed_cpus().map_or(1, |cpus| cpus.len().max(1)));
        AWAKE.fetch_add(1, Ordering::Relaxed);
        Self(())
    }

    /// Runs `sleep` (the epoll wait) counted out.
    pub(crate) fn asleep<T>(&self, sleep: impl FnOnce() -> T) -> T {
        AWAKE.fetch_sub(1, Ordering::Relaxed);
        let out = sleep();
        AWAKE.fetch_add(1, Ordering::Relaxed);
        out
    }

    /// Whether more worker threads are awake than the daemon has CPUs.
    pub(crate) fn crowded(&self) -> bool {
        AWAKE.load(Ordering::Relaxed) > CPUS.get().copied().unwrap_or(1)
    }
}

impl Drop for Awake {
    fn drop(&mut self) {
        AWAKE.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The first window, once growing starts.
const FIRST_WINDOW_NS: u64 = 4_000;

/// How a queue polls, in QEMU's iothread terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PollConfig {
    /// The longest window (`poll-max-ns`); 0: never poll.
    pub max_ns: u64,
    /// What the window is multiplied by when it grows (`poll-grow`, 0: 2).
    pub grow: u64,
    /// What it is divided by when it shrinks (`poll-shrink`, 0: 2).
    pub shrink: u64,
}

impl PollConfig {
    /// An export's `poll-us`, with the default factors.
    pub fn up_to_us(max_us: u32) -> Self {
        Self { max_ns: u64::from(max_us) * 1000, grow: 0, shrink: 0 }
    }
}

/// A worker's polling window, in nanoseconds.
#[derive(Debug)]
pub(crate) struct PollWindow {
    window_ns: u64,
    max_ns: u64,
    grow: u64,
    shrink: u64,
}

impl PollWindow {
    /// A window that never grows past `config.max_ns`.
    pub(crate) fn new(config: PollConfig) -> Self {
        let factor = |f: u64| if f == 0 { 2 } else { f };
        Self { window_ns: 0, max_ns: config.max_ns, grow: factor(config.grow), shrink: factor(config.shrink) }
    }

    /// Whether the worker polls at all.
    pub(crate) fn enabled(&self) -> bool {
        self.max_ns > 0
    }

    /// How long to poll now.
    pub(crate) fn window_ns(&self) -> u64 {
        self.window_ns
    }

    /// Adapts the window to a sleep of `slept_ns` that polling did not
    /// avoid, ended by a guest kick.
    pub(crate) fn slept(&mut self, slept_ns: u64) {
        if slept_ns <= self.window_ns {
            return;
        }
        if slept_ns > self.max_ns {
            self.window_ns /= self.shrink;
            if self.window_ns < FIRST_WINDOW_NS {
                self.window_ns = 0;
            }
        } else {
            self.window_ns = self.window_ns.saturating_mul(self.grow).max(FIRST_WINDOW_NS).min(self.max_ns);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_while_work_comes_soon_and_shrinks_to_nothing_when_idle() {
        let mut w = PollWindow::new(PollConfig::up_to_us(50));
        assert_eq!(w.window_ns(), 0);
        w.slept(20_000);
        assert_eq!(w.window_ns(), 4_000);
        for _ in 0..10 {
            w.slept(45_000);
        }
        assert_eq!(w.window_ns(), 50_000, "capped at poll-us");
        w.slept(1_000_000);
        assert_eq!(w.window_ns(), 25_000);
        for _ in 0..4 {
            w.slept(1_000_000);
        }
        assert_eq!(w.window_ns(), 0, "an idle queue stops polling");
        w.slept(10);
        assert_eq!(w.window_ns(), 4_000, "work arriving soon starts polling again");
        w.slept(3_000);
        assert_eq!(w.window_ns(), 4_000, "a sleep the window covers changes nothing");
    }

    #[test]
    fn more_threads_awake_than_cpus_is_crowded() {
        let cpus = vsd_sys::allowed_cpus().unwrap().len();
        let awake: Vec<Awake> = (0..=cpus).map(|_| Awake::count_in()).collect();
        assert!(awake[0].crowded());
    }

    #[test]
    fn zero_never_polls() {
        let mut w = PollWindow::new(PollConfig::up_to_us(0));
        assert!(!w.enabled());
        w.slept(1_000);
        assert_eq!(w.window_ns(), 0);
    }
}
