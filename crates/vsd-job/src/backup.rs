//! The backup job (`blockdev-backup`): copies a source node into a target
//! node as the source was when the job started, while the source's
//! writers go on writing.
//!
//! ```text
//!   guest write ─▶ recorder ─▶ Hook::before_write ── all copied? ──▶ write goes on
//!                                   │ no: queue the clusters, wait
//!                                   ▼
//!   job thread: serve queued clusters first, then background runs
//!               source.read ─▶ target.write ─▶ mark copied ─▶ wake writers
//! ```
//!
//! The point in time is when the hook is installed: writes submitted
//! before it may still be in flight and land in the copy or not, which is
//! what a crash at that moment would leave (crash-consistent).
//!
//! Only the job's thread copies, with queues of its own; a cluster is
//! marked copied once its data is on the target, and a write to it waits
//! until then. Writers whose clusters are all copied (or not part of the
//! backup) take no lock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use vsd_block::BlockNode;
use vsd_block::dirty::{BeforeWrite, BusyGuard, DirtyBitmaps, DirtySet};

use crate::copy::{Copier, Extents, Failure, MAX_COPY, Pace, extents_above};
use crate::{ErrorPolicy, Job, JobBody, strerror};

/// Bytes per cluster, the unit of copying and of copy-before-write, unless
/// the target's clusters are larger: then theirs, as in QEMU's block-copy.
pub const CLUSTER: u64 = 65536;
/// How long a run that failed under the `ignore` policy waits before it is
/// tried again.
const RETRY_DELAY: Duration = Duration::from_millis(100);

/// What the backup copies (QAPI's `MirrorSyncMode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sync {
    /// Everything.
    Full,
    /// What the top node holds itself (its allocation depth is 1), not
    /// what it reads from its backing chain: the clusters with any of it.
    Top,
    /// Nothing in the background: only the old data of what is written
    /// while the job runs, until it is cancelled (fleecing).
    None,
    /// The clusters dirty in the bitmap when the job starts.
    Bitmap,
}

/// What happens to the bitmap when the job ends (QAPI's `BitmapSyncMode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BitmapMode {
    /// Cleared of what was copied if the job succeeds.
    OnSuccess,
    /// Never cleared.
    Never,
    /// Cleared of what was copied, whatever the outcome.
    Always,
}

/// How a backup is made.
pub struct BackupSpec {
    /// The node copied.
    pub source: Arc<dyn BlockNode>,
    /// The node written.
    pub target: Arc<dyn BlockNode>,
    /// What is copied.
    pub sync: Sync,
    /// The bitmap taken for the job (busy until it ends), and its mode.
    pub bitmap: Option<(BusyGuard, BitmapMode)>,
    /// On a read error of the source.
    pub on_source_error: ErrorPolicy,
    /// On a write error of the target.
    pub on_target_error: ErrorPolicy,
    /// Data is written compressed (the target must store it so).
    pub compress: bool,
}

/// The backup job's body.
pub struct Backup {
    spec: BackupSpec,
    /// The bitmap's dirty bits, taken out of it when the job started.
    taken: Option<DirtySet>,
    clusters: Option<Arc<Clusters>>,
    /// The hook, from the job's start until its copying ends.
    installed: Option<Installed>,
}

impl Backup {
    /// A backup as `spec` says.
    pub fn new(spec: BackupSpec) -> Self {
        Self { spec, taken: None, clusters: None, installed: None }
    }
}

/// Which clusters are done, shared by the job's thread and the writers.
struct Clusters {
    size: u64,
    /// Bytes per cluster.
    cluster: u64,
    /// A set bit: nothing to wait for (copied, or not part of the backup).
    done: Box<[AtomicU64]>,
    requests: Mutex<Requests>,
    /// Signalled when clusters are done or the hook goes.
    copied: Condvar,
    /// Woken when a writer queues a request.
    job: Arc<Job>,
}

#[derive(Default)]
struct Requests {
    /// Ranges of clusters, first and last, writers wait for.
    ranges: Vec<(u64, u64)>,
    /// False once the job let go of the writers.
    active: bool,
}

