//! Dirty bitmaps: which parts of a node were written since a point in
//! time, at a granularity, by name (QEMU's `BdrvDirtyBitmap`). Backups
//! read them to copy only what changed; NBD shows them to clients as the
//! `qemu:dirty-bitmap:NAME` metadata context.
//!
//! ```text
//!   QMP (add, enable, merge...) ──▶ DirtyBitmaps ──generation──▶ DirtyRecorder (one per queue)
//!                                     └─ Bitmap ─▶ Words (atomics) ◀── fetch_or per write
//! ```
//!
//! Every writer of a node (an export's queue, a node above) records its
//! writes through its own [`DirtyRecorder`], which keeps the words of the
//! enabled bitmaps and follows changes by a generation number: with no
//! bitmap, a write costs two loads of a word that rarely changes; with one,
//! a load more and, unless the range is already dirty, one `fetch_or` per
//! word the write covers (one for writes within 64 granules). A job's
//! [`Tracker`] is marked when the write completes instead.

mod bitmap;
mod set;
mod tracker;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};

use vsd_engine::{Completion, IoOp};

use crate::threshold::WriteThreshold;
use bitmap::Words;
pub use bitmap::{Bitmap, BitmapInfo, BusyGuard};
pub use set::DirtySet;
pub use tracker::Tracker;

/// The longest name QEMU stores (`BDRV_BITMAP_MAX_NAME_SIZE`).
pub const MAX_NAME_LEN: usize = 1023;

/// Why a bitmap operation was refused, in QEMU's words.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum BitmapError {
    /// An empty name.
    #[error("Bitmap name cannot be empty")]
    EmptyName,
    /// A name longer than [`MAX_NAME_LEN`].
    #[error("Bitmap name too long: {0}")]
    NameTooLong(String),
    /// The node already has a bitmap of that name.
    #[error("Bitmap already exists: {0}")]
    Exists(String),
    /// No bitmap of that name on the node.
    #[error("Dirty bitmap '{0}' not found")]
    NotFound(String),
    /// Not a power of two, or below 512 bytes.
    #[error("Granularity must be power of 2 and at least 512")]
    Granularity,
    /// A job or an export uses it.
    #[error("Bitmap '{0}' is currently in use by another operation and cannot be used")]
    Busy(String),
    /// Loaded from an image a crash left it in use in: its contents are unknown.
    #[error(
        "Bitmap '{0}' is inconsistent and cannot be used\nTry block-dirty-bitmap-remove to delete this bitmap from disk"
    )]
    Inconsistent(String),
    /// Merged bitmaps must cover the same number of bytes.
    #[error(
        "Bitmaps are of different sizes (destination size is {target}, source size is {merged}) and can't be merged"
    )]
    Sizes {
        /// The target's size in bytes.
        target: u64,
        /// The merged bitmap's (QEMU's "source").
        merged: u64,
    },
}

/// How a bitmap is made.
#[derive(Clone, Copy, Debug)]
pub struct BitmapOptions {
    /// Bytes one bit covers: a power of two, at least 512.
    pub granularity: u64,
    /// Kept in the image across restarts (the node must be able to).
    pub persistent: bool,
    /// Records writes from the start.
    pub enabled: bool,
}

/// What must happen before a write reaches a node: a backup copies the
/// old data of the range first (copy-before-write).
pub trait BeforeWrite: Send + Sync {
    /// Returns once bytes `offset..offset + len` may be overwritten. Called
    /// on the writer's thread, which it may block for about one request.
    fn before_write(&self, offset: u64, len: u64);
}

/// Held to read bitmaps' states for recording, or to change several at
/// once ([`batch`]).
static CHANGES: RwLock<()> = RwLock::new(());

/// Runs `changes` to bitmaps (of any nodes) as one: a writer records each
/// write in the bitmaps as they were before, or as they are after, or
/// both, never in a mix (QMP's `transaction`: a write between disabling
/// one bitmap and adding its successor is in one of them). Writers wait
/// for it: `changes` must not write to a node itself.
pub fn batch<T>(changes: impl FnOnce() -> T) -> T {
    let _batch = CHANGES.write().unwrap_or_else(PoisonError::into_inner);
    changes()
}

