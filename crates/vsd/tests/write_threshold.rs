//! `block-set-write-threshold` and `BLOCK_WRITE_THRESHOLD`: a libblkio
//! client's writes through a vhost-user-blk export cross a node's
//! threshold, which fires once and is gone until set again; and the same
//! writes from qemu-io over NBD, on vsd and on qemu-storage-daemon, give
//! the same answers, events and `write_threshold` listings.

mod common;

use std::process::Command;

use common::images::MIB;
use common::qmp::Qmp;
use common::{Daemon, Scratch, monitor};
use serde_json::{Value, json};
use vsd_bench::ClientOptions;

/// A raw node `disk` over file node `f0` on a 16 MiB image, served over
/// vhost-user (`vhost.sock`) and NBD (export `rw` on `nbd.sock`), writable.
fn args(dir: &Scratch, with_vhost: bool) -> Vec<String> {
    let image = dir.image("disk.img", 16 * MIB);
    let mut args: Vec<String> = vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}", image.display()),
        "--blockdev".into(),
        "driver=raw,node-name=disk,file=f0".into(),
    ];
    if with_vhost {
        let socket = dir.path("vhost.sock");
        args.extend([
            "--export".into(),
            format!(
                "type=vhost-user-blk,id=v0,node-name=disk,writable=on,addr.type=unix,addr.path={}",
                socket.display()
            ),
        ]);
    }
    args.extend([
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", dir.path("nbd.sock").display()),
        "--export".into(),
        "type=nbd,id=n0,node-name=disk,name=rw,writable=on".into(),
    ]);
    args.extend(monitor(&dir.path("qmp.sock")));
    args
}

fn arm(qmp: &mut Qmp, node: &str, bytes: i64) {
    qmp.ok("block-set-write-threshold", json!({"node-name": node, "write-threshold": bytes}));
}

/// The thresholds events said were crossed so far (a command answered
/// after a write has every event that write caused before its answer).
fn crossings(qmp: &mut Qmp) -> Vec<Value> {
    qmp.ok("query-version", json!({}));
    qmp.event_log().into_iter().filter(|e| e[0] == "BLOCK_WRITE_THRESHOLD").map(|e| e[1].clone()).collect()
}

/// Each node's `write_threshold`, by name.
fn thresholds(qmp: &mut Qmp) -> Value {
    let nodes = qmp.ok("query-named-block-nodes", json!({}));
    let named = nodes.as_array().unwrap().iter().filter(|n| !n["node-name"].as_str().unwrap().starts_with('#'));
    named.map(|n| (n["node-name"].as_str().unwrap().to_string(), n["write_threshold"].clone())).collect()
}

fn crossed(node: &str, threshold: u64, exceeded: u64) -> Value {
    json!({"node-name": node, "write-threshold": threshold, "amount-exceeded": exceeded})
}

#[test]
fn a_libblkio_client_crossing_the_threshold_fires_it_once_and_armed_again_it_fires_again() {
    let dir = Scratch::new("threshold-blkio");
    let daemon = Daemon::vsd(&dir, &args(&dir, true));
    let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    let block = [0x5a; 4096];

    arm(&mut qmp, "disk", MIB as i64);
    arm(&mut qmp, "f0", 2 * MIB as i64);
    queue.write_at(MIB - 4096, &block).unwrap();
    assert_eq!(crossings(&mut qmp), Vec::<Value>::new(), "a write ending at the threshold is not past it");
    queue.write_at(MIB, &block).unwrap();
    assert_eq!(crossings(&mut qmp), [crossed("disk", MIB, 4096)]);
    queue.write_at(3 * MIB, &block).unwrap();
    let both = [crossed("disk", MIB, 4096), crossed("f0", 2 * MIB, MIB + 4096)];
    assert_eq!(crossings(&mut qmp), both, "the raw node's is gone; its file's fires on its own offsets");
    assert_eq!(thresholds(&mut qmp), json!({"disk": 0, "f0": 0}), "both disarmed");

    // Armed again, a write-zeroes crosses it as a write does.
    arm(&mut qmp, "disk", 8 * MIB as i64);
    queue.write_zeroes(8 * MIB - 4096, 8192, false).unwrap();
    assert_eq!(crossings(&mut qmp)[2..], [crossed("disk", 8 * MIB, 4096)]);

    // A discard the node ignores (no discard=unmap) does not count, as in QEMU.
    arm(&mut qmp, "disk", 4 * MIB as i64);
    queue.discard(4 * MIB, 65536).unwrap();
    assert_eq!(crossings(&mut qmp).len(), 3);
    assert_eq!(thresholds(&mut qmp)["disk"], json!(4 * MIB), "still armed");

    // 0 disarms.
    arm(&mut qmp, "disk", 0);
    queue.write_at(15 * MIB, &block).unwrap();
    assert_eq!(crossings(&mut qmp).len(), 3);
    assert_eq!(thresholds(&mut qmp)["disk"], json!(0));
}

