//! When a cluster freed while the image is open may be handed out again.
//!
//! Queues map guest bytes to host clusters without the metadata mutex,
//! then read or write them. A request mapped before a discard cleared its
//! entry may still be in flight when the cluster is freed (at a flush):
//! were the cluster allocated again at once, that request's late write
//! would land in the new owner's data. So a freed cluster waits in
//! [`Quarantine`], tagged with the image's epoch when it was freed, and
//! the epoch moves on; the cluster is handed out again once no queue has
//! a request in flight that started in that epoch or before (each queue
//! says so through its [`EpochPin`]). QEMU moves its allocation cursor
//! back at once, whatever is in flight.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex, PoisonError, Weak};

/// A queue with nothing in flight pins no epoch.
const IDLE: u64 = u64::MAX;

/// The image's epoch, and what each queue's requests in flight pin.
#[derive(Default)]
pub(super) struct Epochs {
    current: AtomicU64,
    /// Each queue's oldest epoch with a request in flight, or [`IDLE`].
    pins: Mutex<Vec<Weak<AtomicU64>>>,
}

impl Epochs {
    pub(super) fn current(&self) -> u64 {
        self.current.load(Ordering::Acquire)
    }

    /// Moves on: a request that starts from now on maps after every change
    /// made before, so it cannot reach what was freed.
    pub(super) fn advance(&self) {
        self.current.fetch_add(1, Ordering::SeqCst);
    }

    /// The oldest epoch a request still in flight started in, or
    /// `u64::MAX` if none is.
    pub(super) fn oldest_in_use(&self) -> u64 {
        // Pairs with the fence in `EpochPin::enter`: either this sees the
        // queue's pin, or the queue's lookups see the cleared entries.
        fence(Ordering::SeqCst);
        let mut pins = self.pins.lock().unwrap_or_else(PoisonError::into_inner);
        pins.retain(|pin| pin.strong_count() > 0);
        pins.iter().filter_map(Weak::upgrade).map(|pin| pin.load(Ordering::SeqCst)).min().unwrap_or(IDLE)
    }

    /// A pin for a queue of `depth` requests.
    pub(super) fn pin(self: &Arc<Self>, depth: u16) -> EpochPin {
        let oldest = Arc::new(AtomicU64::new(IDLE));
        self.pins.lock().unwrap_or_else(PoisonError::into_inner).push(Arc::downgrade(&oldest));
        EpochPin {
            epochs: self.clone(),
            oldest,
            bucket_of: vec![0; usize::from(depth)].into_boxed_slice(),
            count: [0; 2],
            since: [0; 2],
            current: 0,
        }
    }
}

/// One queue's requests in flight, as far as the epochs they started in
/// matter: what keeps clusters freed meanwhile from being handed out
/// again.
///
/// Requests join one of two buckets; each bucket knows the epoch it began
/// taking requests in, a lower bound of theirs. Once the older bucket is
/// empty, every request in flight started in the newer bucket's epoch or
/// later: that is published, and if the image's epoch moved since, new
/// requests go to the emptied bucket from now. A request costs a count up
/// and down; the epochs are looked at once per reap.
pub struct EpochPin {
    epochs: Arc<Epochs>,
    /// Published: every request in flight started in this epoch or later
    /// ([`IDLE`]: none is in flight).
    oldest: Arc<AtomicU64>,
    /// By tag: the bucket the request joined.
    bucket_of: Box<[u8]>,
    /// Requests in flight per bucket.
    count: [u32; 2],
    /// The epoch each bucket began taking requests in.
    since: [u64; 2],
    /// The bucket new requests join.
    current: usize,
}

impl EpochPin {
    /// Request `tag` starts: call before its first lookup.
    #[inline]
    pub fn enter(&mut self, tag: u32) {
        if self.count == [0, 0] {
            self.busy();
        }
        let current = self.current & 1;
        if let Some(bucket) = self.bucket_of.get_mut(tag as usize) {
            *bucket = current as u8;
            self.count[current] += 1;
        }
    }

    /// The queue had nothing in flight: from now on it pins the epoch.
    #[cold]
    fn busy(&mut self) {
        let epoch = self.epochs.current();
        self.since[self.current & 1] = epoch;
        self.oldest.store(epoch, Ordering::Relaxed);
        // Published before the request looks anything up.
        fence(Ordering::SeqCst);
    }

    /// Request `tag` is done: none of its I/O is in flight any more.
    #[inline]
    pub fn leave(&mut self, tag: u32) {
        if let Some(&bucket) = self.bucket_of.get(tag as usize) {
            self.count[usize::from(bucket & 1)] -= 1;
        }
    }

    /// Publishes what the requests left in flight allow, after a reap.
    #[inline]
    pub fn settle(&mut self) {
        let older = 1 - self.current;
        if self.count[older] > 0 {
            return;
        }
        let oldest = if self.count[self.current] == 0 { IDLE } else { self.since[self.current] };
        if self.oldest.load(Ordering::Relaxed) != oldest {
            self.oldest.store(oldest, Ordering::Release);
        }
        let epoch = self.epochs.current();
        if oldest != IDLE && epoch != self.since[self.current] {
            self.since[older] = epoch;
            self.current = older;
        }
    }
}

