//! `driver=file`: a host file; `driver=host_device`: a block or character
//! device, as QEMU tells them apart (each refuses the other's).

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use vsd_engine::{AlignedQueue, Alignment, EdgeLeases, IoOp, IoQueue, PoolQueue, ThreadPool, UringQueue};

use super::{Filter, FilteredQueue, Route, out_of_bounds};
use crate::lock::ImageLock;
use crate::options::OptionMap;
use crate::{Allocation, BlockNode, Cache, Claim, ClaimGuard, GraphError, LockError, Perms};

/// How requests reach the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Aio {
    IoUring,
    Threads,
}

pub(crate) struct FileNode {
    name: String,
    filename: String,
    size: AtomicU64,
    /// Changed by [`BlockNode::set_read_only`], with the open file.
    read_only: AtomicBool,
    /// `cache.direct=on`: the file is opened O_DIRECT.
    direct: bool,
    policy: FilePolicy,
    /// Only for `aio=threads`: shared by all of the node's queues.
    pool: Option<Arc<ThreadPool>>,
    /// What the image's lock bytes say, from the claims of its users, and
    /// the open file they are locked on, which the node's I/O goes to.
    lock: Arc<ImageLock>,
    /// `driver=host_device`.
    device: bool,
    /// What O_DIRECT needs; misaligned requests are bounced.
    alignment: Alignment,
    /// The edge blocks its queues read-modify-write.
    leases: Arc<EdgeLeases>,
    /// `auto-read-only=on`: the file is open for writing only while a
    /// claim writes.
    auto_read_only: Option<Arc<AutoReadOnly>>,
}

/// What the file driver answers without I/O.
///
/// Requests past the end of the file are allowed, as in QEMU's file
/// driver: format drivers grow their file. The nodes and exports above
/// check guest requests against their own size.
#[derive(Clone, Copy)]
pub(super) struct FilePolicy {
    /// `cache.no-flush=on`: flushes succeed at once (cache=unsafe).
    no_flush: bool,
    /// `discard=unmap`: discards punch holes; otherwise they are ignored.
    unmap: bool,
    /// A block device, whose zeroing the kernel may do by writing zeroes:
    /// a zeroing that must be fast is refused, as QEMU does.
    device: bool,
}

impl FileNode {
    /// Opens the file (a device if `device`); `active` false for a node
    /// opened inactive, which takes no locks until activated.
    pub(crate) fn open(
        name: String,
        cache: Cache,
        active: bool,
        device: bool,
        opts: &mut OptionMap,
    ) -> Result<Self, GraphError> {
        let context = opts.context().to_string();
        let filename = opts.require("filename")?;
        let Cache { direct, .. } = cache;
        let policy = FilePolicy { device, ..FilePolicy::take(cache, opts)? };
        let read_only = opts.take_bool("read-only")?.unwrap_or(false);
        let auto_read_only = opts.take_bool("auto-read-only")?.unwrap_or(false) && !read_only;
        let aio = match opts.take_choice("aio", &["io_uring", "threads", "native"])? {
            Some("threads") => Aio::Threads,
            // QEMU's Linux AIO needs O_DIRECT; vsd's io_uring engine
            // submits the same way without it, and serves both.
            Some("native") if !direct => {
                return Err(GraphError::Invalid {
                    context,
                    reason: "aio=native was specified, but it requires cache.direct=on, which was not specified."
                        .into(),
                });
            }
            _ => Aio::IoUring,
        };
        // QEMU's `auto` locks where the file system supports OFD locks:
        // every Linux one does.
        let locking = opts.take_choice("locking", &["auto", "on", "off"])? != Some("off");

        let host = |what: String, source: io::Error| GraphError::Host { context: context.clone(), what, source };
        // QEMU's dynamic auto-read-only: read-only until a writer comes.
        let file = open_file(&filename, read_only || auto_read_only, direct).map_err(|e| {
            let hint = if direct && e.raw_os_error() == Some(libc::EINVAL) {
                " (the file system may not support cache.direct=on)"
            } else {
                ""
            };
            host(format!("cannot open '{filename}'{hint}"), e)
        })?;
        let kind = file.metadata().map_err(|e| host(format!("cannot look at '{filename}'"), e))?.file_type();
        let is_device = kind.is_block_device() || kind.is_char_device();
        let refused = |reason: String| GraphError::Invalid { context: context.clone(), reason };
        // QEMU's words for each.
        if device && !is_device {
            return Err(refused(format!(
                "'host_device' driver requires '{filename}' to be either a character or block device"
            )));
        }
        if !device && !kind.is_file() {
            return Err(refused(format!("'file' driver requires '{filename}' to be a regular file")));
        }
        let size = vsd_sys::file_size(&file).map_err(|e| host(format!("cannot size '{filename}'"), e))?;
        let alignment =
            Alignment::of(&file).map_err(|e| host(format!("cannot learn the alignment '{filename}' needs"), e))?;
        if aio == Aio::IoUring {
            UringQueue::probe().map_err(|e| host("aio=io_uring".into(), e))?;
        }
        let file = Arc::new(file);
        let lock = ImageLock::new(file.clone(), filename.clone(), locking, active);
        let auto_read_only = auto_read_only.then(|| AutoReadOnly::watch(&lock, &filename, direct));
        Ok(Self {
            lock,
            auto_read_only,
            device,
            alignment,
            leases: EdgeLeases::new(),
            name,
            filename,
            size: AtomicU64::new(size),
            read_only: AtomicBool::new(read_only),
            direct,
            policy,
            pool: (aio == Aio::Threads).then(ThreadPool::new),
        })
    }
}

