//! QMP's `blockdev-mirror`: a running disk copied onto another node (a
//! local image, or another host's over the NBD client), then its exports
//! moved onto the copy by `job-complete`. With `copy-mode=write-blocking`,
//! the exports write through a filter to both nodes while the job runs;
//! `block-job-change` puts that filter in while a background mirror runs.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use vsd_block::dirty::Tracker;
use vsd_block::{Perms, User};
use vsd_control::qmp::QmpError;
use vsd_job::mirror::{CopyMode, Mirror, MirrorSpec, MirrorSync, Work, Writers};
use vsd_job::mirror_top::{InFlight, MirrorTop};
use vsd_job::{JobBody, JobSpec};

use crate::chain::{Node, is_filter, swaps_child};
use crate::daemon::{Daemon, State, block_backend, lock_state};
use crate::inactive::{Filter, refuse_filter_over};
use crate::jobs::{Claiming, Held, OnError, SOURCE, below, busy, generic, job_user, node, speed, well_formed};
use crate::writers::switch_exports;

/// Bytes copied in a burst under the speed limit unless `buf-size` is
/// given (QEMU's default for its mirror's buffer).
const DEFAULT_BUF_SIZE: u64 = 16 << 20;

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct MirrorArgs {
    pub(crate) job_id: Option<String>,
    pub(crate) device: String,
    pub(crate) target: String,
    pub(crate) replaces: Option<String>,
    pub(crate) sync: SyncArg,
    pub(crate) speed: Option<i64>,
    pub(crate) granularity: Option<u32>,
    pub(crate) buf_size: Option<i64>,
    #[serde(default)]
    pub(crate) on_source_error: OnError,
    #[serde(default)]
    pub(crate) on_target_error: OnError,
    pub(crate) filter_node_name: Option<String>,
    #[serde(default)]
    pub(crate) copy_mode: CopyModeArg,
    pub(crate) auto_finalize: Option<bool>,
    pub(crate) auto_dismiss: Option<bool>,
}

#[derive(Deserialize, JsonSchema, Clone, Copy, PartialEq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum SyncArg {
    Full,
    Top,
    None,
    Incremental,
    Bitmap,
}

/// QAPI's `MirrorCopyMode`.
#[derive(Deserialize, JsonSchema, Clone, Copy, Default, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum CopyModeArg {
    #[default]
    Background,
    WriteBlocking,
}

/// What `drive-mirror`, which made the target, says of it: whether it is
/// a new image, which reads as zeroes (`sync=full` then copies only what
/// the source's chain holds, as QEMU's), the node it gets as its backing
/// node when the job completes, and the job's body wrapped (to let the
/// target go once unused).
pub(crate) struct MadeTarget<'a> {
    pub(crate) zeroed: bool,
    pub(crate) backing: Option<Node>,
    pub(crate) wrap: &'a dyn Fn(Box<dyn JobBody>) -> Box<dyn JobBody>,
}

impl From<CopyModeArg> for CopyMode {
    fn from(mode: CopyModeArg) -> Self {
        match mode {
            CopyModeArg::Background => CopyMode::Background,
            CopyModeArg::WriteBlocking => CopyMode::WriteBlocking,
        }
    }
}

impl Daemon {
    /// Starts a mirror job.
    pub(crate) fn blockdev_mirror(&self, args: MirrorArgs) -> Result<Value, QmpError> {
        self.start_mirror(args, MadeTarget { zeroed: false, backing: None, wrap: &|body| body })
    }

