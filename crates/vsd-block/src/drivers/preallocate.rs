//! `driver=preallocate,file=NODE[,prealloc-align=SIZE][,prealloc-size=SIZE]`:
//! the bytes of its child, whose file is grown ahead of the writes that
//! extend it, as QEMU's preallocate filter grows it: a write past the end
//! of what the host file holds first has the host allocate from there to
//! `prealloc-size` bytes past the write's end, rounded up to
//! `prealloc-align`, so that a format growing its image (qcow2 on the
//! filter) finds the room allocated, in few large extents.
//!
//! The node's size is where the data ends, not the file: the format above
//! sees the file it wrote. The file is cut back to that end when the node
//! is closed or handed over. The filter keeps its ends only while it is
//! the file's only writer (a writable node takes write and resize
//! permissions unshared); read-only, it only passes requests through.

use std::cell::RefCell;
use std::io;
use std::sync::{Arc, Mutex, PoisonError};

use vsd_engine::{IoOp, IoQueue};

use super::child::ChildQueue;
use super::{Filter, FilteredQueue, Route};
use crate::lock::{Claim, ClaimGuard, LockError, Perms};
use crate::options::OptionMap;
use crate::{Allocation, BlockGraph, BlockNode, GraphError};

const MIB: u64 = 1 << 20;

pub(crate) struct PreallocateNode {
    name: String,
    child: Arc<dyn BlockNode>,
    steps: Steps,
    /// `None` while the node is read-only, inactive, or closed.
    ends: Arc<Mutex<Option<Ends>>>,
}

/// How far ahead the file is allocated, and to what multiple.
#[derive(Clone, Copy)]
struct Steps {
    size: u64,
    align: u64,
}

/// Where the data ends, and where the file the host allocated does.
#[derive(Clone, Copy)]
struct Ends {
    data: u64,
    file: u64,
}

impl PreallocateNode {
    pub(crate) fn open(name: String, opts: &mut OptionMap, graph: &BlockGraph) -> Result<Self, GraphError> {
        let child = graph.child(opts, "file")?;
        let align = opts.take_u64("prealloc-align")?.unwrap_or(MIB);
        let size = opts.take_u64("prealloc-size")?.unwrap_or(128 * MIB);
        let invalid = |reason: String| Err(GraphError::Invalid { context: opts.context().into(), reason });
        if !align.is_multiple_of(512) {
            return invalid("prealloc-align parameter of preallocate filter is not aligned to 512".into());
        }
        let file_align = u64::from(child.request_alignment());
        if !align.is_multiple_of(file_align) {
            return invalid(format!(
                "prealloc-align parameter of preallocate filter is not aligned to underlying node request alignment ({file_align})"
            ));
        }
        let node = Self { name, child, steps: Steps { size, align: align.max(file_align) }, ends: Arc::default() };
        node.track().map_err(|e| GraphError::Invalid { context: opts.context().into(), reason: e.to_string() })?;
        Ok(node)
    }

    fn ends(&self) -> std::sync::MutexGuard<'_, Option<Ends>> {
        self.ends.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts keeping the ends, from the file's size now, if the node is
    /// writable and active.
    fn track(&self) -> io::Result<()> {
        let mut ends = self.ends();
        if ends.is_none() && !self.child.read_only() && self.child.active() {
            let size = self.child.refresh_size()?;
            *ends = Some(Ends { data: size, file: size });
        }
        Ok(())
    }

    /// Cuts the file back to where the data ends and stops keeping the
    /// ends: the node is closed or handed over.
    fn drop_preallocation(&self) -> io::Result<()> {
        let Some(ends) = self.ends().take() else { return Ok(()) };
        if ends.file > ends.data {
            self.child.resize(ends.data)?;
        }
        // The child's size is read from the host from now on.
        self.child.refresh_size().map(drop)
    }
}

impl BlockNode for PreallocateNode {
    fn name(&self) -> &str {
        &self.name
    }

