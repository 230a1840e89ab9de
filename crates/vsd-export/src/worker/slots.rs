//! A queue's request slots: what a request holds from the ring to its
//! completion, one slot per ring entry, all allocated when the queue
//! starts. A slot's index is the request's tag for the engine.

use std::sync::Arc;

use vsd_trace::OpKind;
use vsd_virtio::ram::GuestRam;
use vsd_virtio::request::MAX_IOVECS;

use super::trace::Stamps;

/// Per-request state, kept from pop to completion.
pub(super) struct Slot {
    pub(super) head: u16,
    /// The status byte, in guest memory that `ram` keeps mapped.
    pub(super) status: *mut u8,
    pub(super) used_len: u32,
    pub(super) kind: OpKind,
    pub(super) bytes: u64,
    pub(super) stamps: Stamps,
    /// Keeps the guest memory the request points into mapped until it
    /// completes, even if the front-end replaces the memory table meanwhile.
    pub(super) ram: Option<Arc<GuestRam>>,
}

impl Slot {
    fn idle() -> Self {
        Self {
            head: 0,
            status: std::ptr::null_mut(),
            used_len: 0,
            kind: OpKind::Flush,
            bytes: 0,
            stamps: Stamps::default(),
            ram: None,
        }
    }
}

/// One iovec array per slot: a request's scatter list, in guest memory.
pub(super) type IoVecArray = [libc::iovec; MAX_IOVECS];

/// The slots of one queue and which of them are free.
pub(super) struct Slots {
    slots: Vec<Slot>,
    iovecs: Vec<IoVecArray>,
    free: Vec<u16>,
}

// SAFETY: the raw pointers in the slots and their iovecs point into guest
// memory that each slot's `ram` keeps mapped; the slots are used only by
// the thread that owns the queue's worker.
unsafe impl Send for Slots {}

impl Slots {
    /// `depth` free slots (the ring's size).
    pub(super) fn new(depth: u16) -> Self {
        let empty = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
        Self {
            slots: (0..depth).map(|_| Slot::idle()).collect(),
            iovecs: vec![[empty; MAX_IOVECS]; usize::from(depth)],
            // Popped from the end: tag 0 first.
            free: (0..depth).rev().collect(),
        }
    }

    /// A free slot's tag, if any.
    pub(super) fn take(&mut self) -> Option<u16> {
        self.free.pop()
    }

    /// Frees slot `tag`.
    pub(super) fn release(&mut self, tag: u16) {
        self.free.push(tag);
    }

    /// How many slots hold a request.
    pub(super) fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Whether a slot is free.
    pub(super) fn has_free(&self) -> bool {
        !self.free.is_empty()
    }

    pub(super) fn slot(&self, tag: u16) -> &Slot {
        &self.slots[usize::from(tag)]
    }

    pub(super) fn slot_mut(&mut self, tag: u16) -> &mut Slot {
        &mut self.slots[usize::from(tag)]
    }

    pub(super) fn iovecs(&self, tag: u16) -> &IoVecArray {
        &self.iovecs[usize::from(tag)]
    }

    pub(super) fn iovecs_mut(&mut self, tag: u16) -> &mut IoVecArray {
        &mut self.iovecs[usize::from(tag)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_slot_is_handed_out_once_until_released() {
        let mut slots = Slots::new(4);
        let tags: Vec<u16> = std::iter::from_fn(|| slots.take()).collect();
        assert_eq!(tags, [0, 1, 2, 3], "each slot once, tag 0 first");
        assert_eq!((slots.in_flight(), slots.has_free()), (4, false));
        slots.release(2);
        assert_eq!((slots.in_flight(), slots.has_free()), (3, true));
        assert_eq!(slots.take(), Some(2), "a released slot is handed out again");
        assert_eq!(slots.take(), None);
    }

    #[test]
    fn a_slot_keeps_what_its_request_put_in_it() {
        let mut slots = Slots::new(2);
        let tag = slots.take().unwrap();
        slots.slot_mut(tag).head = 7;
        slots.iovecs_mut(tag)[0].iov_len = 4096;
        assert_eq!(slots.slot(tag).head, 7);
        assert_eq!(slots.iovecs(tag)[0].iov_len, 4096);
        assert_eq!(slots.iovecs(1 - tag)[0].iov_len, 0, "slots do not share iovecs");
    }
}
