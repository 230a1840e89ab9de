//! Internal qcow2 snapshots of a running disk (`blockdev-snapshot-internal-sync`,
//! `blockdev-snapshot-delete-internal-sync`, the transaction action): taken
//! while a libblkio client writes through vhost-user-blk, read back by
//! qemu-img, deleted by vsd and by qemu-img, and every answer against
//! qemu-storage-daemon's.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use common::{Daemon, Scratch, monitor, ok, pattern, run};
use serde_json::{Value, json};
use vsd_bench::ClientOptions;
use vsd_control::client::QmpClient;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 16 * MIB;
const BLOCK: usize = 4096;

/// A qcow2 image of `SIZE` bytes whose first half holds pattern 1.
fn image(dir: &Scratch, name: &str) -> PathBuf {
    let path = dir.path(name);
    let raw = dir.path("fill.raw");
    let mut bytes = pattern(1, (SIZE / 2) as usize);
    bytes.resize(SIZE as usize, 0);
    std::fs::write(&raw, &bytes).unwrap();
    ok("qemu-img", &["convert", "-q", "-f", "raw", "-O", "qcow2", raw.to_str().unwrap(), path.to_str().unwrap()]);
    path
}

/// `program` serving qcow2 `image` as node `disk` over vhost-user-blk (two
/// queues) and NBD (export `n`), writable, with QMP; `extra` adds options.
fn serve(program: &str, dir: &Scratch, image: &Path, extra: &[String]) -> Daemon {
    let mut args = vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f,filename={}", image.display()),
        "--blockdev".into(),
        "driver=qcow2,node-name=disk,file=f".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=v0,node-name=disk,addr.type=unix,addr.path={},writable=on,num-queues=2",
            dir.path("vhost.sock").display()
        ),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", dir.path("nbd.sock").display()),
        "--export".into(),
        "type=nbd,id=n0,node-name=disk,name=n,writable=on".into(),
    ];
    args.extend_from_slice(extra);
    args.extend(monitor(&dir.path("qmp.sock")));
    match program {
        "vsd" => Daemon::vsd(dir, &args),
        _ => Daemon::qsd(dir, &args),
    }
}

/// The disk as qemu-img reads it, or its snapshot `name`, while a daemon
/// may hold the image (`-U`).
fn read(dir: &Scratch, image: &Path, snapshot: Option<&str>) -> Vec<u8> {
    let out = dir.path("read.raw");
    let mut args = vec!["convert".to_string(), "-U".into(), "-O".into(), "raw".into()];
    if let Some(name) = snapshot {
        args.extend(["-l".into(), format!("snapshot.name={name}")]);
    }
    args.extend([image.display().to_string(), out.display().to_string()]);
    ok("qemu-img", &args.iter().map(String::as_str).collect::<Vec<_>>());
    std::fs::read(&out).unwrap()
}

/// `qemu-img snapshot -l` as (id, name, disk size in bytes).
fn snapshots(image: &Path) -> Vec<(String, String, u64)> {
    let info: Value =
        serde_json::from_str(&ok("qemu-img", &["info", "-U", "--output=json", image.to_str().unwrap()])).unwrap();
    let list = info["snapshots"].as_array().cloned().unwrap_or_default();
    let size = info["virtual-size"].as_u64().unwrap();
    let listed = ok("qemu-img", &["snapshot", "-U", "-l", image.to_str().unwrap()]);
    list.iter()
        .map(|s| {
            let (id, name) = (s["id"].as_str().unwrap().to_string(), s["name"].as_str().unwrap().to_string());
            assert!(listed.lines().any(|l| l.split_whitespace().take(2).eq([id.as_str(), name.as_str()])), "{listed}");
            (id, name, size)
        })
        .collect()
}

fn assert_clean(image: &Path) {
    let check = run("qemu-img", &["check", image.to_str().unwrap()]);
    let report = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success() && report.contains("No errors were found"), "{}: {report}", image.display());
}

/// Each queue's writes land in its own 4 KiB blocks of the disk's second
/// half: block `i` of queue `q`.
fn slot(q: usize, i: usize) -> usize {
    (SIZE / 2) as usize + (q * 1000 + i) * BLOCK
}

