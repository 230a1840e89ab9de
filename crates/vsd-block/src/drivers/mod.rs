//! The drivers a `--blockdev` can name.

mod blkdebug;
mod child;
mod compress;
mod copy_before_write;
mod copy_on_read;
mod file;
mod http;
mod nbd;
mod null;
mod preallocate;
mod qcow2;
mod raw;
mod rbd;
mod snapshot_access;
mod throttle;

use std::io;
use std::sync::Arc;

use vsd_engine::{Completion, IoOp, IoQueue};

use crate::dirty::DirtyBitmaps;
use crate::options::OptionMap;
use crate::{BlockGraph, BlockNode, Cache, GraphError};

/// Every driver a `--blockdev` can name, as QEMU names them.
pub const DRIVERS: &[&str] = &[
    "file",
    "host_device",
    "raw",
    "qcow2",
    "rbd",
    "nbd",
    "null-co",
    "null-aio",
    "blkdebug",
    "throttle",
    "copy-before-write",
    "snapshot-access",
    "copy-on-read",
    "compress",
    "preallocate",
    "http",
    "https",
];

/// The drivers QEMU counts as filters: each passes its `file` child's
/// bytes on (changed, delayed or copied), and is never a layer of an image
/// of its own.
pub const FILTERS: &[&str] = &["throttle", "blkdebug", "copy-on-read", "compress", "preallocate", "copy-before-write"];

/// Opens a `driver` node; `active` is false for a node opened inactive
/// (`active=off`), which must write nothing to its image; `bitmaps` are the
/// graph node's, which a format may keep in its image.
pub(crate) fn open(
    driver: &str,
    name: String,
    cache: Cache,
    active: bool,
    bitmaps: &Arc<DirtyBitmaps>,
    opts: &mut OptionMap,
    graph: &BlockGraph,
) -> Result<Arc<dyn BlockNode>, GraphError> {
    match driver {
        "file" => Ok(Arc::new(file::FileNode::open(name, cache, active, false, opts)?)),
        "host_device" => Ok(Arc::new(file::FileNode::open(name, cache, active, true, opts)?)),
        "raw" => Ok(Arc::new(raw::RawNode::open(name, opts, graph)?)),
        "qcow2" => Ok(Arc::new(qcow2::Qcow2Node::open(name, cache, active, bitmaps, opts, graph)?)),
        "nbd" => Ok(Arc::new(nbd::NbdNode::open(name, opts, graph)?)),
        "null-co" => Ok(Arc::new(null::NullNode::open(name, "null-co", opts)?)),
        // QEMU's two null drivers differ only in how QEMU completes requests.
        "null-aio" => Ok(Arc::new(null::NullNode::open(name, "null-aio", opts)?)),
        "blkdebug" => Ok(Arc::new(blkdebug::BlkdebugNode::open(name, opts, graph)?)),
        "rbd" => Ok(Arc::new(rbd::RbdNode::open(name, cache, opts, graph)?)),
        "throttle" => Ok(Arc::new(throttle::ThrottleNode::open(name, opts, graph)?)),
        "copy-before-write" => Ok(Arc::new(copy_before_write::CbwNode::open(name, opts, graph)?)),
        "snapshot-access" => Ok(Arc::new(snapshot_access::SnapshotAccessNode::open(name, opts, graph)?)),
        "copy-on-read" => Ok(Arc::new(copy_on_read::CorNode::open(name, opts, graph)?)),
        "compress" => Ok(Arc::new(compress::CompressNode::open(name, opts, graph)?)),
        "preallocate" => Ok(Arc::new(preallocate::PreallocateNode::open(name, opts, graph)?)),
        "http" => Ok(Arc::new(http::HttpNode::open(name, "http", opts, graph)?)),
        "https" => Ok(Arc::new(http::HttpNode::open(name, "https", opts, graph)?)),
        _ => Err(GraphError::UnknownDriver { context: opts.context().into(), driver: driver.into() }),
    }
}

