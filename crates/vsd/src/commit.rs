//! QMP's `block-commit` (libvirt's `virsh blockcommit`): what a chain
//! holds from `top` down to just above `base` goes into `base`. With the
//! active layer as `top`, a mirror into the base that goes ready and whose
//! `job-complete` moves the exports onto the base; otherwise a copy, then
//! the image above `top` names the base as its backing file.

use std::sync::Arc;

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use vsd_block::{Perms, User};
use vsd_control::qmp::{ErrorClass, QmpError};
use vsd_job::commit::{Commit, CommitSpec};
use vsd_job::mirror::{Mirror, MirrorSpec, MirrorSync};
use vsd_job::{JobBody, JobSpec};

use crate::chain::{Node, backing_format, chain, image_filename, is_filter, place_of_file, place_of_node};
use crate::daemon::{Daemon, State, block_backend};
use crate::inactive::{Filter, refuse_filter_over};
use crate::jobs::{Claiming, OnError, Restoring, SOURCE, busy, generic, job_user, speed, well_formed};
use crate::reopen::set_read_only_tree;
use crate::writers::{SourceWriters, switch_exports};

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct CommitArgs {
    job_id: Option<String>,
    device: String,
    base_node: Option<String>,
    base: Option<String>,
    top_node: Option<String>,
    top: Option<String>,
    backing_file: Option<String>,
    #[serde(default)]
    backing_mask_protocol: bool,
    speed: Option<i64>,
    #[serde(default)]
    on_error: OnError,
    filter_node_name: Option<String>,
    auto_finalize: Option<bool>,
    auto_dismiss: Option<bool>,
}

/// Bytes copied in a burst under the speed limit by an active commit
/// (QEMU's mirror default).
const BURST: u64 = 16 << 20;

impl Daemon {
    /// Starts a commit job.
    pub(crate) fn block_commit(&self, args: CommitArgs) -> Result<Value, QmpError> {
        if args.filter_node_name.is_some() {
            return Err(generic("vsd puts no filter node above the top: leave out 'filter-node-name'"));
        }
        let mut guard = self.state();
        let state = &mut *guard;
        let device = state
            .graph
            .get(&args.device)
            .ok_or_else(|| QmpError::new(ErrorClass::DeviceNotFound, format!("Device '{}' not found", args.device)))?;
        let job_source = self.jobs.users_of(device.name()).into_iter().any(|(_, place)| place == SOURCE);
        if state.graph.parent(device.name()).is_some() || job_source {
            return Err(generic("Need a root block node"));
        }
        let chain = chain(&device);
        let top_at = top_of(state, &chain, &args)?;
        let base_at = base_of(state, &chain, top_at, &args)?;
        for node in &chain[top_at..base_at] {
            if let Some((job, _)) = self.jobs.user_of(node.name()) {
                return Err(generic(busy(node.name(), &job)));
            }
        }
        let (top, base) = (chain[top_at].clone(), chain[base_at].clone());
        let active = top_at == 0;
        if active && args.backing_file.is_some() {
            return Err(generic("'backing-file' specified, but 'top' is the active layer"));
        }
        if active {
            refuse_filter_over(state, &[("backing", &top)], Filter::Appended)?;
        }
        let id = args.job_id.unwrap_or_default();
        if !well_formed(&id) {
            return Err(generic(format!("Invalid job ID '{id}'")));
        }
        let speed = speed(args.speed.unwrap_or(0))?;
        let writers = Arc::new(SourceWriters { state: self.shared_state(), source: device.name().to_string() });
        let spec = |nodes: &[Node]| JobSpec {
            id: id.clone(),
            kind: "commit",
            auto_finalize: args.auto_finalize.unwrap_or(true),
            auto_dismiss: args.auto_dismiss.unwrap_or(true),
            speed,
            nodes: nodes.iter().map(|n| n.name().to_string()).collect(),
            group: None,
        };
        // Base first: it is the target, as a mirror's (`blockdev-del` words it so).
        let used: Vec<Node> = std::iter::once(base.clone()).chain(chain[top_at..base_at].iter().cloned()).collect();
        let claims = commit_claims(&id, &chain[top_at..=base_at], active);
        let body: Box<dyn JobBody> = if active {
            let bitmaps =
                device.dirty_bitmaps().cloned().ok_or_else(|| generic("the node cannot record its writes"))?;
            let granularity = base.default_bitmap_granularity();
            let mut tracker = None;
            let mut track = || {
                tracker = Some(bitmaps.track(device.size(), granularity));
                Ok(())
            };
            switch_exports(state, device.name(), None, Some(&mut track)).map_err(generic)?;
            let tracker = tracker.ok_or_else(|| generic("the commit's record of writes was not made"))?;
            Box::new(Restoring {
                body: Claiming::new(
                    Mirror::new(MirrorSpec {
                        source: device.clone(),
                        target: base.clone(),
                        sync: MirrorSync::Above((base_at + 1) as u32),
                        tracker,
                        writers,
                        burst: BURST,
                        on_source_error: args.on_error.into(),
                        on_target_error: args.on_error.into(),
                    }),
                    &state.users,
                    claims,
                ),
                node: base.clone(),
                reopened: false,
                always: false,
            })
        } else {
            self.refuse_inactive_commit_top(state, &spec(&used), &top)?;
            let overlay = chain[top_at - 1].clone();
            let name = args.backing_file.or_else(|| image_filename(&base)).unwrap_or_else(|| base.name().to_string());
            let overlay_writable: Arc<dyn Fn(bool) -> Result<(), String> + Send + Sync> = {
                let overlay = overlay.clone();
                Arc::new(move |writable| set_read_only_tree(&overlay, !writable))
            };
            Box::new(Restoring {
                body: Claiming::new(
                    Commit::new(CommitSpec {
                        top: top.clone(),
                        base: base.clone(),
                        base_depth: (base_at - top_at + 1) as u32,
                        overlay,
                        header: (name, backing_format(&base, args.backing_mask_protocol).to_string()),
                        writers,
                        overlay_writable,
                        on_error: args.on_error.into(),
                    }),
                    &state.users,
                    claims,
                ),
                node: base.clone(),
                reopened: false,
                always: true,
            })
        };
        self.jobs.start(spec(&used), body).map_err(generic)?;
        Ok(json!({}))
    }
}

