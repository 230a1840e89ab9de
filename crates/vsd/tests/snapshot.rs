//! `blockdev-snapshot`: a qcow2 overlay put on a running disk, its exports
//! moved onto it under a writing client, checked with qemu-img, and the
//! command's answers against qemu-storage-daemon's.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{Daemon, Scratch, monitor, ok, pattern};
use serde_json::{Value, json};
use vsd_bench::ClientOptions;
use vsd_control::client::QmpClient;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 16 * MIB;

/// A raw base image of `SIZE` bytes holding pattern 1, and a qcow2
/// overlay file naming it as its backing file.
fn images(dir: &Scratch) -> (std::path::PathBuf, std::path::PathBuf) {
    let base = dir.path("base.img");
    std::fs::write(&base, pattern(1, SIZE as usize)).unwrap();
    let overlay = dir.path("overlay.qcow2");
    let (b, o) = (base.to_str().unwrap(), overlay.to_str().unwrap());
    ok("qemu-img", &["create", "-q", "-f", "qcow2", "-b", b, "-F", "raw", o]);
    (base, overlay)
}

/// `program` serving `base` as raw node `disk` over vhost-user-blk (two
/// queues, writable) and NBD (export `n`), with QMP.
fn serve(program: &str, dir: &Scratch, base: &Path) -> Daemon {
    let mut args = vec![
        "--blockdev".into(),
        format!("driver=file,node-name=bf,filename={}", base.display()),
        "--blockdev".into(),
        "driver=raw,node-name=disk,file=bf".into(),
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
    args.extend(monitor(&dir.path("qmp.sock")));
    match program {
        "vsd" => Daemon::vsd(dir, &args),
        _ => Daemon::qsd(dir, &args),
    }
}

fn add_overlay(qmp: &mut QmpClient, name: &str, file: &Path, backing_null: bool) -> Value {
    let mut args = json!({"driver": "qcow2", "node-name": name, "file": {"driver": "file", "filename": file}});
    if backing_null {
        args["backing"] = Value::Null;
    }
    qmp.execute("blockdev-add", args).unwrap()
}

/// Two queues write while the snapshot is taken, without reconnecting:
/// every acknowledged write is in the disk as qemu-img reads the chain,
/// each one either in the base (before the snapshot) or in the overlay
/// (after), the base holds nothing written after the snapshot returned,
/// and qemu-img finds the overlay clean.
#[test]
fn a_live_snapshot_moves_a_writing_disk_onto_its_overlay() {
    let dir = Scratch::new("snapshot-live");
    let (base, overlay) = images(&dir);
    let daemon = serve("vsd", &dir, &base);
    let mut qmp = QmpClient::connect(&dir.path("qmp.sock")).unwrap();
    add_overlay(&mut qmp, "ovl", &overlay, true);
    let mut client = daemon.connect(ClientOptions { num_queues: 2, ..Default::default() });
    let snapshot_taken = Arc::new(AtomicBool::new(false));
    // Each write goes to its own 64 KiB slot: (queue, index) -> offset.
    let slot = |q: u64, i: u64| (q * SIZE / 2) + i * 65536;
    let writers: Vec<_> = client
        .take_queues()
        .into_iter()
        .enumerate()
        .map(|(q, mut queue)| {
            let taken = snapshot_taken.clone();
            std::thread::spawn(move || {
                let mut after = Vec::new();
                for i in 0..100u64 {
                    // Half the writes come after the snapshot, whatever the timing.
                    while i == 50 && !taken.load(Ordering::Acquire) {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    let was_taken = taken.load(Ordering::Acquire);
                    let data = pattern(100 * q as u64 + i + 2, 4096);
                    queue.write_at(slot(q as u64, i), &data).unwrap();
                    let mut back = vec![0; 4096];
                    queue.read_at(slot(q as u64, i), &mut back).unwrap();
                    assert_eq!(back, data, "queue {q} write {i} reads back");
                    if was_taken {
                        after.push(i);
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                queue.flush().unwrap();
                after
            })
        })
        .collect();
    // An NBD client writes, sleeps through the snapshot on an idle
    // connection, and writes again.
    let nbd_uri = format!("nbd+unix:///n?socket={}", dir.path("nbd.sock").display());
    let nbd = std::process::Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            "-c",
            "write -P 0x11 7M 64k",
            "-c",
            "sleep 1500",
            "-c",
            "write -P 0x22 7680k 64k",
            &nbd_uri,
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    qmp.execute("blockdev-snapshot", json!({"node": "disk", "overlay": "ovl"})).unwrap();
    snapshot_taken.store(true, Ordering::Release);
    assert!(nbd.wait_with_output().unwrap().status.success(), "the NBD client's writes succeed");
    let after: Vec<Vec<u64>> = writers.into_iter().map(|w| w.join().unwrap()).collect();
    assert!(after.iter().all(|a| !a.is_empty()), "writes went on after the snapshot: {after:?}");
    let exports = qmp.execute("query-block-exports", json!({})).unwrap();
    assert!(exports.as_array().unwrap().iter().all(|e| e["node-name"] == "ovl"), "{exports}");
    drop(client);
    assert!(daemon.stop().success());

    ok("qemu-img", &["check", "-q", overlay.to_str().unwrap()]);
    let merged = dir.path("merged.raw");
    ok("qemu-img", &["convert", "-O", "raw", overlay.to_str().unwrap(), merged.to_str().unwrap()]);
    let (merged, base_bytes, before) =
        (std::fs::read(&merged).unwrap(), std::fs::read(&base).unwrap(), pattern(1, SIZE as usize));
    let mut expected = before.clone();
    for q in 0..2u64 {
        for i in 0..100u64 {
            let at = slot(q, i) as usize;
            let data = pattern(100 * q + i + 2, 4096);
            expected[at..at + 4096].copy_from_slice(&data);
            let in_base = &base_bytes[at..at + 4096];
            assert!(
                in_base == &data[..] || in_base == &before[at..at + 4096],
                "queue {q} write {i}: the base holds it or not"
            );
            if after[q as usize].contains(&i) {
                assert_eq!(
                    in_base,
                    &before[at..at + 4096],
                    "queue {q} write {i} came after the snapshot: not in the base"
                );
            }
        }
    }
    // Between the two queues' slots.
    let (first, second) = (7 * MIB as usize, 7680 << 10);
    assert!(
        base_bytes[first..first + 65536].iter().all(|&b| b == 0x11),
        "the NBD write before the snapshot is in the base"
    );
    assert_eq!(base_bytes[second..second + 65536], before[second..second + 65536], "the one after it is not");
    expected[first..first + 65536].fill(0x11);
    expected[second..second + 65536].fill(0x22);
    assert!(merged == expected, "the chain holds every acknowledged write");
    let info = ok("qemu-img", &["info", "--output=json", overlay.to_str().unwrap()]);
    let info: Value = serde_json::from_str(&info).unwrap();
    assert_eq!(info["backing-filename"], base.to_str().unwrap(), "{info}");
}

/// The same commands, the same answers: every refusal in QEMU's words, and
/// the export serving the overlay afterwards, as qemu-storage-daemon does.
#[test]
fn answers_as_qemu_storage_daemon() {
    let transcript = |program: &str| {
        let dir = Scratch::new(&format!("snapshot-{program}"));
        let (base, overlay) = images(&dir);
        let other = dir.path("other.qcow2");
        std::fs::copy(&overlay, &other).unwrap();
        let raw = dir.image("raw.img", SIZE);
        let _daemon = serve(program, &dir, &base);
        let mut qmp = QmpClient::connect(&dir.path("qmp.sock")).unwrap();
        let mut lines = Vec::new();
        let ask = |qmp: &mut QmpClient, command: &str, args: Value| {
            let answer = qmp.execute(command, args.clone());
            format!("{command} {args}: {}", answer.map_or_else(|e| e.to_string(), |v| v.to_string()))
        };
        let snapshot = |node: &str, overlay: &str| json!({"node": node, "overlay": overlay});
        lines.push(ask(&mut qmp, "blockdev-snapshot", snapshot("nope", "disk")));
        add_overlay(&mut qmp, "with-backing", &other, false);
        lines.push(ask(&mut qmp, "blockdev-snapshot", snapshot("disk", "with-backing")));
        qmp.execute(
            "blockdev-add",
            json!({"driver": "raw", "node-name": "r", "file": {"driver": "file", "filename": raw}}),
        )
        .unwrap();
        lines.push(ask(&mut qmp, "blockdev-snapshot", snapshot("disk", "r")));
        add_overlay(&mut qmp, "ovl", &overlay, true);
        lines.push(ask(&mut qmp, "blockdev-snapshot", snapshot("disk", "nowhere")));
        lines.push(ask(&mut qmp, "blockdev-snapshot", snapshot("disk", "disk")));
        // In a transaction: all or nothing with a checkpoint's bitmap.
        let action = |overlay: &str| json!({"type": "blockdev-snapshot", "data": snapshot("disk", overlay)});
        let bitmap = json!({"type": "block-dirty-bitmap-add", "data": {"node": "disk", "name": "b0"}});
        lines.push(ask(&mut qmp, "transaction", json!({"actions": [bitmap, action("with-backing")]})));
        lines.push(ask(&mut qmp, "transaction", json!({"actions": [bitmap, action("ovl")]})));
        let nodes = qmp.execute("query-named-block-nodes", json!({"flat": true})).unwrap();
        let disk = nodes.as_array().unwrap().iter().find(|n| n["node-name"] == "disk").unwrap().clone();
        let names: Vec<&Value> = disk["dirty-bitmaps"].as_array().unwrap().iter().map(|b| &b["name"]).collect();
        lines.push(format!("bitmaps of disk: {names:?}"));
        lines.push(ask(&mut qmp, "blockdev-snapshot", snapshot("disk", "ovl")));
        let exports = qmp.execute("query-block-exports", json!({})).unwrap();
        let nodes: Vec<&Value> = exports.as_array().unwrap().iter().map(|e| &e["node-name"]).collect();
        lines.push(format!("exports on {nodes:?}"));
        lines.push(ask(&mut qmp, "blockdev-del", json!({"node-name": "disk"})));
        lines
    };
    let (vsd, qsd) = (transcript("vsd"), transcript("qsd"));
    assert_eq!(vsd, qsd);
}

/// A throttle filter over the disk, which the export serves: the snapshot
/// puts the overlay under the filter (QEMU puts it in the node's place in
/// every parent), and the filter's export writes into the overlay from
/// then on, the base untouched.
#[test]
fn a_snapshot_below_a_throttle_filter_puts_the_overlay_under_it() {
    let dir = Scratch::new("snapshot-filter");
    let (base, overlay) = images(&dir);
    let mut args = vec![
        "--object".into(),
        "throttle-group,id=tg0".into(),
        "--blockdev".into(),
        format!("driver=file,node-name=bf,filename={}", base.display()),
        "--blockdev".into(),
        "driver=raw,node-name=disk,file=bf".into(),
        "--blockdev".into(),
        "driver=throttle,node-name=th,file=disk,throttle-group=tg0".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=v0,node-name=th,addr.type=unix,addr.path={},writable=on",
            dir.path("vhost.sock").display()
        ),
    ];
    args.extend(monitor(&dir.path("qmp.sock")));
    let daemon = Daemon::vsd(&dir, &args);
    let mut qmp = QmpClient::connect(&dir.path("qmp.sock")).unwrap();
    add_overlay(&mut qmp, "ovl", &overlay, true);
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    let (before, after) = (pattern(2, 65536), pattern(3, 65536));
    queue.write_at(0, &before).unwrap();
    qmp.execute("blockdev-snapshot", json!({"node": "disk", "overlay": "ovl"})).unwrap();
    queue.write_at(65536, &after).unwrap();
    queue.flush().unwrap();
    let exports = qmp.execute("query-block-exports", json!({})).unwrap();
    assert_eq!(exports[0]["node-name"], "th", "the export stays on the filter");
    let del = qmp.execute("blockdev-del", json!({"node-name": "disk"})).unwrap_err().to_string();
    assert!(del.contains("Node 'disk' is busy: node is used as backing hd of 'ovl'"), "QEMU's words: {del}");
    drop(queue);
    drop(client);
    daemon.stop();
    let read = |image: &Path, format: &str| {
        let raw = dir.path("read.raw");
        ok("qemu-img", &["convert", "-f", format, "-O", "raw", image.to_str().unwrap(), raw.to_str().unwrap()]);
        std::fs::read(raw).unwrap()
    };
    let (base_bytes, chain_bytes) = (read(&base, "raw"), read(&overlay, "qcow2"));
    assert!(base_bytes[..65536] == before[..], "the write before the snapshot is in the base");
    assert!(base_bytes[65536..131072] == pattern(1, SIZE as usize)[65536..131072], "the base took nothing after");
    assert!(chain_bytes[65536..131072] == after[..], "the write after the snapshot is in the overlay");
    assert!(chain_bytes[..65536] == before[..], "the overlay reads the base below it");
}
