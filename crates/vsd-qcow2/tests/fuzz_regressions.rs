//! Images the fuzzer (`fuzz/`, target `qcow2_image`) found that broke
//! vsd-qcow2, replayed as the target runs them.

use vsd_qcow2::mem::MemFile;
use vsd_qcow2::{Image, ImageIo, Options};

/// Opens `bytes` writable and writes 64 KiB at `at`, as the fuzz target did.
fn write_into(bytes: &[u8], at: u64) -> std::io::Result<()> {
    let mut file = MemFile::new(bytes.to_vec(), 64 << 20);
    let len = bytes.len() as u64;
    let opts = Options { writable: true, has_backing: Some(false), ..Options::default() };
    let image = Image::open(&mut file, len, opts).map_err(std::io::Error::other)?;
    let n = (image.size() - at % image.size()).min(64 << 10);
    let mut io = ImageIo { meta: &mut file, data: None, backing: None };
    image.write(&mut io, at % image.size(), n, &mut |_, buf: &mut [u8]| buf.fill(0x5a))
}

/// Refcount blocks that mark every cluster used sent allocation scanning
/// and adding refcount metadata without end (gigabytes in seconds). Now an
/// allocation that needs more than a few rounds of new metadata is an error.
#[test]
fn refcounts_marking_everything_used_fail_the_write_instead_of_running_away() {
    for image in
        [&include_bytes!("data/fuzz-alloc-runaway-1.qcow2")[..], &include_bytes!("data/fuzz-alloc-runaway-2.qcow2")[..]]
    {
        let pick = image.iter().rev().take(8).fold(0u64, |acc, &b| acc << 8 | u64::from(b));
        let err = write_into(image, pick).expect_err("the refcounts are garbage");
        let corrupt = vsd_qcow2::CorruptMetadata::of(&err);
        assert!(corrupt.is_some_and(|what| what.contains("refcounts")), "{err}");
    }
}
