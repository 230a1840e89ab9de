//! The virtio-blk device an export presents: features and config space.

use std::mem::offset_of;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use vhost::vhost_user::message::VhostUserVirtioFeatures;
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use vsd_block::BlockNode;
use vsd_trace::{ExportSnapshot, QueueStats};

use crate::IoThread;
use crate::config::ExportConfig;
use vsd_virtio::request::{Limits, SECTOR_SIZE, SEG_MAX, id_bytes};

/// Largest discard and write-zeroes, in sectors (32 MiB, as QEMU's export).
const MAX_RANGE_SECTORS: u32 = 65536;
/// Largest single data segment the guest may use.
const SIZE_MAX: u32 = 1 << 20;

/// One export's device, shared by its sessions and queue workers.
pub struct BlkDevice {
    pub(crate) config: ExportConfig,
    /// The node served; queues take it when they start (a live snapshot
    /// replaces it while they are stopped).
    node: RwLock<Arc<dyn BlockNode>>,
    /// The guest-visible write cache (WCE): when off, every write is made
    /// durable before it completes. The guest may toggle it (CONFIG_WCE).
    writeback: AtomicBool,
    /// Bytes the guest may address: whole logical blocks of the node. It
    /// changes when the node is resized.
    capacity: AtomicU64,
    /// Everything but the capacity, which [`BlkDevice::limits`] adds.
    limits: Limits,
    pub(crate) id: [u8; VIRTIO_BLK_ID_BYTES as usize],
    /// One per virtqueue, kept across connections; each is written only by
    /// the worker serving its queue at the time.
    pub(crate) stats: Vec<Arc<QueueStats>>,
    /// The I/O threads serving the queues, by worker thread (see
    /// `ExportConfig::iothreads`); empty: the export's own threads.
    pub(crate) iothreads: Vec<Arc<IoThread>>,
}

impl BlkDevice {
    pub(crate) fn new(config: ExportConfig, node: Arc<dyn BlockNode>, iothreads: Vec<Arc<IoThread>>) -> Self {
        let limits = Limits {
            capacity: 0,
            block_size: config.logical_block_size,
            writable: config.writable,
            max_discard_sectors: MAX_RANGE_SECTORS,
            max_write_zeroes_sectors: MAX_RANGE_SECTORS,
        };
        // Calibrated here, once, rather than while a front-end waits.
        let clock = config.trace.then(vsd_trace::Clock::get);
        let queue_stats = || Arc::new(clock.map_or_else(QueueStats::new, QueueStats::timed_by));
        let stats = (0..config.num_queues).map(|_| queue_stats()).collect();
        let device = Self {
            writeback: AtomicBool::new(!config.writethrough),
            capacity: AtomicU64::new(0),
            id: id_bytes(&config.serial),
            config,
            node: RwLock::new(node),
            limits,
            stats,
            iothreads,
        };
        device.refresh_capacity();
        device
    }

