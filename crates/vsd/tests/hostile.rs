//! A hostile front-end against the real vsd binary: broken descriptor
//! chains, rings and vhost-user messages, written straight into guest
//! memory by the test's own front-end (`common::frontend`).
//!
//! Every case runs on a fresh connection with queue 0 and checks that vsd
//! answered as the virtio spec and `vsd-export/src/request.rs` say (a status
//! byte, a chain returned with used length 0, or the queue given up), that
//! no byte of guest memory outside the request's writable buffers and the
//! used ring changed, that the daemon still runs, and that queue 1 (and
//! queue 0, unless it was given up) still serves a write and a read.
//!
//! Run with `--nocapture` to see each case and the count.

mod common;

use std::ops::Range;
use std::time::Duration;

use common::frontend::{
    BlkFrontend, Desc, GuestMemory, NEXT, QUEUE_SIZE, READ, REGION_A, REGION_B, REGION_SIZE, WRITE, linked, write_desc,
    write_header,
};
use common::{Daemon, Scratch, file_export};
use vhost::vhost_user::VhostUserFrontend;
use vhost::{VhostBackend, VringConfigData};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_RO, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};
use virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT;

const OK: u8 = VIRTIO_BLK_S_OK as u8;
const IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
const UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;
const INDIRECT: u16 = VRING_DESC_F_INDIRECT as u16;

/// Where the hostile request's parts go.
const HEADER: u64 = REGION_A + 0x2_0000;
const STATUS: u64 = REGION_A + 0x2_1000;
const DATA: u64 = REGION_B + 0x1000;
const TABLE: u64 = REGION_A + 0x3_0000;
const TABLE2: u64 = REGION_A + 0x3_8000;
/// Guest addresses with no memory: below, between and above the regions.
const BELOW: u64 = 0x1000;
const HOLE: u64 = REGION_A + REGION_SIZE + 0x1000;
const ABOVE: u64 = REGION_B + REGION_SIZE + 0x1000;

/// The image served: 16 MiB.
const IMAGE_SIZE: u64 = 16 << 20;
const SERIAL: &str = "hostile-serial";
/// How long a completion that should come may take (a busy machine)...
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// ...and how long one that should not come is waited for.
const SILENCE: Duration = Duration::from_millis(300);

/// What vsd must do with the request.
#[derive(Clone, Copy, Debug)]
enum Expect {
    /// Complete it (used id 0) with this status at STATUS and used length.
    Done(u8, u32),
    /// Return the chain with used length 0, writing nothing: it has no
    /// usable status byte.
    NoStatus,
    /// Give the queue up: no completion, now or later.
    Broken,
    /// Nothing to do: no completion, and the queue keeps serving.
    Nothing,
}

struct Case {
    name: &'static str,
    build: fn(&mut Request),
    expect: Expect,
}

/// A hostile request being written into queue 0, and the buffers it lets
/// the device write.
struct Request<'a> {
    fe: &'a mut BlkFrontend,
    writable: Vec<Range<u64>>,
    kicks: u32,
}

impl Request<'_> {
    fn header(&self, kind: u32, sector: u64) {
        write_header(&self.fe.mem, HEADER, kind, sector);
    }

    /// A discard or write-zeroes request of one segment: `sectors` from
    /// `sector`, flags 0.
    fn range_request(&mut self, kind: u32, sector: u64, sectors: u32) {
        self.header(kind, 0);
        self.fe.mem.write(DATA, sector.to_le());
        self.fe.mem.write(DATA + 8, sectors.to_le());
        self.fe.mem.write(DATA + 12, 0u32);
        self.chain(&[(HEADER, 16, READ), (DATA, 16, READ), (STATUS, 1, WRITE)]);
    }

    fn note(&mut self, d: &Desc) {
        if d.flags & WRITE != 0 && d.flags & INDIRECT == 0 {
            self.writable.push(d.addr..d.addr.saturating_add(u64::from(d.len)));
        }
    }

    /// A chain of (addr, len, flags) at descriptors 0..n, made available.
    fn chain(&mut self, parts: &[(u64, u32, u16)]) {
        self.descriptors(&linked(parts));
    }

    /// These descriptors at 0..n, as they are (no NEXT added); head 0.
    fn descriptors(&mut self, descs: &[Desc]) {
        for (i, d) in descs.iter().enumerate() {
            self.note(d);
            self.fe.write_desc(0, i as u16, *d);
        }
        self.fe.push(0, 0);
    }

    /// An indirect table of (addr, len, flags) at `at`; returns the
    /// descriptor that points to it.
    fn indirect(&mut self, at: u64, parts: &[(u64, u32, u16)]) -> Desc {
        let descs = linked(parts);
        for (i, d) in descs.iter().enumerate() {
            self.note(d);
            write_desc(&self.fe.mem, at + 16 * i as u64, *d);
        }
        Desc { addr: at, len: 16 * descs.len() as u32, flags: INDIRECT, next: 0 }
    }

    /// A read of `len` bytes at sector 0, header and status where they belong.
    fn read(&mut self, data: (u64, u32, u16)) {
        self.header(VIRTIO_BLK_T_IN, 0);
        self.chain(&[(HEADER, 16, READ), data, (STATUS, 1, WRITE)]);
    }
}

