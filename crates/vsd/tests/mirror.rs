//! Mirrors (`blockdev-mirror`): a disk copied while a vhost-user client
//! writes on, then the export moved onto the copy with no write lost; a
//! mirror cancelled once ready leaves a copy and no switch; the mistakes
//! refused; and the same QMP script answered and notified as
//! qemu-storage-daemon does.

mod common;

use std::time::Duration;

use common::images::{BLOCK, MIB, Writer, first_mismatch};
use common::qmp::Qmp;
use common::{Daemon, Scratch, monitor};
use serde_json::{Value, json};
use vsd_bench::ClientOptions;

/// Between the writer's writes: mirrors must get in sync under it.
const PAUSE: Duration = Duration::from_micros(300);

/// A raw disk `disk` of `size` bytes holding 0x11 (over file node `f0`),
/// served writable over vhost-user, and file nodes `targets` of the same
/// size; plus `extra` arguments.
fn served(dir: &Scratch, size: u64, targets: &[&str], extra: &[&str]) -> (Daemon, Qmp) {
    let image = dir.path("disk.img");
    std::fs::write(&image, vec![0x11; size as usize]).unwrap();
    let mut args: Vec<String> = vec![
        "--blockdev".into(),
        format!("driver=file,node-name=file0,filename={}", image.display()),
        "--blockdev".into(),
        "driver=raw,node-name=disk,file=file0".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=v0,node-name=disk,writable=on,addr.type=unix,addr.path={}",
            dir.path("vhost.sock").display()
        ),
    ];
    for target in targets {
        let path = dir.image(&format!("{target}.img"), size);
        args.extend(["--blockdev".into(), format!("driver=file,node-name={target},filename={}", path.display())]);
    }
    args.extend(extra.iter().map(|a| a.to_string()));
    args.extend(monitor(&dir.path("qmp.sock")));
    let daemon = Daemon::vsd(dir, &args);
    let qmp = Qmp::connect(&dir.path("qmp.sock"));
    (daemon, qmp)
}

fn node_served(qmp: &mut Qmp) -> Value {
    qmp.ok("query-block-exports", json!({}))[0]["node-name"].clone()
}

#[test]
fn a_mirror_follows_the_writes_and_job_complete_moves_the_export_onto_the_copy() {
    follows_and_completes("background", "disk");
}

#[test]
fn a_write_blocking_mirror_follows_the_writes_and_job_complete_moves_the_export_onto_the_copy() {
    follows_and_completes("write-blocking", "#mirror_top-disk");
}

/// A mirror in `mode` under a writer, completed: the export serves
/// `served_meanwhile` while the job runs.
fn follows_and_completes(mode: &str, served_meanwhile: &str) {
    let dir = Scratch::new(&format!("mirror-complete-{mode}"));
    let size = 32 * MIB;
    let (daemon, mut qmp) = served(&dir, size, &["tgt"], &[]);
    let writer = Writer::start(&daemon, size / BLOCK, PAUSE);
    std::thread::sleep(Duration::from_millis(100));
    let mirror = json!({"job-id": "m", "device": "disk", "target": "tgt", "sync": "full", "copy-mode": mode});
    qmp.ok("blockdev-mirror", mirror);
    assert_eq!(node_served(&mut qmp), json!(served_meanwhile));
    let ready = qmp.await_event("BLOCK_JOB_READY", json!({"device": "m"}));
    assert_eq!(ready["len"], ready["offset"], "{ready}");
    assert!(ready["len"].as_u64().unwrap() >= size, "everything copied at least once: {ready}");
    let jobs = qmp.ok("query-block-jobs", json!({}));
    assert_eq!((jobs[0]["ready"].clone(), jobs[0]["status"].clone()), (json!(true), json!("ready")), "{jobs}");
    // Ready, the job keeps following the writes.
    std::thread::sleep(Duration::from_millis(300));
    qmp.ok("job-complete", json!({"id": "m"}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "m"}));
    assert!(done.get("error").is_none(), "{done}");
    assert_eq!(node_served(&mut qmp), json!("tgt"), "the export serves the copy");
    // Writes after the switch go to the copy alone.
    std::thread::sleep(Duration::from_millis(200));
    let last = writer.finish();
    assert!(last.len() > 100, "the client wrote throughout ({} blocks)", last.len());
    daemon.stop();
    let expect = |at: u64| last.get(&(at / BLOCK)).copied().unwrap_or(0x11);
    assert_eq!(first_mismatch(&dir.path("tgt.img"), expect), None, "the copy holds every write");
}

