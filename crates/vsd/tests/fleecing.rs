//! Fleecing (`copy-before-write` and `snapshot-access`): QEMU's
//! image-fleecing steps, run against vsd and qemu-storage-daemon alike. A
//! pattern is written, the fleecing graph added over QMP, the disk
//! overwritten through an NBD export of the filter while qemu-io reads the
//! fleecing export, which must show the old data, and the disk the new;
//! then the graph goes with blockdev-del in QEMU's order. With a bitmap,
//! and with a failing target under both `on-cbw-error` policies.

mod common;

use std::path::Path;

use common::qmp::Qmp;
use common::{Daemon, Scratch, monitor, ok, run};
use serde_json::{Value, json};

/// Written before fleecing starts: pattern, offset, length (qemu-io's words).
const PATTERNS: [(&str, &str, &str); 4] =
    [("0x5d", "0", "64k"), ("0xd5", "1M", "64k"), ("0xdc", "32M", "64k"), ("0xcd", "0x3ff0000", "64k")];
/// Written through the filter: a whole cluster, a partial left and right
/// one, one next to a pattern.
const OVERWRITE: [(&str, &str, &str); 4] =
    [("0xab", "0", "64k"), ("0xad", "0x00f8000", "64k"), ("0x1d", "0x2008000", "64k"), ("0xea", "0x3fe0000", "64k")];
/// Never written before fleecing: zeroes in the snapshot.
const ZEROES: [(&str, &str, &str); 3] =
    [("0", "0x00f8000", "32k"), ("0", "0x2010000", "32k"), ("0", "0x3fe0000", "64k")];
/// What the overwrites left of the patterns.
const REMAINDER: [(&str, &str, &str); 3] =
    [("0xd5", "0x108000", "32k"), ("0xdc", "32M", "32k"), ("0xcd", "0x3ff0000", "64k")];

type Start = fn(&Scratch, &[String]) -> Daemon;

/// How the fleecing graph is built.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// The target is a qcow2 image backed by the disk, exported itself.
    Qcow2Target,
    /// The target is a raw file, read through `snapshot-access`.
    SnapshotAccess,
    /// As `SnapshotAccess`, the filter limited to a bitmap.
    Bitmap,
}

fn qemu_io(args: &[&str]) -> bool {
    run("qemu-io", args).status.success()
}

/// Runs `qemu-io -c "VERB -P..."` for each pattern on `target`; whether each passed.
fn io_each(target: &str, verb: &str, patterns: &[(&str, &str, &str)], extra: &[&str]) -> Vec<bool> {
    let commands = patterns.iter().map(|(p, offset, len)| format!("{verb} -P{p} {offset} {len}"));
    commands
        .map(|command| {
            let mut args = extra.to_vec();
            args.extend(["-c", &command, target]);
            qemu_io(&args)
        })
        .collect()
}

fn nbd_uri(dir: &Scratch, export: &str) -> String {
    format!("nbd+unix:///{export}?socket={}", dir.path("nbd.sock").display())
}

/// The daemon's arguments: the disk node `source`, a monitor and an NBD server.
fn daemon_args(dir: &Scratch, base: &Path) -> Vec<String> {
    let mut args = vec![
        "--blockdev".into(),
        format!("driver=qcow2,node-name=source,file.driver=file,file.filename={}", base.display()),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", dir.path("nbd.sock").display()),
    ];
    args.extend(monitor(&dir.path("qmp.sock")));
    args
}

/// The disk with the patterns, and an empty fleecing image.
fn images(dir: &Scratch, mode: Mode) -> (std::path::PathBuf, std::path::PathBuf) {
    let base = dir.path("base.qcow2");
    let fleece = dir.path("fleece.img");
    ok("qemu-img", &["create", "-f", "qcow2", base.to_str().unwrap(), "64M"]);
    if mode == Mode::Bitmap {
        ok("qemu-img", &["bitmap", "--add", base.to_str().unwrap(), "bitmap0"]);
    }
    let format = if mode == Mode::Qcow2Target { "qcow2" } else { "raw" };
    ok("qemu-img", &["create", "-f", format, fleece.to_str().unwrap(), "64M"]);
    let written = io_each(base.to_str().unwrap(), "write", &PATTERNS, &["-f", "qcow2"]);
    assert!(written.iter().all(|&w| w));
    (base, fleece)
}

