//! Ceph RBD images as vsd's block nodes see them: a connection to the
//! cluster, an open image, and per-thread queues of asynchronous requests
//! whose completions come back to the thread that submitted them.
//!
//! ```text
//!   queue worker ──push/submit──▶ RbdQueue ──rbd_aio_*──▶ librbd ──▶ OSDs
//!        ▲                                                  │
//!        └── reap ◀── Mailbox (eventfd) ◀── callback ◀──────┘ (librbd's thread)
//! ```

#![deny(missing_docs)]

mod ffi;
mod image;
mod queue;

pub use image::{Image, Location, OpenError};
pub use queue::RbdQueue;
