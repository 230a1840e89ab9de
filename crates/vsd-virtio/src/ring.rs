//! A split virtqueue as its device side uses it: the available ring read
//! for new heads, the used ring written with finished ones, and the event
//! fields that decide who notifies whom.
//!
//! Why not virtio-queue's `Queue`: it reaches every ring field through
//! vm-memory's generic accessors, which made taking and returning a request
//! 580 of its 2300 instructions (callgrind, BENCHMARKS.md). This reads and
//! writes them through [`GuestRam`] with the same checks and the same
//! memory ordering: one access each (an atomic one for the 16-bit indices
//! and event fields the guest writes meanwhile), an acquire fence after reading
//! the available index, a release fence before publishing the used index,
//! and a full fence between publishing and reading the guest's event index.
//! The chains themselves are walked by [`crate::chain::Chain`].

use std::num::Wrapping;
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};

use virtio_bindings::virtio_ring::VRING_USED_F_NO_NOTIFY;

use crate::chain::Chain;
use crate::dirty_log::DirtyLog;
use crate::ram::GuestRam;

/// The largest queue a front-end may set up (virtio allows 32768; QEMU's
/// devices and libvhost-user stop at 1024).
pub const MAX_QUEUE_SIZE: u16 = 1024;

/// What can be wrong with a ring the front-end set up or the guest wrote.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RingError {
    /// The front-end set a size the spec does not allow.
    #[error("queue size {0} is not a power of two up to {MAX_QUEUE_SIZE}")]
    Size(u16),
    /// A ring misaligned, or reaching outside guest memory.
    #[error("the {0} at {1:#x} is misaligned or not inside guest memory")]
    Placement(&'static str, u64),
    /// The guest's available index runs further ahead than the ring holds.
    #[error("the available index is {0} entries ahead of the device, more than the ring holds")]
    AvailTooFar(u16),
    /// An available entry names no descriptor of the table.
    #[error("the available ring names descriptor {0}, past the table")]
    HeadOutOfRange(u16),
    /// A ring field became unreachable (the memory map changed under it).
    #[error("the rings are no longer inside guest memory")]
    Unreadable,
}

/// Bytes of a ring's flags and index fields, ahead of its entries.
const HEADER: u64 = 4;
const AVAIL_ENTRY: u64 = 2;
const USED_ENTRY: u64 = 8;
const DESC_ENTRY: u64 = 16;

/// One split virtqueue's rings and the device's place in them.
#[derive(Debug)]
pub struct SplitQueue {
    size: u16,
    desc_table: u64,
    avail_ring: u64,
    used_ring: u64,
    event_idx: bool,
    next_avail: Wrapping<u16>,
    next_used: Wrapping<u16>,
    /// Used entries published since the guest was last considered for a
    /// notification.
    unnotified: Wrapping<u16>,
    /// During a migration: the dirty log, and the guest address at which
    /// the front-end wants the used ring's writes logged.
    used_log: Option<(Arc<DirtyLog>, u64)>,
    /// The used entries before this one are marked in the log.
    logged_used: Wrapping<u16>,
}

impl SplitQueue {
    /// The queue of `size` entries whose descriptor table, available and
    /// used rings are at guest addresses `rings`, resuming at available
    /// entry `next_avail`; `event_idx` if VIRTIO_RING_F_EVENT_IDX was
    /// negotiated. The used index is read from guest memory: after a
    /// reconnect, a previous back-end may have published entries this one
    /// never saw.
    pub fn new(
        size: u16,
        rings: [u64; 3],
        next_avail: u16,
        event_idx: bool,
        ram: &GuestRam,
    ) -> Result<Self, RingError> {
        if size == 0 || size > MAX_QUEUE_SIZE || !size.is_power_of_two() {
            return Err(RingError::Size(size));
        }
        let n = u64::from(size);
        let [desc_table, avail_ring, used_ring] = rings;
        // The spec's alignments, and the extents including the event fields.
        for (what, addr, align, len) in [
            ("descriptor table", desc_table, 16, DESC_ENTRY * n),
            ("available ring", avail_ring, 2, HEADER + AVAIL_ENTRY * n + 2),
            ("used ring", used_ring, 4, HEADER + USED_ENTRY * n + 2),
        ] {
            if !addr.is_multiple_of(align) || !ram.pieces(addr, len, |_, _| true) {
                return Err(RingError::Placement(what, addr));
            }
        }
        let mut queue = Self {
            size,
            desc_table,
            avail_ring,
            used_ring,
            event_idx,
            next_avail: Wrapping(next_avail),
            next_used: Wrapping(0),
            unnotified: Wrapping(0),
            used_log: None,
            logged_used: Wrapping(0),
        };
        queue.next_used = Wrapping(load_u16(ram, used_ring + 2)?);
        queue.logged_used = queue.next_used;
        fence(Ordering::Acquire);
        Ok(queue)
    }

