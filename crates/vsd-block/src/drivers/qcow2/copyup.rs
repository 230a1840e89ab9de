//! Allocations waiting for the old bytes their new contents keep.
//!
//! A write into part of a cluster the image does not own yet (an overlay's
//! cluster still in its backing file, a compressed cluster, one shared
//! with a snapshot) gets a new cluster whose contents are the old bytes
//! around the request's. The queue reads those old bytes as child
//! requests among the others, with the metadata mutex free, and keeps the
//! allocation here until every read is back; then the request's bytes go
//! in and the contents are written.

use vsd_engine::IoVecs;
use vsd_qcow2::Allocation;

/// An allocation whose old bytes are being read.
pub(super) struct CopyUp {
    /// The guest request it is a part of.
    pub(super) parent: u32,
    /// The request's guest offset and buffers.
    pub(super) offset: u64,
    pub(super) iov: IoVecs,
    pub(super) allocation: Allocation,
    /// Reads still out.
    reads: u32,
    /// Whether one of them failed.
    pub(super) failed: bool,
}

/// The copy-ups in flight on a queue, by slot.
#[derive(Default)]
pub(super) struct CopyUps {
    slots: Vec<Option<CopyUp>>,
    free: Vec<usize>,
}

impl CopyUps {
    /// Keeps `allocation` of request `parent` (at `offset`, in buffers
    /// `iov`) until `reads` reads of its old bytes are back; its slot.
    pub(super) fn insert(
        &mut self,
        parent: u32,
        offset: u64,
        iov: IoVecs,
        allocation: Allocation,
        reads: u32,
    ) -> usize {
        let copy = CopyUp { parent, offset, iov, allocation, reads, failed: false };
        match self.free.pop() {
            Some(slot) => {
                self.slots[slot] = Some(copy);
                slot
            }
            None => {
                self.slots.push(Some(copy));
                self.slots.len() - 1
            }
        }
    }

    /// One read of slot `slot` is back, failed unless `errno` is 0: the
    /// copy-up, once it was the last.
    pub(super) fn read_done(&mut self, slot: usize, errno: i32) -> Option<CopyUp> {
        let copy = self.slots[slot].as_mut().expect("a read belongs to a copy-up in flight");
        copy.reads -= 1;
        copy.failed |= errno != 0;
        if copy.reads > 0 {
            return None;
        }
        self.free.push(slot);
        self.slots[slot].take()
    }
}
