//! Backups (`blockdev-backup`) and the job commands: the same QMP script
//! against vsd and qemu-storage-daemon, answers and events compared; the
//! copy holding the disk as it was when the job started while clients
//! write through vhost-user and NBD; incremental backups from a bitmap;
//! failing targets; and a daemon stopped with a job running.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::qmp::Qmp;
use common::{Daemon, Scratch, monitor, run};
use serde_json::{Value, json};
use vsd_bench::ClientOptions;

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;
const CLUSTER: u64 = 64 * KIB;

/// `--blockdev` arguments for file nodes, each over a new image.
fn file_nodes(dir: &Scratch, nodes: &[(&str, u64)]) -> Vec<String> {
    let mut args = Vec::new();
    for (name, size) in nodes {
        let image = dir.image(&format!("{name}.img"), *size);
        args.extend(["--blockdev".into(), format!("driver=file,node-name={name},filename={}", image.display())]);
    }
    args
}

use common::script::Step::{self, Await, Command, Sleep};
use common::script::stable;

fn differential_script() -> Vec<Step> {
    let (src, tgt) = ("src", "tgt");
    let full = |job: &str, source: &str, target: &str| json!({"job-id": job, "device": source, "target": target, "sync": "full", "speed": 1});
    let null = |id: &str| json!({"status": "null", "id": id});
    vec![
        Command("blockdev-backup", json!({"job-id": "x", "device": "nope", "target": tgt, "sync": "full"})),
        Command("blockdev-backup", json!({"job-id": "x", "device": src, "target": src, "sync": "full"})),
        Command("blockdev-backup", json!({"job-id": "x", "device": src, "target": "small", "sync": "full"})),
        Command("blockdev-backup", json!({"job-id": "x", "device": src, "target": tgt, "sync": "incremental"})),
        Command("blockdev-backup", json!({"job-id": "x", "device": src, "target": tgt, "sync": "bitmap"})),
        Command(
            "blockdev-backup",
            json!({"job-id": "x", "device": src, "target": tgt, "sync": "incremental", "bitmap": "nope"}),
        ),
        Command("block-dirty-bitmap-add", json!({"node": src, "name": "b", "granularity": 65536})),
        Command(
            "blockdev-backup",
            json!({"job-id": "x", "device": src, "target": tgt, "sync": "bitmap", "bitmap": "b"}),
        ),
        Command(
            "blockdev-backup",
            json!({"job-id": "x", "device": src, "target": tgt, "sync": "incremental", "bitmap": "b", "bitmap-mode": "never"}),
        ),
        Command(
            "blockdev-backup",
            json!({"job-id": "x", "device": src, "target": tgt, "sync": "full", "bitmap-mode": "never"}),
        ),
        Command(
            "blockdev-backup",
            json!({"job-id": "x", "device": src, "target": tgt, "sync": "full", "compress": true}),
        ),
        Command("blockdev-backup", json!({"device": src, "target": tgt, "sync": "full"})),
        Command("blockdev-backup", json!({"job-id": "j4", "device": src, "target": tgt, "sync": "full", "speed": -1})),
        Command("blockdev-backup", full("j1", src, tgt)),
        Sleep(300),
        // A second backup of the same source runs beside the first.
        Command("blockdev-backup", full("j5", src, "tgt3")),
        Sleep(100),
        Command("job-cancel", json!({"id": "j5"})),
        Await("JOB_STATUS_CHANGE", null("j5")),
        Command("blockdev-backup", full("j1", src, tgt)),
        Command("blockdev-backup", full("j1", "src2", "tgt2")),
        Command("blockdev-backup", full("j2", "src2", tgt)),
        Command(
            "blockdev-backup",
            json!({"job-id": "j2", "device": "src2", "target": "tgt2", "sync": "full", "speed": 1, "auto-finalize": false, "auto-dismiss": false}),
        ),
        Sleep(300),
        Command("query-jobs", json!({})),
        Command("query-block-jobs", json!({})),
        Command("job-pause", json!({"id": "j1"})),
        Sleep(200),
        Command("job-pause", json!({"id": "j1"})),
        Command("query-jobs", json!({})),
        Command("query-block-jobs", json!({})),
        Command("job-resume", json!({"id": "j1"})),
        Sleep(200),
        Command("job-resume", json!({"id": "j1"})),
        Command("job-complete", json!({"id": "j1"})),
        Command("job-finalize", json!({"id": "j1"})),
        Command("job-dismiss", json!({"id": "j1"})),
        Command("block-job-complete", json!({"device": "j1"})),
        Command("blockdev-del", json!({"node-name": tgt})),
        Command("blockdev-del", json!({"node-name": src})),
        Command("block-job-set-speed", json!({"device": "j1", "speed": -5})),
        Command("block-job-set-speed", json!({"device": "nope", "speed": 5})),
        Command("block-job-set-speed", json!({"device": "j2", "speed": 0})),
        Await("BLOCK_JOB_PENDING", json!({"id": "j2"})),
        Command("query-jobs", json!({})),
        Command("job-dismiss", json!({"id": "j2"})),
        Command("job-cancel", json!({"id": "j2"})),
        Await("JOB_STATUS_CHANGE", json!({"status": "concluded", "id": "j2"})),
        Command("job-finalize", json!({"id": "j2"})),
        Command("query-jobs", json!({})),
        Command("query-block-jobs", json!({})),
        Command("job-dismiss", json!({"id": "j2"})),
        Command("block-job-pause", json!({"device": "j1"})),
        Command("block-job-resume", json!({"device": "j1"})),
        Command("block-job-cancel", json!({"device": "j1", "force": true})),
        Await("JOB_STATUS_CHANGE", null("j1")),
        Command("query-jobs", json!({})),
        Command("job-cancel", json!({"id": "nope"})),
        Command("job-dismiss", json!({"id": "nope"})),
        Command("block-job-cancel", json!({"device": "nope"})),
        Command("block-job-dismiss", json!({"id": "nope"})),
        Command("block-job-finalize", json!({"id": "nope"})),
        Command(
            "blockdev-backup",
            json!({"job-id": "i1", "device": src, "target": tgt, "sync": "incremental", "bitmap": "b"}),
        ),
        Await("JOB_STATUS_CHANGE", null("i1")),
        Command("blockdev-backup", json!({"job-id": "t1", "device": src, "target": tgt, "sync": "top", "speed": 1})),
        Sleep(300),
        Command("query-jobs", json!({})),
        Command("job-cancel", json!({"id": "t1"})),
        Await("JOB_STATUS_CHANGE", null("t1")),
        Command("blockdev-backup", json!({"job-id": "n1", "device": src, "target": tgt, "sync": "none"})),
        Sleep(100),
        Command("query-jobs", json!({})),
        Command("job-cancel", json!({"id": "n1"})),
        Await("JOB_STATUS_CHANGE", null("n1")),
        Command(
            "blockdev-backup",
            json!({"job-id": "f1", "device": src, "target": tgt, "sync": "full", "auto-dismiss": false}),
        ),
        Await("JOB_STATUS_CHANGE", json!({"status": "concluded", "id": "f1"})),
        Command("query-jobs", json!({})),
        Command("job-dismiss", json!({"id": "f1"})),
        // Grouped: the job done first waits for the other, then both end.
        Command(
            "transaction",
            json!({"actions": [
                {"type": "blockdev-backup", "data": {"job-id": "g1", "device": src, "target": tgt, "sync": "full"}},
                {"type": "blockdev-backup", "data": full("g2", src, "tgt3")},
            ], "properties": {"completion-mode": "grouped"}}),
        ),
        Await("JOB_STATUS_CHANGE", json!({"status": "waiting", "id": "g1"})),
        // g2's first copy (then its 1 byte/s holds it) may still be on the
        // way when g1 is done: a loaded machine showed it at 0 bytes.
        Sleep(300),
        Command("query-jobs", json!({})),
        Command("block-job-set-speed", json!({"device": "g2", "speed": 0})),
        Await("JOB_STATUS_CHANGE", null("g1")),
        Command(
            "transaction",
            json!({"actions": [{"type": "block-dirty-bitmap-add", "data": {"node": src, "name": "g"}}],
                   "properties": {"completion-mode": "grouped"}}),
        ),
        Command("blockdev-del", json!({"node-name": tgt})),
    ]
}