    /// Entries in each ring.
    #[inline]
    pub fn size(&self) -> u16 {
        self.size
    }

    /// The available entry the device takes next.
    #[inline]
    pub fn next_avail(&self) -> u16 {
        self.next_avail.0
    }

    /// The used entry the device fills next.
    #[inline]
    pub fn next_used(&self) -> u16 {
        self.next_used.0
    }

    /// Resumes taking requests at available entry `next_avail`.
    pub fn set_next_avail(&mut self, next_avail: u16) {
        self.next_avail = Wrapping(next_avail);
    }

    /// Logs the used ring's writes from now on in a dirty log, at the
    /// guest address the front-end gave (VHOST_VRING_F_LOG's
    /// `log_guest_addr`), or no longer (`None`).
    pub fn set_used_log(&mut self, used_log: Option<(Arc<DirtyLog>, u64)>) {
        self.used_log = used_log;
        self.logged_used = self.next_used;
    }

    /// Marks the used entries published since the last call, and the used
    /// index, in the dirty log (if the ring is logged): once per batch,
    /// not per entry, so that an unlogged ring pays one branch.
    #[inline]
    pub fn mark_published(&mut self) {
        let Some((log, base)) = &self.used_log else { return };
        while self.logged_used != self.next_used {
            let slot = u64::from(self.logged_used.0 % self.size);
            log.mark(base + HEADER + USED_ENTRY * slot, USED_ENTRY);
            self.logged_used += 1;
        }
        log.mark(base + 2, 2);
    }

    /// Marks the used ring's field at `offset` (flags, avail_event) in the
    /// dirty log, if the ring is logged.
    fn mark_used_field(&self, offset: u64) {
        if let Some((log, base)) = &self.used_log {
            log.mark(base + offset, 2);
        }
    }

    /// The chain at `head` of the descriptor table.
    #[inline]
    pub fn chain<'m>(&self, ram: &'m GuestRam, head: u16) -> Chain<'m> {
        Chain::new(ram, self.desc_table, self.size, head)
    }

    /// How many requests the guest made available past the device's
    /// place. Their entries (and chains) may be read once this returns.
    #[inline]
    pub fn available(&self, ram: &GuestRam) -> Result<u16, RingError> {
        let idx = load_u16(ram, self.avail_ring + 2)?;
        fence(Ordering::Acquire);
        match (Wrapping(idx) - self.next_avail).0 {
            ahead if ahead > self.size => Err(RingError::AvailTooFar(ahead)),
            ahead => Ok(ahead),
        }
    }

    /// Takes the head of the next available request; only after
    /// [`Self::available`] said there is one.
    pub fn pop(&mut self, ram: &GuestRam) -> Result<u16, RingError> {
        let slot = u64::from(self.next_avail.0 % self.size);
        let head = load_u16(ram, self.avail_ring + HEADER + AVAIL_ENTRY * slot)?;
        if head >= self.size {
            return Err(RingError::HeadOutOfRange(head));
        }
        self.next_avail += 1;
        Ok(head)
    }

    /// Returns the chain at `head` to the guest, `len` bytes of it written.
    pub fn push_used(&mut self, ram: &GuestRam, head: u16, len: u32) -> Result<(), RingError> {
        let slot = u64::from(self.next_used.0 % self.size);
        let mut entry = [0u8; 8];
        entry[..4].copy_from_slice(&u32::from(head).to_le_bytes());
        entry[4..].copy_from_slice(&len.to_le_bytes());
        if !ram.write_array(self.used_ring + HEADER + USED_ENTRY * slot, entry) {
            return Err(RingError::Unreadable);
        }
        self.next_used += 1;
        self.unnotified += 1;
        // The entry is visible before the index that announces it.
        fence(Ordering::Release);
        store_u16(ram, self.used_ring + 2, self.next_used.0)
    }

    /// Whether the guest asked to be notified of the entries published
    /// since this was last asked (always, without EVENT_IDX).
    #[inline]
    pub fn needs_notification(&mut self, ram: &GuestRam) -> Result<bool, RingError> {
        // The used index must be visible before the guest's event index is
        // read, or a guest re-arming meanwhile could be missed.
        fence(Ordering::SeqCst);
        let published = std::mem::take(&mut self.unnotified);
        if !self.event_idx {
            return Ok(true);
        }
        let used_event = Wrapping(load_u16(ram, self.avail_ring + HEADER + AVAIL_ENTRY * u64::from(self.size))?);
        // Notify if used_event + 1 is among the indices just published
        // (the guest wants to hear once its used_event-th entry is there).
        Ok(self.next_used - used_event - Wrapping(1) < published)
    }

    /// Stops guest kicks (as far as the guest honours the request).
    #[inline]
    pub fn disable_kicks(&mut self, ram: &GuestRam) -> Result<(), RingError> {
        // With EVENT_IDX, kicks stop by themselves once the guest passes
        // the avail_event last written.
        if !self.event_idx {
            store_u16(ram, self.used_ring, VRING_USED_F_NO_NOTIFY as u16)?;
            self.mark_used_field(0);
        }
        Ok(())
    }

    /// Asks for kicks again. Returns whether requests arrived meanwhile
    /// (which the guest may not kick for): take them before sleeping.
    #[inline]
    pub fn enable_kicks(&mut self, ram: &GuestRam) -> Result<bool, RingError> {
        let field = match self.event_idx {
            true => HEADER + USED_ENTRY * u64::from(self.size),
            false => 0,
        };
        let value = if self.event_idx { self.next_avail.0 } else { 0 };
        store_u16(ram, self.used_ring + field, value)?;
        self.mark_used_field(field);
        // The request for kicks is visible before the index is read again.
        fence(Ordering::SeqCst);
        Ok(load_u16(ram, self.avail_ring + 2)? != self.next_avail.0)
    }
}

