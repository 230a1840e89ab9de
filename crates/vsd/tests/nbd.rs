//! NBD exports against real peers: libnbd's tools (nbdinfo, nbdcopy),
//! QEMU's (qemu-img, qemu-io: QEMU 10's client negotiates extended
//! headers), fio's libnbd engine; and a hostile client of the test's own
//! on a raw socket.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use common::{Daemon, Scratch, ok, pattern, run};
use serde_json::{Value, json};
use vsd_control::client::QmpClient;

const MIB: u64 = 1 << 20;

/// `--blockdev` file + raw over `image`, an NBD server on `socket`, and an
/// export `e0` named `disk` with `export_opts` (",writable=on").
fn unix_export(image: &Path, socket: &Path, export_opts: &str) -> Vec<String> {
    vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}", image.display()),
        "--blockdev".into(),
        "driver=raw,node-name=r0,file=f0".into(),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", socket.display()),
        "--export".into(),
        format!("type=nbd,id=e0,node-name=r0,name=disk,description=a test disk{export_opts}"),
    ]
}

fn uri(socket: &Path, name: &str) -> String {
    format!("nbd+unix:///{name}?socket={}", socket.display())
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// A TCP port nobody listens on right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// An image with a pattern at a few places and holes between them.
fn sparse_image(dir: &Scratch, name: &str) -> std::path::PathBuf {
    let image = dir.image(name, 64 * MIB);
    let file = std::fs::OpenOptions::new().write(true).open(&image).unwrap();
    file.write_all_at(&pattern(1, MIB as usize), 4 * MIB).unwrap();
    file.write_all_at(&pattern(2, 64 << 10), 20 * MIB).unwrap();
    file.write_all_at(&pattern(3, 2 * MIB as usize), 62 * MIB).unwrap();
    image
}

#[test]
fn nbdinfo_sees_the_export_as_configured() {
    let dir = Scratch::new("nbd-info");
    let image = dir.image("disk.img", 64 * MIB);
    let socket = dir.path("nbd.sock");
    let daemon = Daemon::vsd(&dir, &unix_export(&image, &socket, ",writable=on"));
    let info: Value = serde_json::from_str(&ok("nbdinfo", &["--json", &uri(&socket, "disk")])).unwrap();
    assert_eq!((&info["protocol"], &info["structured"]), (&json!("newstyle-fixed"), &json!(true)));
    let export = &info["exports"][0];
    assert_eq!(export["export-name"], "disk");
    assert_eq!(export["description"], "a test disk");
    assert_eq!(export["export-size"], 64 * MIB);
    assert_eq!(export["contexts"], json!(["base:allocation"]));
    for (key, want) in [
        ("is_read_only", false),
        ("can_multi_conn", true),
        ("can_flush", true),
        ("can_fua", true),
        ("can_trim", true),
        ("can_zero", true),
        ("can_fast_zero", true),
        ("can_df", true),
        ("can_cache", true),
    ] {
        assert_eq!(export[key], want, "{key}");
    }
    assert_eq!((&export["block_size_minimum"], &export["block_size_maximum"]), (&json!(1), &json!(32 * MIB)));
    let missing = run("nbdinfo", &["--json", &uri(&socket, "nope")]);
    assert!(!missing.status.success(), "an unknown export name is refused");
    drop(daemon);
    assert!(!socket.exists(), "the socket goes with the daemon");
}

#[test]
fn nbdinfo_map_matches_the_sparse_file_s_holes() {
    let dir = Scratch::new("nbd-map");
    let image = sparse_image(&dir, "disk.img");
    let socket = dir.path("nbd.sock");
    let _daemon = Daemon::vsd(&dir, &unix_export(&image, &socket, ""));
    let map: Value = serde_json::from_str(&ok("nbdinfo", &["--map", "--json", &uri(&socket, "disk")])).unwrap();
    let extents: Vec<(u64, u64, u64)> = map
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["offset"].as_u64().unwrap(), e["length"].as_u64().unwrap(), e["type"].as_u64().unwrap()))
        .collect();
    let (hole, data) = (3, 0);
    let want = [
        (0, 4 * MIB, hole),
        (4 * MIB, MIB, data),
        (5 * MIB, 15 * MIB, hole),
        (20 * MIB, 64 << 10, data),
        (20 * MIB + (64 << 10), 42 * MIB - (64 << 10), hole),
        (62 * MIB, 2 * MIB, data),
    ];
    assert_eq!(extents, want);
    // qemu-img agrees through QEMU's NBD client.
    let qemu: Value =
        serde_json::from_str(&ok("qemu-img", &["map", "--output=json", "-f", "raw", &uri(&socket, "disk")])).unwrap();
    let data_ranges: Vec<(u64, u64)> = qemu
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["data"] == true)
        .map(|e| (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap()))
        .collect();
    assert_eq!(data_ranges, [(4 * MIB, MIB), (20 * MIB, 64 << 10), (62 * MIB, 2 * MIB)]);
}

/// Runs of (start, length, reads-as-hole), adjacent runs of a kind merged.
fn runs(extents: impl Iterator<Item = (u64, u64, bool)>) -> Vec<(u64, u64, bool)> {
    let mut merged: Vec<(u64, u64, bool)> = Vec::new();
    for (start, len, hole) in extents {
        match merged.last_mut() {
            Some(last) if last.2 == hole && last.0 + last.1 == start => last.1 += len,
            _ => merged.push((start, len, hole)),
        }
    }
    merged
}

#[test]
fn qcow2_block_status_matches_qemu_img_map() {
    let dir = Scratch::new("nbd-qcow2-map");
    let base = dir.path("base.raw");
    let overlay = dir.path("overlay.qcow2");
    ok("qemu-img", &["create", "-q", "-f", "raw", base.to_str().unwrap(), "32M"]);
    ok("qemu-io", &["-f", "raw", "-c", "write -P 1 0 1M", "-c", "write -P 2 12M 512k", base.to_str().unwrap()]);
    let backing = ["-b", base.to_str().unwrap(), "-F", "raw"];
    ok("qemu-img", &[&["create", "-q", "-f", "qcow2"][..], &backing, &[overlay.to_str().unwrap(), "32M"]].concat());
    let writes = ["write -P 3 4M 1M", "write -z 12M 128k", "write -c -P 4 20M 64k", "write -z 24M 64k"];
    let mut args = vec!["-f", "qcow2"];
    writes.iter().for_each(|w| args.extend(["-c", w]));
    args.push(overlay.to_str().unwrap());
    ok("qemu-io", &args);
    let map: Value =
        serde_json::from_str(&ok("qemu-img", &["map", "--output=json", overlay.to_str().unwrap()])).unwrap();
    let want = runs(
        map.as_array()
            .unwrap()
            .iter()
            .map(|e| (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap(), e["data"] == false)),
    );
    assert!(want.len() >= 7, "the image has runs of both kinds: {want:?}");

    let socket = dir.path("nbd.sock");
    let args = vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}", overlay.display()),
        "--blockdev".into(),
        "driver=qcow2,node-name=q0,file=f0".into(),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", socket.display()),
        "--export".into(),
        "type=nbd,id=e0,node-name=q0".into(),
    ];
    let _daemon = Daemon::vsd(&dir, &args);
    let map: Value = serde_json::from_str(&ok("nbdinfo", &["--map", "--json", &uri(&socket, "q0")])).unwrap();
    let got =
        runs(map.as_array().unwrap().iter().map(|e| {
            (e["offset"].as_u64().unwrap(), e["length"].as_u64().unwrap(), e["type"].as_u64().unwrap() & 1 != 0)
        }));
    assert_eq!(got, want, "vsd's base:allocation against qemu-img map of the chain");
}

