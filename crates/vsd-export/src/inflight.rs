//! Inflight I/O tracking (vhost-user INFLIGHT_SHMFD, split virtqueues), so
//! that a back-end killed mid-I/O and restarted loses no request.
//!
//! The front-end asks for a shared memory region (GET_INFLIGHT_FD), keeps
//! its descriptor across back-end restarts and hands it to every back-end
//! it connects to (SET_INFLIGHT_FD). Per queue, at a 64-byte aligned offset
//! (queue `q` at `q * queue_region_len(queue_size)`), the region holds the
//! layout of the vhost-user specification ("Inflight I/O tracking"):
//!
//! ```text
//! header   features u64 | version u16 | desc_num u16 | last_batch_head u16 | used_idx u16
//! desc[i]  inflight u8 | padding [u8; 5] | next u16 | counter u64     (i < desc_num)
//! ```
//!
//! While a queue runs, a request's head is marked inflight (with a counter
//! that grows with each request) when it is taken from the available ring
//! ([`InflightQueue::begin`]). Publishing it goes: `last_batch_head = head`
//! ([`InflightQueue::publishing`]), the used entry and the used index
//! (virtio-queue's `add_used`), then `inflight = 0` and `used_idx = the used
//! index` ([`InflightQueue::published`]). A back-end killed between the used
//! index and the clearing leaves the region's `used_idx` behind the ring's,
//! which tells the next back-end that `last_batch_head` was in fact
//! published ([`InflightQueue::recover`]).
//!
//! Only the ordering of stores in program order matters here: the region
//! lives on in the kernel when the process dies, with every store the
//! process executed. They are release stores, so neither the compiler nor
//! the CPU moves an earlier store (the used index) after them; on x86 each
//! is a plain `mov`.

use std::fs::File;
use std::io;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU16, AtomicU64, Ordering};

use vhost::vhost_user::message::VhostUserInflight;
use vm_memory::FileOffset;
use vm_memory::mmap::MmapRegion;

/// The layout version written into a queue's header once it is in use; a
/// region fresh from GET_INFLIGHT_FD reads 0.
const VERSION: u16 = 1;
const HEADER_LEN: usize = 16;
const DESC_LEN: usize = 16;
const QUEUE_ALIGN: usize = 64;

// Header fields.
const VERSION_AT: usize = 8;
const DESC_NUM_AT: usize = 10;
const LAST_BATCH_HEAD_AT: usize = 12;
const USED_IDX_AT: usize = 14;
// Descriptor state fields, from the state's start.
const INFLIGHT_AT: usize = 0;
const COUNTER_AT: usize = 8;

/// Bytes one queue takes in the region.
pub(crate) fn queue_region_len(queue_size: u16) -> usize {
    (HEADER_LEN + DESC_LEN * usize::from(queue_size)).next_multiple_of(QUEUE_ALIGN)
}

/// A new region for GET_INFLIGHT_FD: a memfd of `num_queues` zeroed queue
/// states, and its description for the front-end.
pub(crate) fn create(num_queues: u16, queue_size: u16) -> io::Result<(VhostUserInflight, File)> {
    let size = queue_region_len(queue_size) * usize::from(num_queues);
    let file = vsd_sys::memfd("vsd-inflight")?;
    file.set_len(size as u64)?;
    Ok((VhostUserInflight::new(size as u64, 0, num_queues, queue_size), file))
}

/// A region handed over with SET_INFLIGHT_FD, mapped.
pub(crate) struct InflightRegion {
    map: MmapRegion,
    num_queues: u16,
    queue_size: u16,
}

impl InflightRegion {
    pub(crate) fn map(file: File, info: &VhostUserInflight) -> io::Result<Self> {
        let invalid = |why: &str| io::Error::new(io::ErrorKind::InvalidInput, format!("inflight region: {why}"));
        let (num_queues, queue_size) = (info.num_queues, info.queue_size);
        if num_queues == 0 || queue_size == 0 {
            return Err(invalid("no queues"));
        }
        let needed = (queue_region_len(queue_size) * usize::from(num_queues)) as u64;
        if info.mmap_size < needed {
            return Err(invalid(&format!("{} bytes, {needed} needed", info.mmap_size)));
        }
        if file.metadata()?.len() < info.mmap_offset.saturating_add(needed) {
            return Err(invalid("the file is smaller than the region"));
        }
        let map = MmapRegion::from_file(FileOffset::new(file, info.mmap_offset), needed as usize)
            .map_err(|e| invalid(&e.to_string()))?;
        Ok(Self { map, num_queues, queue_size })
    }

