//! The mirror job (`blockdev-mirror`): copies a node onto a target while
//! the node's writers go on, until the two are in sync (the job is then
//! ready and keeps them so); `job-complete` then moves the writers onto
//! the target, and `block-job-cancel` leaves the copy as it is.
//!
//! ```text
//!   writers ─▶ source ─(write completed)─▶ Tracker ─dirty runs─▶ job: source.read ─▶ target.write
//!   complete: writers stopped ─▶ last dirty runs copied, target flushed ─▶ writers on the target
//! ```
//!
//! The tracker is marked when a write completes: a run the job takes (and
//! so cleans) and then reads is dirty again if a write to it lands after,
//! and copied again. Only the end needs the writers stopped, for as long as
//! the last runs take.
//!
//! With `copy-mode=write-blocking`, the writers write through a
//! [`MirrorTop`](crate::mirror_top::MirrorTop) filter to both nodes instead,
//! and the tracker is the job's alone: it holds what the job has still to
//! copy, and the writes that crossed one of its copies. `block-job-change`
//! switches a background mirror to write-blocking while it runs (QEMU
//! goes that way only): at the job's next step, between two copies, its
//! writers are stopped, put on a filter, and its tracker left to itself.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use vsd_block::dirty::Tracker;
use vsd_block::{Allocation, BlockNode};

use crate::copy::{Copier, Extents, Failure, MAX_COPY, Pace, extents_above};
use crate::mirror_top::InFlight;
use crate::{CANCELLED, ErrorPolicy, Finish, Job, JobBody, Status, strerror};

/// How long a job in sync waits before it looks for new writes again.
const IDLE: Duration = Duration::from_millis(100);
/// How long a run that failed under the `ignore` or `stop` policy waits
/// before it is tried again.
const RETRY_DELAY: Duration = Duration::from_millis(100);

/// What the mirror copies before it follows the writes (QAPI's
/// `MirrorSyncMode`, as far as mirrors take it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MirrorSync {
    /// Everything.
    Full,
    /// What the source holds itself, not what it reads from its backing
    /// chain (the target has the same backing).
    Top,
    /// What the source's chain holds above the layer this deep (1 is the
    /// source): an active commit's, into that layer.
    Above(u32),
    /// Nothing: only what is written from now on.
    None,
}

/// A mirror's copy mode (QAPI's `MirrorCopyMode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyMode {
    /// The job copies what the writers wrote.
    Background,
    /// The writers write to the target too.
    WriteBlocking,
}

impl CopyMode {
    /// QAPI's name.
    pub fn name(self) -> &'static str {
        match self {
            CopyMode::Background => "background",
            CopyMode::WriteBlocking => "write-blocking",
        }
    }
}

/// A mirror's copy mode as `block-job-change` sets it, and whether the
/// job is actively synced (`query-block-jobs`).
#[derive(Default)]
pub struct Mode {
    write_blocking: AtomicBool,
    actively_synced: AtomicBool,
}

impl Mode {
    fn new(mode: CopyMode) -> Arc<Self> {
        Arc::new(Self { write_blocking: AtomicBool::new(mode == CopyMode::WriteBlocking), ..Self::default() })
    }

    /// Asks for copy mode `to`, in QEMU's words: there is no way back
    /// from write-blocking.
    pub(crate) fn change(&self, to: CopyMode) -> Result<(), String> {
        if to == CopyMode::Background && self.write_blocking.load(Ordering::SeqCst) {
            return Err(format!("Change to copy mode '{}' is not implemented", to.name()));
        }
        self.write_blocking.store(to == CopyMode::WriteBlocking, Ordering::SeqCst);
        Ok(())
    }

    /// Whether the target holds what the source does and the writers
    /// write both.
    pub fn actively_synced(&self) -> bool {
        self.actively_synced.load(Ordering::SeqCst)
    }

    fn set_synced(&self, synced: bool) {
        self.actively_synced.store(synced, Ordering::SeqCst);
    }
}

/// Runs with no write of the writers in flight.
pub type Work<'a> = &'a mut dyn FnMut() -> Result<(), String>;

/// The writers of the source (the daemon's exports), which the job stops
/// at its end.
pub trait Writers: Send + Sync {
    /// Runs `work` with no write to the source in flight or starting; if
    /// it succeeds and `switch_to` is given, the writers write there from
    /// then on.
    fn stopped(
        &self,
        switch_to: Option<&Arc<dyn BlockNode>>,
        work: &mut dyn FnMut() -> Result<(), String>,
    ) -> Result<(), String>;

    /// Runs `work`, then has the writers write through a filter sharing
    /// `in_flight` to the source and the target (a switch to
    /// write-blocking), if these writers can.
    fn write_blocking(&self, _in_flight: &Arc<InFlight>, _work: Work<'_>) -> Result<(), String> {
        Err("these writers cannot write through a mirror's filter".into())
    }
}

