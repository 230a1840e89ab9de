//! Growing and shrinking the virtual disk (QMP `block_resize`).
//!
//! The active L1 table fills whole clusters on disk, whatever its `l1_size`,
//! so a disk can grow until those clusters are full (4 TiB with 64 KiB
//! clusters) without moving the table: the new entries are written as zero,
//! made durable, and only then does the header announce the new size and
//! L1 length. Past that the table moves, as QEMU moves it: new clusters are
//! allocated, everything the table names is made durable, the table is
//! written there from memory, and one header write switches size, length
//! and place; the old clusters are freed after. A crash before the header
//! write leaves the old size and table intact (and the new clusters
//! leaked, no more). The entries in memory never move: an open image keeps
//! room for a disk 16 times its size (see `open`).
//!
//! Shrinking is QEMU's: every cluster past the new end is unmapped and
//! freed, the L2 tables wholly past it too, all of it made durable before
//! the header announces the new size. The file keeps its length (QEMU
//! truncates a free tail), and the L1 table its length and place.

use std::io;
use std::sync::atomic::Ordering;

use super::{Image, ImageIo, Meta};
use crate::SyncIo;
use crate::buf::AlignedBuf;
use crate::entry::L2Entry;
use crate::header::field;

impl Image {
    /// Changes the virtual disk's size to `size` bytes: new space reads
    /// as zeroes (or as the backing file, as QEMU reads it); what lies past
    /// a smaller size is gone.
    pub fn resize(&self, io: &mut ImageIo, size: u64) -> io::Result<()> {
        let unsupported = |why: &str| io::Error::new(io::ErrorKind::Unsupported, why.to_string());
        if !self.writable() {
            return Err(io::Error::new(io::ErrorKind::PermissionDenied, "the image is read-only"));
        }
        if self.layout.data_file {
            return Err(unsupported("resizing an image with an external data file is not supported yet"));
        }
        if self.lock().snapshots.len() > 0 && self.header.version < 3 {
            return Err(unsupported("Can't resize a v2 image which has snapshots"));
        }
        if size < self.size() { self.shrink(io, size) } else { self.grow(io, size) }
    }