/// Once ready, a write-blocking mirror has nothing to copy of what is
/// written (the filter wrote it to the target too); a background one copies
/// it. Returns how many bytes the job copied between READY and its end.
fn copied_after_ready(mode: &str) -> u64 {
    let dir = Scratch::new(&format!("mirror-after-ready-{mode}"));
    let size = 16 * MIB;
    let (daemon, mut qmp) = served(&dir, size, &["tgt"], &[]);
    let mirror = json!({"job-id": "m", "device": "disk", "target": "tgt", "sync": "full", "copy-mode": mode});
    qmp.ok("blockdev-mirror", mirror);
    let ready = qmp.await_event("BLOCK_JOB_READY", json!({"device": "m"}));
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    for block in 0..256 {
        queue.write_at(block * 2 * BLOCK, &[0x22; BLOCK as usize]).unwrap();
    }
    drop(queue);
    drop(client);
    qmp.ok("job-complete", json!({"id": "m"}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "m"}));
    assert!(done.get("error").is_none(), "{done}");
    daemon.stop();
    let expect = |at: u64| if (at / BLOCK).is_multiple_of(2) && at < 512 * BLOCK { 0x22 } else { 0x11 };
    assert_eq!(first_mismatch(&dir.path("tgt.img"), expect), None, "the copy holds every write");
    done["offset"].as_u64().unwrap() - ready["offset"].as_u64().unwrap()
}

#[test]
fn writes_after_ready_are_copied_by_a_background_mirror_and_written_through_by_a_write_blocking_one() {
    assert!(copied_after_ready("background") >= 256 * BLOCK, "the background mirror copies the writes");
    assert_eq!(copied_after_ready("write-blocking"), 0, "the filter wrote them to the target");
}

/// `replaces` a node below a filter the export serves: the filter passes
/// its requests to the copy from then on, the export never moves, and the
/// node replaced is no one's child any more.
#[test]
fn a_mirror_replacing_the_node_below_a_filter_leaves_the_filter_over_the_copy() {
    let dir = Scratch::new("mirror-replaces");
    let size = 16 * MIB;
    let image = dir.path("disk.img");
    std::fs::write(&image, vec![0x11; size as usize]).unwrap();
    let target = dir.image("tgt.img", size);
    let socket = dir.path("vhost.sock");
    let mut args: Vec<String> = vec![
        "--object".into(),
        "throttle-group,id=tg0".into(),
        "--blockdev".into(),
        format!("driver=file,node-name=disk,filename={}", image.display()),
        "--blockdev".into(),
        "driver=throttle,node-name=th,file=disk,throttle-group=tg0".into(),
        "--blockdev".into(),
        format!("driver=file,node-name=tgt,filename={}", target.display()),
        "--export".into(),
        format!("type=vhost-user-blk,id=v0,node-name=th,writable=on,addr.type=unix,addr.path={}", socket.display()),
    ];
    args.extend(monitor(&dir.path("qmp.sock")));
    let daemon = Daemon::vsd(&dir, &args);
    let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
    let writer = Writer::start(&daemon, size / BLOCK, PAUSE);
    let mirror = json!({"job-id": "m", "device": "th", "target": "tgt", "sync": "full", "replaces": "disk",
        "copy-mode": "write-blocking"});
    qmp.ok("blockdev-mirror", mirror);
    qmp.await_event("BLOCK_JOB_READY", json!({"device": "m"}));
    qmp.ok("job-complete", json!({"id": "m"}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "m"}));
    assert!(done.get("error").is_none(), "{done}");
    assert_eq!(node_served(&mut qmp), json!("th"), "the export stays on the filter");
    let del = qmp.answer("blockdev-del", json!({"node-name": "tgt"}));
    assert!(del.get("error").is_some(), "the copy is the filter's child: {del}");
    qmp.ok("blockdev-del", json!({"node-name": "disk"}));
    // Writes after the switch reach the copy alone.
    std::thread::sleep(Duration::from_millis(200));
    let last = writer.finish();
    daemon.stop();
    let expect = |at: u64| last.get(&(at / BLOCK)).copied().unwrap_or(0x11);
    assert_eq!(first_mismatch(&target, expect), None, "the copy holds every write");
    assert_ne!(first_mismatch(&image, expect), None, "the node replaced missed the writes after the switch");
}

