//! Connecting to a vhost-user-blk back-end.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use blkio::{Blkio, Errno};

use crate::buffer::{Buffer, SharedBlkio, lock};
use crate::device::{DeviceInfo, get_i32};
use crate::error::{Error, Result};
use crate::queue::Queue;

/// The largest queue size [`ClientOptions::queue_size_for_iodepth`] picks.
pub const MAX_QUEUE_SIZE: u32 = 1024;

/// Virtqueue descriptors budgeted per request: a read or write uses 3
/// (header, data, status); one spare keeps libblkio from ever backlogging.
pub const DESCRIPTORS_PER_REQUEST: u32 = 4;

/// How to connect.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Number of virtqueues to set up (at least 1, at most the device's
    /// `max-queues`).
    pub num_queues: usize,
    /// Set the queues up as libblkio poll queues (`num-poll-queues`): no
    /// completion interrupts, completions are busy-polled.
    pub poll_queues: bool,
    /// Open read-only (libblkio property `read-only`). Required for devices
    /// offering `VIRTIO_BLK_F_RO`; makes libblkio fail writes with `EBADF`.
    pub read_only: bool,
    /// Virtqueue size (power of two); `None` keeps libblkio's default (256).
    /// Each request takes 3 descriptors, see
    /// [`ClientOptions::queue_size_for_iodepth`].
    pub queue_size: Option<u32>,
    /// How long the blocking request helpers of [`Queue`] wait for a
    /// completion before giving up.
    pub io_timeout: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            num_queues: 1,
            poll_queues: false,
            read_only: false,
            queue_size: None,
            io_timeout: Duration::from_secs(5),
        }
    }
}

impl ClientOptions {
    /// The smallest power-of-two queue size of at least
    /// [`DESCRIPTORS_PER_REQUEST`]` * iodepth`, so `iodepth` requests never
    /// wait in libblkio's backlog; at most [`MAX_QUEUE_SIZE`] (so `iodepth`
    /// is limited to 256).
    pub fn queue_size_for_iodepth(iodepth: u32) -> Result<u32> {
        let max_depth = MAX_QUEUE_SIZE / DESCRIPTORS_PER_REQUEST;
        if iodepth == 0 || iodepth > max_depth {
            return Err(Error::InvalidArgument(format!(
                "iodepth {iodepth} must be between 1 and {max_depth} \
                 (queue size is capped at {MAX_QUEUE_SIZE}, \
                 {DESCRIPTORS_PER_REQUEST} descriptors per request)"
            )));
        }
        Ok((iodepth * DESCRIPTORS_PER_REQUEST).next_power_of_two().min(MAX_QUEUE_SIZE))
    }
}

/// A started connection to a vhost-user-blk back-end.
///
/// Queues are taken out of the client ([`Client::take_queue`]) and can be
/// moved to other threads; they keep the connection alive even after the
/// client is dropped.
pub struct Client {
    blkio: SharedBlkio,
    info: DeviceInfo,
    queues: Vec<Option<Queue>>,
}

impl Client {
    /// Connects to the vhost-user socket, negotiates and starts the device.
    ///
    /// Fails with [`Error::DeviceReadOnly`] if the device offers
    /// `VIRTIO_BLK_F_RO` and `opts.read_only` is false. Connecting itself has
    /// no timeout (libblkio performs the vhost-user handshake synchronously).
    pub fn connect(socket: &Path, opts: ClientOptions) -> Result<Client> {
        validate_options(&opts)?;
        let mut blkio = Blkio::new(crate::DRIVER).map_err(|e| Error::setup("creating the libblkio instance", &e))?;
        configure_before_connect(&mut blkio, socket, &opts)?;
        blkio.connect().map_err(|e| Error::setup(format!("connecting to {}", socket.display()), &e))?;
        let max_queues = get_i32(&blkio, "max-queues")?;
        configure_queues(&mut blkio, &opts, max_queues)?;
        let outcome = blkio.start().map_err(|e| match e.errno() {
            Errno::ROFS => Error::DeviceReadOnly,
            _ => Error::setup("starting the device", &e),
        })?;
        let info = DeviceInfo::read(&blkio, opts.num_queues, opts.poll_queues)?;
        let blkio: SharedBlkio = Arc::new(Mutex::new(blkio));
        let blkioqs = if opts.poll_queues { outcome.poll_queues } else { outcome.queues };
        let queues = blkioqs
            .into_iter()
            .enumerate()
            .map(|(index, q)| Some(Queue::new(index, q, &blkio, &info, opts.io_timeout)))
            .collect();
        Ok(Client { blkio, info, queues })
    }

