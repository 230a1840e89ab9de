//! What `block-stream` needs of an overlay: copy-on-read writes, which
//! take in what it reads from its backing chain ([`Image::populate`]), and
//! a header naming another backing file, or none, once it holds what it
//! needs of the old one ([`Image::set_backing_file`]).
//!
//! A populated cluster is allocated as a guest write's is: held in flight
//! (see `allocate.rs`) while its bytes are written with the metadata mutex
//! free, then linked. A guest write to it meanwhile fails with [`Busy`]
//! and is retried once it is linked, landing on top; a cluster that a
//! guest write is allocating is left to that write, which copies what it
//! keeps from below itself. What the image holds is never written: a
//! guest may be writing it in place.

use std::io;
use std::ops::Range;
use std::sync::atomic::Ordering;

#[cfg(doc)]
use super::Busy;
use super::{Allocation, Image, ImageIo, Meta, Origin};
use crate::buf::AlignedBuf;
use crate::entry::{L2Entry, Subcluster};
use crate::header;

/// A cluster [`Image::populate`] writes bytes into.
struct Filling {
    /// The guest cluster (byte offset).
    cluster: u64,
    allocation: Allocation,
    /// The byte runs of the cluster that take the populated bytes.
    filled: Vec<Range<u64>>,
    /// The whole cluster is written (a new one); else only `filled`: the
    /// image owns the cluster, and a guest may be writing its other
    /// subclusters in place.
    whole: bool,
}

impl Image {
    /// Writes `data`, what the image reads at `offset` now, into the
    /// subclusters of that range it does not hold (unallocated: they read
    /// from below), as QEMU's copy-on-read does. Whatever it holds (data,
    /// zero flags, compressed clusters) is left alone, and so is every
    /// cluster with an allocation in flight: the guest write allocating it
    /// copies what it keeps from below itself. Subclusters whose bytes are
    /// all zero are flagged zero where the image can say so (version 3,
    /// no raw data file), as QEMU's copy-on-read writes zeroes.
    ///
    /// `offset` is cluster aligned, and the range ends at a cluster
    /// boundary or at the end of the disk. Never fails with [`Busy`]: the
    /// clusters it allocates are in flight until linked, so guest writes
    /// to them wait and land on top.
    pub fn populate(&self, io: &mut ImageIo, offset: u64, data: &[u8]) -> io::Result<()> {
        self.check_writable()?;
        self.check_cluster_range(offset, data.len() as u64)?;
        let mut result = Ok(());
        for mut filling in self.start_populate(io, offset, data)? {
            let start = (filling.cluster - offset) as usize;
            let bytes = &data[start..data.len().min(start + self.cluster_size() as usize)];
            let written = result.is_ok() && {
                result = self.write_filling(io, &mut filling, bytes);
                result.is_ok()
            };
            let linked = self.finish_allocation(io.meta, filling.allocation, written);
            result = result.and(linked);
        }
        result
    }

    /// Refuses a range that does not start at a cluster, or does not end
    /// at one or at the end of the disk.
    fn check_cluster_range(&self, offset: u64, len: u64) -> io::Result<()> {
        let (cs, end, size) = (self.cluster_size(), offset.saturating_add(len), self.size());
        if offset.is_multiple_of(cs) && end <= size && (end.is_multiple_of(cs) || end == size) {
            return Ok(());
        }
        let what = format!("populate takes whole clusters of the disk, not {len} bytes at {offset:#x}");
        Err(io::Error::new(io::ErrorKind::InvalidInput, what))
    }

    /// Plans what `populate` writes, under the metadata mutex: subclusters
    /// that read as zeroes are flagged zero at once, and each cluster that
    /// takes bytes is allocated and marked in flight.
    fn start_populate(&self, io: &mut ImageIo, offset: u64, data: &[u8]) -> io::Result<Vec<Filling>> {
        let mut meta = self.lock();
        self.prepare_change(&mut meta, io)?;
        let mut fillings = Vec::new();
        let planned = self.for_each_cluster(offset, data.len() as u64, |image, cluster, _, n| {
            if meta.allocating.contains(&cluster) {
                return Ok(());
            }
            let start = (cluster - offset) as usize;
            fillings.extend(image.plan_filling(&mut meta, io, cluster, &data[start..start + n as usize])?);
            Ok(())
        });
        match planned {
            Ok(()) => meta.allocating.extend(fillings.iter().map(|f| f.cluster)),
            Err(_) => fillings.iter().for_each(|f| self.give_back(&mut meta, &f.allocation)),
        }
        self.note_dirty(&meta);
        planned.map(|()| fillings)
    }