#[test]
fn job_commands_answer_and_notify_as_qemu_storage_daemon_does() {
    let setup = |dir: &Scratch| {
        let big = 64 * MIB;
        file_nodes(dir, &[("src", big), ("tgt", big), ("src2", big), ("tgt2", big), ("tgt3", big), ("small", 2 * MIB)])
    };
    common::script::assert_same_as_qsd("backup-qmp", &setup, &differential_script(), stable);
}

/// Fills `len` bytes at `offset` of NBD export `name` with `byte`
/// (`write -z` for 0).
fn nbd_write(socket: &Path, name: &str, offset: u64, len: u64, byte: u8) {
    let uri = format!("nbd+unix:///{name}?socket={}", socket.display());
    let command = format!("write -P {byte} {offset} {len}");
    let out = run("qemu-io", &["-f", "raw", "-c", &command, &uri]);
    assert!(out.status.success(), "{command}: {}", String::from_utf8_lossy(&out.stderr));
}

/// The bytes of `image` that differ from `expect(offset)`, as (first offset, count).
fn mismatches(image: &Path, expect: impl Fn(u64) -> u8) -> Option<(u64, usize)> {
    unexpected(image, |at, byte| byte == expect(at))
}

/// The bytes of `image` that `fits(offset, byte)` refuses, as (first offset, count).
fn unexpected(image: &Path, fits: impl Fn(u64, u8) -> bool) -> Option<(u64, usize)> {
    let data = std::fs::read(image).unwrap();
    let wrong: Vec<u64> = (0..data.len() as u64).filter(|&at| !fits(at, data[at as usize])).collect();
    wrong.first().map(|&first| (first, wrong.len()))
}

/// A raw disk `disk` (over file node `f0`), served writable over NBD as
/// `rw` and over vhost-user, and file nodes for targets.
fn served_disk(dir: &Scratch, size: u64, targets: &[&str], extra: &[String]) -> (Daemon, Qmp) {
    let image = dir.image("disk.img", size);
    let qmp_socket = dir.path("qmp.sock");
    let mut args = common::disk_over_vhost_and_nbd(dir, &image);
    let nodes: Vec<(&str, u64)> = targets.iter().map(|t| (*t, size)).collect();
    args.extend(file_nodes(dir, &nodes));
    args.extend(extra.iter().cloned());
    args.extend(monitor(&qmp_socket));
    let daemon = Daemon::vsd(dir, &args);
    let qmp = Qmp::connect(&qmp_socket);
    (daemon, qmp)
}

