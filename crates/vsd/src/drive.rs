//! QMP's commands that make their target image themselves, as QEMU's:
//! `drive-mirror` and `drive-backup` create (or open, `mode=existing`) a
//! file, open it as a node of their own (named `#block<n>` unless
//! `drive-mirror` is given a `node-name`) and run `blockdev-mirror`'s or
//! `blockdev-backup`'s job onto it; `blockdev-snapshot-sync` creates an
//! overlay naming the node's image as its backing file and does what
//! `blockdev-snapshot` does. As in QEMU, such a node lives while something
//! uses it: an export (a mirror's exports move onto its target), another
//! node, or the job; once nothing does, it goes, and its image is closed.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use vsd_block::GraphError;
use vsd_block::options::OptionMap;
use vsd_control::qmp::QmpError;
use vsd_job::{Group, Job, JobBody};

use crate::chain::{Node, backing_of, image_filename, skip_filters};
use crate::create::create_image;
use crate::daemon::{Daemon, State, lock_state};
use crate::jobs::{self, BackupArgs, BitmapModeArg, OnError, generic, well_formed};
use crate::mirror::{self, CopyModeArg, MadeTarget, MirrorArgs};
use crate::snapshot::SnapshotArgs;

/// QAPI's `NewImageMode`.
#[derive(Deserialize, JsonSchema, Clone, Copy, Default, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum NewImageMode {
    /// Open the image that is there.
    Existing,
    /// Create a new image (its backing file named as the node has it).
    #[default]
    AbsolutePaths,
}

/// `drive-mirror`'s arguments (QAPI's `DriveMirror`).
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct DriveMirrorArgs {
    job_id: Option<String>,
    device: String,
    target: PathBuf,
    format: Option<String>,
    node_name: Option<String>,
    replaces: Option<String>,
    sync: mirror::SyncArg,
    #[serde(default)]
    mode: NewImageMode,
    speed: Option<i64>,
    granularity: Option<u32>,
    buf_size: Option<i64>,
    #[serde(default)]
    on_source_error: OnError,
    #[serde(default)]
    on_target_error: OnError,
    unmap: Option<bool>,
    #[serde(default)]
    copy_mode: CopyModeArg,
    auto_finalize: Option<bool>,
    auto_dismiss: Option<bool>,
}

/// `drive-backup`'s arguments (QAPI's `DriveBackup`): `blockdev-backup`'s,
/// with a file name as `target`, and `format` and `mode`.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct DriveBackupArgs {
    job_id: Option<String>,
    device: String,
    sync: jobs::SyncArg,
    speed: Option<i64>,
    bitmap: Option<String>,
    bitmap_mode: Option<BitmapModeArg>,
    #[serde(default)]
    compress: bool,
    #[serde(default)]
    on_source_error: OnError,
    #[serde(default)]
    on_target_error: OnError,
    auto_finalize: Option<bool>,
    auto_dismiss: Option<bool>,
    filter_node_name: Option<String>,
    #[serde(default)]
    discard_source: bool,
    /// Performance tuning QEMU marks experimental; vsd's backup sizes its
    /// copies itself, so it is taken and has no effect.
    #[serde(rename = "x-perf")]
    #[schemars(skip)]
    _x_perf: Option<Value>,
    target: PathBuf,
    format: Option<String>,
    #[serde(default)]
    mode: NewImageMode,
}

/// `blockdev-snapshot-sync`'s arguments (QAPI's `BlockdevSnapshotSync`).
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct SnapshotSyncArgs {
    /// A device (BlockBackend) name: QEMU's storage daemon has none, so it
    /// never names a node there, as in QEMU (`node-name` does).
    device: Option<String>,
    node_name: Option<String>,
    snapshot_file: PathBuf,
    snapshot_node_name: Option<String>,
    format: Option<String>,
    #[serde(default)]
    mode: NewImageMode,
}

/// How a target node is opened.
struct Opening<'a> {
    path: &'a Path,
    /// `None`: probed, as QEMU does for an existing image.
    format: Option<&'a str>,
    /// `None`: `#block<n>`.
    node_name: Option<String>,
    /// Opened without the backing file its header names (QEMU's
    /// `BDRV_O_NO_BACKING`): the command gives it its backing node.
    no_backing: bool,
    /// `discard=unmap` and `detect-zeroes=unmap`, as QEMU opens a backup's.
    unmap: bool,
}

