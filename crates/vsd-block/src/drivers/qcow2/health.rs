//! A qcow2 node whose metadata turned out corrupt while in use, handled as
//! QEMU does: a writable image is flagged corrupt in its header and every
//! later request to the node fails (fatal); a read-only one goes on
//! serving what it can. A BLOCK_IMAGE_CORRUPTED event says so, once. The
//! daemon's other nodes and exports are not touched.

use std::sync::atomic::{AtomicBool, Ordering};

use serde_json::json;
use vsd_qcow2::{Image, SyncIo};

use crate::EventSink;

pub(crate) struct Health {
    node: String,
    /// Found corrupt while writable: the node serves nothing more.
    corrupt: AtomicBool,
    /// The event was sent.
    reported: AtomicBool,
    events: Option<EventSink>,
}

impl Health {
    pub(crate) fn new(node: &str, events: Option<EventSink>) -> Self {
        Self { node: node.to_string(), corrupt: AtomicBool::new(false), reported: AtomicBool::new(false), events }
    }

    /// Whether the image was found corrupt: the node serves nothing more.
    #[inline]
    pub(crate) fn is_corrupt(&self) -> bool {
        self.corrupt.load(Ordering::Relaxed)
    }

    /// The metadata is corrupt (`what`): a writable image is flagged
    /// through `io` and the node stops; the first time, the daemon's
    /// clients are told.
    pub(crate) fn corrupted(&self, what: &str, image: &Image, io: &mut dyn SyncIo) {
        let fatal = image.writable();
        if fatal && !self.corrupt.swap(true, Ordering::AcqRel) {
            log::error!("qcow2 node '{}': Marking image as corrupt: {what}", self.node);
            if let Err(e) = image.mark_corrupt(io) {
                log::error!("qcow2 node '{}': cannot flag the image corrupt: {e}", self.node);
            }
        }
        if self.reported.swap(true, Ordering::AcqRel) {
            return;
        }
        log::error!("qcow2 node '{}': {what}; further corruption events will be suppressed", self.node);
        if let Some(events) = &self.events {
            let data = json!({"device": "", "node-name": self.node, "msg": what, "fatal": fatal});
            events("BLOCK_IMAGE_CORRUPTED", data);
        }
    }
}
