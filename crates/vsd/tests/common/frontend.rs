//! A small vhost-user-blk front-end for tests that misbehave on purpose.
//!
//! Unlike libblkio (vsd-bench's client), it lets a test write anything into
//! the guest's rings: it shares a memfd as guest memory, lays the split
//! virtqueues out in it itself, and leaves descriptors, ring entries and
//! indexes to the caller. The vhost-user messages go through rust-vmm's
//! `vhost` front-end, with REPLY_ACK so that a refused message is an error.
//!
//! Guest memory is two regions of one memfd with holes below, between and
//! above them, so that "outside guest memory" has somewhere to point.

use std::ffi::CStr;
use std::fs::File;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{
    VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserVirtioFeatures, VhostUserVringAddrFlags,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserDirtyLogRegion, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

/// Guest physical address of the first region; below it is a hole.
pub const REGION_A: u64 = 0x10_0000;
/// Guest physical address of the second region, after a hole.
pub const REGION_B: u64 = 0x40_0000;
/// Size of each region.
pub const REGION_SIZE: u64 = 0x10_0000;
/// Queues the front-end sets up.
pub const QUEUES: usize = 2;
/// Entries in each queue.
pub const QUEUE_SIZE: u16 = 16;
/// Descriptor flags, as the ring stores them: the chain goes on...
pub const NEXT: u16 = VRING_DESC_F_NEXT as u16;
/// ...the device writes the buffer...
pub const WRITE: u16 = VRING_DESC_F_WRITE as u16;
/// ...or reads it (no flag).
pub const READ: u16 = 0;

/// Each region's (guest address, offset in the memfd).
const REGIONS: [(u64, u64); 2] = [(REGION_A, 0), (REGION_B, REGION_SIZE)];

/// One split-ring descriptor, as the guest writes it.
#[derive(Clone, Copy, Debug)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub flags: u16,
    pub next: u16,
}

/// One used-ring entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Used {
    pub id: u32,
    pub len: u32,
}

/// Guest memory: two regions of one memfd. `backed` bytes of the file
/// exist; a region may claim more (to lie to the back-end).
pub struct GuestMemory {
    mem: GuestMemoryMmap,
    file: File,
    backed: u64,
}

impl GuestMemory {
    /// Both regions fully backed.
    pub fn new() -> Self {
        Self::with_backed_bytes(2 * REGION_SIZE)
    }

    /// Regions claiming 2 * REGION_SIZE bytes of a file of `backed` bytes.
    pub fn with_backed_bytes(backed: u64) -> Self {
        let file = memfd(c"vsd-hostile-guest");
        file.set_len(backed).unwrap();
        let ranges: Vec<_> = REGIONS
            .iter()
            .map(|&(gpa, offset)| {
                (GuestAddress(gpa), REGION_SIZE as usize, Some(FileOffset::new(file.try_clone().unwrap(), offset)))
            })
            .collect();
        let mem = GuestMemoryMmap::from_ranges_with_files(&ranges).unwrap();
        Self { mem, file, backed }
    }

    /// The regions as SET_MEM_TABLE describes them.
    pub fn regions(&self) -> Vec<VhostUserMemoryRegionInfo> {
        REGIONS
            .iter()
            .map(|&(gpa, offset)| VhostUserMemoryRegionInfo {
                guest_phys_addr: gpa,
                memory_size: REGION_SIZE,
                userspace_addr: self.host_addr(gpa),
                mmap_offset: offset,
                mmap_handle: self.file.as_raw_fd(),
            })
            .collect()
    }

    /// This process's address of a guest address (the front-end's address
    /// space, in which vhost-user names ring addresses).
    pub fn host_addr(&self, gpa: u64) -> u64 {
        self.mem.get_host_address(GuestAddress(gpa)).unwrap() as u64
    }