#[test]
fn nbdcopy_both_ways_keeps_every_byte() {
    let dir = Scratch::new("nbd-copy");
    let source = sparse_image(&dir, "source.img");
    let target = dir.image("target.img", 64 * MIB);
    let socket = dir.path("nbd.sock");
    let daemon = Daemon::vsd(&dir, &unix_export(&target, &socket, ",writable=on"));
    ok("nbdcopy", &[source.to_str().unwrap(), &uri(&socket, "disk")]);
    let back = dir.path("back.img");
    ok("nbdcopy", &[&uri(&socket, "disk"), back.to_str().unwrap()]);
    drop(daemon);
    let source_bytes = std::fs::read(&source).unwrap();
    assert!(std::fs::read(&target).unwrap() == source_bytes, "what nbdcopy wrote is in the image");
    assert!(std::fs::read(&back).unwrap() == source_bytes, "what nbdcopy read is the image");
}

#[test]
fn qemu_img_and_qemu_io_over_tcp() {
    let dir = Scratch::new("nbd-qemu");
    let source = sparse_image(&dir, "source.img");
    let target = dir.image("target.img", 64 * MIB);
    let port = free_port();
    let args = vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}", target.display()),
        "--nbd-server".into(),
        format!("addr.type=inet,addr.host=127.0.0.1,addr.port={port}"),
        "--export".into(),
        "type=nbd,id=e0,node-name=f0,writable=on".into(),
    ];
    let _daemon = Daemon::vsd(&dir, &args);
    let tcp = format!("nbd://127.0.0.1:{port}/f0");
    ok("qemu-img", &["convert", "-n", "-f", "raw", "-O", "raw", source.to_str().unwrap(), &tcp]);
    ok("qemu-img", &["compare", "-f", "raw", "-F", "raw", source.to_str().unwrap(), &tcp]);
    let io = |command: &str| run("qemu-io", &["-f", "raw", "-c", command, &tcp]);
    let out = io("write -f -P 0x5a 1M 64k");
    assert!(out.status.success(), "{}", text(&out));
    let out = io("write -z 4M 1M");
    assert!(out.status.success(), "{}", text(&out));
    let out = io("read -P 0x5a 1M 64k");
    assert!(out.status.success() && !text(&out).contains("Pattern verification failed"), "{}", text(&out));
    let out = io("read -P 0x77 1M 4k");
    assert!(text(&out).contains("Pattern verification failed"), "a negative control: {}", text(&out));
    let out = io("discard 8M 1M");
    assert!(out.status.success(), "{}", text(&out));
    let bytes = std::fs::read(&target).unwrap();
    assert!(bytes[MIB as usize..(MIB + (64 << 10)) as usize].iter().all(|&b| b == 0x5a));
    assert!(bytes[4 * MIB as usize..5 * MIB as usize].iter().all(|&b| b == 0), "write -z zeroed");
    assert_eq!(&bytes[62 * MIB as usize..], &pattern(3, 2 * MIB as usize)[..]);
}

#[test]
fn fio_s_nbd_engine_writes_and_verifies() {
    let dir = Scratch::new("nbd-fio");
    let image = dir.image("disk.img", 64 * MIB);
    let socket = dir.path("nbd.sock");
    let _daemon = Daemon::vsd(&dir, &unix_export(&image, &socket, ",writable=on"));
    let uri = uri(&socket, "disk");
    let out = run(
        "fio",
        &[
            "--name=nbd",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bsrange=4k-128k",
            "--size=32M",
            "--iodepth=32",
            "--verify=crc32c",
            "--verify_fatal=1",
            // No state file in the working directory.
            "--verify_state_save=0",
            "--output-format=json",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "fio: {}", text(&out));
    assert!(stdout.contains("fio: connected to NBD server"), "{stdout}");
    let report: Value = serde_json::from_str(&stdout[stdout.find('{').unwrap()..]).unwrap();
    let job = &report["jobs"][0];
    assert_eq!(job["error"], 0, "{job}");
    assert!(job["write"]["io_bytes"].as_u64().unwrap() >= 32 * MIB, "{job}");
    assert!(job["read"]["io_bytes"].as_u64().unwrap() >= 32 * MIB, "the verify pass read it all back: {job}");
}

#[test]
fn qmp_starts_serves_lists_deletes_and_stops() {
    let dir = Scratch::new("nbd-qmp");
    let image = dir.image("disk.img", 16 * MIB);
    let qmp_socket = dir.path("qmp.sock");
    let nbd_socket = dir.path("nbd.sock");
    let args = vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}", image.display()),
        "--chardev".into(),
        format!("socket,id=m,path={},server=on,wait=off", qmp_socket.display()),
        "--monitor".into(),
        "chardev=m".into(),
    ];
    let _daemon = Daemon::vsd(&dir, &args);
    let mut qmp = QmpClient::connect(&qmp_socket).unwrap();
    let export = json!({"type": "nbd", "id": "e0", "node-name": "f0", "writable": true});
    let refused = qmp.execute("block-export-add", export.clone()).unwrap_err().to_string();
    assert!(refused.contains("NBD server not running"), "{refused}");
    // QMP's legacy socket address, as libvirt sends it.
    let addr = json!({"addr": {"type": "unix", "data": {"path": nbd_socket}}, "max-connections": 4});
    qmp.execute("nbd-server-start", addr.clone()).unwrap();
    let twice = qmp.execute("nbd-server-start", addr).unwrap_err().to_string();
    assert!(twice.contains("already running"), "{twice}");
    qmp.execute("block-export-add", export).unwrap();
    let listed = qmp.execute("query-block-exports", Value::Null).unwrap();
    assert_eq!(listed, json!([{"type": "nbd", "id": "e0", "node-name": "f0", "shutting-down": false}]));

    let out =
        run("qemu-io", &["-f", "raw", "-c", "write -P 0x11 0 1M", "-c", "read -P 0x11 0 1M", &uri(&nbd_socket, "f0")]);
    assert!(out.status.success() && !text(&out).contains("verification failed"), "{}", text(&out));
    let stats = qmp.execute("query-blockstats", Value::Null).unwrap();
    let entry = stats.as_array().unwrap().iter().find(|e| e["qdev"] == "e0").unwrap().clone();
    assert_eq!((&entry["stats"]["wr_bytes"], &entry["stats"]["rd_bytes"]), (&json!(MIB), &json!(MIB)), "{entry}");

    // A connected client keeps a safe delete from happening; hard cuts it.
    let mut client = RawClient::connect(&nbd_socket, "f0", Mode::Simple);
    client.request(0, FLUSH, 1, 0, 0, &[]);
    assert_eq!(client.simple_reply(), (0, 1), "in the transmission phase");
    let busy = qmp.execute("block-export-del", json!({"id": "e0"})).unwrap_err().to_string();
    assert!(busy.contains("still in use"), "{busy}");
    qmp.execute("block-export-del", json!({"id": "e0", "mode": "hard"})).unwrap();
    assert!(client.closed_within(Duration::from_secs(5)), "the client was cut");
    assert_eq!(qmp.execute("query-block-exports", Value::Null).unwrap(), json!([]));

    qmp.execute("block-export-add", json!({"type": "nbd", "id": "e1", "node-name": "f0", "name": "again"})).unwrap();
    let mut handshaking = UnixStream::connect(&nbd_socket).unwrap();
    handshaking.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    handshaking.read_exact(&mut [0u8; 18]).expect("the greeting: the server took the connection");
    qmp.execute("nbd-server-stop", Value::Null).unwrap();
    assert_eq!(qmp.execute("query-block-exports", Value::Null).unwrap(), json!([]), "stopping deletes NBD exports");
    let mut rest = Vec::new();
    handshaking.read_to_end(&mut rest).expect("a client still negotiating is cut too (CVE-2024-7409)");
    assert!(!nbd_socket.exists());
    let stopped = qmp.execute("nbd-server-stop", Value::Null).unwrap_err().to_string();
    assert!(stopped.contains("not running"), "{stopped}");
}

