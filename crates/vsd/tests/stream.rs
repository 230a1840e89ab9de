//! Streams (`block-stream`): an overlay takes in its backing chain while a
//! vhost-user client writes on, and qemu-img finds the images as QEMU
//! would leave them (the header's backing file, clean, the same
//! contents); the answers and events are qemu-storage-daemon's.

mod common;

use std::path::Path;
use std::time::Duration;

use common::images::{
    BLOCK, CHAIN_SIZE, MIB, Writer, assert_clean, chain_byte, chain_nodes, chain_with_read_only, first_mismatch_read,
    info, node_read_only, qcow2_chain, served_chain,
};
use common::{Daemon, Scratch, ok};
use serde_json::{Value, json};

const SIZE: u64 = CHAIN_SIZE;

#[test]
fn a_stream_to_a_base_keeps_every_write_and_names_the_base_in_the_header() {
    let dir = Scratch::new("stream-base");
    let images = qcow2_chain(&dir);
    let (daemon, mut qmp) = served_chain(&dir, &images);
    let writing = Writer::start(&daemon, SIZE / BLOCK, Duration::ZERO);
    std::thread::sleep(Duration::from_millis(100));
    qmp.ok("block-stream", json!({"job-id": "s", "device": "top", "base-node": "base"}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "s"}));
    assert!(done.get("error").is_none(), "{done}");
    assert_eq!((done["len"].as_u64(), done["offset"].as_u64()), (Some(SIZE), Some(SIZE)), "{done}");
    // The middle image is no longer used: it can go while the client writes.
    qmp.ok("blockdev-del", json!({"node-name": "mid"}));
    std::thread::sleep(Duration::from_millis(100));
    let last = writing.finish();
    daemon.stop();
    let top_info = info(&images[2]);
    assert_eq!(top_info["backing-filename"], json!(images[0].to_str().unwrap()), "{top_info}");
    assert_eq!(top_info["backing-filename-format"], "qcow2", "{top_info}");
    images.iter().for_each(|image| assert_clean(image));
    let expect = |at: u64| last.get(&(at / BLOCK)).copied().unwrap_or_else(|| chain_byte(at));
    assert_eq!(first_mismatch_read(&dir, &images[2], expect), None, "top over base reads every write and the chain");
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
    assert_eq!(first_mismatch_read(&dir, &images[2], own), None, "top holds what mid held");
}

#[test]
fn a_stream_of_the_whole_chain_leaves_a_standalone_image() {
    let dir = Scratch::new("stream-all");
    let images = qcow2_chain(&dir);
    let (daemon, mut qmp) = served_chain(&dir, &images);
    let writing = Writer::start(&daemon, SIZE / BLOCK, Duration::ZERO);
    qmp.ok("block-stream", json!({"job-id": "s", "device": "top", "speed": 64 * MIB}));
    let jobs = qmp.ok("query-block-jobs", json!({}));
    assert_eq!((jobs[0]["device"].clone(), jobs[0]["type"].clone()), (json!("s"), json!("stream")), "{jobs}");
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "s"}));
    assert!(done.get("error").is_none(), "{done}");
    let last = writing.finish();
    daemon.stop();
    let top_info = info(&images[2]);
    assert!(top_info.get("backing-filename").is_none(), "{top_info}");
    assert_clean(&images[2]);
    let expect = |at: u64| last.get(&(at / BLOCK)).copied().unwrap_or_else(|| chain_byte(at));
    assert_eq!(first_mismatch_read(&dir, &images[2], expect), None);
}

