//! `driver=qcow2`: the qcow2 format on top of a `file` child, with its
//! backing chain and external data file opened from the header as QEMU
//! does (inheriting the node's cache options), or given as nodes.

mod copyup;
mod flusher;
mod health;
mod loads;
mod queue;

use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, Weak};
use std::time::Duration;

use vsd_qcow2::buf::AlignedBuf;
use vsd_qcow2::{CorruptMetadata, FormatError, Image, MapMemo, Mapping, StoredBitmap, SyncIo};

use super::child::ChildQueue;
use super::file::FileNode;
use crate::common::DISCARD;
use crate::dirty::{DirtyBitmaps, Persisted};
use crate::options::OptionMap;
use crate::{AttachError, BlockGraph, BlockNode, Cache, Claim, ClaimGuard, GraphError, IoQueue, LockError, Perms};
use flusher::Flusher;
use health::Health;
use queue::Qcow2Queue;

/// Backing chains deeper than this are refused (QEMU has no fixed limit,
/// but a chain this long is a loop or a mistake).
const MAX_CHAIN: usize = 256;

pub(crate) struct Qcow2Node {
    name: String,
    /// The image as last read from its file. Inactive (handed to another
    /// process during a migration), it is open read-only, with nothing
    /// cached that the other process could make stale; activating reads
    /// it again. Queues hold the image they were opened with.
    image: RwLock<Arc<Image>>,
    /// How to open it again.
    options: RwLock<vsd_qcow2::Options>,
    cache_clean_interval: u64,
    file: Arc<dyn BlockNode>,
    data: Option<Arc<dyn BlockNode>>,
    /// Set at open, later by `blockdev-snapshot`, or replaced when a
    /// `block-stream` ends.
    backing: RwLock<Option<Arc<dyn BlockNode>>>,
    /// What the node holds of its images while active (image locks).
    claims: Mutex<Claims>,
    /// The graph node's dirty bitmaps, whose persistent ones live in the
    /// image (loaded while active and writable, stored when handed over).
    bitmaps: Arc<DirtyBitmaps>,
    /// Whether the metadata was found corrupt, and whom to tell.
    health: Arc<Health>,
    /// Does the queues' flushes that have metadata to write.
    flusher: Arc<Flusher>,
    /// `discard=unmap`: without it the node answers discards at once and
    /// never deallocates for a write-zeroes, as QEMU's nodes.
    acts_on_discards: bool,
}

/// What a qcow2 node needs of its image file (and external data file), as
/// QEMU's qcow2 driver takes it: writable, consistent reads, writes and
/// resizes; read-only, reads only; either way nobody else may write or
/// resize it, or the metadata would change under the node.
fn file_claim(writable: bool) -> Claim {
    let held = if writable { Perms::READ.with(Perms::WRITE).with(Perms::RESIZE) } else { Perms::READ };
    Claim { held, unshared: Perms::WRITE.with(Perms::RESIZE) }
}

/// What it needs of its backing node: reads, whoever else uses it.
const BACKING_CLAIM: Claim = Claim { held: Perms::READ, unshared: Perms::NONE };

/// The claims a node holds while active: on its image file and data file,
/// and on its backing node, which may be replaced.
#[derive(Default)]
struct Claims {
    image: Vec<ClaimGuard>,
    backing: Vec<ClaimGuard>,
}

/// Where the backing file comes from.
enum Backing {
    /// The header's backing file name and format.
    FromHeader,
    /// `backing=null`: none, even if the header names one.
    Null,
    /// `backing=NODE`.
    Node(Arc<dyn BlockNode>),
}

/// Runtime options, also used for implicitly opened backing images.
#[derive(Clone, Default)]
struct Settings {
    read_only: bool,
    /// The node's `cache.direct` and `cache.no-flush`, which the files it
    /// opens from its header inherit, as in QEMU.
    cache: Cache,
    l2_cache_bytes: Option<u64>,
    l2_cache_entry_bytes: Option<u64>,
    discard_no_unref: bool,
    pass_discard: bool,
    lazy_refcounts: Option<bool>,
    refcount_cache_bytes: Option<u64>,
    /// Seconds between drops of unused cache entries (0: never).
    cache_clean_interval: u64,
    /// Opened inactive: read-only until activated.
    inactive: bool,
    /// `discard=unmap`. Images opened from a header have it, as children
    /// QEMU opens itself.
    acts_on_discards: bool,
}