/// Reply formats the raw client can ask for.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Simple,
    /// Structured replies with compact headers.
    Structured,
    Extended,
}

/// A client of the test's own that says exactly what it is told to.
struct RawClient {
    s: UnixStream,
}

const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;

impl RawClient {
    /// Negotiates up to the greeting and the client flags.
    fn greeted(socket: &Path) -> Self {
        let s = UnixStream::connect(socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut client = Self { s };
        let greeting = client.read_exact(18);
        assert_eq!(&greeting[..8], b"NBDMAGIC");
        client.s.write_all(&3u32.to_be_bytes()).unwrap();
        client
    }

    fn connect(socket: &Path, export: &str, mode: Mode) -> Self {
        match mode {
            Mode::Simple => Self::go(Self::greeted(socket), export),
            Mode::Structured => {
                let mut client = Self::greeted(socket);
                assert_eq!(client.option(8, &[])[0].0, 1, "structured replies acknowledged");
                Self::go(client, export)
            }
            Mode::Extended => Self::connect_with(socket, export, &["base:allocation"]),
        }
    }

    /// Negotiates extended headers and selects these metadata contexts,
    /// which the server must all acknowledge with their ids in order.
    fn connect_with(socket: &Path, export: &str, contexts: &[&str]) -> Self {
        let mut client = Self::greeted(socket);
        assert_eq!(client.option(11, &[])[0].0, 1, "extended headers acknowledged");
        let string = |s: &str| [&(s.len() as u32).to_be_bytes()[..], s.as_bytes()].concat();
        let mut meta = [string(export), (contexts.len() as u32).to_be_bytes().to_vec()].concat();
        contexts.iter().for_each(|c| meta.extend(string(c)));
        let replies = client.option(10, &meta);
        let mut selected: Vec<&[u8]> = replies.iter().filter(|r| r.0 == 4).map(|r| &r.1[4..]).collect();
        let mut wanted: Vec<&[u8]> = contexts.iter().map(|c| c.as_bytes()).collect();
        selected.sort();
        wanted.sort();
        assert_eq!(selected, wanted, "contexts selected");
        Self::go(client, export)
    }

    fn go(mut client: Self, export: &str) -> Self {
        let go = [&(export.len() as u32).to_be_bytes()[..], export.as_bytes(), &0u16.to_be_bytes()].concat();
        let replies = client.option(7, &go);
        assert_eq!(replies.last().unwrap().0, 1, "GO acknowledged");
        client
    }

    fn read_exact(&mut self, n: usize) -> Vec<u8> {
        let mut buf = vec![0; n];
        self.s.read_exact(&mut buf).unwrap();
        buf
    }

    /// Sends an option and reads its replies up to the last: (type, data).
    fn option(&mut self, code: u32, data: &[u8]) -> Vec<(u32, Vec<u8>)> {
        let header = [&IHAVEOPT.to_be_bytes()[..], &code.to_be_bytes(), &(data.len() as u32).to_be_bytes()].concat();
        self.s.write_all(&[&header[..], data].concat()).unwrap();
        let mut replies = Vec::new();
        loop {
            let head = self.read_exact(20);
            let kind = u32::from_be_bytes(head[12..16].try_into().unwrap());
            let len = u32::from_be_bytes(head[16..20].try_into().unwrap()) as usize;
            let body = self.read_exact(len);
            replies.push((kind, body));
            // Informational replies (SERVER, INFO, META_CONTEXT) come before the last.
            if !(2..=4).contains(&kind) {
                return replies;
            }
        }
    }

    fn request(&mut self, flags: u16, kind: u16, cookie: u64, offset: u64, len: u32, payload: &[u8]) {
        let header = request_header(REQUEST_MAGIC, flags, kind, cookie, offset, &len.to_be_bytes());
        self.s.write_all(&[&header[..], payload].concat()).unwrap();
    }

    fn extended_request(&mut self, flags: u16, kind: u16, cookie: u64, offset: u64, len: u64) {
        let header = request_header(EXTENDED_REQUEST_MAGIC, flags, kind, cookie, offset, &len.to_be_bytes());
        self.s.write_all(&header).unwrap();
    }

    /// A simple reply: (error, cookie).
    fn simple_reply(&mut self) -> (u32, u64) {
        let r = self.read_exact(16);
        assert_eq!(&r[..4], &0x6744_6698u32.to_be_bytes());
        (u32::from_be_bytes(r[4..8].try_into().unwrap()), u64::from_be_bytes(r[8..16].try_into().unwrap()))
    }

    /// An extended reply chunk: (flags, type, cookie, payload).
    fn extended_reply(&mut self) -> (u16, u16, u64, Vec<u8>) {
        let r = self.read_exact(32);
        assert_eq!(&r[..4], &0x6e8a_278cu32.to_be_bytes());
        let len = u64::from_be_bytes(r[24..32].try_into().unwrap()) as usize;
        let payload = self.read_exact(len);
        let be16 = |at: usize| u16::from_be_bytes(r[at..at + 2].try_into().unwrap());
        (be16(4), be16(6), u64::from_be_bytes(r[8..16].try_into().unwrap()), payload)
    }

    /// A compact structured reply chunk: (flags, type, cookie, payload).
    fn structured_reply(&mut self) -> (u16, u16, u64, Vec<u8>) {
        let r = self.read_exact(20);
        assert_eq!(&r[..4], &0x668e_33efu32.to_be_bytes());
        let len = u32::from_be_bytes(r[16..20].try_into().unwrap()) as usize;
        let payload = self.read_exact(len);
        let be16 = |at: usize| u16::from_be_bytes(r[at..at + 2].try_into().unwrap());
        (be16(4), be16(6), u64::from_be_bytes(r[8..16].try_into().unwrap()), payload)
    }

    /// Sends a read in `mode`'s request format.
    fn read_request(&mut self, mode: Mode, cookie: u64, offset: u64, len: u32) {
        match mode {
            Mode::Extended => self.extended_request(0, READ, cookie, offset, u64::from(len)),
            _ => self.request(0, READ, cookie, offset, len, &[]),
        }
    }

    /// Reads the reply to a read, whichever comes next: (cookie, bytes).
    /// `asked` gives the length its cookie asked for (a simple reply does
    /// not say it). vsd answers a read in one chunk: data, or a hole.
    fn read_reply(&mut self, mode: Mode, asked: impl Fn(u64) -> usize) -> (u64, Vec<u8>) {
        if mode == Mode::Simple {
            let (error, cookie) = self.simple_reply();
            assert_eq!(error, 0, "the read of cookie {cookie} failed");
            return (cookie, self.read_exact(asked(cookie)));
        }
        let (flags, kind, cookie, payload) =
            if mode == Mode::Extended { self.extended_reply() } else { self.structured_reply() };
        assert_eq!(flags & 1, 1, "one chunk, done, for cookie {cookie}");
        match kind {
            1 => (cookie, payload[8..].to_vec()),
            2 => (cookie, vec![0; u32::from_be_bytes(payload[8..12].try_into().unwrap()) as usize]),
            other => panic!("chunk type {other} for cookie {cookie}: {payload:?}"),
        }
    }

    /// Reads `image` (its bytes) whole in reads of `len`, `depth` of them
    /// in flight, and checks every reply against it.
    fn read_all(&mut self, mode: Mode, image: &[u8], len: usize, depth: usize) {
        let requests: Vec<(usize, usize)> =
            (0..image.len()).step_by(len).map(|at| (at, len.min(image.len() - at))).collect();
        for window in requests.chunks(depth) {
            for (&(at, n), cookie) in window.iter().zip(0u64..) {
                self.read_request(mode, cookie, at as u64, n as u32);
            }
            for _ in window {
                let (cookie, data) = self.read_reply(mode, |cookie| window[cookie as usize].1);
                let (at, n) = window[cookie as usize];
                assert!(data == image[at..at + n], "{n} bytes at {at} differ ({} replies)", mode_name(mode));
            }
        }
    }

    /// Whether the server closes the connection within `limit`.
    fn closed_within(&mut self, limit: Duration) -> bool {
        self.s.set_read_timeout(Some(limit)).unwrap();
        let mut buf = [0u8; 4096];
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            match self.s.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
        false
    }
}

fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Simple => "simple",
        Mode::Structured => "structured",
        Mode::Extended => "extended",
    }
}