/// What a commit of `layers` (top first, the base last) takes, as QEMU's:
/// the images above the base read by nobody else and resized by nobody
/// (they go from the chain; filters right above the base may be read),
/// the base written (and grown if smaller) through a BlockBackend that
/// lets nobody else write or resize it, or, for the active layer's
/// commit, lets others write it (the guest's writes reach it when the
/// job completes). The top's users of the moment go through QEMU's
/// filter above it; an active commit only reads the active layer,
/// sharing all but resizing.
fn commit_claims(id: &str, layers: &[Node], active: bool) -> Vec<(Node, User)> {
    let (base, above) = layers.split_last().expect("a commit has a top and a base");
    let filters_over_base = above.iter().rev().take_while(|node| is_filter(node)).count();
    let mut claims: Vec<(Node, User)> = above
        .iter()
        .enumerate()
        .map(|(at, node)| {
            let mut shared = Perms::WRITE_UNCHANGED.with(Perms::WRITE);
            if at >= above.len() - filters_over_base {
                shared = shared.with(Perms::READ);
            }
            let user = match (at, active) {
                (0, true) => job_user("commit", id, "source", Perms::NONE, Perms::ALL.without(Perms::RESIZE)),
                _ => job_user("commit", id, "intermediate node", Perms::NONE, shared),
            };
            (node.clone(), User { above_users: at == 0, ..user })
        })
        .collect();
    let unchanged = Perms::READ.with(Perms::WRITE_UNCHANGED);
    let (held, shared) = match active {
        true => (Perms::WRITE, unchanged.with(Perms::WRITE)),
        false => (Perms::READ.with(Perms::WRITE), unchanged),
    };
    let grows = if base.size() < layers[0].size() { Perms::RESIZE } else { Perms::NONE };
    claims.push((base.clone(), block_backend(held.with(grows), shared)));
    claims
}

/// Where node `name` is in `chain`, which must hold it.
fn place_in_chain(state: &State, chain: &[Node], name: &str) -> Result<usize, QmpError> {
    place_of_node(state, chain, name)?.ok_or_else(|| generic(format!("'{name}' is not in this backing file chain")))
}

/// Where `top` is in `chain` (0: the active layer, the default).
fn top_of(state: &State, chain: &[Node], args: &CommitArgs) -> Result<usize, QmpError> {
    match (&args.top_node, &args.top) {
        (Some(_), Some(_)) => Err(generic("'top-node' and 'top' are mutually exclusive")),
        (Some(name), None) => place_in_chain(state, chain, name),
        (None, Some(file)) => {
            place_of_file(chain, file).ok_or_else(|| generic(format!("Top image file {file} not found")))
        }
        (None, None) => Ok(0),
    }
}

/// Where the base is in `chain`, below `top_at` (the bottom by default).
fn base_of(state: &State, chain: &[Node], top_at: usize, args: &CommitArgs) -> Result<usize, QmpError> {
    let below = &chain[top_at..];
    let at = match (&args.base_node, &args.base) {
        (Some(_), Some(_)) => return Err(generic("'base-node' and 'base' are mutually exclusive")),
        (Some(name), None) => place_in_chain(state, below, name)?,
        (None, Some(file)) => {
            place_of_file(below, file).ok_or_else(|| generic(format!("Can't find '{file}' in the backing chain")))?
        }
        (None, None) => below.len() - 1,
    };
    if at == 0 {
        return Err(generic("cannot commit an image into itself"));
    }
    Ok(top_at + at)
}