impl Qcow2Node {
    /// Opens the node; an inactive node (`active=off`) reads the image but
    /// writes nothing to it until it is activated.
    pub(crate) fn open(
        name: String,
        cache: Cache,
        active: bool,
        bitmaps: &Arc<DirtyBitmaps>,
        opts: &mut OptionMap,
        graph: &BlockGraph,
    ) -> Result<Self, GraphError> {
        let context = opts.context().to_string();
        let node =
            |name: String| graph.get(&name).ok_or_else(|| GraphError::NoSuchNode { context: context.clone(), name });
        let file = node(opts.require("file")?)?;
        let backing = match opts.take("backing") {
            None => Backing::FromHeader,
            Some(b) if b == "null" => Backing::Null,
            Some(b) => Backing::Node(node(b)?),
        };
        let data_file = opts.take("data-file").map(node).transpose()?;
        let settings = Settings {
            read_only: opts.take_bool("read-only")?.unwrap_or(false) || file.read_only(),
            cache,
            l2_cache_bytes: opts.take_size("l2-cache-size")?,
            l2_cache_entry_bytes: opts.take_size("l2-cache-entry-size")?,
            discard_no_unref: opts.take_bool("discard-no-unref")?.unwrap_or(false),
            pass_discard: opts.take_bool("pass-discard-request")?.unwrap_or(true),
            lazy_refcounts: opts.take_bool("lazy-refcounts")?,
            refcount_cache_bytes: opts.take_size("refcount-cache-size")?,
            // QEMU's default on Linux: 10 minutes.
            cache_clean_interval: opts.take_u64("cache-clean-interval")?.unwrap_or(600),
            inactive: !active,
            acts_on_discards: matches!(opts.take_choice("discard", DISCARD)?, Some("unmap" | "on")),
        };
        let mut node = Self::build(name, &context, file, backing, data_file, &settings, &mut Vec::new())?;
        node.bitmaps = bitmaps.clone();
        node.health = Arc::new(Health::new(&node.name, graph.events()));
        if active {
            node.load_bitmaps().map_err(|source| GraphError::Host {
                context,
                what: "cannot load its dirty bitmaps".into(),
                source,
            })?;
        }
        Ok(node)
    }