    /// What populating guest `cluster` with `bytes` (its bytes, fewer in
    /// the disk's last cluster) takes: nothing, zero flags set here, or
    /// bytes to write.
    fn plan_filling(
        &self,
        meta: &mut Meta,
        io: &mut ImageIo,
        cluster: u64,
        bytes: &[u8],
    ) -> io::Result<Option<Filling>> {
        let (table, index, old) = self.entry_for_write(meta, io, cluster)?;
        let gaps = self.gaps(&old);
        let zeroes = self.zero_subclusters(gaps, bytes);
        let filled = gaps & !zeroes;
        if filled == 0 {
            if zeroes != 0 {
                self.set_l2(meta, &table, index, &L2Entry { zero: old.zero | zeroes, ..old })?;
            }
            return Ok(None);
        }
        let new = L2Entry { alloc: old.alloc | filled, zero: old.zero | zeroes, ..old };
        let (entry, cs) = ((table.offset, index, old), self.cluster_size());
        let (allocation, whole) = match old.host.filter(|_| old.copied) {
            Some(host) => {
                if self.write_hits_metadata(host, cs) {
                    let what = format!("guest cluster {cluster:#x} maps onto metadata at {host:#x}");
                    return Err(crate::CorruptMetadata(what).into());
                }
                (Allocation::whole_cluster(cluster, entry, new, false, Vec::new(), cs), false)
            }
            None => {
                let host = if self.layout.data_file { cluster } else { meta.alloc(io.meta, 1)? };
                let new = L2Entry { host: Some(host), copied: true, ..new };
                (Allocation::whole_cluster(cluster, entry, new, true, self.held_bytes(&old, cluster), cs), true)
            }
        };
        Ok(Some(Filling { cluster, allocation, filled: self.runs(filled), whole }))
    }

    /// Puts a filling's old bytes and `bytes` (its cluster's populated
    /// bytes) into its contents, and writes what it writes.
    fn write_filling(&self, io: &mut ImageIo, filling: &mut Filling, bytes: &[u8]) -> io::Result<()> {
        self.read_old_bytes(io, &mut filling.allocation)?;
        let host = filling.allocation.host;
        let contents = filling.allocation.contents.as_mut().expect("a whole cluster's contents");
        for run in &filling.filled {
            let given = given(bytes, run.clone());
            contents[run.start as usize..run.start as usize + given.len()].copy_from_slice(given);
        }
        if filling.whole {
            return io.data().write_at(contents, host);
        }
        let data = io.data();
        filling
            .filled
            .iter()
            .try_for_each(|run| data.write_at(&contents[run.start as usize..run.end as usize], host + run.start))
    }

    /// The subclusters `e` leaves unallocated: they read from below.
    fn gaps(&self, e: &L2Entry) -> u32 {
        let scb = self.layout.subcluster_bits();
        let unallocated = |&sc: &u32| e.subcluster(sc, scb) == Subcluster::Unallocated;
        (0..self.layout.subclusters()).filter(unallocated).fold(0, |mask, sc| mask | 1 << sc)
    }

    /// The subclusters of `mask` whose bytes (in `bytes`, zeroes past its
    /// end) are all zero, if the image can flag subclusters zero.
    fn zero_subclusters(&self, mask: u32, bytes: &[u8]) -> u32 {
        if self.header.version < 3 || self.raw_data_file() {
            return 0;
        }
        let scb = self.layout.subcluster_bits();
        let zero = |sc: u32| given(bytes, u64::from(sc) << scb..u64::from(sc + 1) << scb).iter().all(|&b| b == 0);
        (0..self.layout.subclusters()).filter(|&sc| mask & 1 << sc != 0 && zero(sc)).fold(0, |z, sc| z | 1 << sc)
    }

