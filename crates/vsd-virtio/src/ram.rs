//! Guest memory as the request path touches it: descriptors, request
//! headers, data buffers and status bytes, reached through a snapshot of
//! the memory map's regions.
//!
//! Why not vm-memory's accessors here: each of its reads goes through
//! `try_access` (closures, a region search, a `VolatileSlice` with bitmap
//! hooks) and costs about 100 instructions; a request needs five or six of
//! them, which made parsing 40 % of a request's instructions (callgrind,
//! BENCHMARKS.md). A guest has a handful of regions: a scan over their
//! (guest start, length, host address) and a volatile copy make the same
//! checks in a few instructions. Every access is still bounded: a guest
//! range is only touched once each of its bytes is found inside a mapped
//! region, and ranges that cross regions are split at the boundary.

use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};

use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

/// One mapped region: guest bytes `start..start + len` at host `host`.
#[derive(Clone, Copy, Debug)]
struct Region {
    start: u64,
    len: u64,
    host: *mut u8,
}

/// The regions of one guest memory map, with the map itself held so that
/// the host addresses stay valid as long as this lives.
pub struct GuestRam {
    regions: Vec<Region>,
    mem: Arc<GuestMemoryMmap>,
}

// SAFETY: the host addresses point into mappings that `mem` keeps alive
// and never change; guest memory is shared with the guest (and other
// queues) anyway, and every access to it here is volatile.
unsafe impl Send for GuestRam {}
// SAFETY: as above; `GuestRam` itself is never changed after it is made.
unsafe impl Sync for GuestRam {}

impl GuestRam {
    /// A snapshot of `mem`'s regions.
    pub fn new(mem: Arc<GuestMemoryMmap>) -> Self {
        let regions = mem
            .iter()
            .map(|r| Region { start: r.start_addr().0, len: r.len(), host: r.as_ptr() })
            .filter(|r| r.len > 0)
            .collect();
        Self { regions, mem }
    }

    /// The memory map this snapshot was taken of.
    pub fn memory(&self) -> &Arc<GuestMemoryMmap> {
        &self.mem
    }

    /// The region holding guest byte `addr`, and `addr`'s offset in it.
    #[inline]
    fn region_of(&self, addr: u64) -> Option<(&Region, u64)> {
        self.regions.iter().find_map(|r| {
            let off = addr.wrapping_sub(r.start);
            (addr >= r.start && off < r.len).then_some((r, off))
        })
    }

    /// The guest address of host byte `host`, if it lies in guest memory
    /// (the dirty log marks guest pages from the buffers of a request).
    pub fn guest_addr(&self, host: *const u8) -> Option<u64> {
        self.regions.iter().find_map(|r| {
            let off = (host.addr()).wrapping_sub(r.host.addr()) as u64;
            (off < r.len).then(|| r.start + off)
        })
    }

    /// The host address of guest bytes `addr..addr + len` (`len` > 0), if
    /// all of them lie in one region.
    #[inline]
    pub fn host(&self, addr: u64, len: u64) -> Option<*mut u8> {
        let (r, off) = self.region_of(addr)?;
        (len <= r.len - off).then(|| r.host.wrapping_add(off as usize))
    }

    /// Calls `f` with the host pieces of guest bytes `addr..addr + len`,
    /// region by region, in order; false (and `f` not called for the
    /// rest) if some byte lies outside guest memory or `f` says stop.
    #[inline]
    pub fn pieces(&self, addr: u64, len: u64, mut f: impl FnMut(*mut u8, usize) -> bool) -> bool {
        let (mut addr, mut left) = (addr, len);
        while left > 0 {
            let Some((r, off)) = self.region_of(addr) else { return false };
            let n = left.min(r.len - off);
            if !f(r.host.wrapping_add(off as usize), n as usize) {
                return false;
            }
            left -= n;
            if left > 0 {
                // Regions end inside the address space, so a range that
                // goes on past one starts the next at a representable address.
                addr = match addr.checked_add(n) {
                    Some(next) => next,
                    None => return false,
                };
            }
        }
        true
    }

    /// Copies guest bytes `addr..addr + out.len()` into `out`; false if
    /// some of them lie outside guest memory.
    pub fn read(&self, addr: u64, out: &mut [u8]) -> bool {
        let mut done = 0;
        self.pieces(addr, out.len() as u64, |host, n| {
            for (i, byte) in out[done..done + n].iter_mut().enumerate() {
                // SAFETY: `pieces` found these n bytes inside a mapped
                // region that `self.mem` keeps alive; the guest may change
                // them meanwhile, hence volatile reads.
                *byte = unsafe { host.add(i).read_volatile() };
            }
            done += n;
            true
        })
    }