#[test]
fn a_full_backup_holds_the_disk_as_it_was_when_the_job_started() {
    let dir = Scratch::new("backup-point-in-time");
    let size = 64 * MIB;
    let (daemon, mut qmp) = served_disk(&dir, size, &["tgt"], &[]);
    let nbd = dir.path("nbd.sock");
    nbd_write(&nbd, "rw", 0, size, 0x11);
    qmp.ok("blockdev-backup", json!({"job-id": "b", "device": "disk", "target": "tgt", "sync": "full", "speed": 1}));
    // The job copied its first run and waits: these writes wait for their
    // clusters' old data instead.
    nbd_write(&nbd, "rw", 10 * MIB + 4096, 4096, 0x22);
    nbd_write(&nbd, "rw", 30 * MIB - 32 * KIB, CLUSTER, 0x22);
    nbd_write(&nbd, "rw", 50 * MIB, 3 * MIB, 0);
    nbd_write(&nbd, "rw", 0, 4096, 0x22);
    // A paused job still copies what writes wait for.
    qmp.ok("job-pause", json!({"id": "b"}));
    qmp.await_event("JOB_STATUS_CHANGE", json!({"status": "paused", "id": "b"}));
    nbd_write(&nbd, "rw", 20 * MIB, 4096, 0x22);
    qmp.ok("job-resume", json!({"id": "b"}));
    // A vhost-user client writes on while the job runs at full speed.
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut writes = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let offset = 40 * MIB + (writes % 120) * 68 * KIB;
                queue.write_at(offset, &[0x33; 4096]).unwrap();
                writes += 1;
            }
            writes
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    qmp.ok("block-job-set-speed", json!({"device": "b", "speed": 0}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "b"}));
    stop.store(true, Ordering::Relaxed);
    let writes = writer.join().unwrap();
    assert!(writes > 0 && done.get("error").is_none(), "{writes} writes; {done}");
    assert_eq!((done["len"].as_u64(), done["offset"].as_u64()), (Some(size), Some(size)));
    assert_eq!(mismatches(&dir.path("tgt.img"), |_| 0x11), None, "the copy is the disk before the job");
    let source = |at: u64| match at {
        0..4096 => 0x22,
        _ if (10 * MIB + 4096..10 * MIB + 8192).contains(&at) => 0x22,
        _ if (20 * MIB..20 * MIB + 4096).contains(&at) => 0x22,
        _ if (30 * MIB - 32 * KIB..30 * MIB + 32 * KIB).contains(&at) => 0x22,
        _ if (50 * MIB..53 * MIB).contains(&at) => 0,
        _ => 0x11,
    };
    // The vhost-user writer may not have come round to all its offsets.
    let written = |at: u64| (40 * MIB..40 * MIB + 120 * 68 * KIB).contains(&at) && (at - 40 * MIB) % (68 * KIB) < 4096;
    let fits = |at, byte| byte == source(at) || (written(at) && byte == 0x33);
    assert_eq!(unexpected(&dir.path("disk.img"), fits), None, "the source has every write");
}

/// Two backups of one disk, started apart, run at once: each copy holds the
/// disk as it was when its own job started, and a write waits for both.
#[test]
fn two_backups_of_one_disk_each_hold_their_own_point_in_time() {
    let dir = Scratch::new("backup-two");
    let size = 16 * MIB;
    let (_daemon, mut qmp) = served_disk(&dir, size, &["t1", "t2"], &[]);
    let nbd = dir.path("nbd.sock");
    nbd_write(&nbd, "rw", 0, size, 0x11);
    let backup = |job: &str, target: &str| json!({"job-id": job, "device": "disk", "target": target, "sync": "full", "speed": 1});
    qmp.ok("blockdev-backup", backup("b1", "t1"));
    nbd_write(&nbd, "rw", 4 * MIB, MIB, 0x22);
    qmp.ok("blockdev-backup", backup("b2", "t2"));
    nbd_write(&nbd, "rw", 4 * MIB + 512 * KIB, MIB, 0x33);
    nbd_write(&nbd, "rw", 12 * MIB, 4096, 0x33);
    for job in ["b1", "b2"] {
        qmp.ok("block-job-set-speed", json!({"device": job, "speed": 0}));
    }
    // In either order.
    let mut ended: Vec<Value> = (0..2).map(|_| qmp.await_event("BLOCK_JOB_COMPLETED", json!({}))).collect();
    ended.sort_by_key(|done| done["device"].as_str().map(str::to_owned));
    assert_eq!((&ended[0]["device"], &ended[1]["device"]), (&json!("b1"), &json!("b2")));
    assert!(ended.iter().all(|done| done.get("error").is_none()), "{ended:?}");
    assert_eq!(mismatches(&dir.path("t1.img"), |_| 0x11), None, "b1: the disk before both writes");
    let at_b2 = |at: u64| if (4 * MIB..5 * MIB).contains(&at) { 0x22 } else { 0x11 };
    assert_eq!(mismatches(&dir.path("t2.img"), at_b2), None, "b2: the disk after the first write only");
    let now = |at: u64| match at {
        _ if (4 * MIB + 512 * KIB..5 * MIB + 512 * KIB).contains(&at) => 0x33,
        _ if (12 * MIB..12 * MIB + 4096).contains(&at) => 0x33,
        _ => at_b2(at),
    };
    assert_eq!(mismatches(&dir.path("disk.img"), now), None, "the disk has every write");
}