    /// Starts a mirror job onto a target that `made` says more about.
    pub(crate) fn start_mirror(&self, args: MirrorArgs, made: MadeTarget<'_>) -> Result<Value, QmpError> {
        let mut guard = self.state();
        let state = &mut *guard;
        let source = node(state, &args.device)?;
        // QEMU's jobs on a node put a filter above it: no longer a root.
        let job_source = self.jobs.users_of(source.name()).into_iter().any(|(_, place)| place == SOURCE);
        if state.graph.parent(source.name()).is_some() || job_source {
            return Err(generic("Need a root block node"));
        }
        let target = node(state, &args.target)?;
        if source.name() == target.name() {
            return Err(generic("Can't mirror node into itself"));
        }
        // QEMU's default: the target's cluster, within 4 KiB to 64 KiB.
        let granularity = args.granularity.map(u64::from).unwrap_or_else(|| target.default_bitmap_granularity());
        if !(512..=64 << 20).contains(&granularity) {
            return Err(generic("Parameter 'granularity' expects a value in range [512B, 64MB]"));
        }
        if !granularity.is_power_of_two() {
            return Err(generic("Parameter 'granularity' expects a power of 2"));
        }
        let burst = match args.buf_size {
            Some(size) if size < 0 => return Err(generic("Parameter 'buf-size' expects a non-negative value")),
            Some(size @ 1..) => size as u64,
            _ => DEFAULT_BUF_SIZE,
        };
        // Every layer of the chain, onto a target that needs no zeroing.
        let full = if made.zeroed { MirrorSync::Above(u32::MAX) } else { MirrorSync::Full };
        let sync = match args.sync {
            SyncArg::Full => full,
            // Without a backing chain, the top is all there is (QEMU's rule).
            SyncArg::Top if source.children().iter().any(|(role, _)| *role == "backing") => MirrorSync::Top,
            SyncArg::Top => full,
            SyncArg::None => MirrorSync::None,
            SyncArg::Incremental => return Err(generic("Sync mode 'incremental' not supported")),
            SyncArg::Bitmap => return Err(generic("Sync mode 'bitmap' not supported")),
        };
        let replaced_under = match &args.replaces {
            Some(replaces) => filter_above(state, &source, replaces)?,
            None => None,
        };
        refuse_filter_over(state, &[("backing", &source)], Filter::Appended)?;
        if args.filter_node_name.is_some() {
            return Err(generic("vsd does not name a mirror's filter node: leave out 'filter-node-name'"));
        }
        if below(&source, target.name()) || below(&target, source.name()) {
            return Err(generic(format!(
                "Node '{}' and node '{}' are in one backing chain: the mirror would write what it reads",
                source.name(),
                target.name()
            )));
        }
        if source.size() != target.size() {
            return Err(generic("Source and target image have different sizes"));
        }
        if target.read_only() {
            return Err(generic(format!("Node '{}' is read-only", target.name())));
        }
        for name in [source.name(), target.name()] {
            if let Some((job, _)) = self.jobs.user_of(name) {
                return Err(generic(busy(name, &job)));
            }
        }
        // Exports of the target are refused as the job starts, as QEMU refuses them.
        if state.graph.parent(target.name()).is_some() {
            return Err(generic(format!("Node '{}' is busy: another node uses it", target.name())));
        }
        let id = args.job_id.unwrap_or_default();
        if !well_formed(&id) {
            return Err(generic(format!("Invalid job ID '{id}'")));
        }
        let speed = speed(args.speed.unwrap_or(0))?;
        let job = JobSpec {
            id,
            kind: "mirror",
            auto_finalize: args.auto_finalize.unwrap_or(true),
            auto_dismiss: args.auto_dismiss.unwrap_or(true),
            speed,
            nodes: [Some(&target), Some(&source), replaced_under.as_ref().map(|filter| &filter.1)]
                .into_iter()
                .flatten()
                .map(|node| node.name().to_string())
                .collect(),
            group: None,
        };
        self.refuse_inactive_target(&job, &target)?;
        let spec = |tracker: Tracker, writers: Arc<dyn Writers>| MirrorSpec {
            source: source.clone(),
            target: target.clone(),
            sync,
            tracker,
            writers,
            burst,
            on_source_error: args.on_source_error.into(),
            on_target_error: args.on_target_error.into(),
        };
        let replaced_under = replaced_under.map(|(filter, _)| filter);
        let (users, claims, job_holds) =
            (state.users.clone(), mirror_claims(&job.id, &source, &target), Held::default());
        let writers = |serving: &Node| {
            Arc::new(MirrorWriters {
                state: self.shared_state(),
                serving: Mutex::new(serving.clone()),
                source: source.clone(),
                target: target.clone(),
                replaced_under: replaced_under.clone(),
                target_backing: made.backing.clone(),
                job_holds: job_holds.clone(),
            })
        };
        let start = |writers: Arc<MirrorWriters>, mirror: Mirror| {
            let body = Claiming::new(Filtered { mirror, writers }, &users, claims).sharing(job_holds.clone());
            self.jobs.start(job, (made.wrap)(Box::new(body)))
        };
        match args.copy_mode {
            CopyModeArg::Background => {
                let tracker = track(state, &source, granularity)?;
                let writers = writers(&source);
                let mirror = Mirror::new(spec(tracker, writers.clone()));
                start(writers, mirror).map_err(generic)?;
            }
            CopyModeArg::WriteBlocking => {
                let in_flight = Arc::new(InFlight::default());
                let filter: Node =
                    Arc::new(MirrorTop::new(filter_name(&source), source.clone(), target.clone(), in_flight.clone()));
                // Stopped, so that no write in flight is left out of both.
                switch_exports(state, source.name(), Some(&filter), Some(&mut || Ok(()))).map_err(generic)?;
                let writers = writers(&filter);
                let tracker = Tracker::apart(source.size(), granularity);
                let mirror = Mirror::write_blocking(spec(tracker, writers.clone()), in_flight);
                if let Err(e) = start(writers, mirror) {
                    unfilter(state, &filter_name(&source), &source);
                    return Err(generic(e));
                }
            }
        }
        Ok(json!({}))
    }
}

