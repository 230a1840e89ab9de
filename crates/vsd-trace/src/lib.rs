//! Always-on, lock-free statistics for vsd's request path.
//!
//! Every virtqueue worker owns one [`QueueStats`] and is its only writer; a
//! control thread reads it at any time with [`QueueStats::snapshot`] and
//! merges the snapshots of an export's queues ([`ExportSnapshot`]).
//!
//! # Single writer
//!
//! Because one thread writes each value, an update is a relaxed load and a
//! relaxed store of an `AtomicU64`: plain moves, no `lock` prefix, no
//! read-modify-write, and the cache line stays with the writer until a reader
//! asks. Recording costs a handful of instructions, with no allocation, lock
//! or system call. Readers load each value with relaxed ordering, so a
//! snapshot may be torn (a histogram's sum one request apart from its
//! buckets), but each value only grows, so snapshots never go backwards.
//!
//! # Why not `hdrhistogram`
//!
//! Its `Histogram::record` takes `&mut self`. Reading one from another thread
//! then needs either a lock taken around every record on the hot path, or its
//! `sync` recorders, which hand histograms over a channel and make the reader
//! wait for the writer to take part. Here the reader never disturbs the writer.

#![deny(missing_docs)]

mod clock;
mod counter;
mod histogram;
mod keyed;
mod prometheus;
mod queue;
mod render;
mod runs;
mod snapshot;

use std::sync::OnceLock;
use std::time::Instant;

pub use clock::Clock;
pub use counter::Counter;
pub use histogram::{Histogram, HistogramSnapshot};
pub use prometheus::{ExportLabel, prometheus};
pub use queue::{OpKind, OpStats, QueueStats, Stage};
pub use render::{events_table, stage_table};
pub use runs::Runs;
pub use snapshot::{ExportSnapshot, OpSnapshot, QueueEvents, QueueSnapshot};

/// Monotonic nanoseconds since the first call in this process.
///
/// `Instant` reads `CLOCK_MONOTONIC` through the vDSO, so this makes no system
/// call; the process-wide epoch keeps the values small and comparable across
/// threads.
pub fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn now_ns_is_monotonic() {
        let a = now_ns();
        std::thread::sleep(std::time::Duration::from_millis(1));
        let b = now_ns();
        assert!(b >= a + 1_000_000, "{a} -> {b}");
    }
}
