//! `driver=raw`: the bytes of its child, optionally a window of them
//! (`offset=`, `size=`).

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use vsd_engine::{IoOp, IoQueue};

use super::{Filter, FilteredQueue, Route, out_of_bounds, shifted};
use crate::common::{DISCARD, without_unmap};
use crate::options::OptionMap;
use crate::{Allocation, BlockGraph, BlockNode, GraphError};

pub(crate) struct RawNode {
    name: String,
    child: Arc<dyn BlockNode>,
    window: Window,
    /// `size=` was given: the window is fixed and cannot be resized.
    fixed_size: bool,
    /// `read-only=on`, or changed by [`BlockNode::set_read_only`]; the
    /// node is read-only too while its child is.
    read_only: AtomicBool,
}

/// The part of the child the node shows. The size is shared with every
/// queue's copy so that a resize reaches them all.
#[derive(Clone)]
struct Window {
    offset: u64,
    size: Arc<AtomicU64>,
    /// `discard=unmap`: without it, discards are answered at once and
    /// write-zeroes never deallocate, as QEMU's nodes.
    acts_on_discards: bool,
}

impl RawNode {
    pub(crate) fn open(name: String, opts: &mut OptionMap, graph: &BlockGraph) -> Result<Self, GraphError> {
        let context = opts.context().to_string();
        let child = graph.child(opts, "file")?;
        let offset = opts.take_size("offset")?.unwrap_or(0);
        let room = child.size().checked_sub(offset).ok_or_else(|| GraphError::Invalid {
            context: context.clone(),
            reason: format!("offset {offset} is past the end of '{}' ({} bytes)", child.name(), child.size()),
        })?;
        let fixed = opts.take_size("size")?;
        let size = fixed.unwrap_or(room);
        if size > room {
            return Err(GraphError::Invalid {
                context,
                reason: format!("offset {offset} + size {size} exceed '{}' ({} bytes)", child.name(), child.size()),
            });
        }
        let read_only = opts.take_bool("read-only")?.unwrap_or(false) || child.read_only();
        let acts_on_discards = matches!(opts.take_choice("discard", DISCARD)?, Some("unmap" | "on"));
        let window = Window { offset, size: Arc::new(AtomicU64::new(size)), acts_on_discards };
        Ok(Self { name, child, window, fixed_size: fixed.is_some(), read_only: AtomicBool::new(read_only) })
    }
}

impl Filter for Window {
    fn route(&self, op: IoOp) -> Route {
        if out_of_bounds(&op, self.size.load(Ordering::Relaxed)) {
            return Route::Answer(libc::EIO);
        }
        let route = if self.acts_on_discards { Route::Forward(op) } else { without_unmap(op) };
        match route {
            Route::Forward(op) => Route::Forward(shifted(op, self.offset)),
            answered => answered,
        }
    }
}

impl BlockNode for RawNode {
    fn name(&self) -> &str {
        &self.name
    }

    fn driver(&self) -> &'static str {
        "raw"
    }

    fn size(&self) -> u64 {
        self.window.size.load(Ordering::Relaxed)
    }

    fn claim(&self, claim: crate::Claim) -> Result<Vec<crate::ClaimGuard>, crate::LockError> {
        self.child.claim(claim)
    }

    fn children(&self) -> Vec<(&'static str, Arc<dyn BlockNode>)> {
        vec![("file", self.child.clone())]
    }

    fn resize(&self, size: u64) -> io::Result<()> {
        if self.fixed_size {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "the node has a fixed size= window"));
        }
        let end = self.window.offset.checked_add(size).ok_or(io::ErrorKind::InvalidInput)?;
        self.child.resize(end)?;
        self.window.size.store(size, Ordering::Relaxed);
        Ok(())
    }

    fn read_only(&self) -> bool {
        self.read_only.load(Ordering::Acquire) || self.child.read_only()
    }

    /// Only the node's own flag: its child is the caller's to reopen (first,
    /// to make the node writable).
    fn set_read_only(&self, read_only: bool) -> io::Result<()> {
        self.read_only.store(read_only, Ordering::Release);
        Ok(())
    }

    /// The child's, shifted by the window, for ranges inside it.
    fn host_file(&self, offset: u64, len: u64) -> Option<(Arc<std::fs::File>, u64)> {
        if offset.checked_add(len)? > self.size() {
            return None;
        }
        self.child.host_file(offset.checked_add(self.window.offset)?, len)
    }

    fn block_status(&self, offset: u64, len: u64) -> io::Result<(Allocation, u64)> {
        self.child.block_status(offset + self.window.offset, len)
    }

    fn allocation_depth(&self, offset: u64, len: u64) -> io::Result<(u32, u64)> {
        self.child.allocation_depth(offset + self.window.offset, len)
    }

    fn open_queue(&self, depth: u16) -> io::Result<Box<dyn IoQueue>> {
        Ok(Box::new(FilteredQueue::new(self.child.open_queue(depth)?, self.window.clone(), depth)))
    }
}
