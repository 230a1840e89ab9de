//! Flushing: the metadata changed in memory reaches the file without the
//! metadata mutex held across the I/O. The chunks changed are copied under
//! the mutex and written without it, while other queues map, allocate and
//! link; afterwards, under the mutex again, each chunk that still holds
//! what was written is marked clean, and the ones changed meanwhile stay
//! dirty for the next flush. The `writeback` lock serialises the writers
//! of chunks, so that an older copy never lands after a newer one.

use std::io;
use std::sync::{Arc, MutexGuard, PoisonError};

use super::cache::L2Table;
use super::refcounts::BlockLoad;
use super::{Image, ImageIo, Meta, unloaded_slice};
use crate::SyncIo;
use crate::buf::AlignedBuf;

/// A metadata chunk as it was when copied: which one (`key`), where it goes
/// in the image file, and its bytes.
pub(super) struct Copy<K> {
    pub(super) key: K,
    pub(super) at: u64,
    pub(super) bytes: AlignedBuf,
}

/// Refcount block chunks are keyed by (block index, byte offset in it).
pub(super) type RefcountCopy = Copy<(u64, usize)>;

/// What one flush writes: copies of every chunk changed in memory when it
/// began, and how many queued decrements their durability allows.
struct Batch {
    refcounts: Vec<RefcountCopy>,
    l2: Vec<Copy<(Arc<L2Table>, usize)>>,
    l1: Vec<Copy<usize>>,
    /// The decrements queued before the copies were taken: the tables that
    /// stopped naming their clusters are among the copies.
    decrements: usize,
    /// The refcount blocks those decrements need and the cache lacks.
    blocks: BlockLoad,
}

impl Image {
    /// Makes every completed write durable, metadata included, in an order
    /// that leaves a consistent image wherever a crash or power loss cuts
    /// it: data and refcount increments, then L2 tables, then L1 entries
    /// (each step durable before the next starts), then refcount
    /// decrements (a lost decrement is a leak, never a corruption).
    pub fn flush(&self, io: &mut ImageIo) -> io::Result<()> {
        if let Some(data) = io.data.as_deref_mut() {
            data.flush()?;
        }
        let _writeback = self.writeback();
        self.write_back(io)
    }

    /// The lock every writer of metadata chunks holds, taken before the
    /// metadata mutex.
    pub(super) fn writeback(&self) -> MutexGuard<'_, ()> {
        self.writeback.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// [`Image::flush`] of the image file; the caller holds
    /// [`Image::writeback`]. The metadata mutex is taken three times, for
    /// no I/O: the refcount blocks the decrements need are read before.
    pub(super) fn write_back(&self, io: &mut ImageIo) -> io::Result<()> {
        if !self.metadata_dirty() {
            return io.meta.flush();
        }
        let batch = self.copy_dirty(&self.lock())?;
        self.write_batch(io.meta, &batch)?;
        let blocks = batch.blocks.read(io.meta)?;
        let freed = {
            let mut meta = self.lock();
            // Before this flush's own writes count as a change of blocks:
            // they were of cached blocks, not of these.
            meta.refcounts.insert_loaded(&batch.blocks, blocks);
            self.forget_written(&mut meta, &batch);
            self.tables_written();
            meta.apply_decrements(io.meta, batch.decrements)?;
            (meta.refcounts.copy_dirty(), meta.quarantine.take_discards())
        };
        let (freed, (discards, freed_in)) = freed;
        // Decrements need no barrier: one lost to a crash is a leak.
        write_copies(io.meta, &freed)?;
        // No table names these clusters any more, durably; they are not
        // handed out again before their discard is done.
        let cs = self.cluster_size();
        for &(first, count) in &discards {
            let _ = io.meta.discard(first * cs, count * cs);
        }
        let mut meta = self.lock();
        meta.quarantine.discarded(freed_in, &discards);
        meta.refcounts.forget_written(&freed);
        self.note_dirty(&meta);
        Ok(())
    }

    /// Writes every changed chunk in flush order with the metadata mutex
    /// held (`meta`), for a change that must let no other writer in
    /// between (moving the L1 table); the caller holds
    /// [`Image::writeback`]. Decrements stay queued.
    pub(super) fn write_back_held(&self, meta: &mut Meta, file: &mut dyn SyncIo) -> io::Result<()> {
        let batch = self.copy_dirty(meta)?;
        self.write_batch(file, &batch)?;
        self.forget_written(meta, &batch);
        self.tables_written();
        Ok(())
    }

