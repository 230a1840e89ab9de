//! Damaged qcow2 images: each one must give a clear error at startup or an
//! I/O error on the affected range, never a panic, a hang, or a write
//! where the image's metadata lives.
//!
//! Every image is made by `qemu-img`/`qemu-io` and then patched with std::fs
//! at offsets read from its own header (qcow2 spec, "Header", "Host cluster
//! management", "Cluster mapping").
//!
//! Where either of two outcomes is acceptable (zeroes or an error, refusal
//! or service), the test prints which one it saw ("observed: ..."; run
//! with `--nocapture`).

mod common;

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Daemon, Scratch, VSD, pattern, run, vsd_fails};
use serde_json::json;
use vsd_bench::{Client, ClientOptions, Error, Queue};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const CLUSTER: u64 = 64 * KIB;
/// L1/L2 entry: the cluster is referenced once.
const COPIED: u64 = 1 << 63;
/// L2 entry: the cluster is compressed.
const COMPRESSED: u64 = 1 << 62;
/// L1/L2 entry: bits 9..55, the host offset.
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// Header extension: the backing file's format.
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
/// How long vsd may take to start, refuse, or answer one request.
const TIMEOUT: Duration = Duration::from_secs(20);

/// Guest clusters the base image holds, each filled with its own byte.
const DATA: [(u64, u8); 5] = [(0, 0x41), (CLUSTER, 0x42), (2 * CLUSTER, 0x43), (MIB, 0x44), (8 * MIB, 0x45)];
/// The guest cluster whose L2 entry the data cases damage.
const DAMAGED: u64 = CLUSTER;
/// A guest range nothing allocates in the base image.
const UNALLOCATED: u64 = 4 * MIB;
/// Another one, for allocating writes of tests that still check
/// [`UNALLOCATED`] reads as zeroes.
const FRESH: u64 = 5 * MIB;

// ---------------------------------------------------------------------------
// Building and patching images

fn qemu_img(args: &[&str]) -> String {
    let out = run("qemu-img", args);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "qemu-img {args:?} failed: {text}");
    text
}

/// Runs qemu-io commands on a qcow2 image; every command must succeed.
fn qemu_io(image: &Path, read_only: bool, commands: &[&str]) {
    let mut args = vec!["-f", "qcow2"];
    if read_only {
        args.push("-r");
    }
    for c in commands {
        args.extend(["-c", c]);
    }
    args.push(image.to_str().unwrap());
    let out = run("qemu-io", &args);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && !text.contains("failed") && !text.contains("error"),
        "qemu-io {commands:?} on {}: {text}",
        image.display()
    );
}

/// `qemu-img check` of an image: (exit code, report).
fn qemu_check(image: &Path) -> (Option<i32>, String) {
    let out = run("qemu-img", &["check", "-f", "qcow2", image.to_str().unwrap()]);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code(), text)
}

/// A qcow2 file, read and patched in place.
struct Img {
    path: PathBuf,
}

impl Img {
    /// `len` bytes at `offset`; zeroes past the end of the file, as the
    /// qcow2 spec reads it.
    fn bytes(&self, offset: u64, len: u64) -> Vec<u8> {
        let file = File::open(&self.path).unwrap();
        let mut buf = vec![0u8; len as usize];
        let mut done = 0;
        while done < buf.len() {
            match file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) => panic!("read {}: {e}", self.path.display()),
            }
        }
        buf
    }

    fn put(&self, offset: u64, bytes: &[u8]) {
        let file = OpenOptions::new().write(true).open(&self.path).unwrap();
        file.write_all_at(bytes, offset).unwrap();
    }

    fn u32(&self, offset: u64) -> u32 {
        u32::from_be_bytes(self.bytes(offset, 4).try_into().unwrap())
    }

    fn u64(&self, offset: u64) -> u64 {
        u64::from_be_bytes(self.bytes(offset, 8).try_into().unwrap())
    }

    fn set_u32(&self, offset: u64, value: u32) {
        self.put(offset, &value.to_be_bytes());
    }

    fn set_u64(&self, offset: u64, value: u64) {
        self.put(offset, &value.to_be_bytes());
    }

    fn len(&self) -> u64 {
        fs::metadata(&self.path).unwrap().len()
    }

    fn truncate(&self, len: u64) {
        OpenOptions::new().write(true).open(&self.path).unwrap().set_len(len).unwrap();
    }

    fn whole(&self) -> Vec<u8> {
        fs::read(&self.path).unwrap()
    }

    /// A copy of this image under another name.
    fn copy(&self, dir: &Scratch, name: &str) -> Img {
        let path = dir.path(name);
        fs::copy(&self.path, &path).unwrap();
        Img { path }
    }

    fn cluster_size(&self) -> u64 {
        1 << self.u32(20)
    }

    /// `l1_table_offset`.
    fn l1(&self) -> u64 {
        self.u64(40)
    }

    /// `refcount_table_offset`.
    fn refcount_table(&self) -> u64 {
        self.u64(48)
    }

    /// The first refcount block.
    fn refcount_block(&self) -> u64 {
        self.u64(self.refcount_table())
    }

    /// Guest bytes one L2 table maps.
    fn l2_span(&self) -> u64 {
        self.cluster_size() * (self.cluster_size() / 8)
    }

    /// The L2 table mapping guest offset `guest`.
    fn l2_table(&self, guest: u64) -> u64 {
        let table = self.u64(self.l1() + guest / self.l2_span() * 8) & OFFSET_MASK;
        assert_ne!(table, 0, "guest offset {guest:#x} has no L2 table in {}", self.path.display());
        table
    }

    /// Where the L2 entry of guest offset `guest` is in the file.
    fn l2_slot(&self, guest: u64) -> u64 {
        let cs = self.cluster_size();
        self.l2_table(guest) + guest % self.l2_span() / cs * 8
    }

    fn l2_entry(&self, guest: u64) -> u64 {
        self.u64(self.l2_slot(guest))
    }

    fn set_l2_entry(&self, guest: u64, entry: u64) {
        self.set_u64(self.l2_slot(guest), entry);
    }

    /// The host cluster of a standard (uncompressed) allocated guest cluster.
    fn host_of(&self, guest: u64) -> u64 {
        let entry = self.l2_entry(guest);
        assert_eq!(entry & COMPRESSED, 0, "guest {guest:#x} is compressed");
        let host = entry & OFFSET_MASK;
        assert_ne!(host, 0, "guest {guest:#x} is not allocated");
        host
    }

    /// Where the 16-bit refcount of the host cluster at `host` is stored.
    fn refcount_slot(&self, host: u64) -> u64 {
        assert_eq!(self.u32(96), 4, "these helpers handle 16-bit refcounts only");
        let cs = self.cluster_size();
        let cluster = host / cs;
        let per_block = cs / 2;
        let block = self.u64(self.refcount_table() + cluster / per_block * 8);
        assert_ne!(block, 0, "no refcount block covers {host:#x}");
        block + cluster % per_block * 2
    }

    fn refcount(&self, host: u64) -> u16 {
        u16::from_be_bytes(self.bytes(self.refcount_slot(host), 2).try_into().unwrap())
    }

    fn set_refcount(&self, host: u64, value: u16) {
        self.put(self.refcount_slot(host), &value.to_be_bytes());
    }

    /// Header extensions: (offset of the extension's type field, type, length).
    fn extensions(&self) -> Vec<(u64, u32, u32)> {
        let mut at = u64::from(self.u32(100));
        let mut out = Vec::new();
        while at + 8 <= self.cluster_size() {
            let (kind, len) = (self.u32(at), self.u32(at + 4));
            if kind == 0 {
                break;
            }
            out.push((at, kind, len));
            at += 8 + u64::from(len).next_multiple_of(8);
        }
        out
    }

    /// The image's metadata clusters, by name, with their current bytes.
    fn metadata(&self) -> Vec<(String, u64, Vec<u8>)> {
        let cs = self.cluster_size();
        let mut out = vec![("header".to_string(), 0, self.bytes(0, cs))];
        for (name, at) in [
            ("refcount table", self.refcount_table()),
            ("refcount block", self.refcount_block()),
            ("L1 table", self.l1()),
            ("L2 table", self.l2_table(0)),
        ] {
            out.push((name.to_string(), at, self.bytes(at, cs)));
        }
        out
    }
}

