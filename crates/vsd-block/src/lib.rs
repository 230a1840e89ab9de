//! vsd's block graph: named nodes built from `--blockdev` options, each a
//! driver that turns requests into I/O on the node below or on the host.
//!
//! ```text
//!   export ──▶ raw (offset/size window) ──▶ file (host file, io_uring | threads)
//!          └─▶ null-co (no I/O)
//! ```
//!
//! A node is shared by every queue of every export that uses it; the hot
//! path never touches the node itself, only the per-thread [`IoQueue`] it
//! opened for that queue. Every node of the graph counts the requests it
//! is sent ([`BlockNode::stats`]).

#![deny(missing_docs)]

mod accounting;
mod common;
pub mod dirty;
mod drivers;
pub use drivers::{DRIVERS, FILTERS};
mod lock;
pub mod options;
pub mod threshold;
pub mod throttle;
mod zeroes;

use std::io;
use std::sync::Arc;

pub use accounting::counted_as;
pub use lock::{Claim, ClaimGuard, LockError, Perms, User, UserGuard, Users};
pub use vsd_engine::{Completion, IoOp, IoQueue, IoVecs};

use options::{OptionError, OptionMap};
use vsd_trace::QueueSnapshot;

/// A node of the block graph.
pub trait BlockNode: Send + Sync {
    /// The node's `node-name`.
    fn name(&self) -> &str;
    /// The driver's name, as `--blockdev driver=` takes it.
    fn driver(&self) -> &'static str;
    /// The size in bytes.
    fn size(&self) -> u64;
    /// Whether writes are refused.
    fn read_only(&self) -> bool;
    /// Makes the node read-only or writable (QMP `blockdev-reopen`, a job
    /// writing into a backing image); this node only: a format needs its
    /// `file` and `data-file` children writable first, and made read-only
    /// after it. Queues opened from then on have the new access; those
    /// already open keep what they had, so reopen a node read-only only
    /// once its writers are gone. Nothing changes on a failure.
    fn set_read_only(&self, read_only: bool) -> io::Result<()> {
        if read_only == self.read_only() {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("driver '{}' cannot change whether it is read-only", self.driver()),
        ))
    }
    /// The node's cache options (`cache.direct`, `cache.no-flush`).
    fn cache(&self) -> Cache {
        Cache::default()
    }
    /// The alignment of requests that reach the host without bouncing
    /// (QEMU's `request_alignment`): the largest below this node.
    fn request_alignment(&self) -> u32 {
        self.children().iter().map(|(_, child)| child.request_alignment()).max().unwrap_or(1)
    }
    /// The host file behind the node, if it is a `file` node (format
    /// drivers resolve relative backing file names against it).
    fn filename(&self) -> Option<&str> {
        None
    }
    /// The host file that holds the node's `len` bytes at `offset` as they
    /// are, and where in it, for a reader that takes them from the host's
    /// page cache itself (the NBD server splices them to its socket):
    /// answered by `file` and `host_device` nodes without
    /// `cache.direct=on`, and by `raw` over such a node, within its window.
    /// Every other driver answers `None` (the default), so that what it
    /// does to a read (limits, formats, injected errors, a job's filter)
    /// is never bypassed.
    fn host_file(&self, _offset: u64, _len: u64) -> Option<(Arc<std::fs::File>, u64)> {
        None
    }
    /// The nodes this one reads and writes through, with the role QEMU
    /// names them by (`file`, `backing`, `data-file`).
    fn children(&self) -> Vec<(&'static str, Arc<dyn BlockNode>)> {
        Vec::new()
    }
    /// Changes the size (QMP `block_resize`); drivers that cannot say so.
    /// Exports read the new size when told to (they own the guest's view).
    fn resize(&self, _size: u64) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::Unsupported, format!("driver '{}' cannot be resized", self.driver())))
    }
    /// Writes back whatever the node keeps in memory (a format's metadata),
    /// when the daemon stops. Call it once no queue has requests in flight.
    fn close(&self) -> io::Result<()> {
        Ok(())
    }
    /// Takes what a user of this node (an export, a format on top) needs
    /// of the images below it, as QEMU's image locks say it ([`Claim`]),
    /// for as long as the guards live. Filters pass the claim to their
    /// child; a format keeps the claim its own use needs and passes nothing;
    /// nodes without an image need nothing.
    fn claim(&self, _claim: Claim) -> Result<Vec<ClaimGuard>, LockError> {
        Ok(Vec::new())
    }
    /// Reads the size again from the host (a file grown by the format
    /// above it, or by another process while the node was inactive) and
    /// returns it; nodes whose size only they change answer [`Self::size`].
    fn refresh_size(&self) -> io::Result<u64> {
        Ok(self.size())
    }
    /// Whether the node is active: inactive, its image belongs to another
    /// process (the other end of a live migration) and is not to be used.
    /// The graph keeps this state ([`BlockGraph::set_active`]).
    fn active(&self) -> bool {
        true
    }
    /// Hands the image over: writes back what the node keeps in memory and
    /// forgets it, so that nothing it holds can go stale while another
    /// process writes the image. This node only, not its children; call it
    /// once no queue has requests in flight.
    fn inactivate(&self) -> io::Result<()> {
        Ok(())
    }
    /// Takes the image back: reads again what the node keeps in memory.
    /// Queues opened before keep what they had: open new ones.
    fn activate(&self) -> io::Result<()> {
        Ok(())
    }
    /// Opens a channel for one thread with at most `depth` requests in
    /// flight. Call it from that thread: engines may bind to their creator.
    fn open_queue(&self, depth: u16) -> io::Result<Box<dyn IoQueue>>;
    /// Opens a queue whose requests the node does not count, for a caller
    /// that counts them itself (an export).
    fn open_uncounted_queue(&self, depth: u16) -> io::Result<Box<dyn IoQueue>> {
        self.open_queue(depth)
    }
    /// How the bytes from `offset` read, and for how many of them (1 to
    /// `len`; the range lies inside the node): NBD's `base:allocation`.
    /// By default all data, which is never wrong, only less precise.
    fn block_status(&self, _offset: u64, len: u64) -> io::Result<(Allocation, u64)> {
        Ok((Allocation::Data, len))
    }
    /// The node's dirty bitmaps, which every writer of the node records
    /// its writes in: the nodes of a [`BlockGraph`] have them.
    fn dirty_bitmaps(&self) -> Option<&Arc<dirty::DirtyBitmaps>> {
        None
    }
    /// Whether the node can keep persistent dirty bitmaps (in its image).
    fn can_store_bitmaps(&self) -> bool {
        false
    }
    /// Tells a node that keeps persistent bitmaps that one of them was
    /// removed, so that its image forgets it at once.
    fn persistent_bitmap_removed(&self) -> io::Result<()> {
        Ok(())
    }
    /// The unit the node allocates in, if it has one (a qcow2 cluster).
    fn cluster_size(&self) -> Option<u64> {
        None
    }
    /// Whether the node stores [`IoOp::WriteCompressed`] (a qcow2 node):
    /// every other fails it with ENOTSUP, so a job asks first.
    fn supports_compressed_writes(&self) -> bool {
        false
    }
    /// The granularity of a bitmap made without one (QEMU's default: the
    /// cluster size between 4 KiB and 64 KiB, or 64 KiB).
    fn default_bitmap_granularity(&self) -> u64 {
        65536
    }
    /// How many layers down the bytes from `offset` are stored, and for how
    /// many of them (1 to `len`): 1 in this node, 2 in its backing file,
    /// and so on; 0 in none (NBD's `qemu:allocation-depth`). A node
    /// without a backing file stores every byte itself.
    fn allocation_depth(&self, _offset: u64, len: u64) -> io::Result<(u32, u64)> {
        Ok((1, len))
    }
    /// Puts `backing` under this node, which has none (QMP
    /// `blockdev-snapshot`: the node is a new overlay, opened with
    /// `backing=null` and used by nobody yet).
    fn attach_backing(&self, _backing: Arc<dyn BlockNode>) -> Result<(), AttachError> {
        Err(AttachError::Unsupported)
    }
    /// Writes `data`, what the node reads at `offset` now, into the parts
    /// of that range it does not hold itself (they read from its backing
    /// chain), as QEMU's copy-on-read does for `block-stream`; what it
    /// holds, and what a guest write is allocating meanwhile, is left
    /// alone, and a guest write after it lands on top. `offset` is cluster
    /// aligned, the range ends at a cluster boundary or at the end of the
    /// node, and it is at most 1 MiB.
    fn populate(&self, _offset: u64, _data: &[u8]) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("driver '{}' cannot copy from a backing chain", self.driver()),
        ))
    }
    /// Makes `backing` the node's backing node (`None`: none), and, with
    /// `header`, names it in the image (file name, format: "qcow2" or
    /// "raw"; `None` names none), durably, as `block-stream` does when it
    /// is done. Queues opened afterwards read through the new backing
    /// node; those already open may keep the old one, which the caller
    /// makes sure reads the same bytes.
    fn set_backing(&self, _backing: Option<Arc<dyn BlockNode>>, _header: Option<(String, String)>) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("driver '{}' has no backing file to change", self.driver()),
        ))
    }
    /// Names `header` (file name, format; `None`: none) in the image as
    /// its backing file, durably, the graph and what the node reads left
    /// as they are (QMP `change-backing-file`: the name counts from the
    /// image's next open).
    fn rename_backing_file(&self, _header: Option<(String, String)>) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("driver '{}' has no backing file to change", self.driver()),
        ))
    }
    /// Makes `backing` the node's backing node (`None`: none) in the graph
    /// only, the image's header left as it names its backing file (QMP
    /// `blockdev-reopen`). Queues opened before read through what the node
    /// had: call it with none in flight, and open them again afterwards.
    fn replace_backing(&self, _backing: Option<Arc<dyn BlockNode>>) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("driver '{}' has no backing file to change", self.driver()),
        ))
    }
    /// Makes a filter pass its requests to `child` instead (QMP
    /// `blockdev-mirror`'s `replaces`: the mirror's target takes the place
    /// of the node below the filter). Queues opened before keep the old
    /// child: call it with none in flight, and open them again afterwards.
    fn replace_filtered(&self, _child: Arc<dyn BlockNode>) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::Unsupported, format!("driver '{}' is not a filter", self.driver())))
    }
    /// The node's internal snapshots, if its format keeps them (qcow2).
    fn internal_snapshots(&self) -> Option<&dyn InternalSnapshots> {
        None
    }
    /// The throttle group whose limits the node applies, if it is a
    /// throttle filter.
    fn throttle_group(&self) -> Option<Arc<throttle::ThrottleGroup>> {
        None
    }
    /// The requests the node was sent through counted queues (by the nodes
    /// above it), if it counts them: the nodes of a [`BlockGraph`] do.
    fn stats(&self) -> Option<QueueSnapshot> {
        None
    }
}