/// What one run saw: the QMP answers, then each read of the fleecing
/// export before and after the overwrites, each overwrite, and each
/// check of the disk afterwards.
#[derive(Debug, PartialEq)]
struct Seen {
    answers: Vec<Value>,
    before: Vec<bool>,
    written: Vec<bool>,
    after: Vec<bool>,
    /// `qemu-img map` of the fleecing export after the overwrites: holes
    /// the copies kept sparse.
    map: String,
    disk: Vec<bool>,
}

/// QEMU's image-fleecing steps on `start`'s daemon.
fn fleece(start: Start, mode: Mode) -> Seen {
    let dir = Scratch::new(&format!("fleecing-{mode:?}"));
    let (base, fleece) = images(&dir, mode);
    let daemon = start(&dir, &daemon_args(&dir, &base));
    let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
    let mut answers = Vec::new();
    let mut command = |qmp: &mut Qmp, name: &str, args: Value| answers.push(qmp.answer(name, args));
    let temp = match mode {
        Mode::Qcow2Target => json!({"driver": "qcow2", "node-name": "temp", "backing": "source",
            "file": {"driver": "file", "filename": fleece}}),
        _ => json!({"driver": "file", "node-name": "temp", "filename": fleece}),
    };
    command(&mut qmp, "blockdev-add", temp);
    let mut cbw = json!({"driver": "copy-before-write", "node-name": "fl-cbw", "file": "source", "target": "temp"});
    if mode == Mode::Bitmap {
        cbw["bitmap"] = json!({"node": "source", "name": "bitmap0"});
    }
    command(&mut qmp, "blockdev-add", cbw);
    let export = if mode == Mode::Qcow2Target { "temp" } else { "fl-access" };
    if mode != Mode::Qcow2Target {
        command(
            &mut qmp,
            "blockdev-add",
            json!({"driver": "snapshot-access", "node-name": "fl-access", "file": "fl-cbw"}),
        );
    }
    command(&mut qmp, "block-export-add", json!({"type": "nbd", "id": "fleece", "node-name": export}));
    // The guest's disk, moved onto the filter.
    command(
        &mut qmp,
        "block-export-add",
        json!({"type": "nbd", "id": "guest", "node-name": "fl-cbw", "writable": true}),
    );

    let uri = nbd_uri(&dir, export);
    let expected: Vec<_> = PATTERNS.iter().chain(&ZEROES).copied().collect();
    let read_only = ["-r", "-f", "raw"];
    let before = io_each(&uri, "read", &expected, &read_only);
    let written = io_each(&nbd_uri(&dir, "fl-cbw"), "write", &OVERWRITE, &["-f", "raw"]);
    let after = io_each(&uri, "read", &expected, &read_only);
    // Through snapshot-access the raw target's holes read as the host's
    // file system says, which vsd's file node and QEMU's see apart: the
    // qcow2 target's map is compared.
    let map = match mode {
        Mode::Qcow2Target => ok("qemu-img", &["map", "--output=json", "-f", "raw", &uri]),
        _ => String::new(),
    };

    command(&mut qmp, "nbd-server-stop", json!({}));
    if mode != Mode::Qcow2Target {
        command(&mut qmp, "blockdev-del", json!({"node-name": "fl-access"}));
    }
    command(&mut qmp, "blockdev-del", json!({"node-name": "fl-cbw"}));
    command(&mut qmp, "blockdev-del", json!({"node-name": "temp"}));
    drop(qmp);
    daemon.stop();
    let final_data: Vec<_> = OVERWRITE.iter().chain(&REMAINDER).copied().collect();
    let disk = io_each(base.to_str().unwrap(), "read", &final_data, &["-f", "qcow2"]);
    Seen { answers, before, written, after, map, disk }
}

/// Runs the steps on both daemons; they must see the same, which the
/// caller checks further.
fn both(mode: Mode) -> Seen {
    let qsd = fleece(Daemon::qsd, mode);
    let vsd = fleece(Daemon::vsd, mode);
    assert_eq!(vsd, qsd, "vsd, then qemu-storage-daemon");
    assert!(vsd.answers.iter().all(|a| a.get("return").is_some()), "{:?}", vsd.answers);
    assert!(vsd.written.iter().all(|&w| w) && vsd.disk.iter().all(|&d| d), "{vsd:?}");
    vsd
}