    /// The byte runs of a cluster that the subclusters of `mask` make up.
    fn runs(&self, mask: u32) -> Vec<Range<u64>> {
        let scb = self.layout.subcluster_bits();
        let mut runs: Vec<Range<u64>> = Vec::new();
        for sc in (0..self.layout.subclusters()).filter(|sc| mask & 1 << sc != 0) {
            let (start, end) = (u64::from(sc) << scb, u64::from(sc + 1) << scb);
            match runs.last_mut() {
                Some(last) if last.end == start => last.end = end,
                _ => runs.push(start..end),
            }
        }
        runs
    }

    /// Where the data subclusters of a cluster mapped by `old` (which the
    /// image does not own: shared with a snapshot) are, for its copy.
    fn held_bytes(&self, old: &L2Entry, cluster: u64) -> Vec<super::OldBytes> {
        let parts = self.old_bytes(old, cluster, (0, 0)).into_iter();
        parts.filter(|part| matches!(part.source, Origin::Data(_))).collect()
    }

    /// Names `backing` (file name, format) in the header as the image's
    /// backing file, or none, as `qemu-img rebase -u` does; unallocated
    /// clusters read from below, or as zeroes, from then on. What changed
    /// before (populated clusters) is made durable first, so that a crash
    /// never finds a header naming a backing file the image's tables are
    /// not ready for; the header is durable when this returns. Fails,
    /// having changed nothing, if the name does not fit in the header.
    pub fn set_backing_file(&self, io: &mut ImageIo, backing: Option<(&str, &str)>) -> io::Result<()> {
        self.rename_backing_file(io, backing)?;
        self.has_backing.store(backing.is_some(), Ordering::Relaxed);
        Ok(())
    }

    /// As [`Image::set_backing_file`], but the header alone changes: the
    /// image reads from below as it did (QMP `change-backing-file`, whose
    /// new name counts from the next open).
    pub fn rename_backing_file(&self, io: &mut ImageIo, backing: Option<(&str, &str)>) -> io::Result<()> {
        self.check_writable()?;
        self.flush(io)?;
        let mut meta = self.lock();
        let mut chunk = AlignedBuf::copy_of(&meta.header_chunk);
        header::set_backing_file(&mut chunk, backing).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        io.meta.write_at(&chunk, 0)?;
        io.meta.flush()?;
        meta.header_chunk = chunk;
        Ok(())
    }
}

