//! Growing the virtual disk (QMP `block_resize`).
//!
//! The active L1 table fills whole clusters on disk, whatever its `l1_size`,
//! so a disk can grow until those clusters are full (4 TiB with 64 KiB
//! clusters) without moving the table: the new entries are written as zero,
//! made durable, and only then does the header announce the new size and
//! L1 length. A crash before the header write leaves the old size intact.

use std::io;
use std::sync::atomic::Ordering;

use super::{Image, ImageIo};
use crate::header::field;

impl Image {
    /// Grows the virtual disk to `size` bytes; the new space reads as zeroes
    /// (or as the backing file, as QEMU reads it).
    pub fn grow(&self, io: &mut ImageIo, size: u64) -> io::Result<()> {
        let unsupported = |why: String| io::Error::new(io::ErrorKind::Unsupported, why);
        if !self.writable() {
            return Err(io::Error::new(io::ErrorKind::PermissionDenied, "the image is read-only"));
        }
        let old = self.size();
        if size < old {
            return Err(unsupported(format!("shrinking a qcow2 image ({old} to {size} bytes) is not supported")));
        }
        if self.layout.data_file {
            return Err(unsupported("growing an image with an external data file is not supported yet".into()));
        }
        let entries = self.header.l1_entries_for(size);
        if entries > self.l1.len() as u64 {
            return Err(unsupported(format!(
                "growing to {size} bytes needs {entries} L1 entries, more than the table's clusters hold ({}); \
                 moving the L1 table is not supported yet",
                self.l1.len()
            )));
        }
        // Everything pending first: the header write below must not make
        // durable a size whose tables are not.
        self.flush(io)?;
        let mut meta = self.lock();
        let old_entries = self.header.l1_entries_for(old).max(u64::from(self.header.l1_size));
        for index in old_entries..entries {
            // Zero in memory already; written so that whatever the clusters
            // held past the old length is gone before the header points there.
            self.set_l1(&mut meta, index as usize, 0);
        }
        drop(meta);
        self.flush(io)?;
        let mut meta = self.lock();
        let fields = field::SIZE as usize..field::L1_SIZE as usize + 4;
        let before = meta.header_chunk[fields.clone()].to_vec();
        let l1_size = u32::try_from(entries.max(u64::from(self.header.l1_size))).unwrap_or(u32::MAX);
        meta.header_chunk[fields.start..fields.start + 8].copy_from_slice(&size.to_be_bytes());
        meta.header_chunk[fields.end - 4..fields.end].copy_from_slice(&l1_size.to_be_bytes());
        if let Err(e) = io.meta.write_at(&meta.header_chunk, 0).and_then(|()| io.meta.flush()) {
            meta.header_chunk[fields].copy_from_slice(&before);
            return Err(e);
        }
        self.size.store(size, Ordering::Release);
        Ok(())
    }
}
