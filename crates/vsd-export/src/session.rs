//! One front-end connection: the vhost-user messages that set up memory and
//! rings, and the worker threads they start and stop.
//!
//! This is written on the `vhost` crate directly rather than on
//! `vhost-user-backend`, whose daemon keeps every vring behind a lock taken
//! on the request path and does not wait for requests in flight when the
//! front-end stops a ring (GET_VRING_BASE). Here a worker owns its queues
//! outright, and stopping it waits for their I/O to finish, so the index
//! handed back never covers a request still being served.
//!
//! Queue q is served by worker thread q % `num-threads`. Starting or
//! stopping a queue stops its thread and starts a new one with the new set
//! of queues; the others lose nothing but the time their requests in flight
//! take to complete. That happens only when the front-end reconfigures a
//! ring, never on the request path.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;

use vhost::VhostUserMemoryRegionBase;
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags, VhostUserInflight, VhostUserLog,
    VhostUserMemoryRegion, VhostUserProtocolFeatures, VhostUserShMemConfig, VhostUserSharedMsg,
    VhostUserSingleMemoryRegion, VhostUserVirtioFeatures, VhostUserVringAddrFlags, VhostUserVringState,
};
use vhost::vhost_user::{Error as ProtocolError, GpuBackend, Result as ProtocolResult, VhostUserBackendReqHandlerMut};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use vm_memory::mmap::MmapRegion;
use vm_memory::{GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap, GuestRegionMmap};

use crate::config::{MAX_QUEUE_SIZE, MAX_QUEUES};
use crate::device::BlkDevice;
use crate::inflight::{self, InflightRegion};
use crate::worker::{QueueRun, Worker};
use vsd_virtio::dirty_log::DirtyLog;
use vsd_virtio::ram::GuestRam;
use vsd_virtio::ring::SplitQueue;

/// Memory slots offered with CONFIGURE_MEM_SLOTS (the common vhost limit).
const MAX_MEM_SLOTS: u64 = 509;

/// How the front-end's addresses map to guest physical addresses.
struct Mapping {
    front_end_addr: u64,
    size: u64,
    guest_addr: u64,
}

/// One virtqueue as the front-end set it up.
#[derive(Default)]
struct Vring {
    size: u16,
    /// Descriptor table, available ring, used ring (guest addresses).
    rings: Option<[u64; 3]>,
    next_avail: u16,
    /// Taken by the worker while the ring runs.
    kick: Option<File>,
    call: Option<File>,
    enabled: bool,
    /// An inflight region was handed over and this ring has not started
    /// since: what a previous back-end left undone is to be recovered.
    recover: bool,
    /// VHOST_VRING_F_LOG: the guest address at which the used ring's
    /// writes are logged while the dirty log is on.
    log_addr: Option<u64>,
}

/// The state of one connection.
pub(crate) struct Session {
    device: Arc<BlkDevice>,
    acked_features: u64,
    acked_protocol_features: u64,
    mem: GuestMemoryAtomic<GuestMemoryMmap>,
    mappings: Vec<Mapping>,
    vrings: Vec<Vring>,
    /// The worker threads, by number; `None` while none of its queues runs.
    threads: Vec<Option<Worker>>,
    /// The front-end's inflight region (SET_INFLIGHT_FD), if any.
    inflight: Option<Arc<InflightRegion>>,
    /// The front-end's dirty log (SET_LOG_BASE), if any; written to while
    /// VHOST_F_LOG_ALL is on.
    log: Option<Arc<DirtyLog>>,
    /// An eventfd to signal once a batch wrote to the log (SET_LOG_FD).
    log_call: Option<Arc<File>>,
}

/// A kick or call descriptor never holds a worker, which may serve other
/// exports' queues too (QEMU's own eventfds are non-blocking already).
fn never_block(fd: &Option<File>) {
    if let Some(file) = fd
        && let Err(e) = vsd_sys::set_nonblocking(file.as_fd())
    {
        log::warn!("cannot make a front-end's eventfd non-blocking: {e}");
    }
}

fn invalid(reason: &str) -> ProtocolError {
    ProtocolError::ReqHandlerError(io::Error::new(io::ErrorKind::InvalidInput, reason.to_string()))
}

