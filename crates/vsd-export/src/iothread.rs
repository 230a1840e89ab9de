//! I/O threads shared by exports (`--object iothread`, QEMU's spelling):
//! one thread serves the queues of every export started with its
//! `iothread=`, a round of each per wake-up, so that many exports cost
//! one thread rather than one per queue.

use std::io;
use std::sync::Arc;

use crate::poll::PollConfig;
use crate::worker::ThreadHandle;

/// A running I/O thread; it ends when the last export using it has gone
/// and it is dropped.
pub struct IoThread {
    id: String,
    pub(crate) thread: Arc<ThreadHandle>,
    pub(crate) poll: PollConfig,
}

impl IoThread {
    /// Starts I/O thread `id`, polling as `poll` says, pinned to `cpus`
    /// unless empty.
    pub fn start(id: &str, poll: PollConfig, cpus: Vec<usize>) -> io::Result<Self> {
        let allowed = vsd_sys::allowed_cpus()?;
        if let Some(cpu) = cpus.iter().find(|cpu| !allowed.contains(cpu)) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("cpu-affinity: CPU {cpu} is not available to vsd (it may use {allowed:?})"),
            ));
        }
        // Linux keeps 15 bytes of a thread's name.
        let thread = ThreadHandle::spawn(format!("vsd-io-{id}"), cpus)?;
        Ok(Self { id: id.to_string(), thread: Arc::new(thread), poll })
    }

    /// Its id.
    pub fn id(&self) -> &str {
        &self.id
    }
}

impl Drop for IoThread {
    fn drop(&mut self) {
        self.thread.exit();
    }
}
