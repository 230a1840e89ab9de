//! QMP's older commands, on vsd and on qemu-storage-daemon side by side:
//! `nbd-server-add`/`nbd-server-remove` (read by nbdinfo, qemu-img and
//! qemu-io), `drive-mirror` and `drive-backup` (their new targets checked
//! by `qemu-img compare`, `info` and `check`), `blockdev-snapshot-sync`
//! (writes land in the overlay, `qemu-img map`); the same scripts, bad
//! input included, answered and notified as QSD does, and nothing changed
//! by a refused command.

mod common;

use std::path::Path;

use common::qmp::Qmp;
use common::script::{Step, assert_same_as_qsd_in, stable};
use common::{Daemon, Scratch, monitor, ok, outcome};
use serde_json::{Value, json};

use Step::{Await, Command};

/// base.qcow2 (0x11 in its first MiB) under top.qcow2 (0x22 at 4 MiB),
/// raw.img (0x33 in its first 2 MiB) and an empty existing.qcow2, all of
/// 16 MiB.
fn images(dir: &Scratch) {
    let path = |name: &str| dir.path(name).display().to_string();
    let (base, top, raw) = (path("base.qcow2"), path("top.qcow2"), path("raw.img"));
    ok("qemu-img", &["create", "-q", "-f", "qcow2", &base, "16M"]);
    ok("qemu-io", &["-f", "qcow2", "-c", "write -q -P 0x11 0 1M", &base]);
    ok("qemu-img", &["create", "-q", "-f", "qcow2", "-b", &base, "-F", "qcow2", &top]);
    ok("qemu-io", &["-f", "qcow2", "-c", "write -q -P 0x22 4M 1M", &top]);
    ok("qemu-img", &["create", "-q", "-f", "raw", &raw, "16M"]);
    ok("qemu-io", &["-f", "raw", "-c", "write -q -P 0x33 0 2M", &raw]);
    ok("qemu-img", &["create", "-q", "-f", "qcow2", &path("existing.qcow2"), "16M"]);
}

/// The images, with `disk` (qcow2 on top.qcow2, over file node `f0`),
/// `rawdisk` (raw on raw.img, over `rf`) and `ro` (raw.img read-only).
fn nodes(dir: &Scratch) -> Vec<String> {
    images(dir);
    let file = |name: &str, image: &str, extra: &str| {
        [
            "--blockdev".to_string(),
            format!("driver=file,node-name={name},filename={}{extra}", dir.path(image).display()),
        ]
    };
    let mut args: Vec<String> = file("f0", "top.qcow2", "").into();
    args.extend(["--blockdev".into(), "driver=qcow2,node-name=disk,file=f0".into()]);
    args.extend(file("rf", "raw.img", ""));
    args.extend(["--blockdev".into(), "driver=raw,node-name=rawdisk,file=rf".into()]);
    args.extend(file("ro", "raw.img", ",read-only=on"));
    args
}

fn at(dir: &Scratch, name: &str) -> String {
    dir.path(name).display().to_string()
}

fn nbd_uri(dir: &Scratch, export: &str) -> String {
    format!("nbd+unix:///{export}?socket={}", dir.path("nbd.sock").display())
}

fn nbd_server_start(dir: &Scratch) -> Step {
    Command("nbd-server-start", json!({"addr": {"type": "unix", "data": {"path": at(dir, "nbd.sock")}}}))
}

