//! Block jobs under writable NBD exports: a client writes on through the
//! export, several writes in flight at once, while a `blockdev-mirror` or
//! an active `block-commit` runs; `job-complete` stops the connections at
//! a request boundary and moves them onto the target, and no acknowledged
//! write is lost. The mirror's source image is behind nbdkit's delay
//! filter, so that writes are in flight whenever the job stops them: a
//! stop that did not wait for them would lose some. A client idle through
//! the switch, and one stopped half-way through sending a write, are
//! served by the target after it.

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::images::{
    BLOCK, CHAIN_SIZE, MIB, assert_clean, assert_committed, chain_nodes, first_mismatch_read, qcow2_chain,
};
use common::qmp::Qmp;
use common::{Daemon, Scratch, monitor, ok, qcow2_node};
use serde_json::{Value, json};
use vsd_nbd::proto::handshake::{FLAG_FIXED_NEWSTYLE, FLAG_NO_ZEROES, IHAVEOPT, opt, rep};
use vsd_nbd::proto::{Request, SimpleReply, cmd};

/// The disk's size (that of the commit's chain too); the writer writes
/// its first [`WRITTEN`] bytes.
const SIZE: u64 = CHAIN_SIZE;
const WRITTEN: u64 = 12 * MIB;
/// Writes the writer keeps in flight at once.
const DEPTH: usize = 4;
/// Between the writer's batches: the jobs must get in sync under it.
const PAUSE: Duration = Duration::from_millis(1);
/// The export every test serves, on `nbd.sock`.
const EXPORT: &str = "rw";

/// A client of the test's own on an NBD export (simple replies).
struct NbdClient {
    s: UnixStream,
    next_cookie: u64,
}