/// `sync=top` of an overlay copies the clusters the overlay holds itself,
/// whole (backing bytes included), and nothing of its backing file: the
/// target ends byte for byte as qemu-storage-daemon leaves it.
#[test]
fn sync_top_of_an_overlay_copies_what_qemu_copies() {
    let size = 8 * MIB;
    let run_backup = |program: fn(&Scratch, &[String]) -> Daemon, name: &str| {
        let dir = Scratch::new(name);
        let (base, top) = (dir.path("base.qcow2"), dir.path("top.qcow2"));
        let img = |args: &[&str]| assert!(run("qemu-img", args).status.success(), "qemu-img {args:?}");
        img(&["create", "-q", "-f", "qcow2", base.to_str().unwrap(), "8M"]);
        img(&["create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", top.to_str().unwrap()]);
        let io = |image: &Path, commands: &[&str]| {
            let mut args = vec!["-f", "qcow2"];
            commands.iter().for_each(|c| args.extend(["-c", c]));
            args.push(image.to_str().unwrap());
            assert!(run("qemu-io", &args).status.success(), "qemu-io {args:?}");
        };
        io(&base, &["write -q -P 0x11 0 8M"]);
        io(&top, &["write -q -P 0x22 1052672 4096", "write -q -P 0x33 5M 128K", "write -q -z 7M 64K"]);
        let target = dir.image("tgt.img", size);
        let socket = dir.path("qmp.sock");
        let mut args: Vec<String> = [
            format!("driver=file,node-name=topf,filename={}", top.display()),
            "driver=qcow2,node-name=top,file=topf".into(),
            format!("driver=file,node-name=tgt,filename={}", target.display()),
        ]
        .into_iter()
        .flat_map(|b| ["--blockdev".to_string(), b])
        .collect();
        args.extend(monitor(&socket));
        let daemon = program(&dir, &args);
        let mut qmp = Qmp::connect(&socket);
        qmp.ok("blockdev-backup", json!({"job-id": "t", "device": "top", "target": "tgt", "sync": "top"}));
        let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "t"}));
        drop(daemon);
        (done, std::fs::read(&target).unwrap())
    };
    let (vsd, qsd) = (run_backup(Daemon::vsd, "backup-top-vsd"), run_backup(Daemon::qsd, "backup-top-qsd"));
    assert_eq!(vsd.0, qsd.0, "BLOCK_JOB_COMPLETED");
    let expect = |at: u64| match at {
        _ if (MIB + 4096..MIB + 8192).contains(&at) => 0x22,
        _ if (MIB..MIB + CLUSTER).contains(&at) => 0x11,
        _ if (5 * MIB..5 * MIB + 128 * KIB).contains(&at) => 0x33,
        _ => 0,
    };
    let wrong = (0..size).find(|&at| vsd.1[at as usize] != expect(at));
    assert_eq!(wrong, None, "vsd's target");
    assert!(vsd.1 == qsd.1, "vsd's and qemu-storage-daemon's targets differ");
}

/// The `dirty-bitmaps` entry of bitmap `name` on node `node`.
fn bitmap(qmp: &mut Qmp, node: &str, name: &str) -> Value {
    let nodes = qmp.ok("query-named-block-nodes", json!({}));
    let node = nodes.as_array().unwrap().iter().find(|n| n["node-name"] == node).unwrap().clone();
    node["dirty-bitmaps"].as_array().unwrap().iter().find(|b| b["name"] == name).unwrap().clone()
}