    /// Opens the image on `file`; `chain` holds the files of the images
    /// above it, to catch loops.
    fn build(
        name: String,
        context: &str,
        file: Arc<dyn BlockNode>,
        backing: Backing,
        data_file: Option<Arc<dyn BlockNode>>,
        settings: &Settings,
        chain: &mut Vec<PathBuf>,
    ) -> Result<Self, GraphError> {
        let invalid = |reason: String| GraphError::Invalid { context: context.to_string(), reason };
        let host = |what: String, source: io::Error| GraphError::Host { context: context.to_string(), what, source };
        let path = file.filename().map(|f| std::fs::canonicalize(f).unwrap_or_else(|_| PathBuf::from(f)));
        if let Some(path) = &path {
            if chain.contains(path) {
                return Err(invalid(format!("the backing chain loops back to '{}'", path.display())));
            }
            if chain.len() >= MAX_CHAIN {
                return Err(invalid(format!("backing chain deeper than {MAX_CHAIN} images")));
            }
            chain.push(path.clone());
        }

        let has_backing = match &backing {
            Backing::FromHeader => None,
            Backing::Null => Some(false),
            Backing::Node(_) => Some(true),
        };
        let options = vsd_qcow2::Options {
            writable: !settings.read_only,
            l2_cache_bytes: settings.l2_cache_bytes,
            l2_cache_entry_bytes: settings.l2_cache_entry_bytes,
            discard_no_unref: settings.discard_no_unref,
            pass_discard: settings.pass_discard,
            has_backing,
            lazy_refcounts: settings.lazy_refcounts,
            refcount_cache_bytes: settings.refcount_cache_bytes,
            // A writable image keeps its persistent bitmaps up to date.
            keep_bitmaps: !settings.read_only,
        };
        let locked = |e: LockError| invalid(e.to_string());
        // Before anything is read or written: another process may own it.
        let file_claims =
            if settings.inactive { Vec::new() } else { file.claim(file_claim(options.writable)).map_err(locked)? };
        let opened = if settings.inactive { read_only(&options) } else { options.clone() };
        let image = read_image(&*file, opened).map_err(|e| match e {
            FormatError::Io(e) => host("cannot read the image".into(), e),
            e => invalid(e.to_string()),
        })?;
        let header = image.header().clone();

        let backing = match backing {
            Backing::Null => None,
            Backing::Node(node) => Some(node),
            Backing::FromHeader => match &header.backing_file {
                None => None,
                Some(name) => {
                    let path = resolve(path.as_deref(), name).map_err(invalid)?;
                    Some(open_backing(&path, header.backing_format.as_deref(), settings, chain).map_err(|e| {
                        invalid(format!("cannot open backing file '{}': {}", path.display(), error_chain(&e)))
                    })?)
                }
            },
        };

        let data = match (header.has_data_file(), data_file, &header.data_file) {
            (false, Some(_), _) => {
                return Err(invalid("data-file given, but the image has no external data file".into()));
            }
            (false, None, _) => None,
            (true, Some(node), _) => Some(node),
            (true, None, Some(name)) => {
                let path = resolve(path.as_deref(), name).map_err(invalid)?;
                Some(open_file(&path, settings, settings.read_only).map_err(|e| {
                    invalid(format!("cannot open external data file '{}': {}", path.display(), error_chain(&e)))
                })?)
            }
            (true, None, None) => {
                return Err(invalid("the image needs an external data file and names none: give data-file=".into()));
            }
        };
        let health = Arc::new(Health::new(&name, None));
        let flusher = Arc::new(Flusher::new(file.clone(), data.clone()));
        let node = Self {
            name,
            image: RwLock::new(Arc::new(image)),
            options: RwLock::new(options),
            cache_clean_interval: settings.cache_clean_interval,
            file,
            data,
            backing: RwLock::new(backing),
            claims: Mutex::new(Claims { image: file_claims, backing: Vec::new() }),
            bitmaps: Arc::default(),
            health,
            flusher,
            acts_on_discards: settings.acts_on_discards,
        };
        if !settings.inactive {
            let data = node.claim_data_file(!settings.read_only).map_err(locked)?;
            let backing = node.backing().map(|b| b.claim(BACKING_CLAIM)).transpose().map_err(locked)?;
            let mut claims = node.claims();
            claims.image.extend(data);
            claims.backing = backing.unwrap_or_default();
        }
        node.clean_caches().map_err(|e| host("cannot start the cache cleaner".into(), e))?;
        Ok(node)
    }