/// The header's corrupt bit (incompatible feature bit 1).
const CORRUPT_BIT: u64 = 1 << 1;

/// What a writable node does when it meets corrupt metadata, as QEMU's
/// qcow2 driver: the image is flagged corrupt in its header and nothing
/// else of its metadata changes (`before`, taken before it was served).
fn flagged_corrupt_and_nothing_else(case: &str, image: &Img, before: &[(String, u64, Vec<u8>)]) {
    assert_ne!(image.u64(72) & CORRUPT_BIT, 0, "{case}: the image is not flagged corrupt");
    image.set_u64(72, image.u64(72) & !CORRUPT_BIT);
    let changes = metadata_changes(before, &image.metadata());
    image.set_u64(72, image.u64(72) | CORRUPT_BIT);
    assert!(changes.is_empty(), "{case}: more than the corrupt flag changed: {}", changes.join("; "));
}

/// Compares metadata snapshots; returns what changed.
fn metadata_changes(before: &[(String, u64, Vec<u8>)], after: &[(String, u64, Vec<u8>)]) -> Vec<String> {
    before
        .iter()
        .zip(after)
        .filter(|(b, a)| b.2 != a.2)
        .map(|(b, a)| {
            let first = b.2.iter().zip(&a.2).position(|(x, y)| x != y).unwrap_or(0);
            format!("{} at {:#x} changed (first difference at byte {first:#x})", b.0, b.1)
        })
        .collect()
}

/// A 32 MiB image (64 KiB clusters, 16-bit refcounts unless `opts` says
/// otherwise) holding the guest clusters of [`DATA`].
fn base_image(dir: &Scratch, name: &str, opts: &str) -> Img {
    let path = dir.path(name);
    let o = format!("cluster_size=64k{opts}");
    qemu_img(&["create", "-q", "-f", "qcow2", "-o", &o, path.to_str().unwrap(), "32M"]);
    let writes: Vec<String> = DATA.iter().map(|(at, b)| format!("write -q -P {b:#x} {at} 64k")).collect();
    qemu_io(&path, false, &writes.iter().map(String::as_str).collect::<Vec<_>>());
    let img = Img { path };
    for &(guest, _) in &DATA {
        img.host_of(guest); // every data cluster is a plain allocated cluster
    }
    img
}

// ---------------------------------------------------------------------------
// Running vsd

fn qcow2_args(image: &Path, socket: &Path, writable: bool) -> Vec<String> {
    // Writable, the nodes act on discards, which the cases send.
    let ro = if writable { ",discard=unmap" } else { ",read-only=on" };
    vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}{ro}", image.display()),
        "--blockdev".into(),
        format!("driver=qcow2,node-name=q0,file=f0{ro}"),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=e0,node-name=q0,addr.type=unix,addr.path={}{}",
            socket.display(),
            if writable { ",writable=on" } else { "" }
        ),
    ]
}

/// How a vsd run that may refuse to start ended.
enum Startup {
    Exited {
        status: std::process::ExitStatus,
        stderr: String,
    },
    /// It wrote its pidfile: it accepted the image (and was stopped).
    Served,
    /// Neither within [`TIMEOUT`] (and was killed).
    Hung,
}

fn stop_child(child: &mut Child) {
    // SAFETY: kill() on the pid of a child we spawned and have not reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn startup(dir: &Scratch, args: &[String]) -> Startup {
    let pidfile = dir.path("probe.pid");
    let errfile = dir.path("probe.err");
    let _ = fs::remove_file(&pidfile);
    let mut child = Command::new(VSD)
        .args(args)
        .arg("--pidfile")
        .arg(&pidfile)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(&errfile).unwrap())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {VSD}: {e}"));
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Startup::Exited { status, stderr: fs::read_to_string(&errfile).unwrap_or_default() };
        }
        if pidfile.exists() {
            stop_child(&mut child);
            return Startup::Served;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Startup::Hung;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn describe(status: std::process::ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(101), _) => "status 101 (a Rust panic)".to_string(),
        (Some(code), _) => format!("status {code}"),
        (None, Some(libc::SIGABRT)) => "SIGABRT (an abort, e.g. a failed allocation)".to_string(),
        (None, Some(signal)) => format!("signal {signal}"),
        (None, None) => "an unknown status".to_string(),
    }
}

/// vsd must refuse `image` (read-only and writable) with exit status 1
/// and one `vsd: ` line naming the problem, and leave the file untouched.
fn refuses(dir: &Scratch, case: &str, image: &Img, words: &[&str]) -> Result<(), String> {
    let socket = dir.path("refused.sock");
    let before = image.whole();
    for writable in [false, true] {
        let mode = if writable { "writable" } else { "read-only" };
        let stderr = match startup(dir, &qcow2_args(&image.path, &socket, writable)) {
            Startup::Served => return Err(format!("{case} ({mode}): vsd accepted the image and started serving")),
            Startup::Hung => return Err(format!("{case} ({mode}): vsd neither started nor exited in {TIMEOUT:?}")),
            Startup::Exited { status, stderr } if status.code() != Some(1) => {
                let how = describe(status);
                return Err(format!(
                    "{case} ({mode}): vsd must exit with status 1, ended with {how}; stderr: {stderr}"
                ));
            }
            Startup::Exited { stderr, .. } => stderr,
        };
        let line = stderr.trim_end();
        if line.lines().count() != 1 || !line.starts_with("vsd: ") {
            return Err(format!("{case} ({mode}): expected one 'vsd: ' line on stderr, got: {stderr:?}"));
        }
        let lower = line.to_lowercase();
        if let Some(missing) = words.iter().find(|w| !lower.contains(&w.to_lowercase())) {
            return Err(format!("{case} ({mode}): the error should mention {missing:?}: {line}"));
        }
        if !writable {
            eprintln!("{case}: refused: {line}");
        }
        if socket.exists() {
            return Err(format!("{case} ({mode}): a refused start left its socket behind"));
        }
        if image.whole() != before {
            return Err(format!("{case} ({mode}): vsd changed the image it refused"));
        }
    }
    Ok(())
}