    /// Queue `index`'s part, for a ring of `size` entries; `None` if the
    /// region has no room for it.
    pub(crate) fn queue(self: &Arc<Self>, index: u16, size: u16) -> Option<InflightQueue> {
        if index >= self.num_queues || size > self.queue_size {
            return None;
        }
        let offset = usize::from(index) * queue_region_len(self.queue_size);
        // SAFETY: `offset` plus one queue's length is within the mapping
        // (checked in `map`), and the mapping is not null.
        let base = unsafe { NonNull::new_unchecked(self.map.as_ptr().add(offset)) };
        // SAFETY: as above: one queue's states, 64-byte aligned (the mapping
        // is page-aligned), kept mapped by the `Arc` the queue holds.
        Some(unsafe { InflightQueue::new(base, self.queue_size, Some(self.clone())) })
    }
}

/// What a restarted back-end must do for a queue.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Recovery {
    /// Where to take the next request from the available ring: every entry
    /// before it was taken by a previous back-end, and is either published
    /// in the used ring or listed in `resubmit`.
    pub(crate) next_avail: u16,
    /// Heads taken but never published, oldest first: serve them again.
    pub(crate) resubmit: Vec<u16>,
}

/// One queue's part of the region, as its worker writes it.
pub(crate) struct InflightQueue {
    base: NonNull<u8>,
    desc_num: u16,
    counter: u64,
    /// Keeps the mapping alive.
    _region: Option<Arc<InflightRegion>>,
}

// SAFETY: the pointer is into a shared mapping that `_region` keeps alive
// (or, in tests, a buffer that outlives the queue); only the worker that
// owns this value writes through it.
unsafe impl Send for InflightQueue {}

impl InflightQueue {
    /// # Safety
    /// `base` must point to `queue_region_len(desc_num)` bytes, 8-byte
    /// aligned, that stay valid (kept alive by `region`, or by the caller)
    /// as long as this value, and that only atomics access meanwhile.
    unsafe fn new(base: NonNull<u8>, desc_num: u16, region: Option<Arc<InflightRegion>>) -> Self {
        let mut queue = Self { base, desc_num, counter: 0, _region: region };
        // Continue after the newest request still marked, if any.
        queue.counter = (0..desc_num).filter(|&i| queue.is_inflight(i)).map(|i| queue.counter_of(i)).max().unwrap_or(0);
        queue
    }

    fn u8_at(&self, offset: usize) -> &AtomicU8 {
        debug_assert!(offset < queue_region_len(self.desc_num));
        // SAFETY: callers pass offsets of fields inside this queue's states
        // (`new`'s contract), which only atomics access.
        unsafe { AtomicU8::from_ptr(self.base.as_ptr().add(offset)) }
    }

    fn u16_at(&self, offset: usize) -> &AtomicU16 {
        debug_assert!(offset + 2 <= queue_region_len(self.desc_num) && offset.is_multiple_of(2));
        // SAFETY: as in `u8_at`; every u16 field is 2-byte aligned.
        unsafe { AtomicU16::from_ptr(self.base.as_ptr().add(offset).cast()) }
    }

