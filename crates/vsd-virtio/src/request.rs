//! Parsing of virtio-blk requests. Everything here comes from the guest and
//! is untrusted: every length, address, sector and flag is checked before it
//! is used, and a bad request becomes a status, never a panic.
//!
//! A request is a descriptor chain: device-readable buffers holding the
//! 16-byte header (and, for writes, the data), then device-writable buffers
//! (read data), whose very last byte is the status. VERSION_1 implies
//! ANY_LAYOUT, so the header, data and status may be split or merged across
//! descriptors in any way; the parser treats the chain as two byte streams.

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
    VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use virtio_queue::desc::split::Descriptor;
use vm_memory::GuestAddress;

use crate::ram::GuestRam;

/// Sectors are always 512 bytes in virtio-blk, whatever the block size.
pub const SECTOR_SIZE: u64 = 512;
/// Data segments a request may have (advertised as `seg_max`).
pub const SEG_MAX: u32 = 126;
/// Descriptors a chain may have: the data segments, header and status.
pub const MAX_DESCRIPTORS: usize = SEG_MAX as usize + 2;
/// Host buffers a request may map to: a segment that crosses a boundary
/// between guest memory regions becomes two.
pub const MAX_IOVECS: usize = 128;
/// Size of the request header: type, reserved, sector.
const HEADER_LEN: u64 = 16;
/// Size of one discard / write-zeroes segment.
const SEGMENT_LEN: u64 = 16;

/// Status byte values.
pub mod status {
    use super::*;
    /// Success.
    pub const OK: u8 = VIRTIO_BLK_S_OK as u8;
    /// The request failed or was malformed.
    pub const IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
    /// The request type or a flag is not supported.
    pub const UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;
}

/// What the export promises the guest, against which requests are checked.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Capacity in bytes (a whole number of sectors).
    pub capacity: u64,
    /// The logical block size: offsets and lengths must be multiples of it.
    pub block_size: u32,
    /// Whether writes, discards and write-zeroes are allowed.
    pub writable: bool,
    /// Largest discard, in sectors.
    pub max_discard_sectors: u32,
    /// Largest write-zeroes, in sectors.
    pub max_write_zeroes_sectors: u32,
}

/// What a request asks for, once checked. `offset` and `len` are in bytes.
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Read `len` bytes at `offset` into the request's iovecs.
    Read { offset: u64, len: u64 },
    /// Write `len` bytes at `offset` from the request's iovecs.
    Write { offset: u64, len: u64 },
    /// Make completed writes durable.
    Flush,
    /// Drop a range.
    Discard { offset: u64, len: u64 },
    /// Zero a range, deallocating it if `unmap`.
    WriteZeroes { offset: u64, len: u64, unmap: bool },
    /// Copy the serial into the request's iovecs.
    GetId,
    /// Complete at once with this status.
    Done(u8),
}

/// A parsed request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// Where to write the status byte.
    pub status: GuestAddress,
    /// What to do.
    pub action: Action,
    /// How many iovecs of the caller's array hold the data buffers.
    pub iovcnt: usize,
}

/// A chain that cannot even be answered: it has no writable status byte
/// (or could not be walked to its end). It is returned to the guest used
/// with length 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("descriptor chain has no usable status byte")]
pub struct NoStatus;

/// A run of guest memory named by one descriptor.
#[derive(Clone, Copy, Debug, Default)]
struct Span {
    addr: u64,
    len: u64,
}

/// Bytes spread over a list of spans, minus `skip` bytes at the front.
#[derive(Clone, Copy)]
struct Region<'a> {
    spans: &'a [Span],
    skip: u64,
}

impl<'a> Region<'a> {
    #[inline]
    fn len(&self) -> u64 {
        self.spans.iter().map(|s| s.len).sum::<u64>().saturating_sub(self.skip)
    }

    fn after(self, bytes: u64) -> Self {
        Self { spans: self.spans, skip: self.skip + bytes }
    }

