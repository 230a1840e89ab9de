//! Decompression of compressed clusters. Output must fill the cluster
//! exactly, as QEMU requires; the input may carry trailing bytes up to the
//! end of its last 512-byte sector.

use std::io::Read;

use miniz_oxide::inflate::TINFLStatus;
use miniz_oxide::inflate::core::{DecompressorOxide, decompress, inflate_flags};

use crate::header::Compression;

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
