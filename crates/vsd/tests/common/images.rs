//! What the job tests share: a qcow2 chain with known contents, a client
//! that writes on through a job and remembers what it wrote, and checks
//! of the images left behind.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::Value;
use vsd_bench::ClientOptions;

use super::qmp::Qmp;
use super::{Daemon, Scratch, monitor, ok, run};

pub const MIB: u64 = 1 << 20;
/// The writer's unit.
pub const BLOCK: u64 = 4096;
/// The size of every image of [`qcow2_chain`].
pub const CHAIN_SIZE: u64 = 16 * MIB;

/// A chain base <- mid <- top of qcow2 images in `dir`: base holds 0x11
/// all over, mid 0x22 in its second MiB, top 0x33 in its fourth
/// ([`chain_byte`]); returns their paths.
pub fn qcow2_chain(dir: &Scratch) -> [PathBuf; 3] {
    let [base, mid, top] = ["base", "mid", "top"].map(|n| dir.path(&format!("{n}.qcow2")));
    let s = |p: &Path| p.to_str().unwrap().to_string();
    ok("qemu-img", &["create", "-q", "-f", "qcow2", &s(&base), &CHAIN_SIZE.to_string()]);
    ok("qemu-img", &["create", "-q", "-f", "qcow2", "-b", &s(&base), "-F", "qcow2", &s(&mid)]);
    ok("qemu-img", &["create", "-q", "-f", "qcow2", "-b", &s(&mid), "-F", "qcow2", &s(&top)]);
    let writes = [
        (&base, format!("write -P 0x11 0 {CHAIN_SIZE}")),
        (&mid, format!("write -P 0x22 {MIB} {MIB}")),
        (&top, format!("write -P 0x33 {} {MIB}", 3 * MIB)),
    ];
    for (image, command) in writes {
        ok("qemu-io", &["-f", "qcow2", "-c", &command, &s(image)]);
    }
    [base, mid, top]
}

/// What the chain of [`qcow2_chain`] reads at `at`.
pub fn chain_byte(at: u64) -> u8 {
    match at / MIB {
        1 => 0x22,
        3 => 0x33,
        _ => 0x11,
    }
}

/// `--blockdev`s naming each image of [`qcow2_chain`]: nodes `base`,
/// `mid` and `top`, each over a file node (`base-file`...).
pub fn chain_nodes(images: &[PathBuf; 3]) -> Vec<String> {
    let mut args = Vec::new();
    let mut below: Option<&str> = None;
    for (name, image) in ["base", "mid", "top"].iter().zip(images) {
        // base names no backing file in its header.
        let backing = below.map_or(String::new(), |b| format!(",backing={b}"));
        args.extend([
            "--blockdev".into(),
            format!("driver=file,node-name={name}-file,filename={}", image.display()),
            "--blockdev".into(),
            format!("driver=qcow2,node-name={name},file={name}-file{backing}"),
        ]);
        below = Some(name);
    }
    args
}

/// vsd serving node `top` of `images` ([`qcow2_chain`]) over vhost-user
/// (export `v0`), with a monitor.
pub fn served_chain(dir: &Scratch, images: &[PathBuf; 3]) -> (Daemon, Qmp) {
    let mut args = chain_nodes(images);
    args.extend([
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=v0,node-name=top,writable=on,addr.type=unix,addr.path={}",
            dir.path("vhost.sock").display()
        ),
    ]);
    args.extend(monitor(&dir.path("qmp.sock")));
    let daemon = Daemon::vsd(dir, &args);
    let qmp = Qmp::connect(&dir.path("qmp.sock"));
    (daemon, qmp)
}

/// A client writing 4 KiB blocks round the first `blocks` of the disk
/// until told to stop, then flushing; it remembers what each block it
/// wrote holds last.
pub struct Writer {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<HashMap<u64, u8>>,
}

impl Writer {
    /// Starts writing through `daemon`'s export, pausing `pause` between
    /// writes, as a guest does: a writer that dirties faster than a
    /// mirror copies keeps it from ever being in sync (QEMU's too).
    pub fn start(daemon: &Daemon, blocks: u64, pause: Duration) -> Self {
        let mut client = daemon.connect(ClientOptions::default());
        let mut queue = client.take_queue(0).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::spawn(move || {
            let _client = client;
            let mut last = HashMap::new();
            let mut n = 0u64;
            while !stopping.load(Ordering::Relaxed) {
                // A stride that visits every block, not in order.
                let block = (n * 7919) % blocks;
                let byte = (n % 150) as u8 + 0x40;
                queue.write_at(block * BLOCK, &[byte; BLOCK as usize]).unwrap();
                last.insert(block, byte);
                n += 1;
                std::thread::sleep(pause);
            }
            queue.flush().unwrap();
            last
        });
        Self { stop, thread }
    }

