//! Point-in-time copies of queue statistics, as they travel over JSON.

use serde::{Deserialize, Serialize};

use crate::{Clock, HistogramSnapshot, OpKind, OpStats, QueueStats, Stage};

/// A copy of [`OpStats`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OpSnapshot {
    /// Requests completed.
    pub ops: u64,
    /// Bytes transferred.
    pub bytes: u64,
    /// Requests completed with an error.
    pub failed: u64,
    /// Latency from kick noticed to used entry published.
    pub latency: HistogramSnapshot,
}

impl OpSnapshot {
    fn merge(&mut self, other: &OpSnapshot) {
        self.ops += other.ops;
        self.bytes += other.bytes;
        self.failed += other.failed;
        self.latency.merge(&other.latency);
    }

    fn since(&self, baseline: &OpSnapshot) -> OpSnapshot {
        OpSnapshot {
            ops: self.ops.saturating_sub(baseline.ops),
            bytes: self.bytes.saturating_sub(baseline.bytes),
            failed: self.failed.saturating_sub(baseline.failed),
            latency: self.latency.since(&baseline.latency),
        }
    }
}

/// A copy of a queue's event counters; [`QueueStats`] tells when each counts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct QueueEvents {
    /// Kicks found.
    pub kicks: u64,
    /// Worker wake-ups.
    pub wakeups: u64,
    /// Guest notifications.
    pub calls: u64,
    /// Rounds that took requests from the ring.
    pub batches: u64,
    /// Requests taken from the ring.
    pub requests: u64,
    /// I/O engine kernel entries.
    pub kernel_entries: u64,
    /// Polling rounds that found work without a kick.
    pub poll_hits: u64,
    /// Requests in flight (a gauge).
    pub in_flight: u64,
    /// Requests rejected before reaching the engine.
    pub invalid: u64,
}

impl QueueEvents {
    /// Each counter of `self` combined with the same counter of `other`.
    fn zip_with(&self, other: &QueueEvents, f: impl Fn(u64, u64) -> u64) -> QueueEvents {
        QueueEvents {
            kicks: f(self.kicks, other.kicks),
            wakeups: f(self.wakeups, other.wakeups),
            calls: f(self.calls, other.calls),
            batches: f(self.batches, other.batches),
            requests: f(self.requests, other.requests),
            kernel_entries: f(self.kernel_entries, other.kernel_entries),
            poll_hits: f(self.poll_hits, other.poll_hits),
            in_flight: f(self.in_flight, other.in_flight),
            invalid: f(self.invalid, other.invalid),
        }
    }

    fn merge(&mut self, other: &QueueEvents) {
        *self = self.zip_with(other, |a, b| a + b);
    }
}

/// A copy of [`QueueStats`], or the sum of several.
///
/// In JSON, `stages` and `ops` are objects keyed by [`Stage::name`] and
/// [`OpKind::name`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct QueueSnapshot {
    /// Time spent in each stage, indexed by [`Stage::index`].
    #[serde(
        serialize_with = "crate::keyed::serialize::<Stage, _, _, _>",
        deserialize_with = "crate::keyed::deserialize::<Stage, _, _, _>"
    )]
    pub stages: [HistogramSnapshot; Stage::ALL.len()],
    /// Kick noticed -> guest notified: every kind's latency together.
    pub total: HistogramSnapshot,
    /// Per kind of request, indexed by [`OpKind::index`].
    #[serde(
        serialize_with = "crate::keyed::serialize::<OpKind, _, _, _>",
        deserialize_with = "crate::keyed::deserialize::<OpKind, _, _, _>"
    )]
    pub ops: [OpSnapshot; OpKind::ALL.len()],
    /// Event counters.
    pub events: QueueEvents,
}

impl QueueSnapshot {
    /// The histogram of `stage`.
    pub fn stage(&self, stage: Stage) -> &HistogramSnapshot {
        &self.stages[stage.index()]
    }

    /// The statistics of `kind` requests.
    pub fn op(&self, kind: OpKind) -> &OpSnapshot {
        &self.ops[kind.index()]
    }

    /// Adds `other`'s figures to these; gauges add up too.
    pub fn merge(&mut self, other: &QueueSnapshot) {
        self.stages.iter_mut().zip(&other.stages).for_each(|(a, b)| a.merge(b));
        self.total.merge(&other.total);
        self.ops.iter_mut().zip(&other.ops).for_each(|(a, b)| a.merge(b));
        self.events.merge(&other.events);
    }

    /// What happened after `baseline` was taken (the in-flight gauge is
    /// kept as of now).
    pub fn since(&self, baseline: &QueueSnapshot) -> QueueSnapshot {
        let mut events = self.events.zip_with(&baseline.events, u64::saturating_sub);
        events.in_flight = self.events.in_flight;
        QueueSnapshot {
            stages: std::array::from_fn(|i| self.stages[i].since(&baseline.stages[i])),
            total: self.total.since(&baseline.total),
            ops: std::array::from_fn(|i| self.ops[i].since(&baseline.ops[i])),
            events,
        }
    }
}

