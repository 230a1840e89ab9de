//! Commits (`block-commit`): the active layer committed into its base
//! while a vhost-user client writes on, the export then moved onto the
//! base with no write lost; an image inside a chain committed, the image
//! above it naming the base; qemu-img finds every image clean and holding
//! what it must; the answers and events are qemu-storage-daemon's.

mod common;

use std::time::Duration;

use common::images::{
    BLOCK, CHAIN_SIZE, MIB, Writer, assert_clean, assert_committed, chain_byte, chain_nodes, chain_with_read_only,
    first_mismatch_read, info, node_read_only, qcow2_chain, served_chain,
};
use common::qmp::Qmp;
use common::script::Step::{self, Await, Command};
use common::{Daemon, Scratch, ok};
use serde_json::{Value, json};

/// Between the writer's writes: an active commit must get in sync under it.
const PAUSE: Duration = Duration::from_micros(300);

fn node_served(qmp: &mut Qmp) -> Value {
    qmp.ok("query-block-exports", json!({}))[0]["node-name"].clone()
}

#[test]
fn an_active_commit_moves_the_export_onto_the_base_with_every_write() {
    let dir = Scratch::new("commit-active");
    let images = qcow2_chain(&dir);
    let (daemon, mut qmp) = served_chain(&dir, &images);
    let writer = Writer::start(&daemon, CHAIN_SIZE / BLOCK, PAUSE);
    std::thread::sleep(Duration::from_millis(100));
    qmp.ok("block-commit", json!({"job-id": "c", "device": "top"}));
    let ready = qmp.await_event("BLOCK_JOB_READY", json!({"device": "c"}));
    assert_eq!(ready["type"], "commit", "{ready}");
    assert_eq!(node_served(&mut qmp), json!("top"), "not before job-complete");
    qmp.ok("job-complete", json!({"id": "c"}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "c"}));
    assert!(done.get("error").is_none(), "{done}");
    assert_eq!(node_served(&mut qmp), json!("base"), "the export serves the base");
    std::thread::sleep(Duration::from_millis(200));
    let last = writer.finish();
    assert_committed(&mut qmp, daemon, &dir, &images, &last);
}

#[test]
fn an_intermediate_commit_leaves_the_top_over_the_base() {
    let dir = Scratch::new("commit-mid");
    let images = qcow2_chain(&dir);
    let (daemon, mut qmp) = served_chain(&dir, &images);
    let writer = Writer::start(&daemon, CHAIN_SIZE / BLOCK, Duration::ZERO);
    qmp.ok("block-commit", json!({"job-id": "c", "device": "top", "top-node": "mid", "base-node": "base"}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "c"}));
    assert!(done.get("error").is_none(), "{done}");
    assert_eq!((done["len"].as_u64(), done["offset"].as_u64()), (Some(CHAIN_SIZE), Some(CHAIN_SIZE)), "{done}");
    assert_eq!(node_served(&mut qmp), json!("top"));
    qmp.ok("blockdev-del", json!({"node-name": "mid"}));
    let last = writer.finish();
    daemon.stop();
    let top = info(&images[2]);
    assert_eq!(top["backing-filename"], json!(images[0].to_str().unwrap()), "{top}");
    images.iter().for_each(|image| assert_clean(image));
    let expect = |at: u64| last.get(&(at / BLOCK)).copied().unwrap_or_else(|| chain_byte(at));
    assert_eq!(first_mismatch_read(&dir, &images[2], expect), None, "top over base reads as before");
    let base = |at: u64| if at / MIB == 1 { 0x22 } else { 0x11 };
    assert_eq!(first_mismatch_read(&dir, &images[0], base), None, "the base took in mid");
    // The base is a backing file again: read-only, as before the job.
    let base_info = info(&images[0]);
    assert_eq!(base_info["format-specific"]["data"]["corrupt"], false, "{base_info}");
    ok("qemu-img", &["check", images[0].to_str().unwrap()]);
}

fn differential_script() -> Vec<Step> {
    let null = |id: &str| json!({"id": id, "status": "null"});
    vec![
        Command("block-commit", json!({"job-id": "x", "device": "nope"})),
        Command("block-commit", json!({"job-id": "x", "device": "mid"})),
        Command("block-commit", json!({"job-id": "x", "device": "top", "top-node": "mid", "top": "x"})),
        Command("block-commit", json!({"job-id": "x", "device": "top", "top-node": "nope"})),
        Command("block-commit", json!({"job-id": "x", "device": "top", "top-node": "solo"})),
        Command("block-commit", json!({"job-id": "x", "device": "top", "base-node": "solo"})),
        Command("block-commit", json!({"job-id": "x", "device": "top", "top-node": "mid", "base-node": "mid"})),
        Command("block-commit", json!({"job-id": "x", "device": "top", "top-node": "mid", "base-node": "top"})),
        Command("block-commit", json!({"job-id": "x", "device": "top", "base": "nope.qcow2"})),
        Command("block-commit", json!({"job-id": "x", "device": "top", "backing-file": "b.qcow2"})),
        Command("block-commit", json!({"job-id": "x", "device": "solo"})),
        Command("block-commit", json!({"device": "top"})),
        // The active layer: ready, then completed.
        // Only an intermediate commit rewrites a header, but both take the mask.
        Command(
            "block-commit",
            json!({"job-id": "a1", "device": "top", "base-node": "mid", "backing-mask-protocol": true}),
        ),
        Await("BLOCK_JOB_READY", json!({"device": "a1"})),
        Command("query-block-jobs", json!({})),
        Command("block-job-cancel", json!({"device": "a1"})),
        Await("JOB_STATUS_CHANGE", null("a1")),
        // An intermediate image, into the base.
        Command(
            "block-commit",
            json!({"job-id": "i1", "device": "top", "top-node": "mid", "base-node": "base", "backing-mask-protocol": false}),
        ),
        Await("JOB_STATUS_CHANGE", null("i1")),
        Command("blockdev-del", json!({"node-name": "mid"})),
    ]
}

