//! What tracing adds to one request, in nanoseconds of this machine: the
//! stamps and records a queue worker makes for a round of requests (six
//! clock reads per round, none per request; each request's stamps and kind
//! pushed to [`Runs`], and one record per run), run in a loop.
//!
//! `cargo run --release -p vsd-trace --example trace-cost [BATCH]` (default
//! 32, the batch size at iodepth 32). Compare the result with the daemon's
//! CPU time per request (BENCHMARKS.md).

use std::hint::black_box;
use std::time::Instant;

use vsd_trace::{Clock, OpKind, QueueStats, Runs, Stage};

fn main() {
    let batch: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(32);
    let clock = Clock::get();
    let stats = QueueStats::timed_by(clock);
    let rounds = 2_000_000 / batch;
    let mut completing = Runs::with_capacity(batch);
    let mut awaiting = Runs::with_capacity(batch);
    let start = Instant::now();
    for _ in 0..rounds {
        let kicked = clock.now();
        let popped = clock.now();
        let submitted = clock.now();
        let completed = clock.now();
        for _ in 0..batch {
            completing.push(black_box((kicked, popped, submitted)));
            awaiting.push(black_box((kicked, OpKind::Read)));
        }
        for ((kicked, popped, submitted), n) in completing.drain() {
            stats.stage(Stage::Pop).record_n(popped.saturating_sub(kicked), n);
            stats.stage(Stage::Submit).record_n(submitted.saturating_sub(popped), n);
            stats.stage(Stage::Complete).record_n(completed.saturating_sub(submitted), n);
        }
        let used = clock.now();
        stats.stage(Stage::Used).record_n(used.saturating_sub(completed), batch as u64);
        let called = clock.now();
        let mut requests = 0;
        for ((at, kind), n) in awaiting.drain() {
            stats.op(kind).latency.record_n(called.saturating_sub(at), n);
            requests += n;
        }
        stats.stage(Stage::Call).record_n(called.saturating_sub(used), requests);
    }
    let requests = (rounds * batch) as f64;
    let ns = start.elapsed().as_nanos() as f64 / requests;
    black_box(stats.snapshot());
    println!("tracing work: {ns:.1} ns per request (batches of {batch}, {requests:.0} requests)");
}