/// What a mirror takes, as QEMU's: the source read through its filter,
/// which takes over the source's users, and resized by nobody; the target
/// written through a BlockBackend that lets others only write it
/// unchanged (its data is not the source's until the job is ready).
fn mirror_claims(id: &str, source: &Node, target: &Node) -> Vec<(Node, User)> {
    let shared = Perms::ALL.without(Perms::RESIZE);
    let source_user = User { above_users: true, ..job_user("mirror", id, "source", Perms::READ, shared) };
    let target_user = block_backend(Perms::WRITE, Perms::WRITE_UNCHANGED);
    vec![(source.clone(), source_user), (target.clone(), target_user)]
}

/// A tracker of `source`'s writes from a moment none is in flight: each
/// writer picks it up with its next write.
fn track(state: &mut State, source: &Node, granularity: u64) -> Result<Tracker, QmpError> {
    let bitmaps = source
        .dirty_bitmaps()
        .cloned()
        .ok_or_else(|| generic(format!("Node '{}' cannot record its writes", source.name())))?;
    let mut tracker = None;
    let mut start = || {
        tracker = Some(bitmaps.track(source.size(), granularity));
        Ok(())
    };
    switch_exports(state, source.name(), None, Some(&mut start)).map_err(generic)?;
    tracker.ok_or_else(|| generic("the mirror's record of writes was not made"))
}

/// Checks `replaces` as QEMU does: the device itself (`None`), or a node
/// it reads through filters only (whose data they show unchanged): then the
/// filter right above it, and the node.
fn filter_above(state: &State, device: &Node, name: &str) -> Result<Option<(Node, Node)>, QmpError> {
    if name == device.name() {
        return Ok(None);
    }
    let replaced =
        state.graph.get(name).ok_or_else(|| generic(format!("Failed to find node with node-name='{name}'")))?;
    let mut node = device.clone();
    while is_filter(&node) {
        let Some((_, child)) = node.children().into_iter().next() else { break };
        if child.name() != name {
            node = child;
            continue;
        }
        if !swaps_child(&node) {
            return Err(generic(format!("vsd's {} filter '{}' cannot take another child", node.driver(), node.name())));
        }
        return Ok(Some((node, replaced)));
    }
    Err(generic(format!(
        "Cannot replace '{name}' by a node mirrored from '{}', because it cannot be guaranteed that doing so would not \
         lead to an abrupt change of visible data",
        device.name()
    )))
}

fn filter_name(source: &Node) -> String {
    format!("#mirror_top-{}", source.name())
}

/// Moves the exports of a write-blocking mirror's filter back onto its source.
fn unfilter(state: &mut State, filter: &str, source: &Node) {
    if let Err(e) = switch_exports(state, filter, Some(source), None) {
        log::error!("the exports of node '{}' stay on its mirror's filter: {e}", source.name());
    }
}

/// A mirror's writers: the exports of the node they serve while the job
/// runs (the source, or a write-blocking mirror's filter). They end on the
/// source, or on the target; with `replaces` below a filter, on the source
/// still, its filter passing requests to the target from then on.
struct MirrorWriters {
    state: Arc<Mutex<State>>,
    /// Changes once, when a background mirror becomes write-blocking.
    serving: Mutex<Node>,
    source: Node,
    target: Node,
    /// The filter whose child the target replaces.
    replaced_under: Option<Node>,
    /// The target's backing node from the switch on (`drive-mirror`'s).
    target_backing: Option<Node>,
    /// What the job holds: it lets go of the target before the exports
    /// move onto it.
    job_holds: Held,
}

impl MirrorWriters {
    fn serving(&self) -> MutexGuard<'_, Node> {
        self.serving.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Puts the exports back on the source if they are on a filter.
    fn unfilter(&self) {
        let serving = self.serving().clone();
        if serving.name() != self.source.name() {
            unfilter(&mut lock_state(&self.state), serving.name(), &self.source);
        }
    }
}

