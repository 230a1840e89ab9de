//! QMP's `block-stream`: an overlay takes in what it reads from its
//! backing chain above a base (libvirt's `virsh blockpull`), then names
//! the base as its backing file; the images between are no longer used.

use std::sync::Arc;

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use vsd_block::{Perms, User};
use vsd_control::qmp::QmpError;
use vsd_job::JobSpec;
use vsd_job::stream::{Stream, StreamSpec};

use crate::chain::{
    Node, backing_format, chain, image_filename, is_filter, lookup, place_of_file, place_of_node, skip_filters,
};
use crate::daemon::{Daemon, State};
use crate::inactive::{Filter, refuse_filter_over};
use crate::jobs::{Claiming, OnError, Restoring, busy, generic, job_user, node, speed, well_formed};
use crate::writers::SourceWriters;

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct StreamArgs {
    job_id: Option<String>,
    device: String,
    base: Option<String>,
    base_node: Option<String>,
    backing_file: Option<String>,
    #[serde(default)]
    backing_mask_protocol: bool,
    bottom: Option<String>,
    speed: Option<i64>,
    #[serde(default)]
    on_error: OnError,
    filter_node_name: Option<String>,
    auto_finalize: Option<bool>,
    auto_dismiss: Option<bool>,
}

impl Daemon {
    /// Starts a stream job.
    pub(crate) fn block_stream(&self, args: StreamArgs) -> Result<Value, QmpError> {
        let both = |a: &str, b: &str| generic(format!("'{a}' and '{b}' cannot be specified at the same time"));
        match (&args.base, &args.base_node, &args.bottom) {
            (Some(_), Some(_), _) => return Err(both("base", "base-node")),
            (Some(_), _, Some(_)) => return Err(both("base", "bottom")),
            (_, Some(_), Some(_)) => return Err(both("bottom", "base-node")),
            _ => {}
        }
        if args.filter_node_name.is_some() {
            return Err(generic("vsd puts no filter node above the overlay: leave out 'filter-node-name'"));
        }
        let mut state = self.state();
        let top = node(&state, &args.device)?;
        let chain = chain(&top);
        let base_depth = base_of(&state, &chain, &args)?;
        for node in &chain[..base_depth.unwrap_or(chain.len())] {
            if let Some((job, _)) = self.jobs.user_of(node.name()) {
                return Err(generic(busy(node.name(), &job)));
            }
        }
        let base = base_depth.map(|at| chain[at].clone());
        // A backing file name goes with a base given as such: 'bottom' gives none.
        if args.backing_file.is_some() && (base.is_none() || args.bottom.is_some()) {
            return Err(generic("backing file specified, but streaming the entire chain"));
        }
        let header = base.as_ref().map(|base| {
            let base = skip_filters(base);
            let name = args.backing_file.or_else(|| image_filename(&base)).unwrap_or_else(|| base.name().to_string());
            (name, backing_format(&base, args.backing_mask_protocol).to_string())
        });
        refuse_filter_over(&mut state, &[("file", &top)], Filter::Opened)?;
        if chain.len() > 1 && top.driver() != "qcow2" {
            return Err(generic(format!("Node '{}' is not a qcow2 image: vsd streams into qcow2 only", top.name())));
        }
        // QEMU takes a device's name as the id, and a node has none.
        let id = args.job_id.unwrap_or_default();
        if !well_formed(&id) {
            return Err(generic(format!("Invalid job ID '{id}'")));
        }
        let spec = JobSpec {
            id,
            kind: "stream",
            auto_finalize: args.auto_finalize.unwrap_or(true),
            auto_dismiss: args.auto_dismiss.unwrap_or(true),
            speed: speed(args.speed.unwrap_or(0))?,
            nodes: chain[..base_depth.unwrap_or(chain.len())].iter().map(|n| n.name().to_string()).collect(),
            group: None,
        };
        let claims = stream_claims(&spec.id, &chain[..base_depth.unwrap_or(chain.len())]);
        let writers = Arc::new(SourceWriters { state: self.shared_state(), source: top.name().to_string() });
        let stream = Stream::new(StreamSpec {
            top: top.clone(),
            base,
            base_depth: base_depth.map(|at| at as u32 + 1),
            header,
            writers,
            on_error: args.on_error.into(),
        });
        // A read-only overlay is writable while the job runs, as in QEMU.
        let body = Claiming::new(stream, &state.users, claims);
        let body = Restoring { body, node: top, reopened: false, always: true };
        self.jobs.start(spec, Box::new(body)).map_err(generic)?;
        Ok(json!({}))
    }
}

/// What a stream takes, as QEMU's: the overlay (`streamed[0]`) read and
/// written unchanged through its copy-on-read filter, which takes over the
/// overlay's users, and nobody resizing it; the images below it, down to
/// the base, neither written nor resized by anyone: they go from the chain.
fn stream_claims(id: &str, streamed: &[Node]) -> Vec<(Node, User)> {
    let unchanged = Perms::READ.with(Perms::WRITE_UNCHANGED);
    let top =
        User { above_users: true, ..job_user("stream", id, "active node", unchanged, unchanged.with(Perms::WRITE)) };
    let below = streamed[1..]
        .iter()
        .map(|node| (node.clone(), job_user("stream", id, "intermediate node", Perms::NONE, unchanged)));
    std::iter::once((streamed[0].clone(), top)).chain(below).collect()
}

/// Where the base (the node that stays below the overlay) is in `chain`,
/// as `base`, `base-node` or `bottom` say; none: the whole chain goes.
fn base_of(state: &State, chain: &[Node], args: &StreamArgs) -> Result<Option<usize>, QmpError> {
    if let Some(file) = &args.base {
        return place_of_file(chain, file)
            .map(Some)
            .ok_or_else(|| generic(format!("Can't find '{file}' in the backing chain")));
    }
    if let Some(name) = &args.base_node {
        // Not the overlay itself, and looked up by node name only, as QEMU does.
        let at = place_of_node(state, chain, name)?.filter(|&at| at > 0);
        return at
            .map(Some)
            .ok_or_else(|| generic(format!("Node '{name}' is not a backing image of '{}'", args.device)));
    }
    let Some(name) = &args.bottom else { return Ok(None) };
    if is_filter(&lookup(state, name)?) {
        return Err(generic(format!("Node '{name}' is a filter, use a non-filter node as 'bottom'")));
    }
    // The overlay itself may be the bottom: then nothing is copied.
    let at = place_of_node(state, chain, name)?
        .ok_or_else(|| generic(format!("Node '{name}' is not in a chain starting from '{}'", args.device)))?;
    Ok(Some(at + 1).filter(|&base| base < chain.len()))
}
