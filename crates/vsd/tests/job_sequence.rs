//! The guest test's sequence of jobs (`guest_jobs.rs`) driven by QMP with
//! a client writing through the live export: a snapshot, an active commit
//! with its switch, a second snapshot streamed, and a write-blocking mirror
//! onto another vsd over NBD with its switch. After each step, QEMU's tools
//! say where the writes landed: in which image (`qemu-img map`), holding
//! what (`qemu-io -U`), and every image is clean at the end.

mod common;

use std::path::{Path, PathBuf};

use common::images::{BLOCK, MIB, first_mismatch, first_mismatch_read, info};
use common::qmp::Qmp;
use common::{Daemon, Scratch, monitor, ok};
use serde_json::{Value, json};
use vsd_bench::{ClientOptions, Queue};

const SIZE: u64 = 16 * MIB;
/// What the disk holds before the first step.
const FIRST: u8 = 0x11;

/// The byte step `n` writes over MiB `n` (step 0 is the disk as made).
fn step_byte(n: u64) -> u8 {
    0x20 + n as u8
}

/// What the disk reads at `at` once steps `1..=steps` have written.
fn after(steps: u64) -> impl Fn(u64) -> u8 {
    move |at| if (1..=steps).contains(&(at / MIB)) { step_byte(at / MIB) } else { FIRST }
}

/// Step `n`'s write through the export, flushed: MiB `n` holds its byte.
fn write_step(queue: &mut Queue, n: u64) {
    for block in 0..MIB / BLOCK {
        queue.write_at(n * MIB + block * BLOCK, &[step_byte(n); BLOCK as usize]).unwrap();
    }
    queue.flush().unwrap();
}

