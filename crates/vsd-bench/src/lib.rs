//! `vsd-bench`: a vhost-user-blk client library and benchmark, built on
//! [libblkio](https://libblkio.gitlab.io/libblkio/) (the `blkio` crate,
//! driver `virtio-blk-vhost-user`).
//!
//! The crate has two halves:
//!
//! * a small **client API** ([`Client`], [`Queue`], [`Buffer`]) used by the
//!   daemon's integration tests to prove it correct, and
//! * a **benchmark engine** ([`bench`]) driven by the `vsd-bench` binary.
//!
//! # Client API
//!
//! ```no_run
//! use std::path::Path;
//! use vsd_bench::{Client, ClientOptions};
//!
//! # fn main() -> Result<(), vsd_bench::Error> {
//! let mut client = Client::connect(Path::new("/tmp/vsd.sock"), ClientOptions::default())?;
//! println!("capacity: {} bytes", client.info().capacity);
//! let mut queue = client.take_queue(0)?;
//! queue.write_at(0, &[0xa5; 4096])?;
//! let mut back = vec![0; 4096];
//! queue.read_at(0, &mut back)?;
//! assert_eq!(back, vec![0xa5; 4096]);
//! # Ok(())
//! # }
//! ```
//!
//! * Every request helper blocks for at most the queue's timeout
//!   ([`ClientOptions::io_timeout`], changeable with [`Queue::set_timeout`]);
//!   libblkio would otherwise wait forever if the back-end dies. A queue whose
//!   request timed out is *broken*: all further requests on it fail with
//!   [`Error::QueueBroken`].
//! * A failed request returns [`Error::Request`] carrying the negative-errno
//!   status libblkio reported (see [`Error::errno`]). libblkio maps the
//!   virtio-blk status byte as `VIRTIO_BLK_S_IOERR` → `EIO`,
//!   `VIRTIO_BLK_S_UNSUPP` → `ENOTSUP`, anything else → `EPROTO`; it fails
//!   some requests locally without sending them: offsets/lengths that are not
//!   multiples of 512 → `EINVAL`, writes/discards/write-zeroes on a client
//!   opened with `read_only` → `EBADF`, discard/write-zeroes when the device
//!   did not offer the feature → `ENOTSUP`.
//! * Each [`Queue`] is `Send` and owns its virtqueue, so tests can move one
//!   queue into each thread and drive them concurrently.
//! * All I/O buffers must live in memory mapped into the back-end. The
//!   blocking helpers copy through a per-queue bounce [`Buffer`]; zero-copy
//!   callers allocate a [`Buffer`] themselves ([`Client::alloc_buffer`]).
//! * The virtio-blk serial (`VIRTIO_BLK_T_GET_ID`) is **not** available:
//!   libblkio 0.5 (and its `virtio-driver` 0.6) only implement read, write,
//!   flush, discard and write-zeroes requests.
//! * libblkio refuses to start a device that offers `VIRTIO_BLK_F_RO` unless
//!   `read_only` was requested; [`Client::connect`] reports that as
//!   [`Error::DeviceReadOnly`], which is how a test can check that a
//!   read-only export advertises the feature. With `read_only` set, libblkio
//!   rejects writes itself (`EBADF`), so the daemon's own rejection of writes
//!   to a read-only export cannot be observed through libblkio.
//!
//! # Benchmark JSON output
//!
//! `vsd-bench --json` prints one JSON object; its key names are stable:
//!
//! ```text
//! {
//!   "config": {
//!     "socket": str, "rw": "randread"|"randwrite"|"randrw"|"read"|"write",
//!     "rwmixread": int (percent of reads; 100 for read modes, 0 for write modes),
//!     "bs": int (bytes), "iodepth": int (per job), "queues": int, "jobs": int,
//!     "seconds": float, "ramp_seconds": float, "size": int (bytes touched),
//!     "poll": bool, "cpus": [int] (empty = not pinned), "queue_size": int
//!   },
//!   "device": {      (the fields of DeviceInfo)
//!     "capacity": int (bytes), "request_alignment": int, "optimal_io_size": int,
//!     "max_transfer": int, "max_segments": int, "max_segment_len": int,
//!     "max_queues": int, "max_mem_regions": int, "max_discard_len": int,
//!     "discard_alignment": int, "max_write_zeroes_len": int,
//!     "flush_needed": bool, "read_only": bool, "num_queues": int,
//!     "poll_queues": bool, "queue_size": int
//!   },
//!   "results": {
//!     "duration_s": float (measured interval),
//!     "ios": int, "read_ios": int, "write_ios": int (successful, in interval),
//!     "iops": float, "bw_mib_s": float (MiB/s, 2^20 bytes),
//!     "lat_us": { "mean", "min", "p50", "p99", "p999", "max": float (µs) },
//!     "errors": int (failed requests, whole run incl. ramp),
//!     "first_error": str|null,
//!     "client_cpu_us": float (user+sys of this process over the interval),
//!     "client_cpu_us_per_io": float|null (null if no I/O completed)
//!   }
//! }
//! ```
//!
//! The binary exits non-zero if any request failed, if setup failed, or if a
//! queue stopped completing requests for [`bench::STALL_TIMEOUT`]. Read-only
//! modes (`randread`, `read`) connect with `read_only` so read-only exports
//! can be benchmarked. Writes send a fixed non-zero byte pattern
//! ([`bench::WRITE_PATTERN`]); reads are not verified.
//!
//! Latency is measured per request from submission (enqueue) to reaping its
//! completion with a monotonic clock, recorded in nanoseconds in an
//! HdrHistogram per job and merged over jobs. Only requests completing inside
//! the measured interval (after the ramp) are counted.

#![deny(missing_docs)]

pub mod bench;
pub mod breakdown;
mod buffer;
mod client;
mod device;
mod error;
mod queue;

pub use buffer::Buffer;
pub use client::{Client, ClientOptions};
pub use device::DeviceInfo;
pub use error::{Error, Op, Result};
pub use queue::{BatchOp, Queue};

/// The libblkio driver used for every connection.
pub const DRIVER: &str = "virtio-blk-vhost-user";
