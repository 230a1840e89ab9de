//! Streams (`block-stream`): an overlay takes in its backing chain while a
//! vhost-user client writes on, and qemu-img finds the images as QEMU
//! would leave them (the header's backing file, clean, the same
//! contents); the answers and events are qemu-storage-daemon's.

mod common;

use std::time::Duration;

use common::images::{
    BLOCK, CHAIN_SIZE, MIB, Writer, assert_clean, chain_byte, chain_nodes, first_mismatch_read, info, qcow2_chain,
    served_chain,
};
use common::{Scratch, ok};
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
    let setup = |dir: &Scratch| chain_nodes(&qcow2_chain(dir));
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
    let last = Writer::start(&daemon, SIZE / BLOCK, Duration::ZERO);
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