#[test]
fn block_job_cancel_of_a_ready_mirror_leaves_a_copy_and_the_export_where_it_was() {
    let dir = Scratch::new("mirror-leave");
    let size = 16 * MIB;
    let (daemon, mut qmp) = served(&dir, size, &["tgt"], &[]);
    let writer = Writer::start(&daemon, size / BLOCK, PAUSE);
    // Granules larger than the job's buffer are copied in pieces.
    let mirror = json!({"job-id": "m", "device": "disk", "target": "tgt", "sync": "full", "granularity": 4 * MIB});
    qmp.ok("blockdev-mirror", mirror);
    std::thread::sleep(Duration::from_millis(300));
    let last = writer.finish();
    qmp.await_event("BLOCK_JOB_READY", json!({"device": "m"}));
    qmp.ok("block-job-pause", json!({"device": "m"}));
    qmp.await_event("JOB_STATUS_CHANGE", json!({"id": "m", "status": "standby"}));
    qmp.ok("block-job-resume", json!({"device": "m"}));
    qmp.await_event("JOB_STATUS_CHANGE", json!({"id": "m", "status": "ready"}));
    qmp.ok("block-job-cancel", json!({"device": "m"}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "m"}));
    assert!(done.get("error").is_none(), "{done}");
    assert_eq!(node_served(&mut qmp), json!("disk"), "no switch");
    // A write after the end reaches the disk only.
    let mut client = daemon.connect(ClientOptions::default());
    client.take_queue(0).unwrap().write_at(size - BLOCK, &[0x99; BLOCK as usize]).unwrap();
    drop(client);
    daemon.stop();
    let expect = |at: u64| last.get(&(at / BLOCK)).copied().unwrap_or(0x11);
    assert_eq!(first_mismatch(&dir.path("tgt.img"), expect), None, "the copy is the disk when cancelled");
    let disk = |at: u64| if at >= size - BLOCK { 0x99 } else { expect(at) };
    assert_eq!(first_mismatch(&dir.path("disk.img"), disk), None);
}

#[test]
fn a_mirror_cancelled_before_it_is_ready_is_cancelled() {
    let dir = Scratch::new("mirror-cancel");
    let (_daemon, mut qmp) = served(&dir, 16 * MIB, &["tgt"], &[]);
    // One burst of 1 MiB, then a byte a second: never ready.
    let mirror = json!({"job-id": "m", "device": "disk", "target": "tgt", "sync": "full", "speed": 1, "buf-size": MIB});
    qmp.ok("blockdev-mirror", mirror);
    let early = qmp.answer("job-complete", json!({"id": "m"}));
    assert_eq!(early["error"]["desc"], "Job 'm' in state 'running' cannot accept command verb 'complete'");
    qmp.ok("block-job-cancel", json!({"device": "m"}));
    let cancelled = qmp.await_event("BLOCK_JOB_CANCELLED", json!({"device": "m"}));
    assert!(cancelled["offset"].as_u64().unwrap() <= 2 * MIB, "{cancelled}");
    assert_eq!(node_served(&mut qmp), json!("disk"));
    // The nodes are free again.
    qmp.ok("blockdev-mirror", json!({"job-id": "m2", "device": "disk", "target": "tgt", "sync": "none"}));
    qmp.await_event("BLOCK_JOB_READY", json!({"device": "m2"}));
    qmp.ok("job-cancel", json!({"id": "m2"}));
    qmp.await_event("BLOCK_JOB_CANCELLED", json!({"device": "m2"}));
}