    fn claims(&self) -> MutexGuard<'_, Claims> {
        self.claims.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes what the node needs of its images, writable or not (see
    /// [`file_claim`]).
    fn claim_images(&self, writable: bool) -> Result<Claims, LockError> {
        let mut image = self.file.claim(file_claim(writable))?;
        image.extend(self.claim_data_file(writable)?);
        let backing = self.backing().map(|b| b.claim(BACKING_CLAIM)).transpose()?.unwrap_or_default();
        Ok(Claims { image, backing })
    }

    /// Takes what the node needs of its external data file.
    fn claim_data_file(&self, writable: bool) -> Result<Vec<ClaimGuard>, LockError> {
        match &self.data {
            Some(data) => data.claim(file_claim(writable)),
            None => Ok(Vec::new()),
        }
    }

    /// The backing node, if any.
    fn backing(&self) -> Option<Arc<dyn BlockNode>> {
        self.backing.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// How the image is opened.
    fn options(&self) -> vsd_qcow2::Options {
        self.options.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The image as it stands.
    fn image(&self) -> Arc<Image> {
        self.image.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Reads the image from its file again, writable or not, in place of
    /// the one open, with empty caches.
    fn reopen(&self, options: vsd_qcow2::Options) -> io::Result<()> {
        let image = read_image(&*self.file, options)?;
        *self.image.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(image);
        self.clean_caches()
    }

    /// Reads the image again writable, with what a writable image needs:
    /// the claims that let it write its files (which must be writable
    /// already), and its persistent bitmaps. On a failure the image is
    /// read-only again, with the claims it had.
    fn reopen_writable(&self) -> io::Result<()> {
        if self.file.read_only() || self.data.as_ref().is_some_and(|d| d.read_only()) {
            return Err(io::Error::new(io::ErrorKind::ReadOnlyFilesystem, "Block node is read-only"));
        }
        let before = self.options();
        let writable = vsd_qcow2::Options { writable: true, keep_bitmaps: true, ..before.clone() };
        // Beside the read-only claims until the image is open writable.
        let claims = self.claim_images(true).map_err(io::Error::other)?;
        self.reopen(writable.clone())?;
        *self.options.write().unwrap_or_else(PoisonError::into_inner) = writable;
        let old = std::mem::replace(&mut *self.claims(), claims);
        self.load_bitmaps().inspect_err(|_| {
            // Nothing of the bitmaps is stored back: they did not load.
            let _ = self.with_io(|image, io| image.close(io));
            *self.options.write().unwrap_or_else(PoisonError::into_inner) = before.clone();
            let _ = self.reopen(before.clone());
            *self.claims() = old;
        })
    }

    /// Reads the image again read-only, once its metadata and bitmaps are
    /// written back and it is marked clean, as at a clean stop; then it
    /// claims only reads. On a failure it stays writable, its bitmaps
    /// loaded again.
    fn reopen_read_only(&self) -> io::Result<()> {
        self.close()?;
        self.bitmaps.drop_persistent();
        let options = vsd_qcow2::Options { writable: false, keep_bitmaps: false, ..self.options() };
        let reopened = self.claim_images(false).map_err(io::Error::other).and_then(|claims| {
            self.reopen(options.clone())?;
            Ok(claims)
        });
        match reopened {
            Ok(claims) => {
                *self.options.write().unwrap_or_else(PoisonError::into_inner) = options;
                *self.claims() = claims;
                Ok(())
            }
            Err(e) => {
                let _ = self.load_bitmaps();
                Err(e)
            }
        }
    }

    /// Reads the image again knowing whether it has a backing file, as a
    /// clean stop and a new open would: on a failure, the image open stays.
    fn read_again(&self, has_backing: bool) -> io::Result<()> {
        self.close()?;
        self.bitmaps.drop_persistent();
        let options = vsd_qcow2::Options { has_backing: Some(has_backing), ..self.options() };
        let reread = self.reopen(options.clone());
        if reread.is_ok() {
            *self.options.write().unwrap_or_else(PoisonError::into_inner) = options;
        }
        // The bitmaps of whichever image is open now.
        let loaded = self.load_bitmaps();
        reread.and(loaded)
    }

    /// Loads the image's persistent bitmaps and flags them in use, so that
    /// a crash leaves them inconsistent (QEMU's protocol); none from an
    /// image opened read-only.
    fn load_bitmaps(&self) -> io::Result<()> {
        if !self.options().writable {
            return Ok(());
        }
        let stored = self.with_io(|image, io| {
            let stored = image.load_bitmaps(io)?;
            image.mark_bitmaps_in_use(io)?;
            Ok(stored)
        })?;
        let persisted = stored.into_iter().map(|b| Persisted {
            name: b.name,
            granularity: b.granularity,
            enabled: b.enabled,
            inconsistent: b.in_use,
            words: b.words,
        });
        self.bitmaps.load(self.image().size(), persisted.collect());
        Ok(())
    }

    /// Writes the persistent bitmaps to the image: with their bits at a
    /// clean stop, or (`in_use`) only flagged, after one was removed.
    fn store_bitmaps(&self, in_use: bool) -> io::Result<()> {
        let stored: Vec<StoredBitmap> = self
            .bitmaps
            .persistent(in_use)
            .into_iter()
            .map(|p| StoredBitmap {
                name: p.name,
                granularity: p.granularity,
                in_use: p.inconsistent,
                enabled: p.enabled,
                words: p.words,
            })
            .collect();
        self.with_io(|image, io| image.store_bitmaps(io, &stored))
    }

    /// How the image maps the bytes from `offset`, and for how many of them.
    fn mapping(&self, offset: u64, len: u64) -> io::Result<(Mapping, u64)> {
        let extent = self.with_io(|image, io| image.map(&mut MapMemo::default(), &mut *io.meta, offset, len))?;
        Ok((extent.mapping, extent.len.clamp(1, len)))
    }

    /// Drops unused cache entries of the image now open every
    /// `cache-clean-interval` seconds, for as long as it stays open.
    fn clean_caches(&self) -> io::Result<()> {
        if self.cache_clean_interval == 0 {
            return Ok(());
        }
        clean_caches_every(Duration::from_secs(self.cache_clean_interval), Arc::downgrade(&self.image()))
    }
}

/// The options of an image opened read-only: nothing is written to it.
fn read_only(options: &vsd_qcow2::Options) -> vsd_qcow2::Options {
    vsd_qcow2::Options { writable: false, ..options.clone() }
}

/// Opens the image on `file`.
fn read_image(file: &dyn BlockNode, options: vsd_qcow2::Options) -> Result<Image, FormatError> {
    let mut io = ChildQueue::open(file, 1, u64::MAX)?;
    // The format above the file grows it: its size as of now.
    Image::open(&mut io, file.refresh_size()?, options)
}

/// Drops unused cache entries of `image` every `interval`, for as long as
/// the image is open.
fn clean_caches_every(interval: Duration, image: Weak<Image>) -> io::Result<()> {
    std::thread::Builder::new().name("vsd-qcow2-clean".into()).spawn(move || {
        loop {
            std::thread::sleep(interval);
            match image.upgrade() {
                Some(image) => image.drop_unused_caches(),
                None => return,
            }
        }
    })?;
    Ok(())
}

/// An error and its sources, as one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text = format!("{text}: {s}");
        source = s.source();
    }
    text
}

/// A header's file name, relative to the directory of the image naming it.
fn resolve(image: Option<&Path>, name: &str) -> Result<PathBuf, String> {
    if name.starts_with("json:") || name.contains("://") {
        return Err(format!("'{name}' is not a plain file name (vsd opens only local files from a header)"));
    }
    let name = Path::new(name);
    if name.is_absolute() {
        return Ok(name.to_path_buf());
    }
    match image.and_then(Path::parent) {
        Some(dir) => Ok(dir.join(name)),
        None => Err(format!("cannot resolve '{}': the image is not a named file", name.display())),
    }
}

/// An implicit `file` node (QEMU names these after the file).
fn open_file(path: &Path, settings: &Settings, read_only: bool) -> Result<Arc<dyn BlockNode>, GraphError> {
    let filename = path.to_str().ok_or_else(|| GraphError::Invalid {
        context: path.display().to_string(),
        reason: "the file name is not UTF-8".into(),
    })?;
    let text = format!("filename={},read-only={}", filename.replace(',', ",,"), read_only);
    let mut opts = OptionMap::parse("--blockdev", &text)?;
    // As QEMU probes a name from a header: a device is a host_device.
    let device =
        std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device() || m.file_type().is_char_device());
    let node = FileNode::open(format!("#{filename}"), settings.cache, !settings.inactive, device, &mut opts)?;
    opts.finish()?;
    Ok(Arc::new(node))
}

/// Opens a backing file named by a header, read-only, probing its format
/// if the header does not say it.
fn open_backing(
    path: &Path,
    format: Option<&str>,
    settings: &Settings,
    chain: &mut Vec<PathBuf>,
) -> Result<Arc<dyn BlockNode>, GraphError> {
    let file = open_file(path, settings, true)?;
    let format = match format {
        Some(f) => f.to_string(),
        None => probe(&*file).map(String::from).map_err(|e| GraphError::Host {
            context: path.display().to_string(),
            what: "cannot probe the format".into(),
            source: e,
        })?,
    };
    match format.as_str() {
        "raw" | "file" => Ok(file),
        "qcow2" => {
            // The entry size must fit the overlay's clusters, not the
            // backing file's: QEMU opens backing files with defaults.
            let settings =
                Settings { read_only: true, l2_cache_entry_bytes: None, acts_on_discards: true, ..settings.clone() };
            let context = path.display().to_string();
            let name = format!("#{context}-qcow2");
            Ok(Arc::new(Qcow2Node::build(name, &context, file, Backing::FromHeader, None, &settings, chain)?))
        }
        other => Err(GraphError::Invalid {
            context: path.display().to_string(),
            reason: format!("backing format '{other}' is not supported (vsd has raw and qcow2)"),
        }),
    }
}

/// "qcow2" if the node starts with the qcow2 magic, else "raw".
pub(crate) fn probe(node: &dyn BlockNode) -> io::Result<&'static str> {
    let mut io = ChildQueue::open(node, 1, node.size())?;
    let mut head = AlignedBuf::zeroed(4096);
    io.read_at(&mut head, 0)?;
    Ok(if head.starts_with(b"QFI\xfb") { "qcow2" } else { "raw" })
}