/// Internal snapshots of a node's image (QMP's
/// `blockdev-snapshot-internal-sync`). Taking or deleting one needs the
/// node's queues stopped: no request may be in flight.
pub trait InternalSnapshots {
    /// The snapshots, in the image's order.
    fn list(&self) -> Vec<vsd_qcow2::SnapshotInfo>;
    /// Takes one named `name`, dated `date` (seconds, nanoseconds).
    fn create(&self, name: &str, date: (u32, u32)) -> io::Result<vsd_qcow2::SnapshotInfo>;
    /// Deletes the one with this id and name (either may be left out).
    fn delete(&self, id: Option<&str>, name: Option<&str>) -> io::Result<vsd_qcow2::SnapshotInfo>;
}

/// Writes a new, empty qcow2 image over `file` (emptied first), waiting on
/// the calling thread: QMP `blockdev-create`, not guests' requests.
pub fn create_qcow2(file: &dyn BlockNode, image: &vsd_qcow2::create::NewImage) -> io::Result<()> {
    drivers::create_qcow2(file, image)
}

/// The format of the image `node` holds, as QEMU probes it: "qcow2" if it
/// starts with the qcow2 magic, else "raw".
pub fn probe_format(node: &dyn BlockNode) -> io::Result<&'static str> {
    drivers::probe_format(node)
}

