//! Long-running block jobs with QEMU's job model: a status machine that
//! QMP verbs drive, events for every change, and a body that runs on the
//! job's own thread (the backup job, [`backup`]; the mirror, [`mirror`]).
//!
//! ```text
//!   created ─▶ running ⇄ paused
//!                 │ ╰──▶ ready ⇄ standby   (a mirror in sync: job-complete ends it)
//!                 │ body done
//!                 ├─ ok ─────▶ waiting ─▶ pending ─[finalize]─▶ commit ─┐
//!                 └─ error / cancel ───────────▶ aborting ─▶ abort ─────┴▶ concluded ─[dismiss]─▶ null
//! ```
//!
//! QMP threads call the verbs ([`Job::cancel`], [`Job::pause`]...), which
//! only change the job's state under its lock and wake its thread; the
//! thread moves the status along at its pause points and emits the events,
//! so they come in the order the statuses change.

#![deny(missing_docs)]

pub mod backup;
pub mod commit;
mod copy;
mod group;
pub mod mirror;
pub mod mirror_top;
mod registry;
pub mod stream;

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use serde_json::{Value, json};

pub use group::Group;
pub use registry::Jobs;

/// Sends a QMP event: its name and data.
pub type Emit = Arc<dyn Fn(&str, Value) + Send + Sync>;

/// Where a job is, with QAPI's names (`JobStatus`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Made, not started.
    Created,
    /// Working.
    Running,
    /// Paused by a user or by an error.
    Paused,
    /// Could complete (never for a backup).
    Ready,
    /// Ready and paused.
    Standby,
    /// Done, waiting for the other jobs of its transaction.
    Waiting,
    /// Done, waiting to be finalized.
    Pending,
    /// Failed or cancelled, undoing its work.
    Aborting,
    /// Finished; its outcome can be queried until dismissed.
    Concluded,
    /// Gone.
    Null,
}

impl Status {
    /// QAPI's name.
    pub fn name(self) -> &'static str {
        match self {
            Status::Created => "created",
            Status::Running => "running",
            Status::Paused => "paused",
            Status::Ready => "ready",
            Status::Standby => "standby",
            Status::Waiting => "waiting",
            Status::Pending => "pending",
            Status::Aborting => "aborting",
            Status::Concluded => "concluded",
            Status::Null => "null",
        }
    }
}

/// What a user may ask of a job (QAPI's `JobVerb`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    /// Stop it, undoing its work.
    Cancel,
    /// Pause it.
    Pause,
    /// Resume it.
    Resume,
    /// Change its speed limit.
    SetSpeed,
    /// Finish a ready job.
    Complete,
    /// Commit a pending job.
    Finalize,
    /// Forget a concluded job.
    Dismiss,
    /// Change its options (`block-job-change`: a mirror's copy mode).
    Change,
}

impl Verb {
    /// QAPI's name.
    pub fn name(self) -> &'static str {
        match self {
            Verb::Cancel => "cancel",
            Verb::Pause => "pause",
            Verb::Resume => "resume",
            Verb::SetSpeed => "set-speed",
            Verb::Complete => "complete",
            Verb::Finalize => "finalize",
            Verb::Dismiss => "dismiss",
            Verb::Change => "change",
        }
    }

    /// Whether a job in `status` takes the verb (QEMU's verb table).
    pub fn allowed(self, status: Status) -> bool {
        use Status::*;
        match self {
            Verb::Cancel => matches!(status, Created | Running | Paused | Ready | Standby | Waiting | Pending),
            Verb::Pause | Verb::Resume | Verb::SetSpeed | Verb::Change => {
                matches!(status, Created | Running | Paused | Ready | Standby)
            }
            Verb::Complete => status == Ready,
            Verb::Finalize => status == Pending,
            Verb::Dismiss => status == Concluded,
        }
    }
}

/// What a job does on an I/O error (QAPI's `BlockdevOnError`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ErrorPolicy {
    /// Fail the job.
    #[default]
    Report,
    /// Try again.
    Ignore,
    /// Pause the job until it is resumed, then try again.
    Stop,
    /// Stop on ENOSPC, report anything else.
    Enospc,
}

/// How a ready job is asked to end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// `job-complete`: its work is finished (a mirror moves the source's
    /// writers onto the copy).
    Complete,
    /// `block-job-cancel` without `force`: it ends well, as it is (a
    /// mirror leaves a copy of the source at that moment and no switch).
    Leave,
}