impl Session {
    pub(crate) fn new(device: Arc<BlkDevice>) -> Self {
        let queues = usize::from(device.config.num_queues);
        Self {
            threads: (0..device.config.num_threads).map(|_| None).collect(),
            device,
            acked_features: 0,
            acked_protocol_features: 0,
            mem: GuestMemoryAtomic::new(GuestMemoryMmap::new()),
            mappings: Vec::new(),
            vrings: (0..queues).map(|_| Vring::default()).collect(),
            inflight: None,
            log: None,
            log_call: None,
        }
    }

    fn vring(&mut self, index: u32) -> ProtocolResult<&mut Vring> {
        self.vrings.get_mut(index as usize).ok_or(ProtocolError::InvalidParam)
    }

    /// Stops a ring, keeping where it got to. The other queues of its
    /// thread go on in a new one.
    fn pause(&mut self, index: u32) -> ProtocolResult<()> {
        self.vring(index)?;
        let (queue, thread) = (index as u16, self.thread_of(index));
        if !self.threads[thread].as_ref().is_some_and(|worker| worker.serves(queue)) {
            return Ok(());
        }
        let mut runs = self.stop_thread(thread);
        if let Some(at) = runs.iter().position(|run| run.index == queue) {
            self.park(runs.remove(at));
        }
        self.start_thread(thread, runs)
    }

    /// Starts a ring if the front-end has given it all it needs, restarting
    /// its thread with it.
    fn resume(&mut self, index: u32) -> ProtocolResult<()> {
        let Some(run) = self.queue_run(index)? else { return Ok(()) };
        let thread = self.thread_of(index);
        let mut runs = self.stop_thread(thread);
        runs.push(run);
        runs.sort_by_key(|run| run.index);
        self.start_thread(thread, runs)
    }

    /// The thread that serves ring `index`.
    fn thread_of(&self, index: u32) -> usize {
        usize::from(self.device.config.thread_of(index as u16))
    }

    /// Stops a thread, if it runs; returns its queues.
    fn stop_thread(&mut self, thread: usize) -> Vec<QueueRun> {
        self.threads[thread].take().map(Worker::stop).unwrap_or_default()
    }

    /// Starts a thread serving `runs`, unless there are none.
    fn start_thread(&mut self, thread: usize, runs: Vec<QueueRun>) -> ProtocolResult<()> {
        if runs.is_empty() {
            return Ok(());
        }
        let (mem, device) = (self.mem.clone(), self.device.clone());
        let worker = match self.device.iothreads.get(thread) {
            Some(iothread) => Worker::start_on(iothread, runs, mem, device),
            None => Worker::start(thread as u16, runs, mem, device),
        }
        .map_err(ProtocolError::ReqHandlerError)?;
        self.threads[thread] = Some(worker);
        Ok(())
    }

    /// The dirty log, while the front-end has logging on.
    fn active_log(&self) -> Option<Arc<DirtyLog>> {
        let logging = self.acked_features & VhostUserVirtioFeatures::LOG_ALL.bits() != 0;
        self.log.clone().filter(|_| logging)
    }

    /// Gives a queue the dirty log as it now stands: for the requests'
    /// writes, and for the used ring's if the ring asked for it.
    fn apply_log(&self, run: &mut QueueRun) {
        run.log = self.active_log();
        run.log_call = self.log_call.clone().filter(|_| run.log.is_some());
        let log_addr = self.vrings[usize::from(run.index)].log_addr;
        run.queue.set_used_log(run.log.clone().zip(log_addr));
    }

    /// Starts or stops logging, or moves to a new log, on every running
    /// queue. Each thread stops first, so the requests it has in flight
    /// complete into the log it had; its queues then carry on where they
    /// were, with the new one.
    fn relog(&mut self) -> ProtocolResult<()> {
        for thread in 0..self.threads.len() {
            let mut runs = self.stop_thread(thread);
            for run in &mut runs {
                self.apply_log(run);
            }
            self.start_thread(thread, runs)?;
        }
        Ok(())
    }

