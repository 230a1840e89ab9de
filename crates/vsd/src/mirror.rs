//! QMP's `blockdev-mirror`: a running disk copied onto another node (a
//! local image, or another host's over the NBD client), then its exports
//! moved onto the copy by `job-complete`. With `copy-mode=write-blocking`,
//! the exports write through a filter to both nodes while the job runs.

use std::sync::{Arc, Mutex};

use serde::Deserialize;
use serde_json::{Value, json};
use vsd_block::dirty::Tracker;
use vsd_control::qmp::QmpError;
use vsd_job::mirror::{Mirror, MirrorSpec, MirrorSync, Writers};
use vsd_job::mirror_top::{InFlight, MirrorTop};
use vsd_job::{JobBody, JobSpec};

use crate::chain::{Node, is_filter};
use crate::daemon::{Daemon, State, lock_state};
use crate::jobs::{OnError, SOURCE, below, busy, generic, node, speed, well_formed};
use crate::writers::{SourceWriters, switch_exports};

/// Bytes copied in a burst under the speed limit unless `buf-size` is
/// given (QEMU's default for its mirror's buffer).
const DEFAULT_BUF_SIZE: u64 = 16 << 20;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct MirrorArgs {
    job_id: Option<String>,
    device: String,
    target: String,
    replaces: Option<String>,
    sync: SyncArg,
    speed: Option<i64>,
    granularity: Option<u64>,
    buf_size: Option<i64>,
    #[serde(default)]
    on_source_error: OnError,
    #[serde(default)]
    on_target_error: OnError,
    filter_node_name: Option<String>,
    #[serde(default)]
    copy_mode: CopyMode,
    auto_finalize: Option<bool>,
    auto_dismiss: Option<bool>,
}

#[derive(Deserialize, Clone, Copy, PartialEq)]
#[serde(rename_all = "lowercase")]
enum SyncArg {
    Full,
    Top,
    None,
    Incremental,
    Bitmap,
}

#[derive(Deserialize, Clone, Copy, Default, PartialEq)]
#[serde(rename_all = "kebab-case")]
enum CopyMode {
    #[default]
    Background,
    WriteBlocking,
}

impl Daemon {
    /// Starts a mirror job.
    pub(crate) fn blockdev_mirror(&self, args: MirrorArgs) -> Result<Value, QmpError> {
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
        let granularity = args.granularity.unwrap_or_else(|| target.default_bitmap_granularity());
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
        let sync = match args.sync {
            SyncArg::Full => MirrorSync::Full,
            // Without a backing chain, the top is all there is (QEMU's rule).
            SyncArg::Top if source.children().iter().any(|(role, _)| *role == "backing") => MirrorSync::Top,
            SyncArg::Top => MirrorSync::Full,
            SyncArg::None => MirrorSync::None,
            SyncArg::Incremental => return Err(generic("Sync mode 'incremental' not supported")),
            SyncArg::Bitmap => return Err(generic("Sync mode 'bitmap' not supported")),
        };
        if let Some(replaces) = &args.replaces {
            check_replaces(state, &source, replaces)?;
        }
        if args.filter_node_name.is_some() {
            return Err(generic("vsd puts no filter node above the source: leave out 'filter-node-name'"));
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
        if self.in_use(state, target.name()) {
            return Err(generic(format!("Node '{}' is busy: an export or another node uses it", target.name())));
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
            nodes: vec![target.name().to_string(), source.name().to_string()],
            group: None,
        };
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
        match args.copy_mode {
            CopyMode::Background => {
                let tracker = track(state, &source, granularity)?;
                let writers = Arc::new(SourceWriters { state: self.shared_state(), source: source.name().to_string() });
                let mirror = Mirror::new(spec(tracker, writers));
                self.jobs.start(job, Box::new(mirror)).map_err(generic)?;
            }
            CopyMode::WriteBlocking => {
                let in_flight = Arc::new(InFlight::default());
                let filter: Node =
                    Arc::new(MirrorTop::new(filter_name(&source), source.clone(), target.clone(), in_flight.clone()));
                // Stopped, so that no write in flight is left out of both.
                switch_exports(state, source.name(), Some(&filter), Some(&mut || Ok(()))).map_err(generic)?;
                let writers = Arc::new(FilterWriters { state: self.shared_state(), filter, source: source.clone() });
                let tracker = Tracker::apart(source.size(), granularity);
                let mirror = Mirror::write_blocking(spec(tracker, writers.clone()), in_flight);
                if let Err(e) = self.jobs.start(job, Box::new(Filtered { mirror, writers })) {
                    unfilter(state, &filter_name(&source), &source);
                    return Err(generic(e));
                }
            }
        }
        Ok(json!({}))
    }
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

/// Checks `replaces` as QEMU does: the device itself, or a node it reads
/// through filters only (whose data it shows unchanged).
fn check_replaces(state: &State, device: &Node, name: &str) -> Result<(), QmpError> {
    if name == device.name() {
        return Ok(());
    }
    state.graph.get(name).ok_or_else(|| generic(format!("Failed to find node with node-name='{name}'")))?;
    if !through_filters(device, name) {
        return Err(generic(format!(
            "Cannot replace '{name}' by a node mirrored from '{}', because it cannot be guaranteed that doing so would \
             not lead to an abrupt change of visible data",
            device.name()
        )));
    }
    // vsd's filters cannot take another child while they serve.
    Err(generic(format!("vsd cannot replace node '{name}' below filter '{}': leave out 'replaces'", device.name())))
}

/// Whether `node` is `name`, or a filter (as QEMU counts them) over it.
fn through_filters(node: &Node, name: &str) -> bool {
    node.name() == name
        || is_filter(node) && node.children().into_iter().next().is_some_and(|(_, child)| through_filters(&child, name))
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

/// A write-blocking mirror's writers: the exports of its filter, which go
/// back to the source unless the job moves them onto the target.
struct FilterWriters {
    state: Arc<Mutex<State>>,
    filter: Node,
    source: Node,
}

impl Writers for FilterWriters {
    fn stopped(&self, switch_to: Option<&Node>, work: &mut dyn FnMut() -> Result<(), String>) -> Result<(), String> {
        let to = switch_to.unwrap_or(&self.source);
        switch_exports(&mut lock_state(&self.state), self.filter.name(), Some(to), Some(work))
    }
}

/// A write-blocking mirror, whose filter goes once it ends, whatever the
/// end: a failed or cancelled job leaves the exports on the source.
struct Filtered {
    mirror: Mirror,
    writers: Arc<FilterWriters>,
}

impl JobBody for Filtered {
    fn run(&mut self, job: &Arc<vsd_job::Job>) -> Result<(), String> {
        let result = self.mirror.run(job);
        let writers = &self.writers;
        unfilter(&mut lock_state(&writers.state), writers.filter.name(), &writers.source);
        result
    }
}
