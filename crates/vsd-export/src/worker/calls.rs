//! Call batching (`call-batch-us`): a queue that published completions
//! while more of its requests are in flight may hold the guest's
//! notification for up to that long, so that one interrupt covers the
//! completions that follow (RSD's call batching): fewer interrupts for at
//! most that much added latency. A lone request is never held.

use vsd_trace::Clock;

/// Whether the guest has completions it was not told of, and since when.
pub(super) struct CallBatch {
    /// `call-batch-us`, in nanoseconds (0: never hold).
    window_ns: u64,
    /// Used entries were published since the guest was last signalled.
    unsignalled: bool,
    /// When the first of those was published (with a window only).
    since: u64,
}

impl CallBatch {
    pub(super) fn new(window_us: u32) -> Self {
        Self { window_ns: u64::from(window_us) * 1000, unsignalled: false, since: 0 }
    }

    /// A used entry was published.
    pub(super) fn published(&mut self, clock: &Clock) {
        if !self.unsignalled && self.window_ns > 0 {
            self.since = clock.now();
        }
        self.unsignalled = true;
    }

    /// Whether the guest has completions it was not told of.
    pub(super) fn pending(&self) -> bool {
        self.unsignalled
    }

    /// Whether to hold the notification a little longer, for the
    /// `in_flight` requests to complete and share it.
    pub(super) fn holding(&self, clock: &Clock, in_flight: usize, stopping: bool) -> bool {
        self.window_ns > 0
            && !stopping
            && in_flight > 0
            && clock.ns(clock.now().saturating_sub(self.since)) < self.window_ns
    }

    /// The guest is being told.
    pub(super) fn signalled(&mut self) {
        self.unsignalled = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notification_is_held_only_within_the_window_and_with_more_to_come() {
        let clock = Clock::get();
        let mut calls = CallBatch::new(1_000_000);
        assert!(!calls.pending());
        calls.published(&clock);
        assert!(calls.pending());
        assert!(calls.holding(&clock, 3, false), "within the window, requests in flight");
        assert!(!calls.holding(&clock, 0, false), "a lone request is never held");
        assert!(!calls.holding(&clock, 3, true), "nor while the queue stops");
        calls.signalled();
        assert!(!calls.pending());

        let mut never = CallBatch::new(0);
        never.published(&clock);
        assert!(never.pending() && !never.holding(&clock, 3, false), "call-batch-us=0 never holds");

        let mut short = CallBatch::new(1);
        short.published(&clock);
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(!short.holding(&clock, 3, false), "the window ran out");
    }
}
