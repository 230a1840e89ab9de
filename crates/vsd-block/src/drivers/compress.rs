//! `driver=compress,file=NODE`: the bytes of its child, every write stored
//! compressed ([`IoOp::WriteCompressed`]), as QEMU's compress filter does.
//! Only a child that stores compressed clusters (qcow2) is taken.
//!
//! Compressed writes cover whole clusters: the filter's request alignment
//! is the child's cluster size, which exports advertise (an NBD client
//! pads its writes to it, as QEMU's does). A write that is not aligned
//! fails with EINVAL, the child's answer. A durable write (FUA) is
//! followed by a flush, completed once that is.

use std::collections::HashSet;
use std::io;
use std::sync::Arc;

use vsd_engine::{Completion, IoOp, IoQueue};

use crate::options::OptionMap;
use crate::{Allocation, BlockGraph, BlockNode, GraphError};

pub(crate) struct CompressNode {
    name: String,
    child: Arc<dyn BlockNode>,
}

impl CompressNode {
    pub(crate) fn open(name: String, opts: &mut OptionMap, graph: &BlockGraph) -> Result<Self, GraphError> {
        let child = graph.child(opts, "file")?;
        if !child.supports_compressed_writes() {
            let reason = format!("Compression is not supported for underlying format: {}", child.driver());
            return Err(GraphError::Invalid { context: opts.context().into(), reason });
        }
        Ok(Self { name, child })
    }
}

impl BlockNode for CompressNode {
    fn name(&self) -> &str {
        &self.name
    }

    fn driver(&self) -> &'static str {
        "compress"
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

    /// Whole clusters, as the child stores compressed data.
    fn request_alignment(&self) -> u32 {
        let cluster = self.child.cluster_size().unwrap_or(1);
        u32::try_from(cluster).unwrap_or(u32::MAX).max(self.child.request_alignment())
    }

    fn cluster_size(&self) -> Option<u64> {
        self.child.cluster_size()
    }

    fn supports_compressed_writes(&self) -> bool {
        true
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
        let inner = self.child.open_queue(depth)?;
        Ok(Box::new(CompressQueue { inner, durable: HashSet::with_capacity(usize::from(depth)) }))
    }
}

/// Turns writes into compressed writes, and durable ones into a
/// compressed write and then a flush under the same tag.
struct CompressQueue {
    inner: Box<dyn IoQueue>,
    /// Tags of durable writes whose compressed write is in flight.
    durable: HashSet<u32>,
}

impl IoQueue for CompressQueue {
    unsafe fn push(&mut self, tag: u32, op: IoOp) {
        let op = match op {
            IoOp::Write { offset, len, iov, durable } => {
                if durable {
                    self.durable.insert(tag);
                }
                IoOp::WriteCompressed { offset, len, iov }
            }
            op => op,
        };
        // SAFETY: the caller's guarantee for `op` covers the rewritten
        // request, which names the same buffers.
        unsafe { self.inner.push(tag, op) }
    }

    /// Completions of durable writes' compressed writes are held back,
    /// their flushes sent instead.
    fn reap(&mut self, out: &mut Vec<Completion>) {
        let before = out.len();
        self.inner.reap(out);
        let mut flushes = false;
        let mut at = before;
        while at < out.len() {
            let Completion { tag, errno } = out[at];
            if !self.durable.remove(&tag) || errno != 0 {
                at += 1;
                continue;
            }
            out.swap_remove(at);
            // SAFETY: a flush names no buffer.
            unsafe { self.inner.push(tag, IoOp::Flush) };
            flushes = true;
        }
        if flushes && let Err(e) = self.inner.submit() {
            log::error!("compress: cannot submit the flushes of durable writes: {e}");
        }
    }

    vsd_engine::forward_to_inner!(inner: submit, wait, notify_fd, rearm, max_batch, held, kernel_entries);
}