    /// The pieces of the region, as (guest address, length).
    fn pieces(self) -> impl Iterator<Item = (u64, u64)> + 'a {
        let mut skip = self.skip;
        self.spans.iter().filter_map(move |s| {
            let taken = skip.min(s.len);
            skip -= taken;
            (s.len > taken).then(|| (s.addr.wrapping_add(taken), s.len - taken))
        })
    }

    /// The region's first 16 bytes (a header or a segment), or `None` if
    /// it is shorter or leaves guest memory.
    fn read_16(self, ram: &GuestRam) -> Option<[u8; 16]> {
        match self.pieces().next() {
            // Nearly always: all 16 bytes in the first piece.
            Some((addr, len)) if len >= 16 => ram.read_array(addr),
            _ => {
                let mut out = [0u8; 16];
                self.read(ram, &mut out).then_some(out)
            }
        }
    }

    /// Copies the region's first `out.len()` bytes out of guest memory.
    fn read(self, ram: &GuestRam, out: &mut [u8]) -> bool {
        let mut done = 0;
        for (addr, len) in self.pieces() {
            let n = len.min((out.len() - done) as u64) as usize;
            if n == 0 {
                break;
            }
            if !ram.read(addr, &mut out[done..done + n]) {
                return false;
            }
            done += n;
        }
        done == out.len()
    }

    /// Maps the region to host iovecs; `None` if it leaves guest memory or
    /// needs more than `iov.len()` of them.
    fn map(self, ram: &GuestRam, iov: &mut [libc::iovec]) -> Option<usize> {
        let mut count = 0;
        for (addr, len) in self.pieces() {
            let mapped = ram.pieces(addr, len, |host, n| match iov.get_mut(count) {
                Some(v) => {
                    *v = libc::iovec { iov_base: host.cast(), iov_len: n };
                    count += 1;
                    true
                }
                None => false,
            });
            if !mapped {
                return None;
            }
        }
        Some(count)
    }
}

/// Parses descriptor chains, with its working space allocated once (a
/// zeroed array of spans per request cost about 130 instructions, 5 % of
/// a null-co request).
pub struct Parser {
    spans: Vec<Span>,
}

impl Default for Parser {
    fn default() -> Self {
        Self { spans: Vec::with_capacity(MAX_DESCRIPTORS) }
    }
}

impl Parser {
    /// A parser for one thread's requests.
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses one descriptor chain.
    ///
    /// `descriptors` yields the chain as the queue walks it (which stops at
    /// loops, over-long chains and bad indirect tables, see
    /// [`crate::chain::Chain`]); data buffers are mapped into `iov`. Host
    /// pointers in `iov` stay valid while `ram`'s memory map does.
    pub fn parse(
        &mut self,
        descriptors: impl Iterator<Item = Descriptor>,
        ram: &GuestRam,
        limits: &Limits,
        iov: &mut [libc::iovec; MAX_IOVECS],
    ) -> Result<Request, NoStatus> {
        self.spans.clear();
        parse(descriptors, ram, limits, iov, &mut self.spans)
    }
}

fn parse(
    descriptors: impl Iterator<Item = Descriptor>,
    ram: &GuestRam,
    limits: &Limits,
    iov: &mut [libc::iovec; MAX_IOVECS],
    spans: &mut Vec<Span>,
) -> Result<Request, NoStatus> {
    let mut count = 0usize;
    let mut first_writable = None;
    let mut misordered = false;
    let mut last = None;
    for desc in descriptors {
        if count < MAX_DESCRIPTORS {
            spans.push(Span { addr: desc.addr().0, len: u64::from(desc.len()) });
        }
        match (desc.is_write_only(), first_writable) {
            (true, None) => first_writable = Some(count),
            (false, Some(_)) => misordered = true,
            _ => {}
        }
        count += 1;
        last = Some(desc);
    }
    // The walk stops early on a broken chain: then its last descriptor
    // still points onwards, and what looks like the status byte is not.
    let last = last.filter(|d| !d.has_next() && d.is_write_only() && d.len() > 0).ok_or(NoStatus)?;
    let status = last.addr().0.checked_add(u64::from(last.len()) - 1).ok_or(NoStatus)?;
    if ram.host(status, 1).is_none() {
        return Err(NoStatus);
    }
    let status = GuestAddress(status);
    let done = |code| Ok(Request { status, action: Action::Done(code), iovcnt: 0 });
    if count > MAX_DESCRIPTORS || misordered {
        return done(status::IOERR);
    }
    let first_writable = first_writable.unwrap_or(count);
    spans[count - 1].len -= 1; // the status byte is not data
    let readable = Region { spans: &spans[..first_writable], skip: 0 };
    let writable = Region { spans: &spans[first_writable..count], skip: 0 };

    let Some(header) = readable.read_16(ram) else {
        return done(status::IOERR);
    };
    let kind = u32::from_le_bytes(header[0..4].try_into().unwrap_or_default());
    let sector = u64::from_le_bytes(header[8..16].try_into().unwrap_or_default());
    let payload = readable.after(HEADER_LEN);

    let (action, data) = match kind {
        VIRTIO_BLK_T_IN => match byte_range(limits, sector, writable.len()) {
            Some((offset, len)) => (Action::Read { offset, len }, Some(writable)),
            None => return done(status::IOERR),
        },
        VIRTIO_BLK_T_OUT if !limits.writable => return done(status::IOERR),
        VIRTIO_BLK_T_OUT => match byte_range(limits, sector, payload.len()) {
            Some((offset, len)) => (Action::Write { offset, len }, Some(payload)),
            None => return done(status::IOERR),
        },
        VIRTIO_BLK_T_FLUSH => (Action::Flush, None),
        VIRTIO_BLK_T_GET_ID if writable.len() == 0 => return done(status::IOERR),
        VIRTIO_BLK_T_GET_ID => (Action::GetId, Some(writable)),
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => match range_command(kind, payload, ram, limits) {
            Ok(action) => (action, None),
            Err(code) => return done(code),
        },
        _ => return done(status::UNSUPP),
    };
    let iovcnt = match data {
        Some(region) => match region.map(ram, iov) {
            Some(n) => n,
            None => return done(status::IOERR),
        },
        None => 0,
    };
    Ok(Request { status, action, iovcnt })
}