const READ: u16 = 0;
const WRITE: u16 = 1;
const DISC: u16 = 2;
const FLUSH: u16 = 3;
const TRIM: u16 = 4;
const WRITE_ZEROES: u16 = 6;
const BLOCK_STATUS: u16 = 7;
const EPERM: u32 = 1;
const EINVAL: u32 = 22;

/// Two exports of one file: `rw` writable and `ro` read-only, on `socket`.
fn two_exports(dir: &Scratch, socket: &Path, server_opts: &str) -> Daemon {
    let image = dir.image("disk.img", 16 * MIB);
    let args = vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}", image.display()),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}{server_opts}", socket.display()),
        "--export".into(),
        "type=nbd,id=rw,node-name=f0,name=rw,writable=on".into(),
        "--export".into(),
        "type=nbd,id=ro,node-name=f0,name=ro".into(),
    ];
    Daemon::vsd(dir, &args)
}

/// A real client gets through and reads the export's size (or the test
/// fails after 30 s rather than hang).
fn nbdinfo_works(socket: &Path, name: &str, size: u64) {
    let out = run("timeout", &["30", "nbdinfo", "--size", &uri(socket, name)]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), size.to_string(), "{}", text(&out));
}

#[test]
fn hostile_options_and_requests_get_the_spec_s_errors() {
    let dir = Scratch::new("nbd-hostile");
    let socket = dir.path("nbd.sock");
    let mut daemon = two_exports(&dir, &socket, "");

    let mut c = RawClient::greeted(&socket);
    let unknown = c.option(0x4242, &[1, 2, 3]);
    assert_eq!(unknown[0].0, (1 << 31) + 1, "NBD_REP_ERR_UNSUP");
    let listed = c.option(3, &[]);
    assert_eq!(listed.len(), 3, "two exports and the ACK");
    let missing = [&4u32.to_be_bytes()[..], b"nope", &0u16.to_be_bytes()].concat();
    assert_eq!(c.option(7, &missing)[0].0, (1 << 31) + 6, "NBD_REP_ERR_UNKNOWN");
    let lying = [&100u32.to_be_bytes()[..], b"rw", &0u16.to_be_bytes()].concat();
    assert_eq!(c.option(7, &lying)[0].0, (1 << 31) + 3, "a name longer than its option: NBD_REP_ERR_INVALID");
    drop(c);

    let mut c = RawClient::connect(&socket, "rw", Mode::Simple);
    c.request(0, 0x55, 1, 0, 0, &[]);
    assert_eq!(c.simple_reply(), (EINVAL, 1), "unknown command");
    c.request(0, READ, 2, 16 * MIB - 512, 1024, &[]);
    assert_eq!(c.simple_reply(), (EINVAL, 2), "a read past the end");
    c.request(0, WRITE, 3, u64::MAX - 511, 512, &[7; 512]);
    assert_eq!(c.simple_reply(), (EINVAL, 3), "an offset that wraps; its payload was taken");
    c.request(0, BLOCK_STATUS, 4, 0, 4096, &[]);
    assert_eq!(c.simple_reply(), (EINVAL, 4), "block status without base:allocation");
    c.request(1 << 2, READ, 5, 0, 512, &[]);
    assert_eq!(c.simple_reply(), (EINVAL, 5), "DF without structured replies");
    c.request(0, READ, 6, 0, 64 << 20, &[]);
    assert_eq!(c.simple_reply(), (EINVAL, 6), "a read over the maximum block size");
    c.request(0, TRIM, 7, 0, 0xffff_fe00, &[]);
    assert_eq!(c.simple_reply(), (EINVAL, 7), "a 4 GiB trim past the end of 16 MiB");
    // Still served after all that.
    c.request(1, WRITE, 8, 4096, 512, &[0xee; 512]);
    assert_eq!(c.simple_reply(), (0, 8), "a FUA write");
    c.request(0, READ, 9, 4096, 512, &[]);
    assert_eq!(c.simple_reply(), (0, 9));
    assert_eq!(c.read_exact(512), vec![0xee; 512]);
    // A payload over the maximum cannot be taken: an error, then the end.
    c.request(0, WRITE, 10, 0, 64 << 20, &[]);
    assert_eq!(c.simple_reply(), (EINVAL, 10));
    assert!(c.closed_within(Duration::from_secs(5)));

    let mut ro = RawClient::connect(&socket, "ro", Mode::Simple);
    ro.request(0, WRITE, 1, 0, 4096, &[1; 4096]);
    assert_eq!(ro.simple_reply(), (EPERM, 1), "a write to a read-only export");
    ro.request(0, WRITE_ZEROES, 2, 0, 4096, &[]);
    assert_eq!(ro.simple_reply(), (EPERM, 2));
    ro.request(0, TRIM, 3, 0, 4096, &[]);
    assert_eq!(ro.simple_reply(), (EPERM, 3));
    ro.request(0, FLUSH, 4, 0, 0, &[]);
    assert_eq!(ro.simple_reply(), (0, 4), "flush is allowed");
    ro.request(0, READ, 5, 0, 4096, &[]);
    assert_eq!(ro.simple_reply(), (0, 5));
    assert_eq!(ro.read_exact(4096), vec![0; 4096], "the refused write wrote nothing");
    ro.request(0, DISC, 6, 0, 0, &[]);
    assert!(ro.closed_within(Duration::from_secs(5)), "DISC closes");

    // A write whose payload stops half-way, then a client that sends garbage.
    let mut half = RawClient::connect(&socket, "rw", Mode::Simple);
    half.request(0, WRITE, 1, 0, MIB as u32, &[9; 1000]);
    drop(half);
    let mut garbage = RawClient::connect(&socket, "rw", Mode::Simple);
    garbage.s.write_all(&[0xff; 64]).unwrap();
    assert!(garbage.closed_within(Duration::from_secs(5)), "a bad request magic closes the connection");
    assert!(daemon.is_running());
    nbdinfo_works(&socket, "rw", 16 * MIB);
    let bytes = std::fs::read(dir.path("disk.img")).unwrap();
    assert!(bytes[..4096].iter().all(|&b| b == 0), "the half payload was never written");
}