/// `n` data descriptors of 512 bytes from DATA, with these flags.
fn segments(n: usize, flags: u16) -> impl Iterator<Item = (u64, u32, u16)> {
    (0..n as u64).map(move |i| (DATA + 512 * i, 512, flags))
}

fn request_cases() -> Vec<Case> {
    vec![
        // 1. Loops.
        Case {
            name: "descriptor loop (0 -> 1 -> 0)",
            build: |r| {
                r.header(VIRTIO_BLK_T_IN, 0);
                r.descriptors(&[
                    Desc { addr: HEADER, len: 16, flags: READ | NEXT, next: 1 },
                    Desc { addr: STATUS, len: 1, flags: WRITE | NEXT, next: 0 },
                ]);
            },
            expect: Expect::NoStatus,
        },
        Case {
            name: "descriptor pointing at itself",
            build: |r| {
                r.header(VIRTIO_BLK_T_IN, 0);
                r.descriptors(&[
                    Desc { addr: HEADER, len: 16, flags: READ | NEXT, next: 1 },
                    Desc { addr: STATUS, len: 1, flags: WRITE | NEXT, next: 1 },
                ]);
            },
            expect: Expect::NoStatus,
        },
        // 2. Chains longer than the queue.
        Case {
            name: "chain over the whole table, the last pointing past it",
            build: |r| {
                r.header(VIRTIO_BLK_T_IN, 0);
                let mut parts = vec![(HEADER, 16, READ)];
                parts.extend(segments(usize::from(QUEUE_SIZE) - 2, WRITE));
                parts.push((STATUS, 1, WRITE));
                let mut descs = linked(&parts);
                let last = descs.last_mut().unwrap();
                (last.flags, last.next) = (last.flags | NEXT, QUEUE_SIZE);
                r.descriptors(&descs);
            },
            expect: Expect::NoStatus,
        },
        Case {
            name: "indirect chain of 300 descriptors (queue 16, seg_max 126)",
            build: |r| {
                r.header(VIRTIO_BLK_T_IN, 0);
                let mut parts = vec![(HEADER, 16, READ)];
                parts.extend(segments(298, WRITE));
                parts.push((STATUS, 1, WRITE));
                let table = r.indirect(TABLE, &parts);
                r.descriptors(&[table]);
            },
            expect: Expect::Done(IOERR, 1),
        },
        Case {
            name: "indirect chain of 40 descriptors (longer than the queue, within seg_max)",
            build: |r| {
                r.header(VIRTIO_BLK_T_IN, 0);
                let mut parts = vec![(HEADER, 16, READ)];
                parts.extend(segments(38, WRITE));
                parts.push((STATUS, 1, WRITE));
                let table = r.indirect(TABLE, &parts);
                r.descriptors(&[table]);
            },
            expect: Expect::Done(OK, 38 * 512 + 1),
        },
        // 3. Indirect tables inside indirect tables, and broken tables.
        Case {
            name: "indirect table inside an indirect table (after the header)",
            build: |r| {
                r.header(VIRTIO_BLK_T_IN, 0);
                let inner = r.indirect(TABLE2, &[(DATA, 512, WRITE), (STATUS, 1, WRITE)]);
                let outer = r.indirect(TABLE, &[(HEADER, 16, READ), (inner.addr, inner.len, INDIRECT)]);
                r.descriptors(&[outer]);
            },
            expect: Expect::NoStatus,
        },
        Case {
            name: "indirect table whose only entry is an indirect table",
            build: |r| {
                r.header(VIRTIO_BLK_T_IN, 0);
                let inner = r.indirect(TABLE2, &[(HEADER, 16, READ), (DATA, 512, WRITE), (STATUS, 1, WRITE)]);
                let outer = r.indirect(TABLE, &[(inner.addr, inner.len, INDIRECT)]);
                r.descriptors(&[outer]);
            },
            expect: Expect::NoStatus,
        },
        Case {
            name: "indirect table length not a multiple of 16",
            build: |r| {
                r.header(VIRTIO_BLK_T_IN, 0);
                let table = r.indirect(TABLE, &[(HEADER, 16, READ), (DATA, 512, WRITE), (STATUS, 1, WRITE)]);
                r.descriptors(&[Desc { len: table.len - 8, ..table }]);
            },
            expect: Expect::NoStatus,
        },
        Case {
            name: "indirect table outside guest memory",
            build: |r| r.descriptors(&[Desc { addr: HOLE, len: 48, flags: INDIRECT, next: 0 }]),
            expect: Expect::NoStatus,
        },
        Case {
            name: "indirect table at the top of the address space (addr + len wraps)",
            build: |r| r.descriptors(&[Desc { addr: u64::MAX - 15, len: 48, flags: INDIRECT, next: 0 }]),
            expect: Expect::NoStatus,
        },
        // 4. Addresses outside any memory region.
        Case {
            name: "header in the hole between regions",
            build: |r| r.chain(&[(HOLE, 16, READ), (DATA, 512, WRITE), (STATUS, 1, WRITE)]),
            expect: Expect::Done(IOERR, 1),
        },
        Case {
            name: "header straddling the end of a region",
            build: |r| {
                let at = REGION_A + REGION_SIZE - 8;
                write_header(&r.fe.mem, at - 8, VIRTIO_BLK_T_IN, 0);
                r.chain(&[(at, 16, READ), (DATA, 512, WRITE), (STATUS, 1, WRITE)]);
            },
            expect: Expect::Done(IOERR, 1),
        },
        Case {
            name: "read data above guest memory",
            build: |r| r.read((ABOVE, 512, WRITE)),
            expect: Expect::Done(IOERR, 1),
        },
        Case {
            name: "read data straddling the end of a region",
            build: |r| r.read((REGION_B + REGION_SIZE - 256, 512, WRITE)),
            expect: Expect::Done(IOERR, 1),
        },
        Case {
            name: "write data below guest memory",
            build: |r| {
                r.header(VIRTIO_BLK_T_OUT, 0);
                r.chain(&[(HEADER, 16, READ), (BELOW, 512, READ), (STATUS, 1, WRITE)]);
            },
            expect: Expect::Done(IOERR, 1),
        },
        Case {
            name: "status byte outside guest memory",
            build: |r| {
                r.header(VIRTIO_BLK_T_IN, 0);
                r.chain(&[(HEADER, 16, READ), (DATA, 512, WRITE), (ABOVE, 1, WRITE)]);
            },
            expect: Expect::NoStatus,
        },
        // 5. Lengths that overflow.
        Case {
            name: "status descriptor whose addr + len wraps u64",
            build: |r| {
                r.header(VIRTIO_BLK_T_IN, 0);
                r.chain(&[(HEADER, 16, READ), (DATA, 512, WRITE), (u64::MAX, 2, WRITE)]);
            },
            expect: Expect::NoStatus,
        },
        Case {
            name: "data descriptor whose addr + len wraps u64",
            build: |r| r.read((u64::MAX - 0xfff, 0x2000, WRITE)),
            expect: Expect::Done(IOERR, 1),
        },
        Case {
            name: "data length near u32::MAX",
            build: |r| r.read((DATA, u32::MAX - 511, WRITE)),
            expect: Expect::Done(IOERR, 1),
        },
        Case {
            name: "chain of more than 4 GiB in all",
            build: |r| {
                r.header(VIRTIO_BLK_T_IN, 0);
                r.chain(&[(HEADER, 16, READ), (DATA, u32::MAX - 511, WRITE), (DATA, 4096, WRITE), (STATUS, 1, WRITE)]);
            },
            expect: Expect::NoStatus,
        },
        Case {
            name: "sector * 512 overflows u64",
            build: |r| {
                r.header(VIRTIO_BLK_T_IN, u64::MAX / 256);
                r.chain(&[(HEADER, 16, READ), (DATA, 512, WRITE), (STATUS, 1, WRITE)]);
            },
            expect: Expect::Done(IOERR, 1),
        },
        Case {
            name: "offset + length overflows u64",
            build: |r| {
                r.header(VIRTIO_BLK_T_IN, u64::MAX / 512);
                r.chain(&[(HEADER, 16, READ), (DATA, 1024, WRITE), (STATUS, 1, WRITE)]);
            },
            expect: Expect::Done(IOERR, 1),
        },
        Case {
            name: "read of the first sector past the end",
            build: |r| {
                r.header(VIRTIO_BLK_T_IN, IMAGE_SIZE / 512);
                r.chain(&[(HEADER, 16, READ), (DATA, 512, WRITE), (STATUS, 1, WRITE)]);
            },
            expect: Expect::Done(IOERR, 1),
        },
        Case {
            name: "discard whose sector range overflows",
            build: |r| r.range_request(VIRTIO_BLK_T_DISCARD, u64::MAX / 512, 8),
            expect: Expect::Done(IOERR, 1),
        },
        // 6. Available-ring indexes that jump, or name no descriptor.
        Case {
            name: "available index advanced by more than the queue size",
            build: |r| {
                r.read((DATA, 512, WRITE));
                let idx = r.fe.queues[0].avail_idx.wrapping_add(QUEUE_SIZE);
                r.fe.set_avail_idx(0, idx);
            },
            expect: Expect::Broken,
        },
        Case {
            name: "available index moved backwards",
            build: |r| r.fe.set_avail_idx(0, u16::MAX),
            expect: Expect::Broken,
        },
        Case {
            name: "available entry naming a descriptor past the table",
            build: |r| r.fe.push(0, 200),
            expect: Expect::Broken,
        },
        // 7. Kicks with nothing to do.
        Case { name: "1000 kicks with no buffers", build: |r| r.kicks = 1000, expect: Expect::Nothing },
        // 8. Status descriptors the device may not write.
        Case {
            name: "read-only status descriptor",
            build: |r| {
                r.header(VIRTIO_BLK_T_IN, 0);
                r.chain(&[(HEADER, 16, READ), (DATA, 512, WRITE), (STATUS, 1, READ)]);
            },
            expect: Expect::NoStatus,
        },
        Case {
            name: "zero-length status descriptor",
            build: |r| {
                r.header(VIRTIO_BLK_T_FLUSH, 0);
                r.chain(&[(HEADER, 16, READ), (STATUS, 0, WRITE)]);
            },
            expect: Expect::NoStatus,
        },
        // Zero-length chains.
        Case {
            name: "chain of one empty descriptor",
            build: |r| r.chain(&[(STATUS, 0, WRITE)]),
            expect: Expect::NoStatus,
        },
        Case {
            name: "empty header",
            build: |r| r.chain(&[(HEADER, 0, READ), (STATUS, 1, WRITE)]),
            expect: Expect::Done(IOERR, 1),
        },
        // Data in the wrong direction.
        Case {
            name: "readable descriptor after a writable one",
            build: |r| {
                r.header(VIRTIO_BLK_T_IN, 0);
                r.chain(&[(HEADER, 16, READ), (DATA, 512, WRITE), (DATA + 512, 512, READ), (STATUS, 1, WRITE)]);
            },
            expect: Expect::Done(IOERR, 1),
        },
        Case {
            name: "read whose data buffer is device-readable",
            build: |r| r.read((DATA, 512, READ)),
            expect: Expect::Done(OK, 1),
        },
        Case {
            name: "write whose data buffer is device-writable",
            build: |r| {
                r.header(VIRTIO_BLK_T_OUT, 0);
                r.chain(&[(HEADER, 16, READ), (DATA, 512, WRITE), (STATUS, 1, WRITE)]);
            },
            expect: Expect::Done(OK, 1),
        },
        // GET_ID with too little room.
        Case {
            name: "GET_ID into an 8-byte buffer",
            build: |r| {
                r.header(VIRTIO_BLK_T_GET_ID, 0);
                r.chain(&[(HEADER, 16, READ), (DATA, 8, WRITE), (STATUS, 1, WRITE)]);
            },
            expect: Expect::Done(OK, 9),
        },
        Case {
            name: "GET_ID with no buffer",
            build: |r| {
                r.header(VIRTIO_BLK_T_GET_ID, 0);
                r.chain(&[(HEADER, 16, READ), (STATUS, 1, WRITE)]);
            },
            expect: Expect::Done(IOERR, 1),
        },
        Case {
            name: "unknown request type",
            build: |r| {
                r.header(0x4242, 0);
                r.chain(&[(HEADER, 16, READ), (DATA, 512, WRITE), (STATUS, 1, WRITE)]);
            },
            expect: Expect::Done(UNSUPP, 1),
        },
    ]
}

