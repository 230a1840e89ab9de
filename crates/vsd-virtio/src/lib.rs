//! The virtio side of vsd's request path, as a device sees it: guest
//! memory reached through a snapshot of its regions ([`ram`]), split
//! virtqueues ([`ring`]) and their descriptor chains ([`chain`]),
//! virtio-blk requests parsed into host iovecs ([`request`]), and the
//! dirty page log a live migration reads ([`dirty_log`]).
//!
//! ```text
//!  available ring ──pop──▶ Chain ──parse──▶ Request (iovecs into guest RAM)
//!                                                │ the export's engine does the I/O
//!  used ring ◀──push_used── status byte ◀────────┘   (marked in the DirtyLog while migrating)
//! ```
//!
//! Nothing here allocates or locks per request, and every access to guest
//! memory is bounded by the regions the front-end shared: a guest, however
//! hostile, gets an error, never a read or write outside its memory.

#![deny(missing_docs)]

pub mod chain;
pub mod dirty_log;
pub mod ram;
pub mod request;
pub mod ring;

pub use ring::MAX_QUEUE_SIZE;