use common::script::Step::{self, Await, Command};

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
        // 'bottom': a node of the chain, not a filter, alone.
        Command("block-stream", json!({"device": "top", "bottom": "nope"})),
        Command("block-stream", json!({"device": "top", "bottom": "thr"})),
        Command("block-stream", json!({"device": "top", "bottom": "base-file"})),
        Command("block-stream", json!({"device": "mid", "bottom": "top"})),
        Command("block-stream", json!({"device": "top", "bottom": "mid", "base": "base.qcow2"})),
        Command("block-stream", json!({"device": "top", "bottom": "mid", "base-node": "base"})),
        Command("block-stream", json!({"device": "top", "bottom": "mid", "backing-file": "x"})),
        // Nothing between the overlay and its base: nothing to count.
        Command("block-stream", json!({"job-id": "s0", "device": "top", "base-node": "mid"})),
        Await("JOB_STATUS_CHANGE", null("s0")),
        // Slow, then cancelled.
        Command("block-stream", json!({"job-id": "s1", "device": "top", "base-node": "base", "speed": 1})),
        Command("block-stream", json!({"job-id": "s2", "device": "top", "base-node": "base"})),
        Command("block-stream", json!({"job-id": "s2", "device": "top", "bottom": "top"})),
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
        // The chain's last image as the bottom: all of it comes up.
        Command(
            "block-stream",
            json!({"job-id": "s4", "device": "top", "bottom": "base", "backing-mask-protocol": true}),
        ),
        Await("JOB_STATUS_CHANGE", null("s4")),
        Command("blockdev-del", json!({"node-name": "base"})),
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
    let setup = |dir: &Scratch| {
        let mut args = chain_nodes(&qcow2_chain(dir));
        // A filter, which 'bottom' refuses.
        args.extend(
            ["--object", "throttle-group,id=g", "--blockdev", "driver=null-co,node-name=null"].map(String::from),
        );
        args.extend(["--blockdev", "driver=throttle,node-name=thr,file=null,throttle-group=g"].map(String::from));
        args
    };
    common::script::assert_same_as_qsd("stream-qmp", &setup, &differential_script(), stable);
}

/// vsd killed in the middle of a stream: every image stays consistent and
/// the overlay, still over its chain, reads what the guest flushed (start
/// vsd and the stream again).
#[test]
fn a_kill_during_a_stream_leaves_every_image_consistent() {
    let dir = Scratch::new("stream-kill");
    let images = qcow2_chain(&dir);
    let (daemon, mut qmp) = served_chain(&dir, &images);
    // Over the first quarter only: however fast the writer, the overlay
    // then lacks the rest, which the stream is still copying when killed.
    let last = Writer::start(&daemon, SIZE / BLOCK / 4, Duration::ZERO);
    std::thread::sleep(Duration::from_millis(200));
    let last = last.finish();
    qmp.ok("block-stream", json!({"job-id": "s", "device": "top", "speed": 2 * MIB}));
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(qmp.ok("query-block-jobs", json!({}))[0]["status"], "running", "killed while copying");
    daemon.kill();
    images.iter().for_each(|image| common::images::assert_consistent(image));
    assert_eq!(info(&images[2])["backing-filename"], json!(images[1].to_str().unwrap()), "the header is unchanged");
    let expect = |at: u64| last.get(&(at / BLOCK)).copied().unwrap_or_else(|| chain_byte(at));
    assert_eq!(first_mismatch_read(&dir, &images[2], expect), None, "the overlay reads what was flushed");
}

/// A raw image opened as file node `base`, under a pair of qcow2 overlays
/// `mid{i}` <- `top{i}` for each of the `pairs`, all in `dir`.
fn pairs_over_a_file_node(dir: &Path, pairs: usize) -> Vec<String> {
    let base = dir.join("base.img");
    std::fs::File::create(&base).unwrap().set_len(SIZE).unwrap();
    let mut args = vec!["--blockdev".to_string(), format!("driver=file,node-name=base,filename={}", base.display())];
    for i in 0..pairs {
        let (mid, top) = (dir.join(format!("mid{i}.qcow2")), dir.join(format!("top{i}.qcow2")));
        for (image, below, format) in [(&mid, &base, "raw"), (&top, &mid, "qcow2")] {
            let (image, below) = (image.to_str().unwrap(), below.to_str().unwrap());
            ok("qemu-img", &["create", "-q", "-f", "qcow2", "-b", below, "-F", format, image]);
        }
        let node = |name: &str, image: &Path, backing: &str| {
            let file = format!("driver=file,node-name={name}{i}-file,filename={}", image.display());
            [
                "--blockdev".into(),
                file,
                "--blockdev".into(),
                format!("driver=qcow2,node-name={name}{i},file={name}{i}-file,backing={backing}"),
            ]
        };
        args.extend(node("mid", &mid, "base"));
        args.extend(node("top", &top, &format!("mid{i}")));
    }
    args
}