/// QEMU's ready and paused jobs flap around its drained sections.
fn stable(events: Vec<Value>) -> Vec<Value> {
    let flapping = |e: &Value| matches!(e[1]["status"].as_str(), Some("paused" | "running" | "standby" | "ready"));
    events.into_iter().filter(|e| !flapping(e)).collect()
}

#[test]
fn commit_commands_answer_and_notify_as_qemu_storage_daemon_does() {
    let setup = |dir: &Scratch| {
        let mut args = chain_nodes(&qcow2_chain(dir));
        let solo = dir.image("solo.img", CHAIN_SIZE);
        args.extend(["--blockdev".into(), format!("driver=file,node-name=solo,filename={}", solo.display())]);
        args
    };
    common::script::assert_same_as_qsd("commit-qmp", &setup, &differential_script(), stable);
}

/// Whether node `base` of [`qcow2_chain`] (opened read-only, as `mid` is)
/// is read-only after an active commit into it went ready and was
/// cancelled, with `force` or not, on the daemon `start` runs.
fn base_read_only_after_cancel(start: fn(&Scratch, &[String]) -> Daemon, name: &str, force: bool) -> bool {
    let dir = Scratch::new(name);
    let (_daemon, mut qmp) = chain_with_read_only(start, &dir, &qcow2_chain(&dir), &["base", "mid"]);
    assert!(node_read_only(&mut qmp, "base"), "{name}: read-only before the job");
    qmp.ok("block-commit", json!({"job-id": "c", "device": "top"}));
    qmp.await_event("BLOCK_JOB_READY", json!({"device": "c"}));
    qmp.ok("block-job-cancel", json!({"device": "c", "force": force}));
    qmp.await_event("JOB_STATUS_CHANGE", json!({"id": "c", "status": "null"}));
    node_read_only(&mut qmp, "base")
}

/// QEMU 10 makes the base read-only again when a ready active commit is
/// cancelled by force (the job fails), not after a soft cancel (the job
/// ends well, the base left writable): vsd does as it does.
#[test]
fn a_cancelled_active_commit_leaves_the_base_writable_or_not_as_qemu_does() {
    for (force, read_only) in [(false, false), (true, true)] {
        let qsd = base_read_only_after_cancel(Daemon::qsd, "commit-ro-qsd", force);
        assert_eq!(qsd, read_only, "qemu-storage-daemon, force: {force}");
        let vsd = base_read_only_after_cancel(Daemon::vsd, "commit-ro-vsd", force);
        assert_eq!(vsd, qsd, "vsd, force: {force}");
    }
}

/// vsd killed in the middle of an active commit: every image stays
/// consistent and the active layer, over its chain, reads what the guest
/// flushed (start vsd on it and commit again).
#[test]
fn a_kill_during_a_commit_leaves_every_image_consistent() {
    let dir = Scratch::new("commit-kill");
    let images = qcow2_chain(&dir);
    let (daemon, mut qmp) = served_chain(&dir, &images);
    let last = Writer::start(&daemon, CHAIN_SIZE / BLOCK, Duration::ZERO);
    std::thread::sleep(Duration::from_millis(200));
    let last = last.finish();
    let commit = json!({"job-id": "c", "device": "top", "speed": 2 * MIB, "on-error": "report"});
    qmp.ok("block-commit", commit);
    std::thread::sleep(Duration::from_millis(700));
    // Copying, or (16 MiB go in one burst, as in QEMU) ready and following.
    let status = qmp.ok("query-block-jobs", json!({}))[0]["status"].clone();
    assert!(status == "running" || status == "ready", "killed mid-job: {status}");
    daemon.kill();
    images.iter().for_each(|image| common::images::assert_consistent(image));
    let expect = |at: u64| last.get(&(at / BLOCK)).copied().unwrap_or_else(|| chain_byte(at));
    assert_eq!(first_mismatch_read(&dir, &images[2], expect), None, "the active layer reads what was flushed");
}
