//! The commit job of an image inside a chain (`block-commit` with a `top`
//! below the active layer): what the chain holds from `top` down to just
//! above `base` is copied into `base`, then the image above `top` names
//! `base` as its backing file; `top` and the images between are no longer
//! used. (An active layer's commit is a mirror into the base:
//! [`crate::mirror`].)
//!
//! Nobody writes `top` or the images below it: they are backing files.
//! The job alone writes `base`, and only where the chain above it holds
//! data, which readers take from above: nothing races with it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use vsd_block::BlockNode;

use crate::copy::{Copier, Extents, Failure, MAX_COPY, Pace, extents_above, turn};
use crate::mirror::Writers;
use crate::{ErrorPolicy, Job, JobBody, strerror};

/// How long a run that failed under the `ignore` or `stop` policy waits
/// before it is tried again.
const RETRY_DELAY: Duration = Duration::from_millis(100);

/// How a commit is made.
pub struct CommitSpec {
    /// The highest image committed.
    pub top: Arc<dyn BlockNode>,
    /// The image written, `base_depth` layers below `top` (`top` is 1).
    pub base: Arc<dyn BlockNode>,
    /// How deep `base` lies below `top`.
    pub base_depth: u32,
    /// The image whose backing file `top` is: it names `base` at the end.
    pub overlay: Arc<dyn BlockNode>,
    /// The backing file name and format `overlay`'s header names then.
    pub header: (String, String),
    /// The writers of the chain's active layer: their queues restart on
    /// the shorter chain.
    pub writers: Arc<dyn Writers>,
    /// Makes `overlay` writable for the header's change and read-only
    /// again (it is a backing file itself unless it is the active layer).
    pub overlay_writable: Arc<dyn Fn(bool) -> Result<(), String> + Send + Sync>,
    /// On a read error of the chain or a write error of `base`.
    pub on_error: ErrorPolicy,
}

/// The commit job's body.
pub struct Commit {
    spec: CommitSpec,
}

impl Commit {
    /// A commit as `spec` says.
    pub fn new(spec: CommitSpec) -> Self {
        Self { spec }
    }

    /// Copies run `offset..offset + len` under the error policy; `Ok(false)`:
    /// it is to be tried again.
    fn copy(&self, job: &Job, copier: &mut Copier, offset: u64, len: u64) -> Result<bool, String> {
        match copier.copy(offset, len) {
            Ok(()) => Ok(true),
            Err(Failure::Io { write, errno }) => {
                if job.io_error(self.spec.on_error, write, errno) {
                    Ok(false)
                } else {
                    Err(strerror(errno))
                }
            }
            Err(Failure::Engine(text)) => Err(text),
        }
    }

    /// The overlay names the base, with the active layer's writers stopped.
    fn relink(&self) -> Result<(), String> {
        let spec = &self.spec;
        let (base, header) = (spec.base.clone(), spec.header.clone());
        let mut relink = || {
            let made_writable = spec.overlay.read_only();
            if made_writable {
                (spec.overlay_writable)(true)?;
            }
            let result = spec.overlay.set_backing(Some(base.clone()), Some(header.clone())).map_err(|e| e.to_string());
            if made_writable {
                (spec.overlay_writable)(false)?;
            }
            result
        };
        spec.writers.stopped(None, &mut relink)
    }
}

impl JobBody for Commit {
    fn prepare(&mut self, job: &Arc<Job>) -> Result<(), String> {
        job.set_total(self.spec.top.size());
        Ok(())
    }

    fn run(&mut self, job: &Arc<Job>) -> Result<(), String> {
        let spec = &self.spec;
        let size = spec.top.size();
        let extents = extents_above(&*spec.top, spec.base_depth)
            .map_err(|e| format!("Cannot read the allocation of node '{}': {e}", spec.top.name()))?;
        let mut copier = Copier::open(&spec.top, &spec.base, Extents::Stable)?;
        let mut pace = Pace::new();
        // Chunk by chunk over the whole image, as QEMU counts progress;
        // `first` is the first extent not over before the chunk.
        let mut first = 0;
        for chunk in (0..size).step_by(MAX_COPY as usize) {
            let end = (chunk + MAX_COPY).min(size);
            while extents.get(first).is_some_and(|&(at, len)| at + len <= chunk) {
                first += 1;
            }
            let inside = extents[first..].iter().take_while(|&&(at, _)| at < end);
            let pieces: Vec<(u64, u64)> = inside.map(|&(at, len)| (at.max(chunk), (at + len).min(end))).collect();
            for (from, to) in pieces {
                loop {
                    if !turn(job, &pace)? {
                        continue;
                    }
                    if self.copy(job, &mut copier, from, to - from)? {
                        break;
                    }
                    job.wait(Some(Instant::now() + RETRY_DELAY));
                }
                pace.copied(to - from);
            }
            job.add_progress(end - chunk);
        }
        copier.flush().map_err(|f| f.report(job))?;
        self.relink()
    }
}