/// Opens `filename` for reading, and for writing unless `read_only`.
fn open_file(filename: &str, read_only: bool, direct: bool) -> io::Result<File> {
    let mut open = File::options();
    open.read(true).write(!read_only);
    if direct {
        open.custom_flags(libc::O_DIRECT);
    }
    open.open(filename)
}

/// Opens `filename` again, with the access `read_only` says, and moves the
/// image's locks onto the new open (see [`ImageLock::move_to`]).
fn reopen(lock: &ImageLock, filename: &str, read_only: bool, direct: bool) -> io::Result<()> {
    let file = open_file(filename, read_only, direct)?;
    let (old, new) = (lock.file().metadata()?, file.metadata()?);
    if (old.dev(), old.ino()) != (new.dev(), new.ino()) {
        return Err(io::Error::other(format!("'{filename}' is no longer the file the node opened")));
    }
    lock.move_to(Arc::new(file)).map_err(io::Error::other)
}

/// A file opened with `auto-read-only=on`: open read-only, for writing
/// while a user's claim writes to it or resizes it (an export, a format
/// node, a job's target), and read-only again once none does, as QEMU's
/// file driver reopens it. A file that refuses writers refuses those
/// claims.
struct AutoReadOnly {
    filename: String,
    direct: bool,
    /// Whether the open is writable; held while it changes, so that a
    /// claim and a release never cross.
    writable: Mutex<bool>,
}

/// The permissions that need a writable open.
const WRITING: [Perms; 3] = [Perms::WRITE, Perms::WRITE_UNCHANGED, Perms::RESIZE];

fn writes(held: Perms) -> bool {
    WRITING.iter().any(|&perm| held.contains(perm))
}

impl AutoReadOnly {
    /// Follows the claims on `lock` from now on.
    fn watch(lock: &ImageLock, filename: &str, direct: bool) -> Arc<Self> {
        let auto = Arc::new(Self { filename: filename.to_string(), direct, writable: Mutex::new(false) });
        let watcher = auto.clone();
        lock.on_release(Box::new(move |lock| watcher.settle(lock, &mut watcher.writable())));
        auto
    }

    fn writable(&self) -> std::sync::MutexGuard<'_, bool> {
        self.writable.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes `claim`, writable first if it writes.
    fn claim(&self, lock: &Arc<ImageLock>, claim: Claim) -> Result<ClaimGuard, LockError> {
        let mut writable = self.writable();
        if writes(claim.held) && !*writable {
            reopen(lock, &self.filename, false, self.direct)
                .map_err(|source| LockError::Reopen { path: self.filename.clone(), source })?;
            *writable = true;
        }
        let claimed = lock.claim(claim);
        self.settle(lock, &mut writable);
        claimed
    }

    /// Read-only again once no claim writes. A failure keeps the writable
    /// open, which is still a correct one.
    fn settle(&self, lock: &ImageLock, writable: &mut bool) {
        if *writable && !writes(lock.held()) && reopen(lock, &self.filename, true, self.direct).is_ok() {
            *writable = false;
        }
    }

    /// The node made read-only or writable (`blockdev-reopen`): writable,
    /// the file is open for writing only if a claim writes.
    fn set_node_read_only(&self, lock: &ImageLock, read_only: bool) -> io::Result<()> {
        let mut writable = self.writable();
        let wanted = !read_only && writes(lock.held());
        if wanted != *writable {
            reopen(lock, &self.filename, !wanted, self.direct)?;
            *writable = wanted;
        }
        Ok(())
    }
}

impl FileNode {
    fn reopen(&self, read_only: bool) -> io::Result<()> {
        match &self.auto_read_only {
            Some(auto) => auto.set_node_read_only(&self.lock, read_only),
            None => reopen(&self.lock, &self.filename, read_only, self.direct),
        }
    }
}

impl FilePolicy {
    /// The policy of a node with `cache` options and `discard=` in `opts`.
    pub(super) fn take(cache: Cache, opts: &mut OptionMap) -> Result<Self, GraphError> {
        let unmap = opts.take_choice("discard", crate::common::DISCARD)?.is_some_and(|d| d == "unmap" || d == "on");
        Ok(Self { no_flush: cache.no_flush, unmap, device: false })
    }
}