/// How a range of a node reads, as block status reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allocation {
    /// Stored bytes (or bytes the node cannot say anything more about).
    Data,
    /// Nothing stored: reads as zeroes.
    Hole,
}

/// A node's cache options, as QEMU's `BlockdevCacheInfo` reports them.
///
/// Every node takes them, as in QEMU, and children defined inline inherit
/// those they do not set; only file nodes act on them (the others reach
/// the host through a file node with options of its own).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cache {
    /// `cache.direct=on`: O_DIRECT, bypassing the host's page cache.
    pub direct: bool,
    /// `cache.no-flush=on`: flushes succeed without doing anything.
    pub no_flush: bool,
}

impl Cache {
    const KEYS: [&'static str; 2] = ["cache.direct", "cache.no-flush"];

    fn take(opts: &mut OptionMap) -> Result<Self, OptionError> {
        let direct = opts.take_bool("cache.direct")?.unwrap_or(false);
        let no_flush = opts.take_bool("cache.no-flush")?.unwrap_or(false);
        Ok(Self { direct, no_flush })
    }
}

/// Gives a child defined inline, in `role`, the options of its parent it
/// does not set itself, as QEMU's children inherit them: the cache
/// options, `read-only`, `auto-read-only`, `force-share`, and `active`
/// (such a child is handed over with its parent); a backing file is
/// read-only unless it says otherwise, and every such child takes
/// `discard=unmap` unless it says otherwise.
fn inherit(parent: &OptionMap, child: &mut OptionMap, role: &str) {
    if role == "backing" && !child.has("read-only") {
        child.insert("read-only", "on");
    }
    // The parent answers the discards its own option refuses, so the
    // child may act on those it passes down (QEMU's default too).
    if !child.has("discard") {
        child.insert("discard", "unmap");
    }
    for key in Cache::KEYS.into_iter().chain(["read-only", "active"]).chain(common::Common::INHERITED) {
        if let (Some(value), false) = (parent.get(key), child.has(key)) {
            child.insert(key, value);
        }
    }
}

/// Why a backing node could not be put under a node; the messages are
/// QEMU's for `blockdev-snapshot`.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The driver has no backing files.
    #[error("The overlay does not support backing images")]
    Unsupported,
    /// It has one already.
    #[error("The overlay already has a backing image")]
    HasBacking,
    /// The image could not be read again, or the backing node locked.
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// Why a node could not be added.
#[derive(Debug, thiserror::Error)]
pub enum GraphError {
    /// The option string is wrong.
    #[error(transparent)]
    Options(#[from] OptionError),
    /// `driver=` names no driver vsd has (QEMU's words, then vsd's drivers).
    #[error("{context}: Parameter 'driver' does not accept value '{driver}' (one of {})", drivers::DRIVERS.join(", "))]
    UnknownDriver {
        /// Which option string.
        context: String,
        /// The driver given.
        driver: String,
    },
    /// The node name is taken.
    #[error("{context}: a node named '{name}' already exists")]
    DuplicateNode {
        /// Which option string.
        context: String,
        /// The name.
        name: String,
    },
    /// A reference to a node that does not exist (yet).
    #[error("{context}: no node named '{name}' (define it with an earlier --blockdev)")]
    NoSuchNode {
        /// Which option string.
        context: String,
        /// The name.
        name: String,
    },
    /// An active node over an inactive child.
    #[error("{context}: {refusal}")]
    InactiveChild {
        /// Which option string.
        context: String,
        /// QEMU's words, which name no option string.
        refusal: InactiveChild,
    },
    /// The node's options do not fit together or with its child.
    #[error("{context}: {reason}")]
    Invalid {
        /// Which option string.
        context: String,
        /// What is wrong.
        reason: String,
    },
    /// The host refused something (opening the image, setting up I/O).
    #[error("{context}: {what}")]
    Host {
        /// Which option string.
        context: String,
        /// What was being done.
        what: String,
        /// The host's answer.
        #[source]
        source: io::Error,
    },
}

/// An active node cannot use an inactive one, which another process owns
/// (QEMU's rule): QEMU's words for a node, job filter or link that would.
#[derive(Debug, thiserror::Error)]
#[error("Inactive '{child}' can't be a {role} child of active '{parent}'")]
pub struct InactiveChild {
    /// The inactive node.
    pub child: String,
    /// Its role under the parent (`file`, `backing`, `target`).
    pub role: String,
    /// The active node that would use it.
    pub parent: String,
}

/// Why a node's activation could not be changed, in QEMU's words.
#[derive(Debug, thiserror::Error)]
pub enum ActivationError {
    /// No node has that name.
    #[error("Failed to find node with node-name='{0}'")]
    NoSuchNode(String),
    /// A node above it is still active, so it is still in use.
    #[error("Node has active parent node")]
    ActiveParent,
    /// A user that needs it active (an export without `allow-inactive`)
    /// uses it, or a node that would go inactive with it.
    #[error("Failed to inactivate node: Operation not permitted")]
    InUse,
    /// The driver could not write its state back or read it again.
    #[error("Failed to {what} node '{node}': {source}")]
    Host {
        /// "activate" or "inactivate".
        what: &'static str,
        /// The node.
        node: String,
        /// The host's answer.
        #[source]
        source: io::Error,
    },
}

/// Why a node could not be removed.
#[derive(Debug, thiserror::Error)]
pub enum RemoveError {
    /// No node has that name.
    #[error("no such node")]
    NoSuchNode,
    /// Another node uses it as a child (a backing node is QEMU's "backing hd").
    #[error("node is used as {} of '{parent}'", if *.role == "backing" { "backing hd" } else { .role })]
    Child {
        /// The role it has there (`file`, `backing`, ...).
        role: &'static str,
        /// The node using it.
        parent: String,
    },
    /// An export serves it (`user` names the export).
    #[error("node is exported by '{user}'")]
    Exported {
        /// The export, as the caller described it.
        user: String,
    },
}

/// The options by which a node names its children: a child is given by
/// name, or defined inline under the role's prefix.
pub const CHILD_ROLES: [&str; 4] = ["file", "backing", "data-file", "image"];

/// Where nodes send QMP events (BLOCK_IMAGE_CORRUPTED): the event's name
/// and data.
pub type EventSink = Arc<dyn Fn(&str, serde_json::Value) + Send + Sync>;

/// Where nodes find the objects they name by id: the daemon's `--object`s.
pub trait NodeObjects: Send + Sync {
    /// The bytes of secret `id` (`key-secret=ID`), or why there are none,
    /// in QEMU's words.
    fn secret(&self, id: &str) -> Result<Vec<u8>, String>;
    /// The client credentials `id` (`tls-creds=ID` of an NBD node), or why
    /// there are none.
    fn tls_client_creds(&self, id: &str) -> Result<Arc<vsd_net::ClientCreds>, String>;
    /// Throttle group `id` (`throttle-group=ID`), or why there is none.
    fn throttle_group(&self, id: &str) -> Result<Arc<throttle::ThrottleGroup>, String>;
}

/// The nodes defined so far, by name.
#[derive(Default)]
pub struct BlockGraph {
    nodes: Vec<Arc<dyn BlockNode>>,
    /// The options each node was added with, by the same index.
    options: Vec<OptionMap>,
    /// Names given to nodes defined inline without one (`#block<n>`, as QEMU).
    implicit: u64,
    objects: Option<Arc<dyn NodeObjects>>,
    events: Option<EventSink>,
}

impl BlockGraph {
    /// An empty graph.
    pub fn new() -> Self {
        Self::default()
    }