    /// The guest ranges with file pages behind them.
    fn backed_ranges(&self) -> impl Iterator<Item = Range<u64>> + '_ {
        REGIONS.iter().map(|&(gpa, offset)| gpa..gpa + REGION_SIZE.min(self.backed.saturating_sub(offset)))
    }

    /// Fills every backed byte with a pattern made from `seed`: 64 KiB of
    /// it, repeated (generating 2 MiB byte by byte is slow in a debug build).
    pub fn fill(&self, seed: u64) {
        let block = crate::common::pattern(seed, 0x1_0000);
        for range in self.backed_ranges() {
            for at in range.step_by(block.len()) {
                self.mem.write_slice(&block, GuestAddress(at)).unwrap();
            }
        }
    }

    /// A copy of every backed byte.
    pub fn snapshot(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for range in self.backed_ranges() {
            let mut bytes = vec![0u8; (range.end - range.start) as usize];
            self.mem.read_slice(&mut bytes, GuestAddress(range.start)).unwrap();
            out.extend(bytes);
        }
        out
    }

    /// Guest addresses whose byte differs from `before` (a snapshot) and
    /// lies in none of `allowed`.
    pub fn changed_outside(&self, before: &[u8], allowed: &[Range<u64>]) -> Vec<u64> {
        const PAGE: usize = 4096;
        let now = self.snapshot();
        let starts = self.backed_ranges().flat_map(|r| r.step_by(PAGE));
        let pages = starts.zip(before.chunks(PAGE).zip(now.chunks(PAGE)));
        // Whole pages compare fast; only a page that differs is looked at byte by byte.
        let differing = pages.filter(|(_, (b, n))| b != n);
        let bytes = differing.flat_map(|(start, (b, n))| (start..).zip(b.iter().zip(n.iter())));
        bytes.filter(|(a, (b, n))| b != n && !allowed.iter().any(|r| r.contains(a))).map(|(a, _)| a).collect()
    }

    pub fn write<T: vm_memory::ByteValued>(&self, gpa: u64, value: T) {
        self.mem.write_obj(value, GuestAddress(gpa)).unwrap();
    }

    pub fn write_bytes(&self, gpa: u64, bytes: &[u8]) {
        self.mem.write_slice(bytes, GuestAddress(gpa)).unwrap();
    }

    pub fn read<T: vm_memory::ByteValued>(&self, gpa: u64) -> T {
        self.mem.read_obj(GuestAddress(gpa)).unwrap()
    }

    pub fn read_bytes(&self, gpa: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        self.mem.read_slice(&mut out, GuestAddress(gpa)).unwrap();
        out
    }
}

impl Default for GuestMemory {
    fn default() -> Self {
        Self::new()
    }
}

fn memfd(name: &CStr) -> File {
    // SAFETY: memfd_create reads a NUL-terminated name and returns a new
    // descriptor or -1; it touches no other memory.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` was just created and nothing else owns it.
    unsafe { File::from_raw_fd(fd) }
}

/// One virtqueue as this front-end laid it out, and the driver's view of it.
pub struct Queue {
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    kick: EventFd,
    call: EventFd,
    /// The next available index the driver will publish.
    pub avail_idx: u16,
    /// Used entries already read.
    used_seen: u16,
}

impl Queue {
    /// Queue `index`'s rings: 64 KiB apart at the start of region A.
    fn new(index: usize) -> Self {
        let base = REGION_A + index as u64 * 0x1_0000;
        Self {
            desc: base,
            avail: base + 0x1000,
            used: base + 0x2000,
            kick: EventFd::new(EFD_NONBLOCK).unwrap(),
            call: EventFd::new(EFD_NONBLOCK).unwrap(),
            avail_idx: 0,
            used_seen: 0,
        }
    }

    /// The used ring's bytes (flags, index, entries, avail_event): the
    /// device writes them.
    pub fn used_ring(&self) -> Range<u64> {
        self.used..self.used + 6 + 8 * u64::from(QUEUE_SIZE)
    }
}

