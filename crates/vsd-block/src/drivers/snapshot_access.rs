//! `driver=snapshot-access,file=NODE`: the point-in-time image a
//! copy-before-write node `NODE` keeps, read-only (QEMU's fleecing
//! export). Over any other node, reads fail (ENOTSUP), as in QEMU; a
//! discard drops the clusters it covers from the snapshot.
//!
//! Requests are served on the caller's thread, through blocking queues
//! of its own on the filter's `file` and `target`.

use std::cell::RefCell;
use std::io;
use std::sync::Arc;

use vsd_engine::{IoOp, IoQueue};

use super::copy_before_write::{Readers, Snapshot};
use super::{Filter, FilteredQueue, Route, out_of_bounds};
use crate::options::OptionMap;
use crate::{Allocation, BlockGraph, BlockNode, GraphError};

pub(crate) struct SnapshotAccessNode {
    name: String,
    child: Arc<dyn BlockNode>,
    snapshot: Option<Arc<Snapshot>>,
}

impl SnapshotAccessNode {
    pub(crate) fn open(name: String, opts: &mut OptionMap, graph: &BlockGraph) -> Result<Self, GraphError> {
        let child = graph.child(opts, "file")?;
        let snapshot = if child.driver() == "copy-before-write" { Snapshot::of(&*child) } else { None };
        Ok(Self { name, child, snapshot })
    }
}

/// Answers every request from the snapshot.
struct SnapshotFilter {
    snapshot: Arc<Snapshot>,
    readers: RefCell<Readers>,
}

impl Filter for SnapshotFilter {
    fn route(&self, op: IoOp) -> Route {
        if out_of_bounds(&op, self.snapshot.size()) {
            return Route::Answer(libc::EIO);
        }
        let readers = &mut *self.readers.borrow_mut();
        let outcome = match op {
            IoOp::Read { offset, len, iov } => {
                let mut buf = vec![0; len as usize];
                self.snapshot.read(readers, &mut buf, offset).map(|()| {
                    // SAFETY: the owner's guarantee for the request's
                    // buffers, which it does not touch until completion.
                    unsafe { iov.fill(0, len, Some(&buf)) }
                })
            }
            IoOp::Discard { offset, len } => self.snapshot.discard(readers, offset, len),
            IoOp::Flush => Ok(()),
            IoOp::Write { .. } | IoOp::WriteCompressed { .. } | IoOp::WriteZeroes { .. } => Err(libc::ENOTSUP),
        };
        Route::Answer(outcome.err().unwrap_or(0))
    }
}

/// Over a node that keeps no snapshot: nothing to read.
struct Unsupported;

impl Filter for Unsupported {
    fn route(&self, op: IoOp) -> Route {
        Route::Answer(if matches!(op, IoOp::Flush) { 0 } else { libc::ENOTSUP })
    }
}

impl BlockNode for SnapshotAccessNode {
    fn name(&self) -> &str {
        &self.name
    }

    fn driver(&self) -> &'static str {
        "snapshot-access"
    }

    fn size(&self) -> u64 {
        self.child.size()
    }

    fn read_only(&self) -> bool {
        false
    }

    fn children(&self) -> Vec<(&'static str, Arc<dyn BlockNode>)> {
        vec![("file", self.child.clone())]
    }

    fn block_status(&self, offset: u64, len: u64) -> io::Result<(Allocation, u64)> {
        match &self.snapshot {
            Some(snapshot) => snapshot.block_status(offset, len),
            None => Err(io::Error::from_raw_os_error(libc::ENOTSUP)),
        }
    }

    fn open_queue(&self, depth: u16) -> io::Result<Box<dyn IoQueue>> {
        // Never sent a request: it gives the queue a descriptor to wait on.
        let inner = self.child.open_queue(depth)?;
        Ok(match &self.snapshot {
            Some(snapshot) => {
                let readers = RefCell::new(snapshot.readers()?);
                Box::new(FilteredQueue::new(inner, SnapshotFilter { snapshot: snapshot.clone(), readers }, depth))
            }
            None => Box::new(FilteredQueue::new(inner, Unsupported, depth)),
        })
    }
}