/// A running vsd and one queue on it. Fields drop in order: queue, client,
/// daemon.
struct Served {
    queue: Queue,
    _client: Client,
    daemon: Daemon,
}

fn serve(dir: &Scratch, image: &Img, writable: bool) -> Served {
    let socket = dir.path("s.sock");
    let daemon = Daemon::vsd(dir, &qcow2_args(&image.path, &socket, writable));
    let mut client = daemon.connect(ClientOptions { read_only: !writable, io_timeout: TIMEOUT, ..Default::default() });
    let queue = client.take_queue(0).unwrap();
    Served { queue, _client: client, daemon }
}

impl Served {
    /// Stops vsd; it must exit cleanly (not panic, not crash).
    fn stop(self, case: &str) {
        let Served { queue, _client, daemon } = self;
        drop(queue);
        drop(_client);
        let status = daemon.stop();
        assert!(status.success(), "{case}: vsd did not exit cleanly after serving: {status}");
    }
}

fn read(q: &mut Queue, offset: u64, len: u64) -> Result<Vec<u8>, Error> {
    let mut buf = vec![0u8; len as usize];
    q.read_at(offset, &mut buf).map(|()| buf)
}

fn is_eio(e: &Error) -> bool {
    matches!(e, Error::Request { errno, .. } if *errno == libc::EIO)
}

fn expect_read(case: &str, q: &mut Queue, offset: u64, expected: &[u8]) {
    match read(q, offset, expected.len() as u64) {
        Ok(buf) => {
            if let Some(i) = buf.iter().zip(expected).position(|(a, b)| a != b) {
                panic!(
                    "{case}: read of {:#x} bytes at {offset:#x}: byte {i:#x} is {:#04x}, expected {:#04x}",
                    expected.len(),
                    buf[i],
                    expected[i]
                );
            }
        }
        Err(e) => panic!("{case}: read of {:#x} bytes at {offset:#x} should succeed: {e}", expected.len()),
    }
}

fn expect_byte(case: &str, q: &mut Queue, offset: u64, len: u64, byte: u8) {
    expect_read(case, q, offset, &vec![byte; len as usize]);
}

fn expect_read_eio(case: &str, q: &mut Queue, offset: u64, len: u64) {
    match read(q, offset, len) {
        Err(e) if is_eio(&e) => {}
        Err(e) => panic!("{case}: read of {len:#x} bytes at {offset:#x} should fail with EIO, got: {e}"),
        Ok(buf) => panic!(
            "{case}: read of {len:#x} bytes at {offset:#x} should fail with an I/O error, returned data {:02x?}...",
            &buf[..16]
        ),
    }
}

fn expect_write_eio(case: &str, q: &mut Queue, offset: u64, data: &[u8]) {
    match q.write_at(offset, data) {
        Err(e) if is_eio(&e) => {}
        Err(e) => panic!("{case}: write of {:#x} bytes at {offset:#x} should fail with EIO, got: {e}", data.len()),
        Ok(()) => panic!("{case}: write of {:#x} bytes at {offset:#x} should fail with an I/O error", data.len()),
    }
}

/// Every [`DATA`] cluster but the damaged one, and an unallocated range,
/// read as written.
fn rest_reads(case: &str, q: &mut Queue) {
    for &(guest, byte) in DATA.iter().filter(|(g, _)| *g != DAMAGED) {
        expect_byte(case, q, guest, CLUSTER, byte);
    }
    expect_byte(case, q, UNALLOCATED, CLUSTER, 0);
}

/// Serves `image`, a base image whose [`DAMAGED`] L2 entry was damaged,
/// read-only: reads of that cluster fail with EIO (whole, partial, and
/// spanning its neighbours), everything else reads right, and vsd keeps
/// serving and leaves the file alone.
fn damaged_entry_fails_reads(case: &str, dir: &Scratch, image: &Img) {
    let before = image.whole();
    let mut served = serve(dir, image, false);
    let q = &mut served.queue;
    rest_reads(case, q);
    expect_read_eio(case, q, DAMAGED, CLUSTER);
    expect_read_eio(case, q, DAMAGED + 8 * KIB, 4 * KIB);
    expect_read_eio(case, q, DAMAGED + CLUSTER - 512, 512);
    expect_read_eio(case, q, 0, 3 * CLUSTER);
    rest_reads(case, q);
    assert!(served.daemon.is_running(), "{case}: vsd died");
    served.stop(case);
    assert!(image.whole() == before, "{case}: a read-only export changed the image");
}

// ---------------------------------------------------------------------------
// 1. Header damage: refused at startup

