//! What tracing adds to one request, in nanoseconds of this machine: the
//! same stamps and records a queue worker makes per request (a clock read at
//! pop, three stage records at completion, the latency record at the call,
//! and the per-round stamps and records shared by a batch), run in a loop.
//!
//! `cargo run --release -p vsd-trace --example trace-cost [BATCH]` (default
//! 32, the batch size at iodepth 32). Compare the result with the daemon's
//! CPU time per request (BENCHMARKS.md).

use std::hint::black_box;
use std::time::Instant;

use vsd_trace::{Clock, OpKind, QueueStats, Stage};

fn main() {
    let batch: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(32);
    let clock = Clock::get();
    let stats = QueueStats::timed_by(clock);
    let rounds = 2_000_000 / batch;
    let mut popped = vec![0u64; batch];
    let mut awaiting = Vec::with_capacity(batch);
    let start = Instant::now();
    for _ in 0..rounds {
        let kicked = clock.now();
        for stamp in popped.iter_mut() {
            *stamp = black_box(clock.now());
        }
        let submitted = clock.now();
        let completed = clock.now();
        for &at in &popped {
            stats.stage(Stage::Pop).record(at.saturating_sub(kicked));
            stats.stage(Stage::Submit).record(submitted.saturating_sub(at));
            stats.stage(Stage::Complete).record(completed.saturating_sub(submitted));
            awaiting.push((kicked, OpKind::Read));
        }
        let used = clock.now();
        stats.stage(Stage::Used).record_n(used.saturating_sub(completed), batch as u64);
        let called = clock.now();
        stats.stage(Stage::Call).record_n(called.saturating_sub(used), batch as u64);
        for (at, kind) in awaiting.drain(..) {
            stats.op(kind).latency.record(called.saturating_sub(at));
        }
    }
    let requests = (rounds * batch) as f64;
    let ns = start.elapsed().as_nanos() as f64 / requests;
    black_box(stats.snapshot());
    println!("tracing work: {ns:.1} ns per request (batches of {batch}, {requests:.0} requests)");
}