#[test]
fn extended_headers_carry_64_bit_lengths() {
    let dir = Scratch::new("nbd-extended");
    let socket = dir.path("nbd.sock");
    let args = vec![
        "--blockdev".into(),
        "driver=null-co,node-name=n0,size=8589934592,read-zeroes=on".into(),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", socket.display()),
        "--export".into(),
        "type=nbd,id=e0,node-name=n0,writable=on".into(),
    ];
    let _daemon = Daemon::vsd(&dir, &args);
    let mut c = RawClient::connect(&socket, "n0", Mode::Extended);
    c.extended_request(0, WRITE_ZEROES, 1, 0, 5 << 30);
    let (flags, kind, cookie, payload) = c.extended_reply();
    assert_eq!((flags, kind, cookie, payload.len()), (1, 0, 1, 0), "a 5 GiB zeroing: one NONE chunk, done");
    c.extended_request(0, BLOCK_STATUS, 2, 0, 6 << 30);
    let (flags, kind, cookie, payload) = c.extended_reply();
    assert_eq!((flags, kind, cookie), (1, 6, 2), "BLOCK_STATUS_EXT");
    let be64 = |at: usize| u64::from_be_bytes(payload[at..at + 8].try_into().unwrap());
    assert_eq!(u32::from_be_bytes(payload[4..8].try_into().unwrap()), 1, "one descriptor");
    assert_eq!((be64(8), be64(16)), (6 << 30, 3), "6 GiB of hole,zero in one 64-bit extent");
    c.extended_request(0, READ, 3, 0, 4096);
    let (_, kind, _, payload) = c.extended_reply();
    assert_eq!((kind, payload.len()), (2, 12), "zeroes come back as an OFFSET_HOLE chunk");
    c.extended_request(0, READ, 4, 8 << 30, 1);
    let (_, kind, cookie, payload) = c.extended_reply();
    assert_eq!(
        (kind, cookie, &payload[..4]),
        ((1 << 15) + 1, 4, &EINVAL.to_be_bytes()[..]),
        "an ERROR chunk past the end"
    );
}

#[test]
fn block_status_answers_every_selected_context_in_one_reply() {
    let dir = Scratch::new("nbd-contexts");
    let image = sparse_image(&dir, "disk.img");
    let (socket, qmp_socket) = (dir.path("nbd.sock"), dir.path("qmp.sock"));
    let mut args = unix_export(&image, &socket, ",writable=on");
    args.extend(common::monitor(&qmp_socket));
    let _daemon = Daemon::vsd(&dir, &args);
    let mut qmp = QmpClient::connect(&qmp_socket).unwrap();
    qmp.execute("block-dirty-bitmap-add", json!({"node": "r0", "name": "b", "granularity": 65536})).unwrap();
    ok("qemu-io", &["-f", "raw", "-c", "write 1M 64k", &uri(&socket, "disk")]);
    qmp.execute("block-dirty-bitmap-disable", json!({"node": "r0", "name": "b"})).unwrap();
    let view = json!({"type": "nbd", "id": "e1", "node-name": "r0", "name": "view", "bitmaps": ["b"]});
    qmp.execute("block-export-add", view).unwrap();

    let mut c = RawClient::connect_with(&socket, "view", &["qemu:dirty-bitmap:b", "base:allocation"]);
    c.extended_request(0, BLOCK_STATUS, 9, 0, 8 * MIB);
    let mut chunks = Vec::new();
    loop {
        let (flags, kind, cookie, payload) = c.extended_reply();
        assert_eq!((kind, cookie), (6, 9), "BLOCK_STATUS_EXT chunks of request 9");
        let be32 = |at: usize| u32::from_be_bytes(payload[at..at + 4].try_into().unwrap());
        let be64 = |at: usize| u64::from_be_bytes(payload[at..at + 8].try_into().unwrap());
        let extents: Vec<(u64, u64)> = (0..be32(4) as usize).map(|i| (be64(8 + 16 * i), be64(16 + 16 * i))).collect();
        chunks.push((be32(0), extents));
        if flags & 1 != 0 {
            break;
        }
    }
    let (hole, dirty) = (3, 1);
    assert_eq!(
        chunks,
        [
            (0, vec![(MIB, hole), (64 << 10, 0), (3 * MIB - (64 << 10), hole), (MIB, 0), (3 * MIB, hole)]),
            (2, vec![(MIB, 0), (64 << 10, dirty), (7 * MIB - (64 << 10), 0)]),
        ],
        "one chunk per context, in id order, the last one DONE"
    );
    c.extended_request(1 << 3, BLOCK_STATUS, 10, 0, 8 * MIB);
    let (flags, _, _, first) = c.extended_reply();
    let (last, _, _, second) = c.extended_reply();
    assert_eq!((flags, last), (0, 1));
    assert_eq!((first[7], second[7]), (1, 1), "REQ_ONE: one extent in each");
}

/// VmRSS of a process, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

#[test]
fn a_client_that_never_reads_replies_costs_bounded_memory() {
    let dir = Scratch::new("nbd-flood");
    let socket = dir.path("nbd.sock");
    let image = dir.path("disk.img");
    // Data everywhere, so that reads fill their buffers.
    std::fs::write(&image, pattern(9, 64 * MIB as usize)).unwrap();
    let daemon = Daemon::vsd(&dir, &unix_export(&image, &socket, ""));
    let before = rss(daemon.pid());
    let c = RawClient::connect(&socket, "disk", Mode::Simple);
    // 32 MiB reads, many more than the server takes at once, replies
    // unread; the writer blocks once the socket is full, and the daemon's
    // end frees it.
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (mut writer, counter) = (c.s.try_clone().unwrap(), sent.clone());
    std::thread::spawn(move || {
        for cookie in 0u64.. {
            let header = [
                &REQUEST_MAGIC.to_be_bytes()[..],
                &0u16.to_be_bytes(),
                &READ.to_be_bytes(),
                &cookie.to_be_bytes(),
                &0u64.to_be_bytes(),
                &(32 * MIB as u32).to_be_bytes(),
            ]
            .concat();
            if writer.write_all(&header).is_err() {
                return;
            }
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });
    std::thread::sleep(Duration::from_secs(3));
    let sent = sent.load(std::sync::atomic::Ordering::Relaxed);
    assert!(sent >= 64, "the requests went out ({sent})");
    let grown = rss(daemon.pid()).saturating_sub(before);
    // 16 slots of 32 MiB would be 512 MiB; the budget is 64 MiB.
    assert!(grown < 160 * MIB, "RSS grew by {} MiB", grown / MIB);
    nbdinfo_works(&socket, "disk", 64 * MIB);
}

#[test]
fn idle_half_handshaken_connections_do_not_lock_real_clients_out() {
    let dir = Scratch::new("nbd-idle");
    let socket = dir.path("nbd.sock");
    let _daemon = two_exports(&dir, &socket, ",max-connections=4,handshake-max-seconds=2");
    // More idle clients than the server takes; each stops after the greeting.
    let mut idle: Vec<UnixStream> = (0..12).map(|_| UnixStream::connect(&socket).unwrap()).collect();
    let started = Instant::now();
    nbdinfo_works(&socket, "rw", 16 * MIB);
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(12), "a real client got through after {waited:?}");
    // The idle ones were dropped by the handshake timeout.
    for s in &mut idle {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).expect("closed by the server, not left open");
        assert!(rest.len() <= 18, "at most the greeting was sent");
    }
}