/// 9. Requests that would change a read-only export.
fn read_only_cases() -> Vec<Case> {
    vec![
        Case {
            name: "write to a read-only export",
            build: |r| {
                r.header(VIRTIO_BLK_T_OUT, 8);
                r.chain(&[(HEADER, 16, READ), (DATA, 4096, READ), (STATUS, 1, WRITE)]);
            },
            expect: Expect::Done(IOERR, 1),
        },
        Case {
            name: "write-zeroes on a read-only export",
            build: |r| r.range_request(VIRTIO_BLK_T_WRITE_ZEROES, 8, 8),
            expect: Expect::Done(IOERR, 1),
        },
        Case {
            name: "discard on a read-only export",
            build: |r| r.range_request(VIRTIO_BLK_T_DISCARD, 8, 8),
            expect: Expect::Done(IOERR, 1),
        },
        Case {
            name: "flush on a read-only export",
            build: |r| {
                r.header(VIRTIO_BLK_T_FLUSH, 0);
                r.chain(&[(HEADER, 16, READ), (STATUS, 1, WRITE)]);
            },
            expect: Expect::Done(OK, 1),
        },
    ]
}

/// A served image and the daemon serving it.
struct Served {
    _dir: Scratch,
    daemon: Daemon,
    image: std::path::PathBuf,
    writable: bool,
}