/// Runs each of `jobs` (a command, its arguments, and the backing format
/// QEMU names in the header) on vsd and on qemu-storage-daemon, job `i`
/// leaving `top{i}` of [`pairs_over_a_file_node`] over file node `base`;
/// asserts the same answers and events, and that every header names the
/// base in the format given.
fn assert_headers_as_qsd(name: &str, jobs: &[(&'static str, Value, &str)]) {
    let mut script = Vec::new();
    for (at, (command, args, _)) in jobs.iter().enumerate() {
        let id = format!("j{at}");
        let mut args = args.clone();
        args["job-id"] = json!(id);
        script.push(Command(command, args));
        script.push(Await("JOB_STATUS_CHANGE", json!({"id": id, "status": "null"})));
    }
    // The images outlive each daemon's scratch directory: vsd's run first, then QEMU's.
    let kept = Scratch::new(name);
    let runs = std::cell::RefCell::new(Vec::new());
    let setup = |_: &Scratch| {
        let dir = kept.path(&runs.borrow().len().to_string());
        std::fs::create_dir(&dir).unwrap();
        runs.borrow_mut().push(dir.clone());
        pairs_over_a_file_node(&dir, jobs.len())
    };
    common::script::assert_same_as_qsd(name, &setup, &script, stable);
    for (dir, daemon) in runs.borrow().iter().zip(["vsd", "qemu-storage-daemon"]) {
        let base = json!(dir.join("base.img").to_str().unwrap());
        for (at, (command, args, format)) in jobs.iter().enumerate() {
            let top = info(&dir.join(format!("top{at}.qcow2")));
            let header = (&top["backing-filename"], &top["backing-filename-format"]);
            assert_eq!(header, (&base, &json!(format)), "{daemon}, after {command} {args}");
        }
    }
}

/// With `backing-mask-protocol`, a stream (to a base, or from a bottom) and
/// an intermediate commit onto a file node name it "raw" in the header.
#[test]
fn a_masked_file_node_base_is_named_raw_in_the_header_as_qemu_does() {
    let mask = json!(true);
    let jobs = [
        ("block-stream", json!({"device": "top0", "base-node": "base", "backing-mask-protocol": mask}), "raw"),
        ("block-stream", json!({"device": "top1", "bottom": "mid1", "backing-mask-protocol": mask}), "raw"),
        ("block-commit", json!({"device": "top2", "top-node": "mid2", "backing-mask-protocol": mask}), "raw"),
    ];
    assert_headers_as_qsd("stream-header-masked", &jobs);
}

/// Without it, QEMU names the protocol driver, "file".
#[test]
fn an_unmasked_file_node_base_is_named_file_in_the_header_as_qemu_does() {
    let jobs = [
        ("block-stream", json!({"device": "top0", "base-node": "base"}), "file"),
        ("block-stream", json!({"device": "top1", "bottom": "mid1", "backing-mask-protocol": false}), "file"),
        ("block-commit", json!({"device": "top2", "top-node": "mid2", "base-node": "base"}), "file"),
    ];
    assert_headers_as_qsd("stream-header-unmasked", &jobs);
}

/// A stream into a read-only overlay on `start`'s daemon: whether the
/// overlay was writable during the job and is read-only after it, and
/// whether its header then names no backing file.
fn read_only_overlay_streamed(start: fn(&Scratch, &[String]) -> Daemon, name: &str) -> (bool, bool, bool) {
    let dir = Scratch::new(name);
    let images = qcow2_chain(&dir);
    let (daemon, mut qmp) = chain_with_read_only(start, &dir, &images, &["base", "mid", "top"]);
    // Slow enough to be looked at while it runs.
    qmp.ok("block-stream", json!({"job-id": "s", "device": "top", "speed": 4 * MIB}));
    let during = node_read_only(&mut qmp, "top");
    qmp.ok("block-job-set-speed", json!({"device": "s", "speed": 0}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "s"}));
    assert!(done.get("error").is_none(), "{name}: {done}");
    let after = node_read_only(&mut qmp, "top");
    drop(daemon);
    (during, after, info(&images[2]).get("backing-filename").is_none())
}

/// QEMU reopens a read-only overlay writable for a stream and read-only
/// again after it: vsd does as it does.
#[test]
fn a_read_only_overlay_is_writable_while_streamed_as_in_qemu() {
    let qsd = read_only_overlay_streamed(Daemon::qsd, "stream-ro-qsd");
    assert_eq!(qsd, (false, true, true), "qemu-storage-daemon: writable during, read-only after, streamed");
    assert_eq!(read_only_overlay_streamed(Daemon::vsd, "stream-ro-vsd"), qsd);
}