impl Qcow2Node {
    /// Runs `f` with synchronous channels to the image's files, for work
    /// done outside the queues (writing metadata back, growing).
    fn with_io<T>(&self, f: impl FnOnce(&Image, &mut vsd_qcow2::ImageIo) -> io::Result<T>) -> io::Result<T> {
        let image = self.image();
        let mut file = ChildQueue::open(&*self.file, 1, u64::MAX)?;
        let mut data = self.data.as_ref().map(|d| ChildQueue::open(&**d, 1, u64::MAX)).transpose()?;
        let mut io =
            vsd_qcow2::ImageIo { meta: &mut file, data: data.as_mut().map(|d| d as &mut dyn SyncIo), backing: None };
        f(&image, &mut io)
    }

    /// [`Qcow2Node::with_io`] for a change of the image beside the queues'
    /// requests: refused once the image was found corrupt, and corrupt
    /// metadata found on the way marks it so, as a request would.
    fn change<T>(&self, f: impl FnOnce(&Image, &mut vsd_qcow2::ImageIo) -> io::Result<T>) -> io::Result<T> {
        if self.health.is_corrupt() {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.with_io(|image, io| {
            f(image, io).inspect_err(|e| {
                if let Some(what) = CorruptMetadata::of(e) {
                    self.health.corrupted(what, image, &mut *io.meta);
                }
            })
        })
    }
}

impl crate::InternalSnapshots for Qcow2Node {
    fn list(&self) -> Vec<vsd_qcow2::SnapshotInfo> {
        self.image().snapshots()
    }