    /// Copies of the chunks changed in memory.
    fn copy_dirty(&self, meta: &Meta) -> io::Result<Batch> {
        let mut l2 = Vec::new();
        for (table, chunks) in meta.dirty_l2.values() {
            for &start in chunks {
                let len = self.chunk_of(start..start + 8).len();
                let bytes = table.bytes(start..start + len).ok_or_else(unloaded_slice)?;
                l2.push(Copy { key: (table.clone(), start), at: table.offset + start as u64, bytes });
            }
        }
        let l1 = meta.dirty_l1.iter().map(|&start| Copy {
            key: start,
            at: meta.l1_offset() + start as u64,
            bytes: self.l1_chunk(start),
        });
        let decrements = meta.decrements.len();
        let blocks = meta.refcounts.missing(meta.decrements.iter().map(|&(cluster, _)| cluster));
        Ok(Batch { refcounts: meta.refcounts.copy_dirty(), l2, l1: l1.collect(), decrements, blocks })
    }

    /// Writes a batch in the order [`Image::flush`] names, each step
    /// durable before the next (with lazy refcounts, the dirty bit covers
    /// any order: no barriers).
    fn write_batch(&self, file: &mut dyn SyncIo, batch: &Batch) -> io::Result<()> {
        let barrier = |file: &mut dyn SyncIo| if self.lazy { Ok(()) } else { file.flush() };
        write_copies(file, &batch.refcounts)?;
        barrier(file)?;
        write_copies(file, &batch.l2)?;
        if !batch.l1.is_empty() {
            barrier(file)?;
            write_copies(file, &batch.l1)?;
        }
        file.flush()
    }

    /// Marks clean the chunks of `batch` that still hold what was written.
    fn forget_written(&self, meta: &mut Meta, batch: &Batch) {
        meta.refcounts.forget_written(&batch.refcounts);
        for Copy { key: (table, start), bytes, .. } in &batch.l2 {
            let unchanged = table.bytes(*start..*start + bytes.len()).is_some_and(|now| now[..] == bytes[..]);
            let chunks = meta.dirty_l2.get_mut(&table.offset).map(|(_, chunks)| chunks);
            if let Some(chunks) = chunks.filter(|_| unchanged) {
                chunks.remove(start);
                if chunks.is_empty() {
                    meta.dirty_l2.remove(&table.offset);
                }
            }
        }
        for Copy { key: start, bytes, .. } in &batch.l1 {
            if self.l1_chunk(*start)[..] == bytes[..] {
                meta.dirty_l1.remove(start);
            }
        }
    }
}