#[test]
fn mistakes_are_refused_and_change_nothing() {
    let dir = Scratch::new("mirror-refused");
    let size = 16 * MIB;
    let small = dir.image("small.img", MIB);
    let nbd = dir.path("nbd.sock");
    let extra = [
        "--blockdev".to_string(),
        format!("driver=file,node-name=small,filename={}", small.display()),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", nbd.display()),
        "--export".into(),
        "type=nbd,id=n0,node-name=t2,name=t2,writable=on".into(),
        "--blockdev".into(),
        "driver=blkdebug,node-name=bd,image=t4".into(),
    ];
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let (_daemon, mut qmp) = served(&dir, size, &["tgt", "t2", "t3", "t4"], &extra);
    let mirror = |target: &str, more: Value| {
        let mut args = json!({"job-id": "m", "device": "disk", "target": target, "sync": "full"});
        args.as_object_mut().unwrap().extend(more.as_object().unwrap().clone());
        args
    };
    let cases = [
        (mirror("disk", json!({})), "Can't mirror node into itself"),
        (mirror("nope", json!({})), "Cannot find device='nope' nor node-name='nope'"),
        (mirror("tgt", json!({"granularity": 256})), "Parameter 'granularity' expects a value in range [512B, 64MB]"),
        (mirror("tgt", json!({"granularity": 65537})), "Parameter 'granularity' expects a power of 2"),
        (mirror("tgt", json!({"sync": "incremental"})), "Sync mode 'incremental' not supported"),
        (mirror("small", json!({})), "Source and target image have different sizes"),
        (mirror("tgt", json!({"job-id": "1x"})), "Invalid job ID '1x'"),
        (
            mirror("file0", json!({})),
            "Node 'disk' and node 'file0' are in one backing chain: the mirror would write what it reads",
        ),
        (
            mirror("t2", json!({})),
            "Permission conflict on node 't2': permissions 'consistent read, write' are both required by an unnamed \
             block device (uses node 't2' as 'root' child) and unshared by an unnamed block device (uses node 't2' as \
             'root' child).",
        ),
    ];
    // QEMU would replace a node below any filter; vsd's blkdebug keeps its child.
    let below_filter = json!({"job-id": "m", "device": "bd", "target": "tgt", "sync": "full", "replaces": "t4"});
    let cases = cases.into_iter().chain([(below_filter, "vsd's blkdebug filter 'bd' cannot take another child")]);
    for (args, error) in cases {
        let answer = qmp.answer("blockdev-mirror", args.clone());
        assert_eq!(answer["error"]["desc"], error, "{args}");
    }
    assert_eq!(qmp.ok("query-block-jobs", json!({})), json!([]), "no job was made");
    // One job per node.
    qmp.ok("blockdev-mirror", mirror("tgt", json!({"speed": 1})));
    let busy = qmp.answer("blockdev-mirror", json!({"job-id": "m2", "device": "disk", "target": "t3", "sync": "full"}));
    assert_eq!(busy["error"]["desc"], "Need a root block node", "QEMU's filter above the source");
    let busy = qmp.answer("blockdev-mirror", json!({"job-id": "m2", "device": "t3", "target": "tgt", "sync": "full"}));
    assert_eq!(busy["error"]["desc"], "Node 'tgt' is busy: block device is in use by block job: mirror");
    let del = qmp.answer("blockdev-del", json!({"node-name": "tgt"}));
    assert!(del.get("error").is_some(), "{del}");
}

