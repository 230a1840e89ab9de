//! vsd's FUSE export: a block node shown as a regular file
//! (`--export type=fuse,mountpoint=FILE`), as qemu-storage-daemon's.
//!
//! ```text
//!  reader of FILE ── kernel FUSE ── /dev/fuse ─┬─ reader thread 0 (the mount's descriptor) ── IoQueue ──▶ node
//!                                              └─ reader thread N (FUSE_DEV_IOC_CLONE)    ── IoQueue ──▶ node
//! ```
//!
//! The protocol is spoken here, not through a crate, by argument rather
//! than measurement: one regular file needs a dozen messages (proto.rs);
//! `fuser`'s session reads one descriptor on one thread and hands every
//! request to a callback with a boxed reply, and `fuse-backend-rs` answers
//! each request from its `FileSystem` call, built for virtiofs' inode
//! trees. What vsd needs is neither: one reader per cloned descriptor,
//! reading without blocking while its earlier requests wait on its own
//! queue on the node, with replies written from the slot that holds the
//! data, as vsd's NBD connections do.
//!
//! Every open file gets `FOPEN_DIRECT_IO` and attributes are never cached:
//! what another export writes is read at once, and a resize shows in
//! `st_size` at the next stat.

#![deny(missing_docs)]

mod config;
mod mount;
mod proto;
mod worker;

use std::collections::BTreeSet;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

pub use config::{AllowOther, ExportConfig};
use proto::fattr;
use vsd_block::{Allocation, BlockNode};
use vsd_trace::{ExportSnapshot, QueueStats};

/// The largest read or write one request carries: the kernel's most
/// pages per request (256).
pub(crate) const MAX_IO: usize = 1 << 20;
/// Readers at most: each keeps many requests in flight, so more than the
/// CPUs the daemon may run on only adds switches.
const MAX_READERS: usize = 8;

/// The mountpoints of running exports, by the path given (as QEMU: the
/// same file named another way is not caught).
static MOUNTPOINTS: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

fn mountpoints() -> std::sync::MutexGuard<'static, BTreeSet<String>> {
    MOUNTPOINTS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A running FUSE export.
pub struct FuseExport {
    shared: Arc<Shared>,
    mount: mount::Mount,
    readers: Vec<JoinHandle<()>>,
    stats: Vec<Arc<QueueStats>>,
}

/// What every reader shares.
pub(crate) struct Shared {
    pub(crate) config: ExportConfig,
    /// The node served, and the readers' stops to change it.
    control: Mutex<Control>,
    /// Signalled when a reader parks or leaves, and when the readers may
    /// go on.
    changed: Condvar,
    /// Set while readers are asked to stop (see [`FuseExport::with_readers_stopped`]).
    pub(crate) pausing: AtomicBool,
    /// Readable while readers are asked to stop (an eventfd), to wake them.
    pub(crate) pause: OwnedFd,
    /// Whether the mount lets other users in (`allow-other`, as it came out).
    allow_other: bool,
    /// Mode, owner and group, which `chmod` and `chown` change.
    owner: Mutex<Owner>,
    /// Held while the node grows, so that two writes past the end agree.
    resizing: Mutex<()>,
    /// Signalled when the export stops (an eventfd).
    pub(crate) stop: OwnedFd,
    /// False once a reader found the file unmounted under the daemon.
    pub(crate) connected: AtomicBool,
}

/// What the readers and the daemon agree on under [`Shared::control`].
struct Control {
    node: Arc<dyn BlockNode>,
    /// Counts node changes: a reader whose queue is older opens another.
    generation: u64,
    /// Readers stopped at a request boundary, and readers running.
    parked: usize,
    live: usize,
}

#[derive(Clone, Copy)]
struct Owner {
    mode: u32,
    uid: u32,
    gid: u32,
}

impl FuseExport {
    /// Mounts `node` over the file `config.mountpoint` and starts serving
    /// it; errors in QEMU's words.
    pub fn start(config: ExportConfig, node: Arc<dyn BlockNode>) -> Result<Self, String> {
        let path = config.mountpoint.clone();
        if !mountpoints().insert(path.clone()) {
            return Err(format!("There already is a FUSE export on '{path}'"));
        }
        let started = Self::mount_and_serve(config, node);
        if started.is_err() {
            mountpoints().remove(&path);
        }
        started
    }

    fn mount_and_serve(config: ExportConfig, node: Arc<dyn BlockNode>) -> Result<Self, String> {
        // SAFETY: PR_GET_SECCOMP takes no arguments.
        if unsafe { libc::prctl(libc::PR_GET_SECCOMP) } == libc::SECCOMP_MODE_FILTER as i32 {
            return Err("FUSE exports need mount(2), which --sandbox on forbids".into());
        }
        let path = config.mountpoint.clone();
        mount::check_mountpoint(&path)?;
        let (mount, allow_other) = mount_allowing(&path, config.allow_other)
            .map_err(|e| format!("Failed to mount FUSE session to export: {}", mount::strerror(&e)))?;
        let shared = match Shared::new(config, node, allow_other) {
            Ok(shared) => Arc::new(shared),
            Err(e) => {
                mount.unmount();
                return Err(e.to_string());
            }
        };
        let mut export = Self { shared, mount, readers: Vec::new(), stats: Vec::new() };
        // A failure from here on unmounts, as dropping `export` stops it.
        export.start_readers().map_err(|e| format!("FUSE export '{}': {e}", export.shared.config.id))?;
        Ok(export)
    }