/// A persistent bitmap as an image format stores it: bit i covers bytes
/// `i * granularity..`, bit `i % 64` of `words[i / 64]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Persisted {
    /// Its name.
    pub name: String,
    /// Bytes per bit.
    pub granularity: u64,
    /// Whether it records writes.
    pub enabled: bool,
    /// Whether its bits mean nothing (in use when the image was left).
    pub inconsistent: bool,
    /// Its bits (none if inconsistent).
    pub words: Vec<u64>,
}

/// The bitmaps of one node, the hooks its writes wait for (one per
/// backup of the node, as QEMU stacks a copy-before-write filter per
/// backup), and its write threshold, which every writer checks too.
#[derive(Default)]
pub struct DirtyBitmaps {
    /// Bumped after every change of what recorders act on.
    generation: AtomicU64,
    /// Newest first, as QEMU lists them.
    bitmaps: Mutex<Vec<Arc<Bitmap>>>,
    hooks: Mutex<Vec<Arc<dyn BeforeWrite>>>,
    /// The words of the jobs' [`Tracker`]s, with their granularity's shift.
    trackers: Mutex<Vec<(Arc<Words>, u32)>>,
    threshold: WriteThreshold,
}

impl DirtyBitmaps {
    fn list(&self) -> MutexGuard<'_, Vec<Arc<Bitmap>>> {
        // The list is consistent whatever panicked while holding it.
        self.bitmaps.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The node's write threshold.
    pub fn write_threshold(&self) -> &WriteThreshold {
        &self.threshold
    }