/// The job's side of a [`JobBody`]: what the body does.
pub trait JobBody: Send + 'static {
    /// What must happen at the moment the job is made, on the caller's
    /// thread (a backup's point in time: with the other actions of a
    /// transaction); an error and the job is not made.
    fn prepare(&mut self, _job: &Arc<Job>) -> Result<(), String> {
        Ok(())
    }
    /// The work, on the job's thread; returns once done, on an error, or
    /// once [`Job::cancelled`] says so.
    fn run(&mut self, job: &Arc<Job>) -> Result<(), String>;
    /// Makes the work count (the job succeeded and is finalized).
    fn commit(&mut self) {}
    /// Undoes what can be undone (the job failed or was cancelled).
    fn abort(&mut self) {}
    /// Lets go of what the job held, whatever the outcome.
    fn clean(&mut self) {}
    /// The copy mode `block-job-change` switches, for a mirror.
    fn copy_mode(&self) -> Option<Arc<mirror::Mode>> {
        None
    }
}

/// How a job is made.
#[derive(Clone, Debug)]
pub struct JobSpec {
    /// Its id, unique among live jobs.
    pub id: String,
    /// Its type, as QAPI names it (`backup`).
    pub kind: &'static str,
    /// Finalize once done without waiting for `job-finalize`.
    pub auto_finalize: bool,
    /// Go away once concluded without waiting for `job-dismiss`.
    pub auto_dismiss: bool,
    /// Bytes per second, 0 for no limit.
    pub speed: u64,
    /// The nodes it uses, which no other job may use meanwhile.
    pub nodes: Vec<String>,
    /// The jobs it succeeds or fails with (`completion-mode=grouped`).
    pub group: Option<Arc<Group>>,
}

/// One job.
pub struct Job {
    spec: JobSpec,
    state: Mutex<State>,
    /// Wakes the job's thread: a verb, a request for its body, a status.
    wake: Condvar,
    emit: Emit,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// A mirror's copy mode.
    mode: Option<Arc<mirror::Mode>>,
}

struct State {
    status: Status,
    /// Asked to pause (by a user, or by an error with the stop policy).
    pause_requested: bool,
    cancelled: bool,
    finalize_requested: bool,
    /// How a ready job was asked to end.
    finish: Option<Finish>,
    /// The body was asked to look for work ([`Job::kick`]).
    kicked: bool,
    speed: u64,
    progress: u64,
    total: u64,
    error: Option<String>,
    /// Stopped on an I/O error until resumed.
    io_failed: bool,
}

/// What `query-jobs` and `query-block-jobs` show of a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobInfo {
    /// Its id.
    pub id: String,
    /// Its type.
    pub kind: &'static str,
    /// Its status.
    pub status: Status,
    /// Bytes done.
    pub progress: u64,
    /// Bytes to do.
    pub total: u64,
    /// Its speed limit.
    pub speed: u64,
    /// Pausing or paused.
    pub paused: bool,
    /// Stopped on an I/O error.
    pub io_failed: bool,
    /// Why it failed, once it has.
    pub error: Option<String>,
    /// As made.
    pub auto_finalize: bool,
    /// As made.
    pub auto_dismiss: bool,
    /// A block job (`query-block-jobs`, `BLOCK_JOB_*` events), not one of
    /// QEMU's other jobs (`create`).
    pub block: bool,
    /// A mirror's: the target is in sync and written with the source.
    pub actively_synced: Option<bool>,
}

fn is_paused(status: Status) -> bool {
    matches!(status, Status::Paused | Status::Standby)
}

/// Whether jobs of type `kind` are block jobs, as QEMU's types are.
fn is_block_job(kind: &str) -> bool {
    matches!(kind, "backup" | "commit" | "stream" | "mirror")
}

/// Why a cancelled job ended, in the words of `strerror(ECANCELED)`.
pub const CANCELLED: &str = "Operation canceled";

/// The host's text for `errno`, without Rust's "(os error N)".
pub fn strerror(errno: i32) -> String {
    let text = std::io::Error::from_raw_os_error(errno).to_string();
    match text.rfind(" (os error") {
        Some(at) => text[..at].to_string(),
        None => text,
    }
}