#[test]
fn command_line_mistakes_are_one_line_errors_and_leave_no_socket() {
    let dir = Scratch::new("nbd-cli");
    let socket = dir.path("nbd.sock");
    let server = format!("addr.type=unix,addr.path={}", socket.display());
    let node = "driver=null-co,node-name=n0,size=1M";
    let export = "type=nbd,id=e0,node-name=n0";
    let owned = |list: &[&str]| list.iter().map(|a| a.to_string()).collect::<Vec<String>>();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (owned(&["--blockdev", node, "--export", export]), "NBD server not running"),
        (
            owned(&["--nbd-server", &format!("{server},tls-creds=t0"), "--blockdev", node]),
            "No TLS credentials with id 't0'",
        ),
        (
            owned(&["--nbd-server", "addr.type=inet,addr.host=127.0.0.1,addr.port=http", "--blockdev", node]),
            "addr.port",
        ),
        (owned(&["--nbd-server", "addr.type=vsock,addr.cid=3", "--blockdev", node]), "addr.type"),
        (
            owned(&[
                "--nbd-server",
                &server,
                "--blockdev",
                node,
                "--export",
                export,
                "--export",
                "type=nbd,id=e1,node-name=n0",
            ]),
            "already exists",
        ),
        (
            owned(&[
                "--nbd-server",
                &server,
                "--blockdev",
                &format!("{node},read-only=on"),
                "--export",
                &format!("{export},writable=on"),
            ]),
            "read-only",
        ),
        (owned(&["--nbd-server", &server, "--blockdev", node, "--export", &format!("{export},bitmaps=b0")]), "bitmaps"),
    ];
    for (args, culprit) in cases {
        let out = run(common::VSD, &args.iter().map(String::as_str).collect::<Vec<_>>());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(culprit), "{args:?}: expected '{culprit}' in {stderr}");
        assert!(!socket.exists(), "{args:?} left its socket behind");
    }
    std::fs::write(&socket, "not a socket").unwrap();
    let out = run(common::VSD, &["--nbd-server", &server, "--blockdev", node]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a socket"), "{}", text(&out));
    assert_eq!(std::fs::read(&socket).unwrap(), b"not a socket", "a file that is not a socket is never replaced");
}

/// What nbdinfo prints for `name` on `socket`, with the socket's path
/// taken out of the URI.
fn nbdinfo_json(socket: &Path, name: &str, extra: &[&str]) -> String {
    let uri = uri(socket, name);
    let args = [extra, &["--json", &uri]].concat();
    ok("nbdinfo", &args).replace(socket.to_str().unwrap(), "SOCKET")
}

#[test]
fn nbdinfo_sees_vsd_as_it_sees_qemu_storage_daemon() {
    let dir = Scratch::new("nbd-vs-qsd");
    let image = sparse_image(&dir, "disk.img");
    for export_opts in [",writable=on", ""] {
        let mut seen = Vec::new();
        for qsd in [false, true] {
            let socket = dir.path(if qsd { "qsd.sock" } else { "vsd.sock" });
            let args = unix_export(&image, &socket, export_opts);
            let daemon = if qsd { Daemon::qsd(&dir, &args) } else { Daemon::vsd(&dir, &args) };
            let info = nbdinfo_json(&socket, "disk", &[]);
            let list = nbdinfo_json(&socket, "", &["--list"]);
            let map = nbdinfo_json(&socket, "disk", &["--map"]);
            seen.push((info, list, map));
            drop(daemon);
        }
        assert_eq!(seen[0], seen[1], "vsd, then qemu-storage-daemon, with '{export_opts}'");
    }
}

/// A request header: compact (a 32-bit `len`) or extended (64-bit), by
/// its magic.
fn request_header(magic: u32, flags: u16, kind: u16, cookie: u64, offset: u64, len: &[u8]) -> Vec<u8> {
    [
        &magic.to_be_bytes()[..],
        &flags.to_be_bytes(),
        &kind.to_be_bytes(),
        &cookie.to_be_bytes(),
        &offset.to_be_bytes(),
        len,
    ]
    .concat()
}

#[test]
fn allocation_depth_and_allocation_map_as_qemu_storage_daemon_s() {
    let dir = Scratch::new("nbd-depth");
    let (base, top) = (dir.path("base.qcow2"), dir.path("top.qcow2"));
    let (base_s, top_s) = (base.to_str().unwrap(), top.to_str().unwrap());
    ok("qemu-img", &["create", "-q", "-f", "qcow2", base_s, "1M"]);
    ok("qemu-io", &["-f", "qcow2", "-c", "write 0 64k", "-c", "write 512k 64k", base_s]);
    ok("qemu-img", &["create", "-q", "-f", "qcow2", "-b", base_s, "-F", "qcow2", top_s]);
    ok("qemu-io", &["-f", "qcow2", "-c", "write 128k 64k", "-c", "write -z 256k 64k", "-c", "write 512k 64k", top_s]);
    let sparse = dir.image("sparse.img", MIB);
    ok("qemu-io", &["-f", "raw", "-c", "write 64k 64k", sparse.to_str().unwrap()]);
    let maps = |program: fn(&Scratch, &[String]) -> Daemon, name: &str| {
        let socket = dir.path(&format!("{name}.sock"));
        let args: Vec<String> = [
            "--blockdev",
            &format!("driver=file,node-name=f,filename={top_s}"),
            "--blockdev",
            "driver=qcow2,node-name=q,file=f",
            "--blockdev",
            &format!("driver=file,node-name=s,filename={}", sparse.display()),
            "--nbd-server",
            &format!("addr.type=unix,addr.path={}", socket.display()),
            "--export",
            "type=nbd,id=e,node-name=q,name=q,allocation-depth=on",
            "--export",
            "type=nbd,id=e2,node-name=s,name=s,allocation-depth=on",
        ]
        .map(String::from)
        .to_vec();
        let _daemon = program(&dir, &args);
        let mut out = Vec::new();
        for export in ["q", "s"] {
            for map in ["--map=qemu:allocation-depth", "--map=base:allocation"] {
                out.push(ok("nbdinfo", &[map, "--json", &uri(&socket, export)]));
            }
            let listed: Value = serde_json::from_str(&ok("nbdinfo", &["--json", &uri(&socket, export)])).unwrap();
            out.push(listed["exports"][0]["contexts"].to_string());
        }
        out
    };
    let (vsd, qsd) = (maps(Daemon::vsd, "vsd"), maps(Daemon::qsd, "qsd"));
    assert_eq!(vsd, qsd);
    let depths: Value = serde_json::from_str(&vsd[0]).unwrap();
    let types: Vec<u64> = depths.as_array().unwrap().iter().map(|e| e["type"].as_u64().unwrap()).collect();
    assert_eq!(types, [2, 0, 1, 0, 1, 0, 1, 0], "backing, absent, local...: {depths}");
}