impl Daemon {
    pub(crate) fn drive_mirror(&self, args: DriveMirrorArgs) -> Result<Value, QmpError> {
        let source = self.found(&args.device)?;
        check_job_id(args.job_id.as_deref())?;
        if args.unmap == Some(false) {
            return Err(generic("vsd's mirror always unmaps the target's zeroes: leave out 'unmap' or set it"));
        }
        if args.replaces.is_some() && args.node_name.is_none() {
            return Err(generic("a node-name must be provided when replacing a named node of the graph"));
        }
        self.refuse_taken_name(args.node_name.as_deref(), |name| format!("Duplicate nodes with node-name='{name}'"))?;
        // QEMU's rules: sync=top without a backing file is sync=full, and
        // the new image of sync=top/none is an overlay of what the
        // source's own image does not hold.
        let below = match args.sync {
            mirror::SyncArg::Top => backing_of(&skip_filters(&source)),
            mirror::SyncArg::None => Some(source.clone()),
            _ => None,
        };
        let format = self.made_image(args.mode, args.format.as_deref(), &args.target, &source, below.as_ref())?;
        let opening = Opening {
            path: &args.target,
            format: format.as_deref(),
            node_name: args.node_name,
            no_backing: args.mode == NewImageMode::AbsolutePaths,
            unmap: false,
        };
        let target = self.open_target(&opening)?;
        let mirror = MirrorArgs {
            job_id: args.job_id,
            device: args.device,
            target: target.name().to_string(),
            replaces: args.replaces,
            sync: args.sync,
            speed: args.speed,
            granularity: args.granularity,
            buf_size: args.buf_size,
            on_source_error: args.on_source_error,
            on_target_error: args.on_target_error,
            filter_node_name: None,
            copy_mode: args.copy_mode,
            auto_finalize: args.auto_finalize,
            auto_dismiss: args.auto_dismiss,
        };
        let zeroed = args.mode == NewImageMode::AbsolutePaths;
        let backing = below.filter(|_| zeroed);
        let wrap = self.releasing(&target);
        self.start_mirror(mirror, MadeTarget { zeroed, backing, wrap: &wrap }).inspect_err(|_| self.release(&target))
    }

    /// `drive-backup`, alone or as an action of a transaction.
    pub(crate) fn drive_backup(&self, args: DriveBackupArgs, group: Option<Arc<Group>>) -> Result<Arc<Job>, QmpError> {
        let source = self.found(&args.device)?;
        check_job_id(args.job_id.as_deref())?;
        if args.filter_node_name.is_some() {
            return Err(generic("vsd does not name a backup's filter node: leave out 'filter-node-name'"));
        }
        if args.discard_source {
            return Err(generic(
                "vsd's backup does not discard what it copied from the source: leave out 'discard-source'",
            ));
        }
        let below = match args.sync {
            jobs::SyncArg::Top => backing_of(&skip_filters(&source)),
            jobs::SyncArg::None => Some(source.clone()),
            _ => None,
        };
        let format = self.made_image(args.mode, args.format.as_deref(), &args.target, &source, below.as_ref())?;
        // sync=none reads what the target lacks from the source itself, a
        // node open here: the header's name would open its image again.
        let none = args.sync == jobs::SyncArg::None;
        let opening =
            Opening { path: &args.target, format: format.as_deref(), node_name: None, no_backing: none, unmap: true };
        let target = self.open_target(&opening)?;
        if none && let Err(e) = target.attach_backing(source.clone()) {
            self.release(&target);
            return Err(generic(e.to_string()));
        }
        let backup = BackupArgs {
            job_id: args.job_id,
            device: args.device,
            target: target.name().to_string(),
            sync: args.sync,
            speed: args.speed,
            bitmap: args.bitmap,
            bitmap_mode: args.bitmap_mode,
            compress: args.compress,
            on_source_error: args.on_source_error,
            on_target_error: args.on_target_error,
            auto_finalize: args.auto_finalize,
            auto_dismiss: args.auto_dismiss,
        };
        let wrap = self.releasing(&target);
        self.start_backup(backup, group, &wrap).inspect_err(|_| self.release(&target))
    }