    /// Gives nodes added from now on a way to send events.
    pub fn set_events(&mut self, events: EventSink) {
        self.events = Some(events);
    }

    /// Where nodes send events, if anywhere.
    fn events(&self) -> Option<EventSink> {
        self.events.clone()
    }

    /// Gives nodes added from now on the daemon's objects.
    pub fn set_objects(&mut self, objects: Arc<dyn NodeObjects>) {
        self.objects = Some(objects);
    }

    /// The node option `role` names (`file=NODE`), taken from `opts`.
    fn child(&self, opts: &mut OptionMap, role: &str) -> Result<Arc<dyn BlockNode>, GraphError> {
        let name = opts.require(role)?;
        self.get(&name).ok_or_else(|| GraphError::NoSuchNode { context: opts.context().into(), name })
    }

    /// The bytes of secret `id`.
    fn secret(&self, id: &str) -> Result<Vec<u8>, String> {
        match &self.objects {
            Some(objects) => objects.secret(id),
            None => Err(format!("No secret with id '{id}'")),
        }
    }

    /// The client credentials `id`.
    fn tls_client_creds(&self, id: &str) -> Result<Arc<vsd_net::ClientCreds>, String> {
        match &self.objects {
            Some(objects) => objects.tls_client_creds(id),
            None => Err(format!("No TLS credentials with id '{id}'")),
        }
    }