use common::script::Step::{self, Await, Command};

fn differential_script() -> Vec<Step> {
    let mirror = |job: &str, sync: &str, more: Value| {
        let mut args = json!({"job-id": job, "device": "src", "target": "tgt", "sync": sync});
        args.as_object_mut().unwrap().extend(more.as_object().unwrap().clone());
        args
    };
    let status = |id: &str, status: &str| json!({"id": id, "status": status});
    vec![
        Command("blockdev-mirror", json!({"job-id": "x", "device": "nope", "target": "tgt", "sync": "full"})),
        Command("blockdev-mirror", json!({"job-id": "x", "device": "src", "target": "src", "sync": "full"})),
        Command("blockdev-mirror", json!({"job-id": "x", "device": "src", "target": "nope", "sync": "full"})),
        Command("blockdev-mirror", mirror("x", "incremental", json!({}))),
        Command("blockdev-mirror", mirror("x", "full", json!({"granularity": 256}))),
        Command("blockdev-mirror", mirror("x", "full", json!({"granularity": 65537}))),
        Command("blockdev-mirror", mirror("1x", "full", json!({}))),
        // Arguments QAPI's visitor refuses, in its words.
        Command("blockdev-mirror", mirror("x", "full", json!({"copy-mode": "sideways"}))),
        Command("blockdev-mirror", mirror("x", "full", json!({"speed": "fast"}))),
        Command("blockdev-mirror", mirror("x", "full", json!({"bogus": 1}))),
        Command("blockdev-mirror", json!({"job-id": "x", "target": "tgt", "sync": "full"})),
        Command("blockdev-mirror", mirror("x", "full", json!({"auto-finalize": "yes"}))),
        Command("blockdev-mirror", mirror("x", "full", json!({"granularity": -1}))),
        Command("blockdev-mirror", mirror("x", "full", json!({"job-id": 5}))),
        Command(
            "transaction",
            json!({"actions": [{"type": "blockdev-backup", "data": {"device": "src", "target": "tgt"}}]}),
        ),
        Command(
            "transaction",
            json!({"actions": [{"type": "blockdev-backup", "data": {"device": "src", "target": "tgt", "sync": "full", "zz": 1}}]}),
        ),
        Command("blockdev-create", json!({"job-id": "c", "options": {"driver": "file", "filename": "zz.img"}})),
        Command("query-block-jobs", json!({"x": 1})),
        // `replaces`: the device, or a node it reads through filters only.
        Command("blockdev-mirror", mirror("x", "full", json!({"replaces": "nope"}))),
        Command("blockdev-add", json!({"driver": "raw", "node-name": "r", "file": "spare"})),
        Command(
            "blockdev-mirror",
            json!({"job-id": "x", "device": "r", "target": "tgt", "sync": "full", "replaces": "spare"}),
        ),
        Command(
            "blockdev-mirror",
            json!({"job-id": "x", "device": "r", "target": "tgt", "sync": "full", "replaces": "src"}),
        ),
        Command("blockdev-del", json!({"node-name": "r"})),
        // Cancelled before it is ready.
        Command("blockdev-mirror", mirror("m1", "full", json!({"speed": 1}))),
        Command("job-complete", json!({"id": "m1"})),
        Command("blockdev-mirror", mirror("m1b", "full", json!({}))),
        Command("block-job-cancel", json!({"device": "m1"})),
        Await("JOB_STATUS_CHANGE", status("m1", "null")),
        // Ready, paused into standby and back, completed.
        Command("blockdev-mirror", mirror("m2", "full", json!({}))),
        Await("BLOCK_JOB_READY", json!({"device": "m2"})),
        Command("query-block-jobs", json!({})),
        Command("job-pause", json!({"id": "m2"})),
        Await("JOB_STATUS_CHANGE", status("m2", "standby")),
        Command("job-resume", json!({"id": "m2"})),
        Await("JOB_STATUS_CHANGE", status("m2", "ready")),
        Command("job-complete", json!({"id": "m2"})),
        Await("JOB_STATUS_CHANGE", status("m2", "null")),
        // Cancelled once ready: completed, without a switch.
        Command("blockdev-mirror", mirror("m3", "none", json!({}))),
        Await("BLOCK_JOB_READY", json!({"device": "m3"})),
        Command("block-job-cancel", json!({"device": "m3"})),
        Await("JOB_STATUS_CHANGE", status("m3", "null")),
        // Forced: cancelled.
        Command("blockdev-mirror", mirror("m4", "top", json!({}))),
        Await("BLOCK_JOB_READY", json!({"device": "m4"})),
        Command("block-job-cancel", json!({"device": "m4", "force": true})),
        Await("JOB_STATUS_CHANGE", status("m4", "null")),
        // Finalized and dismissed by hand.
        Command("blockdev-mirror", mirror("m5", "full", json!({"auto-finalize": false, "auto-dismiss": false}))),
        Await("BLOCK_JOB_READY", json!({"device": "m5"})),
        Command("job-complete", json!({"id": "m5"})),
        Await("BLOCK_JOB_PENDING", json!({"id": "m5"})),
        Command("query-jobs", json!({})),
        Command("job-finalize", json!({"id": "m5"})),
        Await("JOB_STATUS_CHANGE", status("m5", "concluded")),
        Command("job-dismiss", json!({"id": "m5"})),
        Command("query-jobs", json!({})),
        // Write-blocking: ready, then cancelled once ready, then completed.
        Command("blockdev-mirror", mirror("m6", "full", json!({"copy-mode": "write-blocking"}))),
        Await("BLOCK_JOB_READY", json!({"device": "m6"})),
        Command("block-job-cancel", json!({"device": "m6"})),
        Await("JOB_STATUS_CHANGE", status("m6", "null")),
        Command("blockdev-mirror", mirror("m7", "top", json!({"copy-mode": "write-blocking"}))),
        Await("BLOCK_JOB_READY", json!({"device": "m7"})),
        Command("job-complete", json!({"id": "m7"})),
        Await("JOB_STATUS_CHANGE", status("m7", "null")),
        // The target takes the place of the node below a filter, which is
        // then no one's child.
        Command("object-add", json!({"qom-type": "throttle-group", "id": "tg0"})),
        Command(
            "blockdev-add",
            json!({"driver": "throttle", "node-name": "th", "file": "spare", "throttle-group": "tg0"}),
        ),
        Command("blockdev-del", json!({"node-name": "spare"})),
        Command(
            "blockdev-mirror",
            json!({"job-id": "m8", "device": "th", "target": "tgt", "sync": "full", "replaces": "spare"}),
        ),
        Await("BLOCK_JOB_READY", json!({"device": "m8"})),
        Command("job-complete", json!({"id": "m8"})),
        Await("JOB_STATUS_CHANGE", status("m8", "null")),
        Command("blockdev-del", json!({"node-name": "tgt"})),
        Command("blockdev-del", json!({"node-name": "spare"})),
    ]
}