#[test]
fn header_damage_is_refused_at_startup() {
    let dir = Scratch::new("qcow2-header");
    let base = base_image(&dir, "base.qcow2", "");
    type Patch = fn(&Img);
    let cases: Vec<(&str, Patch, &[&str])> = vec![
        ("bad magic", |i| i.put(0, b"QFI\0"), &["not a qcow2"]),
        ("version 4", |i| i.set_u32(4, 4), &["qcow2", "version 4"]),
        ("cluster_bits 8", |i| i.set_u32(20, 8), &["qcow2", "cluster_bits 8"]),
        ("cluster_bits 22", |i| i.set_u32(20, 22), &["qcow2", "cluster_bits 22"]),
        ("unknown incompatible feature bit 10", |i| i.set_u64(72, 1 << 10), &["qcow2", "incompatible", "bit 10"]),
        ("corrupt bit", |i| i.set_u64(72, 1 << 1), &["qcow2", "corrupt"]),
        ("crypt_method 1", |i| i.set_u32(32, 1), &["qcow2", "encrypt"]),
        ("l1_size 0", |i| i.set_u32(36, 0), &["qcow2", "l1 table", "too small"]),
        ("l1_size too small for a 1 GiB virtual size", |i| i.set_u64(24, 1 << 30), &["qcow2", "l1 table", "too small"]),
        ("L1 table offset unaligned", |i| i.set_u64(40, i.l1() + 512), &["qcow2", "l1 table", "aligned"]),
        ("L1 table past the end (file truncated)", |i| i.truncate(i.l1()), &["qcow2", "l1 table", "past the end"]),
        (
            "L1 table offset past the end",
            |i| i.set_u64(40, i.len().next_multiple_of(CLUSTER) + 16 * MIB),
            &["qcow2", "l1 table", "past the end"],
        ),
        (
            "refcount table past the end",
            |i| i.set_u64(48, i.len().next_multiple_of(CLUSTER) + MIB),
            &["qcow2", "refcount table", "past the end"],
        ),
        ("refcount_order 7", |i| i.set_u32(96, 7), &["qcow2", "refcount_order 7"]),
        ("header_length 108", |i| i.set_u32(100, 108), &["qcow2", "header_length"]),
        (
            "header extension longer than the first cluster",
            |i| {
                let (at, _, _) = i.extensions()[0];
                i.set_u32(at + 4, i.cluster_size() as u32);
            },
            &["qcow2", "extension", "first cluster"],
        ),
        (
            "backing file name crossing the end of the first cluster",
            |i| {
                i.set_u64(8, i.cluster_size() - 16);
                i.set_u32(16, 64);
            },
            &["qcow2", "backing file name"],
        ),
        (
            "backing file name offset far past the first cluster",
            |i| {
                i.set_u64(8, 1 << 40);
                i.set_u32(16, 8);
            },
            &["qcow2", "backing file name"],
        ),
        (
            "L1 entry pointing into the refcount table",
            |i| i.set_u64(i.l1(), i.refcount_table() | COPIED),
            &["qcow2", "l1 entry 0", "metadata"],
        ),
        (
            "L1 entry with reserved bits",
            |i| i.set_u64(i.l1(), i.u64(i.l1()) | 0x2),
            &["qcow2", "l1 entry 0", "reserved"],
        ),
        (
            "refcount table entry unaligned",
            |i| i.set_u64(i.refcount_table(), i.refcount_block() + 512),
            &["qcow2", "refcount table entry 0"],
        ),
    ];
    let mut failures = Vec::new();
    for (n, (case, patch, words)) in cases.into_iter().enumerate() {
        let image = base.copy(&dir, &format!("case{n}.qcow2"));
        patch(&image);
        if let Err(e) = refuses(&dir, case, &image, words) {
            failures.push(e);
        }
    }
    assert!(failures.is_empty(), "{} header case(s) failed:\n{}", failures.len(), failures.join("\n"));
}

/// A snapshot whose L1 table lies at the very top of the 64-bit offset
/// space (an internal snapshot's table is read at open): a clear error,
/// not an arithmetic overflow.
#[test]
fn snapshot_l1_table_at_the_top_of_the_offset_space_is_refused_clearly() {
    let dir = Scratch::new("qcow2-snapshot");
    let image = base_image(&dir, "snap.qcow2", "");
    qemu_img(&["snapshot", "-c", "s1", image.path.to_str().unwrap()]);
    assert_eq!(image.u32(60), 1, "qemu-img made one snapshot");
    let entry = image.u64(64);
    // Snapshot table entry: l1_table_offset u64 at 0, l1_size u32 at 8.
    image.set_u64(entry, u64::MAX - CLUSTER + 1);
    image.set_u32(entry + 8, 0x2001);
    let result = refuses(&dir, "snapshot L1 table at 2^64 - 64 KiB, 0x2001 entries", &image, &["snapshot"]);
    assert!(result.is_ok(), "{}", result.unwrap_err());
}

// ---------------------------------------------------------------------------
// 2. Backing chain damage: refused at startup

/// `top` backs on `backing` (a relative name), format qcow2.
fn overlay(dir: &Scratch, top: &str, backing: &str) -> Img {
    let path = dir.path(top);
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "cluster_size=64k",
        "-b",
        backing,
        "-F",
        "qcow2",
        path.to_str().unwrap(),
    ]);
    Img { path }
}

/// Replaces the backing file name of `image` by `name` (same length).
fn rename_backing(image: &Img, name: &str) {
    let (at, len) = (image.u64(8), u64::from(image.u32(16)));
    assert_eq!(len, name.len() as u64, "the new backing name must have the old one's length");
    image.put(at, name.as_bytes());
}

#[test]
fn backing_chain_damage_is_refused_at_startup() {
    let dir = Scratch::new("qcow2-backing");
    let mut failures = Vec::new();

    // Control: an undamaged overlay opens and shows its backing file's
    // data, so the refusals below are about the damage.
    base_image(&dir, "base.qcow2", "");
    let good = overlay(&dir, "good.qcow2", "base.qcow2");
    match startup(&dir, &qcow2_args(&good.path, &dir.path("s.sock"), false)) {
        Startup::Served => {
            let mut served = serve(&dir, &good, false);
            rest_reads("undamaged overlay (control)", &mut served.queue);
            expect_byte("undamaged overlay (control)", &mut served.queue, DAMAGED, CLUSTER, 0x42);
            served.stop("undamaged overlay (control)");
        }
        Startup::Hung => failures.push("undamaged overlay (control): vsd hung at startup".to_string()),
        Startup::Exited { status, stderr } => {
            failures.push(format!("undamaged overlay (control): vsd must serve it, exited with {status}: {stderr}"))
        }
    }
    let mut check = |r: Result<(), String>| failures.extend(r.err());

    // Backing file pointing to itself.
    let me = overlay(&dir, "self.qcow2", "base.qcow2");
    rename_backing(&me, "self.qcow2");
    check(refuses(&dir, "image backing on itself", &me, &["loop", "self.qcow2"]));

    // A loop of two: a -> b -> a.
    base_image(&dir, "c.qcow2", "");
    let b = overlay(&dir, "b.qcow2", "c.qcow2");
    let a = overlay(&dir, "a.qcow2", "b.qcow2");
    rename_backing(&b, "a.qcow2");
    check(refuses(&dir, "two images backing on each other", &a, &["loop", "a.qcow2"]));

    // Backing file missing.
    base_image(&dir, "gone.qcow2", "");
    let orphan = overlay(&dir, "orphan.qcow2", "gone.qcow2");
    fs::remove_file(dir.path("gone.qcow2")).unwrap();
    check(refuses(&dir, "backing file missing", &orphan, &["backing", "gone.qcow2"]));

    // Backing format extension naming a format vsd does not have.
    for format in ["foo", "vmdk"] {
        let image = overlay(&dir, &format!("fmt-{format}.qcow2"), "base.qcow2");
        let (at, _, len) = *image
            .extensions()
            .iter()
            .find(|(_, kind, _)| *kind == EXT_BACKING_FORMAT)
            .expect("qemu-img writes a backing format extension with -F");
        assert_eq!(len, 5, "the extension holds 'qcow2'");
        image.set_u32(at + 4, format.len() as u32);
        image.put(at + 8, &[0; 8]);
        image.put(at + 8, format.as_bytes());
        check(refuses(&dir, &format!("backing format '{format}'"), &image, &["backing", &format!("'{format}'")]));
    }
    assert!(failures.is_empty(), "{} backing case(s) failed:\n{}", failures.len(), failures.join("\n"));
}