fn serve(name: &str, writable: bool) -> Served {
    let dir = Scratch::new(name);
    let image = dir.image("disk.img", IMAGE_SIZE);
    let socket = dir.path("vsd.sock");
    let export = format!(",writable={},num-queues=2,serial={SERIAL}", if writable { "on" } else { "off" });
    let daemon = Daemon::vsd(&dir, &file_export(&image, &socket, "", &export));
    Served { _dir: dir, daemon, image, writable }
}

impl Served {
    fn connect(&self, mem: GuestMemory) -> Result<BlkFrontend, String> {
        BlkFrontend::connect(&self.daemon.socket, mem).map_err(|e| format!("connect: {e}"))
    }

    /// The daemon runs and a new connection gets a good write and read on
    /// both queues.
    fn still_serves(&mut self, sector: u64) -> Result<(), String> {
        if !self.daemon.is_running() {
            return Err("vsd is gone".into());
        }
        let mut fe = self.connect(GuestMemory::new())?;
        (0..2).try_for_each(|q| fe.check_service(q, sector + 8 * q as u64, self.writable))
    }
}

/// Runs one case on a fresh connection; `seed` picks the memory pattern
/// and the sectors the service checks use.
fn run_case(served: &mut Served, case: &Case, seed: u64) -> Result<(), String> {
    let mem = GuestMemory::new();
    mem.fill(seed);
    let mut fe = served.connect(mem)?;
    let mut request = Request { fe: &mut fe, writable: Vec::new(), kicks: 1 };
    (case.build)(&mut request);
    let (writable, kicks) = (request.writable, request.kicks);
    let status_before: u8 = fe.mem.read(STATUS);
    let before = fe.mem.snapshot();
    for _ in 0..kicks {
        fe.kick(0);
    }

    let answer = match case.expect {
        Expect::Done(..) | Expect::NoStatus => ANSWER_TIMEOUT,
        Expect::Broken | Expect::Nothing => SILENCE,
    };
    let used = fe.wait_used(0, answer);
    let status: u8 = fe.mem.read(STATUS);
    match (case.expect, used) {
        (Expect::Done(code, len), Some(u)) if u.id == 0 && u.len == len && status == code => {}
        (Expect::NoStatus, Some(u)) if u.id == 0 && u.len == 0 && status == status_before => {}
        (Expect::Broken | Expect::Nothing, None) => {}
        (_, used) => return Err(format!("got used entry {used:?}, status byte {status:#x}")),
    }
    if let Some(extra) = fe.wait_used(0, Duration::ZERO) {
        return Err(format!("an extra used entry {extra:?}"));
    }

    // The device may write the used rings (the other queue's worker sets
    // its notification fields there whenever it starts polling) and, if it
    // answered with a status, the request's writable buffers; nothing else.
    let mut allowed: Vec<_> = fe.queues.iter().map(|q| q.used_ring()).collect();
    if let Expect::Done(..) = case.expect {
        allowed.extend(writable);
    }
    let changed = fe.mem.changed_outside(&before, &allowed);
    if let Some(first) = changed.first() {
        return Err(format!("{} bytes of guest memory changed, the first at {first:#x}", changed.len()));
    }

    if !served.daemon.is_running() {
        return Err("vsd is gone".into());
    }
    let sector = 1024 + seed * 16;
    fe.check_service(1, sector + 8, served.writable)?;
    if let Expect::Broken = case.expect {
        // A good request on the broken queue is never taken.
        fe.start_io(0, VIRTIO_BLK_T_IN, sector, &[0; 512]);
        if let Some(used) = fe.wait_used(0, SILENCE) {
            return Err(format!("the broken queue still completed {used:?}"));
        }
    } else {
        fe.check_service(0, sector, served.writable)?;
    }
    drop(fe);
    served.still_serves(sector)
}