impl NbdClient {
    fn connect(socket: &Path) -> Self {
        let mut s = UnixStream::connect(socket).unwrap();
        // A request held longer than this fails the test.
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut greeting = [0u8; 18];
        s.read_exact(&mut greeting).unwrap();
        assert_eq!(&greeting[..8], b"NBDMAGIC");
        s.write_all(&u32::from(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes()).unwrap();
        // NBD_OPT_GO: the export's name, and no information asked for.
        let go = [&(EXPORT.len() as u32).to_be_bytes()[..], EXPORT.as_bytes(), &0u16.to_be_bytes()].concat();
        let head = [&IHAVEOPT.to_be_bytes()[..], &opt::GO.to_be_bytes(), &(go.len() as u32).to_be_bytes()].concat();
        s.write_all(&[head, go].concat()).unwrap();
        let mut client = Self { s, next_cookie: 0 };
        while client.option_reply() != rep::ACK {}
        client
    }

    /// Reads an option reply; returns its type.
    fn option_reply(&mut self) -> u32 {
        let mut head = [0u8; 20];
        self.s.read_exact(&mut head).unwrap();
        let kind = u32::from_be_bytes(head[12..16].try_into().unwrap());
        assert!(kind == rep::ACK || kind == rep::INFO, "NBD_OPT_GO refused: {kind:#x}");
        let len = u32::from_be_bytes(head[16..20].try_into().unwrap());
        std::io::copy(&mut (&mut self.s).take(u64::from(len)), &mut std::io::sink()).unwrap();
        kind
    }

    /// Sends a request's header and the first `sent` bytes of `payload`;
    /// returns its cookie.
    fn send(&mut self, kind: u16, offset: u64, payload: &[u8], sent: usize) -> u64 {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let mut header = [0u8; 28];
        Request { flags: 0, kind, cookie, offset, len: payload.len() as u64 }.encode(&mut header);
        self.s.write_all(&[&header[..], &payload[..sent]].concat()).unwrap();
        cookie
    }

    fn send_write(&mut self, offset: u64, data: &[u8]) -> u64 {
        self.send(cmd::WRITE, offset, data, data.len())
    }

    /// The next reply, which must be a success: its cookie.
    fn acknowledged(&mut self) -> u64 {
        let mut buf = [0u8; SimpleReply::SIZE];
        self.s.read_exact(&mut buf).unwrap();
        let reply = SimpleReply::parse(&buf).unwrap();
        assert_eq!(reply.error, 0, "request {} failed", reply.cookie);
        reply.cookie
    }

    /// Writes `data` at `offset`, waiting for the answer.
    fn write(&mut self, offset: u64, data: &[u8]) {
        let cookie = self.send_write(offset, data);
        assert_eq!(self.acknowledged(), cookie);
    }

    fn flush(&mut self) {
        let cookie = self.send(cmd::FLUSH, 0, &[], 0);
        assert_eq!(self.acknowledged(), cookie);
    }
}

/// A client writing 4 KiB blocks round the first [`WRITTEN`] bytes,
/// [`DEPTH`] at a time, until told to stop; it remembers what each block
/// holds by the writes the export acknowledged.
struct Writer {
    stop: Arc<AtomicBool>,
    acknowledged: Arc<AtomicU64>,
    thread: JoinHandle<HashMap<u64, u8>>,
}

impl Writer {
    fn start(socket: &Path) -> Self {
        let mut client = NbdClient::connect(socket);
        let stop = Arc::new(AtomicBool::new(false));
        let acknowledged = Arc::new(AtomicU64::new(0));
        let (stopping, counted) = (stop.clone(), acknowledged.clone());
        let thread = std::thread::spawn(move || {
            let mut last = HashMap::new();
            let mut n = 0u64;
            while !stopping.load(Ordering::Relaxed) {
                // Blocks of a batch differ: their order on disk is known.
                let mut sent = HashMap::new();
                for _ in 0..DEPTH {
                    // A stride that visits every block, not in order.
                    let block = (n * 7919) % (WRITTEN / BLOCK);
                    let byte = (n % 150) as u8 + 0x40;
                    sent.insert(client.send_write(block * BLOCK, &[byte; BLOCK as usize]), (block, byte));
                    n += 1;
                }
                for _ in 0..DEPTH {
                    let (block, byte) = sent.remove(&client.acknowledged()).expect("a cookie sent");
                    last.insert(block, byte);
                    counted.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(PAUSE);
            }
            client.flush();
            last
        });
        Self { stop, acknowledged, thread }
    }

    fn acknowledged(&self) -> u64 {
        self.acknowledged.load(Ordering::Relaxed)
    }

    /// Waits until the export has acknowledged `more` writes than now.
    fn wait_for(&self, more: u64) {
        let want = self.acknowledged() + more;
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.acknowledged() < want {
            assert!(!self.thread.is_finished(), "the writer failed");
            assert!(Instant::now() < deadline, "the writes stopped at {}", self.acknowledged());
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Stops, and returns what each block written holds last.
    fn finish(self) -> HashMap<u64, u8> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

/// The NBD server on `nbd.sock` in `dir` with export [`EXPORT`] of `node`,
/// and a monitor.
fn nbd_and_monitor(dir: &Scratch, node: &str) -> Vec<String> {
    let mut args = vec![
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", dir.path("nbd.sock").display()),
        "--export".into(),
        format!("type=nbd,id=n0,node-name={node},name={EXPORT},writable=on"),
    ];
    args.extend(monitor(&dir.path("qmp.sock")));
    args
}

/// A qcow2 image of [`SIZE`] bytes, made with `extra` options.
fn qcow2_image(image: &Path, extra: &[&str]) {
    let (path, size) = (image.to_str().unwrap(), SIZE.to_string());
    ok("qemu-img", &[&["create", "-q", "-f", "qcow2"], extra, &[path, &size]].concat());
}

/// nbdkit serving `image` on `socket` with every write delayed; killed on
/// drop.
struct SlowWrites(Child);

impl SlowWrites {
    fn serve(image: &Path, socket: &Path) -> Self {
        let file = format!("file={}", image.display());
        let args = ["-f", "-U", socket.to_str().unwrap(), "--filter=delay", "file", &file, "wdelay=20ms"];
        let child = Command::new("nbdkit").args(args).spawn().expect("nbdkit");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !socket.exists() {
            assert!(Instant::now() < deadline, "nbdkit did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        Self(child)
    }
}

impl Drop for SlowWrites {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn node_served(qmp: &mut Qmp) -> Value {
    qmp.ok("query-block-exports", json!({}))[0]["node-name"].clone()
}

/// `job` goes ready, then `job-complete` moves the export onto `target`
/// while the writer writes on; the writes go on after.
fn complete_under_writes(qmp: &mut Qmp, writer: &Writer, job: &str, target: &str) {
    let ready = qmp.await_event("BLOCK_JOB_READY", json!({"device": job}));
    assert_eq!(ready["len"], ready["offset"], "{ready}");
    // Ready, the job follows the writes.
    writer.wait_for(200);
    qmp.ok("job-complete", json!({"id": job}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": job}));
    assert!(done.get("error").is_none(), "{done}");
    assert_eq!(node_served(qmp), json!(target), "the export serves the target");
    writer.wait_for(200);
}

/// What `image` reads, as raw bytes.
fn contents(dir: &Scratch, image: &Path) -> Vec<u8> {
    let raw = dir.path("contents.raw");
    ok("qemu-img", &["convert", "-U", "-O", "raw", image.to_str().unwrap(), raw.to_str().unwrap()]);
    std::fs::read(&raw).unwrap()
}

#[test]
fn a_mirror_of_a_writable_nbd_export_switches_it_with_every_acknowledged_write() {
    let dir = Scratch::new("nbd-jobs-mirror");
    let (source, target) = (dir.path("disk.qcow2"), dir.path("tgt.qcow2"));
    // Allocated all over: an NBD export, its file cannot grow.
    qcow2_image(&source, &["-o", "preallocation=metadata"]);
    qcow2_image(&target, &[]);
    // Data in the first half, zeroes in the second.
    ok("qemu-io", &["-f", "qcow2", "-c", &format!("write -P 0x11 0 {}", SIZE / 2), source.to_str().unwrap()]);
    let slow = SlowWrites::serve(&source, &dir.path("slow.sock"));
    let mut args = vec![
        "--blockdev".into(),
        format!("driver=nbd,node-name=disk-file,server.type=unix,server.path={}", dir.path("slow.sock").display()),
        "--blockdev".into(),
        "driver=qcow2,node-name=disk,file=disk-file".into(),
    ];
    args.extend(qcow2_node("tgt", &target));
    args.extend(nbd_and_monitor(&dir, "disk"));
    let daemon = Daemon::vsd(&dir, &args);
    let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
    let socket = dir.path("nbd.sock");
    let writer = Writer::start(&socket);
    // A client that sends nothing through the switch, and one that stops
    // half-way through a write's payload.
    let mut idle = NbdClient::connect(&socket);
    let mut halfway = NbdClient::connect(&socket);
    let (idle_at, halfway_at) = (15 * MIB, 14 * MIB);
    let halfway_data = [0xa5; BLOCK as usize];
    let halfway_cookie = halfway.send(cmd::WRITE, halfway_at, &halfway_data, BLOCK as usize / 2);
    writer.wait_for(200);
    qmp.ok("blockdev-mirror", json!({"job-id": "m", "device": "disk", "target": "tgt", "sync": "full"}));
    complete_under_writes(&mut qmp, &writer, "m", "tgt");
    // Both connections are served, by the target.
    halfway.s.write_all(&halfway_data[BLOCK as usize / 2..]).unwrap();
    assert_eq!(halfway.acknowledged(), halfway_cookie);
    idle.write(idle_at, &[0x5a; BLOCK as usize]);
    let last = writer.finish();
    drop((idle, halfway));
    daemon.stop();
    drop(slow);
    assert_clean(&source);
    assert_clean(&target);
    let expect = |at: u64| match at {
        _ if (idle_at..idle_at + BLOCK).contains(&at) => 0x5a,
        _ if (halfway_at..halfway_at + BLOCK).contains(&at) => 0xa5,
        _ => last.get(&(at / BLOCK)).copied().unwrap_or(if at < SIZE / 2 { 0x11 } else { 0 }),
    };
    assert_eq!(first_mismatch_read(&dir, &target, expect), None, "the target holds every acknowledged write");
    let source = contents(&dir, &source);
    for at in [idle_at, halfway_at] {
        assert_eq!(source[at as usize..(at + BLOCK) as usize], [0; BLOCK as usize], "at {at}: on the target only");
    }
}

#[test]
fn an_active_commit_of_a_writable_nbd_export_switches_it_onto_the_base() {
    let dir = Scratch::new("nbd-jobs-commit");
    let images = qcow2_chain(&dir);
    let mut args = chain_nodes(&images);
    args.extend(nbd_and_monitor(&dir, "top"));
    let daemon = Daemon::vsd(&dir, &args);
    let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
    let writer = Writer::start(&dir.path("nbd.sock"));
    writer.wait_for(200);
    qmp.ok("block-commit", json!({"job-id": "c", "device": "top"}));
    complete_under_writes(&mut qmp, &writer, "c", "base");
    let last = writer.finish();
    assert_committed(&mut qmp, daemon, &dir, &images, &last);
}