// ---------------------------------------------------------------------------
// 3. Data damage: vsd serves; the damaged range fails, the rest reads

#[test]
fn l2_entry_with_reserved_bits_fails_its_reads() {
    let dir = Scratch::new("qcow2-l2-reserved");
    let image = base_image(&dir, "d.qcow2", "");
    image.set_l2_entry(DAMAGED, image.l2_entry(DAMAGED) | 0x2);
    damaged_entry_fails_reads("L2 entry with reserved bit 1 set", &dir, &image);
}

#[test]
fn l2_entry_with_an_unaligned_offset_fails_its_reads() {
    let dir = Scratch::new("qcow2-l2-unaligned");
    let image = base_image(&dir, "d.qcow2", "");
    image.set_l2_entry(DAMAGED, image.l2_entry(DAMAGED) + 0x200);
    damaged_entry_fails_reads("L2 entry with an unaligned offset", &dir, &image);
}

/// An L2 entry naming a metadata cluster: reads of the range fail and the
/// rest reads right (read-only); served writable, the first request that
/// meets it fails and the image is found corrupt: flagged in its header,
/// every later request failing, nothing else changed, the data still
/// there for QEMU to read.
fn l2_entry_into_metadata(case: &str, name: &str, target: fn(&Img) -> u64) {
    let dir = Scratch::new(name);
    let image = base_image(&dir, "d.qcow2", "");
    let old_host = image.host_of(DAMAGED);
    image.set_l2_entry(DAMAGED, target(&image) | COPIED);
    damaged_entry_fails_reads(case, &dir, &image);

    // 4. Served writable: found corrupt at the first request that needs
    // the entry; from then on the node serves nothing.
    let before = image.metadata();
    let (len, old_data) = (image.len(), image.bytes(old_host, CLUSTER));
    let mut served = serve(&dir, &image, true);
    let q = &mut served.queue;
    expect_write_eio(case, q, DAMAGED + 8 * KIB, &pattern(2, 4 * KIB as usize));
    expect_write_eio(case, q, 2 * CLUSTER, &pattern(4, CLUSTER as usize));
    expect_read_eio(case, q, 0, CLUSTER);
    assert!(q.flush().is_err(), "{case}: a flush of a corrupt image succeeded");
    served.stop(case);
    flagged_corrupt_and_nothing_else(case, &image, &before);
    assert_eq!(image.len(), len, "{case}: the file grew");
    assert!(image.bytes(old_host, CLUSTER) == old_data, "{case}: the cluster the entry used to name changed");
    let refused = vsd_fails(&[
        "--blockdev",
        &format!("driver=file,node-name=f,filename={}", image.path.display()),
        "--blockdev",
        "driver=qcow2,node-name=q,file=f",
    ]);
    assert!(refused.contains("marked corrupt"), "{case}: {refused}");
    // QEMU reads what is left.
    qemu_io(&image.path, true, &["read -q -P 0x41 0 64k", "read -q -P 0x44 1M 64k", "read -q -P 0x45 8M 64k"]);
}

/// A writable image found corrupt stops only its own export: QMP clients
/// get BLOCK_IMAGE_CORRUPTED (fatal) once, as from QEMU, and another
/// export of the same daemon goes on reading and writing.
#[test]
fn a_corrupt_image_stops_only_its_own_export_and_says_so() {
    let case = "an L2 entry into the L1 table, next to a healthy export";
    let dir = Scratch::new("qcow2-corrupt-event");
    let image = base_image(&dir, "d.qcow2", "");
    image.set_l2_entry(DAMAGED, image.l1() | COPIED);
    let healthy = dir.image("healthy.img", 4 * MIB);
    let mut args = qcow2_args(&image.path, &dir.path("s.sock"), true);
    args.extend([
        "--blockdev".into(),
        format!("driver=file,node-name=h,filename={}", healthy.display()),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=h0,node-name=h,addr.type=unix,addr.path={},writable=on",
            dir.path("h.sock").display()
        ),
    ]);
    args.extend(common::monitor(&dir.path("qmp.sock")));
    let daemon = Daemon::vsd(&dir, &args);
    let mut qmp = common::qmp::Qmp::connect(&dir.path("qmp.sock"));
    let options = ClientOptions { io_timeout: TIMEOUT, ..Default::default() };
    let mut client = Client::connect(&dir.path("s.sock"), options.clone()).unwrap();
    let mut q = client.take_queue(0).unwrap();
    let mut other = Client::connect(&dir.path("h.sock"), options).unwrap();
    let mut h = other.take_queue(0).unwrap();
    h.write_at(0, &pattern(1, 4096)).unwrap();
    expect_write_eio(case, &mut q, DAMAGED, &pattern(2, 4096));
    let event = qmp.await_event("BLOCK_IMAGE_CORRUPTED", json!({"node-name": "q0"}));
    assert_eq!((event["fatal"].clone(), event["device"].clone()), (json!(true), json!("")), "{event}");
    assert!(event["msg"].as_str().is_some_and(|m| m.contains("0x10000")), "{event}");
    expect_read_eio(case, &mut q, 0, CLUSTER);
    expect_write_eio(case, &mut q, 4 * MIB, &pattern(3, 4096));
    h.write_at(4096, &pattern(4, 4096)).unwrap();
    let mut back = vec![0; 8192];
    h.read_at(0, &mut back).unwrap();
    assert_eq!(back, [pattern(1, 4096), pattern(4, 4096)].concat(), "{case}: the other export works on");
    let events = qmp.event_log();
    assert_eq!(events.iter().filter(|e| e[0] == "BLOCK_IMAGE_CORRUPTED").count(), 1, "one event: {events:?}");
    drop((q, client, h, other, qmp));
    assert!(daemon.stop().success(), "{case}: vsd stops cleanly");
    assert_ne!(image.u64(72) & CORRUPT_BIT, 0, "{case}: the image is flagged corrupt");
}

#[test]
fn l2_entry_into_the_l1_table_fails_reads_and_writes() {
    l2_entry_into_metadata("L2 entry pointing into the L1 table", "qcow2-l2-l1", Img::l1);
}

#[test]
fn l2_entry_into_the_refcount_block_fails_reads_and_writes() {
    l2_entry_into_metadata("L2 entry pointing into the refcount block", "qcow2-l2-rb", Img::refcount_block);
}

