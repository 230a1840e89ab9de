//! Streams (`block-stream`): an overlay takes in its backing chain while a
//! vhost-user client writes on, and qemu-img finds the images as QEMU
//! would leave them (the header's backing file, clean, the same
//! contents); the answers and events are qemu-storage-daemon's.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::qmp::Qmp;
use common::{Daemon, Scratch, monitor, ok, run};
use serde_json::{Value, json};
use vsd_bench::ClientOptions;

const MIB: u64 = 1 << 20;
const BLOCK: u64 = 4096;
const SIZE: u64 = 16 * MIB;

/// A chain base <- mid <- top of qcow2 images: base holds 0x11 all over,
/// mid 0x22 in its second MiB, top 0x33 in its fourth; returns the paths.
fn chain(dir: &Scratch) -> [PathBuf; 3] {
    let [base, mid, top] = ["base", "mid", "top"].map(|n| dir.path(&format!("{n}.qcow2")));
    let s = |p: &Path| p.to_str().unwrap().to_string();
    ok("qemu-img", &["create", "-q", "-f", "qcow2", &s(&base), &SIZE.to_string()]);
    ok("qemu-img", &["create", "-q", "-f", "qcow2", "-b", &s(&base), "-F", "qcow2", &s(&mid)]);
    ok("qemu-img", &["create", "-q", "-f", "qcow2", "-b", &s(&mid), "-F", "qcow2", &s(&top)]);
    for (image, command) in [
        (&base, format!("write -P 0x11 0 {SIZE}")),
        (&mid, format!("write -P 0x22 {MIB} {MIB}")),
        (&top, format!("write -P 0x33 {} {MIB}", 3 * MIB)),
    ] {
        ok("qemu-io", &["-f", "qcow2", "-c", &command, &s(image)]);
    }
    [base, mid, top]
}

/// What the chain reads at `at` before any client writes.
fn chain_byte(at: u64) -> u8 {
    match at / MIB {
        1 => 0x22,
        3 => 0x33,
        _ => 0x11,
    }
}

/// `--blockdev`s naming each image of [`chain`] (`base`, `mid`, `top`).
fn chain_nodes(images: &[PathBuf; 3]) -> Vec<String> {
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

/// vsd serving node `top` of `images` over vhost-user, with a monitor.
fn served(dir: &Scratch, images: &[PathBuf; 3]) -> (Daemon, Qmp) {
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

/// A client writing 4 KiB blocks all over the disk until told to stop,
/// then flushing; returns what each block it wrote holds last.
fn writer(daemon: &Daemon, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<HashMap<u64, u8>> {
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    std::thread::spawn(move || {
        let _client = client;
        let mut last = HashMap::new();
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let block = (n * 7919) % (SIZE / BLOCK);
            let byte = (n % 100) as u8 + 0x40;
            queue.write_at(block * BLOCK, &[byte; BLOCK as usize]).unwrap();
            last.insert(block, byte);
            n += 1;
        }
        queue.flush().unwrap();
        last
    })
}

fn info(image: &Path) -> Value {
    serde_json::from_str(&ok("qemu-img", &["info", "--output=json", "-U", image.to_str().unwrap()])).unwrap()
}

/// `qemu-img check` finds nothing wrong.
fn assert_clean(image: &Path) {
    let check = run("qemu-img", &["check", image.to_str().unwrap()]);
    assert!(check.status.success(), "{}: {}", image.display(), String::from_utf8_lossy(&check.stdout));
}

/// The first byte `image` (read through its chain) holds that `expect` does not.
fn first_mismatch(dir: &Scratch, image: &Path, expect: impl Fn(u64) -> u8) -> Option<(u64, u8, u8)> {
    let raw = dir.path("flat.raw");
    ok("qemu-img", &["convert", "-O", "raw", image.to_str().unwrap(), raw.to_str().unwrap()]);
    let data = std::fs::read(&raw).unwrap();
    (0..data.len() as u64).map(|at| (at, data[at as usize], expect(at))).find(|(_, got, want)| got != want)
}

#[test]
fn a_stream_to_a_base_keeps_every_write_and_names_the_base_in_the_header() {
    let dir = Scratch::new("stream-base");
    let images = chain(&dir);
    let (daemon, mut qmp) = served(&dir, &images);
    let stop = Arc::new(AtomicBool::new(false));
    let writing = writer(&daemon, stop.clone());
    std::thread::sleep(Duration::from_millis(100));
    qmp.ok("block-stream", json!({"job-id": "s", "device": "top", "base-node": "base"}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "s"}));
    assert!(done.get("error").is_none(), "{done}");
    assert_eq!((done["len"].as_u64(), done["offset"].as_u64()), (Some(SIZE), Some(SIZE)), "{done}");
    // The middle image is no longer used: it can go while the client writes.
    qmp.ok("blockdev-del", json!({"node-name": "mid"}));
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, Ordering::Relaxed);
    let last = writing.join().unwrap();
    daemon.stop();
    let top_info = info(&images[2]);
    assert_eq!(top_info["backing-filename"], json!(images[0].to_str().unwrap()), "{top_info}");
    assert_eq!(top_info["backing-filename-format"], "qcow2", "{top_info}");
    images.iter().for_each(|image| assert_clean(image));
    let expect = |at: u64| last.get(&(at / BLOCK)).copied().unwrap_or_else(|| chain_byte(at));
    assert_eq!(first_mismatch(&dir, &images[2], expect), None, "top over base reads every write and the chain");
    // What top took in is its own now: over an empty base it still reads
    // mid's data, and base's only in clusters a write copied up.
    std::fs::remove_file(&images[0]).unwrap();
    ok("qemu-img", &["create", "-q", "-f", "qcow2", images[0].to_str().unwrap(), &SIZE.to_string()]);
    const CLUSTER: u64 = 65536;
    let written: std::collections::HashSet<u64> = last.keys().map(|block| block * BLOCK / CLUSTER).collect();
    let own = |at: u64| match last.get(&(at / BLOCK)) {
        Some(&byte) => byte,
        None if at / MIB == 1 || at / MIB == 3 || written.contains(&(at / CLUSTER)) => chain_byte(at),
        None => 0,
    };
    assert_eq!(first_mismatch(&dir, &images[2], own), None, "top holds what mid held");
}