    /// Throttle group `id`.
    fn throttle_group(&self, id: &str) -> Result<Arc<throttle::ThrottleGroup>, String> {
        match &self.objects {
            Some(objects) => objects.throttle_group(id),
            None => Err(format!("Throttle group '{id}' does not exist")),
        }
    }

    /// Builds a node from `--blockdev` options and adds it, with the
    /// children it defines inline (`file.driver=...`, or a JSON object
    /// under `file`), which are named `#block<n>` unless they say.
    pub fn add(&mut self, opts: OptionMap) -> Result<Arc<dyn BlockNode>, GraphError> {
        let before = self.nodes.len();
        let added = self.add_with_children(opts);
        if added.is_err() {
            // The inline children of a node that failed go with it.
            self.nodes.truncate(before);
            self.options.truncate(before);
        }
        added
    }

    fn add_with_children(&mut self, mut opts: OptionMap) -> Result<Arc<dyn BlockNode>, GraphError> {
        for role in CHILD_ROLES {
            let Some(mut child) = opts.take_group(role) else { continue };
            if opts.has(role) {
                return Err(GraphError::Invalid {
                    context: opts.context().into(),
                    reason: format!("'{role}' is given both by name and inline"),
                });
            }
            inherit(&opts, &mut child, role);
            if !child.has("node-name") {
                child.insert("node-name", self.implicit_name());
            }
            let node = self.add_with_children(child)?;
            opts.insert(role, node.name());
        }
        let given = opts.clone();
        let context = opts.context().to_string();
        let driver = opts.require("driver")?;
        let name = opts.require("node-name")?;
        if self.get(&name).is_some() {
            return Err(GraphError::DuplicateNode { context, name });
        }
        let cache = Cache::take(&mut opts)?;
        let common = common::Common::take(&mut opts)?;
        let active = opts.take_bool("active")?.unwrap_or(true);
        if active {
            self.refuse_inactive_children(&opts, &name)?;
        }
        let bitmaps = Arc::<dirty::DirtyBitmaps>::default();
        bitmaps.write_threshold().attach(&name, self.events(), common.acts_on_discards);
        let opened = drivers::open(&driver, name, cache, active, &bitmaps, &mut opts, self)?;
        let node: Arc<dyn BlockNode> = Arc::new(accounting::AccountedNode::new(opened, cache, common, active, bitmaps));
        common::Common::drop_unused(&mut opts);
        opts.finish()?;
        self.nodes.push(node.clone());
        self.options.push(given);
        Ok(node)
    }

    /// An active node cannot sit on an inactive one (QEMU's rule and
    /// wording): it would use an image another process owns.
    fn refuse_inactive_children(&self, opts: &OptionMap, name: &str) -> Result<(), GraphError> {
        for role in CHILD_ROLES {
            if let Some(child) = opts.get(role).and_then(|child| self.get(child)).filter(|c| !c.active()) {
                let refusal = InactiveChild { child: child.name().into(), role: role.into(), parent: name.into() };
                return Err(GraphError::InactiveChild { context: opts.context().into(), refusal });
            }
        }
        Ok(())
    }

