//! `driver=rbd`: an image on a Ceph cluster, with QEMU's options.

use std::io;
use std::sync::Arc;

use base64::Engine;
use vsd_engine::IoQueue;
use vsd_rbd::{Image, Location, RbdQueue};

use super::FilteredQueue;
use super::file::FilePolicy;
use crate::options::OptionMap;
use crate::{BlockGraph, BlockNode, Cache, GraphError};

pub(crate) struct RbdNode {
    name: String,
    image: Arc<Image>,
    /// `discard=` and `cache.no-flush`, as for files.
    policy: FilePolicy,
}

impl RbdNode {
    pub(crate) fn open(
        name: String,
        cache: Cache,
        opts: &mut OptionMap,
        graph: &BlockGraph,
    ) -> Result<Self, GraphError> {
        let context = opts.context().to_string();
        let invalid = |reason: String| GraphError::Invalid { context: context.clone(), reason };
        let location = Location {
            pool: opts.require("pool")?,
            image: opts.require("image")?,
            namespace: opts.take("namespace"),
            snapshot: opts.take("snapshot"),
            conf: opts.take("conf"),
            user: opts.take("user"),
            auth_client_required: auth_modes(opts)?,
            mon_host: servers(opts)?,
            cache: !cache.direct,
            key: match opts.take("key-secret") {
                Some(id) => Some(base64::engine::general_purpose::STANDARD.encode(graph.secret(&id).map_err(invalid)?)),
                None => None,
            },
        };
        let read_only = opts.take_bool("read-only")?.unwrap_or(false);
        let policy = FilePolicy::take(cache, opts)?;
        if location.snapshot.is_some() && !read_only {
            // QEMU's words: a snapshot node must be opened read-only=on.
            return Err(invalid("rbd snapshots are read-only".into()));
        }
        let image = Image::open(&location, read_only).map_err(|e| invalid(e.to_string()))?;
        Ok(Self { name, image: Arc::new(image), policy })
    }
}

/// `auth-client-required`: a list of `cephx` and `none`, as librados'
/// `auth_client_required` takes them.
fn auth_modes(opts: &mut OptionMap) -> Result<Option<String>, GraphError> {
    let modes = opts.take_values("auth-client-required");
    if let Some(bad) = modes.iter().find(|m| !matches!(m.as_str(), "cephx" | "none")) {
        return Err(opts.invalid("auth-client-required", bad, "a list of cephx, none").into());
    }
    Ok((!modes.is_empty()).then(|| modes.join(";")))
}

/// `server`: the monitors, each `host` and `port`, as ceph.conf's `mon_host`.
fn servers(opts: &mut OptionMap) -> Result<Option<String>, GraphError> {
    let mut hosts = Vec::new();
    for mut server in opts.take_groups("server") {
        let host = server.require("host")?;
        let port = server.require("port")?;
        server.finish()?;
        hosts.push(if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") });
    }
    Ok((!hosts.is_empty()).then(|| hosts.join(",")))
}

impl BlockNode for RbdNode {
    fn name(&self) -> &str {
        &self.name
    }

    fn driver(&self) -> &'static str {
        "rbd"
    }

    fn size(&self) -> u64 {
        self.image.size()
    }

    fn read_only(&self) -> bool {
        self.image.read_only()
    }

    fn resize(&self, size: u64) -> io::Result<()> {
        if self.image.read_only() {
            return Err(io::Error::new(io::ErrorKind::PermissionDenied, "the node is read-only"));
        }
        self.image.resize(size)
    }

    /// Another client may have resized the image.
    fn refresh_size(&self) -> io::Result<u64> {
        self.image.refresh_size()
    }

    /// What librbd cached may be stale: another process wrote the image.
    fn activate(&self) -> io::Result<()> {
        self.image.invalidate_cache()
    }

    fn open_queue(&self, depth: u16) -> io::Result<Box<dyn IoQueue>> {
        let queue = Box::new(RbdQueue::new(self.image.clone(), depth)?);
        Ok(Box::new(FilteredQueue::new(queue, self.policy, depth)))
    }
}