/// Every mistake and success of the NBD commands, in one script.
fn nbd_script(dir: &Scratch) -> Vec<Step> {
    let add = |args: Value| Command("nbd-server-add", args);
    let remove = |args: Value| Command("nbd-server-remove", args);
    vec![
        add(json!({"device": "disk"})),
        add(json!({"device": "nope"})),
        remove(json!({"name": "disk"})),
        nbd_server_start(dir),
        add(json!({"device": "nope"})),
        add(json!({"device": "rawdisk", "bogus": 1})),
        add(json!({"device": "rawdisk"})),
        add(json!({"device": "rawdisk"})),
        add(json!({"device": "rf", "name": "rawdisk"})),
        add(json!({"device": "rawdisk", "name": "w", "writable": true, "description": "hello"})),
        add(json!({"device": "ro", "name": "r", "writable": true})),
        add(json!({"device": "rawdisk", "name": "b", "bitmap": "nob"})),
        add(json!({"device": "rawdisk", "name": "bad name!"})),
        add(json!({"device": "rawdisk", "name": ""})),
        Command("block-export-add", json!({"type": "nbd", "id": "e1", "node-name": "rawdisk", "name": "viaexp"})),
        add(json!({"device": "rawdisk", "name": "viaexp"})),
        Command(
            "block-export-add",
            json!({"type": "vhost-user-blk", "id": "v0", "node-name": "rawdisk",
                   "addr": {"type": "unix", "path": at(dir, "vhost.sock")}}),
        ),
        remove(json!({"name": "v0"})),
        remove(json!({"name": "nope"})),
        remove(json!({"name": "w", "mode": "sideways"})),
        remove(json!({"name": "w", "force": true})),
        remove(json!({"name": "w"})),
        remove(json!({"name": "r", "mode": "hard"})),
        remove(json!({"name": "e1"})),
        remove(json!({"name": "viaexp"})),
    ]
}

#[test]
fn nbd_server_add_and_remove_answer_and_notify_as_qsd() {
    assert_same_as_qsd_in("legacy-nbd", &nodes, &nbd_script, stable, &|_| {});
}

/// What nbdinfo says of export `name`.
fn nbdinfo(dir: &Scratch, name: &str) -> Value {
    let text = ok("nbdinfo", &["--json", &nbd_uri(dir, name)]);
    serde_json::from_str::<Value>(&text).unwrap()["exports"][0].clone()
}

fn export_ids(qmp: &mut Qmp) -> Vec<Value> {
    let mut ids: Vec<Value> = qmp.ok("query-block-exports", json!({})).as_array().unwrap().clone();
    ids.iter_mut().for_each(|e| *e = json!([e["id"], e["node-name"]]));
    ids
}

/// Exports made by `nbd-server-add` serve the node as nbdinfo, qemu-img
/// and qemu-io see it, read-only unless asked (and always for a read-only
/// node); refused adds change nothing; `nbd-server-remove` ends them with
/// BLOCK_EXPORT_DELETED.
#[test]
fn nbd_server_add_serves_what_nbdinfo_and_qemu_img_read() {
    let dir = Scratch::new("legacy-nbd-serve");
    let mut args = nodes(&dir);
    args.extend(monitor(&dir.path("qmp.sock")));
    let daemon = Daemon::vsd(&dir, &args);
    let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
    let start = nbd_server_start(&dir);
    let Command(command, start) = start else { unreachable!() };
    qmp.ok(command, start);
    qmp.ok("nbd-server-add", json!({"device": "rawdisk"}));
    qmp.ok("nbd-server-add", json!({"device": "rawdisk", "name": "w", "writable": true, "description": "hello"}));
    qmp.ok("nbd-server-add", json!({"device": "ro", "name": "r", "writable": true}));
    let before = export_ids(&mut qmp);
    for bad in [json!({"device": "rawdisk"}), json!({"device": "nope"}), json!({"device": "rawdisk", "name": "x y"})] {
        assert!(qmp.answer("nbd-server-add", bad.clone()).get("error").is_some(), "{bad}");
    }
    assert_eq!(export_ids(&mut qmp), before, "refused adds leave the exports as they were");

    let (plain, writable, read_only) = (nbdinfo(&dir, "rawdisk"), nbdinfo(&dir, "w"), nbdinfo(&dir, "r"));
    assert_eq!((plain["is_read_only"].clone(), plain["export-size"].clone()), (json!(true), json!(16 << 20)));
    assert_eq!((writable["is_read_only"].clone(), writable["description"].clone()), (json!(false), json!("hello")));
    assert_eq!(read_only["is_read_only"], json!(true), "a read-only node is exported read-only");
    let raw = at(&dir, "raw.img");
    for export in ["rawdisk", "w", "r"] {
        ok("qemu-img", &["compare", "-U", "-f", "raw", "-F", "raw", &raw, &nbd_uri(&dir, export)]);
    }
    let (wrote, said) = outcome("qemu-io", &["-f", "raw", "-c", "write -P 0x44 0 64k", &nbd_uri(&dir, "rawdisk")]);
    assert!(!wrote || said.contains("failed"), "a read-only export takes no write: {said}");
    ok("qemu-io", &["-f", "raw", "-c", "write -q -P 0x44 8M 64k", &nbd_uri(&dir, "w")]);
    ok("qemu-io", &["-r", "-U", "-f", "raw", "-c", "read -q -P 0x44 8M 64k", &raw]);

    for name in ["w", "r", "rawdisk"] {
        qmp.ok("nbd-server-remove", json!({"name": name}));
        qmp.await_event("BLOCK_EXPORT_DELETED", json!({"id": name}));
        let (listed, _) = outcome("nbdinfo", &["--json", &nbd_uri(&dir, name)]);
        assert!(!listed, "export {name} is gone");
    }
    assert_eq!(export_ids(&mut qmp), Vec::<Value>::new());
    daemon.stop();
}