/// An L2 entry far past the end of the file: reads there return zeroes
/// (the file reads as zeroes past its end) or fail; never a hang.
#[test]
fn l2_entry_past_the_end_of_the_file_reads_as_zeroes_or_fails() {
    let case = "L2 entry pointing 1 TiB into a small file";
    let dir = Scratch::new("qcow2-l2-past-eof");
    let image = base_image(&dir, "d.qcow2", "");
    image.set_l2_entry(DAMAGED, (1 << 40) | COPIED);
    let before = image.whole();
    let mut served = serve(&dir, &image, false);
    let q = &mut served.queue;
    rest_reads(case, q);
    match read(q, DAMAGED, CLUSTER) {
        Ok(buf) => {
            assert!(buf.iter().all(|&b| b == 0), "{case}: a read past the end of the file returned non-zero bytes");
            eprintln!("{case}: observed: the range reads as zeroes");
        }
        Err(e) if is_eio(&e) => eprintln!("{case}: observed: reads of the range fail with EIO"),
        Err(e) => panic!("{case}: the read should return zeroes or fail with EIO, got: {e}"),
    }
    rest_reads(case, q);
    served.stop(case);
    assert!(image.whole() == before, "{case}: a read-only export changed the image");
}

/// References far past the end of the file in an image with the dirty bit
/// set, opened writable: vsd rebuilds the refcounts on open. It must
/// neither die nor grow the file to count such a reference (QEMU's check
/// reports "counting reference for region exceeding the end of the file"
/// and grows nothing); refusing the image or serving it are both fine.
#[test]
fn dirty_image_with_references_past_the_end_is_not_rebuilt_out_there() {
    let dir = Scratch::new("qcow2-dirty");
    let base = base_image(&dir, "base.qcow2", "");
    let socket = dir.path("s.sock");
    type Patch = fn(&Img);
    let cases: Vec<(&str, Patch)> = vec![
        ("dirty image, L2 entry 1 TiB past the end", |i| i.set_l2_entry(DAMAGED, (1 << 40) | COPIED)),
        ("dirty image, L2 entry 2^55 past the end", |i| i.set_l2_entry(DAMAGED, (1 << 55) | COPIED)),
        ("dirty image, snapshot L1 table at 2^56", |i| {
            qemu_img(&["snapshot", "-c", "s1", i.path.to_str().unwrap()]);
            i.set_u64(i.u64(64), 1 << 56);
        }),
    ];
    let mut failures = Vec::new();
    for (n, (case, patch)) in cases.into_iter().enumerate() {
        let image = base.copy(&dir, &format!("dirty{n}.qcow2"));
        patch(&image);
        image.set_u64(72, image.u64(72) | 1);
        let len = image.len();
        match startup(&dir, &qcow2_args(&image.path, &socket, true)) {
            Startup::Served => eprintln!("{case}: observed: served"),
            Startup::Hung => failures.push(format!("{case}: vsd neither started nor exited in {TIMEOUT:?}")),
            Startup::Exited { status, stderr } if status.code() == Some(1) => {
                eprintln!("{case}: observed: refused: {}", stderr.trim_end());
            }
            Startup::Exited { status, stderr } => {
                let first = stderr.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
                failures.push(format!("{case}: vsd must serve or exit 1, ended with {}: {first}", describe(status)));
            }
        }
        let now = image.len();
        if now > len + 4 * MIB {
            failures.push(format!("{case}: opening the image grew the file from {len} to {now} bytes"));
        }
    }
    assert!(failures.is_empty(), "{} dirty case(s) failed:\n{}", failures.len(), failures.join("\n"));
}

/// A compressed cluster whose bytes are garbage: its reads (and partial
/// writes, which must decompress it) fail; the other compressed clusters
/// still read.
#[test]
fn garbage_compressed_cluster_fails_its_reads() {
    let case = "compressed cluster with garbage data";
    let dir = Scratch::new("qcow2-compressed");
    let raw = dir.path("src.raw");
    qemu_img(&["create", "-q", "-f", "raw", raw.to_str().unwrap(), "32M"]);
    let writes: Vec<String> = DATA.iter().map(|(at, b)| format!("write -q -P {b:#x} {at} 64k")).collect();
    let mut args = vec!["-f", "raw"];
    for w in &writes {
        args.extend(["-c", w.as_str()]);
    }
    args.push(raw.to_str().unwrap());
    let out = run("qemu-io", &args);
    assert!(out.status.success(), "qemu-io: {}", String::from_utf8_lossy(&out.stderr));
    let image = Img { path: dir.path("c.qcow2") };
    let (src, dst) = (raw.to_str().unwrap(), image.path.to_str().unwrap());
    qemu_img(&["convert", "-c", "-f", "raw", "-O", "qcow2", "-o", "cluster_size=64k", src, dst]);
    for &(guest, _) in &DATA {
        assert_ne!(image.l2_entry(guest) & COMPRESSED, 0, "qemu-img convert -c compressed guest {guest:#x}");
    }
    // 64 KiB clusters: the host offset is in bits 0..54 of the entry.
    let host = image.l2_entry(DAMAGED) & ((1 << 54) - 1);
    let next = image.l2_entry(2 * CLUSTER) & ((1 << 54) - 1);
    assert!(next >= host + 8, "the damaged stream has at least 8 bytes of its own");
    // 0xff: a final deflate block of the reserved type 3.
    image.put(host, &[0xff; 8]);

    let before = image.whole();
    let mut served = serve(&dir, &image, false);
    let q = &mut served.queue;
    rest_reads(case, q);
    expect_read_eio(case, q, DAMAGED, CLUSTER);
    expect_byte(case, q, 0, CLUSTER, 0x41); // the decompressed cluster cache
    expect_read_eio(case, q, DAMAGED + 4 * KIB, 4 * KIB);
    expect_read_eio(case, q, 0, 3 * CLUSTER);
    rest_reads(case, q);
    served.stop(case);
    assert!(image.whole() == before, "{case}: a read-only export changed the image");

    // Writable: a partial write needs the old contents and must fail.
    let end = image.len().next_multiple_of(CLUSTER);
    let mut served = serve(&dir, &image, true);
    let q = &mut served.queue;
    expect_write_eio(case, q, DAMAGED + 4 * KIB, &pattern(7, 4 * KIB as usize));
    expect_read_eio(case, q, DAMAGED, CLUSTER);
    // A whole-cluster overwrite needs no old contents; QEMU accepts it.
    let full = pattern(8, CLUSTER as usize);
    let overwrite = q.write_at(DAMAGED, &full);
    let after = read(q, DAMAGED, CLUSTER);
    rest_reads(case, q);
    served.stop(case);
    let (code, report) = qemu_check(&image.path);
    let past_end: Vec<u16> = (0..3).map(|i| image.refcount(end + i * CLUSTER)).collect();
    eprintln!(
        "{case}: observed: a whole-cluster overwrite gives {overwrite:?}; the range then reads {}; \
         refcounts of the clusters from the old end of the file on: {past_end:?}; \
         qemu-img check exits {code:?}:\n{report}",
        match &after {
            Ok(b) if *b == full => "the new data".to_string(),
            Ok(_) => "other data".to_string(),
            Err(e) => format!("an error ({e})"),
        }
    );
}

