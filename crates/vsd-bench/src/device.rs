//! What a vhost-user-blk device offers, as libblkio reports it once the
//! connection is started: shared by the client that reads it and the
//! queues that check requests against it.

use blkio::Blkio;
use serde::Serialize;

use crate::error::{Error, Result};

/// Device properties read from libblkio after starting.
///
/// Lengths are in bytes; a `0` limit means the device reported none (for
/// discard/write-zeroes: the feature is not offered).
#[derive(Clone, Debug, Serialize)]
pub struct DeviceInfo {
    /// `capacity`: device size at connect time.
    pub capacity: u64,
    /// `request-alignment`: the logical block size.
    pub request_alignment: u32,
    /// `optimal-io-size`.
    pub optimal_io_size: u32,
    /// `max-transfer`: `size_max * seg_max` when both are offered.
    pub max_transfer: u32,
    /// `max-segments`.
    pub max_segments: u32,
    /// `max-segment-len`.
    pub max_segment_len: u32,
    /// `max-queues`: queues the device offers.
    pub max_queues: u32,
    /// `max-mem-regions`: back-end memory slots.
    pub max_mem_regions: u64,
    /// `max-discard-len`.
    pub max_discard_len: u64,
    /// `discard-alignment`.
    pub discard_alignment: u32,
    /// `max-write-zeroes-len`.
    pub max_write_zeroes_len: u64,
    /// `flush-needed`: the device has a volatile write cache.
    pub flush_needed: bool,
    /// `read-only` as requested by the client.
    pub read_only: bool,
    /// Number of queues set up.
    pub num_queues: usize,
    /// Whether they are poll queues.
    pub poll_queues: bool,
    /// `queue-size` in use.
    pub queue_size: u32,
}

impl DeviceInfo {
    /// Reads the properties of a started `blkio` with `num_queues` queues
    /// (poll queues if `poll_queues`).
    pub(crate) fn read(blkio: &Blkio, num_queues: usize, poll_queues: bool) -> Result<Self> {
        let u32_prop = |name| get_i32(blkio, name).map(|v| u32::try_from(v).unwrap_or(0));
        Ok(DeviceInfo {
            capacity: get_u64(blkio, "capacity")?,
            request_alignment: u32_prop("request-alignment")?,
            optimal_io_size: u32_prop("optimal-io-size")?,
            max_transfer: u32_prop("max-transfer")?,
            max_segments: u32_prop("max-segments")?,
            max_segment_len: u32_prop("max-segment-len")?,
            max_queues: u32_prop("max-queues")?,
            max_mem_regions: get_u64(blkio, "max-mem-regions")?,
            max_discard_len: get_u64(blkio, "max-discard-len")?,
            discard_alignment: u32_prop("discard-alignment")?,
            max_write_zeroes_len: get_u64(blkio, "max-write-zeroes-len")?,
            flush_needed: get_bool(blkio, "flush-needed")?,
            read_only: get_bool(blkio, "read-only")?,
            num_queues,
            poll_queues,
            queue_size: u32_prop("queue-size")?,
        })
    }
}

pub(crate) fn get_i32(blkio: &Blkio, name: &str) -> Result<i32> {
    blkio.get_i32(name).map_err(|e| Error::setup(format!("reading property {name}"), &e))
}

fn get_u64(blkio: &Blkio, name: &str) -> Result<u64> {
    blkio.get_u64(name).map_err(|e| Error::setup(format!("reading property {name}"), &e))
}

fn get_bool(blkio: &Blkio, name: &str) -> Result<bool> {
    blkio.get_bool(name).map_err(|e| Error::setup(format!("reading property {name}"), &e))
}