/// A job's end: ready then completed (mirrors), or completed (backups).
fn job(command: &'static str, id: &'static str, args: Value, ready: bool) -> Vec<Step> {
    let mut steps = vec![Command(command, args)];
    if ready {
        steps.push(Await("BLOCK_JOB_READY", json!({"device": id})));
        steps.push(Command("job-complete", json!({"id": id})));
    }
    steps.push(Await("BLOCK_JOB_COMPLETED", json!({"device": id})));
    steps
}

/// The refusals both commands share, with `extra` arguments (`job-id`).
fn refusals(command: &'static str, dir: &Scratch) -> Vec<Step> {
    let args = |device: &str, target: &str, extra: Value| {
        let mut args = json!({"device": device, "target": at(dir, target), "sync": "full"});
        args.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        Command(command, args)
    };
    vec![
        args("nope", "new.qcow2", json!({"job-id": "j"})),
        args("disk", "nodir/new.qcow2", json!({"job-id": "j"})),
        args("disk", "new.qcow2", json!({"job-id": "j", "format": "vmdk9"})),
        args("disk", "new.qcow2", json!({"job-id": "j", "format": "null-co"})),
        args("disk", "new.qcow2", json!({"job-id": "j", "bogus": 1})),
        args("disk", "top.qcow2", json!({"job-id": "j"})),
        args("disk", "base.qcow2", json!({"job-id": "j"})),
        args("disk", "missing.qcow2", json!({"job-id": "j", "mode": "existing"})),
        args("disk", "new.qcow2", json!({"job-id": "j", "mode": "sideways"})),
    ]
}

fn mirror_script(dir: &Scratch) -> Vec<Step> {
    let mirror = |id: &'static str, target: &str, extra: Value| {
        let mut args = json!({"job-id": id, "device": "disk", "target": at(dir, target)});
        args.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        job("drive-mirror", id, args, true)
    };
    let mut steps = refusals("drive-mirror", dir);
    steps.push(Command(
        "drive-mirror",
        json!({"device": "disk", "target": at(dir, "new.qcow2"), "sync": "full",
        "replaces": "f0", "job-id": "j"}),
    ));
    steps.extend(mirror("full", "full.qcow2", json!({"sync": "full"})));
    steps.extend(mirror("raw", "full.raw", json!({"sync": "full", "format": "raw"})));
    steps.extend(mirror("top", "top-copy.qcow2", json!({"sync": "top"})));
    steps.extend(mirror("none", "none.qcow2", json!({"sync": "none"})));
    steps.extend(mirror("existing", "existing.qcow2", json!({"sync": "full", "mode": "existing"})));
    steps
}

/// What `qemu-img info` says of `image`: its format and backing file.
fn described(image: &Path) -> Value {
    let info = ok("qemu-img", &["info", "--output=json", image.to_str().unwrap()]);
    let info: Value = serde_json::from_str(&info).unwrap();
    json!([info["format"], info["virtual-size"], info["backing-filename"], info["backing-filename-format"]])
}

/// Each target of the scripts, as qemu-img checks it: its format and
/// backing file, clean, and reading as the disk (`top.qcow2`) does.
fn check_targets(dir: &Scratch, targets: &[(&str, &str, Option<&str>)]) {
    let top = at(dir, "top.qcow2");
    for (target, format, backing) in targets {
        let path = dir.path(target);
        let backing = backing.map(|name| at(dir, name));
        let backing_format = backing.as_ref().map(|_| "qcow2");
        assert_eq!(described(&path), json!([format, 16 << 20, backing, backing_format]), "{target}");
        if *format == "qcow2" {
            ok("qemu-img", &["check", "-q", path.to_str().unwrap()]);
        }
        ok("qemu-img", &["compare", "-q", &top, path.to_str().unwrap()]);
    }
    assert!(!dir.path("nodir").exists() && !dir.path("missing.qcow2").exists());
    ok("qemu-img", &["check", "-q", &top]);
}