/// Two queues write (each block once) while the snapshot is taken: a
/// write acknowledged before the command was sent is in the snapshot, one
/// sent after it returned is not; afterwards writes over blocks the
/// snapshot shares leave it as it was, and both it and the active disk
/// read back as written. Deleting it through QMP answers what it was, and
/// the image is clean after each step.
#[test]
fn a_snapshot_of_a_writing_disk_holds_what_was_written_before_it() {
    let dir = Scratch::new("isnap-live");
    let disk = image(&dir, "disk.qcow2");
    let daemon = serve("vsd", &dir, &disk, &[]);
    let mut qmp = QmpClient::connect(&dir.path("qmp.sock")).unwrap();
    let mut client = daemon.connect(ClientOptions { num_queues: 2, ..Default::default() });
    // 0: before the command, 1: during it, 2: after it returned.
    let phase = Arc::new(AtomicU8::new(0));
    let writers: Vec<_> = client
        .take_queues()
        .into_iter()
        .enumerate()
        .map(|(q, mut queue)| {
            let phase = phase.clone();
            std::thread::spawn(move || {
                let mut sent_in = Vec::new();
                for i in 0..120 {
                    while i == 60 && phase.load(Ordering::Acquire) < 2 {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    let started = phase.load(Ordering::Acquire);
                    queue.write_at(slot(q, i) as u64, &pattern((q * 1000 + i) as u64 + 7, BLOCK)).unwrap();
                    let done = phase.load(Ordering::Acquire);
                    sent_in.push((started, done));
                    std::thread::sleep(Duration::from_millis(1));
                }
                queue.flush().unwrap();
                sent_in
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(40));
    phase.store(1, Ordering::Release);
    assert_eq!(
        qmp.execute("blockdev-snapshot-internal-sync", json!({"device": "disk", "name": "s1"})).unwrap(),
        json!({})
    );
    phase.store(2, Ordering::Release);
    let sent: Vec<Vec<(u8, u8)>> = writers.into_iter().map(|w| w.join().unwrap()).collect();

    let before = {
        let mut b = pattern(1, (SIZE / 2) as usize);
        b.resize(SIZE as usize, 0);
        b
    };
    let (in_snapshot, active) = (read(&dir, &disk, Some("s1")), read(&dir, &disk, None));
    let mut written = before.clone();
    let (mut kept, mut left_out) = (0, 0);
    for (q, sent) in sent.iter().enumerate() {
        for (i, &(started, done)) in sent.iter().enumerate() {
            let at = slot(q, i);
            let data = pattern((q * 1000 + i) as u64 + 7, BLOCK);
            written[at..at + BLOCK].copy_from_slice(&data);
            let held = &in_snapshot[at..at + BLOCK];
            if done == 0 {
                assert!(held == &data[..], "queue {q} write {i}, acknowledged before the snapshot, is in it");
                kept += 1;
            } else if started == 2 {
                assert!(held == &before[at..at + BLOCK], "queue {q} write {i}, sent after the snapshot, is not in it");
                left_out += 1;
            } else {
                assert!(held == &data[..] || held == &before[at..at + BLOCK], "queue {q} write {i}: one or the other");
            }
        }
    }
    assert!(kept > 0 && left_out > 0, "writes on both sides of the snapshot: {kept} before, {left_out} after");
    assert!(active == written, "the active disk holds every write");

    // Over the first half, which the snapshot shares whole: through NBD.
    let nbd_uri = format!("nbd+unix:///n?socket={}", dir.path("nbd.sock").display());
    ok("qemu-io", &["-f", "raw", "-c", "write -q -P 0x5c 1M 192k", "-c", "write -q -P 0x5d 6M 4k", &nbd_uri]);
    written[MIB as usize..(MIB + 192 * 1024) as usize].fill(0x5c);
    written[6 * MIB as usize..6 * MIB as usize + BLOCK].fill(0x5d);
    let snapshot_then = in_snapshot;
    assert!(read(&dir, &disk, Some("s1")) == snapshot_then, "writes after the snapshot leave it as it was");
    assert!(read(&dir, &disk, None) == written);
    assert_eq!(snapshots(&disk), [("1".to_string(), "s1".to_string(), SIZE)]);

    qmp.execute("blockdev-snapshot-internal-sync", json!({"device": "disk", "name": "s2"})).unwrap();
    let gone = qmp.execute("blockdev-snapshot-delete-internal-sync", json!({"device": "disk", "name": "s1"})).unwrap();
    assert_eq!((&gone["id"], &gone["name"], &gone["vm-state-size"]), (&json!("1"), &json!("s1"), &json!(0)), "{gone}");
    assert!(gone["date-sec"].as_u64().unwrap() > 1_600_000_000, "{gone}");
    ok("qemu-io", &["-f", "raw", "-c", "write -q -P 0x6e 0 64k", &nbd_uri]);
    drop(client);
    assert!(daemon.stop().success());
    written[..65536].fill(0x6e);
    assert_clean(&disk);
    assert_eq!(snapshots(&disk), [("2".to_string(), "s2".to_string(), SIZE)]);
    let mut at_s2 = written.clone();
    at_s2[..65536].copy_from_slice(&before[..65536]);
    assert!(read(&dir, &disk, Some("s2")) == at_s2, "s2 as the disk was when it was taken");
    assert!(read(&dir, &disk, None) == written);
}

/// A snapshot qemu-img took is deleted through vsd's QMP, and one vsd took
/// is read and deleted by qemu-img; the image is clean after each.
#[test]
fn snapshots_cross_between_qemu_img_and_vsd() {
    let dir = Scratch::new("isnap-cross");
    let disk = image(&dir, "disk.qcow2");
    ok("qemu-img", &["snapshot", "-c", "by-qemu", disk.to_str().unwrap()]);
    let daemon = serve("vsd", &dir, &disk, &[]);
    let mut qmp = QmpClient::connect(&dir.path("qmp.sock")).unwrap();
    let nbd_uri = format!("nbd+unix:///n?socket={}", dir.path("nbd.sock").display());
    ok("qemu-io", &["-f", "raw", "-c", "write -q -P 0x21 0 128k", &nbd_uri]);
    qmp.execute("blockdev-snapshot-internal-sync", json!({"device": "disk", "name": "by-vsd"})).unwrap();
    ok("qemu-io", &["-f", "raw", "-c", "write -q -P 0x22 64k 128k", &nbd_uri]);
    let gone = qmp.execute("blockdev-snapshot-delete-internal-sync", json!({"device": "disk", "id": "1"})).unwrap();
    assert_eq!((&gone["name"], &gone["vm-clock-sec"]), (&json!("by-qemu"), &json!(0)), "{gone}");
    assert!(daemon.stop().success());
    assert_clean(&disk);
    assert_eq!(snapshots(&disk), [("2".to_string(), "by-vsd".to_string(), SIZE)]);
    let mut expected = pattern(1, (SIZE / 2) as usize);
    expected.resize(SIZE as usize, 0);
    expected[..128 * 1024].fill(0x21);
    assert!(read(&dir, &disk, Some("by-vsd")) == expected);
    ok("qemu-img", &["snapshot", "-d", "by-vsd", disk.to_str().unwrap()]);
    assert_clean(&disk);
    expected[64 * 1024..192 * 1024].fill(0x22);
    assert!(read(&dir, &disk, None) == expected);
}

/// Dates and clocks differ from run to run (and qemu-storage-daemon puts
/// its host clock in the VM clock, vsd 0): left out of the comparison.
fn without_times(mut answer: Value) -> Value {
    if let Some(object) = answer.as_object_mut() {
        for key in ["date-sec", "date-nsec", "vm-clock-sec", "vm-clock-nsec"] {
            if object.remove(key).is_some() {
                object.insert(key.into(), json!("T"));
            }
        }
    }
    answer
}

/// The same commands, the same answers as qemu-storage-daemon: every
/// refusal in QEMU's words (unknown node, not a root node, read-only,
/// not qcow2, empty or taken names, unknown snapshots, bad arguments,
/// transactions undone), and the same snapshots left in each image.
#[test]
fn answers_as_qemu_storage_daemon() {
    let transcript = |program: &str| {
        let dir = Scratch::new(&format!("isnap-{program}"));
        let disk = image(&dir, "disk.qcow2");
        let read_only = image(&dir, "ro.qcow2");
        ok("qemu-img", &["snapshot", "-c", "old", read_only.to_str().unwrap()]);
        let other = image(&dir, "other.qcow2");
        let raw = dir.image("raw.img", SIZE);
        let throttle_group = ["--object".to_string(), "throttle-group,id=g".into()];
        let extra = [
            format!("driver=file,node-name=rof,filename={},read-only=on", read_only.display()),
            "driver=qcow2,node-name=ro,file=rof,read-only=on".into(),
            format!("driver=file,node-name=rawf,filename={}", raw.display()),
            "driver=raw,node-name=raw,file=rawf".into(),
            format!("driver=file,node-name=of,filename={}", other.display()),
            "driver=qcow2,node-name=under,file=of".into(),
            "driver=throttle,node-name=thr,file=under,throttle-group=g".into(),
        ]
        .into_iter()
        .flat_map(|o| ["--blockdev".to_string(), o]);
        let extra: Vec<String> = throttle_group.into_iter().chain(extra).collect();
        let daemon = serve(program, &dir, &disk, &extra);
        let mut qmp = QmpClient::connect(&dir.path("qmp.sock")).unwrap();
        let take = |device: &str, name: &str| json!({"device": device, "name": name});
        let action =
            |device: &str, name: &str| json!({"type": "blockdev-snapshot-internal-sync", "data": take(device, name)});
        let commands = [
            ("blockdev-snapshot-internal-sync", take("nope", "s")),
            ("blockdev-snapshot-internal-sync", take("f", "s")),
            ("blockdev-snapshot-internal-sync", take("disk", "s1")),
            ("blockdev-snapshot-internal-sync", take("disk", "s1")),
            ("blockdev-snapshot-internal-sync", take("disk", "")),
            ("blockdev-snapshot-internal-sync", json!({"device": "disk"})),
            ("blockdev-snapshot-internal-sync", json!({"device": "disk", "name": "x", "id": "9"})),
            ("blockdev-snapshot-internal-sync", json!({"device": "disk", "name": 5})),
            ("blockdev-snapshot-internal-sync", take("ro", "s")),
            ("blockdev-snapshot-internal-sync", take("raw", "s")),
            ("blockdev-snapshot-internal-sync", take("under", "s")),
            ("blockdev-snapshot-internal-sync", take("thr", "through-a-filter")),
            ("blockdev-snapshot-internal-sync", take("disk", "1")),
            ("blockdev-snapshot-delete-internal-sync", json!({"device": "disk"})),
            ("blockdev-snapshot-delete-internal-sync", json!({"device": "disk", "name": "zz"})),
            ("blockdev-snapshot-delete-internal-sync", json!({"device": "disk", "id": "9"})),
            ("blockdev-snapshot-delete-internal-sync", json!({"device": "disk", "id": "1", "name": "zz"})),
            ("blockdev-snapshot-delete-internal-sync", json!({"device": "nope", "id": "1"})),
            ("blockdev-snapshot-delete-internal-sync", json!({"device": "raw", "id": "1"})),
            ("blockdev-snapshot-delete-internal-sync", json!({"device": "ro", "id": "1"})),
            ("blockdev-snapshot-delete-internal-sync", json!({"device": "ro", "id": "7"})),
            ("blockdev-snapshot-delete-internal-sync", json!({"device": "under", "id": "1"})),
            ("blockdev-snapshot-delete-internal-sync", json!({"device": "disk", "name": "1"})),
            ("blockdev-snapshot-delete-internal-sync", json!({"device": "disk", "id": "1"})),
            ("blockdev-snapshot-delete-internal-sync", json!({"device": "disk", "name": "s1"})),
            ("transaction", json!({"actions": [action("disk", "t1")]})),
            ("transaction", json!({"actions": [action("disk", "t2"), action("disk", "t2")]})),
            ("transaction", json!({"actions": [action("disk", "t3"), action("nope", "t3")]})),
            ("transaction", json!({"actions": [action("disk", "t4"), action("thr", "t1")]})),
            ("transaction", json!({"actions": [action("disk", "t1")]})),
        ];
        let mut lines = Vec::new();
        for (command, args) in commands {
            let answer = qmp.execute(command, args.clone());
            let answer = answer.map_or_else(|e| e.to_string(), |v| without_times(v).to_string());
            lines.push(format!("{command} {args}: {answer}"));
        }
        drop(qmp);
        assert!(daemon.stop().success());
        for image in [&disk, &read_only, &other] {
            assert_clean(image);
            let names: Vec<String> = snapshots(image).into_iter().map(|(id, name, _)| format!("{id} {name}")).collect();
            lines.push(format!("{}: {names:?}", image.file_name().unwrap().to_string_lossy()));
        }
        lines
    };
    let (vsd, qsd) = (transcript("vsd"), transcript("qsd"));
    for (v, q) in vsd.iter().zip(&qsd) {
        assert_eq!(v, q);
    }
    assert_eq!(vsd.len(), qsd.len());
}