impl Writers for MirrorWriters {
    fn stopped(&self, switch_to: Option<&Node>, work: &mut dyn FnMut() -> Result<(), String>) -> Result<(), String> {
        if let Some(to) = switch_to.filter(|to| to.name() == self.target.name()) {
            self.job_holds.release(to.name());
        }
        let mut state = lock_state(&self.state);
        let backing = switch_to.zip(self.target_backing.as_ref());
        let mut work = || {
            work()?;
            backing
                .map_or(Ok(()), |(target, backing)| target.attach_backing(backing.clone()).map_err(|e| e.to_string()))
        };
        let work: &mut dyn FnMut() -> Result<(), String> = &mut work;
        let serving = self.serving().clone();
        let (Some(target), Some(filter)) = (switch_to, &self.replaced_under) else {
            let to = switch_to.unwrap_or(&self.source);
            let to = (to.name() != serving.name()).then_some(to);
            return switch_exports(&mut state, serving.name(), to, Some(work));
        };
        let mut replace = || {
            work()?;
            filter
                .replace_filtered(target.clone())
                .map_err(|e| format!("Cannot replace below '{}': {e}", filter.name()))
        };
        switch_exports(&mut state, serving.name(), Some(&self.source), Some(&mut replace))?;
        // Again, for the exports to hold what they need of the target's images.
        switch_exports(&mut state, self.source.name(), Some(&self.source), None)
    }

    fn write_blocking(&self, in_flight: &Arc<InFlight>, work: Work<'_>) -> Result<(), String> {
        let filter: Node = Arc::new(MirrorTop::new(
            filter_name(&self.source),
            self.source.clone(),
            self.target.clone(),
            in_flight.clone(),
        ));
        let mut state = lock_state(&self.state);
        switch_exports(&mut state, self.source.name(), Some(&filter), Some(work))?;
        *self.serving() = filter;
        Ok(())
    }
}

/// A mirror, whose filter (if it is write-blocking) goes once it ends,
/// whatever the end: a failed or cancelled job leaves the exports on the
/// source.
struct Filtered {
    mirror: Mirror,
    writers: Arc<MirrorWriters>,
}

impl JobBody for Filtered {
    fn run(&mut self, job: &Arc<vsd_job::Job>) -> Result<(), String> {
        let result = self.mirror.run(job);
        self.writers.unfilter();
        result
    }

    fn copy_mode(&self) -> Option<Arc<vsd_job::mirror::Mode>> {
        self.mirror.copy_mode()
    }
}

/// `block-job-change`'s options (QAPI's `JobChangeOptions`): the job's
/// id and type, and a mirror's copy mode.
#[derive(Deserialize, JsonSchema, Clone, Copy, PartialEq)]
#[serde(rename_all = "kebab-case")]
enum JobType {
    Commit,
    Stream,
    Mirror,
    Backup,
    Create,
    Amend,
    SnapshotLoad,
    SnapshotSave,
    SnapshotDelete,
}

/// The members of every type's options.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChangeId {
    id: String,
}

/// A mirror's.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct MirrorChange {
    id: String,
    copy_mode: CopyModeArg,
}

/// `block-job-change`'s arguments as QEMU's schema has them, the union on
/// `type` that [`job_change`] reads.
#[derive(JsonSchema)]
#[serde(tag = "type", rename_all = "kebab-case")]
#[allow(dead_code)] // Described, never built.
pub(crate) enum JobChange {
    Commit(ChangeId),
    Stream(ChangeId),
    Mirror(MirrorChange),
    Backup(ChangeId),
    Create(ChangeId),
    Amend(ChangeId),
    SnapshotLoad(ChangeId),
    SnapshotSave(ChangeId),
    SnapshotDelete(ChangeId),
}

/// The job, and the copy mode asked, from `block-job-change`'s arguments
/// (a union on `type`). QEMU 10 does not check the type against the
/// job's: a mirror reads another type's options as asking for
/// background, the mode whose value is zero.
fn job_change(mut args: Value) -> Result<(String, CopyMode), QmpError> {
    let kind = args.as_object_mut().and_then(|members| members.remove("type"));
    let kind: JobType = crate::qapi::parse_member("type", kind.ok_or_else(|| generic("Parameter 'type' is missing"))?)?;
    if kind == JobType::Mirror {
        let change: MirrorChange = crate::qapi::parse(args)?;
        return Ok((change.id, change.copy_mode.into()));
    }
    Ok((crate::qapi::parse::<ChangeId>(args)?.id, CopyMode::Background))
}

impl Daemon {
    /// `block-job-change`: a running mirror goes write-blocking.
    pub(crate) fn block_job_change(&self, args: Value) -> Result<Value, QmpError> {
        let (id, mode) = job_change(args)?;
        self.block_job(&id)?.change_copy_mode(mode).map_err(generic)?;
        Ok(json!({}))
    }
}