pub(crate) use qcow2::probe as probe_format;

/// Writes a new, empty qcow2 image over `file`, emptied first (a node that
/// cannot be resized is written over as it is).
pub(crate) fn create_qcow2(file: &dyn BlockNode, image: &vsd_qcow2::create::NewImage) -> io::Result<()> {
    use vsd_qcow2::SyncIo;
    let clusters = vsd_qcow2::create::new_image(image).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // Written and resized while it is made, as QEMU's creation claims it
    // (an `auto-read-only` file is opened for writing meanwhile).
    let making = crate::Claim { held: crate::Perms::WRITE.with(crate::Perms::RESIZE), unshared: crate::Perms::NONE };
    let _making = file.claim(making).map_err(io::Error::other)?;
    match file.resize(0) {
        Err(e) if e.kind() != io::ErrorKind::Unsupported => return Err(e),
        _ => {}
    }
    let mut queue = child::ChildQueue::open(file, 1, u64::MAX)?;
    for (at, bytes) in &clusters {
        queue.write_at(bytes, *at)?;
    }
    queue.flush()?;
    file.refresh_size().map(drop)
}

/// What a filter decides for one request.
pub(crate) enum Route {
    /// Pass this (possibly rewritten) request down.
    Forward(IoOp),
    /// Complete it here with this errno (0: success without I/O).
    Answer(i32),
}

/// A driver's per-request decision: rewrite, answer, or pass on.
pub(crate) trait Filter: Send {
    fn route(&self, op: IoOp) -> Route;
}

/// A queue that lets a [`Filter`] answer some requests itself and forwards
/// the rest to the queue below, merging both kinds of completion.
pub(crate) struct FilteredQueue<F> {
    inner: Box<dyn IoQueue>,
    filter: F,
    answered: Vec<Completion>,
}

impl<F: Filter> FilteredQueue<F> {
    pub(crate) fn new(inner: Box<dyn IoQueue>, filter: F, depth: u16) -> Self {
        Self { inner, filter, answered: Vec::with_capacity(usize::from(depth)) }
    }
}

impl<F: Filter> IoQueue for FilteredQueue<F> {
    unsafe fn push(&mut self, tag: u32, op: IoOp) {
        match self.filter.route(op) {
            // SAFETY: the caller's guarantee for `op` covers the forwarded
            // request, which names the same buffers.
            Route::Forward(op) => unsafe { self.inner.push(tag, op) },
            Route::Answer(errno) => self.answered.push(Completion { tag, errno }),
        }
    }

    fn submit(&mut self) -> io::Result<()> {
        self.inner.submit()
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        out.append(&mut self.answered);
        self.inner.reap(out);
    }

    fn wait(&mut self) -> io::Result<()> {
        if self.answered.is_empty() { self.inner.wait() } else { Ok(()) }
    }

    vsd_engine::forward_to_inner!(inner: notify_fd, rearm, max_batch, held, kernel_entries);
}

/// `op` moved by `delta` bytes.
pub(crate) fn shifted(op: IoOp, delta: u64) -> IoOp {
    match op {
        IoOp::Read { offset, len, iov } => IoOp::Read { offset: offset + delta, len, iov },
        IoOp::Write { offset, len, iov, durable } => IoOp::Write { offset: offset + delta, len, iov, durable },
        IoOp::WriteCompressed { offset, len, iov } => IoOp::WriteCompressed { offset: offset + delta, len, iov },
        IoOp::Discard { offset, len } => IoOp::Discard { offset: offset + delta, len },
        IoOp::WriteZeroes { offset, len, may_unmap, fast } => {
            IoOp::WriteZeroes { offset: offset + delta, len, may_unmap, fast }
        }
        IoOp::Flush => IoOp::Flush,
    }
}

/// EIO for a request outside the node: never let it reach the host.
pub(crate) fn out_of_bounds(op: &IoOp, size: u64) -> bool {
    op.extent().is_some_and(|(offset, len)| !vsd_engine::range_ok(offset, len, size))
}