    /// SET_LOG_FD: an eventfd the workers signal after a batch that wrote
    /// to the dirty log (the `vhost` crate does not pass the message on: see
    /// [`crate::channel`]).
    pub(crate) fn set_log_fd(&mut self, file: File) -> io::Result<()> {
        let target = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))?;
        if target.as_os_str() != "anon_inode:[eventfd]" {
            let what = target.display();
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("the log descriptor is {what}, not an eventfd"),
            ));
        }
        self.log_call = Some(Arc::new(file));
        self.relog().map_err(|e| io::Error::other(e.to_string()))
    }

    /// Keeps what a stopped queue's worker handed back in its ring.
    fn park(&mut self, run: QueueRun) {
        let vring = &mut self.vrings[usize::from(run.index)];
        vring.next_avail = run.queue.next_avail();
        vring.kick = Some(run.kick);
        vring.call = run.call;
    }

    /// Runs `f` with every queue stopped (their requests in flight complete
    /// first), then lets them go on. While the node is inactive they stay
    /// stopped: requests wait in their rings until it is activated.
    pub(crate) fn with_queues_stopped<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let stopped: Vec<Vec<QueueRun>> = (0..self.threads.len()).map(|thread| self.stop_thread(thread)).collect();
        let out = f();
        let active = self.device.node().active();
        for (thread, runs) in stopped.into_iter().enumerate() {
            if !active {
                runs.into_iter().for_each(|run| self.park(run));
            } else if let Err(e) = self.start_thread(thread, runs) {
                log::error!("export '{}': cannot restart queue worker {thread}: {e}", self.device.config.id);
            }
        }
        // Rings held while the node was inactive start now.
        for index in 0..self.vrings.len() as u32 {
            if let Err(e) = self.resume(index) {
                log::error!("export '{}': cannot start vring {index}: {e}", self.device.config.id);
            }
        }
        out
    }

    /// What a worker needs to run ring `index`, if the ring is ready and
    /// not running; its kick and call descriptors go with it.
    fn queue_run(&mut self, index: u32) -> ProtocolResult<Option<QueueRun>> {
        let node = self.device.node();
        if !node.active() {
            log::debug!("vring {index}: held while node '{}' is inactive", node.name());
            return Ok(None);
        }
        let event_idx = self.acked_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        let mem = self.mem.memory();
        let device = self.device.clone();
        let region = self.inflight.clone();
        let vring = self.vring(index)?;
        let ready = vring.enabled && vring.kick.is_some() && vring.rings.is_some();
        let (Some(rings), true) = (vring.rings, ready) else { return Ok(None) };
        let ram = GuestRam::new(mem.into_inner());
        let mut queue = SplitQueue::new(vring.size, rings, vring.next_avail, event_idx, &ram)
            .map_err(|e| ProtocolError::ReqHandlerError(io::Error::other(format!("vring {index}: {e}"))))?;
        let mut tracker = region.as_ref().and_then(|r| r.queue(index as u16, vring.size));
        if region.is_some() && tracker.is_none() {
            log::warn!("vring {index}: the inflight region has no room for it; its requests are not tracked");
        }
        let mut resubmit = None;
        if let Some(tracker) = &mut tracker
            && std::mem::take(&mut vring.recover)
            && let Some(recovery) = tracker.recover(queue.next_used(), vring.size)
        {
            // The front-end's ring base cannot be trusted here: after losing
            // a back-end, QEMU sends the used index, which leaves out the
            // requests still in flight and those completed out of order.
            log::info!(
                "export '{}' vring {index}: taking over from a previous back-end: {} requests in flight, \
                 next_avail {} (the front-end said {})",
                device.config.id,
                recovery.resubmit.len(),
                recovery.next_avail,
                vring.next_avail
            );
            queue.set_next_avail(recovery.next_avail);
            vring.next_avail = recovery.next_avail;
            resubmit = Some(recovery.resubmit);
        }
        let (Some(kick), call) = (vring.kick.take(), vring.call.take()) else { return Ok(None) };
        log::debug!("vring {index}: start, size {} next_avail {} rings {rings:x?}", vring.size, vring.next_avail);
        let mut run = QueueRun {
            index: index as u16,
            queue,
            kick,
            call,
            inflight: tracker,
            resubmit,
            broken: false,
            log: None,
            log_call: None,
        };
        self.apply_log(&mut run);
        Ok(Some(run))
    }

    /// Applies a change to a ring with it stopped, then restarts it.
    fn reconfigure(&mut self, index: u32, change: impl FnOnce(&mut Vring) -> ProtocolResult<()>) -> ProtocolResult<()> {
        self.pause(index)?;
        change(self.vring(index)?)?;
        self.resume(index)
    }

    fn stop_all(&mut self) {
        for thread in 0..self.threads.len() {
            for run in self.stop_thread(thread) {
                self.park(run);
            }
        }
    }

    fn to_guest_addr(&self, front_end_addr: u64) -> ProtocolResult<u64> {
        self.mappings
            .iter()
            .find(|m| front_end_addr.wrapping_sub(m.front_end_addr) < m.size)
            .map(|m| front_end_addr - m.front_end_addr + m.guest_addr)
            .ok_or_else(|| invalid("ring address outside guest memory"))
    }

    fn map_region(mapping: MmapRegion, guest_addr: u64) -> ProtocolResult<Arc<GuestRegionMmap>> {
        GuestRegionMmap::new(mapping, GuestAddress(guest_addr))
            .map(Arc::new)
            .ok_or_else(|| invalid("memory region overflows the guest address space"))
    }
}