/// drive-mirror's answers and events are QSD's, and so are the targets:
/// a new qcow2 and raw image with everything (sync=full), an overlay of
/// the disk's backing file with what the disk holds itself (top), one of
/// the disk itself (none), an existing image filled.
#[test]
fn drive_mirror_makes_the_targets_qsd_makes() {
    assert_same_as_qsd_in("legacy-mirror", &nodes, &mirror_script, stable, &|dir| {
        check_targets(
            dir,
            &[
                ("full.qcow2", "qcow2", None),
                ("full.raw", "raw", None),
                ("top-copy.qcow2", "qcow2", Some("base.qcow2")),
                ("none.qcow2", "qcow2", Some("top.qcow2")),
                ("existing.qcow2", "qcow2", None),
            ],
        );
        let map = ok("qemu-img", &["map", "--output=json", &at(dir, "top-copy.qcow2")]);
        let map: Value = serde_json::from_str(&map).unwrap();
        let own: Vec<_> =
            map.as_array().unwrap().iter().filter(|e| e["depth"] == 0).map(|e| e["start"].clone()).collect();
        assert_eq!(own, [json!(4 << 20)], "sync=top copied what the disk holds itself: {map}");
    });
}

fn backup_script(dir: &Scratch) -> Vec<Step> {
    let backup = |id: &'static str, target: &str, extra: Value| {
        let mut args = json!({"job-id": id, "device": "disk", "target": at(dir, target)});
        args.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        job("drive-backup", id, args, false)
    };
    let mut steps = refusals("drive-backup", dir);
    steps.extend(backup("full", "full.qcow2", json!({"sync": "full"})));
    steps.extend(backup("raw", "full.raw", json!({"sync": "full", "format": "raw"})));
    steps.extend(backup("top", "top-copy.qcow2", json!({"sync": "top"})));
    steps.extend(backup("existing", "existing.qcow2", json!({"sync": "full", "mode": "existing"})));
    let none = json!({"job-id": "none", "device": "disk", "target": at(dir, "none.qcow2"), "sync": "none",
        "auto-finalize": false});
    steps.push(Command("drive-backup", none));
    steps.push(Command("job-cancel", json!({"id": "none"})));
    steps.push(Await("BLOCK_JOB_CANCELLED", json!({"device": "none"})));
    let action = json!({"type": "drive-backup", "data": {"job-id": "tx", "device": "disk",
        "target": at(dir, "tx.qcow2"), "sync": "full"}});
    steps.push(Command("transaction", json!({"actions": [action]})));
    steps.push(Await("BLOCK_JOB_COMPLETED", json!({"device": "tx"})));
    steps
}

/// drive-backup's answers and events are QSD's (alone and in a
/// transaction), and so are the targets, which qemu-img opens once the
/// job is over (the daemon let them go).
#[test]
fn drive_backup_makes_the_targets_qsd_makes() {
    assert_same_as_qsd_in("legacy-backup", &nodes, &backup_script, stable, &|dir| {
        check_targets(
            dir,
            &[
                ("full.qcow2", "qcow2", None),
                ("full.raw", "raw", None),
                ("top-copy.qcow2", "qcow2", Some("base.qcow2")),
                ("existing.qcow2", "qcow2", None),
                ("tx.qcow2", "qcow2", None),
            ],
        );
        assert_eq!(described(&dir.path("none.qcow2"))[2], json!(at(dir, "top.qcow2")), "sync=none's overlay");
    });
}