/// The bytes of `range` that `bytes` holds (fewer at its end, or none).
fn given(bytes: &[u8], range: Range<u64>) -> &[u8] {
    bytes.get(range.start as usize..bytes.len().min(range.end as usize)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::{Receiver, Sender, channel};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::*;
    use crate::SyncIo;
    use crate::header::Header;
    use crate::image::{Busy, Mapping, Options, Piece};
    use crate::mem::MemFile;

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;
    const CLUSTER: usize = 64 * 1024;

    /// What the overlays of these tests read where they hold nothing: each
    /// 512-byte sector holds its number.
    fn below() -> MemFile {
        MemFile::new((0..4 * MIB).map(|i| (i / 512) as u8).collect(), 4 * MIB)
    }

    /// A 4 MiB overlay with 64 KiB clusters (more `qemu-img create`
    /// arguments in `args`), over what [`below`] holds.
    fn overlay(name: &str, args: &[&str]) -> (Image, MemFile) {
        let mut file = MemFile::made_by_qemu_img_with(name, args, "4M");
        (open(&mut file, Some(true)), file)
    }

    /// Opens `file` writable, over a backing file if `has_backing` (as the
    /// header says if `None`).
    fn open(file: &mut MemFile, has_backing: Option<bool>) -> Image {
        let len = file.bytes.len() as u64;
        Image::open(file, len, Options { writable: true, has_backing, ..Options::default() }).unwrap()
    }

    fn io<'a>(file: &'a mut dyn SyncIo, below: &'a mut MemFile) -> ImageIo<'a> {
        ImageIo { meta: file, data: None, backing: Some(below) }
    }

    fn fill(byte: u8) -> impl FnMut(u64, &mut [u8]) {
        move |_, buf: &mut [u8]| buf.fill(byte)
    }

    fn mapping(image: &Image, file: &mut dyn SyncIo, offset: u64) -> Mapping {
        image.map(&mut Default::default(), file, offset, 512).unwrap().mapping
    }

    /// What the overlay reads from `offset` for `len` bytes.
    fn read(image: &Image, file: &mut dyn SyncIo, below: &MemFile, offset: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        let mut pos = 0;
        while pos < len {
            let extent = image.map(&mut Default::default(), file, offset + pos as u64, (len - pos) as u64).unwrap();
            let (at, part) = (offset as usize + pos, &mut out[pos..pos + extent.len as usize]);
            match extent.mapping {
                Mapping::Data { host, .. } => file.read_at(part, host).unwrap(),
                Mapping::Zero => part.fill(0),
                Mapping::Unallocated => part.copy_from_slice(&below.bytes[at..at + part.len()]),
                other => panic!("{other:?} at {at:#x}"),
            }
            pos += extent.len as usize;
        }
        out
    }

    /// `qemu-img check`'s report on an image's bytes, asserting it is clean.
    fn assert_clean(name: &str, bytes: &[u8]) {
        let path = std::env::temp_dir().join(format!("vsd-qcow2-stream-{name}-{}.qcow2", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        let out = std::process::Command::new("qemu-img").args(["check", "-f", "qcow2"]).arg(&path).output().unwrap();
        std::fs::remove_file(&path).unwrap();
        let report = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && report.contains("No errors were found"), "qemu-img check: {report}");
    }

    /// Populating with bytes that differ from what the overlay holds shows
    /// where they went: only into clusters it did not hold.
    #[test]
    fn populate_fills_only_the_clusters_the_overlay_does_not_hold() {
        let (image, mut file) = overlay("populate", &[]);
        let mut below = below();
        image.write(&mut io(&mut file, &mut below), 68 * KIB, 4 * KIB, &mut fill(0xaa)).unwrap();
        image.write_zeroes(&mut io(&mut file, &mut below), 128 * KIB, 64 * KIB, false, false).unwrap();
        let written = read(&image, &mut file, &below, 64 * KIB, CLUSTER);

        // Clusters 0-2 get 0xdd, cluster 3 zeroes; cluster 4 is not asked.
        let mut data = vec![0xdd; 4 * CLUSTER];
        data[3 * CLUSTER..].fill(0);
        image.populate(&mut io(&mut file, &mut below), 0, &data).unwrap();

        assert!(matches!(mapping(&image, &mut file, 0), Mapping::Data { in_place: true, .. }));
        assert_eq!(read(&image, &mut file, &below, 0, CLUSTER), vec![0xdd; CLUSTER], "unallocated: populated");
        assert!(read(&image, &mut file, &below, 64 * KIB, CLUSTER) == written, "written before: kept");
        assert_eq!(mapping(&image, &mut file, 128 * KIB), Mapping::Zero, "a zero cluster stays zero");
        assert_eq!(mapping(&image, &mut file, 192 * KIB), Mapping::Zero, "zeroes populate as a zero cluster");
        assert_eq!(mapping(&image, &mut file, 256 * KIB), Mapping::Unallocated, "outside the range");
        image.close(&mut io(&mut file, &mut below)).unwrap();
        assert_clean("clusters", &file.bytes);
    }

    /// With subclusters, the unallocated ones of a cluster the overlay owns
    /// are filled in place; its data and zero subclusters stay.
    #[test]
    fn populate_fills_only_the_unallocated_subclusters_of_a_cluster() {
        let (image, mut file) = overlay("populate-sub", &["-o", "extended_l2=on,cluster_size=64k"]);
        let mut below = below();
        // Subclusters of 2 KiB: 4 and 5 of cluster 1 hold data, 8 reads as zeroes.
        image.write(&mut io(&mut file, &mut below), 72 * KIB, 4 * KIB, &mut fill(0xaa)).unwrap();
        image.write_zeroes(&mut io(&mut file, &mut below), 80 * KIB, 2 * KIB, false, false).unwrap();

        image.populate(&mut io(&mut file, &mut below), 64 * KIB, &[0xdd; CLUSTER]).unwrap();
        let got = read(&image, &mut file, &below, 64 * KIB, CLUSTER);
        let kib = |n: usize| n * 1024;
        assert!(got[kib(8)..kib(12)].iter().all(|&b| b == 0xaa), "data subclusters keep their bytes");
        assert!(got[kib(16)..kib(18)].iter().all(|&b| b == 0), "the zero subcluster stays zero");
        assert!(got[..kib(8)].iter().chain(&got[kib(12)..kib(16)]).chain(&got[kib(18)..]).all(|&b| b == 0xdd));
        for at in [64 * KIB, 76 * KIB, 82 * KIB, 126 * KIB] {
            assert!(matches!(mapping(&image, &mut file, at), Mapping::Data { .. }), "{at:#x} is allocated");
        }
        image.close(&mut io(&mut file, &mut below)).unwrap();
        assert_clean("subclusters", &file.bytes);
    }

    /// A cluster whose allocation is in flight is the allocating write's:
    /// populate leaves it, and the write's contents are what it reads.
    #[test]
    fn populate_leaves_a_cluster_with_an_allocation_in_flight() {
        let (image, mut file) = overlay("populate-inflight", &[]);
        let mut below = below();
        let mut pieces = image.start_write(&mut io(&mut file, &mut below), 0, 4 * KIB).unwrap();
        let Some(Piece::Allocate(mut a)) = pieces.pop() else { panic!("an allocation") };

        image.populate(&mut io(&mut file, &mut below), 0, &[0xdd; 2 * CLUSTER]).unwrap();
        assert_eq!(mapping(&image, &mut file, 0), Mapping::Unallocated, "left to the write in flight");
        assert_eq!(read(&image, &mut file, &below, 64 * KIB, CLUSTER), vec![0xdd; CLUSTER], "the next is populated");

        image.read_old_bytes(&mut io(&mut file, &mut below), &mut a).unwrap();
        a.put_request_bytes(&mut fill(0xaa));
        let (bytes, at) = a.to_write().map(|(bytes, at)| (bytes.to_vec(), at)).expect("a copy-up");
        file.write_at(&bytes, at).unwrap();
        image.finish_allocation(&mut file, a, true).unwrap();
        let mut expected = below.bytes[..CLUSTER].to_vec();
        expected[..4096].fill(0xaa);
        assert!(read(&image, &mut file, &below, 0, CLUSTER) == expected, "the write's cluster, nothing populated");
        image.close(&mut io(&mut file, &mut below)).unwrap();
        assert_clean("inflight", &file.bytes);
    }

    use crate::mem::SharedFile as Shared;

    /// The shared file, whose first write of a whole cluster (populated
    /// data) says so and waits for a go.
    struct PausedAtData {
        file: Shared,
        pause: Option<(Sender<()>, Receiver<()>)>,
    }

    impl SyncIo for PausedAtData {
        fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            self.file.read_at(buf, offset)
        }
        fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
            if buf.len() == CLUSTER
                && let Some((paused, go)) = self.pause.take()
            {
                paused.send(()).unwrap();
                go.recv().unwrap();
            }
            self.file.write_at(buf, offset)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
        fn discard(&mut self, _: u64, _: u64) -> io::Result<()> {
            Ok(())
        }
    }

    /// A guest write to a cluster while populate writes it waits ([`Busy`])
    /// rather than being overwritten, and lands on top once it is linked.
    #[test]
    fn a_guest_write_waits_for_a_populated_cluster_and_lands_on_top() {
        let (image, file) = overlay("populate-race", &[]);
        let (image, file) = (Arc::new(image), Shared(Arc::new(Mutex::new(file))));
        let (paused_tx, paused) = channel();
        let (go, go_rx) = channel();
        let populating = {
            let (image, mut file) =
                (image.clone(), PausedAtData { file: file.clone(), pause: Some((paused_tx, go_rx)) });
            std::thread::spawn(move || image.populate(&mut io(&mut file, &mut below()), 0, &[0xdd; CLUSTER]))
        };
        paused.recv_timeout(Duration::from_secs(10)).expect("populate writes its cluster");
        let write = |file: &mut Shared| image.write(&mut io(file, &mut below()), 0, 4 * KIB, &mut fill(0xaa));
        let busy = write(&mut file.clone()).expect_err("the cluster is in flight");
        assert!(Busy::is(&busy), "{busy}");
        go.send(()).unwrap();
        populating.join().unwrap().unwrap();

        write(&mut file.clone()).unwrap();
        let got = read(&image, &mut file.clone(), &below(), 0, CLUSTER);
        assert!(got[..4096].iter().all(|&b| b == 0xaa) && got[4096..].iter().all(|&b| b == 0xdd));
    }

    /// Bytes of the disk past its last cluster boundary are populated too;
    /// a range that does not start or end at a cluster is refused.
    #[test]
    fn populate_takes_the_disk_s_partial_last_cluster_and_refuses_unaligned_ranges() {
        let mut file = MemFile::made_by_qemu_img("populate-tail", "100K");
        let image = open(&mut file, Some(true));
        let mut below = below();
        image.populate(&mut io(&mut file, &mut below), 64 * KIB, &[0xdd; 36 * 1024]).unwrap();
        assert_eq!(read(&image, &mut file, &below, 64 * KIB, 36 * 1024), vec![0xdd; 36 * 1024]);
        for (offset, len) in [(4 * KIB, 60 * 1024), (0, 4096), (64 * KIB, 40 * 1024)] {
            let refused = image.populate(&mut io(&mut file, &mut below), offset, &vec![0; len]).unwrap_err();
            assert_eq!(refused.kind(), io::ErrorKind::InvalidInput, "{len} bytes at {offset:#x}");
        }
        image.close(&mut io(&mut file, &mut below)).unwrap();
        assert_clean("tail", &file.bytes);
    }

    /// The header names another backing file, or none, on disk at once;
    /// a name that does not fit changes nothing.
    #[test]
    fn set_backing_file_rewrites_the_header_durably() {
        let base = std::env::temp_dir().join(format!("vsd-qcow2-rebase-base-{}.raw", std::process::id()));
        std::fs::write(&base, [0; 4096]).unwrap();
        let args = ["-b", base.to_str().unwrap(), "-F", "raw"];
        let mut file = MemFile::made_by_qemu_img_with("rebase", &args, "4M");
        std::fs::remove_file(&base).unwrap();
        let image = open(&mut file, None);
        let mut below = below();
        let header = |file: &MemFile| Header::parse(&file.bytes, file.bytes.len() as u64).unwrap();
        assert!(image.has_backing());

        image.write(&mut io(&mut file, &mut below), 0, 4 * KIB, &mut fill(0xaa)).unwrap();
        image.set_backing_file(&mut io(&mut file, &mut below), Some(("../mid.qcow2", "qcow2"))).unwrap();
        let h = header(&file);
        assert_eq!((h.backing_file.as_deref(), h.backing_format.as_deref()), (Some("../mid.qcow2"), Some("qcow2")));
        assert!(!image.metadata_dirty(), "what changed before is durable first");

        let long = "x".repeat(2000);
        let refused = image.set_backing_file(&mut io(&mut file, &mut below), Some((&long, "raw"))).unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(header(&file).backing_file.as_deref(), Some("../mid.qcow2"), "unchanged");

        image.set_backing_file(&mut io(&mut file, &mut below), None).unwrap();
        let h = header(&file);
        assert_eq!((h.backing_file, h.backing_format), (None, None));
        assert!(!image.has_backing());
        // A write into a cluster the image does not hold copies nothing up.
        image.write(&mut io(&mut file, &mut below), 68 * KIB, 4 * KIB, &mut fill(0xaa)).unwrap();
        let Mapping::Data { host, .. } = mapping(&image, &mut file, 64 * KIB) else { panic!("not allocated") };
        let mut around = vec![0xff; 4096];
        file.read_at(&mut around, host).unwrap();
        assert_eq!(around, vec![0; 4096], "zeroes, not the bytes below");
        image.close(&mut io(&mut file, &mut below)).unwrap();
        assert_clean("rebase", &file.bytes);
    }

    /// Renaming changes the header only: the image still reads from below.
    #[test]
    fn rename_backing_file_leaves_the_open_image_reading_from_below() {
        let args = ["-b", "base.raw", "-F", "raw", "-u"];
        let mut file = MemFile::made_by_qemu_img_with("rename", &args, "4M");
        let image = open(&mut file, None);
        let mut below = below();
        image.rename_backing_file(&mut io(&mut file, &mut below), None).unwrap();
        let h = Header::parse(&file.bytes, file.bytes.len() as u64).unwrap();
        assert_eq!((h.backing_file, h.backing_format), (None, None));
        assert!(image.has_backing(), "until it is opened again");
        image.close(&mut io(&mut file, &mut below)).unwrap();
        assert_clean("rename", &file.bytes);
    }
}