#[inline]
fn load_u16(ram: &GuestRam, addr: u64) -> Result<u16, RingError> {
    ram.load_u16(addr).ok_or(RingError::Unreadable)
}

#[inline]
fn store_u16(ram: &GuestRam, addr: u64, value: u16) -> Result<(), RingError> {
    ram.store_u16(addr, value).then_some(()).ok_or(RingError::Unreadable)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;
    use virtio_queue::desc::split::Descriptor;
    use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryMmap};

    use super::*;

    const SIZE: u16 = 16;

    /// Guest memory with a queue's descriptor table, available and used
    /// rings laid out in it.
    fn setup() -> (Arc<GuestMemoryMmap>, GuestRam, [u64; 3]) {
        let mem = Arc::new(GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap());
        let ram = GuestRam::new(mem.clone());
        (mem, ram, [0x1000, 0x2000, 0x3000])
    }

    /// Makes `heads` available, each a one-descriptor chain.
    fn offer(mem: &GuestMemoryMmap, rings: [u64; 3], heads: &[u16], from: u16) {
        let [desc, avail, _] = rings;
        for (i, &head) in heads.iter().enumerate() {
            let d = Descriptor::new(0x8000 + u64::from(head) * 0x100, 0x100, VRING_DESC_F_WRITE as u16, 0);
            mem.write_obj(d, GuestAddress(desc + 16 * u64::from(head))).unwrap();
            let slot = (from.wrapping_add(i as u16) % SIZE) as u64;
            mem.write_obj(head, GuestAddress(avail + 4 + 2 * slot)).unwrap();
        }
        mem.write_obj(from.wrapping_add(heads.len() as u16), GuestAddress(avail + 2)).unwrap();
    }

    #[test]
    fn heads_are_taken_in_order_and_returned_in_the_used_ring() {
        let (mem, ram, rings) = setup();
        let mut queue = SplitQueue::new(SIZE, rings, 0, false, &ram).unwrap();
        offer(&mem, rings, &[3, 7, 1], 0);
        assert_eq!(queue.available(&ram), Ok(3));
        let heads: Vec<u16> = (0..3).map(|_| queue.pop(&ram).unwrap()).collect();
        assert_eq!(heads, [3, 7, 1]);
        assert_eq!(queue.available(&ram), Ok(0));
        assert_eq!(queue.chain(&ram, 7).map(|d| d.addr().0).collect::<Vec<_>>(), [0x8700]);
        queue.push_used(&ram, 7, 0x101).unwrap();
        queue.push_used(&ram, 3, 1).unwrap();
        let used = GuestAddress(rings[2]);
        assert_eq!(mem.read_obj::<u16>(used.unchecked_add(2)).unwrap(), 2, "used index");
        assert_eq!(mem.read_obj::<[u32; 2]>(used.unchecked_add(4)).unwrap(), [7, 0x101]);
        assert_eq!(mem.read_obj::<[u32; 2]>(used.unchecked_add(12)).unwrap(), [3, 1]);
        assert_eq!(queue.next_used(), 2);
    }

    #[test]
    fn a_queue_resumes_where_the_rings_say() {
        let (mem, ram, rings) = setup();
        mem.write_obj(0xfffeu16, GuestAddress(rings[2] + 2)).unwrap();
        let mut queue = SplitQueue::new(SIZE, rings, 0xfffe, false, &ram).unwrap();
        assert_eq!(queue.next_used(), 0xfffe, "the used index in guest memory is the truth");
        offer(&mem, rings, &[4, 5, 6], 0xfffe);
        assert_eq!(queue.available(&ram), Ok(3), "across the index's wrap");
        for head in [4, 5, 6] {
            assert_eq!(queue.pop(&ram), Ok(head));
            queue.push_used(&ram, head, 0).unwrap();
        }
        assert_eq!((queue.next_avail(), queue.next_used()), (1, 1));
        assert_eq!(mem.read_obj::<[u32; 2]>(GuestAddress(rings[2] + 4)).unwrap(), [6, 0], "slot 0 after the wrap");
    }

    #[test]
    fn a_hostile_ring_is_refused() {
        let (mem, ram, rings) = setup();
        let mut queue = SplitQueue::new(SIZE, rings, 0, false, &ram).unwrap();
        mem.write_obj(SIZE + 1, GuestAddress(rings[1] + 2)).unwrap();
        assert_eq!(queue.available(&ram), Err(RingError::AvailTooFar(SIZE + 1)));
        offer(&mem, rings, &[SIZE], 0);
        assert_eq!(queue.pop(&ram), Err(RingError::HeadOutOfRange(SIZE)));
        assert_eq!(queue.next_avail(), 0, "a refused head is not taken");
        // Set-up errors: size, alignment, rings outside memory.
        assert_eq!(SplitQueue::new(12, rings, 0, false, &ram).err(), Some(RingError::Size(12)));
        let [d, a, u] = rings;
        assert!(matches!(SplitQueue::new(SIZE, [d + 8, a, u], 0, false, &ram), Err(RingError::Placement(..))));
        assert!(matches!(SplitQueue::new(SIZE, [d, a + 1, u], 0, false, &ram), Err(RingError::Placement(..))));
        assert!(matches!(SplitQueue::new(SIZE, [d, a, 0xfff0], 0, false, &ram), Err(RingError::Placement(..))));
    }

    #[test]
    fn kicks_and_notifications_follow_the_event_fields() {
        let (mem, ram, rings) = setup();
        let [_, avail, used] = rings;
        let used_event = GuestAddress(avail + 4 + 2 * u64::from(SIZE));
        let avail_event = GuestAddress(used + 4 + 8 * u64::from(SIZE));
        let mut queue = SplitQueue::new(SIZE, rings, 0, true, &ram).unwrap();
        offer(&mem, rings, &[0, 1, 2, 3], 0);
        for _ in 0..4 {
            queue.pop(&ram).unwrap();
        }
        // The guest wants to hear once entry 2 (its used_event) is used.
        mem.write_obj(2u16, used_event).unwrap();
        queue.push_used(&ram, 0, 0).unwrap();
        queue.push_used(&ram, 1, 0).unwrap();
        assert_eq!(queue.needs_notification(&ram), Ok(false), "entries 0 and 1 only");
        queue.push_used(&ram, 2, 0).unwrap();
        queue.push_used(&ram, 3, 0).unwrap();
        assert_eq!(queue.needs_notification(&ram), Ok(true), "entry 2 is among 2 and 3");
        assert_eq!(queue.needs_notification(&ram), Ok(false), "nothing new since");
        // Kicks: avail_event names the next entry the device will take.
        assert_eq!(queue.enable_kicks(&ram), Ok(false));
        assert_eq!(mem.read_obj::<u16>(avail_event).unwrap(), 4);
        offer(&mem, rings, &[5], 4);
        assert_eq!(queue.enable_kicks(&ram), Ok(true), "a request arrived meanwhile");

        // Without EVENT_IDX: the used ring's flags, and a notification each time.
        let mut queue = SplitQueue::new(SIZE, rings, 5, false, &ram).unwrap();
        queue.disable_kicks(&ram).unwrap();
        assert_eq!(mem.read_obj::<u16>(GuestAddress(used)).unwrap(), VRING_USED_F_NO_NOTIFY as u16);
        assert_eq!(queue.enable_kicks(&ram), Ok(false));
        assert_eq!(mem.read_obj::<u16>(GuestAddress(used)).unwrap(), 0);
        assert_eq!(queue.needs_notification(&ram), Ok(true));
    }
}