/// NBD_CMD_FLAG_FAST_ZERO: a zeroing that the node does without writing
/// zeroes (fallocate on a file, zero clusters of a qcow2 image) succeeds;
/// one that would write (a partial qcow2 cluster over data, a version 2
/// image) fails with ENOTSUP and changes nothing, as qemu-storage-daemon
/// answers the same requests.
#[test]
fn fast_zero_answers_as_qemu_storage_daemon() {
    const FAST_ZERO: u16 = 1 << 4;
    const NO_HOLE: u16 = 1 << 1;
    let answers = |program: &str| {
        let dir = Scratch::new(&format!("nbd-fast-zero-{program}"));
        let raw = dir.path("disk.raw");
        std::fs::write(&raw, pattern(1, 4 * MIB as usize)).unwrap();
        // qemu-storage-daemon wants the server before its exports.
        let mut args =
            vec!["--nbd-server".to_string(), format!("addr.type=unix,addr.path={}", dir.path("nbd.sock").display())];
        for (name, compat) in [("v3", "1.1"), ("v2", "0.10")] {
            let image = dir.path(&format!("{name}.qcow2"));
            let (src, dst) = (raw.to_str().unwrap(), image.to_str().unwrap());
            ok("qemu-img", &["convert", "-q", "-f", "raw", "-O", "qcow2", "-o", &format!("compat={compat}"), src, dst]);
            args.extend([
                "--blockdev".to_string(),
                format!("driver=qcow2,node-name={name},file.driver=file,file.filename={dst}"),
                "--export".into(),
                format!("type=nbd,id=e-{name},node-name={name},name={name},writable=on"),
            ]);
        }
        args.extend([
            "--blockdev".into(),
            format!("driver=file,node-name=raw,filename={}", raw.display()),
            "--export".into(),
            "type=nbd,id=e-raw,node-name=raw,name=raw,writable=on".into(),
        ]);
        let _daemon = if program == "vsd" { Daemon::vsd(&dir, &args) } else { Daemon::qsd(&dir, &args) };
        let mut said = Vec::new();
        for export in ["raw", "v3", "v2"] {
            let mut c = RawClient::connect(&dir.path("nbd.sock"), export, Mode::Simple);
            let requests = [
                (FAST_ZERO, 0, 64 << 10),
                (FAST_ZERO | NO_HOLE, 128 << 10, 64 << 10),
                (FAST_ZERO, (1 << 20) + 4096, 4096),
                (0, (2 << 20) + 4096, 4096),
            ];
            for (cookie, (flags, offset, len)) in requests.into_iter().enumerate() {
                c.request(flags, WRITE_ZEROES, cookie as u64, offset, len, &[]);
                let (error, _) = c.simple_reply();
                c.request(0, READ, 99, offset, len, &[]);
                assert_eq!(c.simple_reply(), (0, 99));
                let zeroed = c.read_exact(len as usize).iter().all(|&b| b == 0);
                said.push(format!("{export} flags {flags:#x} at {offset}: error {error}, zeroed {zeroed}"));
            }
        }
        said
    };
    let vsd = answers("vsd");
    assert!(vsd.iter().any(|line| line.contains("error 95")), "some fast zeroing is refused: {vsd:#?}");
    assert_eq!(vsd, answers("qsd"));
}

/// A raw image of random bytes on tmpfs, whose pages are always in the
/// page cache: what the NBD server splices.
fn cached_image(dir: &Scratch, name: &str, seed: u64, size: u64) -> (std::path::PathBuf, Vec<u8>) {
    let image = dir.path(name);
    let bytes = pattern(seed, size as usize);
    std::fs::write(&image, &bytes).unwrap();
    (image, bytes)
}

/// How many reads of `len` bytes of `image` were spliced whole into a
/// pipe, and whether every byte spliced into a pipe went out of one.
fn spliced_reads(calls: &[common::Splice], image: &Path, len: u64) -> usize {
    calls.iter().filter(|c| c.reads(image) && c.len == len && c.result == Ok(len)).count()
}

fn assert_pipes_drained(calls: &[common::Splice]) {
    let moved = |from_pipe: bool| -> u64 {
        calls.iter().filter(|c| c.drains_pipe() == from_pipe).filter_map(|c| c.result.as_ref().ok()).sum()
    };
    assert_eq!(moved(false), moved(true), "every byte spliced into the pipe went out of it");
}

#[test]
fn page_cached_reads_are_spliced_and_arrive_whole_in_every_reply_mode() {
    let dir = Scratch::new_in(Path::new("/dev/shm"), "nbd-splice");
    let (image, bytes) = cached_image(&dir, "disk.img", 21, 16 * MIB);
    let (socket, log) = (dir.path("nbd.sock"), dir.path("splice.log"));
    let daemon = Daemon::vsd_tracing_splices(&dir, &unix_export(&image, &socket, ""), &log);
    // libnbd: structured replies, compact headers.
    for size in [64 << 10, MIB] {
        let copy = dir.path("copy.img");
        ok("nbdcopy", &[&format!("--request-size={size}"), &uri(&socket, "disk"), copy.to_str().unwrap()]);
        assert!(std::fs::read(&copy).unwrap() == bytes, "nbdcopy's reads of {size} bytes are the image");
    }
    // QEMU's client: extended headers (reads of up to 2 MiB: some too long to splice).
    ok("qemu-img", &["compare", "-f", "raw", "-F", "raw", image.to_str().unwrap(), &uri(&socket, "disk")]);
    // The test's own client, in each mode, 64 KiB and 1 MiB at a time.
    for mode in [Mode::Simple, Mode::Structured, Mode::Extended] {
        let mut c = RawClient::connect(&socket, "disk", mode);
        c.read_all(mode, &bytes, 64 << 10, 16);
        c.read_all(mode, &bytes, MIB as usize, 8);
    }
    daemon.stop_traced();
    let calls = common::splices(&log);
    // nbdcopy's pass and the raw client's three, every read spliced.
    assert!(spliced_reads(&calls, &image, 64 << 10) >= 4 * 256, "64 KiB reads spliced: {calls:?}");
    assert!(spliced_reads(&calls, &image, MIB) >= 4 * 16, "1 MiB reads spliced");
    assert_pipes_drained(&calls);
}

#[test]
fn page_cached_reads_are_spliced_over_tcp() {
    let dir = Scratch::new_in(Path::new("/dev/shm"), "nbd-splice-tcp");
    let (image, bytes) = cached_image(&dir, "disk.img", 22, 16 * MIB);
    let log = dir.path("splice.log");
    let port = free_port();
    let args = vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}", image.display()),
        "--nbd-server".into(),
        format!("addr.type=inet,addr.host=127.0.0.1,addr.port={port}"),
        "--export".into(),
        "type=nbd,id=e0,node-name=f0,name=disk".into(),
    ];
    let daemon = Daemon::vsd_tracing_splices(&dir, &args, &log);
    let tcp = format!("nbd://127.0.0.1:{port}/disk");
    let copy = dir.path("copy.img");
    ok("nbdcopy", &["--request-size=65536", &tcp, copy.to_str().unwrap()]);
    assert!(std::fs::read(&copy).unwrap() == bytes, "nbdcopy's copy over TCP is the image");
    ok("qemu-img", &["convert", "-f", "raw", "-O", "raw", &tcp, copy.to_str().unwrap()]);
    assert!(std::fs::read(&copy).unwrap() == bytes, "qemu-img's copy over TCP is the image");
    daemon.stop_traced();
    let calls = common::splices(&log);
    assert!(spliced_reads(&calls, &image, 64 << 10) >= 256, "64 KiB reads spliced: {calls:?}");
    assert_pipes_drained(&calls);
}