fn snapshot_script(dir: &Scratch) -> Vec<Step> {
    let sync = |args: Value| Command("blockdev-snapshot-sync", args);
    let file = |name: &str| at(dir, name);
    let action = |node: &str, file: String, overlay: &str| {
        json!({"type": "blockdev-snapshot-sync",
               "data": {"node-name": node, "snapshot-file": file, "snapshot-node-name": overlay}})
    };
    vec![
        sync(json!({"device": "disk", "snapshot-file": file("s.qcow2")})),
        sync(json!({"snapshot-file": file("s.qcow2")})),
        sync(json!({"node-name": "disk", "snapshot-file": file("s.qcow2")})),
        sync(json!({"node-name": "disk", "snapshot-file": file("s.qcow2"), "snapshot-node-name": "f0"})),
        sync(json!({"node-name": "disk", "snapshot-file": file("nodir/s.qcow2"), "snapshot-node-name": "s"})),
        sync(
            json!({"node-name": "disk", "snapshot-file": file("s.qcow2"), "snapshot-node-name": "s", "format": "vmdk9"}),
        ),
        sync(json!({"node-name": "disk", "snapshot-file": file("s.raw"), "snapshot-node-name": "s", "format": "raw"})),
        sync(json!({"node-name": "disk", "snapshot-file": file("top.qcow2"), "snapshot-node-name": "s"})),
        sync(json!({"node-name": "disk", "snapshot-file": file("s.qcow2"), "snapshot-node-name": "s", "bogus": 1})),
        sync(json!({"node-name": "disk", "snapshot-file": file("missing.qcow2"), "snapshot-node-name": "s",
            "mode": "existing"})),
        Command(
            "transaction",
            json!({"actions": [action("disk", file("g.qcow2"), "g")], "properties": {"completion-mode": "grouped"}}),
        ),
        Command(
            "transaction",
            json!({"actions": [action("disk", file("t1.qcow2"), "t1"), action("nope", file("t2.qcow2"), "t2")]}),
        ),
        // Exported, the overlay stays; unexported, QEMU lets it go.
        Command("block-export-add", json!({"type": "nbd", "id": "n0", "node-name": "disk", "writable": true})),
        sync(json!({"node-name": "disk", "snapshot-file": file("s.qcow2"), "snapshot-node-name": "s"})),
        Command("query-block-exports", json!({})),
        sync(json!({"node-name": "rawdisk", "snapshot-file": file("r.qcow2"), "snapshot-node-name": "rs"})),
        sync(json!({"node-name": "rs", "snapshot-file": file("r2.qcow2"), "snapshot-node-name": "rs2"})),
        Command("transaction", json!({"actions": [action("s", file("t.qcow2"), "t")]})),
        Command("query-block-exports", json!({})),
    ]
}

fn exported_disk(dir: &Scratch) -> Vec<String> {
    let mut args = nodes(dir);
    args.extend(["--nbd-server".into(), format!("addr.type=unix,addr.path={}", dir.path("nbd.sock").display())]);
    args
}

/// blockdev-snapshot-sync's answers are QSD's, alone and in transactions,
/// and so are its overlays: each names the image below it, absolutely.
#[test]
fn blockdev_snapshot_sync_makes_the_overlays_qsd_makes() {
    assert_same_as_qsd_in("legacy-snapshot", &exported_disk, &snapshot_script, stable, &|dir| {
        let overlay = |name: &str| described(&dir.path(name));
        assert_eq!(overlay("s.qcow2"), json!(["qcow2", 16 << 20, at(dir, "top.qcow2"), "qcow2"]));
        assert_eq!(overlay("t.qcow2"), json!(["qcow2", 16 << 20, at(dir, "s.qcow2"), "qcow2"]));
        assert_eq!(overlay("r.qcow2"), json!(["qcow2", 16 << 20, at(dir, "raw.img"), "raw"]));
        for never in ["nodir", "s.raw", "g.qcow2", "t2.qcow2", "r2.qcow2", "missing.qcow2"] {
            assert!(!dir.path(never).exists(), "{never} was made");
        }
        ok("qemu-img", &["check", "-q", &at(dir, "t.qcow2")]);
    });
}

