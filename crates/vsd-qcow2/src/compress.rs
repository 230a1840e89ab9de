//! Compression of clusters, as QEMU writes them, and their decompression.
//! Decompressed output must fill the cluster exactly, as QEMU requires;
//! the input may carry trailing bytes up to the end of its last 512-byte
//! sector.

use std::ffi::{c_int, c_uint, c_void};
use std::io::Read;
use std::sync::OnceLock;

use libloading::Library;

use miniz_oxide::inflate::TINFLStatus;
use miniz_oxide::inflate::core::{DecompressorOxide, decompress, inflate_flags};

use crate::header::Compression;

/// Compresses one whole cluster into at most `limit` bytes; None if it
/// does not fit (then QEMU writes the cluster uncompressed).
pub fn compress_cluster(kind: Compression, input: &[u8], limit: usize) -> Option<Vec<u8>> {
    match kind {
        Compression::Zlib => deflate_raw(input, limit),
        Compression::Zstd => libzstd()?.compress(input, limit),
    }
}

/// libzstd's one-shot compression, loaded at run time as QEMU links it.
/// ruzstd's encoder (0.8) has a single level, about zstd's 1, and turns a
/// cluster of data followed by zeroes into more than the cluster: most
/// clusters of a disk image would be stored uncompressed.
struct Zstd {
    compress: unsafe extern "C" fn(*mut c_void, usize, *const c_void, usize, c_int) -> usize,
    is_error: unsafe extern "C" fn(usize) -> c_uint,
    _lib: Library,
}

/// zstd's default level, QEMU's (`ZSTD_CLEVEL_DEFAULT`).
const ZSTD_LEVEL: c_int = 3;

/// libzstd, loaded once; without it zstd clusters are written
/// uncompressed (a valid image, only larger), which is logged once.
fn libzstd() -> Option<&'static Zstd> {
    static ZSTD: OnceLock<Option<Zstd>> = OnceLock::new();
    let load = || -> Result<Zstd, libloading::Error> {
        // SAFETY: libzstd's initialisers set up nothing vsd relies on; the
        // symbols' types are their declarations in zstd.h (stable API).
        unsafe {
            let lib = Library::new("libzstd.so.1")?;
            let compress = *lib.get(b"ZSTD_compress\0")?;
            let is_error = *lib.get(b"ZSTD_isError\0")?;
            Ok(Zstd { compress, is_error, _lib: lib })
        }
    };
    let loaded = ZSTD.get_or_init(|| {
        load()
            .map_err(|e| log::warn!("qcow2: cannot load libzstd.so.1 ({e}): zstd clusters are written uncompressed"))
            .ok()
    });
    loaded.as_ref()
}

impl Zstd {
    fn compress(&self, input: &[u8], limit: usize) -> Option<Vec<u8>> {
        let mut out = vec![0u8; limit];
        // SAFETY: both buffers are live for the call with the lengths given.
        let n =
            unsafe { (self.compress)(out.as_mut_ptr().cast(), limit, input.as_ptr().cast(), input.len(), ZSTD_LEVEL) };
        // SAFETY: a plain function of the value.
        if unsafe { (self.is_error)(n) } != 0 {
            return None; // no room: it does not fit
        }
        out.truncate(n);
        Some(out)
    }
}

/// Raw deflate with a 4 KiB window (QEMU's `windowBits` -12): QEMU
/// inflates with that window, so a stream reaching further back than 4 KiB
/// would not read back there. miniz_oxide always uses 32 KiB.
fn deflate_raw(input: &[u8], limit: usize) -> Option<Vec<u8>> {
    let mut deflate = flate2::Compress::new_with_window_bits(flate2::Compression::default(), false, 12);
    let mut out = vec![0; limit];
    match deflate.compress(input, &mut out, flate2::FlushCompress::Finish) {
        Ok(flate2::Status::StreamEnd) => {
            out.truncate(deflate.total_out() as usize);
            Some(out)
        }
        // Out of room before the end: it does not fit.
        _ => None,
    }
}

/// Decompresses `input` into `out` (one whole cluster). Returns false when
/// the data is damaged or does not fill the cluster.
pub fn decompress_cluster(kind: Compression, input: &[u8], out: &mut [u8]) -> bool {
    match kind {
        Compression::Zlib => inflate_raw(input, out),
        Compression::Zstd => zstd(input, out),
    }
}

/// Raw deflate (QEMU writes it with a 4 KiB window and no zlib header).
fn inflate_raw(input: &[u8], out: &mut [u8]) -> bool {
    let mut state = Box::new(DecompressorOxide::new());
    let flags = inflate_flags::TINFL_FLAG_USING_NON_WRAPPING_OUTPUT_BUF;
    let (status, _, written) = decompress(&mut state, input, out, 0, flags);
    matches!(status, TINFLStatus::Done | TINFLStatus::HasMoreOutput) && written == out.len()
}

fn zstd(mut input: &[u8], out: &mut [u8]) -> bool {
    match ruzstd::decoding::StreamingDecoder::new(&mut input) {
        Ok(mut decoder) => decoder.read_exact(out).is_ok(),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cluster of text-like bytes, one of noise, one of zeroes: each
    /// compressed by either method reads back whole, or is refused when it
    /// does not fit.
    #[test]
    fn clusters_round_trip_or_do_not_fit() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let noise: Vec<u8> = (0..65536)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let text: Vec<u8> =
            (0..65536u32).map(|i| b"qcow2 clusters, compressed "[(i % 27) as usize] ^ (i / 4096) as u8).collect();
        for kind in [Compression::Zlib, Compression::Zstd] {
            for (name, input) in [("text", &text), ("zeroes", &vec![0; 65536])] {
                let packed = compress_cluster(kind, input, 65535).unwrap_or_else(|| panic!("{kind:?} {name}"));
                assert!(packed.len() < 8192, "{kind:?} {name}: {} bytes", packed.len());
                let mut out = vec![0xff; 65536];
                // Trailing bytes up to a sector's end are read too.
                let padded = [packed, vec![0x5a; 300]].concat();
                assert!(decompress_cluster(kind, &padded, &mut out), "{kind:?} {name}");
                assert!(out == *input, "{kind:?} {name}");
            }
            assert_eq!(compress_cluster(kind, &noise, 65535), None, "{kind:?}: noise does not fit");
        }
    }
}