/// A connected front-end with its guest memory and queues.
pub struct BlkFrontend {
    pub conn: Frontend,
    pub mem: GuestMemory,
    pub queues: Vec<Queue>,
    /// The virtio features the device offered.
    pub offered: u64,
    /// The virtio features acked.
    pub acked: u64,
}

impl BlkFrontend {
    /// Connects and negotiates: features (all offered but EVENT_IDX, so
    /// that every completion is signalled, and LOG_ALL, which a migration
    /// turns on), MQ, REPLY_ACK, CONFIG, LOG_SHMFD.
    /// No memory table and no rings yet.
    pub fn negotiate(socket: &Path, mem: GuestMemory) -> vhost::Result<Self> {
        // More queues than the device has, so that out-of-range indexes
        // reach the back-end.
        let mut conn = Frontend::connect(socket, 8)?;
        conn.set_owner()?;
        let offered = conn.get_features()?;
        let acked = offered & !(1 << VIRTIO_RING_F_EVENT_IDX) & !VhostUserVirtioFeatures::LOG_ALL.bits();
        conn.set_features(acked)?;
        assert!(offered & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0);
        let protocol = conn.get_protocol_features()?;
        let wanted = VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::LOG_SHMFD;
        assert!(protocol.contains(wanted), "protocol features {protocol:?}");
        conn.set_protocol_features(wanted)?;
        conn.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        let queues = (0..QUEUES).map(Queue::new).collect();
        Ok(Self { conn, mem, queues, offered, acked })
    }

    /// Connects, shares memory and starts every queue.
    pub fn connect(socket: &Path, mem: GuestMemory) -> vhost::Result<Self> {
        let mut fe = Self::negotiate(socket, mem)?;
        fe.conn.set_mem_table(&fe.mem.regions())?;
        for q in 0..QUEUES {
            fe.start_queue(q)?;
        }
        Ok(fe)
    }

    /// Zeroes queue `q`'s rings and hands them to the back-end.
    pub fn start_queue(&mut self, q: usize) -> vhost::Result<()> {
        let queue = &self.queues[q];
        let size = u64::from(QUEUE_SIZE);
        self.mem.write_bytes(queue.desc, &vec![0; 16 * size as usize]);
        self.mem.write_bytes(queue.avail, &vec![0; 6 + 2 * size as usize]);
        self.mem.write_bytes(queue.used, &vec![0; 6 + 8 * size as usize]);
        self.conn.set_vring_num(q, QUEUE_SIZE)?;
        self.set_vring_addr(q, None)?;
        self.conn.set_vring_base(q, 0)?;
        let queue = &self.queues[q];
        self.conn.set_vring_call(q, &queue.call)?;
        self.conn.set_vring_kick(q, &queue.kick)?;
        self.conn.set_vring_enable(q, true)
    }

    /// Hands queue `q`'s ring addresses over, with the used ring logged at
    /// `log_addr` if given (VHOST_VRING_F_LOG).
    pub fn set_vring_addr(&self, q: usize, log_addr: Option<u64>) -> vhost::Result<()> {
        let queue = &self.queues[q];
        let flags = if log_addr.is_some() { VhostUserVringAddrFlags::VHOST_VRING_F_LOG.bits() } else { 0 };
        let config = VringConfigData {
            queue_max_size: QUEUE_SIZE,
            queue_size: QUEUE_SIZE,
            flags,
            desc_table_addr: self.mem.host_addr(queue.desc),
            used_ring_addr: self.mem.host_addr(queue.used),
            avail_ring_addr: self.mem.host_addr(queue.avail),
            log_addr,
        };
        self.conn.set_vring_addr(q, &config)
    }

    /// Shares `log` (`size` bytes of bitmap) as the dirty log, as QEMU
    /// does when a migration starts or guest memory grows.
    pub fn set_log_base(&mut self, log: &File, size: u64) -> vhost::Result<()> {
        let region = VhostUserDirtyLogRegion { mmap_size: size, mmap_offset: 0, mmap_handle: log.as_raw_fd() };
        self.conn.set_log_base(0, Some(region))
    }