#[test]
fn incremental_backups_copy_the_dirty_clusters_and_keep_the_bitmap_right() {
    let dir = Scratch::new("backup-incremental");
    let size = 16 * MIB;
    let (_daemon, mut qmp) = served_disk(&dir, size, &["full", "inc", "inc2"], &[]);
    let nbd = dir.path("nbd.sock");
    qmp.ok("block-dirty-bitmap-add", json!({"node": "disk", "name": "b", "granularity": 65536}));
    nbd_write(&nbd, "rw", 0, size, 0x11);
    let full = json!({"job-id": "full", "device": "disk", "target": "full", "sync": "full", "bitmap": "b", "bitmap-mode": "on-success"});
    qmp.ok("blockdev-backup", full);
    qmp.await_event("JOB_STATUS_CHANGE", json!({"status": "null", "id": "full"}));
    assert_eq!(bitmap(&mut qmp, "disk", "b")["count"], json!(0), "a full backup with the bitmap clears it");
    assert_eq!(mismatches(&dir.path("full.img"), |_| 0x11), None);

    let changed = [(MIB, 4 * KIB), (5 * MIB - 4 * KIB, 8 * KIB), (9 * MIB, 128 * KIB)];
    for (offset, len) in changed {
        nbd_write(&nbd, "rw", offset, len, 0x22);
    }
    assert_eq!(bitmap(&mut qmp, "disk", "b")["count"], json!(5 * CLUSTER));
    let inc =
        json!({"job-id": "inc", "device": "disk", "target": "inc", "sync": "incremental", "bitmap": "b", "speed": 1});
    qmp.ok("blockdev-backup", inc);
    assert_eq!(bitmap(&mut qmp, "disk", "b")["busy"], json!(true));
    // During the job: a cluster outside it, and one it has yet to copy.
    nbd_write(&nbd, "rw", 12 * MIB, 4 * KIB, 0x33);
    nbd_write(&nbd, "rw", 9 * MIB + 64 * KIB, 4 * KIB, 0x33);
    let jobs = qmp.ok("query-jobs", json!({}));
    assert_eq!(jobs[0]["total-progress"], json!(5 * CLUSTER));
    qmp.ok("block-job-set-speed", json!({"device": "inc", "speed": 0}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "inc"}));
    assert_eq!(done["len"], json!(5 * CLUSTER));
    qmp.await_event("JOB_STATUS_CHANGE", json!({"status": "null", "id": "inc"}));
    let before_job = |at: u64| if changed.iter().any(|(o, l)| (*o..o + l).contains(&at)) { 0x22 } else { 0x11 };
    let dirty =
        |at: u64| changed.iter().any(|(o, l)| at / CLUSTER >= o / CLUSTER && at / CLUSTER <= (o + l - 1) / CLUSTER);
    let wrong = mismatches(&dir.path("inc.img"), |at| if dirty(at) { before_job(at) } else { 0 });
    assert_eq!(wrong, None, "the dirty clusters as they were, nothing else");
    let after = bitmap(&mut qmp, "disk", "b");
    assert_eq!(
        (after["count"].clone(), after["busy"].clone()),
        (json!(2 * CLUSTER), json!(false)),
        "the writes made during the job"
    );

    let inc2 =
        json!({"job-id": "inc2", "device": "disk", "target": "inc2", "sync": "incremental", "bitmap": "b", "speed": 1});
    qmp.ok("blockdev-backup", inc2);
    qmp.ok("job-cancel", json!({"id": "inc2"}));
    qmp.await_event("BLOCK_JOB_CANCELLED", json!({"device": "inc2"}));
    qmp.await_event("JOB_STATUS_CHANGE", json!({"status": "null", "id": "inc2"}));
    assert_eq!(bitmap(&mut qmp, "disk", "b")["count"], json!(2 * CLUSTER), "a cancelled job gives the bits back");
}

/// A blkdebug node `bad` over a file node, failing writes as `rules` say.
fn failing_target(dir: &Scratch, size: u64, rules: &str) -> Vec<String> {
    let image = dir.image("bad.img", size);
    vec![
        "--blockdev".into(),
        format!("driver=file,node-name=badfile,filename={}", image.display()),
        "--blockdev".into(),
        format!("driver=blkdebug,node-name=bad,image=badfile{rules}"),
    ]
}

#[test]
fn a_failing_target_fails_the_job_and_never_the_guest() {
    let dir = Scratch::new("backup-failing");
    let size = 16 * MIB;
    let rules = ",inject-error.0.iotype=write,inject-error.0.sector=16384";
    let (_daemon, mut qmp) = served_disk(&dir, size, &[], &failing_target(&dir, size, rules));
    let nbd = dir.path("nbd.sock");
    qmp.ok("block-dirty-bitmap-add", json!({"node": "disk", "name": "b", "granularity": 65536}));
    nbd_write(&nbd, "rw", 0, size, 0x11);

    // Copied in order up to the failing 8 MiB: `always` keeps the rest dirty.
    let args = json!({"job-id": "m", "device": "disk", "target": "bad", "sync": "bitmap", "bitmap": "b", "bitmap-mode": "always"});
    qmp.ok("blockdev-backup", args);
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "m"}));
    assert_eq!((done["error"].clone(), done["offset"].clone()), (json!("Input/output error"), json!(8 * MIB)));
    qmp.await_event("JOB_STATUS_CHANGE", json!({"status": "null", "id": "m"}));
    assert_eq!(bitmap(&mut qmp, "disk", "b")["count"], json!(8 * MIB), "what was not copied");

    qmp.ok("blockdev-backup", json!({"job-id": "f", "device": "disk", "target": "bad", "sync": "full"}));
    let error = qmp.await_event("BLOCK_JOB_ERROR", json!({"device": "f"}));
    assert_eq!(error, json!({"device": "f", "operation": "write", "action": "report"}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "f"}));
    assert_eq!(done["error"], json!("Input/output error"));
    qmp.await_event("JOB_STATUS_CHANGE", json!({"status": "null", "id": "f"}));

    // A guest write whose old data cannot be copied fails the job, not the write.
    qmp.ok("blockdev-backup", json!({"job-id": "g", "device": "disk", "target": "bad", "sync": "full", "speed": 1}));
    nbd_write(&nbd, "rw", 8 * MIB, 4096, 0x22);
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "g"}));
    assert_eq!(done["error"], json!("Input/output error"));
    nbd_write(&nbd, "rw", 8 * MIB + 4096, 4096, 0x22);
    let source = |at: u64| if (8 * MIB..8 * MIB + 8192).contains(&at) { 0x22 } else { 0x11 };
    assert_eq!(mismatches(&dir.path("disk.img"), source), None, "the source has every write");
}