    /// Tells every recorder to pick up the bitmaps' words again.
    fn changed(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    /// Adds bitmap `name` for a node of `size` bytes, clean.
    pub fn add(&self, name: &str, size: u64, options: BitmapOptions) -> Result<Arc<Bitmap>, BitmapError> {
        check_name(name)?;
        if !options.granularity.is_power_of_two() || options.granularity < 512 {
            return Err(BitmapError::Granularity);
        }
        let mut list = self.list();
        if list.iter().any(|b| b.name == name) {
            return Err(BitmapError::Exists(name.into()));
        }
        let bitmap = Arc::new(Bitmap::new(name.into(), size, options));
        list.insert(0, bitmap.clone());
        drop(list);
        self.changed();
        Ok(bitmap)
    }

    /// The bitmap called `name`.
    pub fn get(&self, name: &str) -> Result<Arc<Bitmap>, BitmapError> {
        self.list().iter().find(|b| b.name == name).cloned().ok_or_else(|| BitmapError::NotFound(name.into()))
    }

    /// Every bitmap, newest first.
    pub fn all(&self) -> Vec<Arc<Bitmap>> {
        self.list().clone()
    }

    /// Removes the bitmap `guard` holds.
    pub fn remove_held(&self, guard: BusyGuard) {
        self.list().retain(|b| !Arc::ptr_eq(b, guard.bitmap()));
        self.changed();
    }

    /// Starts or stops `bitmap` recording writes.
    pub fn set_enabled(&self, bitmap: &Bitmap, enabled: bool) -> Result<(), BitmapError> {
        bitmap.usable()?;
        bitmap.state().enabled = enabled;
        self.changed();
        Ok(())
    }

    /// Gives every bitmap the node's new size: bits past a smaller size
    /// go, a larger size starts clean. Writes recorded meanwhile land in the
    /// new words (see [`DirtyRecorder::record`]).
    pub fn resize(&self, size: u64) {
        for bitmap in self.list().iter() {
            let old = {
                let mut state = bitmap.state();
                if state.words.size == size {
                    continue;
                }
                std::mem::replace(&mut state.words, Arc::new(Words::new(size, bitmap.shift)))
            };
            // Published before the copy: a recorder that set a bit in the
            // old words after this copy read them sees the new generation
            // and sets it again in the new ones.
            self.changed();
            bitmap.words().or_from(&old);
        }
    }

    /// Adds the bitmaps an image holds, for a node of `size` bytes (those
    /// of a name already taken are skipped, with a warning).
    pub fn load(&self, size: u64, stored: Vec<Persisted>) {
        for p in stored {
            let options = BitmapOptions { granularity: p.granularity, persistent: true, enabled: p.enabled };
            match self.add(&p.name, size, options) {
                Ok(bitmap) => {
                    let mut state = bitmap.state();
                    state.inconsistent = p.inconsistent;
                    for (word, bits) in state.words.words.iter().zip(p.words) {
                        word.store(bits, Ordering::SeqCst);
                    }
                }
                Err(e) => log::warn!("bitmap '{}' stored in the image is not loaded: {e}", p.name),
            }
        }
    }

    /// The persistent bitmaps, as an image is to store them; `in_use`
    /// leaves their bits out (the image only flags them, while open).
    pub fn persistent(&self, in_use: bool) -> Vec<Persisted> {
        let list = self.list();
        let persistent = list.iter().filter(|b| b.persistent).map(|b| {
            let state = b.state();
            let keep_bits = !in_use && !state.inconsistent;
            Persisted {
                name: b.name.clone(),
                granularity: b.granularity,
                enabled: state.enabled,
                inconsistent: in_use || state.inconsistent,
                words: if keep_bits {
                    state.words.words.iter().map(|w| w.load(Ordering::SeqCst)).collect()
                } else {
                    Vec::new()
                },
            }
        });
        persistent.collect()
    }

    /// Forgets the persistent bitmaps: the image now belongs to another
    /// process (the other end of a migration), which loads them.
    pub fn drop_persistent(&self) {
        self.list().retain(|b| !b.persistent);
        self.changed();
    }

    /// Makes every write wait for `hook` first, after the hooks added
    /// before it. Writes already past their recorder are not waited for:
    /// the caller decides whether they count.
    pub fn add_hook(&self, hook: Arc<dyn BeforeWrite>) {
        self.hooks.lock().unwrap_or_else(PoisonError::into_inner).push(hook);
        self.changed();
    }

    /// Writes no longer wait for `hook`.
    pub fn remove_hook(&self, hook: &Arc<dyn BeforeWrite>) {
        self.hooks.lock().unwrap_or_else(PoisonError::into_inner).retain(|h| !Arc::ptr_eq(h, hook));
        self.changed();
    }

    /// A tracker of the writes to a node of `size` bytes that complete
    /// from the moment each writer looks at the bitmaps again (its next
    /// write): the caller makes sure none is in flight before that.
    pub fn track(self: &Arc<Self>, size: u64, granularity: u64) -> Tracker {
        Tracker::new(self.clone(), size, granularity)
    }

    /// A recorder for one writer of the node.
    pub fn recorder(self: &Arc<Self>) -> DirtyRecorder {
        // No generation is u64::MAX: the first write looks the bitmaps up.
        DirtyRecorder {
            bitmaps: self.clone(),
            seen: u64::MAX,
            targets: Vec::new(),
            hooks: Vec::new(),
            trackers: Vec::new(),
            in_flight: Vec::new(),
        }
    }
}

fn check_name(name: &str) -> Result<(), BitmapError> {
    match name.len() {
        0 => Err(BitmapError::EmptyName),
        n if n > MAX_NAME_LEN => Err(BitmapError::NameTooLong(name.into())),
        _ => Ok(()),
    }
}

/// Records one writer's writes in a node's enabled bitmaps.
pub struct DirtyRecorder {
    bitmaps: Arc<DirtyBitmaps>,
    /// The generation `targets` were taken at.
    seen: u64,
    /// The words of the enabled bitmaps, with their granularity's shift.
    targets: Vec<(Arc<Words>, u32)>,
    hooks: Vec<Arc<dyn BeforeWrite>>,
    /// The trackers' words, marked as writes complete.
    trackers: Vec<(Arc<Words>, u32)>,
    /// While there are trackers: by tag, the range each write in flight
    /// changes (empty for none).
    in_flight: Vec<(u64, u64)>,
}

impl DirtyRecorder {
    /// A recorder for one writer of `node` (that records nothing if the
    /// node keeps no bitmaps).
    pub fn for_node(node: &dyn crate::BlockNode) -> Self {
        node.dirty_bitmaps().cloned().unwrap_or_default().recorder()
    }