impl Clusters {
    /// `belongs` says which clusters (of `cluster` bytes) of a node of
    /// `size` bytes the backup copies.
    fn new(size: u64, cluster: u64, belongs: impl Fn(u64) -> bool, job: Arc<Job>) -> Self {
        let count = size.div_ceil(cluster);
        let done: Box<[AtomicU64]> = (0..count.div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
        for index in (0..count).filter(|&i| !belongs(i)) {
            done[(index / 64) as usize].fetch_or(1 << (index % 64), Ordering::Relaxed);
        }
        let requests = Mutex::new(Requests { ranges: Vec::new(), active: true });
        Self { size, cluster, done, requests, copied: Condvar::new(), job }
    }

    fn count(&self) -> u64 {
        self.size.div_ceil(self.cluster)
    }

    fn is_done(&self, index: u64) -> bool {
        self.done.get((index / 64) as usize).is_none_or(|w| w.load(Ordering::Acquire) & (1 << (index % 64)) != 0)
    }

    fn all_done(&self, (first, last): (u64, u64)) -> bool {
        (first..=last).all(|index| self.is_done(index))
    }

    fn requests(&self) -> MutexGuard<'_, Requests> {
        self.requests.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Marks clusters `first..first + count` done and wakes their writers.
    fn mark_done(&self, first: u64, count: u64) {
        for index in first..first + count {
            if let Some(word) = self.done.get((index / 64) as usize) {
                word.fetch_or(1 << (index % 64), Ordering::Release);
            }
        }
        // Under the lock: a writer checks and waits under it, so it
        // cannot miss this.
        let _requests = self.requests();
        self.copied.notify_all();
    }

    /// The bytes of clusters `first..first + count`, clamped to the node.
    fn bytes(&self, first: u64, count: u64) -> (u64, u64) {
        let offset = first * self.cluster;
        (offset, ((first + count) * self.cluster).min(self.size) - offset)
    }

    /// The first run of clusters to copy in `from..end`, at most what one
    /// copy takes.
    fn next_run(&self, from: u64, end: u64) -> Option<(u64, u64)> {
        let end = end.min(self.count());
        let first = (from..end).find(|&i| !self.is_done(i))?;
        let run = (MAX_COPY / self.cluster).max(1);
        let count = (first..end.min(first + run)).take_while(|&i| !self.is_done(i)).count();
        Some((first, count as u64))
    }

    /// Lets every writer go, now and from now on.
    fn release(&self) {
        self.requests().active = false;
        self.copied.notify_all();
    }
}

/// The copy-before-write hook installed on the source.
struct Hook(Arc<Clusters>);

impl BeforeWrite for Hook {
    fn before_write(&self, offset: u64, len: u64) {
        let clusters = &self.0;
        if len == 0 || offset >= clusters.size {
            return;
        }
        let last = (offset.saturating_add(len - 1).min(clusters.size - 1)) / clusters.cluster;
        let range = (offset / clusters.cluster, last);
        if clusters.all_done(range) {
            return;
        }
        let mut requests = clusters.requests();
        if !requests.active {
            return;
        }
        requests.ranges.push(range);
        clusters.job.kick();
        while requests.active && !clusters.all_done(range) {
            requests = clusters.copied.wait(requests).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// Removes the hook and lets the writers go however the job ends.
struct Installed {
    bitmaps: Arc<DirtyBitmaps>,
    hook: Arc<dyn BeforeWrite>,
    clusters: Arc<Clusters>,
}

impl Drop for Installed {
    fn drop(&mut self) {
        self.bitmaps.remove_hook(&self.hook);
        self.clusters.release();
    }
}

/// The job's own view while it runs.
struct Run<'a> {
    job: &'a Arc<Job>,
    copier: Copier,
    clusters: Arc<Clusters>,
    on_source_error: ErrorPolicy,
    on_target_error: ErrorPolicy,
    pace: Pace,
}

impl Run<'_> {
    /// Copies what writers wait for. Their errors fail the job: a write
    /// is never left waiting for a job that stopped.
    fn serve_writers(&mut self) -> Result<(), String> {
        let ranges = std::mem::take(&mut self.clusters.requests().ranges);
        for (first, last) in ranges {
            let mut at = first;
            while let Some((start, count)) = self.clusters.next_run(at, last + 1) {
                self.copy_clusters(start, count).map_err(|f| f.report(self.job))?;
                at = start + count;
            }
        }
        Ok(())
    }

    fn copy_clusters(&mut self, first: u64, count: u64) -> Result<(), Failure> {
        let (offset, len) = self.clusters.bytes(first, count);
        self.copier.copy(offset, len)?;
        self.clusters.mark_done(first, count);
        // Whole clusters, the disk's partial last one too, as QEMU counts.
        self.job.add_progress(count * self.clusters.cluster);
        Ok(())
    }

    /// Copies a background run under the error policies; `Ok(false)`: it
    /// is to be tried again.
    fn background(&mut self, first: u64, count: u64) -> Result<bool, String> {
        match self.copy_clusters(first, count) {
            Ok(()) => {
                self.pace.copied(self.clusters.bytes(first, count).1);
                Ok(true)
            }
            Err(Failure::Io { write, errno }) => {
                let policy = if write { self.on_target_error } else { self.on_source_error };
                if self.job.io_error(policy, write, errno) { Ok(false) } else { Err(strerror(errno)) }
            }
            Err(Failure::Engine(text)) => Err(text),
        }
    }

    /// Copies until everything is (or, without background work, until
    /// cancelled), writers first.
    fn copy_all(&mut self, background: bool) -> Result<(), String> {
        let mut cursor = 0;
        loop {
            self.serve_writers()?;
            if self.job.cancelled() {
                return Err(crate::CANCELLED.into());
            }
            if self.job.pause_point() || !background {
                self.job.wait(None);
                continue;
            }
            let allowed = self.pace.allowed_at(self.job.speed());
            if Instant::now() < allowed {
                self.job.wait(Some(allowed));
                continue;
            }
            let end = self.clusters.count();
            let next = self.clusters.next_run(cursor, end).or_else(|| self.clusters.next_run(0, cursor));
            let Some((first, count)) = next else {
                return self.copier.flush().map_err(|f| f.report(self.job));
            };
            if self.background(first, count)? {
                cursor = first + count;
            } else {
                // Tried again after a while: a lasting error does not spin.
                self.job.wait(Some(Instant::now() + RETRY_DELAY));
            }
        }
    }
}

/// By cluster (of `cluster` bytes): whether `node` holds any of it
/// itself, rather than its backing chain.
fn top_clusters(node: &dyn BlockNode, cluster: u64) -> std::io::Result<Vec<bool>> {
    let mut held = vec![false; node.size().div_ceil(cluster) as usize];
    for (offset, len) in extents_above(node, 2)? {
        held[(offset / cluster) as usize..=((offset + len - 1) / cluster) as usize].fill(true);
    }
    Ok(held)
}

impl JobBody for Backup {
    /// The point in time: the bitmap split and the hook installed, on the
    /// command's thread (with a transaction's other actions).
    fn prepare(&mut self, job: &Arc<Job>) -> Result<(), String> {
        let source = &self.spec.source;
        let bitmaps = source.dirty_bitmaps().cloned().ok_or("the source keeps no dirty bitmaps")?;
        // Taken at the same moment as the hook is installed: writes from
        // now on are in the bitmap again, and their old data in the copy.
        let taken = self.spec.bitmap.as_ref().map(|(guard, _)| guard.split());
        let cluster = CLUSTER.max(self.spec.target.cluster_size().unwrap_or(0));
        let belongs: Box<dyn Fn(u64) -> bool> = match (&taken, self.spec.sync) {
            (Some(set), Sync::Bitmap) => {
                let set = set.coarsen(cluster);
                Box::new(move |index| set.is_dirty(index))
            }
            (_, Sync::Top) => {
                let top = top_clusters(&**source, cluster)
                    .map_err(|e| format!("Cannot read the allocation of the source: {e}"))?;
                Box::new(move |index| top.get(index as usize).is_some_and(|&held| held))
            }
            _ => Box::new(|_| true),
        };
        let clusters = Arc::new(Clusters::new(source.size(), cluster, belongs, job.clone()));
        // Whole clusters, the disk's partial last one too, as QEMU counts.
        let total = (0..clusters.count()).filter(|&i| !clusters.is_done(i)).count() as u64 * cluster;
        job.set_total(total);
        self.taken = taken;
        self.clusters = Some(clusters.clone());
        let hook: Arc<dyn BeforeWrite> = Arc::new(Hook(clusters.clone()));
        bitmaps.add_hook(hook.clone());
        self.installed = Some(Installed { bitmaps, hook, clusters });
        Ok(())
    }

