//! A guest's virtqueue: a split ring and the requests it names, all in
//! guest memory the input fills, popped and parsed as a queue worker does
//! (`vsd_virtio::ring::SplitQueue` for the head, `vsd_virtio::chain::Chain`
//! over `vsd_virtio::ram::GuestRam` for the descriptors, then
//! `vsd_virtio::request::parse`), then completed (status byte, GET_ID
//! answer, used entry, notification). Differentially: vsd's ring must
//! accept the same set-ups, take the same heads, write the same used
//! entries and notify when virtio-queue's `Queue` does, and vsd's chain
//! walker must yield exactly the descriptors virtio-queue's yields.
//!
//! Input: a 48-byte header, then the first bytes of guest memory.
//!
//! | bytes | what |
//! |---|---|
//! | 0 | bit 0 writable export, bit 1 EVENT_IDX, bits 2-3 block size (512 << n), bits 4-6 second region |
//! | 1 | queue size, 1 << (n % 11) (1 to 1024, the export's maximum) |
//! | 2-3 | next available index, as a reconnecting front-end sets it |
//! | 4-11 | capacity in bytes (rounded down to whole blocks) |
//! | 12-15, 16-19 | max discard, max write-zeroes sectors |
//! | 20-27, 28-35, 36-43 | descriptor table, available ring, used ring addresses |
//! | 44 | bit 0: ask whether to notify after each used entry (else only at the end) |
//! | 45-47 | unused |
//!
//! Guest memory is 64 KiB at 0, filled from the rest of the input (zero
//! beyond it), and maybe a second region holding the same bytes: right
//! after the first (buffers straddle the boundary), after a hole, across
//! the 4 GiB line, at the very top of the address space, or 64 MiB (mostly
//! untouched) for long buffers. Descriptors, indirect tables, loops and
//! flags are whatever the memory says.
//!
//! Every parse result is checked against the parser's contract (module
//! docs of `request.rs`): a chain gets no status only when its last
//! descriptor is not a writable byte in memory that ends the chain; a
//! misordered or over-long chain is an error; a request is accepted
//! exactly when it is well formed, with the action and data buffers the
//! descriptors name (host pointers inside guest memory, lengths adding up,
//! ranges aligned and inside the disk); and everything else gets IOERR or
//! UNSUPP.

#![no_main]

use libfuzzer_sys::fuzz_target;
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    VIRTIO_BLK_T_WRITE_ZEROES,
};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, MemoryRegionAddress};
use vsd_virtio::MAX_QUEUE_SIZE;
use vsd_virtio::ram::GuestRam;
use vsd_virtio::request::{self, Action, Limits, MAX_DESCRIPTORS, MAX_IOVECS, NoStatus, Request, SECTOR_SIZE, status};
use vsd_virtio::ring::{RingError, SplitQueue};

const HEADER: usize = 48;

/// `VSD_FUZZ_DEBUG=1` prints what each chain parsed to (to check seeds).
static DEBUG: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
const REGION0: usize = 64 << 10;

/// Where the second region goes, if anywhere.
fn second_region(layout: u8) -> Option<(u64, usize)> {
    match layout {
        1 => Some((REGION0 as u64, REGION0)),
        2 => Some((0x2_0000, 16 << 10)),
        3 => Some(((1 << 32) - 0x8000, REGION0)),
        4 => Some((u64::MAX - REGION0 as u64, REGION0)),
        5 => Some((0x1000_0000, 64 << 20)),
        _ => None,
    }
}

