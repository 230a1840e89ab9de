//! A qcow2 image of arbitrary bytes: opened read-only and writable (which
//! may rebuild refcounts and clears autoclear bits), mapped across the
//! disk, then written, zeroed, discarded and flushed at places the input
//! picks; writable, it keeps its persistent bitmaps as vsd's qcow2 node
//! does (loaded, flagged in use, stored back before the close). Any result is fine except a panic, a hang or an out-of-bounds
//! access; corrupt metadata must surface as errors.

#![no_main]

use libfuzzer_sys::fuzz_target;
use vsd_qcow2::mem::MemFile;
use vsd_qcow2::{Image, ImageIo, MapMemo, Options};

/// Growth of the in-memory file is capped, so that a header asking for
/// terabytes costs an error rather than the fuzzer's memory.
const MAX_FILE: u64 = 64 << 20;

fn exercise(file: &mut MemFile, writable: bool, pick: u64) {
    let len = file.bytes.len() as u64;
    // No backing file is supplied, so none is assumed.
    let opts = Options {
        writable,
        l2_cache_bytes: Some(1 << 20),
        has_backing: Some(false),
        keep_bitmaps: writable,
        ..Options::default()
    };
    let Ok(image) = Image::open(file, len, opts) else { return };
    let size = image.size();
    if size == 0 {
        return;
    }
    let mut memo = MapMemo::default();
    let step = (size / 64).max(image.cluster_size());
    let mut offset = pick % size;
    for _ in 0..64 {
        let _ = image.map(&mut memo, file, offset, 1 << 20);
        offset = (offset + step) % size;
    }
    if !writable {
        return;
    }
    let at = pick % size;
    let n = (size - at).min(64 << 10);
    let mut io = ImageIo { meta: file, data: None, backing: None };
    let bitmaps = image.load_bitmaps(&mut io).unwrap_or_default();
    let _ = image.mark_bitmaps_in_use(&mut io);
    let _ = image.write(&mut io, at, n, &mut |_, buf: &mut [u8]| buf.fill(0x5a));
    let _ = image.write_zeroes(&mut io, at / 2, n, pick & 1 == 0, pick & 4 != 0);
    let _ = image.discard(&mut io, at / 3, n);
    // Half the size, or up to 4 times it (small clusters move the L1 table).
    let new_size = match (pick >> 8) % 4 {
        0 => (size / 2).max(512) & !511,
        n => size.saturating_mul(n),
    };
    let _ = image.resize(&mut io, new_size);
    let _ = image.flush(&mut io);
    let _ = image.store_bitmaps(&mut io, &bitmaps);
    let _ = image.close(&mut io);
}

fuzz_target!(|data: &[u8]| {
    let pick = data.iter().rev().take(8).fold(0u64, |acc, &b| acc << 8 | u64::from(b));
    exercise(&mut MemFile::new(data.to_vec(), MAX_FILE), false, pick);
    exercise(&mut MemFile::new(data.to_vec(), MAX_FILE), true, pick);
});