/// Runs every case, prints each outcome and the count, and fails listing
/// the cases that went wrong.
fn run_cases(served: &mut Served, cases: &[Case], seed_base: u64) -> usize {
    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let result = run_case(served, case, seed_base + i as u64);
        println!(
            "case {:2} {:<75} expect {:<15} {}",
            i + 1,
            case.name,
            format!("{:?}", case.expect),
            match &result {
                Ok(()) => "ok".to_string(),
                Err(e) => format!("FAILED: {e}"),
            }
        );
        if let Err(e) = result {
            failures.push(format!("{}: {e}", case.name));
        }
    }
    assert!(failures.is_empty(), "{} hostile cases failed:\n{}", failures.len(), failures.join("\n"));
    cases.len()
}

#[test]
fn hostile_requests() {
    let mut served = serve("hostile-requests", true);
    let count = run_cases(&mut served, &request_cases(), 1);
    println!("hostile cases tried: {count} (requests)");
    assert!(served.daemon.is_running());
}

#[test]
fn hostile_requests_on_a_read_only_export() {
    let mut served = serve("hostile-read-only", false);
    let fe = served.connect(GuestMemory::new()).unwrap();
    assert!(fe.offered & (1 << VIRTIO_BLK_F_RO) != 0, "a read-only export offers VIRTIO_BLK_F_RO");
    drop(fe);
    let count = run_cases(&mut served, &read_only_cases(), 100);
    println!("hostile cases tried: {count} (read-only export)");
    let image = std::fs::read(&served.image).unwrap();
    assert!(image.iter().all(|&b| b == 0), "the read-only image changed");
}