/// Checks a discard or write-zeroes payload: exactly one segment
/// (`max_discard_seg` is 1), known flags, a valid range.
fn range_command(kind: u32, payload: Region<'_>, ram: &GuestRam, limits: &Limits) -> Result<Action, u8> {
    if !limits.writable {
        return Err(status::IOERR);
    }
    if payload.len() > SEGMENT_LEN {
        return Err(status::UNSUPP);
    }
    let segment = payload.read_16(ram).ok_or(status::IOERR)?;
    let sector = u64::from_le_bytes(segment[0..8].try_into().unwrap_or_default());
    let sectors = u32::from_le_bytes(segment[8..12].try_into().unwrap_or_default());
    let flags = u32::from_le_bytes(segment[12..16].try_into().unwrap_or_default());
    let (unmap, max) = match kind {
        VIRTIO_BLK_T_DISCARD if flags != 0 => return Err(status::UNSUPP),
        VIRTIO_BLK_T_DISCARD => (false, limits.max_discard_sectors),
        _ if flags & !VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0 => return Err(status::UNSUPP),
        _ => (flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0, limits.max_write_zeroes_sectors),
    };
    if sectors > max {
        return Err(status::IOERR);
    }
    let (offset, len) = byte_range(limits, sector, u64::from(sectors) * SECTOR_SIZE).ok_or(status::IOERR)?;
    Ok(match kind {
        VIRTIO_BLK_T_DISCARD => Action::Discard { offset, len },
        _ => Action::WriteZeroes { offset, len, unmap },
    })
}

/// The byte range of a request, if it is aligned to the block size and
/// lies inside the disk (with no overflow on the way).
fn byte_range(limits: &Limits, sector: u64, len: u64) -> Option<(u64, u64)> {
    let offset = sector.checked_mul(SECTOR_SIZE)?;
    let block = u64::from(limits.block_size);
    let end = offset.checked_add(len)?;
    (offset.is_multiple_of(block) && len.is_multiple_of(block) && end <= limits.capacity).then_some((offset, len))
}

/// The GET_ID answer: the serial, NUL-padded to 20 bytes (not terminated
/// when it is exactly 20 bytes long, as the spec allows).
pub fn id_bytes(serial: &str) -> [u8; VIRTIO_BLK_ID_BYTES as usize] {
    let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
    let n = serial.len().min(id.len());
    id[..n].copy_from_slice(&serial.as_bytes()[..n]);
    id
}

