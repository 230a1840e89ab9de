//! Write thresholds (QMP `block-set-write-threshold`): the first write to
//! a node that ends past a set offset sends `BLOCK_WRITE_THRESHOLD` once,
//! and the threshold is gone until set again, as in QEMU. Management
//! tools arm one below the end of a thin volume to grow it in time.
//!
//! Every writer of a node checks it in its [`DirtyRecorder`](crate::dirty::DirtyRecorder),
//! which already sees each write, write-zeroes and discard before it goes
//! down (where QEMU checks it): one relaxed load and one comparison per
//! write, armed or not, since a disarmed threshold is `u64::MAX`, which no
//! write ends past. Crossing it is the cold path.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use serde_json::json;

use crate::EventSink;

/// What no write ends past: the threshold while none is set.
const DISARMED: u64 = u64::MAX;

/// A node's write threshold.
pub struct WriteThreshold {
    /// Writes that end past this offset cross the threshold.
    above: AtomicU64,
    /// The threshold as last set (0: none), as QMP shows it: `u64::MAX`
    /// may be set, and is never crossed.
    set: AtomicU64,
    /// Whether discards count: QEMU counts those a node does not ignore
    /// (`discard=unmap`).
    counts_discards: AtomicBool,
    /// The node's name and where its events go, once the graph has it.
    notice: OnceLock<(String, Option<EventSink>)>,
}

impl Default for WriteThreshold {
    fn default() -> Self {
        Self {
            above: AtomicU64::new(DISARMED),
            set: AtomicU64::new(0),
            counts_discards: AtomicBool::new(false),
            notice: OnceLock::new(),
        }
    }
}

impl WriteThreshold {
    /// Names the node whose threshold this is and where its event goes;
    /// `counts_discards` if the node acts on discards. Once only.
    pub(crate) fn attach(&self, node: &str, events: Option<EventSink>, counts_discards: bool) {
        self.counts_discards.store(counts_discards, Ordering::Relaxed);
        let _ = self.notice.set((node.to_string(), events));
    }

    /// Arms the threshold at `bytes`, or disarms it with 0.
    pub fn set(&self, bytes: u64) {
        self.set.store(bytes, Ordering::Relaxed);
        self.above.store(if bytes == 0 { DISARMED } else { bytes }, Ordering::Release);
    }

    /// The threshold as set, 0 if none (or once crossed).
    pub fn get(&self) -> u64 {
        self.set.load(Ordering::Relaxed)
    }

    /// Checks a write of `len` bytes at `offset` (a discard if `discard`),
    /// before it goes down.
    #[inline(always)]
    pub(crate) fn check(&self, offset: u64, len: u64, discard: bool) {
        // Requests lie within the node: the sum does not wrap.
        let end = offset.wrapping_add(len);
        if end > self.above.load(Ordering::Relaxed) {
            self.crossed(end, discard);
        }
    }

    /// A write ending at `end` crossed the threshold: the first writer to
    /// disarm it sends the event.
    #[cold]
    fn crossed(&self, end: u64, discard: bool) {
        if discard && !self.counts_discards.load(Ordering::Relaxed) {
            return;
        }
        let mut above = self.above.load(Ordering::Acquire);
        while end > above {
            match self.above.compare_exchange(above, DISARMED, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    // Unless it was set again meanwhile, it shows as gone.
                    let _ = self.set.compare_exchange(above, 0, Ordering::Relaxed, Ordering::Relaxed);
                    self.notify(above, end - above);
                    return;
                }
                Err(now) => above = now,
            }
        }
    }

    fn notify(&self, threshold: u64, exceeded: u64) {
        let Some((node, Some(events))) = self.notice.get() else { return };
        let data = json!({ "node-name": node, "amount-exceeded": exceeded, "write-threshold": threshold });
        events("BLOCK_WRITE_THRESHOLD", data);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use serde_json::Value;

    use super::*;

    fn watched(counts_discards: bool) -> (WriteThreshold, Arc<Mutex<Vec<Value>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        let threshold = WriteThreshold::default();
        let events: EventSink = Arc::new(move |name, data| sink.lock().unwrap().push(json!([name, data])));
        threshold.attach("n", Some(events), counts_discards);
        (threshold, seen)
    }

    #[test]
    fn fires_once_past_the_threshold_then_disarms() {
        let (threshold, seen) = watched(false);
        threshold.check(0, u64::MAX, false);
        assert!(seen.lock().unwrap().is_empty(), "never armed");
        threshold.set(1 << 20);
        threshold.check((1 << 20) - 4096, 4096, false);
        assert!(seen.lock().unwrap().is_empty(), "ending at the threshold is not past it");
        threshold.check(1 << 20, 4096, false);
        threshold.check(2 << 20, 4096, false);
        let event = json!({ "node-name": "n", "amount-exceeded": 4096, "write-threshold": 1 << 20 });
        assert_eq!(*seen.lock().unwrap(), [json!(["BLOCK_WRITE_THRESHOLD", event])]);
        assert_eq!(threshold.get(), 0, "disarmed");
        threshold.set(8 << 20);
        threshold.check(8 << 20, 512, false);
        assert_eq!(seen.lock().unwrap().len(), 2, "armed again, it fires again");
    }

    #[test]
    fn zero_disarms_and_the_largest_threshold_is_kept_but_never_crossed() {
        let (threshold, seen) = watched(true);
        threshold.set(4096);
        threshold.set(0);
        threshold.check(0, 1 << 30, false);
        threshold.set(u64::MAX);
        threshold.check(u64::MAX - 1, 4096, false);
        assert!(seen.lock().unwrap().is_empty());
        assert_eq!(threshold.get(), u64::MAX);
    }

    #[test]
    fn discards_count_only_where_the_node_acts_on_them() {
        let (ignoring, seen) = watched(false);
        ignoring.set(4096);
        ignoring.check(0, 8192, true);
        assert!(seen.lock().unwrap().is_empty());
        assert_eq!(ignoring.get(), 4096, "still armed");
        let (unmapping, seen) = watched(true);
        unmapping.set(4096);
        unmapping.check(0, 8192, true);
        assert_eq!(seen.lock().unwrap().len(), 1);
    }

    #[test]
    fn concurrent_writers_send_one_event() {
        let (threshold, seen) = watched(false);
        threshold.set(1);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| (0..1000).for_each(|i| threshold.check(i, 4096, false)));
            }
        });
        assert_eq!(seen.lock().unwrap().len(), 1);
    }
}
