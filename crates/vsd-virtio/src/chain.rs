//! Descriptor chains of a split virtqueue, walked from their head.
//!
//! virtio-queue walks chains too, but reads every descriptor through
//! vm-memory's generic accessors; this walker reads them through
//! [`GuestRam`] (see there for why) and follows the same rules: the chain
//! ends at a descriptor without NEXT, at an index past its table, after as
//! many descriptors as the table holds (a loop), at a descriptor it cannot
//! read, or at one that takes the chain past 4 GiB in all (which drivers
//! must not build, VIRTIO 1.2 2.7.5.2); an indirect descriptor switches to its table (one level
//! only, a whole and non-zero number of descriptors).

use virtio_queue::desc::split::Descriptor;

use crate::ram::GuestRam;

/// Bytes per descriptor in a split ring's table.
const DESC_LEN: u64 = 16;

/// The descriptors of the chain at `head` of a descriptor table.
pub struct Chain<'m> {
    ram: &'m GuestRam,
    table: u64,
    len: u16,
    next: u16,
    /// Descriptors left before the walk gives up (a looping chain).
    ttl: u16,
    indirect: bool,
    /// Bytes of the descriptors yielded so far.
    bytes: u32,
}

impl<'m> Chain<'m> {
    /// The chain at `head` of the table at guest address `table`, of
    /// `queue_size` entries.
    pub fn new(ram: &'m GuestRam, table: u64, queue_size: u16, head: u16) -> Self {
        Self { ram, table, len: queue_size, next: head, ttl: queue_size, indirect: false, bytes: 0 }
    }

    fn read(&self, index: u16) -> Option<Descriptor> {
        let at = self.table.checked_add(u64::from(index) * DESC_LEN)?;
        // addr: u64, then len: u32, flags: u16, next: u16, little-endian.
        let [addr, rest] = self.ram.read_words::<2>(at)?;
        Some(Descriptor::new(addr, rest as u32, (rest >> 32) as u16, (rest >> 48) as u16))
    }
}

impl Iterator for Chain<'_> {
    type Item = Descriptor;

    fn next(&mut self) -> Option<Descriptor> {
        loop {
            if self.ttl == 0 || self.next >= self.len {
                return None;
            }
            let Some(desc) = self.read(self.next) else {
                self.ttl = 0;
                return None;
            };
            if desc.refers_to_indirect_table() {
                let entries = desc.len() / DESC_LEN as u32;
                if self.indirect
                    || !desc.len().is_multiple_of(DESC_LEN as u32)
                    || entries == 0
                    || entries > u32::from(u16::MAX)
                {
                    self.ttl = 0;
                    return None;
                }
                (self.table, self.len, self.next, self.ttl) = (desc.addr().0, entries as u16, 0, entries as u16);
                self.indirect = true;
                continue;
            }
            let Some(bytes) = self.bytes.checked_add(desc.len()) else {
                self.ttl = 0;
                return None;
            };
            self.bytes = bytes;
            if desc.has_next() {
                self.next = desc.next();
                self.ttl -= 1;
            } else {
                self.ttl = 0;
            }
            return Some(desc);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    use super::*;

    fn put(ram: &GuestRam, table: u64, index: u16, desc: Descriptor) {
        ram.memory().write_obj(desc, GuestAddress(table + 16 * u64::from(index))).unwrap();
    }

    fn addrs(ram: &GuestRam, table: u64, size: u16, head: u16) -> Vec<u64> {
        Chain::new(ram, table, size, head).map(|d| d.addr().0).collect()
    }

    #[test]
    fn chains_are_walked_from_their_head() {
        let ram = GuestRam::new(Arc::new(GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap()));
        let (next, write) = (VRING_DESC_F_NEXT as u16, VRING_DESC_F_WRITE as u16);
        put(&ram, 0, 5, Descriptor::new(0x1000, 16, next, 2));
        put(&ram, 0, 2, Descriptor::new(0x2000, 512, next | write, 7));
        put(&ram, 0, 7, Descriptor::new(0x3000, 1, write, 0));
        assert_eq!(addrs(&ram, 0, 8, 5), [0x1000, 0x2000, 0x3000]);
        let d: Vec<_> = Chain::new(&ram, 0, 8, 5).collect();
        assert_eq!((d[1].len(), d[1].flags(), d[1].next()), (512, next | write, 7), "every field read back");
        // Indirect: the head points at a table of two.
        put(&ram, 0, 3, Descriptor::new(0x4000, 32, VRING_DESC_F_INDIRECT as u16, 0));
        put(&ram, 0x4000, 0, Descriptor::new(0x5000, 16, next, 1));
        put(&ram, 0x4000, 1, Descriptor::new(0x6000, 1, write, 0));
        assert_eq!(addrs(&ram, 0, 8, 3), [0x5000, 0x6000]);
        // An indirect table inside an indirect table, or of no whole
        // descriptors, ends the chain.
        put(&ram, 0x4000, 1, Descriptor::new(0x4000, 32, VRING_DESC_F_INDIRECT as u16, 0));
        assert_eq!(addrs(&ram, 0, 8, 3), [0x5000]);
        put(&ram, 0, 3, Descriptor::new(0x4000, 24, VRING_DESC_F_INDIRECT as u16, 0));
        assert!(addrs(&ram, 0, 8, 3).is_empty());
        // A chain ends before the descriptor that takes it past 4 GiB.
        put(&ram, 0, 6, Descriptor::new(0x1000, u32::MAX - 9, next, 7));
        put(&ram, 0, 7, Descriptor::new(0x2000, 10, write, 0));
        assert_eq!(addrs(&ram, 0, 8, 6), [0x1000]);
        put(&ram, 0, 7, Descriptor::new(0x2000, 9, write, 0));
        assert_eq!(addrs(&ram, 0, 8, 6), [0x1000, 0x2000], "exactly 4 GiB - 1");
        // A loop ends after the table's size; a head past the table yields nothing.
        put(&ram, 0, 1, Descriptor::new(0x1000, 1, next, 1));
        assert_eq!(Chain::new(&ram, 0, 8, 1).count(), 8);
        assert_eq!(Chain::new(&ram, 0, 8, 8).count(), 0);
        // A table running off guest memory ends the chain where it does.
        put(&ram, 0, 4, Descriptor::new(0x1000, 1, next, 1));
        assert!(addrs(&ram, 0xfff0, 8, 1).is_empty());
        assert_eq!(addrs(&ram, u64::MAX - 15, 8, 0), Vec::<u64>::new(), "past the address space");
    }
}