impl OpStats {
    /// A copy of the current figures, latencies read as `clock`'s ticks.
    pub fn snapshot_in(&self, clock: Clock) -> OpSnapshot {
        OpSnapshot {
            ops: self.ops.get(),
            bytes: self.bytes.get(),
            failed: self.failed.get(),
            latency: self.latency.snapshot_in(clock),
        }
    }
}

impl QueueStats {
    /// A copy of the current figures; may be taken from any thread.
    pub fn snapshot(&self) -> QueueSnapshot {
        let clock = self.clock.unwrap_or(Clock::NANOSECONDS);
        let ops = self.ops.each_ref().map(|op| op.snapshot_in(clock));
        // Every request is recorded once, under its kind.
        let total = ops.iter().fold(HistogramSnapshot::default(), |mut total, op| {
            total.merge(&op.latency);
            total
        });
        QueueSnapshot {
            stages: self.stages.each_ref().map(|h| h.snapshot_in(clock)),
            total,
            ops,
            events: QueueEvents {
                kicks: self.kicks.get(),
                wakeups: self.wakeups.get(),
                calls: self.calls.get(),
                batches: self.batches.get(),
                requests: self.requests.get(),
                kernel_entries: self.kernel_entries.get(),
                poll_hits: self.poll_hits.get(),
                in_flight: self.in_flight.get(),
                invalid: self.invalid.get(),
            },
        }
    }
}

/// The snapshots of an export's queues.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExportSnapshot {
    /// One per queue, in queue order.
    pub queues: Vec<QueueSnapshot>,
}

impl ExportSnapshot {
    /// An export snapshot from its queues' snapshots.
    pub fn from_queues(queues: Vec<QueueSnapshot>) -> Self {
        Self { queues }
    }

    /// All queues summed.
    pub fn merged(&self) -> QueueSnapshot {
        self.queues.iter().fold(QueueSnapshot::default(), |mut sum, q| {
            sum.merge(q);
            sum
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_recorded_in_ticks_read_as_nanoseconds() {
        let q = QueueStats::timed_by(crate::clock::with_ns_per_tick(3));
        q.stage(Stage::Pop).record_n(1000, 4);
        q.op(OpKind::Read).latency.record(10);
        let s = q.snapshot();
        assert_eq!(s.stage(Stage::Pop).sum_ns(), 12_000);
        assert_eq!(s.stage(Stage::Pop).quantile_ns(0.5), 3 * 1007);
        assert_eq!(s.total.sum_ns(), 30);
    }

    #[test]
    fn since_leaves_what_came_after_the_baseline() {
        let before = busy_queue(2).snapshot();
        let after = busy_queue(5).snapshot();
        let delta = after.since(&before);
        assert_eq!(delta.total.count(), 3);
        assert_eq!(delta.stage(Stage::Call).count(), 3);
        assert_eq!(delta.op(OpKind::Write).bytes, 3 * 4096);
        assert_eq!(delta.events.kicks, 3);
        let mut rebuilt = before.clone();
        rebuilt.merge(&delta);
        assert_eq!(rebuilt.total, after.total);
    }

    fn busy_queue(scale: u64) -> QueueStats {
        let q = QueueStats::new();
        for stage in Stage::ALL {
            q.stage(stage).record_n(1000 * (stage.index() as u64 + 1), scale);
        }
        q.op(OpKind::Write).ops.add(scale);
        q.op(OpKind::Write).bytes.add(4096 * scale);
        q.op(OpKind::Write).latency.record_n(15_000, scale);
        q.kicks.add(scale);
        q.in_flight.set(2);
        q
    }

    #[test]
    fn json_round_trip_with_named_keys() {
        let snap = ExportSnapshot::from_queues(vec![busy_queue(3).snapshot(), QueueStats::new().snapshot()]);
        let json = serde_json::to_value(&snap).unwrap();
        let queue = &json["queues"][0];
        assert_eq!(queue["stages"]["complete"]["count"], 3);
        assert_eq!(queue["ops"]["write"]["bytes"], 3 * 4096);
        assert_eq!(queue["ops"]["read"]["latency"]["buckets"], serde_json::json!([]));
        assert_eq!(queue["events"]["in_flight"], 2);
        let back: ExportSnapshot = serde_json::from_value(json).unwrap();
        assert_eq!(back, snap);
    }

    #[test]
    fn unknown_and_missing_keys_are_tolerated() {
        let mut json = serde_json::to_value(busy_queue(1).snapshot()).unwrap();
        let stages = json["stages"].as_object_mut().unwrap();
        stages.remove("pop");
        stages.insert("future".into(), serde_json::json!({"count": 0, "sum_ns": 0, "buckets": []}));
        let back: QueueSnapshot = serde_json::from_value(json).unwrap();
        assert_eq!(back.stage(Stage::Pop).count(), 0);
        assert_eq!(back.stage(Stage::Submit).count(), 1);
    }

    #[test]
    fn merged_sums_queues() {
        let snap = ExportSnapshot::from_queues(vec![busy_queue(1).snapshot(), busy_queue(2).snapshot()]);
        let mut expected = busy_queue(3).snapshot();
        expected.events.in_flight = 4;
        assert_eq!(snap.merged(), expected);
        assert_eq!(ExportSnapshot::default().merged(), QueueSnapshot::default());
    }
}