    /// Turns VHOST_F_LOG_ALL on or off.
    pub fn set_logging(&mut self, on: bool) -> vhost::Result<()> {
        let log_all = VhostUserVirtioFeatures::LOG_ALL.bits();
        self.acked = if on { self.acked | log_all } else { self.acked & !log_all };
        self.conn.set_features(self.acked)
    }

    /// Starts a migration's dirty logging as QEMU does: the log, LOG_ALL,
    /// then every ring's used ring logged at its guest address.
    pub fn start_logging(&mut self, log: &File, size: u64) -> vhost::Result<()> {
        self.set_log_base(log, size)?;
        self.set_logging(true)?;
        for q in 0..QUEUES {
            self.set_vring_addr(q, Some(self.queues[q].used))?;
        }
        Ok(())
    }

    /// Queue `q`'s scratch area: the request header (the status byte is
    /// 0x100 past it) and the data buffer.
    pub fn scratch_area(q: usize) -> (u64, u64) {
        let (header, _, buffer) = Self::scratch(q);
        (header, buffer)
    }

    /// Writes descriptor `index` of queue `q`.
    pub fn write_desc(&self, q: usize, index: u16, d: Desc) {
        let at = self.queues[q].desc + 16 * u64::from(index);
        write_desc(&self.mem, at, d);
    }

    /// Writes `parts` (addr, len, flags) as a chain at descriptors 0..n,
    /// NEXT added to all but the last; returns the head (0).
    pub fn write_chain(&self, q: usize, parts: &[(u64, u32, u16)]) -> u16 {
        for (i, d) in linked(parts).into_iter().enumerate() {
            self.write_desc(q, i as u16, d);
        }
        0
    }

    /// Puts `head` in the next available-ring entry and publishes it.
    pub fn push(&mut self, q: usize, head: u16) {
        let queue = &self.queues[q];
        let slot = queue.avail + 4 + 2 * u64::from(queue.avail_idx % QUEUE_SIZE);
        self.mem.write(slot, head.to_le());
        let idx = queue.avail_idx.wrapping_add(1);
        self.set_avail_idx(q, idx);
    }

    /// Publishes `idx` as the available index, whatever it is.
    pub fn set_avail_idx(&mut self, q: usize, idx: u16) {
        let queue = &mut self.queues[q];
        queue.avail_idx = idx;
        self.mem.mem.store(idx.to_le(), GuestAddress(queue.avail + 2), Ordering::Release).unwrap();
    }

    pub fn kick(&self, q: usize) {
        self.queues[q].kick.write(1).unwrap();
    }