    /// One reader per CPU the daemon may run on, the first on the mount's
    /// descriptor, the others on clones of it.
    fn start_readers(&mut self) -> std::io::Result<()> {
        let count = std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_READERS);
        for n in 0..count {
            let fd = match n {
                0 => self.mount.fd.try_clone()?,
                _ => worker::clone_fd(self.mount.fd.as_fd())?,
            };
            vsd_sys::set_nonblocking(fd.as_fd())?;
            let stats = Arc::new(QueueStats::timed_by(vsd_trace::Clock::get()));
            let shared = self.shared.clone();
            let (started, result) = std::sync::mpsc::channel();
            let reader_stats = stats.clone();
            let thread =
                std::thread::Builder::new().name(format!("fuse-{}-{n}", self.shared.config.id)).spawn(move || {
                    match worker::Worker::new(fd, shared, reader_stats) {
                        Ok(worker) => {
                            let _ = started.send(Ok(()));
                            worker.run();
                        }
                        Err(e) => drop(started.send(Err(e))),
                    }
                })?;
            self.readers.push(thread);
            result.recv().map_err(|_| std::io::Error::other("a reader thread ended"))??;
            self.stats.push(stats);
        }
        Ok(())
    }

    /// Its options.
    pub fn config(&self) -> &ExportConfig {
        &self.shared.config
    }

    /// The node it serves.
    pub fn node(&self) -> Arc<dyn BlockNode> {
        self.shared.control().node.clone()
    }

    /// Runs `work` with every reader stopped at a request boundary (their
    /// requests in flight completed, new ones waiting in the kernel); if it
    /// succeeds and `to` is given, the readers serve `to` from then on.
    pub fn with_readers_stopped<E>(
        &self,
        to: Option<Arc<dyn BlockNode>>,
        work: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), E> {
        let shared = &*self.shared;
        let mut control = shared.control();
        shared.pausing.store(true, Ordering::Release);
        if let Err(e) = vsd_sys::signal_counter(shared.pause.as_fd()) {
            log::error!("FUSE export '{}': cannot stop its readers: {e}", shared.config.id);
        }
        while control.parked < control.live {
            control = shared.changed.wait(control).unwrap_or_else(PoisonError::into_inner);
        }
        // Not held meanwhile: `work` may ask the export for its node.
        drop(control);
        let result = work();
        let mut control = shared.control();
        if let (Ok(()), Some(to)) = (&result, to) {
            control.node = to;
            control.generation += 1;
        }
        let _ = vsd_sys::read_counter(shared.pause.as_fd());
        shared.pausing.store(false, Ordering::Release);
        shared.changed.notify_all();
        result
    }

    /// Every reader's statistics.
    pub fn stats(&self) -> ExportSnapshot {
        ExportSnapshot::from_queues(self.stats.iter().map(|s| s.snapshot()).collect())
    }

    /// Stops serving (requests in flight complete first) and unmounts.
    pub fn stop(self) {
        drop(self)
    }
}

impl Drop for FuseExport {
    fn drop(&mut self) {
        if let Err(e) = vsd_sys::signal_counter(self.shared.stop.as_fd()) {
            log::error!("FUSE export '{}': cannot stop its readers: {e}", self.shared.config.id);
        }
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
        self.mount.unmount();
        mountpoints().remove(&self.shared.config.mountpoint);
    }
}

/// Mounts with `allow_other` as asked; `auto` tries it first and falls
/// back to without, as QEMU. Returns whether it is on.
fn mount_allowing(path: &str, allow: AllowOther) -> std::io::Result<(mount::Mount, bool)> {
    match allow {
        AllowOther::On => Ok((mount::Mount::new(path, true, MAX_IO)?, true)),
        AllowOther::Off => Ok((mount::Mount::new(path, false, MAX_IO)?, false)),
        AllowOther::Auto => match mount::Mount::new(path, true, MAX_IO) {
            Ok(mount) => Ok((mount, true)),
            Err(_) => Ok((mount::Mount::new(path, false, MAX_IO)?, false)),
        },
    }
}