fn write_copies<K>(file: &mut dyn SyncIo, copies: &[Copy<K>]) -> io::Result<()> {
    copies.iter().try_for_each(|c| file.write_at(&c.bytes, c.at))
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::{Receiver, Sender, channel};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::*;
    use crate::Mapping;
    use crate::image::Options;
    use crate::mem::MemFile;

    const KIB: u64 = 1024;

    use crate::mem::SharedFile as Shared;

    /// The shared file, whose first call of kind `at` says so and waits
    /// for a go.
    struct Paused {
        file: Shared,
        pause: Option<(Sender<()>, Receiver<()>)>,
        at: Call,
    }

    #[derive(PartialEq)]
    enum Call {
        Flush,
        Read,
        Discard,
    }

    impl Paused {
        fn pause(&mut self) {
            if let Some((paused, go)) = self.pause.take() {
                paused.send(()).unwrap();
                go.recv().unwrap();
            }
        }
    }

    impl SyncIo for Paused {
        fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            if self.at == Call::Read {
                self.pause();
            }
            self.file.read_at(buf, offset)
        }
        fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
            self.file.write_at(buf, offset)
        }
        fn flush(&mut self) -> io::Result<()> {
            if self.at == Call::Flush {
                self.pause();
            }
            Ok(())
        }
        fn discard(&mut self, _: u64, _: u64) -> io::Result<()> {
            if self.at == Call::Discard {
                self.pause();
            }
            Ok(())
        }
    }

    fn io(file: &mut dyn SyncIo) -> ImageIo<'_> {
        ImageIo { meta: file, data: None, backing: None }
    }

    fn write(image: &Image, file: &mut dyn SyncIo, offset: u64, byte: u8) {
        image.write(&mut io(file), offset, 4 * KIB, &mut |_, buf| buf.fill(byte)).unwrap();
    }

    fn open(bytes: &[u8]) -> (Image, MemFile) {
        let mut file = MemFile::new(bytes.to_vec(), 64 << 20);
        let opts = Options { writable: true, pass_discard: true, ..Options::default() };
        (Image::open(&mut file, bytes.len() as u64, opts).unwrap(), file)
    }

    /// What `qemu-img check` says of an image's bytes: its exit code (0
    /// clean, 3 leaked clusters only, 2 corruption) and its report.
    fn qemu_img_check(bytes: &[u8]) -> (i32, String) {
        static CHECKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = CHECKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("vsd-qcow2-writeback-{}-{n}.qcow2", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        let out = std::process::Command::new("qemu-img").arg("check").arg(&path).output().unwrap();
        std::fs::remove_file(&path).unwrap();
        (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Flushes `image` on a thread of its own, paused at its first call of
    /// kind `at`, while this thread writes a cluster at `offset`: the write
    /// must get the metadata mutex meanwhile.
    fn write_during_flush(image: &Arc<Image>, file: &Shared, at: Call, offset: u64) {
        let (paused_tx, paused) = channel();
        let (go, go_rx) = channel();
        let flusher = {
            let pause = Some((paused_tx, go_rx));
            let (image, mut file) = (image.clone(), Paused { file: file.clone(), pause, at });
            std::thread::spawn(move || image.flush(&mut io(&mut file)).unwrap())
        };
        paused.recv_timeout(Duration::from_secs(10)).expect("the flush reaches the call");
        let (done_tx, done) = channel();
        {
            let (image, mut file) = (image.clone(), file.clone());
            std::thread::spawn(move || {
                write(&image, &mut file, offset, 0x22);
                done_tx.send(()).unwrap();
            });
        }
        done.recv_timeout(Duration::from_secs(10)).expect("the metadata mutex is free meanwhile");
        go.send(()).unwrap();
        flusher.join().unwrap();
    }

    #[test]
    fn a_flush_writes_without_the_metadata_mutex_and_keeps_what_changed_meanwhile() {
        let bytes = MemFile::made_by_qemu_img("writeback", "4M").bytes;
        let (image, file) = open(&bytes);
        let (image, file) = (Arc::new(image), Shared(Arc::new(Mutex::new(file))));
        write(&image, &mut file.clone(), 0, 0x11);

        // A flush stops at its first barrier, refcounts written, tables not.
        // Meanwhile another request allocates and links a cluster whose
        // table and refcount chunks are the ones being written.
        write_during_flush(&image, &file, Call::Flush, 64 * KIB);

        // The flush wrote what was there when it began: the first cluster is
        // durable and the image consistent; the second stays to be flushed.
        assert!(image.metadata_dirty(), "the chunks changed during the flush are still dirty");
        let between = file.0.lock().unwrap().bytes.clone();
        let (status, report) = qemu_img_check(&between);
        assert!(status == 0 || status == 3, "no corruption, leaks at worst: {report}");
        let (reopened, mut copy) = open(&between);
        assert!(matches!(
            reopened.map(&mut Default::default(), &mut copy, 0, 512).unwrap().mapping,
            Mapping::Data { .. }
        ));
        let second = reopened.map(&mut Default::default(), &mut copy, 64 * KIB, 512).unwrap().mapping;
        assert_eq!(second, Mapping::Unallocated, "linked after the flush began");

        image.flush(&mut io(&mut file.clone())).unwrap();
        assert!(!image.metadata_dirty());
        let after = file.0.lock().unwrap().bytes.clone();
        let (status, report) = qemu_img_check(&after);
        assert_eq!(status, 0, "{report}");
        let (reopened, mut copy) = open(&after);
        for (offset, byte) in [(0, 0x11), (64 * KIB, 0x22)] {
            let Mapping::Data { host, .. } =
                reopened.map(&mut Default::default(), &mut copy, offset, 512).unwrap().mapping
            else {
                panic!("guest offset {offset:#x} is not mapped after the second flush");
            };
            let mut buf = [0u8; 512];
            copy.read_at(&mut buf, host).unwrap();
            assert_eq!(buf, [byte; 512], "guest offset {offset:#x}");
        }
    }

    /// A flush whose decrements fall in a refcount block the cache lacks
    /// reads it without the metadata mutex: requests allocate meanwhile.
    #[test]
    fn a_flush_reads_the_refcount_blocks_of_its_decrements_without_the_metadata_mutex() {
        decrements_meanwhile("decrement-read", Call::Read);
    }

    /// A flush discards the clusters its decrements free without the
    /// metadata mutex: requests allocate meanwhile.
    #[test]
    fn a_flush_discards_what_it_frees_without_the_metadata_mutex() {
        decrements_meanwhile("decrement-discard", Call::Discard);
    }

    /// A flush with a decrement to apply (on an image named `name`), paused
    /// at its first call of kind `at`, while another thread allocates.
    fn decrements_meanwhile(name: &str, at: Call) {
        let bytes = MemFile::made_by_qemu_img(name, "4M").bytes;
        let (image, file) = open(&bytes);
        let (image, file) = (Arc::new(image), Shared(Arc::new(Mutex::new(file))));
        write(&image, &mut file.clone(), 0, 0x11);
        image.flush(&mut io(&mut file.clone())).unwrap();
        image.lock().refcounts.drop_clean();
        image.discard(&mut io(&mut file.clone()), 0, 64 * KIB).unwrap();

        write_during_flush(&image, &file, at, 128 * KIB);
        image.flush(&mut io(&mut file.clone())).unwrap();
        let after = file.0.lock().unwrap().bytes.clone();
        let (status, report) = qemu_img_check(&after);
        assert_eq!(status, 0, "{report}");
        let (reopened, mut copy) = open(&after);
        assert_eq!(reopened.map(&mut Default::default(), &mut copy, 0, 512).unwrap().mapping, Mapping::Zero);
    }
}