fn memory(layout: u8, image: &[u8]) -> GuestMemoryMmap {
    let mut ranges = vec![(GuestAddress(0), REGION0)];
    ranges.extend(second_region(layout).map(|(base, size)| (GuestAddress(base), size)));
    let mem = GuestMemoryMmap::from_ranges(&ranges).expect("guest memory");
    for region in mem.iter() {
        let n = image.len().min(region.len() as usize);
        region.write_slice(&image[..n], MemoryRegionAddress(0)).expect("fits");
    }
    mem
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// A host buffer, as an address and a length.
type Piece = (usize, usize);

/// The host buffers that guest ranges map to, one per range and region
/// crossed, after skipping `skip` bytes; None if a byte is outside guest
/// memory.
fn host_pieces(mem: &GuestMemoryMmap, ranges: &[(u64, u64)], mut skip: u64) -> Option<Vec<Piece>> {
    let mut pieces = Vec::new();
    for &(addr, len) in ranges {
        let taken = skip.min(len);
        skip -= taken;
        let (mut addr, mut len) = (addr.checked_add(taken)?, len - taken);
        while len > 0 {
            let region = mem.find_region(GuestAddress(addr))?;
            let offset = addr - region.start_addr().0;
            let n = (region.len() - offset).min(len);
            let host = region.get_host_address(MemoryRegionAddress(offset)).ok()?;
            pieces.push((host as usize, n as usize));
            len -= n;
            addr = match addr.checked_add(n) {
                Some(next) => next,
                None if len == 0 => break,
                None => return None,
            };
        }
    }
    Some(pieces)
}

/// The first `n` bytes of guest ranges, if they are all in memory.
fn gather(mem: &GuestMemoryMmap, ranges: &[(u64, u64)], skip: u64, n: usize) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(n);
    for (host, len) in host_pieces_prefix(mem, ranges, skip, n as u64)? {
        // SAFETY: `host_pieces` only returns buffers inside the mappings of
        // `mem`, which is alive.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(host as *const u8, len) });
    }
    (out.len() == n).then_some(out)
}

/// `host_pieces` of the first `n` bytes only.
fn host_pieces_prefix(mem: &GuestMemoryMmap, ranges: &[(u64, u64)], skip: u64, n: u64) -> Option<Vec<Piece>> {
    let mut left = n;
    let mut cut = Vec::new();
    let mut skipped = skip;
    for &(addr, len) in ranges {
        let taken = skipped.min(len);
        skipped -= taken;
        let take = (len - taken).min(left);
        if take > 0 {
            cut.push((addr.checked_add(taken)?, take));
        }
        left -= take;
    }
    host_pieces(mem, &cut, 0)
}

fn total(ranges: &[(u64, u64)]) -> u64 {
    ranges.iter().map(|r| r.1).sum()
}

/// The byte range of a request if aligned and inside the disk.
fn byte_range(limits: &Limits, sector: u64, len: u64) -> Option<(u64, u64)> {
    let offset = sector.checked_mul(SECTOR_SIZE)?;
    let end = offset.checked_add(len)?;
    let block = u64::from(limits.block_size);
    (offset.is_multiple_of(block) && len.is_multiple_of(block) && end <= limits.capacity).then_some((offset, len))
}