    /// Stops, and returns what each block written holds last.
    pub fn finish(self) -> HashMap<u64, u8> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

/// The first byte of the raw file `image` that is not what `expect` says:
/// its offset, what it holds, what was expected.
pub fn first_mismatch(image: &Path, expect: impl Fn(u64) -> u8) -> Option<(u64, u8, u8)> {
    let data = std::fs::read(image).unwrap();
    (0..data.len() as u64).map(|at| (at, data[at as usize], expect(at))).find(|(_, got, want)| got != want)
}

/// As [`first_mismatch`], for what `image` reads through its chain
/// (converted to raw in `dir` first).
pub fn first_mismatch_read(dir: &Scratch, image: &Path, expect: impl Fn(u64) -> u8) -> Option<(u64, u8, u8)> {
    let raw = dir.path("flat.raw");
    ok("qemu-img", &["convert", "-O", "raw", image.to_str().unwrap(), raw.to_str().unwrap()]);
    first_mismatch(&raw, expect)
}

/// `qemu-img info` of `image`, parsed.
pub fn info(image: &Path) -> Value {
    serde_json::from_str(&ok("qemu-img", &["info", "--output=json", "-U", image.to_str().unwrap()])).unwrap()
}

/// `qemu-img check` finds nothing wrong with `image`.
pub fn assert_clean(image: &Path) {
    let check = run("qemu-img", &["check", image.to_str().unwrap()]);
    assert!(check.status.success(), "{}: {}", image.display(), String::from_utf8_lossy(&check.stdout));
}

/// After a crash: `qemu-img check` finds `image` consistent (leaked
/// clusters, exit status 3, are allowed: QEMU calls them harmless), once
/// the killed daemon's locks are gone.
pub fn assert_consistent(image: &Path) {
    super::wait_until_unlocked(image);
    let check = run("qemu-img", &["check", image.to_str().unwrap()]);
    let report = String::from_utf8_lossy(&check.stdout).to_string() + &String::from_utf8_lossy(&check.stderr);
    assert!(matches!(check.status.code(), Some(0 | 3)), "{}: {report}", image.display());
    assert!(!report.contains("ERROR"), "{}: {report}", image.display());
}

/// After an active commit of [`qcow2_chain`]'s top into its base, with
/// the export moved onto the base: the overlays are used by nothing and
/// go, every image is clean once `daemon` stops, and the base holds the
/// chain and `last` (what each block written holds last).
pub fn assert_committed(qmp: &mut Qmp, daemon: Daemon, dir: &Scratch, images: &[PathBuf; 3], last: &HashMap<u64, u8>) {
    for node in ["top", "top-file", "mid", "mid-file"] {
        qmp.ok("blockdev-del", serde_json::json!({"node-name": node}));
    }
    daemon.stop();
    images.iter().for_each(|image| assert_clean(image));
    let expect = |at: u64| last.get(&(at / BLOCK)).copied().unwrap_or_else(|| chain_byte(at));
    assert_eq!(first_mismatch_read(dir, &images[0], expect), None, "the base holds the chain and every write");
}

/// `start`ed in `dir` (vsd or qemu-storage-daemon) with the nodes of
/// [`chain_nodes`], those named in `read_only` opened read-only, and a
/// monitor.
pub fn chain_with_read_only(
    start: fn(&Scratch, &[String]) -> Daemon,
    dir: &Scratch,
    images: &[PathBuf; 3],
    read_only: &[&str],
) -> (Daemon, Qmp) {
    let opened = |arg: String| match read_only.iter().any(|n| arg.starts_with(&format!("driver=qcow2,node-name={n},")))
    {
        true => format!("{arg},read-only=on"),
        false => arg,
    };
    let mut args: Vec<String> = chain_nodes(images).into_iter().map(opened).collect();
    args.extend(monitor(&dir.path("qmp.sock")));
    let daemon = start(dir, &args);
    let qmp = Qmp::connect(&dir.path("qmp.sock"));
    (daemon, qmp)
}

/// Whether node `name` is read-only, as `query-named-block-nodes` says.
pub fn node_read_only(qmp: &mut Qmp, name: &str) -> bool {
    let nodes = qmp.ok("query-named-block-nodes", serde_json::json!({"flat": true}));
    let node = nodes.as_array().unwrap().iter().find(|n| n["node-name"] == name).cloned();
    node.and_then(|n| n["ro"].as_bool()).unwrap_or_else(|| panic!("no {name} in {nodes}"))
}