#[test]
fn a_qcow2_target_backed_by_the_disk_keeps_the_disk_as_it_was() {
    let seen = both(Mode::Qcow2Target);
    assert!(seen.before.iter().chain(&seen.after).all(|&r| r), "{seen:?}");
}

#[test]
fn snapshot_access_reads_the_disk_as_it_was() {
    let seen = both(Mode::SnapshotAccess);
    assert!(seen.before.iter().chain(&seen.after).all(|&r| r), "{seen:?}");
}

#[test]
fn a_bitmap_limits_the_snapshot_to_its_dirty_clusters() {
    let seen = both(Mode::Bitmap);
    // The patterns were written with the bitmap on: they are in the
    // snapshot; the clusters never written are not, and fail to read.
    let in_bitmap = [true, true, true, true, false, false, false];
    assert_eq!(seen.before, in_bitmap);
    assert_eq!(seen.after, in_bitmap);
}

/// What qemu-io said of a failed command (empty if it passed).
fn failure(args: &[&str]) -> String {
    let out = run("qemu-io", args);
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    text.lines().filter(|line| line.contains("failed")).collect::<Vec<_>>().join("\n")
}

/// A write through a filter whose target fails, under `policy`: what
/// reading the snapshot before and after, and the write, said.
fn failing_target(start: Start, policy: &str, qemu: bool) -> Vec<String> {
    let dir = Scratch::new(&format!("fleecing-{policy}"));
    let (base, fleece) = images(&dir, Mode::SnapshotAccess);
    let daemon = start(&dir, &daemon_args(&dir, &base));
    let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
    // QEMU's rules fire after an event; vsd's blkdebug has none, its rules fire on every write.
    let rule = if qemu { json!({"event": "pwritev", "iotype": "write"}) } else { json!({"iotype": "write"}) };
    qmp.ok(
        "blockdev-add",
        json!({"driver": "blkdebug", "node-name": "temp", "image": {"driver": "file", "filename": fleece},
            "inject-error": [rule]}),
    );
    qmp.ok(
        "blockdev-add",
        json!({"driver": "copy-before-write", "node-name": "fl-cbw", "file": "source", "target": "temp",
            "on-cbw-error": policy}),
    );
    qmp.ok("blockdev-add", json!({"driver": "snapshot-access", "node-name": "fl-access", "file": "fl-cbw"}));
    qmp.ok("block-export-add", json!({"type": "nbd", "id": "fleece", "node-name": "fl-access"}));
    qmp.ok("block-export-add", json!({"type": "nbd", "id": "guest", "node-name": "fl-cbw", "writable": true}));
    let (snapshot, guest) = (nbd_uri(&dir, "fl-access"), nbd_uri(&dir, "fl-cbw"));
    let read = |command: &str| failure(&["-r", "-f", "raw", "-c", command, &snapshot]);
    let seen = vec![
        read("read -P0x5d 0 64k"),
        failure(&["-f", "raw", "-c", "write -P0xab 0 4k", &guest]),
        read("read -P0x5d 0 64k"),
        read("read -P0xd5 1M 64k"),
    ];
    drop(qmp);
    daemon.stop();
    seen
}

#[test]
fn a_failed_copy_fails_the_guest_write_or_breaks_the_snapshot() {
    for policy in ["break-guest-write", "break-snapshot"] {
        let qsd = failing_target(Daemon::qsd, policy, true);
        let vsd = failing_target(Daemon::vsd, policy, false);
        // vsd's NBD server sends EIO for errnos QEMU's sends EINVAL for
        // (the snapshot's EACCES): whether each failed is compared, and
        // the guest write's error word for word.
        let failed = |seen: &[String]| seen.iter().map(|s| !s.is_empty()).collect::<Vec<_>>();
        assert_eq!(failed(&vsd), failed(&qsd), "{policy}: vsd {vsd:?}, qemu-storage-daemon {qsd:?}");
        assert_eq!(vsd[1], qsd[1], "{policy}: the guest write");
        match policy {
            "break-guest-write" => assert_eq!(failed(&vsd), [false, true, false, false], "{vsd:?}"),
            _ => assert_eq!(failed(&vsd), [false, false, true, true], "{vsd:?}"),
        }
    }
}