/// QEMU's ready and paused jobs flap around its drained sections: only
/// the other statuses are compared; and how far a job cancelled while
/// copying came depends on when the cancel arrived.
fn stable(events: Vec<Value>) -> Vec<Value> {
    let flapping = |e: &Value| matches!(e[1]["status"].as_str(), Some("paused" | "running" | "standby" | "ready"));
    let timeless = |mut e: Value| {
        if e[0] == "BLOCK_JOB_CANCELLED" {
            let data = e[1].as_object_mut().unwrap();
            data.remove("len");
            data.remove("offset");
        }
        e
    };
    events.into_iter().filter(|e| !flapping(e)).map(timeless).collect()
}

#[test]
fn mirror_commands_answer_and_notify_as_qemu_storage_daemon_does() {
    let setup = |dir: &Scratch| {
        let mut args = Vec::new();
        for node in ["src", "tgt", "spare"] {
            let image = dir.image(&format!("{node}.img"), 16 * MIB);
            args.extend(["--blockdev".into(), format!("driver=file,node-name={node},filename={}", image.display())]);
        }
        args
    };
    common::script::assert_same_as_qsd("mirror-qmp", &setup, &differential_script(), stable);
}

/// Another vsd serving `target.img` of `size` bytes writable over NBD as
/// export `copy`, in `far`.
fn far_vsd(far: &Scratch, size: u64) -> Daemon {
    let target = far.image("target.img", size);
    Daemon::vsd(
        far,
        &[
            "--blockdev".into(),
            format!("driver=file,node-name=t0,filename={}", target.display()),
            "--nbd-server".into(),
            format!("addr.type=unix,addr.path={}", far.path("nbd.sock").display()),
            "--export".into(),
            "type=nbd,id=e0,node-name=t0,name=copy,writable=on".into(),
        ],
    )
}