/// Clusters freed while requests that may still use them are in flight,
/// and freed clusters whose discard in the file is still to come.
#[derive(Default)]
pub(super) struct Quarantine {
    /// (epoch freed in, cluster), in the order freed.
    held: VecDeque<(u64, u64)>,
    /// Freed, to be discarded before they wait like the others.
    to_discard: Vec<u64>,
    /// The latest epoch one of those was freed in.
    to_discard_epoch: u64,
    /// Every cluster of `held` and `to_discard`.
    clusters: HashSet<u64>,
}

impl Quarantine {
    pub(super) fn hold(&mut self, epoch: u64, cluster: u64) {
        if self.clusters.insert(cluster) {
            self.held.push_back((epoch, cluster));
        }
    }

    /// Holds `cluster`, freed in `epoch`, until it is discarded
    /// ([`Quarantine::discarded`]).
    pub(super) fn hold_for_discard(&mut self, epoch: u64, cluster: u64) {
        if self.clusters.insert(cluster) {
            self.to_discard.push(cluster);
            self.to_discard_epoch = self.to_discard_epoch.max(epoch);
        }
    }

    /// The clusters to discard now, in runs (first, count), and the latest
    /// epoch one of them was freed in.
    pub(super) fn take_discards(&mut self) -> (Vec<(u64, u64)>, u64) {
        let mut clusters = std::mem::take(&mut self.to_discard);
        clusters.sort_unstable();
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for cluster in clusters {
            match runs.last_mut() {
                Some((first, count)) if *first + *count == cluster => *count += 1,
                _ => runs.push((cluster, 1)),
            }
        }
        (runs, self.to_discard_epoch)
    }

    /// The clusters of `runs` are discarded: they wait like the others,
    /// as freed in `epoch`.
    pub(super) fn discarded(&mut self, epoch: u64, runs: &[(u64, u64)]) {
        let clusters = runs.iter().flat_map(|&(first, count)| first..first + count);
        self.held.extend(clusters.map(|cluster| (epoch, cluster)));
    }

    pub(super) fn holds(&self, cluster: u64) -> bool {
        !self.clusters.is_empty() && self.clusters.contains(&cluster)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Lets go of the clusters freed before epoch `oldest` (no request
    /// from then is in flight); the lowest of them, if any.
    pub(super) fn release(&mut self, oldest: u64) -> Option<u64> {
        let mut lowest = None;
        while let Some(&(_, cluster)) = self.held.front().filter(|&&(epoch, _)| epoch < oldest) {
            self.held.pop_front();
            self.clusters.remove(&cluster);
            lowest = Some(lowest.map_or(cluster, |l: u64| l.min(cluster)));
        }
        lowest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pin_holds_the_oldest_epoch_in_flight() {
        let epochs = Arc::new(Epochs::default());
        let mut pin = epochs.pin(4);
        assert_eq!(epochs.oldest_in_use(), IDLE);
        pin.enter(0);
        assert_eq!(epochs.oldest_in_use(), 0, "published as the queue leaves idle");
        epochs.advance();
        pin.enter(1);
        pin.settle();
        pin.enter(2);
        pin.leave(1);
        pin.settle();
        assert_eq!(epochs.oldest_in_use(), 0, "request 0 is still in flight");
        pin.leave(0);
        pin.settle();
        assert_eq!(epochs.oldest_in_use(), 1, "request 2 joined once the queue saw epoch 1");
        pin.enter(3);
        pin.leave(2);
        pin.settle();
        assert_eq!(epochs.oldest_in_use(), 1, "request 3 joined in epoch 1");
        epochs.advance();
        pin.settle();
        pin.enter(0);
        pin.leave(3);
        pin.settle();
        assert_eq!(epochs.oldest_in_use(), 2);
        pin.leave(0);
        pin.settle();
        assert_eq!(epochs.oldest_in_use(), IDLE);
        drop(pin);
        let mut other = epochs.pin(1);
        other.enter(0);
        assert_eq!(epochs.oldest_in_use(), 2, "a dropped queue's pin is gone");
    }

    #[test]
    fn clusters_leave_quarantine_once_nothing_from_their_epoch_is_in_flight() {
        let mut q = Quarantine::default();
        q.hold(3, 40);
        q.hold(3, 12);
        q.hold(5, 7);
        assert!(q.holds(12) && q.holds(7) && !q.holds(8));
        assert_eq!(q.release(3), None, "epoch 3 still in flight");
        assert_eq!(q.release(4), Some(12));
        assert!(!q.holds(40) && q.holds(7));
        assert_eq!(q.release(IDLE), Some(7));
        assert!(q.is_empty());
    }

    #[test]
    fn clusters_to_discard_are_held_until_discarded_then_wait_like_the_others() {
        let mut q = Quarantine::default();
        for (epoch, cluster) in [(5, 9), (6, 4), (6, 5), (7, 6), (7, 12)] {
            q.hold_for_discard(epoch, cluster);
        }
        assert!(q.holds(5) && q.holds(12));
        assert_eq!(q.release(IDLE), None, "not before their discard");
        let (runs, epoch) = q.take_discards();
        assert_eq!((&runs[..], epoch), (&[(4, 3), (9, 1), (12, 1)][..], 7));
        assert!(q.holds(4), "held while the discard runs");
        q.discarded(7, &runs);
        assert_eq!(q.release(7), None);
        assert_eq!(q.release(8), Some(4));
        assert!(!q.holds(12) && q.is_empty());
    }
}
