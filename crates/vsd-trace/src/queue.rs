//! What a queue worker records: request stages, operation kinds and events.

use crate::{Clock, Counter, Histogram};

/// The stages of a request inside the daemon, in order.
///
/// A request's life: kick noticed (the worker woke up, or polling found
/// work) -> descriptor popped -> submitted to the I/O engine -> completed by
/// the engine -> used entry published -> guest notified (call). Each stage is
/// the time from the previous event to its own.
///
/// A worker stamps rounds, not requests: "popped" is when it began popping
/// the batch the request came in, and the whole batch is submitted at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Kick noticed -> the worker begins popping the request's batch.
    Pop,
    /// Popping begun -> the batch submitted to the I/O engine: the time
    /// the batch takes to parse and queue, which each of its requests waits.
    Submit,
    /// Submitted -> completed by the engine.
    Complete,
    /// Completed -> used entry published.
    Used,
    /// Used entry published -> guest notified.
    Call,
}

impl Stage {
    /// Every stage, in request order.
    pub const ALL: [Stage; 5] = [Stage::Pop, Stage::Submit, Stage::Complete, Stage::Used, Stage::Call];

    /// Position in [`Stage::ALL`] and in per-stage arrays.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The two events the stage lies between, for people.
    pub fn label(self) -> &'static str {
        match self {
            Stage::Pop => "kick -> pop",
            Stage::Submit => "pop -> submit",
            Stage::Complete => "submit -> complete",
            Stage::Used => "complete -> used",
            Stage::Call => "used -> call",
        }
    }

    /// Identifier for JSON keys and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Pop => "pop",
            Stage::Submit => "submit",
            Stage::Complete => "complete",
            Stage::Used => "used",
            Stage::Call => "call",
        }
    }
}

/// Request kinds as QEMU's block accounting counts them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    /// Reads.
    Read,
    /// Writes, write-zeroes included.
    Write,
    /// Flushes.
    Flush,
    /// Discards.
    Unmap,
}

impl OpKind {
    /// Every kind.
    pub const ALL: [OpKind; 4] = [OpKind::Read, OpKind::Write, OpKind::Flush, OpKind::Unmap];

    /// Position in [`OpKind::ALL`] and in per-kind arrays.
    pub fn index(self) -> usize {
        self as usize
    }

    /// Identifier for JSON keys and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Read => "read",
            OpKind::Write => "write",
            OpKind::Flush => "flush",
            OpKind::Unmap => "unmap",
        }
    }
}

/// Statistics of one kind of request. Single writer, as [`Counter`].
#[derive(Debug, Default)]
pub struct OpStats {
    /// Requests completed.
    pub ops: Counter,
    /// Bytes transferred.
    pub bytes: Counter,
    /// Requests completed with an error.
    pub failed: Counter,
    /// Latency from kick noticed to guest notified: all stages.
    pub latency: Histogram,
}

/// One virtqueue's statistics.
///
/// Written only by the queue's worker thread (see [`Counter`]); read by anyone
/// through [`snapshot`](Self::snapshot). Latencies are recorded in the ticks
/// of the queue's [`Clock`] (nanoseconds unless made [`QueueStats::timed_by`]
/// another clock), and read in nanoseconds.
#[derive(Debug, Default)]
pub struct QueueStats {
    /// The unit latencies are recorded in.
    pub(crate) clock: Option<Clock>,
    /// Time spent in each stage, indexed by [`Stage::index`].
    pub stages: [Histogram; Stage::ALL.len()],
    /// Per kind of request, indexed by [`OpKind::index`].
    pub ops: [OpStats; OpKind::ALL.len()],
    /// Kick eventfd reads that found a kick.
    pub kicks: Counter,
    /// Times the worker woke from its wait.
    pub wakeups: Counter,
    /// Call eventfd writes (interrupts signalled).
    pub calls: Counter,
    /// Rounds that took at least one request from the ring.
    pub batches: Counter,
    /// Requests taken from the ring.
    pub requests: Counter,
    /// Kernel entries of the I/O engine (`io_uring_enter` calls).
    pub kernel_entries: Counter,
    /// Polling rounds that found work without a kick.
    pub poll_hits: Counter,
    /// Requests in flight: a gauge.
    pub in_flight: Counter,
    /// Requests answered with an error without reaching the engine (bad sector, unsupported).
    pub invalid: Counter,
}

impl QueueStats {
    /// Statistics at zero, with latencies recorded in nanoseconds.
    pub fn new() -> Self {
        Self::default()
    }

    /// Statistics at zero, with latencies recorded in `clock`'s ticks.
    pub fn timed_by(clock: Clock) -> Self {
        Self { clock: Some(clock), ..Self::default() }
    }

    /// The histogram of `stage`.
    pub fn stage(&self, stage: Stage) -> &Histogram {
        &self.stages[stage.index()]
    }

    /// The statistics of `kind` requests.
    pub fn op(&self, kind: OpKind) -> &OpStats {
        &self.ops[kind.index()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indexes_follow_all() {
        assert!(Stage::ALL.iter().enumerate().all(|(i, s)| s.index() == i));
        assert!(OpKind::ALL.iter().enumerate().all(|(i, k)| k.index() == i));
    }

    #[test]
    fn accessors_reach_their_slot() {
        let q = QueueStats::new();
        q.stage(Stage::Used).record(5);
        q.op(OpKind::Flush).ops.add(1);
        assert_eq!(q.stages[3].snapshot().count(), 1);
        assert_eq!(q.ops[2].ops.get(), 1);
    }
}