    /// Writes `bytes` at guest address `addr` (ring entries and
    /// indices): one volatile store when they lie in one region; false if
    /// some of them lie outside guest memory (then none is written).
    #[inline]
    pub fn write_array<const N: usize>(&self, addr: u64, bytes: [u8; N]) -> bool {
        if let Some(host) = self.host(addr, N as u64) {
            // SAFETY: the N bytes lie inside a mapped region kept alive by
            // `self.mem`; a byte array has no alignment to respect.
            unsafe { host.cast::<[u8; N]>().write_volatile(bytes) };
            return true;
        }
        if !self.pieces(addr, N as u64, |_, _| true) {
            return false;
        }
        let mut done = 0;
        self.pieces(addr, N as u64, |host, n| {
            for (i, byte) in bytes[done..done + n].iter().enumerate() {
                // SAFETY: as in `read`.
                unsafe { host.add(i).write_volatile(*byte) };
            }
            done += n;
            true
        })
    }

    /// Loads the little-endian 16-bit field at `addr`: a ring index or
    /// event field, which the guest changes meanwhile, so one atomic load
    /// where it is host-aligned (always, but in a region at an odd guest
    /// address); a torn read of an index that moves from 0x3fff to 0x4000
    /// would see 0x40ff.
    #[inline(always)]
    pub fn load_u16(&self, addr: u64) -> Option<u16> {
        match self.host(addr, 2) {
            Some(host) if host.cast::<u16>().is_aligned() => {
                // SAFETY: the 2 bytes lie inside a mapped region kept alive
                // by `self.mem`, aligned; the guest accesses them atomically too.
                let field = unsafe { AtomicU16::from_ptr(host.cast()) };
                Some(u16::from_le(field.load(Ordering::Relaxed)))
            }
            _ => self.read_array::<2>(addr).map(u16::from_le_bytes),
        }
    }

    /// Stores `value` as the little-endian 16-bit field at `addr`, in one
    /// atomic store where it is host-aligned (see [`Self::load_u16`]);
    /// false if it lies outside guest memory.
    #[inline(always)]
    pub fn store_u16(&self, addr: u64, value: u16) -> bool {
        match self.host(addr, 2) {
            Some(host) if host.cast::<u16>().is_aligned() => {
                // SAFETY: as in `load_u16`.
                let field = unsafe { AtomicU16::from_ptr(host.cast()) };
                field.store(value.to_le(), Ordering::Relaxed);
                true
            }
            _ => self.write_array(addr, value.to_le_bytes()),
        }
    }

    /// Reads the `N` little-endian 64-bit words at `addr` (a descriptor is
    /// two): one volatile load each when they lie in one region, aligned.
    #[inline]
    pub fn read_words<const N: usize>(&self, addr: u64) -> Option<[u64; N]> {
        match self.host(addr, 8 * N as u64) {
            Some(host) if host.cast::<u64>().is_aligned() => {
                let words = host.cast::<u64>();
                // SAFETY: the 8N bytes lie inside a mapped region kept alive
                // by `self.mem`, and the first (so every) word is aligned.
                Some(std::array::from_fn(|i| u64::from_le(unsafe { words.add(i).read_volatile() })))
            }
            _ => {
                // Across regions or unaligned (a hostile guest's tables).
                const { assert!(N <= 4, "room for the slow path's bytes") };
                let mut room = [0u8; 32];
                let bytes = &mut room[..8 * N];
                self.read(addr, bytes).then(|| {
                    std::array::from_fn(|i| u64::from_le_bytes(bytes[8 * i..8 * i + 8].try_into().unwrap_or_default()))
                })
            }
        }
    }

    /// Reads the `N` bytes at `addr` (request headers, ring entries): one
    /// volatile load when they lie in one region.
    #[inline]
    pub fn read_array<const N: usize>(&self, addr: u64) -> Option<[u8; N]> {
        if let Some(host) = self.host(addr, N as u64) {
            // SAFETY: the N bytes lie inside a mapped region kept alive by
            // `self.mem`; a byte array has no alignment to respect.
            return Some(unsafe { host.cast::<[u8; N]>().read_volatile() });
        }
        let mut out = [0u8; N];
        self.read(addr, &mut out).then_some(out)
    }
}