    /// The next used entry of queue `q`, waiting up to `timeout` for the
    /// device's call.
    pub fn wait_used(&mut self, q: usize, timeout: Duration) -> Option<Used> {
        let deadline = Instant::now() + timeout;
        let epoll = Epoll::new().unwrap();
        let call = self.queues[q].call.as_raw_fd();
        epoll.ctl(ControlOperation::Add, call, EpollEvent::new(EventSet::IN, 0)).unwrap();
        loop {
            let queue = &self.queues[q];
            let used_idx: u16 = self.mem.mem.load(GuestAddress(queue.used + 2), Ordering::Acquire).unwrap();
            if u16::from_le(used_idx) != queue.used_seen {
                let at = queue.used + 4 + 8 * u64::from(queue.used_seen % QUEUE_SIZE);
                let used = Used { id: u32::from_le(self.mem.read(at)), len: u32::from_le(self.mem.read(at + 4)) };
                self.queues[q].used_seen = queue.used_seen.wrapping_add(1);
                return Some(used);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            let mut events = [EpollEvent::default()];
            // Checked again at the top; a wake-up with nothing new is harmless.
            let _ = epoll.wait(left.as_millis().max(1) as i32, &mut events);
            let _ = self.queues[q].call.read();
        }
    }

    /// Queue `q`'s scratch area for well-formed requests: header, status
    /// byte, data buffer.
    fn scratch(q: usize) -> (u64, u64, u64) {
        let area = REGION_A + 0x8_0000 + q as u64 * 0x1_0000;
        (area, area + 0x100, REGION_B + 0x8_0000 + q as u64 * 0x1_0000)
    }

    /// Makes a well-formed request available and kicks: header, then
    /// `data` (readable for writes, writable for reads: its length is
    /// what counts), then the status byte. Returns the head.
    pub fn start_io(&mut self, q: usize, kind: u32, sector: u64, data: &[u8]) -> u16 {
        let (header, status, buffer) = Self::scratch(q);
        write_header(&self.mem, header, kind, sector);
        self.mem.write(status, 0xffu8);
        let flags = if kind == VIRTIO_BLK_T_IN {
            WRITE
        } else {
            self.mem.write_bytes(buffer, data);
            READ
        };
        let head = self.write_chain(q, &[(header, 16, READ), (buffer, data.len() as u32, flags), (status, 1, WRITE)]);
        self.push(q, head);
        self.kick(q);
        head
    }

    /// A well-formed request, waited for. Returns (status, used length),
    /// with read data copied into `data`.
    pub fn io(&mut self, q: usize, kind: u32, sector: u64, data: &mut [u8]) -> Option<(u8, u32)> {
        let head = self.start_io(q, kind, sector, data);
        let used = self.wait_used(q, Duration::from_secs(10))?;
        assert_eq!(used.id, u32::from(head), "queue {q}: used id");
        let (_, status, buffer) = Self::scratch(q);
        if kind == VIRTIO_BLK_T_IN {
            data.copy_from_slice(&self.mem.read_bytes(buffer, data.len()));
        }
        Some((self.mem.read(status), used.len))
    }

    /// Checks that queue `q` serves well: writes a pattern at `sector` and
    /// reads it back (or, with `writable` false, just reads).
    pub fn check_service(&mut self, q: usize, sector: u64, writable: bool) -> Result<(), String> {
        let ok = VIRTIO_BLK_S_OK as u8;
        let mut data = crate::common::pattern(sector ^ 0x5eed, 4096);
        if writable {
            let done = self.io(q, VIRTIO_BLK_T_OUT, sector, &mut data.clone());
            if done != Some((ok, 1)) {
                return Err(format!("queue {q}: write at sector {sector}: {done:?}"));
            }
        } else {
            data = vec![0; 4096];
        }
        let mut back = vec![0x55; 4096];
        let done = self.io(q, VIRTIO_BLK_T_IN, sector, &mut back);
        if done != Some((ok, 4097)) {
            return Err(format!("queue {q}: read at sector {sector}: {done:?}"));
        }
        if back != data {
            return Err(format!("queue {q}: read at sector {sector} returned other data"));
        }
        Ok(())
    }
}

/// Descriptors for `parts` (addr, len, flags), NEXT to the following one
/// on all but the last.
pub fn linked(parts: &[(u64, u32, u16)]) -> Vec<Desc> {
    let n = parts.len();
    parts
        .iter()
        .enumerate()
        .map(|(i, &(addr, len, flags))| {
            let next = if i + 1 < n { NEXT } else { 0 };
            Desc { addr, len, flags: flags | next, next: if i + 1 < n { i as u16 + 1 } else { 0 } }
        })
        .collect()
}

/// Writes one descriptor at guest address `at` (a table slot).
pub fn write_desc(mem: &GuestMemory, at: u64, d: Desc) {
    mem.write(at, d.addr.to_le());
    mem.write(at + 8, d.len.to_le());
    mem.write(at + 12, d.flags.to_le());
    mem.write(at + 14, d.next.to_le());
}

/// Writes a virtio-blk request header at `at`.
pub fn write_header(mem: &GuestMemory, at: u64, kind: u32, sector: u64) {
    mem.write(at, kind.to_le());
    mem.write(at + 4, 0u32);
    mem.write(at + 8, sector.to_le());
}
