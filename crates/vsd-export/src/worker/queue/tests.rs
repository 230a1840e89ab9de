//! A queue worker's rounds against a virtqueue laid out in memory by hand,
//! as a guest driver lays it out, over a null-co or in-memory raw node.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::PathBuf;
use std::time::Duration;

use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};
use vsd_block::BlockGraph;
use vsd_block::options::OptionMap;
use vsd_virtio::ring::SplitQueue;

use super::*;
use crate::config::ExportConfig;

const SIZE: u16 = 32;
/// Requests in flight at most: three descriptors each.
const SLOTS: u16 = 10;
const DESC: u64 = 0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
/// Request i's header, data and status live at these plus i times a page.
const HEADERS: u64 = 0x10000;
const DATA: u64 = 0x20000;
const STATUS: u64 = 0x40000;
const PAGE: u64 = 0x1000;

const NEXT: u16 = 1;
const WRITE: u16 = 2;
const IN: u32 = 0;
const OUT: u32 = 1;
/// The ring's flag asking the guest not to kick (VRING_USED_F_NO_NOTIFY).
const NO_NOTIFY: u16 = 1;

/// The guest side: its memory, the queue's eventfds, and its next request.
struct Guest {
    mem: GuestMemoryAtomic<Memory>,
    kick: EventFd,
    call: EventFd,
    next: u16,
}

impl Guest {
    fn memory(&self) -> Arc<Memory> {
        self.mem.memory().into_inner()
    }

    fn put<T: vm_memory::ByteValued>(&self, value: T, at: u64) {
        self.memory().write_obj(value, GuestAddress(at)).unwrap();
    }

    fn get<T: vm_memory::ByteValued>(&self, at: u64) -> T {
        self.memory().read_obj(GuestAddress(at)).unwrap()
    }

    /// Descriptor `index`, chained to the next one if `flags` say so.
    fn descriptor(&self, index: u16, addr: u64, len: u32, flags: u16) {
        let at = DESC + 16 * u64::from(index);
        self.put(addr, at);
        self.put(len, at + 8);
        self.put(flags, at + 12);
        self.put(index + 1, at + 14);
    }

    /// Queues a request of `kind` at `sector` with `len` data bytes (`fill`
    /// for a write); returns its number.
    fn request(&mut self, kind: u32, sector: u64, len: u32, fill: u8) -> u16 {
        let n = self.next;
        let slot = n % SLOTS;
        let (header, data, status) = self.places(n);
        self.put(kind, header);
        self.put(0u32, header + 4);
        self.put(sector, header + 8);
        self.memory().write_slice(&vec![fill; len as usize], GuestAddress(data)).unwrap();
        self.put(0xffu8, status);
        let head = slot * 3;
        self.descriptor(head, header, 16, NEXT);
        self.descriptor(head + 1, data, len, if kind == IN { NEXT | WRITE } else { NEXT });
        self.descriptor(head + 2, status, 1, WRITE);
        self.put(head, AVAIL + 4 + 2 * u64::from(n % SIZE));
        self.next = n.wrapping_add(1);
        self.put(self.next, AVAIL + 2);
        n
    }

    /// Where request `n`'s header, data and status are.
    fn places(&self, n: u16) -> (u64, u64, u64) {
        let slot = u64::from(n % SLOTS);
        (HEADERS + slot * PAGE, DATA + slot * 2 * PAGE, STATUS + slot * PAGE)
    }

    fn status(&self, n: u16) -> u8 {
        self.get(self.places(n).2)
    }

    fn data(&self, n: u16, len: usize) -> Vec<u8> {
        let mut buf = vec![0; len];
        self.memory().read_slice(&mut buf, GuestAddress(self.places(n).1)).unwrap();
        buf
    }

    fn used_idx(&self) -> u16 {
        self.get(USED + 2)
    }

    fn used_flags(&self) -> u16 {
        self.get(USED)
    }

    fn signalled(&self) -> bool {
        self.call.read().is_ok()
    }
}

fn config(writable: bool) -> ExportConfig {
    ExportConfig {
        id: "unit".into(),
        node_name: "n".into(),
        addr: crate::config::Address::Unix(PathBuf::new()),
        writable,
        writethrough: false,
        num_queues: 1,
        num_threads: 1,
        iothreads: Vec::new(),
        queue_threads: Vec::new(),
        logical_block_size: 512,
        serial: "unit".into(),
        trace: true,
        poll_us: 0,
        call_batch_us: 0,
        cpu_affinity: Vec::new(),
        socket_mode: 0o600,
        socket_owner: None,
        socket_group: None,
        allow_inactive: false,
    }
}