impl Filter for FilePolicy {
    fn route(&self, op: IoOp) -> Route {
        if out_of_bounds(&op, i64::MAX as u64) {
            return Route::Answer(libc::EINVAL);
        }
        match op {
            IoOp::Flush if self.no_flush => Route::Answer(0),
            IoOp::Discard { .. } if !self.unmap => Route::Answer(0),
            IoOp::WriteZeroes { fast: true, .. } if self.device => Route::Answer(libc::EOPNOTSUPP),
            IoOp::WriteZeroes { offset, len, may_unmap, fast } => {
                Route::Forward(IoOp::WriteZeroes { offset, len, may_unmap: may_unmap && self.unmap, fast })
            }
            op => Route::Forward(op),
        }
    }
}

impl BlockNode for FileNode {
    fn name(&self) -> &str {
        &self.name
    }

    fn driver(&self) -> &'static str {
        if self.device { "host_device" } else { "file" }
    }

    fn filename(&self) -> Option<&str> {
        Some(&self.filename)
    }

    fn size(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }

    fn resize(&self, size: u64) -> io::Result<()> {
        if self.read_only() {
            return Err(io::Error::new(io::ErrorKind::PermissionDenied, "the node is read-only"));
        }
        // Resizing needs a writable open (`auto-read-only`).
        let _resizing = self.claim(Claim { held: Perms::RESIZE, unshared: Perms::NONE }).map_err(io::Error::other)?;
        self.lock.file().set_len(size)?;
        self.size.store(size, Ordering::Relaxed);
        Ok(())
    }

    fn read_only(&self) -> bool {
        self.read_only.load(Ordering::Acquire)
    }

    /// The file is opened again, with the other access, and its locks
    /// moved onto the new open; queues opened from then on use it. Going
    /// writable, the flag changes once the new open is in place; going
    /// read-only, first, so that no writer starts on the node meanwhile.
    fn set_read_only(&self, read_only: bool) -> io::Result<()> {
        if read_only == self.read_only() {
            return Ok(());
        }
        if read_only {
            self.read_only.store(true, Ordering::Release);
        }
        self.reopen(read_only).inspect_err(|_| self.read_only.store(!read_only, Ordering::Release))?;
        self.read_only.store(read_only, Ordering::Release);
        Ok(())
    }

    /// The open file itself, unless it bypasses the page cache (O_DIRECT),
    /// for ranges inside the node's size.
    fn host_file(&self, offset: u64, len: u64) -> Option<(Arc<File>, u64)> {
        if self.direct || offset.checked_add(len)? > self.size() {
            return None;
        }
        Some((self.lock.file(), offset))
    }

    fn request_alignment(&self) -> u32 {
        self.alignment.request
    }

    fn refresh_size(&self) -> io::Result<u64> {
        let size = vsd_sys::file_size(&self.lock.file())?;
        self.size.store(size, Ordering::Relaxed);
        Ok(size)
    }

    fn claim(&self, claim: Claim) -> Result<Vec<ClaimGuard>, LockError> {
        match &self.auto_read_only {
            Some(auto) => auto.claim(&self.lock, claim),
            None => self.lock.claim(claim),
        }
        .map(|guard| vec![guard])
    }

    fn inactivate(&self) -> io::Result<()> {
        // The other end of the migration takes the image: no locks.
        self.lock.set_active(false).map_err(io::Error::other)
    }

    fn activate(&self) -> io::Result<()> {
        self.lock.set_active(true).map_err(io::Error::other)?;
        // Another process may have resized the file meanwhile.
        self.refresh_size().map(drop)
    }

    /// The file's holes, as `lseek` finds them. A file system that cannot
    /// say (EINVAL, EOPNOTSUPP) has only data.
    fn block_status(&self, offset: u64, len: u64) -> io::Result<(Allocation, u64)> {
        let file = self.lock.file();
        let fd = file.as_fd();
        let end = offset.saturating_add(len);
        let data = match vsd_sys::seek_data_or_hole(fd, offset, false) {
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::EOPNOTSUPP)) => Some(offset),
            other => other?,
        };
        match data {
            Some(data) if data == offset => {
                // Data here: a hole begins after it (the end of the file at worst).
                let hole = vsd_sys::seek_data_or_hole(fd, offset, true)?.unwrap_or(end);
                Ok((Allocation::Data, hole.clamp(offset + 1, end) - offset))
            }
            Some(data) => Ok((Allocation::Hole, data.min(end) - offset)),
            None => Ok((Allocation::Hole, len)),
        }
    }

    fn open_queue(&self, depth: u16) -> io::Result<Box<dyn IoQueue>> {
        let file = self.lock.file();
        let engine: Box<dyn IoQueue> = match &self.pool {
            Some(pool) => Box::new(PoolQueue::new(pool.clone(), file, depth)?),
            None => Box::new(UringQueue::new(file, depth)?),
        };
        // Without O_DIRECT nothing is in the way of any request.
        let engine = if self.alignment.is_any() {
            engine
        } else {
            Box::new(AlignedQueue::new(engine, self.alignment, self.leases.clone(), depth)?)
        };
        Ok(Box::new(FilteredQueue::new(engine, self.policy, depth)))
    }
}