/// The size of [`FarCopy`]'s disks.
const FAR_SIZE: u64 = 16 * MIB;

/// A served disk under a writer, and another vsd whose export is node
/// `remote` of the first: a mirror's far target.
struct FarCopy {
    dir: Scratch,
    far: Scratch,
    daemon: Daemon,
    qmp: Qmp,
    remote: Daemon,
    writer: Writer,
}

impl FarCopy {
    fn start(name: &str) -> Self {
        let (dir, far, size) = (Scratch::new(name), Scratch::new(&format!("{name}-far")), FAR_SIZE);
        let (daemon, mut qmp) = served(&dir, size, &[], &[]);
        let remote = far_vsd(&far, size);
        let server = json!({"type": "unix", "path": far.path("nbd.sock")});
        qmp.ok("blockdev-add", json!({"driver": "nbd", "node-name": "remote", "server": server, "export": "copy"}));
        let writer = Writer::start(&daemon, size / BLOCK, PAUSE);
        Self { dir, far, daemon, qmp, remote, writer }
    }
}

/// A disk moves to another host's vsd: mirrored onto a `driver=nbd` node,
/// then the export switched onto it; every write, before and after the
/// switch, is in the far image.
#[test]
fn a_running_disk_moves_to_another_vsd_over_nbd() {
    moves_over_nbd("background");
}

#[test]
fn a_running_disk_moves_to_another_vsd_over_nbd_with_write_blocking() {
    moves_over_nbd("write-blocking");
}

fn moves_over_nbd(mode: &str) {
    let FarCopy { dir: _dir, far, daemon, mut qmp, remote, writer, .. } = FarCopy::start(&format!("mirror-nbd-{mode}"));
    let mirror = json!({"job-id": "m", "device": "disk", "target": "remote", "sync": "full", "copy-mode": mode});
    qmp.ok("blockdev-mirror", mirror);
    qmp.await_event("BLOCK_JOB_READY", json!({"device": "m"}));
    qmp.ok("job-complete", json!({"id": "m"}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "m"}));
    assert!(done.get("error").is_none(), "{done}");
    assert_eq!(node_served(&mut qmp), json!("remote"));
    std::thread::sleep(Duration::from_millis(200));
    let last = writer.finish();
    daemon.stop();
    remote.stop();
    let expect = |at: u64| last.get(&(at / BLOCK)).copied().unwrap_or(0x11);
    assert_eq!(first_mismatch(&far.path("target.img"), expect), None, "the far image holds every write");
}

/// The far vsd dies mid-mirror: the job fails as QEMU's does, and the
/// disk goes on serving its writer without an error.
#[test]
fn a_target_that_disappears_fails_the_job_and_never_the_disk() {
    target_disappears("background");
}

/// The filter's writes to the far target fail too: the job fails, and the
/// export is back on the disk.
#[test]
fn a_target_that_disappears_fails_a_write_blocking_job_and_never_the_disk() {
    target_disappears("write-blocking");
}

