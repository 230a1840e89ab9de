//! Block jobs under a real Linux guest (QEMU under TCG): while the guest's
//! fio writes with crc32c verification on its vhost-user-blk disk, a qcow2
//! image served by vsd, the disk is backed up, reshaped and moved, one step
//! after the other: a push and a pull backup of one point in time, a live
//! snapshot onto a new overlay, an active commit of the overlay back into
//! the disk, a second snapshot and a stream that makes that overlay take in
//! its whole backing chain, and a mirror onto another vsd over NBD, whose
//! completion moves the guest's disk there. The guest must see every block
//! it wrote, the backups be the disk at their point in time, and every
//! image be as QEMU's tools expect.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::thread::ScopedJoinHandle;
use std::time::{Duration, Instant};

use common::qmp::Qmp;
use common::{Daemon, GuestRun, Scratch, dirty_map, monitor, ok, run};
use serde_json::{Value, json};

const MIB: u64 = 1 << 20;
/// The guest's disk.
const DISK: u64 = 64 * MIB;
/// What fio writes: half the disk, between two jobs (one per queue).
const FIO_SIZE: &str = "32M";
/// Seconds the guest's write pass lasts (the paced job spreads its writes
/// over them): every step must be done within them.
const WRITE_SECS: u64 = 80;
/// Guest writes to wait for between steps: well over a second of them at
/// the paced rate.
const BETWEEN: u64 = 300;

/// Whether the guest's console says its write pass has ended.
fn write_pass_over(console: &Path) -> bool {
    std::fs::read_to_string(console).unwrap_or_default().contains("VSD-GUEST fio_write_status=")
}

/// The writes the guest made through the daemon's one export so far.
fn writes(qmp: &mut Qmp) -> u64 {
    let stats = qmp.ok("query-blockstats", json!({}));
    stats[0]["stats"]["wr_operations"].as_u64().unwrap_or_else(|| panic!("query-blockstats: {stats}"))
}

/// The test's view of the running guest, to fail early and clearly when it
/// stops writing before the test is done with it.
struct Guest<'scope, 'env> {
    console: &'env Path,
    handle: ScopedJoinHandle<'scope, GuestRun>,
}

impl Guest<'_, '_> {
    /// Panics unless the guest is still in its write pass.
    fn assert_writing(&self, what: &str) {
        assert!(!self.handle.is_finished(), "the guest ended before {what}");
        assert!(
            !write_pass_over(self.console),
            "the guest's write pass ended before {what}: the steps took more than its {WRITE_SECS} s"
        );
    }