    /// Marks what `op`, pushed with `tag`, changes dirty, if it changes
    /// anything; the trackers are marked once it completes
    /// ([`DirtyRecorder::completed`]).
    #[inline(always)]
    pub fn record(&mut self, tag: u32, op: &IoOp) {
        match *op {
            IoOp::Write { offset, len, .. }
            | IoOp::WriteCompressed { offset, len, .. }
            | IoOp::WriteZeroes { offset, len, .. } => {
                self.bitmaps.threshold.check(offset, len, false);
                self.record_write(tag, offset, len);
            }
            IoOp::Discard { offset, len } => {
                self.bitmaps.threshold.check(offset, len, true);
                self.record_write(tag, offset, len);
            }
            // Only this test and the threshold's are inlined: a read costs no call.
            IoOp::Read { .. } | IoOp::Flush => {}
        }
    }

    fn record_write(&mut self, tag: u32, offset: u64, len: u64) {
        // Checked before setting, so that a disabled or removed bitmap
        // records nothing more...
        if self.bitmaps.generation.load(Ordering::SeqCst) != self.seen {
            self.refresh();
        }
        for hook in &self.hooks {
            hook.before_write(offset, len);
        }
        if !self.trackers.is_empty() {
            self.remember(tag, offset, len);
        }
        loop {
            for (words, shift) in &self.targets {
                words.set(offset, len, *shift);
            }
            // ...and after, so that bits set in words a resize replaced
            // meanwhile are set again in the new ones.
            if self.bitmaps.generation.load(Ordering::SeqCst) == self.seen {
                return;
            }
            self.refresh();
        }
    }

    /// Marks the trackers with the writes among `done`.
    #[inline]
    pub fn completed(&mut self, done: &[Completion]) {
        if !self.in_flight.is_empty() {
            self.mark_trackers(done);
        }
    }

    #[cold]
    fn remember(&mut self, tag: u32, offset: u64, len: u64) {
        let index = tag as usize;
        if index >= self.in_flight.len() {
            self.in_flight.resize(index + 1, (0, 0));
        }
        self.in_flight[index] = (offset, len);
    }

    #[cold]
    fn mark_trackers(&mut self, done: &[Completion]) {
        for completion in done {
            let Some(range) = self.in_flight.get_mut(completion.tag as usize) else { continue };
            let (offset, len) = std::mem::take(range);
            for (words, shift) in &self.trackers {
                words.set(offset, len, *shift);
            }
        }
    }