    fn run(&mut self, job: &Arc<Job>) -> Result<(), String> {
        // Removed however the copying ends.
        let _installed = self.installed.take();
        let clusters = self.clusters.clone().ok_or("the backup was not prepared")?;
        let mut copier = Copier::open(&self.spec.source, &self.spec.target, Extents::Stable)?;
        if self.spec.compress {
            // Whole target clusters: each backup cluster is one or several.
            copier.compressed(self.spec.target.cluster_size().unwrap_or(clusters.cluster));
        }
        let mut run = Run {
            job,
            copier,
            clusters,
            on_source_error: self.spec.on_source_error,
            on_target_error: self.spec.on_target_error,
            pace: Pace::new(),
        };
        run.copy_all(self.spec.sync != Sync::None)
    }

    fn commit(&mut self) {
        if let (Some((guard, BitmapMode::Never)), Some(taken)) = (&self.spec.bitmap, &self.taken) {
            guard.restore(taken);
        }
    }

    fn abort(&mut self) {
        let (Some((guard, mode)), Some(taken)) = (&self.spec.bitmap, &self.taken) else { return };
        match (mode, &self.clusters) {
            (BitmapMode::Always, Some(clusters)) => {
                // Only what was not copied stays dirty.
                let mut back = taken.coarsen(clusters.cluster);
                for index in (0..clusters.count()).filter(|&i| clusters.is_done(i)) {
                    back.clean(index);
                }
                guard.restore(&back);
            }
            _ => guard.restore(taken),
        }
    }