impl Job {
    fn new(spec: JobSpec, emit: Emit, mode: Option<Arc<mirror::Mode>>) -> Arc<Self> {
        let state = State {
            status: Status::Created,
            pause_requested: false,
            cancelled: false,
            finalize_requested: false,
            finish: None,
            kicked: false,
            speed: spec.speed,
            progress: 0,
            total: 0,
            error: None,
            io_failed: false,
        };
        let (state, wake, thread) = (Mutex::new(state), Condvar::new(), Mutex::new(None));
        let job = Arc::new(Self { spec, state, wake, emit, thread, mode });
        job.announce(Status::Created);
        job
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every field is valid on its own: a panic elsewhere leaves no half-change.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn announce(&self, status: Status) {
        (self.emit)("JOB_STATUS_CHANGE", json!({ "status": status.name(), "id": self.spec.id }));
    }

    /// Moves to `status` and says so (the lock held keeps events in order).
    fn set_status(&self, state: &mut State, status: Status) {
        state.status = status;
        self.announce(status);
        self.wake.notify_all();
    }

    /// Its id.
    pub fn id(&self) -> &str {
        &self.spec.id
    }

    /// The nodes it uses.
    pub fn nodes(&self) -> &[String] {
        &self.spec.nodes
    }

    /// Its type.
    pub fn kind(&self) -> &'static str {
        self.spec.kind
    }

    /// Its status now.
    pub fn status(&self) -> Status {
        self.state().status
    }

    /// What QMP shows of it.
    pub fn info(&self) -> JobInfo {
        let state = self.state();
        JobInfo {
            id: self.spec.id.clone(),
            kind: self.spec.kind,
            status: state.status,
            progress: state.progress,
            total: state.total,
            speed: state.speed,
            paused: state.pause_requested,
            io_failed: state.io_failed,
            error: state.error.clone(),
            auto_finalize: self.spec.auto_finalize,
            auto_dismiss: self.spec.auto_dismiss,
            block: is_block_job(self.spec.kind),
            actively_synced: self.mode.as_ref().map(|mode| mode.actively_synced()),
        }
    }