fn target_disappears(mode: &str) {
    let FarCopy { dir, far: _far, daemon, mut qmp, remote, writer, .. } =
        FarCopy::start(&format!("mirror-nbd-gone-{mode}"));
    let mirror = json!({"job-id": "m", "device": "disk", "target": "remote", "sync": "full", "buf-size": MIB,
        "speed": MIB, "copy-mode": mode});
    qmp.ok("blockdev-mirror", mirror);
    std::thread::sleep(Duration::from_millis(300));
    remote.kill();
    let error = qmp.await_event("BLOCK_JOB_ERROR", json!({"device": "m"}));
    assert_eq!((error["operation"].clone(), error["action"].clone()), (json!("write"), json!("report")), "{error}");
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "m"}));
    assert!(done.get("error").is_some(), "{done}");
    assert_eq!(node_served(&mut qmp), json!("disk"));
    std::thread::sleep(Duration::from_millis(200));
    let last = writer.finish();
    daemon.stop();
    let expect = |at: u64| last.get(&(at / BLOCK)).copied().unwrap_or(0x11);
    assert_eq!(first_mismatch(&dir.path("disk.img"), expect), None, "the disk has every write");
}

/// vsd killed in the middle of a mirror between qcow2 images: both stay
/// consistent, and the source is the disk as the guest last flushed it
/// (after a crash, the source is the disk; the copy is started again).
#[test]
fn a_kill_during_a_mirror_leaves_the_source_whole_and_both_images_consistent() {
    killed_mid_mirror("background");
}

/// The same with the filter writing the target too, beside the job.
#[test]
fn a_kill_during_a_write_blocking_mirror_leaves_the_source_whole_and_both_images_consistent() {
    killed_mid_mirror("write-blocking");
}

fn killed_mid_mirror(mode: &str) {
    let dir = Scratch::new(&format!("mirror-kill-{mode}"));
    let size = 16 * MIB;
    let (disk, copy) = (dir.path("disk.qcow2"), dir.path("copy.qcow2"));
    for image in [&disk, &copy] {
        common::ok("qemu-img", &["create", "-q", "-f", "qcow2", image.to_str().unwrap(), &size.to_string()]);
    }
    common::ok("qemu-io", &["-f", "qcow2", "-c", &format!("write -P 0x11 0 {size}"), disk.to_str().unwrap()]);
    let mut args: Vec<String> = vec![
        "--blockdev".into(),
        format!("driver=file,node-name=file0,filename={}", disk.display()),
        "--blockdev".into(),
        "driver=qcow2,node-name=disk,file=file0".into(),
        "--blockdev".into(),
        format!("driver=file,node-name=file1,filename={}", copy.display()),
        "--blockdev".into(),
        "driver=qcow2,node-name=tgt,file=file1".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=v0,node-name=disk,writable=on,addr.type=unix,addr.path={}",
            dir.path("vhost.sock").display()
        ),
    ];
    args.extend(monitor(&dir.path("qmp.sock")));
    let daemon = Daemon::vsd(&dir, &args);
    let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
    let writer = Writer::start(&daemon, size / BLOCK, PAUSE);
    qmp.ok(
        "blockdev-mirror",
        json!({"job-id": "m", "device": "disk", "target": "tgt", "sync": "full", "buf-size": MIB, "speed": 2 * MIB,
            "copy-mode": mode}),
    );
    std::thread::sleep(Duration::from_millis(500));
    let last = writer.finish();
    let job = qmp.ok("query-block-jobs", json!({}));
    assert_eq!(job[0]["status"], "running", "killed while copying: {job}");
    daemon.kill();
    for image in [&disk, &copy] {
        common::images::assert_consistent(image);
    }
    let raw = dir.path("disk.raw");
    common::ok("qemu-img", &["convert", "-O", "raw", disk.to_str().unwrap(), raw.to_str().unwrap()]);
    let expect = |at: u64| last.get(&(at / BLOCK)).copied().unwrap_or(0x11);
    assert_eq!(first_mismatch(&raw, expect), None, "the source holds every flushed write");
}