#[test]
fn a_stopped_job_waits_for_resume_and_then_succeeds() {
    let dir = Scratch::new("backup-stop");
    let size = 16 * MIB;
    let rules = ",inject-error.0.iotype=write,inject-error.0.sector=16384,inject-error.0.once=on";
    let (_daemon, mut qmp) = served_disk(&dir, size, &[], &failing_target(&dir, size, rules));
    nbd_write(&dir.path("nbd.sock"), "rw", 0, size, 0x11);
    let args = json!({"job-id": "s", "device": "disk", "target": "bad", "sync": "full", "on-target-error": "stop"});
    qmp.ok("blockdev-backup", args);
    let error = qmp.await_event("BLOCK_JOB_ERROR", json!({"device": "s"}));
    assert_eq!(error["action"], json!("stop"));
    qmp.await_event("JOB_STATUS_CHANGE", json!({"status": "paused", "id": "s"}));
    let jobs = qmp.ok("query-block-jobs", json!({}));
    assert_eq!((jobs[0]["io-status"].clone(), jobs[0]["paused"].clone()), (json!("failed"), json!(true)));
    qmp.ok("job-resume", json!({"id": "s"}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "s"}));
    assert!(done.get("error").is_none(), "{done}");
}

#[test]
fn a_daemon_stops_with_a_job_running() {
    let dir = Scratch::new("backup-quit");
    let (daemon, mut qmp) = served_disk(&dir, 16 * MIB, &["tgt"], &[]);
    qmp.ok("blockdev-backup", json!({"job-id": "q", "device": "disk", "target": "tgt", "sync": "none"}));
    let started = Instant::now();
    assert!(daemon.stop().success());
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn sync_none_into_a_scratch_over_the_source_serves_the_old_data() {
    let dir = Scratch::new("backup-fleecing");
    let size = 16 * MIB;
    let scratch = dir.path("scratch.qcow2");
    let out = run("qemu-img", &["create", "-q", "-f", "qcow2", scratch.to_str().unwrap(), "16M"]);
    assert!(out.status.success());
    let fleece = vec![
        "--blockdev".into(),
        format!("driver=file,node-name=sf,filename={}", scratch.display()),
        "--blockdev".into(),
        "driver=qcow2,node-name=fleece,file=sf,backing=disk".into(),
    ];
    let (_daemon, mut qmp) = served_disk(&dir, size, &[], &fleece);
    let nbd = dir.path("nbd.sock");
    nbd_write(&nbd, "rw", 0, size, 0x11);
    qmp.ok("blockdev-backup", json!({"job-id": "n", "device": "disk", "target": "fleece", "sync": "none"}));
    qmp.ok("block-export-add", json!({"type": "nbd", "id": "view", "node-name": "fleece", "name": "view"}));
    nbd_write(&nbd, "rw", 2 * MIB - 4096, CLUSTER, 0x22);
    nbd_write(&nbd, "rw", 9 * MIB, 4096, 0);
    let uri = format!("nbd+unix:///view?socket={}", nbd.display());
    let out = run("qemu-io", &["-r", "-f", "raw", "-c", "read -P 17 0 16M", &uri]);
    assert!(
        out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("Pattern verification failed"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let jobs = qmp.ok("query-jobs", json!({}));
    assert_eq!(jobs[0]["current-progress"], json!(3 * CLUSTER), "the old data of three clusters was copied");
    let refused = qmp.answer("blockdev-del", json!({"node-name": "fleece"}));
    assert_eq!(refused["error"]["desc"], json!("Node 'fleece' is busy: block device is in use by block job: backup"));
    // qemu-io has hung up; the server may not have seen it yet.
    let deadline = Instant::now() + Duration::from_secs(10);
    while qmp.answer("block-export-del", json!({"id": "view"})).get("error").is_some() {
        assert!(Instant::now() < deadline, "the export is still in use after its client left");
        std::thread::sleep(Duration::from_millis(20));
    }
    qmp.ok("job-cancel", json!({"id": "n"}));
    qmp.await_event("BLOCK_JOB_CANCELLED", json!({"device": "n"}));
    let source = |at: u64| match at {
        _ if (2 * MIB - 4096..2 * MIB - 4096 + CLUSTER).contains(&at) => 0x22,
        _ if (9 * MIB..9 * MIB + 4096).contains(&at) => 0,
        _ => 0x11,
    };
    assert_eq!(mismatches(&dir.path("disk.img"), source), None);
}

#[test]
fn what_vsd_refuses_beyond_qemu() {
    let dir = Scratch::new("backup-refusals");
    let (_daemon, mut qmp) = served_disk(&dir, 16 * MIB, &["tgt", "tgt2"], &[]);
    let below = qmp.answer("blockdev-backup", json!({"job-id": "x", "device": "disk", "target": "f0", "sync": "full"}));
    assert_eq!(below["error"]["desc"], json!("Target 'f0' is below source 'disk'"));
    qmp.ok("blockdev-backup", json!({"job-id": "a", "device": "disk", "target": "tgt", "sync": "full", "speed": 1}));
    let resize = qmp.answer("block_resize", json!({"node-name": "tgt", "size": 32 * MIB}));
    assert_eq!(resize["error"]["desc"], json!("Node 'tgt' is busy: block device is in use by block job: backup"));
    let compress = qmp.answer(
        "blockdev-backup",
        json!({"job-id": "c", "device": "tgt2", "target": "disk", "sync": "full", "compress": true}),
    );
    assert_eq!(compress["error"]["desc"], json!("Compression is not supported for this drive "));
    qmp.ok("job-cancel", json!({"id": "a"}));
    qmp.await_event("JOB_STATUS_CHANGE", json!({"status": "null", "id": "a"}));
    qmp.ok("block_resize", json!({"node-name": "tgt", "size": 32 * MIB}));
}

#[test]
fn a_source_read_error_is_retried_under_ignore() {
    let dir = Scratch::new("backup-source-error");
    let size = 16 * MIB;
    let image = dir.image("src.img", size);
    std::fs::write(&image, common::pattern(7, size as usize)).unwrap();
    let mut args = vec![
        "--blockdev".into(),
        format!("driver=file,node-name=sf,filename={}", image.display()),
        "--blockdev".into(),
        "driver=blkdebug,node-name=src,image=sf,inject-error.0.iotype=read,inject-error.0.sector=8192,inject-error.0.once=on".into(),
    ];
    args.extend(file_nodes(&dir, &[("tgt", size)]));
    let socket = dir.path("qmp.sock");
    args.extend(monitor(&socket));
    let _daemon = Daemon::vsd(&dir, &args);
    let mut qmp = Qmp::connect(&socket);
    let backup = json!({"job-id": "r", "device": "src", "target": "tgt", "sync": "full", "on-source-error": "ignore"});
    qmp.ok("blockdev-backup", backup);
    let error = qmp.await_event("BLOCK_JOB_ERROR", json!({"device": "r"}));
    assert_eq!(error, json!({"device": "r", "operation": "read", "action": "ignore"}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "r"}));
    assert!(done.get("error").is_none(), "{done}");
    let out = run(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", image.to_str().unwrap(), dir.path("tgt.img").to_str().unwrap()],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
}

#[test]
fn a_transaction_starts_a_backup_and_a_checkpoint_at_one_point_in_time() {
    let dir = Scratch::new("backup-transaction");
    let size = 16 * MIB;
    let (_daemon, mut qmp) = served_disk(&dir, size, &["full", "inc"], &[]);
    let nbd = dir.path("nbd.sock");
    nbd_write(&nbd, "rw", 0, size, 0x11);
    let action = |kind: &str, data: Value| json!({"type": kind, "data": data});
    // libvirt's first checkpoint: a bitmap and a full backup, together.
    let full = json!({"job-id": "full", "device": "disk", "target": "full", "sync": "full", "speed": 1});
    let ck1 = json!({"node": "disk", "name": "ck1", "granularity": 65536});
    qmp.ok("transaction", json!({"actions": [action("block-dirty-bitmap-add", ck1), action("blockdev-backup", full)]}));
    nbd_write(&nbd, "rw", 3 * MIB, 4 * KIB, 0x22);
    nbd_write(&nbd, "rw", 7 * MIB, 2 * CLUSTER, 0x22);
    qmp.ok("block-job-set-speed", json!({"device": "full", "speed": 0}));
    qmp.await_event("JOB_STATUS_CHANGE", json!({"status": "null", "id": "full"}));
    assert_eq!(mismatches(&dir.path("full.img"), |_| 0x11), None, "the disk at the transaction");
    assert_eq!(bitmap(&mut qmp, "disk", "ck1")["count"], json!(3 * CLUSTER), "every write after it, nothing before");

    // The next checkpoint and the incremental backup of the first, together.
    let ck2 = json!({"node": "disk", "name": "ck2", "granularity": 65536});
    let inc = json!({"job-id": "inc", "device": "disk", "target": "inc", "sync": "incremental", "bitmap": "ck1"});
    let actions = [
        action("block-dirty-bitmap-add", ck2),
        action("block-dirty-bitmap-disable", json!({"node": "disk", "name": "ck1"})),
        action("blockdev-backup", inc),
    ];
    qmp.ok("transaction", json!({"actions": actions}));
    qmp.await_event("JOB_STATUS_CHANGE", json!({"status": "null", "id": "inc"}));
    let changed =
        |at: u64| (3 * MIB..3 * MIB + CLUSTER).contains(&at) || (7 * MIB..7 * MIB + 2 * CLUSTER).contains(&at);
    let written =
        |at: u64| (3 * MIB..3 * MIB + 4 * KIB).contains(&at) || (7 * MIB..7 * MIB + 2 * CLUSTER).contains(&at);
    let expect = |at: u64| {
        if written(at) {
            0x22
        } else if changed(at) {
            0x11
        } else {
            0
        }
    };
    assert_eq!(mismatches(&dir.path("inc.img"), expect), None, "the clusters written since the first checkpoint");

    // All or nothing: a backup started by a failing transaction is cancelled.
    let again = json!({"job-id": "again", "device": "disk", "target": "full", "sync": "full", "speed": 1});
    let clash = json!({"node": "disk", "name": "ck2"});
    let actions = [action("blockdev-backup", again), action("block-dirty-bitmap-add", clash)];
    let refused = qmp.answer("transaction", json!({ "actions": actions }));
    assert_eq!(refused["error"]["desc"], json!("Bitmap already exists: ck2"), "{refused}");
    qmp.await_event("BLOCK_JOB_CANCELLED", json!({"device": "again"}));
    qmp.await_event("JOB_STATUS_CHANGE", json!({"status": "null", "id": "again"}));
    assert_eq!(qmp.ok("query-jobs", json!({})), json!([]));
    // Only jobs complete as a group, in QEMU's words.
    let add = action("block-dirty-bitmap-add", json!({"node": "disk", "name": "g"}));
    let grouped = json!({"actions": [add], "properties": {"completion-mode": "grouped"}});
    let refused = qmp.answer("transaction", grouped);
    let want = "Action 'block-dirty-bitmap-add' does not support transaction property completion-mode = grouped";
    assert_eq!(refused["error"]["desc"], json!(want));
}

/// vsd serving qcow2 `image` as node `disk` (writable over NBD as `rw`)
/// with a file node `tgt` of `size` bytes for a backup, and QMP.
fn served_qcow2(dir: &Scratch, image: &Path, size: u64) -> (Daemon, Qmp) {
    let qmp_socket = dir.path("qmp.sock");
    let mut args = common::qcow2_over_nbd(dir, image);
    let _ = std::fs::remove_file(dir.path("tgt.img"));
    args.extend(file_nodes(dir, &[("tgt", size)]));
    args.extend(monitor(&qmp_socket));
    let daemon = Daemon::vsd(dir, &args);
    let qmp = Qmp::connect(&qmp_socket);
    (daemon, qmp)
}

#[test]
fn a_kill_during_a_backup_leaves_the_source_clean_and_its_checkpoint_inconsistent() {
    let dir = Scratch::new("backup-kill");
    let size = 16 * MIB;
    let image = dir.path("disk.qcow2");
    let img = image.to_str().unwrap();
    assert!(run("qemu-img", &["create", "-q", "-f", "qcow2", img, "16M"]).status.success());
    // A checkpoint the image holds (one added over QMP is stored at a clean stop).
    assert!(run("qemu-img", &["bitmap", "--add", img, "ck"]).status.success());
    let (daemon, mut qmp) = served_qcow2(&dir, &image, size);
    nbd_write(&dir.path("nbd.sock"), "rw", 0, 4 * MIB, 0x11);
    let backup =
        json!({"job-id": "b", "device": "disk", "target": "tgt", "sync": "incremental", "bitmap": "ck", "speed": 1});
    qmp.ok("blockdev-backup", backup);
    nbd_write(&dir.path("nbd.sock"), "rw", MIB, 64 * KIB, 0x22); // waits for its copy-before-write
    daemon.kill();
    common::wait_until_unlocked(&image);

    let check = run("qemu-img", &["check", img]);
    assert!(check.status.success(), "the source is clean: {}", String::from_utf8_lossy(&check.stdout));
    let info = run("qemu-img", &["info", "--output=json", img]);
    let info: Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(info["format-specific"]["data"]["bitmaps"][0]["flags"], json!(["in-use", "auto"]));

    let (_daemon, mut qmp) = served_qcow2(&dir, &image, size);
    let listed = bitmap(&mut qmp, "disk", "ck");
    assert_eq!(listed["inconsistent"], json!(true), "{listed}");
    let refused = qmp.answer(
        "blockdev-backup",
        json!({"job-id": "i", "device": "disk", "target": "tgt", "sync": "incremental", "bitmap": "ck"}),
    );
    assert!(refused["error"]["desc"].as_str().unwrap().contains("inconsistent"), "{refused}");
    qmp.ok("blockdev-backup", json!({"job-id": "f", "device": "disk", "target": "tgt", "sync": "full"}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "f"}));
    assert!(done.get("error").is_none(), "a new full backup works: {done}");
    let expect = |at: u64| match at {
        _ if (MIB..MIB + 64 * KIB).contains(&at) => 0x22,
        _ if at < 4 * MIB => 0x11,
        _ => 0,
    };
    assert_eq!(mismatches(&dir.path("tgt.img"), expect), None);
}

/// A push backup onto another host's disk: the target is a `driver=nbd`
/// node on qemu-storage-daemon's export, added over QMP; a write during
/// the job waits for its old data to reach it, and the copy is the disk
/// as it was when the job started.
#[test]
fn a_backup_onto_an_nbd_export_of_qemu_storage_daemon() {
    let dir = Scratch::new("backup-to-nbd");
    let size = 16 * MIB;
    let (_daemon, mut qmp) = served_disk(&dir, size, &[], &[]);
    let nbd = dir.path("nbd.sock");
    nbd_write(&nbd, "rw", 0, size, 0x11);
    let far = Scratch::new("backup-to-nbd-far");
    let target = far.image("target.img", size);
    let qsd = Daemon::qsd(
        &far,
        &[
            "--blockdev".into(),
            format!("driver=file,node-name=t0,filename={}", target.display()),
            "--nbd-server".into(),
            format!("addr.type=unix,addr.path={}", far.path("nbd.sock").display()),
            "--export".into(),
            "type=nbd,id=e0,node-name=t0,name=backup,writable=on".into(),
        ],
    );
    let server = json!({"type": "unix", "path": far.path("nbd.sock")});
    qmp.ok("blockdev-add", json!({"driver": "nbd", "node-name": "tgt", "server": server, "export": "backup"}));
    qmp.ok("blockdev-backup", json!({"job-id": "b", "device": "disk", "target": "tgt", "sync": "full", "speed": 1}));
    nbd_write(&nbd, "rw", 8 * MIB, 64 * KIB, 0x22);
    qmp.ok("block-job-set-speed", json!({"device": "b", "speed": 0}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "b"}));
    assert!(done.get("error").is_none(), "{done}");
    qmp.ok("blockdev-del", json!({"node-name": "tgt"}));
    drop(qsd);
    assert_eq!(mismatches(&target, |_| 0x11), None, "the remote copy is the disk before the job");
}