fn path_str(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// How many layers down `image`'s chain the bytes at `at` are stored (0:
/// in `image` itself), as `qemu-img map` says it.
fn depth_at(image: &Path, at: u64) -> u64 {
    let map: Value = serde_json::from_str(&ok("qemu-img", &["map", "-U", "--output=json", path_str(image)])).unwrap();
    let extent = map.as_array().unwrap().iter().find(|e| {
        let (start, length) = (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap());
        (start..start + length).contains(&at)
    });
    extent.unwrap_or_else(|| panic!("no extent of {} at {at}: {map}", image.display()))["depth"].as_u64().unwrap()
}

/// Whether MiB `n` of `image` (qcow2, read through its chain) holds `byte`.
fn holds(image: &Path, n: u64, byte: u8) -> bool {
    let command = format!("read -P {byte:#x} {} {MIB}", n * MIB);
    let out = common::run("qemu-io", &["-U", "-r", "-f", "qcow2", "-c", &command, path_str(image)]);
    out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("Pattern verification failed")
}

/// A qcow2 overlay of the disk, added with `backing=null` as node `name`.
fn overlay(qmp: &mut Qmp, disk: &Path, image: &Path, name: &str) {
    ok("qemu-img", &["create", "-q", "-f", "qcow2", "-b", path_str(disk), "-F", "qcow2", path_str(image)]);
    let file = json!({"driver": "file", "filename": image});
    qmp.ok("blockdev-add", json!({"driver": "qcow2", "node-name": name, "file": file, "backing": null}));
}

fn node_served(qmp: &mut Qmp) -> Value {
    qmp.ok("query-block-exports", json!({}))[0]["node-name"].clone()
}

/// A job run to its end: ready then completed if `complete`, else completed.
fn run_job(qmp: &mut Qmp, command: &str, args: Value, complete: bool) {
    let id = args["job-id"].clone();
    qmp.ok(command, args);
    if complete {
        qmp.await_event("BLOCK_JOB_READY", json!({"device": id}));
        qmp.ok("job-complete", json!({"id": id}));
    }
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": id}));
    assert!(done.get("error").is_none(), "{command}: {done}");
}

/// Another vsd serving a raw image of the disk's size over NBD.
fn far_vsd(far: &Scratch) -> (Daemon, PathBuf) {
    let image = far.image("far.img", SIZE);
    let args = vec![
        "--blockdev".into(),
        format!("driver=file,node-name=far0,filename={}", image.display()),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", far.path("nbd.sock").display()),
        "--export".into(),
        "type=nbd,id=n0,node-name=far0,name=disk,writable=on".into(),
    ];
    (Daemon::vsd(far, &args), image)
}

#[test]
fn snapshot_commit_stream_and_mirror_put_each_write_where_qemu_would() {
    let (dir, far) = (Scratch::new("job-sequence"), Scratch::new("job-sequence-far"));
    let [disk, first, second] = ["disk", "first", "second"].map(|n| dir.path(&format!("{n}.qcow2")));
    ok("qemu-img", &["create", "-q", "-f", "qcow2", path_str(&disk), &SIZE.to_string()]);
    ok("qemu-io", &["-f", "qcow2", "-c", &format!("write -P {FIRST:#x} 0 {SIZE}"), path_str(&disk)]);
    let mut args = common::qcow2_export(&disk, &dir.path("vhost.sock"), ",writable=on");
    args.extend(monitor(&dir.path("qmp.sock")));
    let daemon = Daemon::vsd(&dir, &args);
    let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();

    // 1. A live snapshot: the next write lands in the overlay alone.
    overlay(&mut qmp, &disk, &first, "s1");
    qmp.ok("blockdev-snapshot", json!({"node": "q0", "overlay": "s1"}));
    write_step(&mut queue, 1);
    assert_eq!((depth_at(&first, MIB), depth_at(&first, 0)), (0, 1), "step 1 in the overlay, the rest below");
    assert!(holds(&disk, 1, FIRST), "the disk below did not take step 1");

    // 2. An active commit: the overlay's writes go into the disk, which the
    //    export serves again; the next write lands in the disk, not the overlay.
    run_job(&mut qmp, "block-commit", json!({"job-id": "commit", "device": "s1"}), true);
    assert_eq!(node_served(&mut qmp), json!("q0"));
    write_step(&mut queue, 2);
    assert!(holds(&disk, 1, step_byte(1)) && holds(&disk, 2, step_byte(2)), "steps 1 and 2 in the disk");
    assert_eq!(depth_at(&first, 2 * MIB), 1, "the old overlay did not take step 2");
    qmp.ok("blockdev-del", json!({"node-name": "s1"}));

    // 3. A second snapshot, streamed: the overlay holds every byte itself
    //    and names no backing file any more; the disk took nothing more.
    overlay(&mut qmp, &disk, &second, "s2");
    qmp.ok("blockdev-snapshot", json!({"node": "q0", "overlay": "s2"}));
    write_step(&mut queue, 3);
    assert_eq!((depth_at(&second, 3 * MIB), depth_at(&second, 0)), (0, 1));
    run_job(&mut qmp, "block-stream", json!({"job-id": "stream", "device": "s2"}), false);
    write_step(&mut queue, 4);
    assert_eq!(info(&second).get("backing-filename"), None, "{}", info(&second));
    assert!((0..SIZE).step_by(MIB as usize).all(|at| depth_at(&second, at) == 0), "all streamed");
    assert!(holds(&disk, 3, FIRST) && holds(&disk, 4, FIRST), "the disk took neither step 3 nor 4");

    // 4. A write-blocking mirror onto another vsd: once ready, a write is
    //    on the far image before the switch; after it, on the far image alone.
    let (remote, far_image) = far_vsd(&far);
    let server = json!({"type": "unix", "path": far.path("nbd.sock")});
    qmp.ok("blockdev-add", json!({"driver": "nbd", "node-name": "far", "server": server, "export": "disk"}));
    let mirror =
        json!({"job-id": "move", "device": "s2", "target": "far", "sync": "full", "copy-mode": "write-blocking"});
    qmp.ok("blockdev-mirror", mirror);
    qmp.await_event("BLOCK_JOB_READY", json!({"device": "move"}));
    write_step(&mut queue, 5);
    assert_eq!(first_mismatch(&far_image, after(5)), None, "the far image has step 5 before the switch");
    qmp.ok("job-complete", json!({"id": "move"}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "move"}));
    assert!(done.get("error").is_none(), "{done}");
    assert_eq!(node_served(&mut qmp), json!("far"));
    write_step(&mut queue, 6);
    assert!(holds(&second, 6, FIRST), "the old disk did not take step 6");

    drop(queue);
    drop(client);
    daemon.stop();
    remote.stop();
    for image in [&disk, &first, &second] {
        common::images::assert_clean(image);
    }
    assert_eq!(first_mismatch(&far_image, after(6)), None, "the far image is the disk after every step");
    assert_eq!(first_mismatch_read(&dir, &second, after(5)), None, "the second overlay as at the switch");
    let committed = |at: u64| if at / MIB <= 2 { after(2)(at) } else { FIRST };
    assert_eq!(first_mismatch_read(&dir, &disk, committed), None, "the disk as at the second snapshot");
}