/// After blockdev-snapshot-sync, an NBD client's writes land in the
/// overlay (`qemu-img map`: depth 0 there), the disk's image keeps what it
/// had, and the chain reads the old data under the new.
#[test]
fn writes_after_blockdev_snapshot_sync_land_in_the_overlay() {
    let dir = Scratch::new("legacy-snapshot-writes");
    let mut args = exported_disk(&dir);
    args.extend(["--export".into(), "type=nbd,id=n0,node-name=disk,name=disk,writable=on".into()]);
    args.extend(monitor(&dir.path("qmp.sock")));
    let daemon = Daemon::vsd(&dir, &args);
    let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
    let top = at(&dir, "top.qcow2");
    let copy = at(&dir, "top-before.qcow2");
    ok("qemu-img", &["convert", "-U", "-O", "qcow2", &top, &copy]);
    let snapshot = json!({"node-name": "disk", "snapshot-file": at(&dir, "s.qcow2"), "snapshot-node-name": "s"});
    qmp.ok("blockdev-snapshot-sync", snapshot);
    assert_eq!(qmp.ok("query-block-exports", json!({}))[0]["node-name"], json!("s"));
    ok("qemu-io", &["-f", "raw", "-c", "write -q -P 0x55 8M 64k", &nbd_uri(&dir, "disk")]);
    ok("qemu-io", &["-f", "raw", "-c", "read -q -P 0x22 4M 1M", "-c", "read -q -P 0x11 0 1M", &nbd_uri(&dir, "disk")]);
    daemon.stop();
    let overlay = at(&dir, "s.qcow2");
    let map: Value = serde_json::from_str(&ok("qemu-img", &["map", "--output=json", &overlay])).unwrap();
    let own: Vec<_> = map.as_array().unwrap().iter().filter(|e| e["depth"] == 0).cloned().collect();
    assert_eq!(own.len(), 1, "{map}");
    assert_eq!((own[0]["start"].clone(), own[0]["length"].clone()), (json!(8 << 20), json!(64 << 10)), "{map}");
    ok("qemu-img", &["compare", "-q", &copy, &top]);
    ok("qemu-img", &["check", "-q", &overlay]);
    ok("qemu-io", &["-f", "qcow2", "-c", "read -q -P 0x55 8M 64k", "-c", "read -q -P 0x22 4M 1M", &overlay]);
}

/// Refused drive-* and snapshot commands leave the nodes, the jobs and
/// the images as they were, and make no file.
#[test]
fn refused_commands_change_nothing() {
    let dir = Scratch::new("legacy-refused");
    let mut args = nodes(&dir);
    args.extend(monitor(&dir.path("qmp.sock")));
    let daemon = Daemon::vsd(&dir, &args);
    let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
    let names = |qmp: &mut Qmp| {
        let nodes = qmp.ok("query-named-block-nodes", json!({}));
        nodes.as_array().unwrap().iter().map(|n| n["node-name"].clone()).collect::<Vec<_>>()
    };
    let before = names(&mut qmp);
    let mut refused = refusals("drive-mirror", &dir);
    refused.extend(refusals("drive-backup", &dir));
    refused.push(Command("drive-mirror", json!({"device": "disk", "target": at(&dir, "n.qcow2"), "sync": "full"})));
    refused.push(Command(
        "drive-mirror",
        json!({"device": "disk", "target": at(&dir, "n.qcow2"), "sync": "full", "job-id": "j", "node-name": "f0"}),
    ));
    refused.push(Command(
        "drive-backup",
        json!({"device": "disk", "target": at(&dir, "n.qcow2"), "sync": "full", "job-id": "j", "filter-node-name": "x"}),
    ));
    refused.push(Command(
        "blockdev-snapshot-sync",
        json!({"node-name": "disk", "snapshot-file": at(&dir, "top.qcow2"), "snapshot-node-name": "s"}),
    ));
    for step in refused {
        let Command(command, args) = step else { continue };
        let answer = qmp.answer(command, args.clone());
        assert_eq!(answer["error"]["class"], json!("GenericError"), "{command} {args}: {answer}");
    }
    assert_eq!(names(&mut qmp), before, "no node added or left behind");
    assert_eq!(qmp.ok("query-jobs", json!({})), json!([]));
    daemon.stop();
    for made in ["new.qcow2", "n.qcow2", "missing.qcow2", "nodir"] {
        assert!(!dir.path(made).exists(), "{made} was made");
    }
    ok("qemu-img", &["check", "-q", &at(&dir, "top.qcow2")]);
    ok(
        "qemu-io",
        &["-f", "qcow2", "-c", "read -q -P 0x22 4M 1M", "-c", "read -q -P 0x11 0 1M", &at(&dir, "top.qcow2")],
    );
    ok("qemu-io", &["-f", "raw", "-c", "read -q -P 0x33 0 2M", &at(&dir, "raw.img")]);
}