    fn refresh(&mut self) {
        // Never in the middle of a batch of changes: all or none of them.
        let _batch = CHANGES.read().unwrap_or_else(PoisonError::into_inner);
        self.seen = self.bitmaps.generation.load(Ordering::SeqCst);
        self.hooks.clone_from(&self.bitmaps.hooks.lock().unwrap_or_else(PoisonError::into_inner));
        self.trackers.clone_from(&self.bitmaps.trackers.lock().unwrap_or_else(PoisonError::into_inner));
        if self.trackers.is_empty() {
            self.in_flight = Vec::new();
        }
        self.targets.clear();
        for bitmap in self.bitmaps.list().iter() {
            let state = bitmap.state();
            if state.enabled {
                self.targets.push((state.words.clone(), bitmap.shift));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn write(offset: u64, len: u64) -> IoOp {
        // SAFETY: recording never touches the buffers.
        let iov = unsafe { vsd_engine::IoVecs::new(std::ptr::null(), 0) };
        IoOp::Write { offset, len, iov, durable: false }
    }

    fn options(granularity: u64) -> BitmapOptions {
        BitmapOptions { granularity, persistent: false, enabled: true }
    }

    fn runs(bitmap: &Bitmap) -> Vec<(u64, u64)> {
        let words = bitmap.words();
        let mut out = Vec::new();
        let mut at = 0;
        while let Some(run) = words.next_dirty(at, bitmap.shift) {
            out.push(run);
            at = run.0 + run.1;
        }
        out
    }

    #[test]
    fn writes_mark_whole_granules_and_only_enabled_bitmaps() {
        let set = Arc::new(DirtyBitmaps::default());
        let mut recorder = set.recorder();
        recorder.record(0, &write(0, 4096)); // before any bitmap: nowhere
        let a = set.add("a", MIB, options(65536)).unwrap();
        let b = set.add("b", MIB, BitmapOptions { enabled: false, ..options(512) }).unwrap();
        recorder.record(0, &write(65536 + 100, 10));
        recorder.record(0, &write(3 * 65536 - 1, 2)); // straddles a granule boundary
        assert_eq!(runs(&a), [(65536, 3 * 65536)], "granules 1, 2 and 3");
        assert_eq!(a.info().count, 3 * 65536);
        assert_eq!(b.info().count, 0, "a disabled bitmap records nothing");

        set.set_enabled(&b, true).unwrap();
        // SAFETY: as in `write`.
        let iov = unsafe { vsd_engine::IoVecs::new(std::ptr::null(), 0) };
        recorder.record(0, &IoOp::Read { offset: 0, len: 512, iov });
        recorder.record(0, &IoOp::Discard { offset: MIB - 512, len: 512 });
        assert_eq!(runs(&b), [(MIB - 512, 512)], "reads are not writes; discards are");
        set.set_enabled(&a, false).unwrap();
        recorder.record(0, &write(0, 512));
        assert_eq!(a.status(0, 512), (false, 512), "a disabled bitmap stops at once, whatever the recorder held");
        assert_eq!(a.status(0, MIB), (false, 65536));
        assert_eq!(a.status(65536, MIB - 65536), (true, 3 * 65536));
        assert_eq!(a.status(65536 + 7, 100), (true, 100), "clamped to the range");
    }

    #[test]
    fn ranges_across_many_words_and_past_the_end() {
        let set = Arc::new(DirtyBitmaps::default());
        let bitmap = set.add("x", 1000 * 512 + 100, options(512)).unwrap();
        let mut recorder = set.recorder();
        recorder.record(0, &write(512 * 60, 512 * 200));
        assert_eq!(runs(&bitmap), [(512 * 60, 512 * 200)]);
        recorder.record(0, &write(1000 * 512, 4096)); // the last, partial granule; the rest is outside
        recorder.record(0, &write(1 << 40, 512));
        let last = runs(&bitmap).pop().unwrap();
        assert_eq!(last, (1000 * 512, 100), "runs end at the node's end");
        assert_eq!(bitmap.info().count, 201 * 512, "count is in whole granules");
    }

    #[test]
    fn merge_takes_bytes_across_granularities_and_refuses_other_sizes() {
        let set = Arc::new(DirtyBitmaps::default());
        let fine = set.add("fine", MIB, options(512)).unwrap();
        let coarse = set.add("coarse", MIB, BitmapOptions { enabled: false, ..options(65536) }).unwrap();
        set.recorder().record(0, &write(70000, 1000));
        coarse.merge(&fine).unwrap();
        assert_eq!(runs(&coarse), [(65536, 65536)]);
        let other = DirtyBitmaps::default().add("o", 2 * MIB, options(512)).unwrap();
        assert_eq!(coarse.merge(&other), Err(BitmapError::Sizes { target: MIB, merged: 2 * MIB }));
    }

    #[test]
    fn names_granularities_and_busy_bitmaps_are_refused_as_qemu_does() {
        let set = DirtyBitmaps::default();
        assert_eq!(set.add("", MIB, options(512)).err(), Some(BitmapError::EmptyName));
        assert!(matches!(set.add(&"x".repeat(1024), MIB, options(512)), Err(BitmapError::NameTooLong(_))));
        set.add(&"x".repeat(1023), MIB, options(512)).unwrap();
        for bad in [0, 256, 1000, 3 << 20] {
            assert_eq!(set.add("g", MIB, options(bad)).err(), Some(BitmapError::Granularity), "{bad}");
        }
        let b = set.add("b", MIB, options(512)).unwrap();
        assert_eq!(set.add("b", MIB, options(512)).err(), Some(BitmapError::Exists("b".into())));
        let guard = b.take().unwrap();
        let busy = || BitmapError::Busy("b".into());
        assert_eq!(b.take().err(), Some(busy()));
        assert_eq!(b.clear(), Err(busy()));
        assert_eq!(set.set_enabled(&b, false), Err(busy()));
        assert_eq!(b.hold().err(), Some(busy()));
        drop(guard);
        set.remove_held(b.hold().unwrap());
        assert_eq!(set.get("b").err(), Some(BitmapError::NotFound("b".into())));
    }

    #[test]
    fn a_split_takes_the_bits_and_a_restore_gives_back_any_granularity() {
        let set = Arc::new(DirtyBitmaps::default());
        let bitmap = set.add("s", 4 * MIB, options(4096)).unwrap();
        let mut recorder = set.recorder();
        recorder.record(0, &write(0, 4096));
        recorder.record(0, &write(MIB + 4096, 4096));
        let guard = bitmap.take().unwrap();
        let taken = guard.split();
        assert_eq!((bitmap.info().count, taken.count()), (0, 8192), "the bitmap starts clean");
        recorder.record(0, &write(2 * MIB, 4096)); // recorded after the split: stays in the bitmap
        let clusters = taken.coarsen(65536);
        assert_eq!((clusters.granularity(), clusters.count()), (65536, 2 * 65536));
        assert_eq!(
            (clusters.next_dirty(0), clusters.next_dirty(1), clusters.next_dirty(17)),
            (Some(0), Some(16), None)
        );
        let mut uncopied = clusters.clone();
        uncopied.clean(0);
        guard.restore(&uncopied);
        assert_eq!(runs(&bitmap), [(MIB, 65536), (2 * MIB, 4096)], "a whole cluster comes back");
        let all = DirtySet::all(MIB + 1, 65536);
        assert_eq!((all.count(), all.next_dirty(16), all.next_dirty(17)), (17 * 65536, Some(16), None));
    }

    #[test]
    fn hooks_see_every_write_before_it_goes_while_installed() {
        struct Log(Mutex<Vec<(u64, u64)>>);
        impl BeforeWrite for Log {
            fn before_write(&self, offset: u64, len: u64) {
                self.0.lock().unwrap().push((offset, len));
            }
        }
        let set = Arc::new(DirtyBitmaps::default());
        let mut recorder = set.recorder();
        let (first, second) = (Arc::new(Log(Mutex::default())), Arc::new(Log(Mutex::default())));
        let hook: Arc<dyn BeforeWrite> = first.clone();
        set.add_hook(hook.clone());
        recorder.record(0, &write(4096, 512));
        set.add_hook(second.clone());
        recorder.record(0, &IoOp::Discard { offset: 0, len: 8192 });
        recorder.record(0, &IoOp::Flush);
        set.remove_hook(&hook);
        recorder.record(0, &write(0, 512));
        assert_eq!(*first.0.lock().unwrap(), [(4096, 512), (0, 8192)]);
        assert_eq!(*second.0.lock().unwrap(), [(0, 8192), (0, 512)], "the second hook, until the end");
    }

    #[test]
    fn trackers_are_marked_when_writes_complete_and_taken_clean() {
        let set = Arc::new(DirtyBitmaps::default());
        let mut recorder = set.recorder();
        recorder.record(7, &write(0, 4096)); // before the tracker: not tracked
        let tracker = set.track(MIB, 65536);
        recorder.record(3, &write(65536 + 10, 100));
        recorder.record(4, &IoOp::Discard { offset: 5 * 65536, len: 2 * 65536 });
        assert_eq!(tracker.dirty_bytes(), 0, "nothing until the writes complete");
        recorder.completed(&[Completion { tag: 7, errno: 0 }, Completion { tag: 3, errno: 0 }]);
        assert_eq!(tracker.dirty_bytes(), 65536);
        recorder.completed(&[Completion { tag: 4, errno: libc::EIO }]);
        assert_eq!(tracker.take(0, 65536), Some((65536, 65536)), "a run, at most the bytes asked");
        assert_eq!(tracker.take(0, 1), Some((5 * 65536, 65536)), "whole granules");
        tracker.mark(MIB - 1, 10);
        assert_eq!(tracker.take(0, MIB), Some((6 * 65536, 65536)));
        assert_eq!(tracker.take(7 * 65536, MIB), Some((MIB - 65536, 65536)), "clamped to the node");
        assert_eq!((tracker.take(0, MIB), tracker.dirty_bytes()), (None, 0));
        let words = tracker.words.clone();
        drop(tracker);
        recorder.record(3, &write(0, 4096));
        recorder.completed(&[Completion { tag: 3, errno: 0 }]);
        assert_eq!(words.count(), 0, "a tracker gone is marked no more");
    }

    #[test]
    fn a_batch_of_changes_loses_no_write_between_its_bitmaps() {
        const SIZE: u64 = 8 * MIB;
        let set = Arc::new(DirtyBitmaps::default());
        let mut previous = set.add("c0", SIZE, options(512)).unwrap();
        let mut recorder = set.recorder();
        let writer = std::thread::spawn(move || {
            for i in 0..SIZE / 512 {
                recorder.record(0, &write(i * 512, 512));
            }
        });
        let mut checkpoints = vec![previous.clone()];
        while !writer.is_finished() && checkpoints.len() < 500 {
            // A checkpoint: the next bitmap starts as the previous stops.
            let next = batch(|| {
                set.set_enabled(&previous, false).unwrap();
                set.add(&format!("c{}", checkpoints.len()), SIZE, options(512)).unwrap()
            });
            checkpoints.push(next.clone());
            previous = next;
        }
        writer.join().unwrap();
        let all = set.add("all", SIZE, BitmapOptions { enabled: false, ..options(512) }).unwrap();
        checkpoints.iter().for_each(|c| all.merge(c).unwrap());
        assert_eq!(all.info().count, SIZE, "every write is in one checkpoint or another ({})", checkpoints.len());
    }

    #[test]
    fn a_resize_keeps_bits_and_catches_writes_recorded_meanwhile() {
        let set = Arc::new(DirtyBitmaps::default());
        let bitmap = set.add("r", MIB, options(4096)).unwrap();
        let mut recorder = set.recorder();
        recorder.record(0, &write(MIB - 4096, 4096));
        set.resize(2 * MIB);
        recorder.record(0, &write(MIB, 4096)); // the recorder still holds the old words
        assert_eq!(runs(&bitmap), [(MIB - 4096, 8192)]);
        set.resize(MIB - 8192);
        assert_eq!(runs(&bitmap), [], "bits past a smaller size go");
        assert_eq!(bitmap.info().count, 0);
    }

    #[test]
    fn concurrent_writers_lose_no_bit_while_bitmaps_change() {
        let set = Arc::new(DirtyBitmaps::default());
        let bitmap = set.add("c", 64 * MIB, options(512)).unwrap();
        let writers: Vec<_> = (0..2u64)
            .map(|w| {
                let mut recorder = set.recorder();
                std::thread::spawn(move || {
                    for i in 0..64 * 1024u64 {
                        // Inside the smallest size the node takes below.
                        recorder.record(0, &write((i * 2 + w) * 512, 512));
                    }
                })
            })
            .collect();
        let mut sizes = [80 * MIB, 64 * MIB, 128 * MIB].into_iter().cycle();
        while writers.iter().any(|w| !w.is_finished()) {
            set.resize(sizes.next().unwrap());
        }
        writers.into_iter().for_each(|w| w.join().unwrap());
        assert_eq!(bitmap.info().count, 64 * MIB);
    }
}
