//! A queue's stage timing (unless `trace=off`): kick noticed -> popped ->
//! submitted -> completed -> used entry published -> guest notified, into
//! the queue's own [`QueueStats`]. The clock is read per round, never per
//! request: the requests of a round share their stamps, so their stage
//! times are equal and one histogram record covers each run of them
//! ([`Runs`]).

use vsd_trace::{Clock, OpKind, QueueStats, Runs, Stage};

/// When a request passed the stages up to its submission, in [`Clock`]
/// ticks (0 with tracing off). `popped` is when the worker began popping
/// the request's batch, so its pop -> submit stage is the time the batch
/// took to parse and push, which it waits out before being submitted with
/// the others.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Stamps {
    pub(super) kicked: u64,
    pub(super) popped: u64,
    pub(super) submitted: u64,
}

/// The stamps of one queue's rounds, and the requests waiting to be
/// recorded.
pub(super) struct Trace {
    clock: Clock,
    on: bool,
    /// When the last kick was noticed.
    kicked_at: u64,
    /// When the worker began popping the current round's requests.
    popping_at: u64,
    /// When the last completions were published.
    used_at: u64,
    /// The stamps of the requests being completed, for their stages.
    completing: Runs<Stamps>,
    /// Requests published since the guest was last notified: when their
    /// kick was noticed and their kind, for their latency.
    awaiting_call: Runs<(u64, OpKind)>,
}

impl Trace {
    /// Stamps for a queue of `depth` entries; `on` unless `trace=off`.
    pub(super) fn new(on: bool, depth: u16) -> Self {
        let depth = usize::from(depth);
        Self {
            clock: Clock::get(),
            on,
            kicked_at: 0,
            popping_at: 0,
            used_at: 0,
            completing: Runs::with_capacity(depth),
            awaiting_call: Runs::with_capacity(depth),
        }
    }

    /// The clock, which polling and call batching read even without tracing.
    pub(super) fn clock(&self) -> &Clock {
        &self.clock
    }

    /// The time, if requests are being traced.
    #[inline]
    pub(super) fn now(&self) -> u64 {
        if self.on { self.clock.now() } else { 0 }
    }

    /// The guest kicked (or polling found requests): now.
    pub(super) fn kicked(&mut self) {
        self.kicked_at = self.now();
    }

    /// The worker begins popping a round's requests: now.
    pub(super) fn popping(&mut self) {
        self.popping_at = self.now();
    }

    /// The stamps of a request popped in this round.
    pub(super) fn stamps(&self) -> Stamps {
        Stamps { kicked: self.kicked_at, popped: self.popping_at, submitted: 0 }
    }

    /// A request stamped `stamps` completed.
    #[inline]
    pub(super) fn completed(&mut self, stamps: Stamps, kind: OpKind) {
        if self.on {
            self.completing.push(stamps);
            self.awaiting_call.push((stamps.kicked, kind));
        }
    }

    /// The `count` requests completed at `completed_at` are published:
    /// records their stages up to now.
    pub(super) fn published(&mut self, stats: &QueueStats, completed_at: u64, count: usize) {
        self.used_at = self.now();
        if !self.on {
            return;
        }
        stats.stage(Stage::Used).record_n(self.used_at.saturating_sub(completed_at), count as u64);
        for (at, n) in self.completing.drain() {
            stats.stage(Stage::Pop).record_n(at.popped.saturating_sub(at.kicked), n);
            stats.stage(Stage::Submit).record_n(at.submitted.saturating_sub(at.popped), n);
            stats.stage(Stage::Complete).record_n(completed_at.saturating_sub(at.submitted), n);
        }
    }

    /// The guest was notified: records the latency of every request
    /// published since the last notification, and their last stage.
    pub(super) fn called(&mut self, stats: &QueueStats) {
        if !self.on || self.awaiting_call.is_empty() {
            return;
        }
        let called_at = self.clock.now();
        let mut requests = 0;
        for ((kicked_at, kind), n) in self.awaiting_call.drain() {
            stats.op(kind).latency.record_n(called_at.saturating_sub(kicked_at), n);
            requests += n;
        }
        stats.stage(Stage::Call).record_n(called_at.saturating_sub(self.used_at), requests);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(stats: &QueueStats) -> Vec<u64> {
        let stages = Stage::ALL.iter().map(|&stage| stats.stage(stage).snapshot().count());
        stages.chain([stats.op(OpKind::Read).latency.snapshot().count()]).collect()
    }

    #[test]
    fn every_request_is_recorded_once_in_every_stage() {
        let stats = QueueStats::new();
        let mut trace = Trace::new(true, 8);
        trace.kicked();
        trace.popping();
        let stamps = trace.stamps();
        assert!(stamps.kicked > 0 && stamps.popped >= stamps.kicked);
        for _ in 0..3 {
            trace.completed(Stamps { submitted: trace.now(), ..stamps }, OpKind::Read);
        }
        trace.published(&stats, trace.now(), 3);
        trace.called(&stats);
        assert_eq!(counts(&stats), vec![3; Stage::ALL.len() + 1], "every stage and the latency");
        trace.called(&stats);
        assert_eq!(counts(&stats)[Stage::ALL.len()], 3, "a notification with nothing new records nothing");
    }

    #[test]
    fn without_tracing_nothing_is_stamped_or_recorded() {
        let stats = QueueStats::new();
        let mut trace = Trace::new(false, 8);
        trace.kicked();
        assert_eq!((trace.now(), trace.stamps()), (0, Stamps::default()));
        trace.completed(trace.stamps(), OpKind::Read);
        trace.published(&stats, 0, 1);
        trace.called(&stats);
        assert!(counts(&stats).iter().all(|&n| n == 0));
    }
}