/// What a well-formed request must parse to, given its kind: Some(action
/// and data buffers) if it is well formed, None if it must fail.
fn expected(
    mem: &GuestMemoryMmap,
    limits: &Limits,
    kind: u32,
    sector: u64,
    readable: &[(u64, u64)],
    writable: &[(u64, u64)],
) -> Option<(Action, Vec<Piece>)> {
    let mapped = |pieces: Option<Vec<Piece>>| pieces.filter(|p| p.len() <= MAX_IOVECS);
    let payload_len = total(readable) - 16;
    match kind {
        VIRTIO_BLK_T_IN => {
            let (offset, len) = byte_range(limits, sector, total(writable))?;
            Some((Action::Read { offset, len }, mapped(host_pieces(mem, writable, 0))?))
        }
        VIRTIO_BLK_T_OUT if limits.writable => {
            let (offset, len) = byte_range(limits, sector, payload_len)?;
            Some((Action::Write { offset, len }, mapped(host_pieces(mem, readable, 16))?))
        }
        VIRTIO_BLK_T_FLUSH => Some((Action::Flush, Vec::new())),
        VIRTIO_BLK_T_GET_ID if total(writable) > 0 => Some((Action::GetId, mapped(host_pieces(mem, writable, 0))?)),
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES if limits.writable && payload_len == 16 => {
            let segment = gather(mem, readable, 16, 16)?;
            let (sector, sectors, flags) = (u64_at(&segment, 0), u32_at(&segment, 8), u32_at(&segment, 12));
            let (unmap, max) = match kind {
                VIRTIO_BLK_T_DISCARD if flags == 0 => (false, limits.max_discard_sectors),
                VIRTIO_BLK_T_WRITE_ZEROES if flags & !1 == 0 => (flags == 1, limits.max_write_zeroes_sectors),
                _ => return None,
            };
            if sectors > max {
                return None;
            }
            let (offset, len) = byte_range(limits, sector, u64::from(sectors) * SECTOR_SIZE)?;
            let action = match kind {
                VIRTIO_BLK_T_DISCARD => Action::Discard { offset, len },
                _ => Action::WriteZeroes { offset, len, unmap },
            };
            Some((action, Vec::new()))
        }
        _ => None,
    }
}