    fn verb(&self, verb: Verb) -> Result<MutexGuard<'_, State>, String> {
        let state = self.state();
        if verb.allowed(state.status) {
            return Ok(state);
        }
        Err(format!(
            "Job '{}' in state '{}' cannot accept command verb '{}'",
            self.spec.id,
            state.status.name(),
            verb.name()
        ))
    }

    /// `job-cancel`: the job aborts at its next pause point (and, in a
    /// group, the others with it).
    pub fn cancel(&self) -> Result<(), String> {
        let mut state = self.verb(Verb::Cancel)?;
        state.cancelled = true;
        state.pause_requested = false;
        self.wake.notify_all();
        drop(state);
        if let Some(group) = &self.spec.group {
            group.poke();
        }
        Ok(())
    }

    /// Cancelled whatever its status: its group failed, or the daemon stops.
    fn force_cancel(&self) {
        let mut state = self.state();
        state.cancelled = true;
        state.pause_requested = false;
        self.wake.notify_all();
    }

    /// `block-job-cancel`: as [`Job::cancel`], but a ready job asked
    /// without `force` ends well, as it is ([`Finish::Leave`]).
    pub fn block_cancel(&self, force: bool) -> Result<(), String> {
        let mut state = self.verb(Verb::Cancel)?;
        if force || !matches!(state.status, Status::Ready | Status::Standby) {
            drop(state);
            return self.cancel();
        }
        state.finish = Some(Finish::Leave);
        state.pause_requested = false;
        self.wake.notify_all();
        Ok(())
    }

    /// `job-pause`: the job pauses at its next pause point.
    pub fn pause(&self) -> Result<(), String> {
        let mut state = self.verb(Verb::Pause)?;
        if state.pause_requested {
            return Err("Job is already paused".into());
        }
        state.pause_requested = true;
        self.wake.notify_all();
        Ok(())
    }

    /// `job-resume`.
    pub fn resume(&self) -> Result<(), String> {
        let mut state = self.verb(Verb::Resume)?;
        if !state.pause_requested {
            return Err("Can't resume a job that was not paused".into());
        }
        state.pause_requested = false;
        state.io_failed = false;
        self.wake.notify_all();
        Ok(())
    }

    /// `block-job-set-speed`: bytes per second, 0 for no limit.
    pub fn set_speed(&self, speed: u64) -> Result<(), String> {
        self.verb(Verb::SetSpeed)?.speed = speed;
        self.wake.notify_all();
        Ok(())
    }

    /// `block-job-change`'s copy mode: a mirror's, from background to
    /// write-blocking only, as QEMU's; other jobs take no change.
    pub fn change_copy_mode(&self, to: mirror::CopyMode) -> Result<(), String> {
        drop(self.verb(Verb::Change)?);
        let mode = self.mode.as_ref().ok_or("Job type does not support change")?;
        mode.change(to)?;
        self.kick();
        Ok(())
    }

    /// `job-complete`: a ready job finishes its work.
    pub fn complete(&self) -> Result<(), String> {
        self.verb(Verb::Complete)?.finish = Some(Finish::Complete);
        self.wake.notify_all();
        Ok(())
    }

    /// How the job was asked to end, once it is ready.
    pub fn finish_requested(&self) -> Option<Finish> {
        self.state().finish
    }

    /// The body's work is in sync and could end: the job is ready (QEMU
    /// says so with JOB_STATUS_CHANGE, then BLOCK_JOB_READY).
    pub fn ready(&self) {
        let mut state = self.state();
        if state.status != Status::Running {
            return;
        }
        self.set_status(&mut state, Status::Ready);
        let data = json!({
            "device": self.spec.id,
            "len": state.total,
            "offset": state.progress,
            "speed": state.speed,
            "type": self.spec.kind,
        });
        (self.emit)("BLOCK_JOB_READY", data);
    }

    /// `job-finalize`: a pending job commits (with its whole group).
    pub fn finalize(&self) -> Result<(), String> {
        self.verb(Verb::Finalize)?.finalize_requested = true;
        self.wake.notify_all();
        if let Some(group) = &self.spec.group {
            group.finalize_all();
        }
        Ok(())
    }

    fn finalize_for_group(&self) {
        self.state().finalize_requested = true;
        self.wake.notify_all();
    }

    /// `job-dismiss`: a concluded job goes.
    pub fn dismiss(&self) -> Result<(), String> {
        let mut state = self.verb(Verb::Dismiss)?;
        self.set_status(&mut state, Status::Null);
        Ok(())
    }

    /// Whether the body should stop: the job was cancelled.
    pub fn cancelled(&self) -> bool {
        self.state().cancelled
    }

    /// The speed limit now.
    pub fn speed(&self) -> u64 {
        self.state().speed
    }

    /// Sets the bytes to do.
    pub fn set_total(&self, total: u64) {
        self.state().total = total;
    }

    /// Bytes done so far.
    pub fn progress(&self) -> u64 {
        self.state().progress
    }

    /// Counts `bytes` more done.
    pub fn add_progress(&self, bytes: u64) {
        self.state().progress += bytes;
    }

    /// Asks the body's thread to look for work (see [`Job::wait`]).
    pub fn kick(&self) {
        self.state().kicked = true;
        self.wake.notify_all();
    }

    /// A pause point: pauses or resumes as asked, and returns whether the
    /// job is paused (its body then does only what cannot wait). A ready
    /// job pauses into `standby`, and is ready again when resumed.
    pub fn pause_point(&self) -> bool {
        let mut state = self.state();
        match (state.status, state.pause_requested && !state.cancelled) {
            (Status::Running, true) => self.set_status(&mut state, Status::Paused),
            (Status::Paused, false) => self.set_status(&mut state, Status::Running),
            (Status::Ready, true) => self.set_status(&mut state, Status::Standby),
            (Status::Standby, false) => self.set_status(&mut state, Status::Ready),
            _ => {}
        }
        is_paused(state.status)
    }

    /// Blocks until kicked, a verb changed something, or `until` passed.
    pub fn wait(&self, until: Option<Instant>) {
        let mut state = self.state();
        let settled = |s: &State| s.pause_requested == is_paused(s.status);
        if !state.kicked && !state.cancelled && settled(&state) {
            state = match until {
                None => self.wake.wait(state).unwrap_or_else(PoisonError::into_inner),
                Some(at) => {
                    let left = at.saturating_duration_since(Instant::now());
                    self.wake.wait_timeout(state, left).unwrap_or_else(PoisonError::into_inner).0
                }
            };
        }
        state.kicked = false;
    }

    /// Decides what an I/O error (`errno`, in a `read` or a `write`)
    /// does under `policy`, says so (BLOCK_JOB_ERROR), and stops the job
    /// if the policy says so. Returns whether to try again.
    pub fn io_error(&self, policy: ErrorPolicy, write: bool, errno: i32) -> bool {
        let action = match policy {
            ErrorPolicy::Report => "report",
            ErrorPolicy::Ignore => "ignore",
            ErrorPolicy::Stop => "stop",
            ErrorPolicy::Enospc if errno == libc::ENOSPC => "stop",
            ErrorPolicy::Enospc => "report",
        };
        let operation = if write { "write" } else { "read" };
        let mut state = self.state();
        (self.emit)("BLOCK_JOB_ERROR", json!({ "device": self.spec.id, "operation": operation, "action": action }));
        if action == "stop" {
            state.pause_requested = true;
            state.io_failed = true;
        }
        action != "report"
    }

    /// The job's thread: runs the body, then the finishing sequence.
    fn main(self: &Arc<Self>, mut body: Box<dyn JobBody>) {
        let result = if self.cancelled() { Err(CANCELLED.into()) } else { body.run(self) };
        let ok = self.settle(result);
        if ok {
            body.commit();
        } else {
            body.abort();
        }
        body.clean();
        // Before anyone sees the job gone: what it holds goes first.
        drop(body);
        self.conclude();
        if let Some(group) = &self.spec.group {
            group.concluded();
        }
    }

    /// Says the job runs, before its thread starts (QEMU says so before
    /// the command that made it returns).
    fn start(&self) {
        let mut state = self.state();
        self.set_status(&mut state, Status::Running);
    }

    /// From the body's result to `pending` (waiting for a finalize unless
    /// automatic) or `aborting`; returns whether the job succeeded. In a
    /// group, the job waits for the others first, and fails with them.
    fn settle(&self, result: Result<(), String>) -> bool {
        let group = self.spec.group.as_deref();
        let mut state = self.state();
        if result.is_ok() && !state.cancelled {
            self.set_status(&mut state, Status::Waiting);
            let succeeded = match group {
                None => {
                    self.to_pending(&mut state);
                    true
                }
                Some(group) => {
                    drop(state);
                    let succeeded = group.wait_for_others(self);
                    state = self.state();
                    succeeded
                }
            };
            if succeeded && !self.spec.auto_finalize {
                while !state.finalize_requested && !state.cancelled {
                    state = self.wake.wait(state).unwrap_or_else(PoisonError::into_inner);
                }
            }
            if succeeded && !state.cancelled {
                return true;
            }
            // Failed with its group, or cancelled while pending.
            state.cancelled = true;
        }
        if let Some(group) = group {
            drop(state);
            group.fail(self);
            state = self.state();
        }
        state.error = Some(match (state.cancelled, result) {
            (true, _) | (false, Ok(())) => CANCELLED.into(),
            (false, Err(e)) => e,
        });
        self.set_status(&mut state, Status::Aborting);
        false
    }

    /// Waiting → pending, announced if a `job-finalize` must follow.
    fn to_pending(&self, state: &mut State) {
        self.set_status(state, Status::Pending);
        if !self.spec.auto_finalize {
            (self.emit)("BLOCK_JOB_PENDING", json!({ "type": self.spec.kind, "id": self.spec.id }));
        }
    }

    /// Made pending by its group, once every member's work is done.
    fn become_pending(&self) {
        self.to_pending(&mut self.state());
    }

    fn conclude(&self) {
        let mut state = self.state();
        if is_block_job(self.spec.kind) {
            self.say_ended(&state);
        }
        self.set_status(&mut state, Status::Concluded);
        if self.spec.auto_dismiss {
            self.set_status(&mut state, Status::Null);
        }
    }

    /// BLOCK_JOB_CANCELLED or BLOCK_JOB_COMPLETED, with the error if any.
    fn say_ended(&self, state: &State) {
        let mut data = json!({
            "device": self.spec.id,
            "len": state.total,
            "offset": state.progress,
            "speed": state.speed,
            "type": self.spec.kind,
        });
        if state.cancelled {
            (self.emit)("BLOCK_JOB_CANCELLED", data);
            return;
        }
        if let Some(error) = &state.error {
            data["error"] = json!(error);
        }
        (self.emit)("BLOCK_JOB_COMPLETED", data);
    }

    /// Cancels the job whatever its status (the daemon stops) and waits
    /// for its thread.
    fn end(&self) {
        self.force_cancel();
        if let Some(group) = &self.spec.group {
            group.poke();
        }
        let thread = self.thread.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(thread) = thread
            && thread.join().is_err()
        {
            log::error!("job '{}': its thread panicked", self.spec.id);
        }
    }
}

#[cfg(test)]
mod tests;