#[test]
fn direct_uncached_and_qcow2_reads_are_not_spliced_and_still_right() {
    use std::os::fd::AsFd;
    let shm = Scratch::new_in(Path::new("/dev/shm"), "nbd-splice-not");
    // On a disk's file system (the temporary directory), which O_DIRECT needs.
    let disk = Scratch::new("nbd-splice-not");
    let (cached, cached_bytes) = cached_image(&shm, "cached.img", 23, 8 * MIB);
    let (direct, direct_bytes) = cached_image(&disk, "direct.img", 24, 8 * MIB);
    let (cold, cold_bytes) = cached_image(&disk, "cold.img", 25, 8 * MIB);
    let qcow2 = shm.path("disk.qcow2");
    ok("qemu-img", &["convert", "-f", "raw", "-O", "qcow2", cached.to_str().unwrap(), qcow2.to_str().unwrap()]);
    let (socket, log) = (shm.path("nbd.sock"), shm.path("splice.log"));
    let node = |name: &str, image: &Path, opts: &str| {
        ["--blockdev".into(), format!("driver=file,node-name={name},filename={}{opts}", image.display())]
    };
    let mut args: Vec<String> = [
        node("fc", &cached, ""),
        node("fd", &direct, ",cache.direct=on"),
        node("fu", &cold, ""),
        node("fq", &qcow2, ""),
    ]
    .concat();
    args.extend(["--blockdev".into(), "driver=qcow2,node-name=q,file=fq".into()]);
    args.extend(["--nbd-server".into(), format!("addr.type=unix,addr.path={}", socket.display())]);
    for (id, name) in [("e0", "fc"), ("e1", "fd"), ("e2", "fu"), ("e3", "q")] {
        args.extend(["--export".into(), format!("type=nbd,id={id},node-name={name}")]);
    }
    let daemon = Daemon::vsd_tracing_splices(&shm, &args, &log);
    let qcow2_bytes = cached_bytes.clone();
    for (export, bytes) in [("fc", &cached_bytes), ("fd", &direct_bytes), ("q", &qcow2_bytes)] {
        for size in ["65536", "1048576"] {
            let copy = shm.path("copy.img");
            ok("nbdcopy", &[&format!("--request-size={size}"), &uri(&socket, export), copy.to_str().unwrap()]);
            assert!(std::fs::read(&copy).unwrap() == *bytes, "export {export}, reads of {size}");
        }
    }
    // Its pages out of the page cache: the first read of them cannot be
    // spliced (it would wait for the disk); it brings them in, the second can.
    let file = std::fs::File::open(&cold).unwrap();
    file.sync_all().unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
    // SAFETY: posix_fadvise reads no memory of ours; the file keeps fd open.
    let advised = unsafe { libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(advised, 0);
    assert!(!vsd_sys::fully_cached(file.as_fd(), 0, MIB).unwrap(), "the pages were dropped");
    let mut c = RawClient::connect(&socket, "fu", Mode::Structured);
    c.read_all(Mode::Structured, &cold_bytes[..MIB as usize], MIB as usize, 1);
    c.read_all(Mode::Structured, &cold_bytes[..MIB as usize], MIB as usize, 1);
    drop(c);
    daemon.stop_traced();
    let calls = common::splices(&log);
    assert!(spliced_reads(&calls, &cached, MIB) >= 8, "the page-cached raw file's reads were: {calls:?}");
    for image in [&direct, &qcow2] {
        assert!(!calls.iter().any(|c| c.reads(image)), "{} spliced: {calls:?}", image.display());
    }
    let cold_reads: Vec<_> = calls.iter().filter(|c| c.reads(&cold)).collect();
    assert_eq!(cold_reads.len(), 1, "only the second read of the dropped pages: {cold_reads:?}");
    assert_eq!((cold_reads[0].offset, cold_reads[0].result.clone()), (Some(0), Ok(MIB)));
    assert_pipes_drained(&calls);
}

#[test]
fn a_slow_reader_gets_long_spliced_replies_whole_among_others() {
    let dir = Scratch::new_in(Path::new("/dev/shm"), "nbd-splice-slow");
    let (image, bytes) = cached_image(&dir, "disk.img", 26, 32 * MIB);
    let (socket, log, qmp_socket) = (dir.path("nbd.sock"), dir.path("splice.log"), dir.path("qmp.sock"));
    let mut args = unix_export(&image, &socket, "");
    args.extend(common::monitor(&qmp_socket));
    let daemon = Daemon::vsd_tracing_splices(&dir, &args, &log);
    // 1 MiB (spliced), 4 KiB (too short: read into a buffer), 200000 bytes
    // at an odd offset (spliced), and 1 MiB at an odd offset (its pages one
    // more than the pipe holds: buffered): more than the server's 16 slots.
    let mut requests = Vec::new();
    for i in 0..12u64 {
        requests.push((i * MIB, MIB as usize));
        requests.push((i * MIB + 777 * 512, 4096));
        requests.push((12345 + i * 1_000_003, 200_000));
    }
    requests.push((20 * MIB + 100, MIB as usize));
    for mode in [Mode::Simple, Mode::Structured] {
        let mut c = RawClient::connect(&socket, "disk", mode);
        for (cookie, &(at, n)) in requests.iter().enumerate() {
            c.read_request(mode, cookie as u64, at, n as u32);
        }
        // The replies fill the socket, then wait in the pipe and the slots.
        std::thread::sleep(Duration::from_millis(300));
        let mut seen = vec![false; requests.len()];
        for _ in 0..requests.len() {
            std::thread::sleep(Duration::from_millis(20));
            let (cookie, data) = c.read_reply(mode, |cookie| requests[cookie as usize].1);
            let (at, n) = requests[cookie as usize];
            assert!(data == bytes[at as usize..at as usize + n], "{n} bytes at {at} ({})", mode_name(mode));
            assert!(!std::mem::replace(&mut seen[cookie as usize], true), "cookie {cookie} twice");
        }
    }
    // Spliced or not, every read counts, with its bytes.
    let mut qmp = QmpClient::connect(&qmp_socket).unwrap();
    let stats = qmp.execute("query-blockstats", Value::Null).unwrap();
    let entry = stats.as_array().unwrap().iter().find(|e| e["qdev"] == "e0").unwrap().clone();
    let read: usize = requests.iter().map(|&(_, n)| n).sum();
    let counted = (&entry["stats"]["rd_operations"], &entry["stats"]["rd_bytes"]);
    assert_eq!(counted, (&json!(2 * requests.len()), &json!(2 * read)), "{entry}");
    drop(qmp);
    daemon.stop_traced();
    let calls = common::splices(&log);
    assert_eq!(spliced_reads(&calls, &image, MIB), 2 * 12, "the aligned 1 MiB reads: {calls:?}");
    assert_eq!(spliced_reads(&calls, &image, 200_000), 2 * 12, "the odd 200000-byte reads");
    assert!(!calls.iter().any(|c| c.reads(&image) && c.len == 4096), "4 KiB reads are not spliced");
    let held = calls.iter().filter(|c| c.drains_pipe() && c.result != Ok(c.len)).count();
    assert!(held > 0, "the socket was full: the rest of a reply waited in the pipe");
    assert_pipes_drained(&calls);
}