/// How a mirror is made.
pub struct MirrorSpec {
    /// The node copied.
    pub source: Arc<dyn BlockNode>,
    /// The node written.
    pub target: Arc<dyn BlockNode>,
    /// What is copied first.
    pub sync: MirrorSync,
    /// The source's writes, tracked from a moment no write was in flight.
    pub tracker: Tracker,
    /// Who writes to the source.
    pub writers: Arc<dyn Writers>,
    /// Bytes copied in one burst under the speed limit (QEMU's `buf-size`:
    /// what its mirror has in flight at most).
    pub burst: u64,
    /// On a read error of the source.
    pub on_source_error: ErrorPolicy,
    /// On a write error of the target.
    pub on_target_error: ErrorPolicy,
}

/// The mirror job's body.
pub struct Mirror {
    spec: MirrorSpec,
    /// A write-blocking mirror's writes in flight through its filter.
    in_flight: Option<Arc<InFlight>>,
    mode: Arc<Mode>,
}

impl Mirror {
    /// A mirror as `spec` says, which copies in the background what the
    /// writers write (`copy-mode=background`).
    pub fn new(spec: MirrorSpec) -> Self {
        Self { spec, in_flight: None, mode: Mode::new(CopyMode::Background) }
    }

    /// A mirror whose writers write through a filter sharing `in_flight`
    /// (`copy-mode=write-blocking`); `spec.tracker` must be marked by
    /// nobody else ([`Tracker::apart`]).
    pub fn write_blocking(spec: MirrorSpec, in_flight: Arc<InFlight>) -> Self {
        Self { spec, in_flight: Some(in_flight), mode: Mode::new(CopyMode::WriteBlocking) }
    }
}

/// The job's own view while it runs.
struct Run<'a> {
    job: &'a Arc<Job>,
    spec: &'a MirrorSpec,
    in_flight: Option<Arc<InFlight>>,
    mode: &'a Mode,
    copier: Copier,
    /// Where the next run is looked for: runs are copied in order, round
    /// and round.
    cursor: u64,
    pace: Pace,
    /// Bytes copied in the current burst.
    burst: u64,
}

/// What one step of copying found.
enum Step {
    Copied,
    /// A run failed and stays dirty; it is tried again after a while.
    Retry,
    /// Nothing dirty: the target holds what the source does.
    InSync,
}