/// Copies the GET_ID answer into the request's mapped writable buffers;
/// returns the bytes copied.
///
/// # Safety
/// `iov` must be the iovecs `parse` mapped for this GET_ID request, with the
/// guest memory mapping they point into still held.
pub unsafe fn write_id(iov: &[libc::iovec], id: &[u8]) -> usize {
    let mut done = 0;
    for v in iov {
        let n = v.iov_len.min(id.len() - done);
        // SAFETY: the caller guarantees the iovecs name live, writable guest
        // buffers; n is within both the buffer and `id`.
        unsafe { std::ptr::copy_nonoverlapping(id[done..].as_ptr(), v.iov_base.cast::<u8>(), n) };
        done += n;
        if done == id.len() {
            break;
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use vm_memory::{Bytes, GuestMemoryMmap};

    const MEM_SIZE: u64 = 0x10_0000;
    const R: u16 = 0;
    const W: u16 = VRING_DESC_F_WRITE as u16;

    fn memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).unwrap()
    }

    fn limits() -> Limits {
        Limits {
            capacity: 1 << 20,
            block_size: 512,
            writable: true,
            max_discard_sectors: 128,
            max_write_zeroes_sectors: 128,
        }
    }

    fn header(mem: &GuestMemoryMmap, at: u64, kind: u32, sector: u64) {
        mem.write_obj(kind.to_le(), GuestAddress(at)).unwrap();
        mem.write_obj(sector.to_le(), GuestAddress(at + 8)).unwrap();
    }

    /// A chain of (addr, len, flags); NEXT is set on all but the last.
    fn chain(parts: &[(u64, u32, u16)]) -> Vec<Descriptor> {
        let n = parts.len();
        parts
            .iter()
            .enumerate()
            .map(|(i, &(addr, len, flags))| {
                let next = if i + 1 < n { VRING_DESC_F_NEXT as u16 } else { 0 };
                Descriptor::new(addr, len, flags | next, (i + 1) as u16)
            })
            .collect()
    }

    fn parse_with(descs: Vec<Descriptor>, mem: &GuestMemoryMmap, limits: &Limits) -> Result<Request, NoStatus> {
        let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; MAX_IOVECS];
        let ram = GuestRam::new(std::sync::Arc::new(mem.clone()));
        Parser::new().parse(descs.into_iter(), &ram, limits, &mut iov)
    }

    fn status_of(descs: Vec<Descriptor>, mem: &GuestMemoryMmap, limits: &Limits) -> Option<u8> {
        match parse_with(descs, mem, limits).expect("a status byte").action {
            Action::Done(code) => Some(code),
            _ => None,
        }
    }

    #[test]
    fn read_request() {
        let mem = memory();
        header(&mem, 0x1000, VIRTIO_BLK_T_IN, 8);
        let req = parse_with(chain(&[(0x1000, 16, R), (0x2000, 4096, W), (0x3000, 1, W)]), &mem, &limits()).unwrap();
        assert_eq!(req.action, Action::Read { offset: 4096, len: 4096 });
        assert_eq!(req.iovcnt, 1);
        assert_eq!(req.status, GuestAddress(0x3000));
    }

    #[test]
    fn any_layout_header_split_and_data_merged_with_status() {
        let mem = memory();
        header(&mem, 0x1000, VIRTIO_BLK_T_OUT, 2);
        // Header in two pieces, then data in the same descriptor as its tail;
        // status is the last byte of a writable buffer.
        let descs = chain(&[(0x1000, 10, R), (0x100a, 6 + 512, R), (0x3000, 1, W)]);
        let req = parse_with(descs, &mem, &limits()).unwrap();
        assert_eq!(req.action, Action::Write { offset: 1024, len: 512 });
        let mem2 = memory();
        header(&mem2, 0x1000, VIRTIO_BLK_T_IN, 0);
        let req = parse_with(chain(&[(0x1000, 16, R), (0x2000, 513, W)]), &mem2, &limits()).unwrap();
        assert_eq!(req.action, Action::Read { offset: 0, len: 512 });
        assert_eq!(req.status, GuestAddress(0x2200));
    }

    #[test]
    fn missing_or_read_only_status_cannot_be_answered() {
        let mem = memory();
        header(&mem, 0x1000, VIRTIO_BLK_T_IN, 0);
        // No writable descriptor at all.
        assert_eq!(parse_with(chain(&[(0x1000, 16, R), (0x2000, 512, R)]), &mem, &limits()), Err(NoStatus));
        // Status descriptor not device-writable.
        assert_eq!(
            parse_with(chain(&[(0x1000, 16, R), (0x2000, 512, W), (0x3000, 1, R)]), &mem, &limits()),
            Err(NoStatus)
        );
        // Zero-length status descriptor.
        assert_eq!(parse_with(chain(&[(0x1000, 16, R), (0x3000, 0, W)]), &mem, &limits()), Err(NoStatus));
        // Status byte outside guest memory.
        assert_eq!(parse_with(chain(&[(0x1000, 16, R), (MEM_SIZE, 1, W)]), &mem, &limits()), Err(NoStatus));
        // Status address that overflows.
        assert_eq!(parse_with(chain(&[(0x1000, 16, R), (u64::MAX, 2, W)]), &mem, &limits()), Err(NoStatus));
        // An empty chain.
        assert_eq!(parse_with(Vec::new(), &mem, &limits()), Err(NoStatus));
    }

    #[test]
    fn truncated_chain_is_not_trusted() {
        let mem = memory();
        header(&mem, 0x1000, VIRTIO_BLK_T_IN, 0);
        // The walk stopped (loop, bad index...) on a descriptor that still
        // points onwards: its last byte is not a status byte.
        let mut descs = chain(&[(0x1000, 16, R), (0x3000, 1, W)]);
        descs[1] = Descriptor::new(0x3000, 1, W | VRING_DESC_F_NEXT as u16, 5);
        assert_eq!(parse_with(descs, &mem, &limits()), Err(NoStatus));
    }

    #[test]
    fn out_of_range_and_overflowing_sectors_fail() {
        let mem = memory();
        let io = |sector: u64, len: u32| {
            header(&mem, 0x1000, VIRTIO_BLK_T_IN, sector);
            status_of(chain(&[(0x1000, 16, R), (0x2000, len, W), (0x3000, 1, W)]), &mem, &limits())
        };
        assert_eq!(io(2047, 512), None, "last sector is fine");
        assert_eq!(io(2048, 512), Some(status::IOERR), "first sector past the end");
        assert_eq!(io(2047, 1024), Some(status::IOERR), "straddles the end");
        assert_eq!(io(u64::MAX / 256, 512), Some(status::IOERR), "sector * 512 overflows");
        assert_eq!(io(u64::MAX / 512, 512), Some(status::IOERR), "offset + len overflows");
        assert_eq!(io(0, 100), Some(status::IOERR), "not a whole number of blocks");
        assert_eq!(io(0, 0xF_0000), None, "a large request inside the disk");
        assert_eq!(io(512, 0xF_0000), Some(status::IOERR), "a large request past the end");
    }

    #[test]
    fn data_outside_guest_memory_fails() {
        let mem = memory();
        header(&mem, 0x1000, VIRTIO_BLK_T_IN, 0);
        let descs = chain(&[(0x1000, 16, R), (MEM_SIZE - 256, 512, W), (0x3000, 1, W)]);
        assert_eq!(status_of(descs, &mem, &limits()), Some(status::IOERR));
        header(&mem, 0x1000, VIRTIO_BLK_T_OUT, 0);
        let descs = chain(&[(0x1000, 16, R), (0xdead_0000_0000, 512, R), (0x3000, 1, W)]);
        assert_eq!(status_of(descs, &mem, &limits()), Some(status::IOERR));
        // A header that is not in guest memory.
        let descs = chain(&[(MEM_SIZE + 0x1000, 16, R), (0x3000, 1, W)]);
        assert_eq!(status_of(descs, &mem, &limits()), Some(status::IOERR));
    }

    #[test]
    fn wrong_directions_and_shapes_fail() {
        let mem = memory();
        header(&mem, 0x1000, VIRTIO_BLK_T_IN, 0);
        // Readable after writable.
        let descs = chain(&[(0x1000, 16, R), (0x2000, 512, W), (0x4000, 512, R), (0x3000, 1, W)]);
        assert_eq!(status_of(descs, &mem, &limits()), Some(status::IOERR));
        // A header shorter than 16 bytes.
        assert_eq!(status_of(chain(&[(0x1000, 8, R), (0x3000, 1, W)]), &mem, &limits()), Some(status::IOERR));
        // More descriptors than seg_max allows.
        let mut parts = vec![(0x1000, 16, R)];
        parts.extend((0..MAX_DESCRIPTORS as u64).map(|i| (0x8000 + i * 512, 512, W)));
        parts.push((0x3000, 1, W));
        assert_eq!(status_of(chain(&parts), &mem, &limits()), Some(status::IOERR));
    }

    #[test]
    fn writes_to_a_read_only_export_fail() {
        let mem = memory();
        let ro = Limits { writable: false, ..limits() };
        for kind in [VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_WRITE_ZEROES] {
            header(&mem, 0x1000, kind, 0);
            let descs = chain(&[(0x1000, 16, R), (0x2000, 512, R), (0x3000, 1, W)]);
            assert_eq!(status_of(descs, &mem, &ro), Some(status::IOERR), "type {kind}");
        }
        header(&mem, 0x1000, VIRTIO_BLK_T_FLUSH, 0);
        let req = parse_with(chain(&[(0x1000, 16, R), (0x3000, 1, W)]), &mem, &ro).unwrap();
        assert_eq!(req.action, Action::Flush, "flush is fine on a read-only export");
    }

    #[test]
    fn unknown_types_and_flags_are_unsupported() {
        let mem = memory();
        header(&mem, 0x1000, 0x4242, 0);
        assert_eq!(status_of(chain(&[(0x1000, 16, R), (0x3000, 1, W)]), &mem, &limits()), Some(status::UNSUPP));

        let segment = |sector: u64, sectors: u32, flags: u32| {
            mem.write_obj(sector.to_le(), GuestAddress(0x2000)).unwrap();
            mem.write_obj(sectors.to_le(), GuestAddress(0x2008)).unwrap();
            mem.write_obj(flags.to_le(), GuestAddress(0x200c)).unwrap();
        };
        let request = |kind| {
            header(&mem, 0x1000, kind, 0);
            parse_with(chain(&[(0x1000, 16, R), (0x2000, 16, R), (0x3000, 1, W)]), &mem, &limits()).unwrap().action
        };
        segment(8, 8, 0);
        assert_eq!(request(VIRTIO_BLK_T_DISCARD), Action::Discard { offset: 4096, len: 4096 });
        segment(8, 8, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP);
        assert_eq!(request(VIRTIO_BLK_T_DISCARD), Action::Done(status::UNSUPP), "unmap flag on discard");
        assert_eq!(request(VIRTIO_BLK_T_WRITE_ZEROES), Action::WriteZeroes { offset: 4096, len: 4096, unmap: true });
        segment(8, 8, 0x80);
        assert_eq!(request(VIRTIO_BLK_T_WRITE_ZEROES), Action::Done(status::UNSUPP), "unknown flag");
        segment(0, 129, 0);
        assert_eq!(request(VIRTIO_BLK_T_DISCARD), Action::Done(status::IOERR), "over max_discard_sectors");
        segment(2040, 16, 0);
        assert_eq!(request(VIRTIO_BLK_T_WRITE_ZEROES), Action::Done(status::IOERR), "past the end");
        // Two segments while max_discard_seg is 1.
        header(&mem, 0x1000, VIRTIO_BLK_T_DISCARD, 0);
        let descs = chain(&[(0x1000, 16, R), (0x2000, 32, R), (0x3000, 1, W)]);
        assert_eq!(status_of(descs, &mem, &limits()), Some(status::UNSUPP));
    }

    #[test]
    fn large_blocks_need_aligned_requests() {
        let mem = memory();
        let big = Limits { block_size: 4096, ..limits() };
        header(&mem, 0x1000, VIRTIO_BLK_T_IN, 1);
        let descs = chain(&[(0x1000, 16, R), (0x2000, 4096, W), (0x3000, 1, W)]);
        assert_eq!(status_of(descs, &mem, &big), Some(status::IOERR));
        header(&mem, 0x1000, VIRTIO_BLK_T_IN, 8);
        let descs = chain(&[(0x1000, 16, R), (0x2000, 4096, W), (0x3000, 1, W)]);
        assert_eq!(status_of(descs, &mem, &big), None);
    }

    #[test]
    fn get_id_pads_and_truncates_the_serial() {
        assert_eq!(&id_bytes("abc")[..4], b"abc\0");
        assert_eq!(&id_bytes("0123456789abcdefghijXYZ"), b"0123456789abcdefghij");
        let mem = memory();
        header(&mem, 0x1000, VIRTIO_BLK_T_GET_ID, 0);
        let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; MAX_IOVECS];
        let descs = chain(&[(0x1000, 16, R), (0x2000, 20, W), (0x3000, 1, W)]);
        let ram = GuestRam::new(std::sync::Arc::new(mem.clone()));
        let req = Parser::new().parse(descs.into_iter(), &ram, &limits(), &mut iov).unwrap();
        assert_eq!(req.action, Action::GetId);
        // SAFETY: parse just mapped these iovecs into `mem`, alive here.
        let n = unsafe { write_id(&iov[..req.iovcnt], &id_bytes("serial-1")) };
        assert_eq!(n, 20);
        let mut back = [0u8; 8];
        mem.read_slice(&mut back, GuestAddress(0x2000)).unwrap();
        assert_eq!(&back, b"serial-1");
    }
}