    fn create(&self, name: &str, date: (u32, u32)) -> io::Result<vsd_qcow2::SnapshotInfo> {
        self.change(|image, io| image.create_snapshot(io, name, date))
    }

    fn delete(&self, id: Option<&str>, name: Option<&str>) -> io::Result<vsd_qcow2::SnapshotInfo> {
        self.change(|image, io| image.delete_snapshot(io, id, name))
    }
}

/// Refuses a backing node without a header naming it, or the other way
/// round, and formats vsd cannot open from a header.
fn check_new_backing(backing: Option<&Arc<dyn BlockNode>>, header: Option<&(String, String)>) -> io::Result<()> {
    let invalid = |what: String| Err(io::Error::new(io::ErrorKind::InvalidInput, what));
    match header {
        _ if backing.is_some() != header.is_some() => {
            invalid("a new backing node needs a header naming it, and no backing node a header naming none".into())
        }
        Some((_, format)) if !matches!(format.as_str(), "qcow2" | "raw" | "file") => {
            invalid(format!("backing format '{format}' is not supported (vsd has qcow2, raw and file)"))
        }
        _ => Ok(()),
    }
}

impl BlockNode for Qcow2Node {
    fn name(&self) -> &str {
        &self.name
    }

    fn driver(&self) -> &'static str {
        "qcow2"
    }

    fn size(&self) -> u64 {
        self.image().size()
    }

    fn read_only(&self) -> bool {
        !self.options().writable
    }

    /// The image is read again, writable or not, as activating it does:
    /// see [`Qcow2Node::reopen_writable`], [`Qcow2Node::reopen_read_only`].
    fn set_read_only(&self, read_only: bool) -> io::Result<()> {
        match (read_only, self.read_only()) {
            (true, false) => self.reopen_read_only(),
            (false, true) => self.reopen_writable(),
            _ => Ok(()),
        }
    }