/// A worker for one queue of `SIZE` entries (without EVENT_IDX) over the
/// node `blockdev` describes, and the guest that drives it.
fn worker(blockdev: &str, writable: bool) -> (QueueWorker, Guest) {
    let memory = Memory::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
    let mem = GuestMemoryAtomic::new(memory);
    let ram = GuestRam::new(mem.memory().into_inner());
    let queue = SplitQueue::new(SIZE, [DESC, AVAIL, USED], 0, false, &ram).unwrap();
    let (kick, call) = (EventFd::new(EFD_NONBLOCK).unwrap(), EventFd::new(EFD_NONBLOCK).unwrap());
    // SAFETY: each descriptor is a fresh duplicate that the File owns.
    let own = |fd: &EventFd| unsafe { File::from_raw_fd(libc::dup(fd.as_raw_fd())) };
    let run = QueueRun {
        index: 0,
        queue,
        kick: own(&kick),
        call: Some(own(&call)),
        inflight: None,
        resubmit: None,
        broken: false,
        log: None,
        log_call: None,
    };
    let node = BlockGraph::new().add(OptionMap::parse("--blockdev", blockdev).unwrap()).unwrap();
    let device = Arc::new(BlkDevice::new(config(writable), node, Vec::new()));
    let epoll = Epoll::new().unwrap();
    let poll = PollConfig::up_to_us(0);
    let mut worker = QueueWorker::new(run, 0, &epoll, mem.clone(), device, Arc::default(), poll).unwrap();
    worker.begin();
    (worker, Guest { mem, kick, call, next: 0 })
}

/// The guest kicks; the worker wakes and runs rounds until it has nothing
/// in flight.
fn serve(worker: &mut QueueWorker, guest: &Guest) {
    guest.kick.write(1).unwrap();
    worker.kicked_awake(0);
    for _ in 0..1000 {
        worker.round(false);
        if worker.in_flight() == 0 {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
        worker.io_ready();
    }
    panic!("requests still in flight");
}

const NULL: &str = "driver=null-co,node-name=n,size=1M,read-zeroes=on";

#[test]
fn a_round_serves_what_the_guest_queued_publishes_it_and_signals_once() {
    let (mut worker, mut guest) = worker(NULL, false);
    let reads: Vec<u16> = (0..2).map(|i| guest.request(IN, i * 8, 4096, 0xaa)).collect();
    serve(&mut worker, &guest);
    assert_eq!(guest.used_idx(), 2);
    for n in reads {
        assert_eq!(guest.status(n), 0, "VIRTIO_BLK_S_OK");
        assert!(guest.data(n, 4096).iter().all(|&b| b == 0), "null-co reads zeroes");
    }
    assert!(guest.signalled(), "the guest is told");
    assert!(!guest.signalled(), "once for the round");
    assert_eq!(guest.used_flags() & NO_NOTIFY, 0, "kicks are back on with the ring empty");
}

#[test]
fn writes_reach_the_node_and_read_back() {
    let dir = std::env::temp_dir().join(format!("vsd-worker-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let image = dir.join("disk.raw");
    File::create(&image).unwrap().set_len(1 << 20).unwrap();
    let (mut worker, mut guest) = worker(&format!("driver=file,node-name=n,filename={}", image.display()), true);
    let write = guest.request(OUT, 16, 4096, 0x5c);
    serve(&mut worker, &guest);
    assert_eq!(guest.status(write), 0);
    let read = guest.request(IN, 16, 4096, 0);
    serve(&mut worker, &guest);
    assert_eq!((guest.status(read), guest.used_idx()), (0, 2));
    assert!(guest.data(read, 4096).iter().all(|&b| b == 0x5c));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_requests_get_their_status_and_the_queue_goes_on() {
    let (mut worker, mut guest) = worker(NULL, false);
    let past_end = guest.request(IN, (1 << 20) / 512, 4096, 0);
    let read_only = guest.request(OUT, 0, 4096, 0x11);
    let good = guest.request(IN, 0, 512, 0xee);
    serve(&mut worker, &guest);
    assert_eq!(guest.used_idx(), 3);
    assert_eq!(guest.status(past_end), 1, "VIRTIO_BLK_S_IOERR");
    assert_eq!(guest.status(read_only), 1, "a write to a read-only export");
    assert_eq!(guest.status(good), 0);
    let stats = worker.stats.snapshot();
    assert_eq!(stats.op(vsd_trace::OpKind::Read).ops, 1, "only the good read reached the node");
    assert_eq!(stats.events.invalid, 2, "the others are counted as invalid");
}

#[test]
fn a_broken_ring_stops_the_queue_and_nothing_more_is_taken() {
    let (mut worker, mut guest) = worker(NULL, false);
    // An available index far past the ring's size: the guest broke it.
    guest.put(SIZE * 4, AVAIL + 2);
    serve(&mut worker, &guest);
    assert!(worker.run.broken);
    assert_eq!(worker.poll_window_ns(), 0, "a broken ring is not polled");
    guest.next = 0;
    guest.put(0u16, AVAIL + 2);
    guest.request(IN, 0, 512, 0);
    serve(&mut worker, &guest);
    assert_eq!(guest.used_idx(), 0, "nothing taken once broken");
}

#[test]
fn requests_queued_at_once_are_all_served_in_one_round() {
    let (mut worker, mut guest) = worker(NULL, false);
    for i in 0..SLOTS {
        guest.request(IN, u64::from(i), 512, 0);
    }
    guest.kick.write(1).unwrap();
    worker.kicked_awake(0);
    worker.round(false);
    // null-co completes within the submit: the round published them all.
    assert_eq!((guest.used_idx(), worker.in_flight()), (SLOTS, 0));
    assert!(guest.signalled());
    assert_eq!(guest.used_flags() & NO_NOTIFY, 0);
}