#[test]
fn a_stream_of_the_whole_chain_leaves_a_standalone_image() {
    let dir = Scratch::new("stream-all");
    let images = chain(&dir);
    let (daemon, mut qmp) = served(&dir, &images);
    let stop = Arc::new(AtomicBool::new(false));
    let writing = writer(&daemon, stop.clone());
    qmp.ok("block-stream", json!({"job-id": "s", "device": "top", "speed": 64 * MIB}));
    let jobs = qmp.ok("query-block-jobs", json!({}));
    assert_eq!((jobs[0]["device"].clone(), jobs[0]["type"].clone()), (json!("s"), json!("stream")), "{jobs}");
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "s"}));
    assert!(done.get("error").is_none(), "{done}");
    stop.store(true, Ordering::Relaxed);
    let last = writing.join().unwrap();
    daemon.stop();
    let top_info = info(&images[2]);
    assert!(top_info.get("backing-filename").is_none(), "{top_info}");
    assert_clean(&images[2]);
    let expect = |at: u64| last.get(&(at / BLOCK)).copied().unwrap_or_else(|| chain_byte(at));
    assert_eq!(first_mismatch(&dir, &images[2], expect), None);
}

/// One step of the differential script.
enum Step {
    Command(&'static str, Value),
    /// Waits for an event (name, data members).
    Await(&'static str, Value),
}

use Step::{Await, Command};

fn differential_script() -> Vec<Step> {
    let null = |id: &str| json!({"id": id, "status": "null"});
    vec![
        Command("block-stream", json!({"device": "nope"})),
        Command("block-stream", json!({"device": "top", "base": "x", "base-node": "base"})),
        Command("block-stream", json!({"device": "top", "base-node": "nope"})),
        Command("block-stream", json!({"device": "mid", "base-node": "top"})),
        Command("block-stream", json!({"device": "top", "backing-file": "x"})),
        Command("block-stream", json!({"device": "top", "base": "nope.qcow2"})),
        Command("block-stream", json!({"job-id": "1s", "device": "top"})),
        Command("block-stream", json!({"device": "top", "base-node": "base"})),
        // Slow, then cancelled.
        Command("block-stream", json!({"job-id": "s1", "device": "top", "base-node": "base", "speed": 1})),
        Command("block-stream", json!({"job-id": "s2", "device": "top", "base-node": "base"})),
        Command("block-job-cancel", json!({"device": "s1"})),
        Await("JOB_STATUS_CHANGE", null("s1")),
        // Finalized and dismissed by hand.
        Command(
            "block-stream",
            json!({"job-id": "s3", "device": "top", "base-node": "base", "auto-finalize": false, "auto-dismiss": false}),
        ),
        Await("BLOCK_JOB_PENDING", json!({"id": "s3"})),
        Command("query-block-jobs", json!({})),
        Command("job-finalize", json!({"id": "s3"})),
        Await("JOB_STATUS_CHANGE", json!({"id": "s3", "status": "concluded"})),
        Command("job-dismiss", json!({"id": "s3"})),
        Command("blockdev-del", json!({"node-name": "mid"})),
    ]
}

/// Paused and running flap around QEMU's drained sections; how far a job
/// cancelled while copying came depends on when the cancel arrived.
fn stable(events: Vec<Value>) -> Vec<Value> {
    let flapping = |e: &Value| matches!(e[1]["status"].as_str(), Some("paused" | "running"));
    let timeless = |mut e: Value| {
        if e[0] == "BLOCK_JOB_CANCELLED" {
            let data = e[1].as_object_mut().unwrap();
            data.remove("offset");
        }
        e
    };
    events.into_iter().filter(|e| !flapping(e)).map(timeless).collect()
}

#[test]
fn stream_commands_answer_and_notify_as_qemu_storage_daemon_does() {
    let script = differential_script();
    let run_script = |program: fn(&Scratch, &[String]) -> Daemon, name: &str| {
        let dir = Scratch::new(name);
        let images = chain(&dir);
        let mut args = chain_nodes(&images);
        args.extend(monitor(&dir.path("qmp.sock")));
        let _daemon = program(&dir, &args);
        let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
        let mut answers = Vec::new();
        for step in &script {
            match step {
                Command(command, args) => answers.push(qmp.answer(command, args.clone())),
                Await(event, data) => drop(qmp.await_event(event, data.clone())),
            }
        }
        (answers, stable(qmp.event_log()))
    };
    let (vsd, qsd) = (run_script(Daemon::vsd, "stream-qmp-vsd"), run_script(Daemon::qsd, "stream-qmp-qsd"));
    let commands = script.iter().filter_map(|s| match s {
        Command(command, args) => Some((command, args)),
        Await(..) => None,
    });
    for ((command, args), (ours, theirs)) in commands.zip(vsd.0.iter().zip(&qsd.0)) {
        assert_eq!(ours, theirs, "{command} {args}");
    }
    for (at, (ours, theirs)) in vsd.1.iter().zip(&qsd.1).enumerate() {
        assert_eq!(ours, theirs, "event {at}; vsd's: {:#?}", &vsd.1);
    }
    assert_eq!(vsd.1.len(), qsd.1.len(), "as many events");
}