    /// The node served.
    pub(crate) fn node(&self) -> Arc<dyn BlockNode> {
        self.node.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Serves `node` from now on: call it with every queue stopped.
    pub(crate) fn set_node(&self, node: Arc<dyn BlockNode>) {
        *self.node.write().unwrap_or_else(PoisonError::into_inner) = node;
        self.refresh_capacity();
    }

    /// Reads the node's size again (after a resize); returns the capacity.
    pub(crate) fn refresh_capacity(&self) -> u64 {
        let block = u64::from(self.config.logical_block_size);
        // Whole logical blocks only: a partial block at the end cannot be
        // addressed with aligned requests.
        let capacity = self.node().size() / block * block;
        self.capacity.store(capacity, Ordering::Relaxed);
        capacity
    }

    /// The request limits, with the capacity as of now.
    pub(crate) fn limits(&self) -> Limits {
        Limits { capacity: self.capacity.load(Ordering::Relaxed), ..self.limits }
    }

    /// The statistics of every queue, as of now.
    pub(crate) fn snapshot(&self) -> ExportSnapshot {
        ExportSnapshot::from_queues(self.stats.iter().map(|q| q.snapshot()).collect())
    }

    /// Whether writes may sit in a volatile cache until a FLUSH.
    pub(crate) fn writeback(&self) -> bool {
        self.writeback.load(Ordering::Relaxed)
    }

    /// The virtio and vhost-user feature bits offered.
    pub(crate) fn features(&self) -> u64 {
        let mut blk: u32 = (1 << VIRTIO_BLK_F_SIZE_MAX)
            | (1 << VIRTIO_BLK_F_SEG_MAX)
            | (1 << VIRTIO_BLK_F_BLK_SIZE)
            | (1 << VIRTIO_BLK_F_TOPOLOGY)
            | (1 << VIRTIO_BLK_F_FLUSH)
            | (1 << VIRTIO_BLK_F_CONFIG_WCE)
            | (1 << VIRTIO_BLK_F_MQ);
        if self.config.writable {
            blk |= (1 << VIRTIO_BLK_F_DISCARD) | (1 << VIRTIO_BLK_F_WRITE_ZEROES);
        } else {
            blk |= 1 << VIRTIO_BLK_F_RO;
        }
        let ring = (1 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_RING_F_EVENT_IDX) | (1 << VIRTIO_RING_F_INDIRECT_DESC);
        // LOG_ALL: the back-end can log its writes to guest memory for a
        // live migration (with the LOG_SHMFD protocol feature).
        let vhost = VhostUserVirtioFeatures::PROTOCOL_FEATURES | VhostUserVirtioFeatures::LOG_ALL;
        u64::from(blk) | ring | vhost.bits()
    }

    /// The config space (`struct virtio_blk_config`) as the guest reads it.
    pub(crate) fn config_space(&self) -> Vec<u8> {
        let mut space = vec![0u8; std::mem::size_of::<virtio_blk_config>()];
        let mut put = |offset: usize, bytes: &[u8]| space[offset..offset + bytes.len()].copy_from_slice(bytes);
        let block = self.config.logical_block_size;
        put(offset_of!(virtio_blk_config, capacity), &(self.limits().capacity / SECTOR_SIZE).to_le_bytes());
        put(offset_of!(virtio_blk_config, size_max), &SIZE_MAX.to_le_bytes());
        put(offset_of!(virtio_blk_config, seg_max), &SEG_MAX.to_le_bytes());
        put(offset_of!(virtio_blk_config, blk_size), &block.to_le_bytes());
        put(offset_of!(virtio_blk_config, min_io_size), &1u16.to_le_bytes());
        put(offset_of!(virtio_blk_config, wce), &[u8::from(self.writeback())]);
        put(offset_of!(virtio_blk_config, num_queues), &self.config.num_queues.to_le_bytes());
        put(offset_of!(virtio_blk_config, max_discard_sectors), &MAX_RANGE_SECTORS.to_le_bytes());
        put(offset_of!(virtio_blk_config, max_discard_seg), &1u32.to_le_bytes());
        put(offset_of!(virtio_blk_config, discard_sector_alignment), &(block / 512).to_le_bytes());
        put(offset_of!(virtio_blk_config, max_write_zeroes_sectors), &MAX_RANGE_SECTORS.to_le_bytes());
        put(offset_of!(virtio_blk_config, max_write_zeroes_seg), &1u32.to_le_bytes());
        put(offset_of!(virtio_blk_config, write_zeroes_may_unmap), &[1]);
        space
    }

    /// Applies a config space write; only the WCE byte is writable.
    pub(crate) fn write_config(&self, offset: u32, data: &[u8]) -> bool {
        if offset as usize != offset_of!(virtio_blk_config, wce) || data.len() != 1 {
            return false;
        }
        self.writeback.store(data[0] != 0, Ordering::Relaxed);
        log::info!(
            "export '{}': guest set its write cache {}",
            self.config.id,
            if data[0] != 0 { "on" } else { "off" }
        );
        true
    }
}
