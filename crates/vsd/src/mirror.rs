//! QMP's `blockdev-mirror`: a running disk copied onto another node (a
//! local image, or another host's over the NBD client), then its exports
//! moved onto the copy by `job-complete`.

use std::sync::Arc;

use serde::Deserialize;
use serde_json::{Value, json};
use vsd_control::qmp::QmpError;
use vsd_job::JobSpec;
use vsd_job::mirror::{Mirror, MirrorSpec, MirrorSync};

use crate::daemon::Daemon;
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
        if args.replaces.as_deref().is_some_and(|name| name != source.name()) {
            return Err(generic("vsd replaces only the mirrored node itself: leave out 'replaces'"));
        }
        if args.filter_node_name.is_some() {
            return Err(generic("vsd puts no filter node above the source: leave out 'filter-node-name'"));
        }
        if args.copy_mode == CopyMode::WriteBlocking {
            return Err(generic("vsd mirrors with copy-mode 'background' only"));
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
        let bitmaps = source
            .dirty_bitmaps()
            .cloned()
            .ok_or_else(|| generic(format!("Node '{}' cannot record its writes", source.name())))?;
        // Tracked from a moment no write is in flight: each writer picks the
        // tracker up with its next write.
        let mut tracker = None;
        let mut track = || {
            tracker = Some(bitmaps.track(source.size(), granularity));
            Ok(())
        };
        switch_exports(state, source.name(), None, Some(&mut track)).map_err(generic)?;
        let tracker = tracker.ok_or_else(|| generic("the mirror's record of writes was not made"))?;
        let spec = JobSpec {
            id,
            kind: "mirror",
            auto_finalize: args.auto_finalize.unwrap_or(true),
            auto_dismiss: args.auto_dismiss.unwrap_or(true),
            speed,
            nodes: vec![target.name().to_string(), source.name().to_string()],
            group: None,
        };
        let writers = Arc::new(SourceWriters { state: self.shared_state(), source: source.name().to_string() });
        let mirror = Mirror::new(MirrorSpec {
            source,
            target,
            sync,
            tracker,
            writers,
            burst,
            on_source_error: args.on_source_error.into(),
            on_target_error: args.on_target_error.into(),
        });
        self.jobs.start(spec, Box::new(mirror)).map_err(generic)?;
        Ok(json!({}))
    }
}