/// A vhost-user message vsd must refuse (and close the connection).
struct MessageCase {
    name: &'static str,
    send: fn(&mut BlkFrontend) -> vhost::Result<()>,
}

/// Ring addresses of queue 0 as SET_VRING_ADDR gives them, after `change`.
fn ring_config(fe: &BlkFrontend, change: impl FnOnce(&mut VringConfigData)) -> VringConfigData {
    let queue = &fe.queues[0];
    let mut config = VringConfigData {
        queue_max_size: QUEUE_SIZE,
        queue_size: QUEUE_SIZE,
        flags: 0,
        desc_table_addr: fe.mem.host_addr(queue.desc),
        used_ring_addr: fe.mem.host_addr(queue.used),
        avail_ring_addr: fe.mem.host_addr(queue.avail),
        log_addr: None,
    };
    change(&mut config);
    config
}

/// Sets up queue 0 with these ring addresses, up to enabling it.
fn start_with(fe: &mut BlkFrontend, config: &VringConfigData) -> vhost::Result<()> {
    fe.conn.set_vring_num(0, QUEUE_SIZE)?;
    fe.conn.set_vring_addr(0, config)?;
    fe.conn.set_vring_base(0, 0)?;
    fe.conn.set_vring_call(0, &vmm_sys_util::eventfd::EventFd::new(0).unwrap())?;
    fe.conn.set_vring_kick(0, &vmm_sys_util::eventfd::EventFd::new(0).unwrap())?;
    fe.conn.set_vring_enable(0, true)
}