// ---------------------------------------------------------------------------
// 4. Writes on damaged metadata must not corrupt anything else

/// refcount_bits=1 images hold refcounts of at most 1, which is all vsd
/// needs: allocating writes, overwrites, write-zeroes and discards work
/// and `qemu-img check` finds nothing.
#[test]
fn refcount_bits_1_image_is_fine_to_write() {
    let case = "refcount_bits=1";
    let dir = Scratch::new("qcow2-rc1");
    let image = base_image(&dir, "r1.qcow2", ",refcount_bits=1");
    assert_eq!(image.u32(96), 0, "refcount_order 0");
    let mut served = serve(&dir, &image, true);
    let q = &mut served.queue;
    let (a, b) = (pattern(11, 3 * CLUSTER as usize), pattern(12, CLUSTER as usize));
    q.write_at(UNALLOCATED, &a).unwrap();
    q.write_at(0, &b).unwrap();
    q.write_zeroes(MIB, CLUSTER, false).unwrap();
    q.discard(8 * MIB, CLUSTER).unwrap();
    q.write_at(12 * MIB, &b).unwrap();
    q.flush().unwrap();
    expect_read(case, q, UNALLOCATED, &a);
    expect_read(case, q, 0, &b);
    expect_read(case, q, 12 * MIB, &b);
    expect_byte(case, q, MIB, CLUSTER, 0);
    expect_byte(case, q, 8 * MIB, CLUSTER, 0);
    expect_byte(case, q, CLUSTER, CLUSTER, 0x42);
    served.stop(case);
    let (code, report) = qemu_check(&image.path);
    assert_eq!(code, Some(0), "{case}: qemu-img check after vsd wrote:\n{report}");
    qemu_io(&image.path, true, &["read -q -P 0x42 64k 64k", "read -q -P 0 1M 64k", "read -q -P 0x43 128k 64k"]);
}

/// A data cluster still mapped by an L2 entry but with refcount 0 looks
/// free. QEMU's allocator trusts the refcount too (its overlap check only
/// guards metadata), so reusing it is not asserted against: this test
/// records what happens and checks that vsd stays up and the new write
/// reads back.
#[test]
fn data_cluster_with_refcount_0_observation() {
    let case = "data cluster with refcount 0";
    let dir = Scratch::new("qcow2-rc0-data");
    let image = base_image(&dir, "r0.qcow2", "");
    let victim = image.host_of(0);
    image.set_refcount(victim, 0);
    let (code_before, report_before) = qemu_check(&image.path);

    let mut served = serve(&dir, &image, true);
    let q = &mut served.queue;
    let fresh = pattern(21, CLUSTER as usize);
    q.write_at(5 * MIB, &fresh).unwrap_or_else(|e| panic!("{case}: write to an unallocated range: {e}"));
    q.flush().unwrap();
    expect_read(case, q, 5 * MIB, &fresh);
    let guest0 = read(q, 0, CLUSTER);
    assert!(served.daemon.is_running(), "{case}: vsd died");
    served.stop(case);

    let reused = image.host_of(5 * MIB) == victim;
    let (code_after, report_after) = qemu_check(&image.path);
    eprintln!(
        "{case}: observed: the new write {} the cluster at {victim:#x} still mapped at guest 0; guest 0 now reads {}; \
         refcount of {victim:#x} is {}.\nqemu-img check before vsd (exit {code_before:?}):\n{report_before}\n\
         qemu-img check after vsd (exit {code_after:?}):\n{report_after}",
        if reused { "was given" } else { "was not given" },
        match &guest0 {
            Ok(b) if b.iter().all(|&x| x == 0x41) => "its old data".to_string(),
            Ok(b) if *b == fresh => "the data written at 5 MiB".to_string(),
            Ok(_) => "other data".to_string(),
            Err(e) => format!("an error ({e})"),
        },
        image.refcount(victim),
    );
}

/// The L2 table's own refcount is 0: allocation must not hand out the
/// live L2 table as a data cluster (QEMU's overlap check refuses to write
/// guest data over active L2 tables).
#[test]
fn l2_table_with_refcount_0_is_not_handed_out() {
    let case = "L2 table cluster with refcount 0";
    let dir = Scratch::new("qcow2-rc0-l2");
    let image = base_image(&dir, "r0.qcow2", "");
    let l2 = image.l2_table(0);
    image.set_refcount(l2, 0);
    let metadata = [0, image.refcount_table(), image.refcount_block(), image.l1(), l2];

    let mut served = serve(&dir, &image, true);
    let q = &mut served.queue;
    let fresh = pattern(31, CLUSTER as usize);
    let result = q.write_at(FRESH, &fresh);
    let back = result.as_ref().ok().map(|()| {
        q.flush().unwrap();
        read(q, FRESH, CLUSTER)
    });
    rest_reads(case, q);
    served.stop(case);
    if let Some(back) = back {
        let host = image.host_of(FRESH);
        let back = match back {
            Ok(b) if b == fresh => "the data written".to_string(),
            Ok(b) => format!("other bytes ({:02x?}...)", &b[..8]),
            Err(e) => format!("an error ({e})"),
        };
        assert!(
            !metadata.contains(&host),
            "{case}: an acknowledged write at {FRESH:#x} was given host cluster {host:#x}, which is the live \
             L2 table (metadata clusters: {metadata:x?}); reading it back through the same vsd returned {back}"
        );
    }
    let mut served = serve(&dir, &image, false);
    rest_reads(&format!("{case}, after a restart"), &mut served.queue);
    if result.is_ok() {
        expect_read(&format!("{case}, after a restart"), &mut served.queue, FRESH, &fresh);
    }
    served.stop(case);
}

/// A compressed L2 entry naming the L1 table: vsd checks compressed
/// entries against metadata too, so a writable node finds the image
/// corrupt at the first read of it, and nothing (a discard dropping the
/// L1 table's reference, guest data allocated onto it) can follow.
#[test]
fn compressed_entry_into_the_l1_table_does_not_let_data_onto_it() {
    let case = "compressed L2 entry pointing into the L1 table, discarded";
    let dir = Scratch::new("qcow2-compressed-l1");
    let image = base_image(&dir, "d.qcow2", "");
    let l1 = image.l1();
    // One 512-byte sector of "compressed data" at the L1 table.
    image.set_l2_entry(DAMAGED, COMPRESSED | l1);
    let l1_before = image.bytes(l1, CLUSTER);

    let before = image.metadata();
    let mut served = serve(&dir, &image, true);
    let q = &mut served.queue;
    // The entry is found to point into metadata: the image is corrupt, and
    // nothing more is served, so no guest data can reach the L1 table.
    expect_read_eio(case, q, DAMAGED, CLUSTER);
    assert!(q.discard(DAMAGED, CLUSTER).is_err(), "{case}: a discard of a corrupt image succeeded");
    expect_write_eio(case, q, UNALLOCATED, &pattern(41, CLUSTER as usize));
    served.stop(case);
    flagged_corrupt_and_nothing_else(case, &image, &before);
    assert!(image.bytes(l1, CLUSTER) == l1_before, "{case}: the L1 table changed");
    assert_eq!(image.refcount(l1), 1, "{case}: the L1 table's refcount changed");
    qemu_io(&image.path, true, &["read -q -P 0x41 0 64k", "read -q -P 0x44 1M 64k"]);
}