    /// The first part of `blockdev-snapshot-sync`, done before the other
    /// actions of its transaction: the overlay made and opened, without a
    /// backing node yet; what `blockdev-snapshot` then takes.
    pub(crate) fn open_overlay(&self, args: SnapshotSyncArgs) -> Result<SnapshotArgs, QmpError> {
        let state = self.state();
        let node = args.node_name.as_deref().and_then(|name| state.graph.get(name)).ok_or_else(|| {
            let (device, node) = (args.device.as_deref().unwrap_or(""), args.node_name.as_deref().unwrap_or(""));
            generic(format!("Cannot find device='{device}' nor node-name='{node}'"))
        })?;
        drop(state);
        let overlay = args.snapshot_node_name.ok_or_else(|| generic("New overlay node-name missing"))?;
        self.refuse_taken_name(Some(&overlay), |_| "New overlay node-name already in use".into())?;
        let format = args.format.as_deref().unwrap_or("qcow2");
        if args.mode == NewImageMode::AbsolutePaths {
            let backing = backing_name(&node)?;
            let backing = Some((backing.0.as_str(), backing.1));
            create_image(&args.snapshot_file, format, node.size(), backing).map_err(generic)?;
        }
        let opening = Opening {
            path: &args.snapshot_file,
            format: Some(format),
            node_name: Some(overlay),
            no_backing: true,
            unmap: false,
        };
        let overlay = self.open_target(&opening)?;
        Ok(SnapshotArgs { node: node.name().to_string(), overlay: overlay.name().to_string() })
    }

    /// Lets the overlays [`Daemon::open_overlay`] made go if nothing uses
    /// them: the snapshot was not taken, or was of a node nothing used.
    pub(crate) fn release_overlays(&self, snapshots: &[SnapshotArgs]) {
        for snapshot in snapshots {
            self.release_named(&snapshot.overlay);
        }
    }

    /// Node `name`, as QEMU's jobs look their device up.
    fn found(&self, name: &str) -> Result<Node, QmpError> {
        jobs::node(&self.state(), name)
    }

    /// Refuses a node name already taken, in `words`.
    fn refuse_taken_name(&self, name: Option<&str>, words: impl Fn(&str) -> String) -> Result<(), QmpError> {
        match name {
            Some(name) if self.state().graph.get(name).is_some() => Err(generic(words(name))),
            _ => Ok(()),
        }
    }

    /// Makes the target image unless `mode` says it exists (of `source`'s
    /// size, naming `below`'s image as its backing file); returns the
    /// format to open it with (`None`: probe it).
    fn made_image(
        &self,
        mode: NewImageMode,
        format: Option<&str>,
        path: &Path,
        source: &Node,
        below: Option<&Node>,
    ) -> Result<Option<String>, QmpError> {
        if mode == NewImageMode::Existing {
            return Ok(format.map(str::to_string));
        }
        let format = format.unwrap_or(source.driver());
        let backing = below.map(backing_name).transpose()?;
        let backing = backing.as_ref().map(|(file, format)| (file.as_str(), *format));
        create_image(path, format, source.size(), backing).map_err(generic)?;
        Ok(Some(format.to_string()))
    }

    /// Opens the image of `opening` as a node of its own (its file node
    /// named `#block<n>`, as QEMU names the nodes of a file name).
    fn open_target(&self, opening: &Opening<'_>) -> Result<Node, QmpError> {
        let mut state = self.state();
        let top = opening.node_name.clone().unwrap_or_else(|| state.graph.implicit_name());
        let format = opening.format;
        let file_name = if format == Some("file") { top.clone() } else { state.graph.implicit_name() };
        let mut file = json!({ "driver": "file", "node-name": file_name, "filename": opening.path });
        if format == Some("file") {
            with_unmap(&mut file, opening.unmap);
        }
        let file = add(&mut state, opening.path, file)?;
        let format = match format {
            Some(format) => format,
            None => vsd_block::probe_format(&*file).map_err(|e| generic(could_not_open(opening.path, &e)))?,
        };
        if format == "file" {
            return Ok(file);
        }
        let mut image = json!({ "driver": format, "node-name": top, "file": file.name() });
        if opening.no_backing && format == "qcow2" {
            image["backing"] = Value::Null;
        }
        with_unmap(&mut image, opening.unmap);
        add(&mut state, opening.path, image).inspect_err(|_| release_if_unused(&mut state, file.name()))
    }

