//! `driver=copy-on-read,file=NODE[,bottom=NODE]`: the bytes of its child,
//! and every read of a range the child's top image does not hold itself
//! first copies that range into it (QEMU's copy-on-read filter), so that
//! once the whole disk was read the top image no longer needs its backing
//! chain. With `bottom`, only what comes from the layers down to that node
//! (inclusive, as in QEMU) is copied.
//!
//! The copy is made before the read goes down, on the queue's own thread:
//! the whole clusters around the range are read through the chain and
//! handed to the child's [`BlockNode::populate`], which fills only what
//! the image still lacks; the read then finds them in the top image.
//! Writes pass through.

use std::cell::RefCell;
use std::io;
use std::sync::Arc;

use vsd_engine::{IoOp, IoQueue};
use vsd_qcow2::SyncIo;
use vsd_qcow2::buf::AlignedBuf;

use super::child::ChildQueue;
use super::{Filter, FilteredQueue, Route};
use crate::options::OptionMap;
use crate::{Allocation, BlockGraph, BlockNode, GraphError};

/// The most `populate` takes at once.
const MAX_RUN: u64 = 1 << 20;

pub(crate) struct CorNode {
    name: String,
    child: Arc<dyn BlockNode>,
    /// The allocation depth (as [`BlockNode::allocation_depth`] counts it)
    /// of the last layer copied from: `bottom`'s, if given.
    stop: Option<u32>,
}

impl CorNode {
    pub(crate) fn open(name: String, opts: &mut OptionMap, graph: &BlockGraph) -> Result<Self, GraphError> {
        let child = graph.child(opts, "file")?;
        let bottom = opts.take("bottom");
        let invalid = |reason: String| GraphError::Invalid { context: opts.context().into(), reason };
        let stop = bottom.map(|bottom| stop_at(&child, &bottom, graph)).transpose().map_err(invalid)?;
        if child.read_only() {
            return Err(invalid("Block node is read-only".into()));
        }
        Ok(Self { name, child, stop })
    }
}

/// The allocation depth of `bottom`, which must be an image in the
/// backing chain of `top`; QEMU's words, and vsd's where QEMU 10 hangs
/// (a node outside the chain).
fn stop_at(top: &Arc<dyn BlockNode>, bottom: &str, graph: &BlockGraph) -> Result<u32, String> {
    let node = graph.get(bottom).ok_or_else(|| format!("Bottom node '{bottom}' not found"))?;
    // A `bottom` is an image, never a filter.
    if super::FILTERS.contains(&node.driver()) {
        return Err(format!("Bottom node '{bottom}' is a filter"));
    }
    depth_of(top, bottom)
        .ok_or_else(|| format!("Bottom node '{bottom}' is not in the backing chain of '{}'", top.name()))
}

/// The allocation depth of node `name` below `top` (1: `top` itself),
/// through backing files (one layer deeper each) and the `file` child of
/// nodes without one (the same layer).
fn depth_of(top: &Arc<dyn BlockNode>, name: &str) -> Option<u32> {
    let (mut node, mut depth) = (top.clone(), 1);
    while node.name() != name {
        let children = node.children();
        let backing = children.iter().find(|(role, _)| *role == "backing");
        let next = backing.or_else(|| children.iter().find(|(role, _)| *role == "file"))?;
        depth += u32::from(backing.is_some());
        node = next.1.clone();
    }
    Some(depth)
}

/// What a queue of the filter needs to copy before a read.
struct Copier {
    child: Arc<dyn BlockNode>,
    stop: Option<u32>,
    /// A blocking channel to the child for the chain's bytes; the buffer
    /// they are read into.
    io: RefCell<(ChildQueue, AlignedBuf)>,
}

impl Copier {
    /// Whether bytes at allocation depth `depth` are copied: those from
    /// below the top image, down to `bottom` inclusive, as QEMU copies
    /// them; not those no layer holds (they read as zeroes without a
    /// backing file too).
    fn copies(&self, depth: u32) -> bool {
        depth >= 2 && self.stop.is_none_or(|stop| depth <= stop)
    }

    /// The whole-cluster runs around `offset..offset + len` that hold bytes
    /// to copy, none longer than `populate` takes.
    fn runs(&self, offset: u64, len: u64) -> io::Result<Vec<(u64, u64)>> {
        let (size, cluster) = (self.child.size(), self.child.cluster_size().unwrap_or(65536));
        let end = (offset + len).min(size);
        let mut spans: Vec<(u64, u64)> = Vec::new();
        let mut at = offset;
        while at < end {
            let (depth, n) = self.child.allocation_depth(at, end - at)?;
            let n = n.clamp(1, end - at);
            if self.copies(depth) {
                let (first, last) = (at / cluster * cluster, (at + n).next_multiple_of(cluster).min(size));
                match spans.last_mut() {
                    Some((_, until)) if *until >= first => *until = last,
                    _ => spans.push((first, last)),
                }
            }
            at += n;
        }
        let split = |(first, last): (u64, u64)| {
            (first..last).step_by(MAX_RUN as usize).map(move |at| (at, (last - at).min(MAX_RUN)))
        };
        Ok(spans.into_iter().flat_map(split).collect())
    }

    /// Copies what the top image lacks of `offset..offset + len` into it.
    fn copy(&self, offset: u64, len: u64) -> io::Result<()> {
        let runs = self.runs(offset, len)?;
        let mut io = self.io.borrow_mut();
        let (queue, buf) = &mut *io;
        for (at, run) in runs {
            let bytes = &mut buf[..run as usize];
            queue.read_at(bytes, at)?;
            self.child.populate(at, bytes)?;
        }
        Ok(())
    }
}

impl Filter for Copier {
    fn route(&self, op: IoOp) -> Route {
        let IoOp::Read { offset, len, .. } = op else { return Route::Forward(op) };
        match self.copy(offset, len) {
            Ok(()) => Route::Forward(op),
            Err(e) => {
                log::error!("copy-on-read: cannot copy {len} bytes at {offset:#x}: {e}");
                Route::Answer(e.raw_os_error().unwrap_or(libc::EIO))
            }
        }
    }
}

impl BlockNode for CorNode {
    fn name(&self) -> &str {
        &self.name
    }

    fn driver(&self) -> &'static str {
        "copy-on-read"
    }

    fn size(&self) -> u64 {
        self.child.size()
    }

    fn read_only(&self) -> bool {
        self.child.read_only()
    }

    fn children(&self) -> Vec<(&'static str, Arc<dyn BlockNode>)> {
        vec![("file", self.child.clone())]
    }

    fn claim(&self, claim: crate::Claim) -> Result<Vec<crate::ClaimGuard>, crate::LockError> {
        self.child.claim(claim)
    }

    fn resize(&self, size: u64) -> io::Result<()> {
        self.child.resize(size)
    }

    fn refresh_size(&self) -> io::Result<u64> {
        self.child.refresh_size()
    }

    fn block_status(&self, offset: u64, len: u64) -> io::Result<(Allocation, u64)> {
        self.child.block_status(offset, len)
    }

    fn allocation_depth(&self, offset: u64, len: u64) -> io::Result<(u32, u64)> {
        self.child.allocation_depth(offset, len)
    }

    fn open_queue(&self, depth: u16) -> io::Result<Box<dyn IoQueue>> {
        let io = (ChildQueue::open(&*self.child, 1, u64::MAX)?, AlignedBuf::zeroed(MAX_RUN as usize));
        let copier = Copier { child: self.child.clone(), stop: self.stop, io: RefCell::new(io) };
        Ok(Box::new(FilteredQueue::new(self.child.open_queue(depth)?, copier, depth)))
    }
}