    /// Activates or inactivates node `name`, as QMP `blockdev-set-active`
    /// does (every node if `None`). Inactivating a node inactivates the
    /// children no active node uses any more; it is refused while an active
    /// node uses it, or while any node it would inactivate is `pinned` (an
    /// export needs it active). Activating a node activates its children
    /// first. Call it with no request in flight on the nodes concerned.
    pub fn set_active(
        &self,
        name: Option<&str>,
        active: bool,
        pinned: impl Fn(&str) -> bool,
    ) -> Result<(), ActivationError> {
        let targets: Vec<Arc<dyn BlockNode>> = match name {
            Some(name) => vec![self.get(name).ok_or_else(|| ActivationError::NoSuchNode(name.into()))?],
            // Parents were added after their children: these go first.
            None => self.nodes.iter().rev().cloned().collect(),
        };
        if active {
            return targets.iter().try_for_each(activate);
        }
        // Every node going inactive, parents before children, all checked
        // before any is touched.
        let mut going = Vec::new();
        for node in &targets {
            if self.has_active_parent(&**node, &going) {
                return Err(ActivationError::ActiveParent);
            }
            self.collect_inactivation(node, &mut going);
        }
        if going.iter().any(|node| pinned(node.name())) {
            return Err(ActivationError::InUse);
        }
        for node in going {
            node.inactivate().map_err(|source| ActivationError::Host {
                what: "inactivate",
                node: node.name().into(),
                source,
            })?;
        }
        Ok(())
    }

    /// Whether a node that stays active uses `node` (those in `going` will not).
    fn has_active_parent(&self, node: &dyn BlockNode, going: &[Arc<dyn BlockNode>]) -> bool {
        let uses = |parent: &Arc<dyn BlockNode>| parent.children().iter().any(|(_, c)| c.name() == node.name());
        self.nodes.iter().any(|p| p.active() && !going.iter().any(|g| g.name() == p.name()) && uses(p))
    }

    /// Adds `node` to `going`, and its children that no active node would use.
    fn collect_inactivation(&self, node: &Arc<dyn BlockNode>, going: &mut Vec<Arc<dyn BlockNode>>) {
        if !node.active() || going.iter().any(|g| g.name() == node.name()) {
            return;
        }
        going.push(node.clone());
        for (_, child) in node.children() {
            if !self.has_active_parent(&*child, going) {
                self.collect_inactivation(&child, going);
            }
        }
    }

    /// A new name for a node the user did not name (`#block<n>`, as QEMU
    /// names them): inline children, and the nodes QMP commands open from
    /// file names (`drive-mirror`'s target).
    pub fn implicit_name(&mut self) -> String {
        self.implicit += 1;
        format!("#block{}", self.implicit)
    }

    /// The node called `name`.
    pub fn get(&self, name: &str) -> Option<Arc<dyn BlockNode>> {
        self.nodes.iter().find(|n| n.name() == name).cloned()
    }

    /// The options node `name` was added with, its inline children named
    /// (`file=#block1`) and their inherited options given to them.
    pub fn options(&self, name: &str) -> Option<&OptionMap> {
        self.nodes.iter().position(|n| n.name() == name).map(|at| &self.options[at])
    }

    /// Removes the node called `name`, unless another node or an export
    /// still uses it (`exported` names the export serving a node, if any).
    pub fn remove(&mut self, name: &str, exported: impl Fn(&str) -> Option<String>) -> Result<(), RemoveError> {
        self.remove_node(name, &exported)
    }

    fn remove_node(&mut self, name: &str, exported: &dyn Fn(&str) -> Option<String>) -> Result<(), RemoveError> {
        let index = self.nodes.iter().position(|n| n.name() == name).ok_or(RemoveError::NoSuchNode)?;
        if let Some(used) = self.parent(name) {
            return Err(used);
        }
        if let Some(export) = exported(name) {
            return Err(RemoveError::Exported { user: export });
        }
        let node = self.nodes.remove(index);
        self.options.remove(index);
        // Children defined inline belong to their parent: they go with it
        // unless something else still uses them.
        for (_, child) in node.children() {
            if child.name().starts_with('#') {
                let _ = self.remove_node(child.name(), exported);
            }
        }
        Ok(())
    }

    /// A node that has `name` as a child, as [`RemoveError::Child`] says it.
    pub fn parent(&self, name: &str) -> Option<RemoveError> {
        self.nodes.iter().find_map(|p| {
            let (role, _) = p.children().into_iter().find(|(_, c)| c.name() == name)?;
            Some(RemoveError::Child { role, parent: p.name().to_string() })
        })
    }

