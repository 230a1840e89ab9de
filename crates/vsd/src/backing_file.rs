//! QMP `change-backing-file`: another backing file name in the header of
//! an image of a device's chain, as QEMU writes it. Nothing is reopened:
//! the chain reads as before, and the name counts from the image's next
//! open. Like QEMU 10, the header then names the image's own format
//! (`qcow2`) as the backing file's.

use std::io;

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use vsd_control::qmp::QmpError;

use crate::chain::{Node, backing_of, is_filter, lookup};
use crate::daemon::{Daemon, State};
use crate::jobs::{SOURCE, busy, generic, node};
use crate::reopen::set_read_only_tree;

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct ChangeBackingFile {
    device: String,
    image_node_name: String,
    /// An empty name leaves the header naming none.
    backing_file: String,
}

impl Daemon {
    pub(crate) fn change_backing_file(&self, args: ChangeBackingFile) -> Result<Value, QmpError> {
        let state = self.state();
        let device = self.root(&state, &args.device)?;
        // Backing files opened from a header are nodes of the chain only.
        let image = lookup(&state, &args.image_node_name)
            .or_else(|e| find_in_chain(&device, &args.image_node_name).ok_or(e))?;
        if backing_of(&image).is_none() && !is_filter(&image) {
            return Err(generic("not allowing backing file change on an image without a backing file"));
        }
        if let Some((job, _)) = self.jobs.user_of(device.name()) {
            return Err(generic(busy(device.name(), &job)));
        }
        if find_in_chain(&device, image.name()).is_none() {
            return Err(generic(format!("'{}' and image file are not in the same chain", args.device)));
        }
        // As QEMU, a read-only image is made writable for the change.
        let reopened = image.read_only();
        if reopened {
            set_read_only_tree(&image, false).map_err(generic)?;
        }
        let header = (!args.backing_file.is_empty()).then(|| (args.backing_file.clone(), image.driver().to_string()));
        let renamed = image.rename_backing_file(header);
        if reopened && let Err(e) = set_read_only_tree(&image, true) {
            log::warn!("node '{}' stays writable after change-backing-file: {e}", image.name());
        }
        renamed.map_err(|e| {
            generic(format!("Could not change backing file to '{}': {}", args.backing_file, in_os_words(&e)))
        })?;
        Ok(json!({}))
    }

    /// Node `name`, if nothing uses it (QEMU's root nodes): no other node,
    /// nor a job as its source (QEMU's jobs put a filter above it).
    fn root(&self, state: &State, name: &str) -> Result<Node, QmpError> {
        let node = node(state, name)?;
        let job_source = self.jobs.users_of(node.name()).into_iter().any(|(_, place)| place == SOURCE);
        if state.graph.parent(node.name()).is_some() || job_source {
            return Err(generic("Need a root block node"));
        }
        Ok(node)
    }
}

/// Node `name`, if it is `top` or below it, through backing files and
/// filters (QEMU's `bdrv_chain_contains`).
fn find_in_chain(top: &Node, name: &str) -> Option<Node> {
    if top.name() == name {
        return Some(top.clone());
    }
    let filtered = || top.children().into_iter().next().filter(|_| is_filter(top)).map(|(_, child)| child);
    backing_of(top).or_else(filtered).and_then(|next| find_in_chain(&next, name))
}

/// An I/O error as `strerror` words it (QEMU appends that).
fn in_os_words(e: &io::Error) -> String {
    let errno = match e.kind() {
        io::ErrorKind::InvalidInput => Some(libc::EINVAL),
        io::ErrorKind::Unsupported => Some(libc::ENOTSUP),
        _ => e.raw_os_error(),
    };
    errno.map_or_else(|| e.to_string(), vsd_job::strerror)
}
