//! `driver=copy-before-write,file=NODE,target=NODE`: QEMU's fleecing
//! filter. Writes through it first copy the old data of the clusters they
//! touch into `target`, once per cluster, so that `target` (a qcow2 image
//! backed by `file`, or read through a `snapshot-access` node) keeps `file`
//! as it was when the filter was added.
//!
//! ```text
//!   write ─▶ Snapshot::before_write ─ old clusters? ─▶ copier thread: file.read ─▶ target.write
//!              │ (waits, at most cbw-timeout)                           └─ marks them copied
//!              └─ then waits for snapshot reads of the range ─▶ file
//!   snapshot-access read ─▶ copied? target : file (the range held against writes meanwhile)
//! ```
//!
//! One thread per filter copies, with queues of its own, so that a writer
//! can stop waiting for it (`cbw-timeout`) without its buffers in flight.
//! `bitmap=` limits the snapshot to the clusters dirty in it at the start:
//! only those are copied, and reading the others fails (EACCES), as in QEMU.
//! A target smaller than `file` is taken, as QEMU takes it: copies past its
//! end fail, under `on-cbw-error`.

use std::collections::{HashSet, VecDeque};
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vsd_engine::{IoOp, IoQueue};
use vsd_qcow2::SyncIo;

use super::child::ChildQueue;
use super::{Filter, FilteredQueue, Route};
use crate::dirty::Bitmap;
use crate::options::OptionMap;
use crate::{Allocation, BlockGraph, BlockNode, GraphError};

/// Bytes per cluster unless the target's are larger, as QEMU's block-copy.
const CLUSTER: u64 = 65536;
/// The most one copy moves.
const MAX_COPY: u64 = 1 << 20;

/// What a failed copy breaks (QAPI's `OnCbwError`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum OnError {
    /// The guest write fails; the snapshot stays whole.
    BreakGuestWrite,
    /// The guest write goes on; every snapshot read fails from then on.
    BreakSnapshot,
}

/// Where a cluster's point-in-time data is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Cluster {
    /// Nowhere: not part of the snapshot (outside the bitmap, or discarded).
    Outside,
    /// Still in `file`.
    Original,
    /// In `file`, being copied to `target`.
    Copying,
    /// In `target`.
    Copied,
}

struct State {
    clusters: Vec<Cluster>,
    /// Copies writers asked for: id, first and last cluster.
    requests: VecDeque<(u64, u64, u64)>,
    next_id: u64,
    /// Finished copies whose writer waits: id and errno (0: copied).
    outcomes: Vec<(u64, i32)>,
    /// Copies whose writer stopped waiting (`cbw-timeout`).
    abandoned: HashSet<u64>,
    /// Snapshot reads of `file` in flight: first and last cluster.
    frozen: Vec<(u64, u64)>,
    /// A copy failed under `break-snapshot`.
    broken: bool,
    stop: bool,
}

/// The point-in-time image a filter keeps, shared by its queues, its
/// copier thread and the `snapshot-access` nodes over it.
pub(crate) struct Snapshot {
    /// The filter's node name, to find it by.
    name: String,
    file: Arc<dyn BlockNode>,
    target: Arc<dyn BlockNode>,
    size: u64,
    cluster: u64,
    on_error: OnError,
    timeout: Option<Duration>,
    state: Mutex<State>,
    changed: Condvar,
}

/// The filters' snapshots, for `snapshot-access` to find.
static SNAPSHOTS: Mutex<Vec<Weak<Snapshot>>> = Mutex::new(Vec::new());

/// One thread's blocking queues on a snapshot's `file` and `target`.
pub(crate) struct Readers {
    file: ChildQueue,
    target: ChildQueue,
}

