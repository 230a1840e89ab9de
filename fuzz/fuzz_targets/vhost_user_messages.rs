//! The vhost-user message handler over arbitrary message sequences: one
//! connection per input, served as the export serves it (`Session` behind
//! rust-vmm's `BackendReqHandler`, the back-end channel intercepted, the
//! connection dropped at the first error), with file descriptors attached
//! to messages (memfds of any size, eventfds, `/dev/null`, sockets) and
//! size fields that lie. The export serves a 1 MiB null-co node, so queue
//! workers run without real I/O.
//!
//! The input format is `vsd_export::fuzzing`'s (see its docs): two bytes of
//! set-up (queues, polling, and an optional valid prefix that leaves every
//! ring running with requests queued), then messages, kicks, raw bytes,
//! resizes, pauses and guest memory writes.
//!
//! Checked, besides no panic, abort or SIGBUS (a region larger than its
//! memfd must be refused): every input ends (libFuzzer's `-timeout`), and
//! after each one the process has no more descriptors or threads than
//! before the first one, give or take a few the runtime opens.
//!
//! `VSD_FUZZ_DEBUG=1` prints what each input did.

#![no_main]

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use libfuzzer_sys::fuzz_target;

/// Descriptors and threads of the process before the first input.
static BASELINE: OnceLock<(usize, usize)> = OnceLock::new();
static RUNS: AtomicU64 = AtomicU64::new(0);
static DEBUG: OnceLock<bool> = OnceLock::new();
/// What the runtime (libFuzzer, the sanitizer) may open on its own.
const SLACK: usize = 16;

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

fuzz_target!(|data: &[u8]| {
    let (fds, threads) = *BASELINE.get_or_init(|| (count("/proc/self/fd"), count("/proc/self/task")));
    let outcome = vsd_export::fuzzing::run(data);
    if *DEBUG.get_or_init(|| std::env::var_os("VSD_FUZZ_DEBUG").is_some()) {
        eprintln!("{outcome:?}");
    }
    // After every input: everything the connection had is closed and
    // joined by now, so a leak shows as soon as it passes the slack.
    let run = RUNS.fetch_add(1, Ordering::Relaxed);
    let now = count("/proc/self/fd");
    assert!(now <= fds + SLACK, "descriptor leak: {now} open after input {run}, {fds} before the first");
    let now = count("/proc/self/task");
    assert!(now <= threads + SLACK, "thread leak: {now} threads after input {run}, {threads} before the first");
});
