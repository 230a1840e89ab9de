//! Jobs started by one `transaction` with `completion-mode=grouped`
//! (QEMU's job transactions): they succeed together or fail together.
//!
//! A member whose work is done waits for the others. Once every member's
//! work is done, all become pending at once, then conclude one after
//! another, newest first, as QEMU orders them. If one fails or is
//! cancelled, the others are cancelled, those already waiting included.
//!
//! Locks: a member's state may be locked while the group's is held, never
//! the other way round.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use crate::Job;

/// The members of one grouped transaction.
#[derive(Default)]
pub struct Group {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// Newest first (QEMU's order).
    members: Vec<Arc<Job>>,
    /// Members whose work is done, waiting for the others.
    waiting: usize,
    /// Every member has joined: the transaction is over.
    sealed: bool,
    phase: Phase,
}

#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum Phase {
    #[default]
    Working,
    /// All done: members conclude in turn, from `members[0]`.
    Concluding(usize),
    Failed,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Group({} members)", self.lock().members.len())
    }
}

impl Group {
    /// A group with no member yet.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Each field is valid on its own: a panic elsewhere leaves no half-change.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `job` is a member (it has started).
    pub(crate) fn join(&self, job: Arc<Job>) {
        self.lock().members.insert(0, job);
    }

    /// Every member has joined; if all are done already, they conclude.
    pub fn seal(&self) {
        let mut state = self.lock();
        state.sealed = true;
        self.conclude_if_done(&mut state);
    }

    fn conclude_if_done(&self, state: &mut State) {
        if state.phase == Phase::Working && state.sealed && state.waiting == state.members.len() {
            state.members.iter().for_each(|job| job.become_pending());
            state.phase = Phase::Concluding(0);
            self.changed.notify_all();
        }
    }

    /// `job`'s work is done: waits for the others. True once the group
    /// succeeded and it is `job`'s turn to conclude; false if the group
    /// failed (or `job` was cancelled meanwhile, which fails it).
    pub(crate) fn wait_for_others(&self, job: &Job) -> bool {
        let mut state = self.lock();
        state.waiting += 1;
        self.conclude_if_done(&mut state);
        loop {
            match state.phase {
                Phase::Failed => return false,
                Phase::Concluding(turn) if state.members.get(turn).is_some_and(|m| std::ptr::eq(&**m, job)) => {
                    return true;
                }
                Phase::Working if job.cancelled() => {
                    self.fail_locked(&mut state, job);
                    return false;
                }
                _ => state = self.changed.wait(state).unwrap_or_else(PoisonError::into_inner),
            }
        }
    }

    /// `job` failed or was cancelled: every other member is cancelled.
    pub(crate) fn fail(&self, job: &Job) {
        let mut state = self.lock();
        self.fail_locked(&mut state, job);
    }

    fn fail_locked(&self, state: &mut State, job: &Job) {
        if state.phase == Phase::Failed {
            return;
        }
        state.phase = Phase::Failed;
        for member in state.members.iter().filter(|m| !std::ptr::eq(&***m, job)) {
            member.force_cancel();
        }
        self.changed.notify_all();
    }

    /// A member has concluded: the next one's turn.
    pub(crate) fn concluded(&self) {
        let mut state = self.lock();
        if let Phase::Concluding(turn) = state.phase {
            state.phase = Phase::Concluding(turn + 1);
            self.changed.notify_all();
        }
    }

    /// `job-finalize` of one member finalizes them all, as in QEMU.
    pub(crate) fn finalize_all(&self) {
        self.lock().members.iter().for_each(|job| job.finalize_for_group());
    }

    /// Wakes the members waiting: one of them changed (a verb).
    pub(crate) fn poke(&self) {
        let _state = self.lock();
        self.changed.notify_all();
    }
}