    fn default_bitmap_granularity(&self) -> u64 {
        self.image().cluster_size().clamp(4096, 65536)
    }

    fn cluster_size(&self) -> Option<u64> {
        Some(self.image().cluster_size())
    }

    fn supports_compressed_writes(&self) -> bool {
        true
    }

    fn children(&self) -> Vec<(&'static str, Arc<dyn BlockNode>)> {
        let optional = [("data-file", self.data.clone()), ("backing", self.backing())];
        let optional = optional.into_iter().filter_map(|(role, node)| Some((role, node?)));
        std::iter::once(("file", self.file.clone())).chain(optional).collect()
    }

    fn close(&self) -> io::Result<()> {
        // A corrupt image is written no more, as QEMU leaves it.
        if !self.image().writable() || self.health.is_corrupt() {
            return Ok(());
        }
        self.store_bitmaps(false)?;
        self.with_io(|image, io| image.close(io))
    }

    fn inactivate(&self) -> io::Result<()> {
        // Metadata and bitmaps written back and the image marked clean, as
        // at a clean stop; then nothing cached is kept, and no lock.
        self.close()?;
        self.bitmaps.drop_persistent();
        *self.claims() = Claims::default();
        self.reopen(read_only(&self.options()))
    }

    fn activate(&self) -> io::Result<()> {
        *self.claims() = self.claim_images(self.options().writable).map_err(io::Error::other)?;
        self.reopen(self.options())?;
        self.load_bitmaps()
    }

    /// The image is closed and read again knowing it has a backing file:
    /// its unallocated clusters then read from it. Nobody uses the node
    /// yet, so no queue holds the image it had.
    fn attach_backing(&self, backing: Arc<dyn BlockNode>) -> Result<(), AttachError> {
        let mut slot = self.backing.write().unwrap_or_else(PoisonError::into_inner);
        if slot.is_some() {
            return Err(AttachError::HasBacking);
        }
        let guards = backing.claim(BACKING_CLAIM).map_err(io::Error::other)?;
        if self.image().writable() {
            self.with_io(|image, io| image.close(io))?;
        }
        let mut options = self.options();
        options.has_backing = Some(true);
        self.reopen(options.clone())?;
        *self.options.write().unwrap_or_else(PoisonError::into_inner) = options;
        *slot = Some(backing);
        self.claims().backing = guards;
        Ok(())
    }

    /// Through the image's metadata path, beside the queues' requests: a
    /// cluster populated is in flight until linked, so that their writes
    /// to it wait and land on top (see [`Image::populate`]).
    fn populate(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.change(|image, io| image.populate(io, offset, data))
    }

    /// The header is rewritten (durably, the image's changes before it
    /// first) and the open image told, not read again: the queues already
    /// open share it, and keep their backing node.
    fn set_backing(&self, backing: Option<Arc<dyn BlockNode>>, header: Option<(String, String)>) -> io::Result<()> {
        check_new_backing(backing.as_ref(), header.as_ref())?;
        let guards = backing.as_ref().map(|b| b.claim(BACKING_CLAIM)).transpose().map_err(io::Error::other)?;
        let name = header.as_ref().map(|(file, format)| (file.as_str(), format.as_str()));
        self.change(|image, io| image.set_backing_file(io, name))?;
        self.options.write().unwrap_or_else(PoisonError::into_inner).has_backing = Some(backing.is_some());
        *self.backing.write().unwrap_or_else(PoisonError::into_inner) = backing;
        // The old node's claim goes once the new one is in its place.
        self.claims().backing = guards.unwrap_or_default();
        Ok(())
    }

    /// The header alone: the open image keeps its backing node.
    fn rename_backing_file(&self, header: Option<(String, String)>) -> io::Result<()> {
        let name = header.as_ref().map(|(file, format)| (file.as_str(), format.as_str()));
        self.change(|image, io| image.rename_backing_file(io, name))
    }