fn errno(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

fn same(a: &Arc<dyn BlockNode>, b: &Arc<dyn BlockNode>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

/// Whether any byte of `offset..offset + len` is dirty in `bitmap`.
fn any_dirty(bitmap: &Bitmap, offset: u64, len: u64) -> bool {
    let mut at = offset;
    while at < offset + len {
        let (dirty, run) = bitmap.status(at, offset + len - at);
        if dirty {
            return true;
        }
        at += run.max(1);
    }
    false
}

impl Snapshot {
    /// The snapshot of copy-before-write node `node`, as the graph holds it.
    pub(crate) fn of(node: &dyn BlockNode) -> Option<Arc<Snapshot>> {
        let children = node.children();
        let child = |role| children.iter().find(|(r, _)| *r == role).map(|(_, c)| c.clone());
        let (file, target) = (child("file")?, child("target")?);
        let mut list = SNAPSHOTS.lock().unwrap_or_else(PoisonError::into_inner);
        list.retain(|s| s.strong_count() > 0);
        list.iter()
            .filter_map(Weak::upgrade)
            .find(|s| s.name == node.name() && same(&s.file, &file) && same(&s.target, &target))
    }

    /// The snapshot of `file` now, kept in `target`: every cluster, or
    /// those with bits dirty in `bitmap`.
    fn new(
        name: String,
        file: Arc<dyn BlockNode>,
        target: Arc<dyn BlockNode>,
        bitmap: Option<&Bitmap>,
        on_error: OnError,
        timeout: Option<Duration>,
    ) -> Self {
        let size = file.size();
        let cluster = CLUSTER.max(target.cluster_size().unwrap_or(0));
        let in_snapshot = |i: u64| bitmap.is_none_or(|b| any_dirty(b, i * cluster, cluster.min(size - i * cluster)));
        let clusters = (0..size.div_ceil(cluster))
            .map(|i| if in_snapshot(i) { Cluster::Original } else { Cluster::Outside })
            .collect();
        let state = State {
            clusters,
            requests: VecDeque::new(),
            next_id: 0,
            outcomes: Vec::new(),
            abandoned: HashSet::new(),
            frozen: Vec::new(),
            broken: false,
            stop: false,
        };
        Self { name, file, target, size, cluster, on_error, timeout, state: Mutex::new(state), changed: Condvar::new() }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait<'a>(&self, state: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed.wait(state).unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    /// The first and last cluster of bytes `offset..offset + len`, if any
    /// lies inside the node.
    fn span(&self, offset: u64, len: u64) -> Option<(usize, usize)> {
        if len == 0 || offset >= self.size {
            return None;
        }
        let last = offset.saturating_add(len - 1).min(self.size - 1);
        Some(((offset / self.cluster) as usize, (last / self.cluster) as usize))
    }

    /// Opens queues on `file` and `target` for the calling thread.
    pub(crate) fn readers(&self) -> io::Result<Readers> {
        Ok(Readers {
            file: ChildQueue::open(&*self.file, 0, u64::MAX)?,
            target: ChildQueue::open(&*self.target, 0, u64::MAX)?,
        })
    }

    /// Returns once bytes `offset..offset + len` of `file` may be
    /// overwritten: their old data copied, and no snapshot read of them in
    /// flight. An errno fails the guest write (`break-guest-write`).
    fn before_write(&self, offset: u64, len: u64) -> Result<(), i32> {
        let Some((first, last)) = self.span(offset, len) else { return Ok(()) };
        let mut state = self.lock();
        let old = |state: &State| {
            state.clusters[first..=last].iter().any(|c| matches!(c, Cluster::Original | Cluster::Copying))
        };
        if !state.broken && old(&state) {
            let errno;
            (state, errno) = self.copy(state, first, last);
            if errno != 0 {
                if self.on_error == OnError::BreakGuestWrite {
                    return Err(errno);
                }
                if !state.broken {
                    log::warn!(
                        "copy-before-write '{}': the snapshot is broken: {}",
                        self.name,
                        io::Error::from_raw_os_error(errno)
                    );
                }
                state.broken = true;
            }
        }
        while state.frozen.iter().any(|&(a, b)| a <= last as u64 && first as u64 <= b) {
            state = self.wait(state);
        }
        Ok(())
    }

    /// Has the copier copy clusters `first..=last` and waits for it, at
    /// most `cbw-timeout` (then ETIMEDOUT, the copy going on).
    fn copy<'a>(&'a self, mut state: MutexGuard<'a, State>, first: usize, last: usize) -> (MutexGuard<'a, State>, i32) {
        let id = state.next_id;
        state.next_id += 1;
        state.requests.push_back((id, first as u64, last as u64));
        self.changed.notify_all();
        let deadline = self.timeout.map(|timeout| Instant::now() + timeout);
        loop {
            if let Some(at) = state.outcomes.iter().position(|&(i, _)| i == id) {
                let (_, errno) = state.outcomes.swap_remove(at);
                return (state, errno);
            }
            let Some(deadline) = deadline else {
                state = self.wait(state);
                continue;
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                state.abandoned.insert(id);
                return (state, libc::ETIMEDOUT);
            }
            state = self.changed.wait_timeout(state, left).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    /// The copier thread: copies what writers ask for, in order, until the
    /// filter goes.
    fn copier(self: Arc<Self>) {
        let mut readers = self.readers();
        loop {
            let mut state = self.lock();
            let (id, first, last) = loop {
                if let Some(request) = state.requests.pop_front() {
                    break request;
                }
                if state.stop {
                    return;
                }
                state = self.wait(state);
            };
            let range = first as usize..=last as usize;
            state.clusters[range.clone()]
                .iter_mut()
                .filter(|c| **c == Cluster::Original)
                .for_each(|c| *c = Cluster::Copying);
            drop(state);
            let result = match &mut readers {
                Ok(readers) => self.copy_marked(readers, first as usize, last as usize),
                Err(e) => Err(errno(e)),
            };
            let mut state = self.lock();
            // What a failure left uncopied is still in `file`.
            state.clusters[range].iter_mut().filter(|c| **c == Cluster::Copying).for_each(|c| *c = Cluster::Original);
            if !state.abandoned.remove(&id) {
                state.outcomes.push((id, result.err().unwrap_or(0)));
            }
            self.changed.notify_all();
        }
    }

    /// Copies the clusters of `first..=last` marked copying, in runs of at
    /// most [`MAX_COPY`], each marked copied once on the target.
    fn copy_marked(&self, readers: &mut Readers, first: usize, last: usize) -> Result<(), i32> {
        let mut index = first;
        while index <= last {
            let state = self.lock();
            let Some(start) = (index..=last).find(|&i| state.clusters[i] == Cluster::Copying) else { break };
            let most = (MAX_COPY / self.cluster).max(1) as usize;
            let count = state.clusters[start..=last].iter().take(most).take_while(|&&c| c == Cluster::Copying).count();
            drop(state);
            let offset = start as u64 * self.cluster;
            let len = ((start + count) as u64 * self.cluster).min(self.size) - offset;
            self.copy_bytes(readers, offset, len).map_err(|e| errno(&e))?;
            let mut state = self.lock();
            state.clusters[start..start + count]
                .iter_mut()
                .filter(|c| **c == Cluster::Copying)
                .for_each(|c| *c = Cluster::Copied);
            index = start + count;
        }
        Ok(())
    }

    /// Copies bytes `offset..offset + len` of `file` to `target`, holes as
    /// zeroes (which keeps them sparse there, as QEMU's block-copy).
    fn copy_bytes(&self, readers: &mut Readers, offset: u64, len: u64) -> io::Result<()> {
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let (allocation, run) = self.file.block_status(at, end - at)?;
            let run = run.clamp(1, end - at);
            match allocation {
                Allocation::Hole => readers.target.write_zeroes(at, run)?,
                Allocation::Data => {
                    let mut buf = vec![0; run as usize];
                    readers.file.read_at(&mut buf, at)?;
                    readers.target.write_at(&buf, at)?;
                }
            }
            at += run;
        }
        Ok(())
    }

    /// Runs `f` on the first part of bytes `offset..offset + len` of the
    /// snapshot that is in one place, `target` (true) or `file` (false),
    /// with the part's length; a part in `file` is held against writes
    /// until `f` returns. EACCES for bytes outside the snapshot, or for
    /// all once it is broken.
    fn in_place<T>(&self, offset: u64, len: u64, f: impl FnOnce(bool, u64) -> T) -> Result<(T, u64), i32> {
        let Some((first, last)) = self.span(offset, len) else { return Err(libc::EIO) };
        let mut state = self.lock();
        if state.broken || state.clusters[first..=last].contains(&Cluster::Outside) {
            return Err(libc::EACCES);
        }
        let copied = state.clusters[first] == Cluster::Copied;
        let run = state.clusters[first..=last].iter().take_while(|&&c| (c == Cluster::Copied) == copied).count();
        let part = ((first + run) as u64 * self.cluster).min(offset + len) - offset;
        if copied {
            drop(state);
            return Ok((f(true, part), part));
        }
        let frozen = (first as u64, (first + run - 1) as u64);
        state.frozen.push(frozen);
        drop(state);
        let result = f(false, part);
        let mut state = self.lock();
        if let Some(i) = state.frozen.iter().position(|&held| held == frozen) {
            state.frozen.swap_remove(i);
        }
        self.changed.notify_all();
        Ok((result, part))
    }

    /// Reads the point-in-time bytes at `offset` into `buf`.
    pub(crate) fn read(&self, readers: &mut Readers, buf: &mut [u8], offset: u64) -> Result<(), i32> {
        let mut done = 0;
        while done < buf.len() {
            let rest = &mut buf[done..];
            let at = offset + done as u64;
            let (result, part) = self.in_place(at, rest.len() as u64, |copied, part| {
                let piece = &mut rest[..part as usize];
                if copied { readers.target.read_at(piece, at) } else { readers.file.read_at(piece, at) }
            })?;
            result.map_err(|e| errno(&e))?;
            done += part as usize;
        }
        Ok(())
    }

    /// How the snapshot's bytes from `offset` read: as `target` or `file`
    /// says where they are.
    pub(crate) fn block_status(&self, offset: u64, len: u64) -> io::Result<(Allocation, u64)> {
        let status = |copied, part| if copied { &self.target } else { &self.file }.block_status(offset, part);
        self.in_place(offset, len, status).map_err(io::Error::from_raw_os_error)?.0
    }

    /// Drops the whole clusters of `offset..offset + len` from the
    /// snapshot (the reader is done with them): they are copied no more,
    /// read no more, and discarded from `target`.
    pub(crate) fn discard(&self, readers: &mut Readers, offset: u64, len: u64) -> Result<(), i32> {
        let first = offset.div_ceil(self.cluster);
        let end = (offset + len).min(self.size);
        let end = if end == self.size { self.size.div_ceil(self.cluster) } else { end / self.cluster };
        if end <= first {
            return Ok(());
        }
        self.lock().clusters[first as usize..end as usize].fill(Cluster::Outside);
        let bytes = (end * self.cluster).min(self.size) - first * self.cluster;
        readers.target.discard(first * self.cluster, bytes).map_err(|e| errno(&e))
    }
}

/// A copy-before-write filter node.
pub(crate) struct CbwNode {
    name: String,
    snapshot: Arc<Snapshot>,
    copier: Option<JoinHandle<()>>,
    /// What the node holds of its target's images: it writes them, and
    /// lets nobody resize them (QEMU's claim).
    _target_claim: Vec<crate::ClaimGuard>,
}

impl CbwNode {
    pub(crate) fn open(name: String, opts: &mut OptionMap, graph: &BlockGraph) -> Result<Self, GraphError> {
        let file = graph.child(opts, "file")?;
        let target = graph.child(opts, "target")?;
        let bitmap = Self::bitmap(opts, graph)?;
        let (on_error, timeout) = Self::policy(opts)?;
        let writes = crate::Claim { held: crate::Perms::WRITE, unshared: crate::Perms::RESIZE };
        let target_claim = target
            .claim(writes)
            .map_err(|e| GraphError::Invalid { context: opts.context().into(), reason: e.to_string() })?;
        let snapshot = Arc::new(Snapshot::new(name.clone(), file, target, bitmap.as_deref(), on_error, timeout));
        let copier = {
            let snapshot = snapshot.clone();
            std::thread::Builder::new().name(format!("cbw {name}")).spawn(move || snapshot.copier()).map_err(|e| {
                GraphError::Host { context: opts.context().into(), what: "cannot start the copier".into(), source: e }
            })?
        };
        SNAPSHOTS.lock().unwrap_or_else(PoisonError::into_inner).push(Arc::downgrade(&snapshot));
        Ok(Self { name, snapshot, copier: Some(copier), _target_claim: target_claim })
    }

    /// `on-cbw-error` and `cbw-timeout` (seconds, 0: none).
    fn policy(opts: &mut OptionMap) -> Result<(OnError, Option<Duration>), GraphError> {
        let on_error = match opts.take_choice("on-cbw-error", &["break-guest-write", "break-snapshot"])? {
            Some("break-snapshot") => OnError::BreakSnapshot,
            _ => OnError::BreakGuestWrite,
        };
        let timeout = match opts.take_number("cbw-timeout")? {
            Some(text) => text.parse::<u32>().map_err(|_| opts.invalid("cbw-timeout", &text, "uint32_t"))?,
            None => 0,
        };
        Ok((on_error, (timeout > 0).then(|| Duration::from_secs(timeout.into()))))
    }

    /// `bitmap.node` and `bitmap.name`: the bitmap whose dirty clusters
    /// are the snapshot, as they are now.
    fn bitmap(opts: &mut OptionMap, graph: &BlockGraph) -> Result<Option<Arc<Bitmap>>, GraphError> {
        let Some(mut group) = opts.take_group("bitmap") else { return Ok(None) };
        let node = group.require("node")?;
        let name = group.require("name")?;
        let context = group.context().to_string();
        group.finish()?;
        let node = graph.get(&node).ok_or_else(|| GraphError::NoSuchNode { context: context.clone(), name: node })?;
        let invalid =
            |e: crate::dirty::BitmapError| GraphError::Invalid { context: context.clone(), reason: e.to_string() };
        let bitmaps = node.dirty_bitmaps().ok_or_else(|| invalid(crate::dirty::BitmapError::NotFound(name.clone())))?;
        let bitmap = bitmaps.get(&name).map_err(invalid)?;
        bitmap.usable().map_err(invalid)?;
        Ok(Some(bitmap))
    }
}

impl Drop for CbwNode {
    fn drop(&mut self) {
        self.snapshot.lock().stop = true;
        self.snapshot.changed.notify_all();
        if let Some(copier) = self.copier.take() {
            let _ = copier.join();
        }
    }
}

/// Copies before writes, passes everything on to `file`.
struct CbwFilter(Arc<Snapshot>);

impl Filter for CbwFilter {
    fn route(&self, op: IoOp) -> Route {
        match op {
            IoOp::Write { offset, len, .. }
            | IoOp::WriteCompressed { offset, len, .. }
            | IoOp::WriteZeroes { offset, len, .. }
            | IoOp::Discard { offset, len } => match self.0.before_write(offset, len) {
                Ok(()) => Route::Forward(op),
                Err(errno) => Route::Answer(errno),
            },
            IoOp::Read { .. } | IoOp::Flush => Route::Forward(op),
        }
    }
}

impl BlockNode for CbwNode {
    fn name(&self) -> &str {
        &self.name
    }

    fn driver(&self) -> &'static str {
        "copy-before-write"
    }

    fn size(&self) -> u64 {
        self.snapshot.size
    }

    fn read_only(&self) -> bool {
        self.snapshot.file.read_only()
    }

    fn children(&self) -> Vec<(&'static str, Arc<dyn BlockNode>)> {
        vec![("file", self.snapshot.file.clone()), ("target", self.snapshot.target.clone())]
    }

    fn claim(&self, claim: crate::Claim) -> Result<Vec<crate::ClaimGuard>, crate::LockError> {
        self.snapshot.file.claim(claim)
    }

    fn block_status(&self, offset: u64, len: u64) -> io::Result<(Allocation, u64)> {
        self.snapshot.file.block_status(offset, len)
    }

    fn allocation_depth(&self, offset: u64, len: u64) -> io::Result<(u32, u64)> {
        self.snapshot.file.allocation_depth(offset, len)
    }

    fn open_queue(&self, depth: u16) -> io::Result<Box<dyn IoQueue>> {
        let inner = self.snapshot.file.open_queue(depth)?;
        Ok(Box::new(FilteredQueue::new(inner, CbwFilter(self.snapshot.clone()), depth)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot of a 1 MiB null disk into a null target, without a
    /// copier: every copy a writer asks for waits forever.
    fn stalled(on_error: OnError) -> Snapshot {
        let mut graph = BlockGraph::new();
        let mut add = |text: &str| graph.add(OptionMap::parse("--blockdev", text).unwrap()).unwrap();
        let file = add("driver=null-co,node-name=f,size=1M,read-zeroes=on");
        let target = add("driver=null-co,node-name=t,size=1M,read-zeroes=on");
        Snapshot::new("cbw".into(), file, target, None, on_error, Some(Duration::from_millis(50)))
    }

    #[test]
    fn a_copy_past_the_timeout_fails_the_write_or_breaks_the_snapshot() {
        let guest = stalled(OnError::BreakGuestWrite);
        assert_eq!(guest.before_write(4096, 512), Err(libc::ETIMEDOUT));
        assert_eq!(guest.lock().abandoned.len(), 1, "the copy goes on, its outcome unwanted");
        let mut readers = guest.readers().unwrap();
        assert_eq!(guest.read(&mut readers, &mut [0; 512], 4096), Ok(()), "the snapshot stays whole");

        let snapshot = stalled(OnError::BreakSnapshot);
        assert_eq!(snapshot.before_write(4096, 512), Ok(()));
        let mut readers = snapshot.readers().unwrap();
        assert_eq!(snapshot.read(&mut readers, &mut [0; 512], CLUSTER * 3), Err(libc::EACCES), "every read fails");
        assert_eq!(snapshot.before_write(CLUSTER * 3, 512), Ok(()), "nor do writes wait any more");
    }

    #[test]
    fn a_discard_drops_whole_clusters_from_the_snapshot() {
        let snapshot = stalled(OnError::BreakGuestWrite);
        let mut readers = snapshot.readers().unwrap();
        snapshot.discard(&mut readers, 100, 2 * CLUSTER).unwrap();
        let readable = |at| snapshot.read(&mut snapshot.readers().unwrap(), &mut [0; 512], at);
        assert_eq!(readable(0), Ok(()), "cluster 0 is only partly discarded");
        assert_eq!(readable(CLUSTER), Err(libc::EACCES));
        assert_eq!(readable(2 * CLUSTER), Ok(()));
        assert_eq!(snapshot.before_write(CLUSTER, CLUSTER), Ok(()), "a dropped cluster is not copied");
        snapshot.discard(&mut readers, 15 * CLUSTER + 1, CLUSTER).unwrap();
        assert_eq!(readable(15 * CLUSTER + 4096), Ok(()), "the last cluster is only partly discarded");
    }
}
