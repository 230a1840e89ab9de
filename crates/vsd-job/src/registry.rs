//! Every job of the daemon, by id.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::{Emit, Job, JobBody, JobSpec, Status};

/// The daemon's jobs: ids unique, each node used by one live job at most,
/// but for the source of several backups.
pub struct Jobs {
    emit: Emit,
    /// Newest first, as QEMU lists them; dismissed jobs are pruned.
    list: Mutex<Vec<Arc<Job>>>,
    /// The daemon stops: no new job, their nodes are about to close.
    closed: AtomicBool,
}

impl Jobs {
    /// No job yet; jobs send their events through `emit`.
    pub fn new(emit: Emit) -> Self {
        Self { emit, list: Mutex::new(Vec::new()), closed: AtomicBool::new(false) }
    }

    fn list(&self) -> MutexGuard<'_, Vec<Arc<Job>>> {
        let mut list = self.list.lock().unwrap_or_else(PoisonError::into_inner);
        list.retain(|job| job.status() != Status::Null);
        list
    }

    /// Every job not yet dismissed, newest first.
    pub fn all(&self) -> Vec<Arc<Job>> {
        self.list().clone()
    }

    /// The job called `id`.
    pub fn get(&self, id: &str) -> Option<Arc<Job>> {
        self.list().iter().find(|job| job.id() == id).cloned()
    }

    /// The job using `node`, if any (until it is dismissed), and the
    /// node's place in its [`JobSpec::nodes`].
    pub fn user_of(&self, node: &str) -> Option<(Arc<Job>, usize)> {
        self.users_of(node).into_iter().next()
    }

    /// Every job using `node` (several backups may share their source),
    /// each with the node's place in its [`JobSpec::nodes`].
    pub fn users_of(&self, node: &str) -> Vec<(Arc<Job>, usize)> {
        let place = |job: &Arc<Job>| job.nodes().iter().position(|n| n == node);
        self.list().iter().filter_map(|job| Some((job.clone(), place(job)?))).collect()
    }

    /// Starts `body` as a job, unless its id is taken (QEMU's words).
    pub fn start(&self, spec: JobSpec, mut body: Box<dyn JobBody>) -> Result<Arc<Job>, String> {
        let mut list = self.list();
        if self.closed.load(Ordering::SeqCst) {
            return Err("The daemon is shutting down".into());
        }
        if list.iter().any(|job| job.id() == spec.id) {
            return Err(format!("Job ID '{}' already in use", spec.id));
        }
        let job = Job::new(spec, self.emit.clone(), body.copy_mode());
        if let Err(e) = body.prepare(&job) {
            job.announce(Status::Null);
            return Err(e);
        }
        job.start();
        let runner = job.clone();
        let thread = std::thread::Builder::new()
            .name(format!("job {}", job.id()))
            .spawn(move || runner.main(body))
            .map_err(|e| {
                job.announce(Status::Null);
                format!("Cannot start job '{}': {e}", job.id())
            })?;
        *job.thread.lock().unwrap_or_else(PoisonError::into_inner) = Some(thread);
        if let Some(group) = &job.spec.group {
            group.join(job.clone());
        }
        list.insert(0, job.clone());
        Ok(job)
    }

    /// Cancels every job and waits for their threads (the daemon stops).
    pub fn shutdown(&self) {
        // Under the lock: a job starting meanwhile is in the list or refused.
        let jobs = {
            let list = self.list();
            self.closed.store(true, Ordering::SeqCst);
            list.clone()
        };
        for job in &jobs {
            job.end();
        }
    }
}