impl Run<'_> {
    /// Copies run `offset..offset + len`, counted as progress; on a
    /// failure it is dirty again.
    fn copy(&mut self, offset: u64, len: u64) -> Result<(), Failure> {
        if let Err(failure) = self.crossing((offset, len), |copier| copier.copy(offset, len)) {
            self.spec.tracker.mark(offset, len);
            return Err(failure);
        }
        self.job.add_progress(len);
        Ok(())
    }

    /// Runs `write`, which writes `range` of the target, as a copy the
    /// filter's writes may cross.
    fn crossing<T>(&mut self, range: (u64, u64), write: impl FnOnce(&mut Copier) -> T) -> T {
        let Some(in_flight) = &self.in_flight else { return write(&mut self.copier) };
        in_flight.copy_begins(range);
        let result = write(&mut self.copier);
        in_flight.copy_ends(range);
        result
    }

    /// The next dirty run, looked for from the cursor on, then from the start.
    fn next_run(&mut self) -> Option<(u64, u64)> {
        let tracker = &self.spec.tracker;
        for (offset, len) in self.in_flight.as_deref().map(InFlight::take_dirty).unwrap_or_default() {
            // A write that failed on the target, or crossed a copy.
            self.mode.set_synced(false);
            tracker.mark(offset, len);
        }
        let run = tracker.take(self.cursor, MAX_COPY).or_else(|| tracker.take(0, MAX_COPY))?;
        self.cursor = run.0 + run.1;
        Some(run)
    }

    /// Copies the next dirty run under the error policies.
    fn step(&mut self) -> Result<Step, String> {
        let Some((offset, len)) = self.next_run() else { return Ok(Step::InSync) };
        match self.copy(offset, len) {
            Ok(()) => {
                self.burst += len;
                if self.burst >= self.spec.burst {
                    self.pace.copied(std::mem::take(&mut self.burst));
                }
                Ok(Step::Copied)
            }
            Err(Failure::Io { write, errno }) => {
                self.mode.set_synced(false);
                let policy = if write { self.spec.on_target_error } else { self.spec.on_source_error };
                if self.job.io_error(policy, write, errno) { Ok(Step::Retry) } else { Err(strerror(errno)) }
            }
            Err(Failure::Engine(text)) => Err(text),
        }
    }

    /// Copies what is dirty and flushes the target; any error ends it.
    fn sync(&mut self) -> Result<(), String> {
        while let Some((offset, len)) = self.next_run() {
            self.copy(offset, len).map_err(|f| f.report(self.job))?;
        }
        self.copier.flush().map_err(|f| f.report(self.job))
    }

    /// `sync=full`'s start, as QEMU's: what reads as zeroes is zeroed on
    /// the target at once, the rest is dirty. A write to a hole after it
    /// was looked at is tracked, and copied like any other.
    fn zero_holes_mark_data(&mut self) -> Result<(), String> {
        let size = self.spec.source.size();
        let mut at = 0;
        while at < size {
            if self.job.cancelled() {
                return Err(CANCELLED.into());
            }
            let (allocation, n) = self.copier.status(at).map_err(|f| f.report(self.job))?;
            let n = n.min(size - at);
            match allocation {
                Allocation::Data => self.spec.tracker.mark(at, n),
                Allocation::Hole => {
                    self.crossing((at, n), |copier| copier.zero(at, n)).map_err(|f| f.report(self.job))?;
                    self.job.add_progress(n);
                }
            }
            at += n;
        }
        Ok(())
    }

    /// Follows the writes until asked to end.
    fn follow(&mut self) -> Result<(), String> {
        loop {
            if self.job.cancelled() {
                return Err(CANCELLED.into());
            }
            if self.in_flight.is_none() && self.mode.write_blocking.load(Ordering::SeqCst) {
                self.go_write_blocking();
            }
            if self.job.pause_point() {
                self.job.wait(None);
                continue;
            }
            if let Some(finish) = self.job.finish_requested() {
                return self.end(finish);
            }
            let allowed = self.pace.allowed_at(self.job.speed());
            if Instant::now() < allowed {
                self.job.wait(Some(allowed));
                continue;
            }
            let step = self.step()?;
            self.job.set_total(self.job.progress() + self.spec.tracker.dirty_bytes());
            match step {
                Step::Copied => {}
                Step::Retry => self.job.wait(Some(Instant::now() + RETRY_DELAY)),
                Step::InSync => {
                    if self.job.status() == Status::Running {
                        // In sync means on the target's disk, as QEMU has it.
                        self.copier.flush().map_err(|f| f.report(self.job))?;
                        self.job.ready();
                    }
                    self.mode.set_synced(self.in_flight.is_some());
                    self.job.wait(Some(Instant::now() + IDLE));
                }
            }
        }
    }

    /// Puts the writers on a filter that writes the target too, between
    /// two of the job's copies: from then on the tracker holds what the
    /// job has to copy and the writes that crossed its copies, no more
    /// every write. Refused, the job goes on in the background.
    fn go_write_blocking(&mut self) {
        let in_flight = Arc::new(InFlight::default());
        let tracker = &self.spec.tracker;
        let mut apart = || {
            tracker.set_apart();
            Ok(())
        };
        match self.spec.writers.write_blocking(&in_flight, &mut apart) {
            Ok(()) => self.in_flight = Some(in_flight),
            Err(e) => {
                log::error!("job '{}' stays in copy mode background: {e}", self.job.id());
                self.mode.write_blocking.store(false, Ordering::SeqCst);
            }
        }
    }

    /// The last runs, with the writers stopped; then they move onto the
    /// target if the job completes.
    fn end(&mut self, finish: Finish) -> Result<(), String> {
        let target = self.spec.target.clone();
        let switch_to = (finish == Finish::Complete).then_some(&target);
        let writers = self.spec.writers.clone();
        writers.stopped(switch_to, &mut || self.sync())
    }
}

impl JobBody for Mirror {
    fn run(&mut self, job: &Arc<Job>) -> Result<(), String> {
        let spec = &self.spec;
        let copier = Copier::open(&spec.source, &spec.target, Extents::Changing)?;
        let (in_flight, mode) = (self.in_flight.clone(), &*self.mode);
        let mut run = Run { job, spec, in_flight, mode, copier, cursor: 0, pace: Pace::new(), burst: 0 };
        match spec.sync {
            MirrorSync::Full => {
                job.set_total(spec.source.size());
                run.zero_holes_mark_data()?;
            }
            MirrorSync::Top | MirrorSync::Above(_) => {
                let depth = if let MirrorSync::Above(depth) = spec.sync { depth } else { 2 };
                let extents = extents_above(&*spec.source, depth)
                    .map_err(|e| format!("Cannot read the allocation of the source: {e}"))?;
                extents.into_iter().for_each(|(offset, len)| spec.tracker.mark(offset, len));
            }
            MirrorSync::None => {}
        }
        job.set_total(job.progress() + spec.tracker.dirty_bytes());
        run.follow()
    }

    fn copy_mode(&self) -> Option<Arc<Mode>> {
        Some(self.mode.clone())
    }
}