    fn u64_at(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset + 8 <= queue_region_len(self.desc_num) && offset.is_multiple_of(8));
        // SAFETY: as in `u8_at`; every u64 field is 8-byte aligned.
        unsafe { AtomicU64::from_ptr(self.base.as_ptr().add(offset).cast()) }
    }

    fn desc(head: u16) -> usize {
        HEADER_LEN + DESC_LEN * usize::from(head)
    }

    fn is_inflight(&self, head: u16) -> bool {
        self.u8_at(Self::desc(head) + INFLIGHT_AT).load(Ordering::Acquire) != 0
    }

    fn counter_of(&self, head: u16) -> u64 {
        self.u64_at(Self::desc(head) + COUNTER_AT).load(Ordering::Acquire)
    }

    /// `head` was taken from the available ring.
    #[inline]
    pub(crate) fn begin(&mut self, head: u16) {
        if head < self.desc_num {
            self.counter += 1;
            let desc = Self::desc(head);
            self.u64_at(desc + COUNTER_AT).store(self.counter, Ordering::Release);
            self.u8_at(desc + INFLIGHT_AT).store(1, Ordering::Release);
        }
    }

    /// `head` is about to be added to the used ring.
    #[inline]
    pub(crate) fn publishing(&self, head: u16) {
        self.u16_at(LAST_BATCH_HEAD_AT).store(head, Ordering::Release);
    }

    /// `head` is in the used ring, whose index is now `used_idx`.
    #[inline]
    pub(crate) fn published(&self, head: u16, used_idx: u16) {
        if head < self.desc_num {
            self.u8_at(Self::desc(head) + INFLIGHT_AT).store(0, Ordering::Release);
        }
        self.u16_at(USED_IDX_AT).store(used_idx, Ordering::Release);
    }

    /// Before a queue of `size` entries, whose used ring's index is
    /// `used_idx`, starts: brings the region in line with the used ring and
    /// says what a previous back-end left undone. `None` for a region
    /// never used (fresh from GET_INFLIGHT_FD), which this initialises: the
    /// front-end's ring base is then right.
    pub(crate) fn recover(&mut self, used_idx: u16, size: u16) -> Option<Recovery> {
        self.u16_at(DESC_NUM_AT).store(self.desc_num, Ordering::Release);
        if self.u16_at(VERSION_AT).load(Ordering::Acquire) == 0 {
            self.u16_at(USED_IDX_AT).store(used_idx, Ordering::Release);
            self.u16_at(LAST_BATCH_HEAD_AT).store(0, Ordering::Release);
            self.u16_at(VERSION_AT).store(VERSION, Ordering::Release);
            self.counter = 0;
            return None;
        }
        if self.u16_at(USED_IDX_AT).load(Ordering::Acquire) != used_idx {
            // The last head published reached the used ring but was not
            // cleared here: it is done.
            let last = self.u16_at(LAST_BATCH_HEAD_AT).load(Ordering::Acquire);
            if last < self.desc_num {
                self.u8_at(Self::desc(last) + INFLIGHT_AT).store(0, Ordering::Release);
            }
            self.u16_at(USED_IDX_AT).store(used_idx, Ordering::Release);
        }
        let mut pending: Vec<(u64, u16)> = Vec::new();
        for head in (0..self.desc_num).filter(|&h| self.is_inflight(h)) {
            if head < size {
                pending.push((self.counter_of(head), head));
            } else {
                // Not a head of this ring: nothing to serve.
                self.u8_at(Self::desc(head) + INFLIGHT_AT).store(0, Ordering::Release);
            }
        }
        pending.sort_unstable();
        self.counter = pending.last().map_or(0, |&(counter, _)| counter);
        Some(Recovery {
            next_avail: used_idx.wrapping_add(pending.len() as u16),
            resubmit: pending.into_iter().map(|(_, head)| head).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A queue's states in an ordinary buffer.
    struct Buffer(Vec<u64>);

    impl Buffer {
        fn new(desc_num: u16) -> Self {
            Self(vec![0; queue_region_len(desc_num) / 8])
        }

        fn queue(&mut self, desc_num: u16) -> InflightQueue {
            let base = NonNull::new(self.0.as_mut_ptr().cast::<u8>()).unwrap();
            // SAFETY: the buffer is large enough, 8-byte aligned, and every
            // test drops the queue before reading the buffer.
            unsafe { InflightQueue::new(base, desc_num, None) }
        }

        fn bytes(&self) -> Vec<u8> {
            self.0.iter().flat_map(|w| w.to_ne_bytes()).collect()
        }

        fn u16_at(&self, offset: usize) -> u16 {
            let b = self.bytes();
            u16::from_le_bytes([b[offset], b[offset + 1]])
        }

        fn inflight(&self, head: u16) -> bool {
            self.bytes()[HEADER_LEN + DESC_LEN * usize::from(head)] != 0
        }
    }

    /// A running back-end's bookkeeping of one request.
    fn serve(queue: &mut InflightQueue, used: &mut u16, head: u16) {
        queue.publishing(head);
        *used = used.wrapping_add(1); // add_used
        queue.published(head, *used);
    }

    #[test]
    fn layout_is_the_specification_s() {
        assert_eq!(queue_region_len(128), 2112);
        assert_eq!(queue_region_len(1), 64);
        let mut buf = Buffer::new(8);
        let mut q = buf.queue(8);
        assert_eq!(q.recover(5, 8), None, "a fresh region has nothing to recover");
        q.begin(3);
        q.begin(6);
        q.publishing(6);
        q.published(6, 6);
        drop(q);
        let bytes = buf.bytes();
        assert_eq!(buf.u16_at(VERSION_AT), VERSION);
        assert_eq!(buf.u16_at(DESC_NUM_AT), 8);
        assert_eq!(buf.u16_at(LAST_BATCH_HEAD_AT), 6);
        assert_eq!(buf.u16_at(USED_IDX_AT), 6);
        let desc3 = &bytes[HEADER_LEN + 3 * DESC_LEN..HEADER_LEN + 4 * DESC_LEN];
        assert_eq!(desc3[0], 1, "inflight byte first");
        assert_eq!(u64::from_le_bytes(desc3[8..16].try_into().unwrap()), 1, "counter at offset 8");
        assert!(!buf.inflight(6));
        assert_eq!(u64::from_le_bytes(bytes[HEADER_LEN + 6 * DESC_LEN + 8..][..8].try_into().unwrap()), 2);
    }

    #[test]
    fn requests_in_flight_at_a_crash_are_resubmitted_oldest_first() {
        let mut buf = Buffer::new(16);
        let mut q = buf.queue(16);
        let mut used = 100u16;
        assert_eq!(q.recover(used, 16), None);
        // Taken in this order from avail entries 100..106; 9 and 2 finish.
        for head in [7, 2, 9, 0, 15, 4] {
            q.begin(head);
        }
        serve(&mut q, &mut used, 9);
        serve(&mut q, &mut used, 2);
        drop(q); // killed
        let mut q = buf.queue(16);
        let r = q.recover(used, 16).expect("a used region");
        assert_eq!(r, Recovery { next_avail: 106, resubmit: vec![7, 0, 15, 4] });
        // The new back-end's requests come after the resubmitted ones.
        q.begin(9);
        drop(q);
        let mut q = buf.queue(16);
        q.publishing(7);
        q.published(7, 103);
        let r = q.recover(103, 16).unwrap();
        assert_eq!(r.resubmit, vec![0, 15, 4, 9]);
        assert_eq!(r.next_avail, 107);
    }

    #[test]
    fn a_head_published_but_not_cleared_is_not_resubmitted() {
        let mut buf = Buffer::new(8);
        let mut q = buf.queue(8);
        let used = 0xffffu16;
        q.recover(used, 8);
        q.begin(1);
        q.begin(5);
        // Killed after add_used moved the used index, before the clearing.
        q.publishing(5);
        let used = used.wrapping_add(1);
        drop(q);
        let mut q = buf.queue(8);
        assert_eq!(q.recover(used, 8), Some(Recovery { next_avail: 1, resubmit: vec![1] }));
        drop(q);
        assert!(!buf.inflight(5));
        assert_eq!(buf.u16_at(USED_IDX_AT), used, "the region caught up with the ring");
    }

    #[test]
    fn a_head_about_to_be_published_is_resubmitted() {
        let mut buf = Buffer::new(8);
        let mut q = buf.queue(8);
        q.recover(3, 8);
        q.begin(2);
        q.begin(4);
        serve(&mut q, &mut 3, 2);
        // Killed after naming the head, before add_used.
        q.publishing(4);
        drop(q);
        let mut q = buf.queue(8);
        assert_eq!(q.recover(4, 8), Some(Recovery { next_avail: 5, resubmit: vec![4] }));
    }

    #[test]
    fn a_restart_with_nothing_in_flight_keeps_the_used_index() {
        let mut buf = Buffer::new(4);
        let mut q = buf.queue(4);
        let mut used = 0;
        q.recover(used, 4);
        for head in [0, 1, 2, 3, 0, 1] {
            q.begin(head);
            serve(&mut q, &mut used, head);
        }
        drop(q);
        let mut q = buf.queue(4);
        assert_eq!(q.recover(used, 4), Some(Recovery { next_avail: 6, resubmit: vec![] }));
    }

    #[test]
    fn heads_outside_a_smaller_ring_and_the_table_are_ignored() {
        let mut buf = Buffer::new(8);
        let mut q = buf.queue(8);
        q.recover(0, 8);
        q.begin(6);
        q.begin(1);
        q.begin(8); // not a descriptor of the region: ignored
        q.publishing(8);
        q.published(8, 0);
        drop(q);
        let mut q = buf.queue(8);
        assert_eq!(q.recover(0, 4), Some(Recovery { next_avail: 1, resubmit: vec![1] }));
    }

    #[test]
    fn counters_continue_after_the_newest_request_in_flight() {
        let mut buf = Buffer::new(8);
        let mut q = buf.queue(8);
        q.recover(0, 8);
        for head in 0..5 {
            q.begin(head);
        }
        drop(q);
        let q = buf.queue(8);
        assert_eq!(q.counter, 5);
    }

    #[test]
    fn region_from_a_memfd_round_trips() {
        let (info, file) = create(2, 128).unwrap();
        assert_eq!(info.mmap_size, 2 * 2112);
        let region = Arc::new(InflightRegion::map(file.try_clone().unwrap(), &info).unwrap());
        let mut q1 = region.queue(1, 128).unwrap();
        assert!(region.queue(2, 128).is_none() && region.queue(0, 256).is_none());
        q1.recover(0, 128);
        q1.begin(77);
        drop((q1, region));
        // The next back-end maps the same file.
        let region = Arc::new(InflightRegion::map(file, &info).unwrap());
        let r = region.queue(1, 128).unwrap().recover(0, 128).unwrap();
        assert_eq!(r, Recovery { next_avail: 1, resubmit: vec![77] });
        assert_eq!(region.queue(0, 128).unwrap().recover(0, 128), None, "queue 0 untouched");
        let short = VhostUserInflight::new(100, 0, 2, 128);
        assert!(InflightRegion::map(vsd_sys::memfd("t").unwrap(), &short).is_err());
    }
}