/// A data cluster with refcount 0 becomes a new L2 table; the old entry
/// that still maps it must then be refused like any entry pointing into
/// metadata, not written through (QEMU's overlap check catches this).
#[test]
fn stale_entry_onto_a_newly_allocated_l2_table_is_not_written_through() {
    let case = "data cluster with refcount 0 reused as an L2 table, then written through its old entry";
    let dir = Scratch::new("qcow2-rc0-newl2");
    let path = dir.path("big.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", "-o", "cluster_size=64k", path.to_str().unwrap(), "1G"]);
    qemu_io(&path, false, &["write -q -P 0x41 0 64k", "write -q -P 0x42 64k 64k"]);
    let image = Img { path };
    let victim = image.host_of(0);
    image.set_refcount(victim, 0);

    let mut served = serve(&dir, &image, true);
    let q = &mut served.queue;
    expect_byte(case, q, 0, CLUSTER, 0x41); // loads the first L2 table
    let second = image.l2_span(); // the first guest byte of the second L1 entry
    let b = pattern(51, CLUSTER as usize);
    q.write_at(second, &b).unwrap_or_else(|e| panic!("{case}: write needing a new L2 table: {e}"));
    q.flush().unwrap();
    let new_l2 = image.l2_table(second);
    let c = pattern(52, CLUSTER as usize);
    let through_old = q.write_at(0, &c);
    // Refused as corrupt, the image then serves nothing: the flush fails.
    let flushed = q.flush();
    served.stop(case);

    let first_word = image.u64(new_l2);
    assert!(
        new_l2 != victim || through_old.is_err(),
        "{case}: the new L2 table went to {new_l2:#x}, still mapped at guest 0, and a write to guest 0 succeeded; \
         the table's first entry on disk is now {first_word:#018x}"
    );
    assert_eq!(flushed.is_err(), image.u64(72) & CORRUPT_BIT != 0, "{case}: a flush fails once the image is corrupt");
    let guest = |offset: u64| {
        let out = dir.path("cluster.raw");
        let window = format!(
            "driver=raw,offset={offset},size={CLUSTER},file.driver=qcow2,file.file.filename={}",
            image.path.display()
        );
        qemu_img(&["convert", "--image-opts", &window, "-O", "raw", out.to_str().unwrap()]);
        std::fs::read(&out).unwrap()
    };
    assert!(guest(second) == b, "{case}: the write needing a new L2 table is in the image");
    assert!(guest(CLUSTER).iter().all(|&x| x == 0x42), "{case}: guest cluster 1 is intact");
}

// ---------------------------------------------------------------------------
// 5. Truncated images

/// Cuts a copy of the base image at `cut` (a function of the image):
/// vsd either refuses it clearly or serves it, with every range reading
/// its data, zeroes, or an I/O error; writes work or fail cleanly.
fn truncated(case: &str, name: &str, cut: fn(&Img) -> u64) {
    let dir = Scratch::new(name);
    let image = base_image(&dir, "t.qcow2", "");
    let hosts: Vec<(u64, u8, u64)> = DATA.iter().map(|&(g, b)| (g, b, image.host_of(g))).collect();
    let at = cut(&image);
    image.truncate(at);

    let socket = dir.path("s.sock");
    match startup(&dir, &qcow2_args(&image.path, &socket, false)) {
        Startup::Served => {}
        Startup::Hung => panic!("{case}: vsd neither started nor exited in {TIMEOUT:?}"),
        Startup::Exited { status, stderr } => {
            assert_eq!(status.code(), Some(1), "{case}: vsd must serve or exit with status 1, got {status}: {stderr}");
            assert!(stderr.trim_end().lines().count() == 1 && stderr.starts_with("vsd: "), "{case}: {stderr:?}");
            eprintln!("{case}: observed: refused: {}", stderr.trim_end());
            return;
        }
    }
    let mut served = serve(&dir, &image, false);
    let q = &mut served.queue;
    let mut seen = Vec::new();
    for &(guest, byte, host) in &hosts {
        match read(q, guest, CLUSTER) {
            Ok(buf) if host + CLUSTER <= at => {
                assert!(buf.iter().all(|&x| x == byte), "{case}: guest {guest:#x}, wholly inside the file, changed");
            }
            Ok(buf) => {
                let ok = buf.iter().all(|&x| x == 0 || x == byte);
                assert!(ok, "{case}: guest {guest:#x} (cut) read bytes that are neither its data nor zeroes");
                seen.push(format!("{guest:#x}: {}", if buf.iter().all(|&x| x == 0) { "zeroes" } else { "partly" }));
            }
            Err(e) if is_eio(&e) && host + CLUSTER > at => seen.push(format!("{guest:#x}: EIO")),
            Err(e) => panic!("{case}: read of guest {guest:#x} (host {host:#x}, file cut at {at:#x}): {e}"),
        }
    }
    expect_byte(case, q, UNALLOCATED, CLUSTER, 0);
    served.stop(case);
    eprintln!("{case}: observed: served; cut clusters read as {}", seen.join(", "));

    // Writable: writes over the cut clusters and elsewhere either work and
    // read back, or fail with an I/O error.
    let mut served = serve(&dir, &image, true);
    let q = &mut served.queue;
    for (seed, &(guest, _, _)) in hosts.iter().enumerate() {
        let data = pattern(60 + seed as u64, CLUSTER as usize);
        match q.write_at(guest, &data) {
            Ok(()) => expect_read(case, q, guest, &data),
            Err(e) if is_eio(&e) => {}
            Err(e) => panic!("{case}: write to guest {guest:#x}: {e}"),
        }
    }
    let fresh = pattern(70, CLUSTER as usize);
    q.write_at(UNALLOCATED, &fresh).unwrap_or_else(|e| panic!("{case}: allocating write: {e}"));
    expect_read(case, q, UNALLOCATED, &fresh);
    q.flush().unwrap();
    served.stop(case);
}

#[test]
fn image_truncated_in_the_l2_table() {
    // Keeps the first two L2 entries; the data clusters after it are gone.
    truncated("image cut 16 bytes into the L2 table", "qcow2-cut-l2", |i| i.l2_table(0) + 16);
}

#[test]
fn image_truncated_in_the_data() {
    // Keeps the first two data clusters and half of the third.
    truncated("image cut in the middle of the third data cluster", "qcow2-cut-data", |i| {
        i.host_of(2 * CLUSTER) + CLUSTER / 2
    });
}