    fn driver(&self) -> &'static str {
        "preallocate"
    }

    fn size(&self) -> u64 {
        self.ends().map_or_else(|| self.child.size(), |ends| ends.data)
    }

    fn refresh_size(&self) -> io::Result<u64> {
        match *self.ends() {
            Some(ends) => Ok(ends.data),
            None => self.child.refresh_size(),
        }
    }

    fn read_only(&self) -> bool {
        self.child.read_only()
    }

    fn children(&self) -> Vec<(&'static str, Arc<dyn BlockNode>)> {
        vec![("file", self.child.clone())]
    }

    /// A user that writes and resizes the file shares neither: the ends
    /// the filter keeps would go stale.
    fn claim(&self, claim: Claim) -> Result<Vec<ClaimGuard>, LockError> {
        let grows = Perms::WRITE.with(Perms::RESIZE);
        let unshared = if claim.held.contains(grows) { claim.unshared.with(grows) } else { claim.unshared };
        self.child.claim(Claim { unshared, ..claim })
    }

    /// The preallocation goes first, then the file takes the new size.
    fn resize(&self, size: u64) -> io::Result<()> {
        let mut ends = self.ends();
        self.child.resize(size)?;
        if let Some(ends) = ends.as_mut() {
            *ends = Ends { data: size, file: size };
        }
        Ok(())
    }

    fn close(&self) -> io::Result<()> {
        self.drop_preallocation()
    }

    fn inactivate(&self) -> io::Result<()> {
        self.drop_preallocation()
    }

    fn activate(&self) -> io::Result<()> {
        self.track()
    }

    fn block_status(&self, offset: u64, len: u64) -> io::Result<(Allocation, u64)> {
        self.child.block_status(offset, len)
    }

    fn allocation_depth(&self, offset: u64, len: u64) -> io::Result<(u32, u64)> {
        self.child.allocation_depth(offset, len)
    }

    fn open_queue(&self, depth: u16) -> io::Result<Box<dyn IoQueue>> {
        let grower = Grower {
            steps: self.steps,
            ends: self.ends.clone(),
            io: RefCell::new(ChildQueue::open(&*self.child, 1, u64::MAX)?),
        };
        Ok(Box::new(FilteredQueue::new(self.child.open_queue(depth)?, grower, depth)))
    }
}

/// A queue's part: allocates ahead of the writes that extend the file.
struct Grower {
    steps: Steps,
    ends: Arc<Mutex<Option<Ends>>>,
    /// A blocking channel to the child, for the allocations.
    io: RefCell<ChildQueue>,
}

impl Grower {
    /// Notes a write ending at `end`, and allocates ahead of it if it goes
    /// past the file. Done before the write is sent, under the lock, so
    /// that no write in flight lies in the range allocated. An allocation
    /// that fails is only logged: the write grows the file itself.
    fn extend(&self, end: u64) {
        let mut ends = self.ends.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(ends) = ends.as_mut() else { return };
        if end <= ends.data {
            return;
        }
        ends.data = end;
        if end <= ends.file {
            return;
        }
        let start = ends.file;
        let until = end.saturating_add(self.steps.size).checked_next_multiple_of(self.steps.align).unwrap_or(u64::MAX);
        match self.io.borrow_mut().allocate_zeroes(start, until - start) {
            Ok(()) => ends.file = until,
            Err(e) => {
                log::debug!("preallocate: cannot allocate {start:#x}..{until:#x}: {e}");
                ends.file = end;
            }
        }
    }
}

impl Filter for Grower {
    fn route(&self, op: IoOp) -> Route {
        if let IoOp::Write { .. } | IoOp::WriteCompressed { .. } | IoOp::WriteZeroes { .. } = op
            && let Some((offset, len)) = op.extent()
        {
            self.extend(offset + len);
        }
        Route::Forward(op)
    }
}
