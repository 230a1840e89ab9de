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
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

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
    fn len(&self) -> u64 {
        self.spans.iter().map(|s| s.len).sum::<u64>() - self.skip
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

    /// Copies the region's first `out.len()` bytes out of guest memory.
    fn read<M: GuestMemoryBackend>(self, mem: &M, out: &mut [u8]) -> bool {
        let mut done = 0;
        for (addr, len) in self.pieces() {
            let n = len.min((out.len() - done) as u64) as usize;
            if n == 0 {
                break;
            }
            if mem.read_slice(&mut out[done..done + n], GuestAddress(addr)).is_err() {
                return false;
            }
            done += n;
        }
        done == out.len()
    }

    /// Maps the region to host iovecs; `None` if it leaves guest memory or
    /// needs more than `iov.len()` of them.
    fn map<M: GuestMemoryBackend>(self, mem: &M, iov: &mut [libc::iovec]) -> Option<usize> {
        let mut count = 0;
        for (addr, len) in self.pieces() {
            for slice in mem.get_slices(GuestAddress(addr), usize::try_from(len).ok()?) {
                let slice = slice.ok()?;
                *iov.get_mut(count)? =
                    libc::iovec { iov_base: slice.ptr_guard_mut().as_ptr().cast(), iov_len: slice.len() };
                count += 1;
            }
        }
        Some(count)
    }
}

/// Parses one descriptor chain.
///
/// `descriptors` yields the chain as the queue walks it (which stops at
/// loops, over-long chains and bad indirect tables); data buffers are mapped
/// into `iov`. Host pointers in `iov` stay valid while `mem`'s mappings do.
pub fn parse<M: GuestMemoryBackend>(
    descriptors: impl Iterator<Item = Descriptor>,
    mem: &M,
    limits: &Limits,
    iov: &mut [libc::iovec; MAX_IOVECS],
) -> Result<Request, NoStatus> {
    let mut spans = [Span::default(); MAX_DESCRIPTORS];
    let mut count = 0usize;
    let mut first_writable = None;
    let mut misordered = false;
    let mut last = None;
    for desc in descriptors {
        if count < MAX_DESCRIPTORS {
            spans[count] = Span { addr: desc.addr().0, len: u64::from(desc.len()) };
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
    let status = GuestAddress(last.addr().0).checked_add(u64::from(last.len()) - 1).ok_or(NoStatus)?;
    if !mem.check_range(status, 1) {
        return Err(NoStatus);
    }
    let done = |code| Ok(Request { status, action: Action::Done(code), iovcnt: 0 });
    if count > MAX_DESCRIPTORS || misordered {
        return done(status::IOERR);
    }
    let first_writable = first_writable.unwrap_or(count);
    spans[count - 1].len -= 1; // the status byte is not data
    let readable = Region { spans: &spans[..first_writable], skip: 0 };
    let writable = Region { spans: &spans[first_writable..count], skip: 0 };

    let mut header = [0u8; HEADER_LEN as usize];
    if !readable.read(mem, &mut header) {
        return done(status::IOERR);
    }
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
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => match range_command(kind, payload, mem, limits) {
            Ok(action) => (action, None),
            Err(code) => return done(code),
        },
        _ => return done(status::UNSUPP),
    };
    let iovcnt = match data {
        Some(region) => match region.map(mem, iov) {
            Some(n) => n,
            None => return done(status::IOERR),
        },
        None => 0,
    };
    Ok(Request { status, action, iovcnt })
}

/// Checks a discard or write-zeroes payload: exactly one segment
/// (`max_discard_seg` is 1), known flags, a valid range.
fn range_command<M: GuestMemoryBackend>(
    kind: u32,
    payload: Region<'_>,
    mem: &M,
    limits: &Limits,
) -> Result<Action, u8> {
    if !limits.writable {
        return Err(status::IOERR);
    }
    if payload.len() > SEGMENT_LEN {
        return Err(status::UNSUPP);
    }
    let mut segment = [0u8; SEGMENT_LEN as usize];
    if !payload.read(mem, &mut segment) {
        return Err(status::IOERR);
    }
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