    /// Every node, in the order they were added.
    pub fn nodes(&self) -> impl Iterator<Item = &Arc<dyn BlockNode>> {
        self.nodes.iter()
    }
}

/// Activates `node`, its children first.
fn activate(node: &Arc<dyn BlockNode>) -> Result<(), ActivationError> {
    for (_, child) in node.children() {
        activate(&child)?;
    }
    if node.active() {
        return Ok(());
    }
    node.activate().map_err(|source| ActivationError::Host { what: "activate", node: node.name().into(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add(graph: &mut BlockGraph, text: &str) -> Result<Arc<dyn BlockNode>, GraphError> {
        graph.add(OptionMap::parse("--blockdev", text).unwrap())
    }

    fn names(graph: &BlockGraph) -> Vec<&str> {
        graph.nodes().map(|n| n.name()).collect()
    }

    #[test]
    fn children_defined_inline_become_nodes_of_their_own() {
        let mut graph = BlockGraph::new();
        let raw = add(&mut graph, "driver=raw,node-name=r,file.driver=null-co,file.size=1M").unwrap();
        assert_eq!(names(&graph), ["#block1", "r"]);
        assert_eq!(raw.children()[0].1.name(), "#block1");
        assert_eq!(raw.size(), 1 << 20);
        assert_eq!(graph.options("r").unwrap().get("file"), Some("#block1"), "kept as given, the child by name");
        assert_eq!(graph.options("#block1").unwrap().get("size"), Some("1M"));
        let json =
            r#"{"driver": "raw", "node-name": "j", "file": {"driver": "null-co", "node-name": "n", "size": 4096}}"#;
        add(&mut graph, json).unwrap();
        assert_eq!(names(&graph), ["#block1", "r", "n", "j"]);
    }

    #[test]
    fn every_node_takes_cache_options_and_inline_children_inherit_them() {
        let dir = std::env::temp_dir().join(format!("vsd-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let image = dir.join("img");
        std::fs::write(&image, [0u8; 4096]).unwrap();
        let file = format!("file.driver=file,file.filename={}", image.display());
        let unsafe_cache = Cache { direct: false, no_flush: true };
        let mut graph = BlockGraph::new();

        let raw = add(&mut graph, &format!("driver=raw,node-name=r,cache.no-flush=on,{file}")).unwrap();
        assert_eq!(raw.cache(), unsafe_cache);
        assert_eq!(raw.children()[0].1.cache(), unsafe_cache, "an inline child inherits");

        let own = add(&mut graph, &format!("driver=raw,node-name=o,cache.no-flush=on,{file},file.cache.no-flush=off"));
        assert_eq!(own.unwrap().children()[0].1.cache(), Cache::default(), "an inline child's own setting wins");

        let read_only = add(&mut graph, &format!("driver=raw,node-name=ro,read-only=on,{file}")).unwrap();
        assert!(read_only.children()[0].1.read_only(), "an inline child inherits read-only");

        add(&mut graph, &format!("driver=file,node-name=f,filename={}", image.display())).unwrap();
        let named = add(&mut graph, "driver=raw,node-name=n,file=f,cache.no-flush=on").unwrap();
        assert_eq!(named.cache(), unsafe_cache);
        assert_eq!(graph.get("f").unwrap().cache(), Cache::default(), "a child given by name keeps its own");

        let null = add(&mut graph, "driver=null-co,node-name=z,size=4096,cache.direct=on").unwrap();
        assert_eq!(null.cache(), Cache { direct: true, no_flush: false });
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn block_status_finds_holes_through_raw_windows() {
        use std::os::unix::fs::FileExt;
        let dir = std::env::temp_dir().join(format!("vsd-status-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let image = dir.join("sparse");
        let file = std::fs::File::create(&image).unwrap();
        file.set_len(1 << 20).unwrap();
        file.write_all_at(&[1u8; 64 << 10], 256 << 10).unwrap();
        let mut graph = BlockGraph::new();
        let f = add(&mut graph, &format!("driver=file,node-name=f,filename={}", image.display())).unwrap();
        if f.block_status(0, 1 << 20).unwrap() == (Allocation::Data, 1 << 20) {
            eprintln!("skipped: the temporary directory's file system reports no holes");
            return;
        }
        assert_eq!(f.block_status(0, 1 << 20).unwrap(), (Allocation::Hole, 256 << 10));
        assert_eq!(f.block_status(256 << 10, 768 << 10).unwrap(), (Allocation::Data, 64 << 10));
        assert_eq!(f.block_status(260 << 10, 4096).unwrap(), (Allocation::Data, 4096), "clamped to the range");
        assert_eq!(f.block_status(320 << 10, 704 << 10).unwrap(), (Allocation::Hole, 704 << 10));
        let raw = add(&mut graph, "driver=raw,node-name=r,file=f,offset=128K,size=512K").unwrap();
        assert_eq!(raw.block_status(0, 512 << 10).unwrap(), (Allocation::Hole, 128 << 10));
        assert_eq!(raw.block_status(128 << 10, 384 << 10).unwrap(), (Allocation::Data, 64 << 10));
        let zeroes = add(&mut graph, "driver=null-co,node-name=z,size=1M,read-zeroes=on").unwrap();
        assert_eq!(zeroes.block_status(4096, 8192).unwrap(), (Allocation::Hole, 8192));
        let null = add(&mut graph, "driver=null-co,node-name=n,size=1M").unwrap();
        assert_eq!(null.block_status(0, 8192).unwrap(), (Allocation::Data, 8192), "buffers left as they were");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn only_page_cached_files_and_raw_windows_over_them_name_their_host_file() {
        let dir = std::env::temp_dir().join(format!("vsd-host-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let image = dir.join("img");
        std::fs::write(&image, [0u8; 1 << 20]).unwrap();
        let mut graph = BlockGraph::new();
        let f = add(&mut graph, &format!("driver=file,node-name=f,filename={}", image.display())).unwrap();
        let at = |node: &Arc<dyn BlockNode>, offset, len| node.host_file(offset, len).map(|(_, at)| at);
        assert_eq!(at(&f, 4096, 8192), Some(4096));
        assert_eq!(at(&f, (1 << 20) - 4096, 8192), None, "past the end");
        let raw = add(&mut graph, "driver=raw,node-name=r,file=f,offset=128K,size=512K").unwrap();
        assert_eq!(at(&raw, 0, 4096), Some(128 << 10), "shifted by the window");
        assert_eq!(at(&raw, (512 << 10) - 4096, 4096), Some(636 << 10));
        assert_eq!(at(&raw, (512 << 10) - 4096, 8192), None, "past the window, though inside the file");
        assert_eq!(at(&raw, u64::MAX, 2), None, "a range that wraps");
        let direct =
            format!("driver=raw,node-name=d,cache.direct=on,file.driver=file,file.filename={}", image.display());
        if let Ok(direct) = add(&mut graph, &direct) {
            assert_eq!(at(&direct, 0, 4096), None, "O_DIRECT bypasses the page cache");
        }
        let null = add(&mut graph, "driver=null-co,node-name=n,size=1M").unwrap();
        assert_eq!(at(&null, 0, 4096), None);
        let over_null = add(&mut graph, "driver=raw,node-name=rn,file=n").unwrap();
        assert_eq!(at(&over_null, 0, 4096), None, "raw over a node without a host file");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_node_takes_its_inline_children_with_it() {
        let mut graph = BlockGraph::new();
        let bogus = add(&mut graph, "driver=raw,node-name=r,file.driver=null-co,file.size=1M,bogus=1");
        assert!(matches!(bogus, Err(GraphError::Options(OptionError::Unknown { .. }))));
        let bad_child = add(&mut graph, "driver=raw,node-name=r,file.driver=null-co,file.size=1M,file.bogus=1");
        let message = bad_child.err().unwrap().to_string();
        assert!(message.contains("node-name=r file: unknown parameter 'bogus'"), "{message}");
        let both = add(&mut graph, "driver=raw,node-name=r,file=x,file.driver=null-co");
        assert!(both.err().unwrap().to_string().contains("both by name and inline"));
        assert!(names(&graph).is_empty());
    }

    #[test]
    fn nodes_are_handed_over_with_their_children_and_never_under_an_active_parent() {
        let mut graph = BlockGraph::new();
        add(&mut graph, "driver=null-co,node-name=n,size=1M").unwrap();
        add(&mut graph, "driver=raw,node-name=r,file=n").unwrap();
        let active = |graph: &BlockGraph| ["n", "r"].map(|name| graph.get(name).unwrap().active());
        let no_pins = |_: &str| false;

        let refused = graph.set_active(Some("n"), false, no_pins);
        assert!(matches!(refused, Err(ActivationError::ActiveParent)), "{refused:?}");
        let pinned = graph.set_active(Some("r"), false, |name| name == "n");
        assert_eq!(pinned.unwrap_err().to_string(), "Failed to inactivate node: Operation not permitted");
        assert_eq!(active(&graph), [true, true], "a refusal changes nothing");

        graph.set_active(Some("r"), false, no_pins).unwrap();
        assert_eq!(active(&graph), [false, false], "the child goes with its only parent");
        let over = add(&mut graph, "driver=raw,node-name=o,file=n").err().unwrap().to_string();
        assert!(over.contains("Inactive 'n' can't be a file child of active 'o'"), "{over}");
        add(&mut graph, "driver=raw,node-name=o,file=n,active=off").unwrap();
        graph.set_active(Some("r"), true, no_pins).unwrap();
        assert_eq!(active(&graph), [true, true], "activating a node activates its children first");
        assert!(!graph.get("o").unwrap().active(), "other parents stay as they were");

        let inline = add(&mut graph, "driver=raw,node-name=i,active=off,file.driver=null-co,file.size=1M").unwrap();
        assert!(!inline.children()[0].1.active(), "an inline child is handed over with its parent");
        graph.set_active(None, true, no_pins).unwrap();
        assert!(graph.nodes().all(|node| node.active()));
        graph.set_active(None, false, no_pins).unwrap();
        assert!(graph.nodes().all(|node| !node.active()), "every node, parents first");
    }

    #[test]
    fn removing_a_node_removes_its_unnamed_inline_children() {
        let mut graph = BlockGraph::new();
        add(&mut graph, "driver=raw,node-name=r,file.driver=null-co,file.size=1M").unwrap();
        add(&mut graph, "driver=raw,node-name=s,file.driver=null-co,file.size=1M,file.node-name=kept").unwrap();
        let busy = graph.remove("#block1", |_| None);
        assert!(matches!(busy, Err(RemoveError::Child { role: "file", .. })), "a child in use stays");
        graph.remove("r", |_| None).unwrap();
        graph.remove("s", |_| None).unwrap();
        assert_eq!(names(&graph), ["kept"], "a child the user named is the user's to remove");
        assert!(graph.options("r").is_none() && graph.options("kept").is_some(), "options go with their node");
    }
}