    fn grow(&self, io: &mut ImageIo, size: u64) -> io::Result<()> {
        let entries = self.header.l1_entries_for(size);
        if entries > self.l1.len() as u64 {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!(
                    "growing to {size} bytes needs {entries} L1 entries, more than the image keeps room for while \
                 open ({}, for 16 times its size when opened): reopen it to grow further",
                    self.l1.len()
                ),
            ));
        }
        // Everything pending first: the header write below must not make
        // durable a size whose tables are not.
        self.flush(io)?;
        let _writeback = self.writeback();
        let mut meta = self.lock();
        let (old_offset, old_entries) = (meta.l1_offset(), meta.l1_size());
        let in_clusters = (old_entries * 8).next_multiple_of(self.cluster_size()) / 8;
        let moved = if entries > in_clusters {
            Some(self.write_l1_copy(&mut meta, io.meta, entries)?)
        } else {
            for index in old_entries..entries {
                // Zero in memory already; written so that whatever the
                // clusters held past the old length is gone before the
                // header points there.
                self.set_l1(&mut meta, index as usize, 0);
            }
            self.write_back_held(&mut meta, io.meta)?;
            None
        };
        let l1_size = u32::try_from(entries.max(old_entries)).unwrap_or(u32::MAX);
        let l1_offset = moved.map_or(old_offset, |(offset, _)| offset);
        if let Err(e) = self.write_size_fields(&mut meta, io.meta, size, l1_size, l1_offset) {
            if let Some((offset, clusters)) = moved {
                self.free_clusters(&mut meta, offset, clusters);
            }
            return Err(e);
        }
        if moved.is_some() && old_offset != 0 {
            self.free_clusters(&mut meta, old_offset, (old_entries * 8).div_ceil(self.cluster_size()));
        }
        self.note_dirty(&meta);
        self.size.store(size, Ordering::Release);
        Ok(())
    }

    fn shrink(&self, io: &mut ImageIo, size: u64) -> io::Result<()> {
        let (cs, old) = (self.cluster_size(), self.size());
        let start = size.next_multiple_of(cs);
        self.flush(io)?;
        let _writeback = self.writeback();
        let mut meta = self.lock();
        if start < old {
            self.check_idle(&meta, start, old - start).map_err(|_| {
                io::Error::new(io::ErrorKind::ResourceBusy, "clusters past the new end are being allocated: try again")
            })?;
        }
        let span = cs << self.l2_bits();
        let mut cluster = start;
        while cluster < old {
            let l1_entry = self.l1[(cluster / span) as usize].load(Ordering::Acquire);
            if l1_entry == 0 {
                cluster = (cluster / span + 1) * span;
                continue;
            }
            let (table, index, entry) = self.entry_for_write(&mut meta, io, cluster)?;
            if entry != L2Entry::UNALLOCATED {
                self.set_l2(&mut meta, &table, index, &L2Entry::UNALLOCATED)?;
                self.release(&mut meta, &entry);
            }
            cluster += cs;
        }
        for index in self.header.l1_entries_for(size)..self.header.l1_entries_for(old) {
            let l1_entry = self.l1[index as usize].load(Ordering::Acquire);
            if let Ok(Some((table, _))) = crate::entry::l1(l1_entry, cs) {
                self.set_l1(&mut meta, index as usize, 0);
                meta.dirty_l2.remove(&table);
                self.l2.remove(table);
                meta.decref(table / cs, false);
            }
        }
        self.write_back_held(&mut meta, io.meta)?;
        let (l1_size, l1_offset) = (u32::try_from(meta.l1_size()).unwrap_or(u32::MAX), meta.l1_offset());
        self.write_size_fields(&mut meta, io.meta, size, l1_size, l1_offset)?;
        self.note_dirty(&meta);
        self.size.store(size, Ordering::Release);
        Ok(())
    }

    /// Writes the L1 table, room for `entries` included, to new clusters,
    /// once everything it names is durable; where it is and how many
    /// clusters it fills.
    fn write_l1_copy(&self, meta: &mut Meta, file: &mut dyn SyncIo, entries: u64) -> io::Result<(u64, u64)> {
        let cs = self.cluster_size();
        let clusters = (entries * 8).div_ceil(cs);
        let offset = meta.alloc(file, clusters)?;
        for cluster in offset / cs..offset / cs + clusters {
            meta.metadata.insert(cluster);
        }
        let mut table = AlignedBuf::zeroed((clusters * cs) as usize);
        let written = self.write_back_held(meta, file).and_then(|()| {
            for (out, entry) in table.chunks_exact_mut(8).zip(self.l1.iter()) {
                out.copy_from_slice(&entry.load(Ordering::Acquire).to_be_bytes());
            }
            file.write_at(&table, offset)?;
            file.flush()
        });
        match written {
            Ok(()) => Ok((offset, clusters)),
            Err(e) => {
                self.free_clusters(meta, offset, clusters);
                Err(e)
            }
        }
    }

    /// Drops this image's reference to `clusters` clusters from `offset`
    /// (freed by the next flush).
    fn free_clusters(&self, meta: &mut Meta, offset: u64, clusters: u64) {
        let cs = self.cluster_size();
        for cluster in offset / cs..offset / cs + clusters {
            meta.decref(cluster, false);
        }
    }

    /// Writes the header's size, L1 length and L1 place durably, in one
    /// write; on failure the header in memory stays as it was.
    fn write_size_fields(
        &self,
        meta: &mut Meta,
        file: &mut dyn SyncIo,
        size: u64,
        l1_size: u32,
        l1_offset: u64,
    ) -> io::Result<()> {
        let fields = field::SIZE as usize..field::L1_TABLE_OFFSET as usize + 8;
        let before = meta.header_chunk[fields.clone()].to_vec();
        let mut put =
            |at: u64, bytes: &[u8]| meta.header_chunk[at as usize..at as usize + bytes.len()].copy_from_slice(bytes);
        put(field::SIZE, &size.to_be_bytes());
        put(field::L1_SIZE, &l1_size.to_be_bytes());
        put(field::L1_TABLE_OFFSET, &l1_offset.to_be_bytes());
        let written = file.write_at(&meta.header_chunk, 0).and_then(|()| file.flush());
        if written.is_err() {
            meta.header_chunk[fields].copy_from_slice(&before);
        }
        written
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::MemFile;
    use crate::{Mapping, Options};

    const MIB: u64 = 1 << 20;

    /// The image file, but writes to the header fail once `header_fails`.
    struct HeaderFails {
        file: MemFile,
        header_fails: bool,
    }

    impl SyncIo for HeaderFails {
        fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            self.file.read_at(buf, offset)
        }
        fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
            if offset == 0 && self.header_fails {
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
            self.file.write_at(buf, offset)
        }
        fn flush(&mut self) -> io::Result<()> {
            self.file.flush()
        }
        fn discard(&mut self, offset: u64, len: u64) -> io::Result<()> {
            self.file.discard(offset, len)
        }
    }

    fn io(file: &mut HeaderFails) -> ImageIo<'_> {
        ImageIo { meta: file, data: None, backing: None }
    }

    fn qemu_img_check(name: &str, bytes: &[u8]) -> String {
        let path = std::env::temp_dir().join(format!("vsd-qcow2-resize-{name}-{}.qcow2", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        let out = std::process::Command::new("qemu-img").arg("check").arg(&path).output().unwrap();
        std::fs::remove_file(&path).unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// 512-byte clusters: the L1 table's one cluster spans 2 MiB. Growing
    /// to 4 MiB moves it; if the header write fails, the image keeps its
    /// size and table, with at worst leaked clusters, and serves on; the
    /// next try succeeds.
    #[test]
    fn a_failed_header_write_leaves_the_old_table_in_use() {
        let file = MemFile::made_by_qemu_img_with("resize", &["-o", "cluster_size=512"], "1M");
        let mut file = HeaderFails { file, header_fails: true };
        let len = file.file.bytes.len() as u64;
        let image = Image::open(&mut file, len, Options { writable: true, ..Options::default() }).unwrap();
        image.write(&mut io(&mut file), 0, 4096, &mut |_, buf| buf.fill(0x42)).unwrap();
        image.flush(&mut io(&mut file)).unwrap();
        let before = file.file.bytes[..512].to_vec();

        assert!(image.resize(&mut io(&mut file), 4 * MIB).is_err());
        assert_eq!(image.size(), MIB);
        assert_eq!(file.file.bytes[..512], before[..], "the header is as it was");
        let report = qemu_img_check("failed", &file.file.bytes);
        assert!(!report.contains("ERROR"), "at worst leaks: {report}");
        // Still serving: the first cluster maps as before.
        let extent = image.map(&mut Default::default(), &mut file, 0, 512).unwrap();
        assert!(matches!(extent.mapping, Mapping::Data { .. }));

        file.header_fails = false;
        image.resize(&mut io(&mut file), 4 * MIB).unwrap();
        image.write(&mut io(&mut file), 4 * MIB - 4096, 4096, &mut |_, buf| buf.fill(0x43)).unwrap();
        image.close(&mut io(&mut file)).unwrap();
        let report = qemu_img_check("grown", &file.file.bytes);
        assert!(report.contains("No errors were found"), "the clusters of the failed try were freed: {report}");
    }
}