#[test]
fn the_snapshot_holds_while_the_guest_writes_during_the_backup() {
    let dir = Scratch::new("fleecing-busy");
    let (base, fleece) = images(&dir, Mode::SnapshotAccess);
    let original = dir.path("original.qcow2");
    std::fs::copy(&base, &original).unwrap();
    let daemon = Daemon::vsd(&dir, &daemon_args(&dir, &base));
    let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
    qmp.ok("blockdev-add", json!({"driver": "file", "node-name": "temp", "filename": fleece}));
    qmp.ok(
        "blockdev-add",
        json!({"driver": "copy-before-write", "node-name": "fl-cbw", "file": "source", "target": "temp"}),
    );
    qmp.ok("blockdev-add", json!({"driver": "snapshot-access", "node-name": "fl-access", "file": "fl-cbw"}));
    qmp.ok("block-export-add", json!({"type": "nbd", "id": "fleece", "node-name": "fl-access"}));
    qmp.ok("block-export-add", json!({"type": "nbd", "id": "guest", "node-name": "fl-cbw", "writable": true}));
    // Writes over the whole disk, some straddling clusters, while the
    // backup reads it.
    let guest = nbd_uri(&dir, "fl-cbw");
    let writer = std::thread::spawn(move || {
        let mut args: Vec<String> = vec!["-f".into(), "raw".into()];
        for i in 0..256u64 {
            let offset = (i * 7919 * 4096) % (63 << 20) + (i % 3) * 512;
            args.extend(["-c".into(), format!("write -P{} {offset} 96k", i % 250 + 1)]);
        }
        args.push(guest);
        run("qemu-io", &args.iter().map(String::as_str).collect::<Vec<_>>()).status.success()
    });
    let snapshot = nbd_uri(&dir, "fl-access");
    let compare = || run("qemu-img", &["compare", "-f", "raw", "-F", "qcow2", &snapshot, original.to_str().unwrap()]);
    let during = compare();
    assert!(writer.join().unwrap(), "the guest's writes");
    let after = compare();
    assert!(during.status.success(), "{}", String::from_utf8_lossy(&during.stdout));
    assert!(after.status.success(), "{}", String::from_utf8_lossy(&after.stdout));
    let disk =
        run("qemu-img", &["compare", "-f", "raw", "-F", "qcow2", &nbd_uri(&dir, "fl-cbw"), original.to_str().unwrap()]);
    assert_eq!(disk.status.code(), Some(1), "the disk changed: {}", String::from_utf8_lossy(&disk.stdout));
    drop(qmp);
    daemon.stop();
}

/// The fleecing graph given on the command line, the filter exported as
/// the guest's disk from the start (qemu-storage-daemon's simple case):
/// what the snapshot and the disk read after a write.
fn from_the_command_line(start: Start) -> Vec<bool> {
    let dir = Scratch::new("fleecing-cli");
    let (base, fleece) = images(&dir, Mode::Bitmap);
    let mut args = daemon_args(&dir, &base);
    for blockdev in [
        format!("driver=file,node-name=temp,filename={}", fleece.display()),
        "driver=copy-before-write,node-name=fl-cbw,file=source,target=temp,bitmap.node=source,bitmap.name=bitmap0,\
         on-cbw-error=break-snapshot,cbw-timeout=30"
            .into(),
        "driver=snapshot-access,node-name=fl-access,file=fl-cbw".into(),
    ] {
        args.extend(["--blockdev".into(), blockdev]);
    }
    for export in ["id=fleece,node-name=fl-access", "id=guest,node-name=fl-cbw,writable=on"] {
        args.extend(["--export".into(), format!("type=nbd,{export}")]);
    }
    let daemon = start(&dir, &args);
    let (snapshot, guest) = (nbd_uri(&dir, "fl-access"), nbd_uri(&dir, "fl-cbw"));
    let mut seen = io_each(&guest, "write", &OVERWRITE[..2], &["-f", "raw"]);
    seen.extend(io_each(&snapshot, "read", &PATTERNS, &["-r", "-f", "raw"]));
    seen.extend(io_each(&guest, "read", &OVERWRITE[..2], &["-r", "-f", "raw"]));
    daemon.stop();
    seen
}

#[test]
fn the_graph_can_be_given_on_the_command_line() {
    let vsd = from_the_command_line(Daemon::vsd);
    assert_eq!(vsd, from_the_command_line(Daemon::qsd), "vsd, then qemu-storage-daemon");
    assert!(vsd.iter().all(|&passed| passed), "{vsd:?}");
}
