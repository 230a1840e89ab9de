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

/// The first window, once growing starts.
const FIRST_WINDOW_NS: u64 = 4_000;

/// A worker's polling window, in nanoseconds.
#[derive(Debug)]
pub(crate) struct PollWindow {
    window_ns: u64,
    max_ns: u64,
}

impl PollWindow {
    /// A window that never grows past `max_us` (0: never poll).
    pub(crate) fn new(max_us: u32) -> Self {
        Self { window_ns: 0, max_ns: u64::from(max_us) * 1000 }
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
            self.window_ns /= 2;
            if self.window_ns < FIRST_WINDOW_NS {
                self.window_ns = 0;
            }
        } else {
            self.window_ns = (self.window_ns * 2).clamp(FIRST_WINDOW_NS, self.max_ns);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_while_work_comes_soon_and_shrinks_to_nothing_when_idle() {
        let mut w = PollWindow::new(50);
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
    fn zero_never_polls() {
        let mut w = PollWindow::new(0);
        assert!(!w.enabled());
        w.slept(1_000);
        assert_eq!(w.window_ns(), 0);
    }
}