/// Checks one parse against the contract.
fn check(
    mem: &GuestMemoryMmap,
    limits: &Limits,
    descs: &[Descriptor],
    result: &Result<Request, NoStatus>,
    iov: &[libc::iovec],
) {
    // A status byte: the last descriptor ends the chain, is writable and
    // its last byte is in guest memory.
    let status = descs.last().filter(|d| !d.has_next() && d.is_write_only() && d.len() > 0).and_then(|d| {
        let at = d.addr().0.checked_add(u64::from(d.len()) - 1)?;
        mem.check_range(GuestAddress(at), 1).then_some(GuestAddress(at))
    });
    let Some(status_addr) = status else {
        assert_eq!(result, &Err(NoStatus), "chain without a status byte: {descs:?}");
        return;
    };
    let request = (*result).unwrap_or_else(|_| panic!("a status byte at {status_addr:?} was not found: {descs:?}"));
    assert_eq!(request.status, status_addr);
    assert!(request.iovcnt <= MAX_IOVECS);
    let parsed: Vec<Piece> = iov[..request.iovcnt].iter().map(|v| (v.iov_base as usize, v.iov_len)).collect();
    // Every data buffer lies inside a region's mapping.
    for &(host, len) in &parsed {
        assert!(len > 0, "empty iovec: {parsed:?}");
        let inside = mem.iter().any(|r| {
            let base = r.get_host_address(MemoryRegionAddress(0)).expect("mapped") as usize;
            host >= base && host + len <= base + r.len() as usize
        });
        assert!(inside, "iovec {host:#x}+{len} outside guest memory: {descs:?}");
    }
    let writable_from = descs.iter().position(|d| d.is_write_only()).unwrap_or(descs.len());
    let ordered = descs[writable_from..].iter().all(|d| d.is_write_only());
    if descs.len() > MAX_DESCRIPTORS || !ordered {
        assert_eq!(request.action, Action::Done(status::IOERR), "misordered or over-long: {descs:?}");
        assert_eq!(request.iovcnt, 0);
        return;
    }
    let span = |d: &Descriptor| (d.addr().0, u64::from(d.len()));
    let readable: Vec<(u64, u64)> = descs[..writable_from].iter().map(span).collect();
    let mut writable: Vec<(u64, u64)> = descs[writable_from..].iter().map(span).collect();
    writable.last_mut().expect("the status descriptor").1 -= 1;
    let Some(header) = gather(mem, &readable, 0, 16) else {
        assert_eq!(request.action, Action::Done(status::IOERR), "no header: {descs:?}");
        return;
    };
    let (kind, sector) = (u32_at(&header, 0), u64_at(&header, 8));
    match expected(mem, limits, kind, sector, &readable, &writable) {
        Some((action, pieces)) => {
            assert_eq!(request.action, action, "kind {kind} sector {sector}: {descs:?} {limits:?}");
            assert_eq!(parsed, pieces, "data buffers differ from the descriptors': {descs:?}");
            if let Action::Read { len, .. } | Action::Write { len, .. } = action {
                assert_eq!(parsed.iter().map(|p| p.1 as u64).sum::<u64>(), len, "lengths do not add up");
            }
            if let Action::Read { len, .. } = action {
                // The used length is len + 1 as a u32.
                assert!(len < u64::from(u32::MAX), "read of {len} bytes: its used length overflows");
            }
        }
        None => {
            let Action::Done(code) = request.action else {
                panic!(
                    "malformed request accepted as {:?}: kind {kind} sector {sector} {descs:?} {limits:?}",
                    request.action
                )
            };
            let known = [VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID];
            match kind {
                _ if known.contains(&kind) => assert_eq!(code, status::IOERR, "kind {kind}"),
                VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
                    assert!(code == status::IOERR || code == status::UNSUPP, "kind {kind}: status {code}")
                }
                _ => assert_eq!(code, status::UNSUPP, "unknown kind {kind}"),
            }
            assert_eq!(request.iovcnt, 0);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((header, image)) = data.split_first_chunk::<HEADER>() else { return };
    let flags = header[0];
    let block_size = 512u32 << ((flags >> 2) & 3);
    let capacity = u64_at(header, 4);
    let limits = Limits {
        capacity: capacity - capacity % u64::from(block_size),
        block_size,
        writable: flags & 1 != 0,
        max_discard_sectors: u32_at(header, 12),
        max_write_zeroes_sectors: u32_at(header, 16),
    };
    let mem = memory((flags >> 4) & 7, image);

    // The ring as the session sets it up (session.rs), and virtio-queue's
    // `Queue` on the same rings.
    let size = 1u16 << (header[1] % 11);
    assert!(size <= MAX_QUEUE_SIZE);
    let rings = [u64_at(header, 20), u64_at(header, 28), u64_at(header, 36)];
    let (next_avail, event_idx) = (u16::from_le_bytes([header[2], header[3]]), flags & 2 != 0);
    let ram = GuestRam::new(std::sync::Arc::new(mem.clone()));
    let ours = SplitQueue::new(size, rings, next_avail, event_idx, &ram);
    let mut queue = Queue::new(MAX_QUEUE_SIZE).expect("a queue");
    queue.set_size(size);
    let split = |a: u64| (Some(a as u32), Some((a >> 32) as u32));
    let (lo, hi) = split(rings[0]);
    queue.set_desc_table_address(lo, hi);
    let (lo, hi) = split(rings[1]);
    queue.set_avail_ring_address(lo, hi);
    let (lo, hi) = split(rings[2]);
    queue.set_used_ring_address(lo, hi);
    queue.set_event_idx(event_idx);
    queue.set_next_avail(next_avail);
    queue.set_ready(true);
    // virtio-queue ignores a misaligned address (keeping its default), so
    // the two only compare on aligned rings.
    let aligned = rings[0] % 16 == 0 && rings[1] % 2 == 0 && rings[2] % 4 == 0;
    if aligned {
        assert_eq!(ours.is_ok(), queue.is_valid(&mem), "ring set-up {rings:x?}, size {size}: {ours:?}");
    }
    let Ok(mut ours) = ours else {
        return; // the session refuses such a ring
    };
    // Nothing to compare against where virtio-queue cannot serve a ring
    // vsd serves: it takes an available ring at 0 for one never set up,
    // and its atomic accesses fail on fields that are not host-aligned,
    // as in a region at an odd guest address (layout 4).
    let odd_region = |at: u64| mem.find_region(GuestAddress(at)).is_some_and(|r| r.start_addr().0 % 2 == 1);
    if rings[1] == 0 || rings.iter().any(|&at| odd_region(at)) {
        return;
    }
    queue.set_next_used(ours.next_used());

    let empty = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
    let mut iov = [empty; MAX_IOVECS];
    let mut parser = request::Parser::new();
    // The guest may keep the ring full: a bounded number of requests.
    for _ in 0..2 * usize::from(size).min(64) {
        let available = ours.available(&ram);
        let theirs = queue.iter(&mem).map(|mut chains| chains.next());
        let chain = match (available, theirs) {
            (Ok(0), Ok(None)) => break,
            (Ok(n), Ok(Some(chain))) if n > 0 => chain,
            (Err(RingError::AvailTooFar(_)), Err(_)) => break, // a broken ring: the worker stops taking requests
            (ours, theirs) => panic!("available entries: vsd {ours:?}, virtio-queue {:?}", theirs.map(|c| c.is_some())),
        };
        let head = chain.head_index();
        match ours.pop(&ram) {
            Ok(popped) => assert_eq!(popped, head, "the heads taken differ"),
            Err(RingError::HeadOutOfRange(h)) if h == head && head >= size => break, // the worker stops too
            Err(e) => panic!("head {head}: {e}"),
        }
        let descs: Vec<Descriptor> = chain.collect();
        let chain: Vec<Descriptor> = ours.chain(&ram, head).collect();
        let fields = |d: &Descriptor| (d.addr().0, d.len(), d.flags(), d.next());
        assert_eq!(
            chain.iter().map(fields).collect::<Vec<_>>(),
            descs.iter().map(fields).collect::<Vec<_>>(),
            "chain {head}: vsd's walker and virtio-queue's disagree"
        );
        let result = parser.parse(chain.into_iter(), &ram, &limits, &mut iov);
        check(&mem, &limits, &descs, &result, &iov);
        if *DEBUG.get_or_init(|| std::env::var_os("VSD_FUZZ_DEBUG").is_some()) {
            eprintln!("chain {head}: {} descriptors -> {result:?}", descs.len());
        }
        // Completed as the worker completes it.
        let used_len = match result {
            Err(NoStatus) => 0,
            Ok(request) => {
                let (code, len) = match request.action {
                    Action::Done(code) => (code, 1),
                    Action::GetId => {
                        // SAFETY: checked above: the iovecs lie in `mem`.
                        let written = unsafe { request::write_id(&iov[..request.iovcnt], &request::id_bytes("fuzz")) };
                        (status::OK, written as u32 + 1)
                    }
                    Action::Read { len, .. } => (status::OK, len as u32 + 1),
                    _ => (status::OK, 1),
                };
                mem.write_obj(code, request.status).expect("the status byte is in memory");
                len
            }
        };
        // Both publish into the same used ring: what vsd wrote must be
        // what virtio-queue then writes over it, and both must agree on
        // whether the guest wants to hear of it.
        let slot = u64::from(queue.next_used() % size);
        let entry = GuestAddress(rings[2] + 4 + 8 * slot);
        let read_back = || (mem.read_obj::<[u32; 2]>(entry).ok(), mem.read_obj::<u16>(GuestAddress(rings[2] + 2)).ok());
        ours.push_used(&ram, head, used_len).expect("the used ring is in memory");
        let written = read_back();
        queue.add_used(&mem, head, used_len).expect("the used ring is in memory");
        assert_eq!(written, read_back(), "used entry {slot}");
        assert_eq!(written, (Some([u32::from(head), used_len]), Some(ours.next_used())));
        if header[44] & 1 != 0 {
            let wanted = queue.needs_notification(&mem).expect("the avail ring is in memory");
            assert_eq!(ours.needs_notification(&ram), Ok(wanted), "notification after used entry {slot}");
        }
    }
    let wanted = queue.needs_notification(&mem).expect("the avail ring is in memory");
    assert_eq!(ours.needs_notification(&ram), Ok(wanted), "notification at the end");
});