#[cfg(test)]
mod tests {
    use vm_memory::{Bytes, GuestAddress};

    use super::*;

    /// The last byte a region can have (its end must be representable).
    const LAST: u64 = u64::MAX - 1;

    /// 8 KiB at 0x1000 and 4 KiB right after it, then 4 KiB at the very
    /// top of the address space.
    fn ram() -> GuestRam {
        let top = LAST - 0xfff;
        let mem = GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0x1000), 0x2000),
            (GuestAddress(0x3000), 0x1000),
            (GuestAddress(top), 0x1000),
        ])
        .unwrap();
        for (at, byte) in [(0x1000u64, 1u8), (0x2fff, 2), (0x3000, 3), (top, 4), (LAST, 5)] {
            mem.write_obj(byte, GuestAddress(at)).unwrap();
        }
        GuestRam::new(Arc::new(mem))
    }

    #[test]
    fn ranges_inside_one_region_have_a_host_address() {
        let ram = ram();
        assert!(ram.host(0x1000, 0x2000).is_some());
        assert!(ram.host(0x2fff, 1).is_some());
        assert!(ram.host(0x2fff, 2).is_none(), "crosses into the next region");
        assert!(ram.host(0x0fff, 1).is_none(), "below memory");
        assert!(ram.host(0x4000, 1).is_none(), "in the hole");
        assert!(ram.host(LAST, 1).is_some());
        assert!(ram.host(LAST, 2).is_none(), "past the end of the region");
        assert!(ram.host(u64::MAX, 1).is_none(), "past the end of the region");
    }

    #[test]
    fn reads_split_at_region_boundaries_and_stop_at_holes() {
        let ram = ram();
        assert_eq!(ram.read_array::<2>(0x2fff), Some([2, 3]), "across two adjacent regions");
        assert_eq!(ram.read_array::<1>(0x1000), Some([1]));
        assert_eq!(ram.read_array::<2>(0x3fff), None, "runs into the hole");
        assert_eq!(ram.read_array::<1>(LAST), Some([5]));
        assert_eq!(ram.read_array::<2>(LAST), None, "runs past the top region");
        assert_eq!(ram.read_array::<2>(u64::MAX), None, "wraps around the address space");
        assert_eq!(
            ram.read_words::<1>(0x2ffc),
            Some([u64::from_le_bytes([0, 0, 0, 2, 3, 0, 0, 0])]),
            "unaligned, across regions"
        );
        let mut pieces = Vec::new();
        assert!(ram.pieces(0x2ff0, 0x20, |_, n| {
            pieces.push(n);
            true
        }));
        assert_eq!(pieces, [0x10, 0x10]);
        assert!(!ram.pieces(0x3ff0, 0x20, |_, _| true));
    }

    #[test]
    fn host_addresses_map_back_to_guest_addresses() {
        let ram = ram();
        for addr in [0x1000, 0x2fff, 0x3000, 0x3fff, LAST] {
            assert_eq!(ram.guest_addr(ram.host(addr, 1).unwrap()), Some(addr));
        }
        let outside = [0u8; 1];
        assert_eq!(ram.guest_addr(outside.as_ptr()), None);
    }

    #[test]
    fn writes_land_in_guest_memory_only() {
        let ram = ram();
        assert!(ram.write_array(0x3000, [9]));
        assert_eq!(ram.memory().read_obj::<u8>(GuestAddress(0x3000)).unwrap(), 9);
        assert!(ram.write_array(0x2fff, [7, 8]), "across two adjacent regions");
        assert_eq!(ram.read_array::<2>(0x2fff), Some([7, 8]));
        assert!(!ram.write_array(0x3fff, [6, 6]), "runs into the hole");
        assert_eq!(ram.read_array::<1>(0x3fff), Some([0]), "nothing written");
        assert!(ram.store_u16(0x3002, 0x4000));
        assert_eq!(ram.load_u16(0x3002), Some(0x4000));
        assert_eq!(ram.read_array::<2>(0x3002), Some([0, 0x40]), "little-endian");
        assert!(ram.store_u16(0x2fff, 0x0102), "unaligned, across regions");
        assert_eq!(ram.load_u16(0x2fff), Some(0x0102));
        assert_eq!(ram.load_u16(0x3fff), None);
    }
}