    /// The header is left alone. The image is read again only if it gains
    /// or loses a backing file (unallocated clusters then read otherwise),
    /// its metadata and bitmaps written back first and loaded again after.
    fn replace_backing(&self, backing: Option<Arc<dyn BlockNode>>) -> io::Result<()> {
        let guards = backing.as_ref().map(|b| b.claim(BACKING_CLAIM)).transpose().map_err(io::Error::other)?;
        if self.backing().is_some() != backing.is_some() {
            self.read_again(backing.is_some())?;
        }
        *self.backing.write().unwrap_or_else(PoisonError::into_inner) = backing;
        // The old node's claim goes once the new one is in its place.
        self.claims().backing = guards.unwrap_or_default();
        Ok(())
    }

    fn can_store_bitmaps(&self) -> bool {
        let image = self.image();
        image.writable() && image.header().version >= 3
    }

    fn persistent_bitmap_removed(&self) -> io::Result<()> {
        self.store_bitmaps(true)
    }

    fn resize(&self, size: u64) -> io::Result<()> {
        self.with_io(|image, io| image.resize(io, size))
    }

    fn internal_snapshots(&self) -> Option<&dyn crate::InternalSnapshots> {
        Some(self)
    }

    /// Clusters as the image maps them: zero clusters are holes, and
    /// unallocated ones are what the backing file says (holes without one).
    fn block_status(&self, offset: u64, len: u64) -> io::Result<(crate::Allocation, u64)> {
        let (mapping, n) = self.mapping(offset, len)?;
        match (mapping, self.backing()) {
            (Mapping::Data { .. } | Mapping::Compressed { .. }, _) => Ok((crate::Allocation::Data, n)),
            (Mapping::Unallocated, Some(backing)) if offset < backing.size() => {
                backing.block_status(offset, n.min(backing.size() - offset))
            }
            (Mapping::Zero | Mapping::Unallocated, _) => Ok((crate::Allocation::Hole, n)),
            (Mapping::Invalid, _) => Err(io::Error::from_raw_os_error(libc::EIO)),
        }
    }

    /// Data and zero clusters are this image's; unallocated ones one layer
    /// deeper than the backing file has them, if it does.
    fn allocation_depth(&self, offset: u64, len: u64) -> io::Result<(u32, u64)> {
        let (mapping, n) = self.mapping(offset, len)?;
        match (mapping, self.backing()) {
            (Mapping::Data { .. } | Mapping::Compressed { .. } | Mapping::Zero, _) => Ok((1, n)),
            (Mapping::Unallocated, Some(backing)) if offset < backing.size() => {
                let (depth, n) = backing.allocation_depth(offset, n.min(backing.size() - offset))?;
                Ok((if depth == 0 { 0 } else { depth + 1 }, n))
            }
            (Mapping::Unallocated, _) => Ok((0, n)),
            (Mapping::Invalid, _) => Err(io::Error::from_raw_os_error(libc::EIO)),
        }
    }

    fn open_queue(&self, depth: u16) -> io::Result<Box<dyn IoQueue>> {
        // Child tags below `depth` carry guest requests sent whole, under
        // their own tags. Requests split at cluster boundaries need tags
        // for their parts, and a copy-up two (the old bytes before and
        // after the request's); beyond these, parts wait in line. (The
        // child queue keeps one more tag for blocking requests, and the
        // file's has tags for table reads.)
        let parts = (2 * u32::from(depth)).max(8).min(u32::from((u16::MAX - 1 - loads::LOADS).saturating_sub(depth)));
        let parts = parts as u16;
        if parts == 0 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let child_depth = depth + parts;
        let file = ChildQueue::open(&*self.file, child_depth + loads::LOADS, u64::MAX)?;
        let data = self.data.as_ref().map(|d| ChildQueue::open(&**d, child_depth, u64::MAX)).transpose()?;
        let backing = self.backing().map(|b| ChildQueue::open(&*b, child_depth, b.size())).transpose()?;
        let children = queue::Children { file, data, backing };
        let (health, flusher) = (self.health.clone(), self.flusher.clone());
        let queue = Qcow2Queue::new(self.image(), children, health, flusher, depth, parts)?;
        Ok(Box::new(queue.acting_on_discards(self.acts_on_discards)))
    }
}