    /// A job body wrapper that lets `target` go once the job has ended.
    fn releasing(&self, target: &Node) -> impl Fn(Box<dyn JobBody>) -> Box<dyn JobBody> + use<> {
        let (state, node) = (self.shared_state(), target.name().to_string());
        move |body| Box::new(Releasing { body, state: state.clone(), node: node.clone() })
    }

    fn release(&self, node: &Node) {
        self.release_named(node.name());
    }

    fn release_named(&self, name: &str) {
        release_if_unused(&mut self.state(), name);
    }
}

/// QEMU's rule for job ids, checked before any image is made (QEMU makes
/// the image first, and leaves it behind).
fn check_job_id(id: Option<&str>) -> Result<(), QmpError> {
    let id = id.unwrap_or_default();
    match well_formed(id) {
        true => Ok(()),
        false => Err(generic(format!("Invalid job ID '{id}'"))),
    }
}

/// The name and format a new image's header gives `node`'s image as its
/// backing file: its file, made absolute, and its driver.
fn backing_name(node: &Node) -> Result<(String, &'static str), QmpError> {
    let file = image_filename(node)
        .ok_or_else(|| generic(format!("Node '{}' has no image file to name as a backing file", node.name())))?;
    let file = std::path::absolute(&file).map_err(|e| generic(format!("Cannot make '{file}' absolute: {e}")))?;
    let file = file.to_str().ok_or_else(|| generic("The image's file name is not UTF-8"))?.to_string();
    Ok((file, node.driver()))
}

/// Adds the node `options` describe, in QEMU's words when its image cannot
/// be opened.
fn add(state: &mut State, path: &Path, options: Value) -> Result<Node, QmpError> {
    let options = OptionMap::parse("--blockdev", &options.to_string()).map_err(|e| generic(e.to_string()))?;
    state.graph.add(options).map_err(|e| match e {
        GraphError::Host { source, .. } => generic(could_not_open(path, &source)),
        e => generic(e.to_string()),
    })
}

fn could_not_open(path: &Path, e: &std::io::Error) -> String {
    let why = e.raw_os_error().map_or_else(|| e.to_string(), vsd_job::strerror);
    format!("Could not open '{}': {why}", path.display())
}

/// QEMU's `discard=unmap,detect-zeroes=unmap` on a backup's target.
fn with_unmap(options: &mut Value, unmap: bool) {
    if unmap {
        options["discard"] = json!("unmap");
        options["detect-zeroes"] = json!("unmap");
    }
}

/// Removes node `name`, which a command made, if no export and no other
/// node uses it, and writes back what it caches.
fn release_if_unused(state: &mut State, name: &str) {
    let exported = state.exports.values().any(|e| e.node().name() == name)
        || state.stopping.values().any(|(node, _)| node == name);
    let Some(node) = state.graph.get(name) else { return };
    if exported || state.graph.parent(name).is_some() || state.graph.remove(name, |_| None).is_err() {
        return;
    }
    if let Err(e) = node.close() {
        log::error!("node '{name}': writing back cached state failed: {e}");
    }
}

/// A job onto a node a command made: the node goes once the job ends,
/// unless something else uses it by then.
struct Releasing {
    body: Box<dyn JobBody>,
    state: Arc<Mutex<State>>,
    node: String,
}

impl JobBody for Releasing {
    fn prepare(&mut self, job: &Arc<Job>) -> Result<(), String> {
        self.body.prepare(job)
    }

    fn run(&mut self, job: &Arc<Job>) -> Result<(), String> {
        self.body.run(job)
    }

    fn commit(&mut self) {
        self.body.commit();
    }

    fn abort(&mut self) {
        self.body.abort();
    }

    fn clean(&mut self) {
        self.body.clean();
        release_if_unused(&mut lock_state(&self.state), &self.node);
    }
}