impl Shared {
    fn new(config: ExportConfig, node: Arc<dyn BlockNode>, allow_other: bool) -> std::io::Result<Self> {
        // As QEMU: read (and write) for the daemon's user.
        let mode = libc::S_IFREG | libc::S_IRUSR | if config.writable { libc::S_IWUSR } else { 0 };
        // SAFETY: getuid and getgid have no preconditions.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        Ok(Self {
            config,
            control: Mutex::new(Control { node, generation: 0, parked: 0, live: 0 }),
            changed: Condvar::new(),
            pausing: AtomicBool::new(false),
            pause: eventfd()?,
            allow_other,
            owner: Mutex::new(Owner { mode, uid, gid }),
            resizing: Mutex::new(()),
            stop: eventfd()?,
            connected: AtomicBool::new(true),
        })
    }

    fn control(&self) -> MutexGuard<'_, Control> {
        self.control.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The node and its generation, for a reader starting or going on.
    pub(crate) fn current_node(&self) -> (Arc<dyn BlockNode>, u64) {
        let control = self.control();
        (control.node.clone(), control.generation)
    }

    /// A reader starts serving.
    pub(crate) fn reader_started(&self) {
        self.control().live += 1;
    }

    /// A reader has ended (the export stops, or the file was unmounted).
    pub(crate) fn reader_ended(&self) {
        self.control().live -= 1;
        self.changed.notify_all();
    }

    /// Parks a reader with nothing in flight until the readers may go on;
    /// returns the node to serve and its generation.
    pub(crate) fn park(&self) -> (Arc<dyn BlockNode>, u64) {
        let mut control = self.control();
        control.parked += 1;
        self.changed.notify_all();
        while self.pausing.load(Ordering::Acquire) {
            control = self.changed.wait(control).unwrap_or_else(PoisonError::into_inner);
        }
        control.parked -= 1;
        (control.node.clone(), control.generation)
    }

    fn owner(&self) -> std::sync::MutexGuard<'_, Owner> {
        self.owner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The file's attributes, never cached by the kernel.
    pub(crate) fn attr_out(&self, node: &dyn BlockNode) -> proto::AttrOut {
        let size = node.size();
        let owner = *self.owner();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let attr = proto::Attr {
            ino: proto::ROOT_ID,
            size,
            blocks: size.div_ceil(512),
            atime: now,
            mtime: now,
            ctime: now,
            mode: owner.mode,
            nlink: 1,
            uid: owner.uid,
            gid: owner.gid,
            blksize: node.request_alignment().max(512),
            ..Default::default()
        };
        proto::AttrOut { attr, ..Default::default() }
    }

    /// `truncate`, `chmod` and `chown` as QEMU allows them: a size only on
    /// a writable export; no write permission on a read-only one; no
    /// access for others, nor another owner, without `allow-other`.
    pub(crate) fn setattr(&self, node: &dyn BlockNode, set: &proto::SetattrIn) -> Result<(), i32> {
        let mut supported = fattr::SIZE | fattr::MODE | fattr::FH | fattr::LOCKOWNER;
        if self.allow_other {
            supported |= fattr::UID | fattr::GID;
        }
        if set.valid & !supported != 0 {
            return Err(libc::ENOTSUP);
        }
        if set.valid & fattr::MODE != 0 {
            if !self.allow_other && set.mode & (libc::S_IRWXG | libc::S_IRWXO) != 0 {
                return Err(libc::EPERM);
            }
            if !self.config.writable && set.mode & (libc::S_IWUSR | libc::S_IWGRP | libc::S_IWOTH) != 0 {
                return Err(libc::EROFS);
            }
        }
        if set.valid & fattr::SIZE != 0 {
            if !self.config.writable {
                return Err(libc::EACCES);
            }
            self.resize(node, set.size)?;
        }
        let mut owner = self.owner();
        if set.valid & fattr::MODE != 0 {
            owner.mode = (set.mode & 0o7777) | libc::S_IFREG;
        }
        if set.valid & fattr::UID != 0 {
            owner.uid = set.uid;
        }
        if set.valid & fattr::GID != 0 {
            owner.gid = set.gid;
        }
        Ok(())
    }

    /// Resizes the node to `size`.
    pub(crate) fn resize(&self, node: &dyn BlockNode, size: u64) -> Result<(), i32> {
        let _resizing = self.resizing.lock().unwrap_or_else(PoisonError::into_inner);
        node.resize(size).map_err(|e| errno(&e))
    }

    /// Grows the node to `end` if it is smaller.
    pub(crate) fn grow_to(&self, node: &dyn BlockNode, end: u64) -> Result<(), i32> {
        let _resizing = self.resizing.lock().unwrap_or_else(PoisonError::into_inner);
        if node.size() >= end {
            return Ok(());
        }
        node.resize(end).map_err(|e| errno(&e))
    }

    /// `lseek` with SEEK_DATA or SEEK_HOLE, from the node's block status;
    /// the end of the node is a hole, as in QEMU.
    pub(crate) fn seek(&self, node: &dyn BlockNode, mut offset: u64, whence: u32) -> Result<u64, i32> {
        let hole = match whence as i32 {
            libc::SEEK_DATA => false,
            libc::SEEK_HOLE => true,
            _ => return Err(libc::EINVAL),
        };
        let size = node.size();
        while offset < size {
            let (allocation, len) = node.block_status(offset, size - offset).map_err(|e| errno(&e))?;
            if (allocation == Allocation::Hole) == hole {
                return Ok(offset);
            }
            offset += len.max(1);
        }
        if offset > size || !hole { Err(libc::ENXIO) } else { Ok(offset) }
    }
}

fn eventfd() -> std::io::Result<OwnedFd> {
    // SAFETY: eventfd has no preconditions.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The errno of an I/O error (EIO if it has none).
fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}