fn message_cases() -> Vec<MessageCase> {
    vec![
        MessageCase { name: "SET_VRING_NUM 0", send: |fe| fe.conn.set_vring_num(0, 0) },
        MessageCase { name: "SET_VRING_NUM 3 (not a power of two)", send: |fe| fe.conn.set_vring_num(0, 3) },
        MessageCase { name: "SET_VRING_NUM 2048 (over the maximum)", send: |fe| fe.conn.set_vring_num(0, 2048) },
        MessageCase { name: "SET_VRING_NUM for a queue that does not exist", send: |fe| fe.conn.set_vring_num(5, 16) },
        MessageCase {
            name: "SET_VRING_ADDR outside guest memory",
            send: |fe| {
                let config = ring_config(fe, |c| c.desc_table_addr = 0x1000);
                fe.conn.set_vring_addr(0, &config)
            },
        },
        MessageCase {
            name: "descriptor table running past the end of its region",
            send: |fe| {
                let config = ring_config(fe, |c| c.desc_table_addr += REGION_SIZE - 16 * 4);
                start_with(fe, &config)
            },
        },
        MessageCase {
            name: "used ring running past the end of its region",
            send: |fe| {
                let end = fe.mem.host_addr(REGION_B) + REGION_SIZE;
                let config = ring_config(fe, |c| c.used_ring_addr = end - 8);
                start_with(fe, &config)
            },
        },
    ]
}

#[test]
fn hostile_messages() {
    let mut served = serve("hostile-messages", true);
    let mut failures = Vec::new();
    let cases = message_cases();
    for (i, case) in cases.iter().enumerate() {
        let result = (|| -> Result<(), String> {
            let mut fe =
                BlkFrontend::negotiate(&served.daemon.socket, GuestMemory::new()).map_err(|e| e.to_string())?;
            fe.conn.set_mem_table(&fe.mem.regions()).map_err(|e| e.to_string())?;
            if (case.send)(&mut fe).is_ok() {
                return Err("accepted".into());
            }
            drop(fe);
            served.still_serves(2048 + 16 * i as u64)
        })();
        println!(
            "message case {:2} {:<60} {}",
            i + 1,
            case.name,
            match &result {
                Ok(()) => "refused, vsd serves the next client".to_string(),
                Err(e) => format!("FAILED: {e}"),
            }
        );
        if let Err(e) = result {
            failures.push(format!("{}: {e}", case.name));
        }
    }
    println!("hostile cases tried: {} (messages)", cases.len());
    assert!(failures.is_empty(), "{} message cases failed:\n{}", failures.len(), failures.join("\n"));
}

/// SET_MEM_TABLE naming more memory than its file has: the back-end must
/// refuse the table, or survive a request that points into the part with
/// no file behind it.
#[test]
fn memory_table_larger_than_its_file() {
    let mut served = serve("hostile-short-memfd", true);
    // Region B claims the file's second MiB, which does not exist.
    let mem = GuestMemory::with_backed_bytes(REGION_SIZE);
    match BlkFrontend::connect(&served.daemon.socket, mem) {
        Err(e) => println!("vsd refused the memory table: {e}"),
        Ok(mut fe) => {
            // The header lies past the end of the file; the ring does not.
            let head = fe.write_chain(0, &[(REGION_B + 0x1000, 16, READ), (STATUS, 1, WRITE)]);
            fe.push(0, head);
            fe.kick(0);
            let used = fe.wait_used(0, Duration::from_secs(2));
            println!("vsd accepted the memory table; the request got {used:?}");
        }
    }
    std::thread::sleep(SILENCE);
    println!("hostile cases tried: 1 (memory table)");
    assert!(
        served.daemon.is_running(),
        "vsd died: it mapped a region past the end of its memfd and touched it (SIGBUS)"
    );
    served.still_serves(4096).unwrap();
}