/// Refuses a memory region that runs past the end of its file: touching
/// the unbacked part would kill the daemon with SIGBUS. (A front-end that
/// shrinks the file later still could; QEMU's memfd backend seals it.)
fn backed(file: &File, offset: u64, size: u64) -> ProtocolResult<()> {
    let len = file.metadata().map_err(|e| invalid(&format!("memory region file: {e}")))?.len();
    match offset.checked_add(size) {
        Some(end) if end <= len => Ok(()),
        _ => {
            Err(invalid(&format!("memory region of {size} bytes at offset {offset} runs past its file ({len} bytes)")))
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.stop_all();
    }
}

impl VhostUserBackendReqHandlerMut for Session {
    fn set_owner(&mut self) -> ProtocolResult<()> {
        Ok(())
    }

    fn reset_owner(&mut self) -> ProtocolResult<()> {
        self.stop_all();
        let device = self.device.clone();
        *self = Session::new(device);
        Ok(())
    }

    fn reset_device(&mut self) -> ProtocolResult<()> {
        self.reset_owner()
    }

    fn get_features(&mut self) -> ProtocolResult<u64> {
        Ok(self.device.features())
    }

    fn set_features(&mut self, features: u64) -> ProtocolResult<()> {
        if features & !self.device.features() != 0 {
            return Err(ProtocolError::InvalidParam);
        }
        let log_all = VhostUserVirtioFeatures::LOG_ALL.bits();
        if (features ^ self.acked_features) & !log_all == 0 {
            // QEMU turns logging on and off with the rings running: they
            // carry on, with or without the log.
            self.acked_features = features;
            log::debug!("dirty logging {}", if features & log_all != 0 { "on" } else { "off" });
            return self.relog();
        }
        self.stop_all();
        self.acked_features = features;
        // Without PROTOCOL_FEATURES rings start enabled (vhost-user spec,
        // "Ring states").
        let start_enabled = features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() == 0;
        for index in 0..self.vrings.len() as u32 {
            if start_enabled {
                self.vring(index)?.enabled = true;
            }
            self.resume(index)?;
        }
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        regions: &[VhostUserMemoryRegion],
        files: Vec<File>,
        postcopy: Option<bool>,
    ) -> ProtocolResult<Option<Vec<VhostUserMemoryRegionBase>>> {
        if postcopy.is_some() {
            return Err(ProtocolError::InvalidOperation("postcopy is not supported"));
        }
        let mut mapped = Vec::with_capacity(regions.len());
        let mut mappings = Vec::with_capacity(regions.len());
        for (region, file) in regions.iter().zip(files) {
            backed(&file, region.mmap_offset, region.memory_size)?;
            mapped.push(Self::map_region(region.mmap_region(file)?, region.guest_phys_addr)?);
            mappings.push(Mapping {
                front_end_addr: region.user_addr,
                size: region.memory_size,
                guest_addr: region.guest_phys_addr,
            });
        }
        let memory = GuestMemoryMmap::from_arc_regions(mapped).map_err(|e| invalid(&e.to_string()))?;
        // Workers load the new table at their next batch; requests in flight
        // keep the old mappings alive until they complete.
        self.mem.lock().map_err(|_| invalid("memory lock poisoned"))?.replace(memory);
        self.mappings = mappings;
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> ProtocolResult<()> {
        if num == 0 || num > u32::from(MAX_QUEUE_SIZE) || !num.is_power_of_two() {
            return Err(invalid("queue size must be a power of two up to 1024"));
        }
        self.reconfigure(index, |v| {
            v.size = num as u16;
            Ok(())
        })
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        log: u64,
    ) -> ProtocolResult<()> {
        let rings = [self.to_guest_addr(descriptor)?, self.to_guest_addr(available)?, self.to_guest_addr(used)?];
        let log_addr = flags.contains(VhostUserVringAddrFlags::VHOST_VRING_F_LOG).then_some(log);
        if let Some(addr) = log_addr
            && !self.mappings.iter().any(|m| addr.wrapping_sub(m.guest_addr) < m.size)
        {
            return Err(invalid(&format!(
                "vring {index}: the used ring's log address {addr:#x} is not in guest memory"
            )));
        }
        self.reconfigure(index, |v| {
            v.rings = Some(rings);
            v.log_addr = log_addr;
            Ok(())
        })
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> ProtocolResult<()> {
        self.reconfigure(index, |v| {
            v.next_avail = base as u16;
            Ok(())
        })
    }

    fn get_vring_base(&mut self, index: u32) -> ProtocolResult<VhostUserVringState> {
        // Stopping waits for the requests in flight, so the index returned
        // covers only requests whose completions have been published.
        self.pause(index)?;
        let vring = self.vring(index)?;
        log::debug!("vring {index}: stopped at {}", vring.next_avail);
        // The ring is stopped until the next SET_VRING_KICK.
        vring.kick = None;
        Ok(VhostUserVringState::new(index, u32::from(vring.next_avail)))
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> ProtocolResult<()> {
        never_block(&fd);
        self.reconfigure(u32::from(index), |v| {
            v.kick = fd;
            Ok(())
        })
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> ProtocolResult<()> {
        never_block(&fd);
        self.reconfigure(u32::from(index), |v| {
            v.call = fd;
            Ok(())
        })
    }

    fn set_vring_err(&mut self, index: u8, _fd: Option<File>) -> ProtocolResult<()> {
        self.vring(u32::from(index)).map(drop)
    }

    fn get_protocol_features(&mut self) -> ProtocolResult<VhostUserProtocolFeatures> {
        Ok(VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::BACKEND_REQ
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD
            | VhostUserProtocolFeatures::LOG_SHMFD)
    }

    fn set_protocol_features(&mut self, features: u64) -> ProtocolResult<()> {
        self.acked_protocol_features = features;
        Ok(())
    }

    fn get_queue_num(&mut self) -> ProtocolResult<u64> {
        Ok(self.vrings.len() as u64)
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> ProtocolResult<()> {
        log::debug!("vring {index}: enable {enable}");
        self.reconfigure(index, |v| {
            v.enabled = enable;
            Ok(())
        })
    }

    fn get_config(&mut self, offset: u32, size: u32, _flags: VhostUserConfigFlags) -> ProtocolResult<Vec<u8>> {
        let space = self.device.config_space();
        let start = offset as usize;
        let end = start.checked_add(size as usize).ok_or(ProtocolError::InvalidParam)?;
        // Front-ends built against newer headers may ask for more than this
        // device defines: the rest reads as zeroes.
        let mut out = vec![0u8; size as usize];
        if start < space.len() {
            let n = end.min(space.len()) - start;
            out[..n].copy_from_slice(&space[start..start + n]);
        }
        Ok(out)
    }

    fn set_config(&mut self, offset: u32, buf: &[u8], _flags: VhostUserConfigFlags) -> ProtocolResult<()> {
        if self.device.write_config(offset, buf) { Ok(()) } else { Err(invalid("only the wce byte is writable")) }
    }

    fn set_gpu_socket(&mut self, _gpu_backend: GpuBackend) -> ProtocolResult<()> {
        Err(ProtocolError::InvalidOperation("not a GPU device"))
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> ProtocolResult<File> {
        Err(ProtocolError::InvalidOperation("shared objects are not supported"))
    }

    fn get_inflight_fd(&mut self, inflight: &VhostUserInflight) -> ProtocolResult<(VhostUserInflight, File)> {
        let (num_queues, queue_size) = (inflight.num_queues, inflight.queue_size);
        if num_queues == 0 || num_queues > MAX_QUEUES || queue_size == 0 || queue_size > MAX_QUEUE_SIZE {
            return Err(invalid("inflight region: bad queue count or size"));
        }
        log::debug!("inflight region: new, {num_queues} queues of {queue_size}");
        inflight::create(num_queues, queue_size).map_err(ProtocolError::ReqHandlerError)
    }

    fn set_inflight_fd(&mut self, inflight: &VhostUserInflight, file: File) -> ProtocolResult<()> {
        if self.acked_protocol_features & VhostUserProtocolFeatures::INFLIGHT_SHMFD.bits() == 0 {
            return Err(ProtocolError::InvalidOperation("INFLIGHT_SHMFD was not negotiated"));
        }
        let region = InflightRegion::map(file, inflight).map_err(ProtocolError::ReqHandlerError)?;
        log::debug!("inflight region: {} bytes, {} queues of {}", { inflight.mmap_size }, { inflight.num_queues }, {
            inflight.queue_size
        });
        self.stop_all();
        self.inflight = Some(Arc::new(region));
        for index in 0..self.vrings.len() as u32 {
            self.vring(index)?.recover = true;
            self.resume(index)?;
        }
        Ok(())
    }

    fn get_max_mem_slots(&mut self) -> ProtocolResult<u64> {
        Ok(MAX_MEM_SLOTS)
    }

    fn add_mem_region(
        &mut self,
        region: &VhostUserSingleMemoryRegion,
        fd: File,
        postcopy: Option<bool>,
    ) -> ProtocolResult<Option<VhostUserMemoryRegionBase>> {
        if postcopy.is_some() {
            return Err(ProtocolError::InvalidOperation("postcopy is not supported"));
        }
        log::debug!("add region gpa {:#x} size {:#x}", { region.guest_phys_addr }, { region.memory_size });
        if self.mappings.len() as u64 >= MAX_MEM_SLOTS {
            return Err(invalid("too many memory regions"));
        }
        backed(&fd, region.mmap_offset, region.memory_size)?;
        let mapped = Self::map_region(region.mmap_region(fd)?, region.guest_phys_addr)?;
        let memory = self.mem.memory().insert_region(mapped).map_err(|e| invalid(&e.to_string()))?;
        self.mem.lock().map_err(|_| invalid("memory lock poisoned"))?.replace(memory);
        self.mappings.push(Mapping {
            front_end_addr: region.user_addr,
            size: region.memory_size,
            guest_addr: region.guest_phys_addr,
        });
        Ok(None)
    }

    fn remove_mem_region(&mut self, region: &VhostUserSingleMemoryRegion) -> ProtocolResult<()> {
        log::debug!("remove region gpa {:#x} size {:#x}", { region.guest_phys_addr }, { region.memory_size });
        let (memory, _) = self
            .mem
            .memory()
            .remove_region(GuestAddress(region.guest_phys_addr), region.memory_size)
            .map_err(|e| invalid(&e.to_string()))?;
        self.mem.lock().map_err(|_| invalid("memory lock poisoned"))?.replace(memory);
        self.mappings.retain(|m| m.guest_addr != region.guest_phys_addr);
        Ok(())
    }

    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> ProtocolResult<Option<File>> {
        Err(ProtocolError::InvalidOperation("device state transfer is not supported"))
    }

    fn check_device_state(&mut self) -> ProtocolResult<()> {
        Err(ProtocolError::InvalidOperation("device state transfer is not supported"))
    }

    fn get_shmem_config(&mut self) -> ProtocolResult<VhostUserShMemConfig> {
        Err(ProtocolError::InvalidOperation("shared memory regions are not supported"))
    }

    fn set_log_base(&mut self, region: &VhostUserLog, file: File) -> ProtocolResult<()> {
        let (size, offset) = (region.mmap_size, region.mmap_offset);
        let log = DirtyLog::map(file, size, offset).map_err(ProtocolError::ReqHandlerError)?;
        let memory_end = self.mappings.iter().map(|m| m.guest_addr.saturating_add(m.size)).max().unwrap_or(0);
        if !log.covers(memory_end) {
            return Err(invalid(&format!(
                "dirty log: {size} bytes cannot cover guest memory up to {memory_end:#x} (one bit per 4 KiB page)"
            )));
        }
        log::debug!("dirty log: {size} bytes at offset {offset}");
        // The old log stays mapped until every worker has moved to the new
        // one; the front-end reads it a last time once answered.
        self.log = Some(Arc::new(log));
        self.relog()
    }
}