    /// Device properties read at connect time.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The current capacity in bytes (re-read from the device's config
    /// space).
    pub fn capacity(&self) -> Result<u64> {
        lock(&self.blkio).get_u64("capacity").map_err(|e| Error::setup("reading property capacity", &e))
    }

    /// Any libblkio property as a string, e.g. `"capacity"`,
    /// `"request-alignment"`, `"max-transfer"`, `"read-only"`.
    pub fn property(&self, name: &str) -> Result<String> {
        lock(&self.blkio).get_str(name).map_err(|e| Error::setup(format!("reading property {name}"), &e))
    }

    /// Takes queue `index` out of the client so it can be moved to a thread.
    pub fn take_queue(&mut self, index: usize) -> Result<Queue> {
        let count = self.queues.len();
        self.queues
            .get_mut(index)
            .ok_or_else(|| Error::InvalidArgument(format!("queue {index} does not exist ({count} queues)")))?
            .take()
            .ok_or_else(|| Error::InvalidArgument(format!("queue {index} was already taken")))
    }

    /// Takes all queues not taken yet, in index order.
    pub fn take_queues(&mut self) -> Vec<Queue> {
        self.queues.iter_mut().filter_map(Option::take).collect()
    }

    /// Allocates a zeroed buffer of `len` bytes mapped into the back-end.
    pub fn alloc_buffer(&self, len: usize) -> Result<Buffer> {
        Buffer::alloc(&self.blkio, len)
    }
}

fn validate_options(opts: &ClientOptions) -> Result<()> {
    if opts.num_queues == 0 {
        return Err(Error::InvalidArgument("num_queues must be at least 1".into()));
    }
    if let Some(size) = opts.queue_size
        && (!size.is_power_of_two() || size > 32768)
    {
        return Err(Error::InvalidArgument(format!("queue_size {size} must be a power of two no larger than 32768")));
    }
    Ok(())
}

fn configure_before_connect(blkio: &mut Blkio, socket: &Path, opts: &ClientOptions) -> Result<()> {
    let path = socket
        .to_str()
        .ok_or_else(|| Error::InvalidArgument(format!("socket path {} is not UTF-8", socket.display())))?;
    blkio.set_str("path", path).map_err(|e| Error::setup("setting property path", &e))?;
    blkio.set_bool("read-only", opts.read_only).map_err(|e| Error::setup("setting property read-only", &e))
}

fn configure_queues(blkio: &mut Blkio, opts: &ClientOptions, max_queues: i32) -> Result<()> {
    let wanted = i32::try_from(opts.num_queues).unwrap_or(i32::MAX);
    if wanted > max_queues {
        return Err(Error::InvalidArgument(format!("{wanted} queues requested but the device offers {max_queues}")));
    }
    let (interrupt, poll) = if opts.poll_queues { (0, wanted) } else { (wanted, 0) };
    set_i32(blkio, "num-queues", interrupt)?;
    set_i32(blkio, "num-poll-queues", poll)?;
    if let Some(size) = opts.queue_size {
        set_i32(blkio, "queue-size", i32::try_from(size).unwrap_or(i32::MAX))?;
    }
    Ok(())
}

fn set_i32(blkio: &mut Blkio, name: &str, value: i32) -> Result<()> {
    blkio.set_i32(name, value).map_err(|e| Error::setup(format!("setting property {name} to {value}"), &e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_size_holds_iodepth() {
        assert_eq!(ClientOptions::queue_size_for_iodepth(1).ok(), Some(4));
        assert_eq!(ClientOptions::queue_size_for_iodepth(32).ok(), Some(128));
        assert_eq!(ClientOptions::queue_size_for_iodepth(33).ok(), Some(256));
        assert_eq!(ClientOptions::queue_size_for_iodepth(256).ok(), Some(1024));
        assert!(ClientOptions::queue_size_for_iodepth(257).is_err());
        assert!(ClientOptions::queue_size_for_iodepth(0).is_err());
    }

    #[test]
    fn rejects_bad_options() {
        let zero_queues = ClientOptions { num_queues: 0, ..ClientOptions::default() };
        assert!(validate_options(&zero_queues).is_err());
        let odd_size = ClientOptions { queue_size: Some(100), ..ClientOptions::default() };
        assert!(validate_options(&odd_size).is_err());
        assert!(validate_options(&ClientOptions::default()).is_ok());
    }
}
