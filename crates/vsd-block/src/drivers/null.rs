//! `driver=null-co` and `driver=null-aio`: a device that does no I/O, to
//! measure everything else.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use vsd_engine::{IoQueue, NullQueue};

use crate::options::OptionMap;
use crate::{Allocation, BlockNode, GraphError};

pub(crate) struct NullNode {
    name: String,
    driver: &'static str,
    size: AtomicU64,
    read_zeroes: bool,
    latency: Duration,
    read_only: bool,
}

impl NullNode {
    pub(crate) fn open(name: String, driver: &'static str, opts: &mut OptionMap) -> Result<Self, GraphError> {
        // QEMU's defaults: 1 GiB, buffers left as they are, no latency.
        let size = opts.take_size("size")?.unwrap_or(1 << 30);
        let read_zeroes = opts.take_bool("read-zeroes")?.unwrap_or(false);
        let latency = Duration::from_nanos(opts.take_u64("latency-ns")?.unwrap_or(0));
        let read_only = opts.take_bool("read-only")?.unwrap_or(false);
        Ok(Self { name, driver, size: AtomicU64::new(size), read_zeroes, latency, read_only })
    }
}

impl BlockNode for NullNode {
    fn name(&self) -> &str {
        &self.name
    }

    fn driver(&self) -> &'static str {
        self.driver
    }

    fn size(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }

    fn resize(&self, size: u64) -> io::Result<()> {
        self.size.store(size, Ordering::Relaxed);
        Ok(())
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    /// With `read-zeroes=on` nothing is stored and everything reads as
    /// zeroes, as QEMU's null-co reports it; otherwise reads return
    /// whatever the buffers held: data.
    fn block_status(&self, _offset: u64, len: u64) -> io::Result<(Allocation, u64)> {
        Ok((if self.read_zeroes { Allocation::Hole } else { Allocation::Data }, len))
    }

    fn open_queue(&self, depth: u16) -> io::Result<Box<dyn IoQueue>> {
        Ok(Box::new(NullQueue::new(depth, self.read_zeroes, self.latency)?))
    }
}