    /// Waits until the guest has made `more` writes through `qmp`'s export
    /// since now.
    fn wait_for_writes(&self, qmp: &mut Qmp, more: u64, what: &str) {
        let from = writes(qmp);
        let deadline = Instant::now() + Duration::from_secs(60);
        while writes(qmp) < from + more {
            self.assert_writing(what);
            assert!(Instant::now() < deadline, "waited 60 s for {more} guest writes {what}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits for the block job event `name` of job `id`, polling the jobs
    /// (which reads the events that came meanwhile); returns its data.
    fn await_job_event(&self, qmp: &mut Qmp, name: &str, id: &str, limit: Duration) -> Value {
        let deadline = Instant::now() + limit;
        loop {
            let jobs = qmp.ok("query-block-jobs", json!({}));
            let found = qmp.event_log().into_iter().find(|e| e[0] == name && e[1]["device"] == id);
            if let Some(event) = found {
                return event[1].clone();
            }
            self.assert_writing(&format!("{name} of job {id}"));
            assert!(Instant::now() < deadline, "waited {limit:?} for {name} of job {id}; jobs: {jobs}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// The node `query-block-exports` says the daemon's one export serves.
fn node_served(qmp: &mut Qmp) -> Value {
    qmp.ok("query-block-exports", json!({}))[0]["node-name"].clone()
}

/// `qemu-img check` finds nothing wrong with `image`.
fn assert_clean(image: &Path) {
    let check = run("qemu-img", &["check", image.to_str().unwrap()]);
    let report = String::from_utf8_lossy(&check.stdout).into_owned() + &String::from_utf8_lossy(&check.stderr);
    assert!(check.status.success() && report.contains("No errors were found"), "{}: {report}", image.display());
}

fn qemu_img_info(image: &Path) -> Value {
    serde_json::from_str(&ok("qemu-img", &["info", "--output=json", image.to_str().unwrap()])).unwrap()
}

/// The far host: a vsd serving an empty qcow2 image of the disk's size,
/// writable over NBD as export `disk`, with a monitor.
fn far_vsd(far: &Scratch) -> (Daemon, Qmp) {
    let image = far.path("far.qcow2");
    ok("qemu-img", &["create", "-q", "-f", "qcow2", image.to_str().unwrap(), &DISK.to_string()]);
    let mut args = vec![
        "--blockdev".into(),
        format!("driver=file,node-name=ff,filename={}", image.display()),
        "--blockdev".into(),
        "driver=qcow2,node-name=far0,file=ff".into(),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", far.path("nbd.sock").display()),
        "--export".into(),
        "type=nbd,id=n0,node-name=far0,name=disk,writable=on".into(),
    ];
    args.extend(monitor(&far.path("qmp.sock")));
    let daemon = Daemon::vsd(far, &args);
    (daemon, Qmp::connect(&far.path("qmp.sock")))
}

/// A qcow2 image of the disk's size in `dir`, added as node `name` (with
/// `backing` as its backing node, if given).
fn add_image(qmp: &mut Qmp, dir: &Scratch, name: &str, backing: Option<&str>) -> std::path::PathBuf {
    let image = dir.path(&format!("{name}.qcow2"));
    ok("qemu-img", &["create", "-q", "-f", "qcow2", image.to_str().unwrap(), &DISK.to_string()]);
    let file = json!({"driver": "file", "filename": image});
    qmp.ok("blockdev-add", json!({"driver": "qcow2", "node-name": name, "file": file, "backing": backing}));
    image
}

/// Step 0, as libvirt backs up a running disk: one transaction starts a
/// push backup (into a qcow2 image), a pull backup (a fleecing overlay
/// exported over NBD, read by nbdcopy) and a bitmap of the writes from
/// then on, while the guest writes on. Both backups must be the same
/// disk; and a later full backup must equal them wherever the bitmap
/// says nothing was written since: so each is the disk at its start.
fn backups_at_one_point(guest: &Guest, qmp: &mut Qmp, dir: &Scratch) {
    let nbd = dir.path("nbd.sock");
    let push = add_image(qmp, dir, "push", None);
    add_image(qmp, dir, "fleece", Some("q0"));
    let later = add_image(qmp, dir, "later", None);
    let backup = |id: &str, target: &str, sync: &str| json!({"type": "blockdev-backup", "data": {"job-id": id, "device": "q0", "target": target, "sync": sync}});
    let bitmap = json!({"type": "block-dirty-bitmap-add", "data": {"node": "q0", "name": "since"}});
    qmp.ok(
        "transaction",
        json!({"actions": [bitmap, backup("push", "push", "full"), backup("pull", "fleece", "none")]}),
    );
    qmp.ok("block-export-add", json!({"type": "nbd", "id": "pull", "node-name": "fleece", "name": "pull"}));
    let pulled = dir.path("pulled.raw");
    let uri = format!("nbd+unix:///pull?socket={}", nbd.display());
    ok("nbdcopy", &[&uri, pulled.to_str().unwrap()]);
    let done = guest.await_job_event(qmp, "BLOCK_JOB_COMPLETED", "push", Duration::from_secs(60));
    assert!(done.get("error").is_none(), "the push backup failed: {done}");
    guest.wait_for_writes(qmp, BETWEEN, "after the backups' point in time");
    qmp.ok("blockdev-backup", json!({"job-id": "later", "device": "q0", "target": "later", "sync": "full"}));
    let done = guest.await_job_event(qmp, "BLOCK_JOB_COMPLETED", "later", Duration::from_secs(60));
    assert!(done.get("error").is_none(), "the later backup failed: {done}");
    // Stopped after the later backup: clean here means clean in it too
    // (and only a bitmap that records no more is exported, as in QEMU).
    qmp.ok("block-dirty-bitmap-disable", json!({"node": "q0", "name": "since"}));
    qmp.ok(
        "block-export-add",
        json!({"type": "nbd", "id": "map", "node-name": "q0", "name": "map", "bitmaps": ["since"]}),
    );
    let dirty = dirty_map(&nbd, "map", "since");
    assert!(!dirty.is_empty(), "the guest wrote after the point in time");
    for id in ["pull", "map"] {
        qmp.ok("block-export-del", json!({"id": id}));
    }
    qmp.ok("job-cancel", json!({"id": "pull"}));
    guest.await_job_event(qmp, "BLOCK_JOB_CANCELLED", "pull", Duration::from_secs(30));
    for node in ["push", "fleece", "later"] {
        qmp.ok("blockdev-del", json!({"node-name": node}));
    }
    qmp.ok("block-dirty-bitmap-remove", json!({"node": "q0", "name": "since"}));

    let raw = |image: &Path| {
        let out = dir.path(&format!("{}.raw", image.file_stem().unwrap().to_string_lossy()));
        ok("qemu-img", &["convert", "-O", "raw", image.to_str().unwrap(), out.to_str().unwrap()]);
        std::fs::read(out).unwrap()
    };
    let (pushed, later) = (raw(&push), raw(&later));
    assert!(std::fs::read(&pulled).unwrap() == pushed, "the pull and the push backup are one point in time");
    let mut clean_bytes = 0;
    let mut at = 0;
    for &(start, len) in dirty.iter().chain([&(DISK, 0)]) {
        let (from, to) = (at as usize, start as usize);
        assert!(pushed[from..to] == later[from..to], "bytes {from}..{to}, written by nobody since, differ");
        clean_bytes += to - from;
        at = start + len;
    }
    assert!(clean_bytes > 0, "some of the disk was left alone since: {dirty:?}");
}

/// The guest's fio writes and checks its disk while the disk is snapshotted
/// (qcow2 overlay `s1` on `disk.qcow2`), streamed (`s1` takes in the whole
/// chain and names no backing file any more) and mirrored onto another vsd
/// over NBD (`job-complete` moves the guest's disk there), each step begun
/// once the guest has written more since the last one.
///
/// What proves the data: the guest's write pass writes every block once
/// and checks each one only after all are written, i.e. after every step
/// (it is still writing when the last one is done), against what it wrote
/// there (offset, write number, checksum): a write lost, misplaced or
/// undone by a step fails it. Then a fresh fio process reads everything
/// back, and the guest's MD5 of its whole disk, read through the far vsd,
/// must be the far image's. The overlay stops getting writes at the
/// mirror's switch, so it is not compared with the far image; it and the
/// original image must be consistent (`qemu-img check`).
#[test]
fn a_guest_under_fio_verify_has_its_disk_snapshotted_committed_streamed_and_mirrored_to_another_vsd() {
    let started = Instant::now();
    let dir = Scratch::new("guest-jobs");
    let far = Scratch::new("guest-jobs-far");
    let (disk, overlay, far_image) = (dir.path("disk.qcow2"), dir.path("s1.qcow2"), far.path("far.qcow2"));
    let second = dir.path("s2.qcow2");
    ok("qemu-img", &["create", "-q", "-f", "qcow2", disk.to_str().unwrap(), &DISK.to_string()]);
    let socket = dir.path("vsd.sock");
    let mut args = common::qcow2_export(&disk, &socket, ",writable=on,num-queues=2");
    args.extend(["--nbd-server".into(), format!("addr.type=unix,addr.path={}", dir.path("nbd.sock").display())]);
    args.extend(monitor(&dir.path("qmp.sock")));
    let vsd = Daemon::vsd(&dir, &args);
    let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
    let console = dir.path("console.log");

    let (remote, run) = std::thread::scope(|s| {
        let handle = s.spawn(|| {
            let runtime = WRITE_SECS.to_string();
            let args = ["--socket", socket.to_str().unwrap(), "--queues", "2", "--size", FIO_SIZE, "--bs", "4k"];
            let paced = ["--job", "paced", "--runtime", &runtime, "--timeout", "300"];
            common::guest_job(&console, args.iter().chain(&paced))
        });
        let guest = Guest { console: &console, handle };

        // The guest boots (slowly, under TCG) and starts writing.
        let deadline = Instant::now() + Duration::from_secs(180);
        while !std::fs::read_to_string(&console).unwrap_or_default().contains("VSD-GUEST fio_write_iops_per_job=") {
            assert!(!guest.handle.is_finished(), "the guest ended before fio started");
            assert!(Instant::now() < deadline, "fio did not start in the guest within 180 s");
            std::thread::sleep(Duration::from_millis(100));
        }
        guest.wait_for_writes(&mut qmp, BETWEEN, "as fio starts");
        let boot_done = started.elapsed();

        // 0. A push and a pull backup of one point in time.
        backups_at_one_point(&guest, &mut qmp, &dir);

        // 1. A live snapshot: the disk becomes the backing node of a new
        //    overlay, which the export serves from then on.
        let (d, o) = (disk.to_str().unwrap(), overlay.to_str().unwrap());
        ok("qemu-img", &["create", "-q", "-f", "qcow2", "-b", d, "-F", "qcow2", o, &DISK.to_string()]);
        let file = json!({"driver": "file", "filename": overlay});
        qmp.ok("blockdev-add", json!({"driver": "qcow2", "node-name": "s1", "file": file, "backing": null}));
        guest.wait_for_writes(&mut qmp, BETWEEN, "before the snapshot");
        qmp.ok("blockdev-snapshot", json!({"node": "q0", "overlay": "s1"}));
        assert_eq!(node_served(&mut qmp), json!("s1"), "the export serves the overlay");

        // 2. An active commit: what the guest wrote to the overlay goes
        //    into the disk, and job-complete moves the export back onto it.
        guest.wait_for_writes(&mut qmp, BETWEEN, "on the overlay, before the commit");
        let before = writes(&mut qmp);
        qmp.ok("block-commit", json!({"job-id": "commit0", "device": "s1", "speed": 16 * MIB}));
        let ready = guest.await_job_event(&mut qmp, "BLOCK_JOB_READY", "commit0", Duration::from_secs(90));
        assert_eq!(ready["len"], ready["offset"], "{ready}");
        guest.wait_for_writes(&mut qmp, BETWEEN, "while the commit is ready");
        assert!(writes(&mut qmp) > before, "the guest wrote during the commit");
        qmp.ok("job-complete", json!({"id": "commit0"}));
        let done = guest.await_job_event(&mut qmp, "BLOCK_JOB_COMPLETED", "commit0", Duration::from_secs(60));
        assert!(done.get("error").is_none(), "the commit failed: {done}");
        assert_eq!(node_served(&mut qmp), json!("q0"), "the export serves the disk again");
        qmp.ok("blockdev-del", json!({"node-name": "s1"}));

        // 3. A second snapshot, then a stream of the whole chain into it
        //    (no base). Its speed keeps it copying for a few seconds of the
        //    guest's writes.
        let (d, o) = (disk.to_str().unwrap(), second.to_str().unwrap());
        ok("qemu-img", &["create", "-q", "-f", "qcow2", "-b", d, "-F", "qcow2", o, &DISK.to_string()]);
        let file = json!({"driver": "file", "filename": second});
        qmp.ok("blockdev-add", json!({"driver": "qcow2", "node-name": "s2", "file": file, "backing": null}));
        qmp.ok("blockdev-snapshot", json!({"node": "q0", "overlay": "s2"}));
        guest.wait_for_writes(&mut qmp, BETWEEN, "on the second overlay, before the stream");
        let before = writes(&mut qmp);
        qmp.ok("block-stream", json!({"job-id": "stream0", "device": "s2", "speed": 8 * MIB}));
        let done = guest.await_job_event(&mut qmp, "BLOCK_JOB_COMPLETED", "stream0", Duration::from_secs(90));
        assert!(done.get("error").is_none(), "the stream failed: {done}");
        assert_eq!((done["len"].as_u64(), done["offset"].as_u64()), (Some(DISK), Some(DISK)), "{done}");
        assert!(writes(&mut qmp) > before, "the guest wrote during the stream");
        let nodes = qmp.ok("query-named-block-nodes", json!({"flat": true}));
        let s2 = nodes.as_array().unwrap().iter().find(|n| n["node-name"] == "s2").unwrap();
        assert_eq!(s2["backing_file_depth"], 0, "the overlay has no backing node any more: {s2}");
        let streamed = started.elapsed();

        // 4. A mirror onto another vsd over NBD; job-complete moves the
        //    guest's disk there.
        let (remote, mut far_qmp) = far_vsd(&far);
        let server = json!({"type": "unix", "path": far.path("nbd.sock")});
        qmp.ok("blockdev-add", json!({"driver": "nbd", "node-name": "far", "server": server, "export": "disk"}));
        guest.wait_for_writes(&mut qmp, BETWEEN, "after the stream, before the mirror");
        let before = writes(&mut qmp);
        let mirror = json!({"job-id": "move", "device": "s2", "target": "far", "sync": "full", "speed": 16 * MIB});
        qmp.ok("blockdev-mirror", mirror);
        let ready = guest.await_job_event(&mut qmp, "BLOCK_JOB_READY", "move", Duration::from_secs(90));
        assert_eq!(ready["len"], ready["offset"], "{ready}");
        assert!(writes(&mut qmp) > before, "the guest wrote during the mirror's copy");
        // Ready, the mirror follows the guest's writes a while.
        guest.wait_for_writes(&mut qmp, BETWEEN, "while the mirror is ready");
        qmp.ok("job-complete", json!({"id": "move"}));
        let done = guest.await_job_event(&mut qmp, "BLOCK_JOB_COMPLETED", "move", Duration::from_secs(60));
        assert!(done.get("error").is_none(), "the mirror failed: {done}");
        assert_eq!(node_served(&mut qmp), json!("far"), "the export serves the far vsd's disk");
        // The guest goes on writing, through the far vsd now. fio checks a
        // job's blocks once it has written all of them (both jobs write at
        // one pace): every check comes after every step.
        let far_before = writes(&mut far_qmp);
        guest.wait_for_writes(&mut qmp, BETWEEN, "through the far vsd");
        assert!(writes(&mut far_qmp) > far_before, "the guest's writes reach the far vsd");
        guest.assert_writing("the test was done with its steps");
        assert_eq!(qmp.ok("query-block-jobs", json!({})), json!([]), "no job left");
        eprintln!(
            "guest_jobs: writing after {boot_done:.0?}, streamed by {streamed:.0?}, moved by {:.0?}",
            started.elapsed()
        );
        (remote, guest.handle.join().expect("the guest's thread"))
    });
    eprintln!("guest_jobs: the guest was done after {:.0?}", started.elapsed());

    let tail: Vec<&str> = run.console.lines().rev().take(40).collect();
    let tail = tail.into_iter().rev().collect::<Vec<_>>().join("\n");
    assert!(run.passed, "guest job failed ({})\n--- console tail ---\n{tail}", run.report);
    let facts: &HashMap<String, String> = &run.facts;
    assert_eq!(facts["job"], "paced", "{facts:?}");
    assert_eq!(facts["capacity_bytes"], DISK.to_string());
    assert_eq!(facts["queues"], "2", "the guest uses both virtqueues");
    assert_eq!(facts["fio_write_status"], "0", "{facts:?}");
    assert_eq!(facts["fio_write_error"], "0", "{facts:?}");
    assert_eq!(facts["fio_verify_status"], "0", "{facts:?}");
    assert_eq!(facts["fio_verify_error"], "0", "{facts:?}");
    assert_eq!(facts["fio_expected_bytes"], (32 * MIB).to_string());
    assert_eq!(facts["fio_write_write_bytes"], facts["fio_expected_bytes"]);
    assert_eq!(facts["fio_write_read_bytes"], facts["fio_expected_bytes"], "every block written checked");
    assert_eq!(facts["fio_verify_read_bytes"], facts["fio_expected_bytes"]);

    assert_eq!(vsd.stop().code(), Some(0), "the first vsd stops cleanly");
    assert_eq!(remote.stop().code(), Some(0), "the far vsd stops cleanly");
    for image in [&disk, &overlay, &second, &far_image] {
        assert_clean(image);
    }
    let info = qemu_img_info(&second);
    assert!(info.get("backing-filename").is_none(), "the streamed overlay names no backing file: {info}");
    // The far image is the disk the guest read last.
    let raw = far.path("far.raw");
    ok("qemu-img", &["convert", "-O", "raw", far_image.to_str().unwrap(), raw.to_str().unwrap()]);
    let md5 = ok("md5sum", &[raw.to_str().unwrap()]);
    assert_eq!(md5.split_whitespace().next(), Some(facts["disk_md5"].as_str()), "the far image is the guest's disk");
    eprintln!("guest_jobs: {:.0?} in all", started.elapsed());
}