    fn clean(&mut self) {
        // The hook goes (if the job never ran), the bitmap is free again,
        // and the clusters' hold on the job goes.
        self.installed = None;
        self.spec.bitmap = None;
        self.clusters = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::JobSpec;

    fn job() -> Arc<Job> {
        let spec = JobSpec {
            id: "t".into(),
            kind: "backup",
            auto_finalize: true,
            auto_dismiss: true,
            speed: 0,
            nodes: Vec::new(),
            group: None,
        };
        Job::new(spec, Arc::new(|_: &str, _| {}), None)
    }

    #[test]
    fn runs_stop_at_copied_clusters_at_the_run_length_and_at_the_bound() {
        // 40 clusters and a half; clusters 3 and 30..33 are not in the backup.
        let size = 40 * CLUSTER + CLUSTER / 2;
        let clusters = Clusters::new(size, CLUSTER, |i| i != 3 && !(30..33).contains(&i), job());
        assert_eq!(clusters.count(), 41);
        assert_eq!(clusters.next_run(0, 41), Some((0, 3)));
        assert_eq!(clusters.next_run(3, 41), Some((4, MAX_COPY / CLUSTER)), "at most a run");
        assert_eq!(clusters.next_run(4, 10), Some((4, 6)), "within the bound");
        assert_eq!(clusters.next_run(25, 41), Some((25, 5)));
        clusters.mark_done(33, 8);
        assert_eq!(clusters.next_run(30, 41), None);
        assert_eq!(clusters.bytes(40, 1), (40 * CLUSTER, CLUSTER / 2), "the last cluster ends with the node");
    }

    #[test]
    fn writers_wait_for_their_clusters_and_go_when_released() {
        let clusters = Arc::new(Clusters::new(4 * CLUSTER, CLUSTER, |i| i != 0, job()));
        let hook = Hook(clusters.clone());
        hook.before_write(100, 4096); // cluster 0 is not in the backup
        hook.before_write(4 * CLUSTER, 512); // past the end
        let writer = {
            let clusters = clusters.clone();
            std::thread::spawn(move || Hook(clusters).before_write(CLUSTER - 1, 2))
        };
        while clusters.requests().ranges.is_empty() {
            std::thread::yield_now();
        }
        assert_eq!(clusters.requests().ranges, [(0, 1)]);
        assert!(!writer.is_finished(), "cluster 1 is not copied yet");
        clusters.mark_done(1, 1);
        writer.join().unwrap();
        let late = {
            let clusters = clusters.clone();
            std::thread::spawn(move || Hook(clusters).before_write(2 * CLUSTER, CLUSTER))
        };
        while clusters.requests().ranges.len() < 2 {
            std::thread::yield_now();
        }
        clusters.release();
        late.join().unwrap();
        Hook(clusters.clone()).before_write(3 * CLUSTER, 1); // released: no wait
    }
}