#[test]
fn a_discard_counts_where_the_node_acts_on_discards() {
    let dir = Scratch::new("threshold-unmap");
    let mut args = args(&dir, true);
    args[1].push_str(",discard=unmap");
    args[3].push_str(",discard=unmap");
    let daemon = Daemon::vsd(&dir, &args);
    let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    arm(&mut qmp, "disk", 4 * MIB as i64);
    queue.discard(4 * MIB, 65536).unwrap();
    assert_eq!(crossings(&mut qmp), [crossed("disk", 4 * MIB, 65536)]);
}

/// A qemu-io command on the NBD export.
fn qemu_io(dir: &Scratch, command: &str) {
    let uri = format!("nbd+unix:///rw?socket={}", dir.path("nbd.sock").display());
    let out = Command::new("qemu-io").args(["-f", "raw", "-c", command, &uri]).output().unwrap();
    assert!(out.status.success(), "qemu-io -c '{command}': {}", String::from_utf8_lossy(&out.stderr));
}

/// What a daemon answers, sends and lists along one session of arming,
/// writing (qemu-io over NBD) and mistakes.
fn transcript(start: fn(&Scratch, &[String]) -> Daemon, name: &str) -> Vec<Value> {
    let dir = Scratch::new(name);
    let _daemon = start(&dir, &args(&dir, false));
    let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
    let mut said = Vec::new();
    let mut command = |qmp: &mut Qmp, args: Value| said.push(qmp.answer("block-set-write-threshold", args));
    command(&mut qmp, json!({"node-name": "nowhere", "write-threshold": 4096}));
    command(&mut qmp, json!({"node-name": "disk"}));
    command(&mut qmp, json!({"node-name": "disk", "write-threshold": "1M"}));
    command(&mut qmp, json!({"node-name": "disk", "write-threshold": 4096, "extra": 1}));
    command(&mut qmp, json!({"node-name": "disk", "write-threshold": MIB}));
    command(&mut qmp, json!({"node-name": "f0", "write-threshold": -1}));
    let listed_armed = thresholds(&mut qmp);
    qemu_io(&dir, "write -P 1 0 1M");
    qemu_io(&dir, "write -P 2 1M 64k");
    qemu_io(&dir, "write -P 3 2M 64k");
    qemu_io(&dir, "discard 3M 64k");
    command(&mut qmp, json!({"node-name": "disk", "write-threshold": 4 * MIB}));
    qemu_io(&dir, "write -z 4M 128k");
    said.extend([listed_armed, thresholds(&mut qmp), json!(crossings(&mut qmp))]);
    said
}

#[test]
fn answers_events_and_listings_are_qemu_storage_daemons() {
    let ours = transcript(Daemon::vsd, "threshold-vsd");
    let theirs = transcript(Daemon::qsd, "threshold-qsd");
    assert_eq!(ours, theirs);
    let events = ours.last().unwrap();
    assert_eq!(events.as_array().unwrap().len(), 2, "one per arming crossed: {events}");
}
