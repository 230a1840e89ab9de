//! Image locking as QEMU does it: vsd, qemu-storage-daemon, qemu-img and
//! qemu-io see each other's locks on an image, both ways, with QEMU's
//! wording; `locking=off` opts out; read-only users share; an inactive
//! node (a live migration's other end) holds no lock.

mod common;

use std::path::Path;

use common::qmp::Qmp;
use common::{Daemon, Scratch, VSD, run};
use serde_json::json;
use vsd_control::client::QmpClient;

const QSD: &str = "qemu-storage-daemon";
const WRITE_LOCK: &str = "Failed to get \"write\" lock";
const SHARED_WRITE_LOCK: &str = "Failed to get shared \"write\" lock";

fn qcow2(dir: &Scratch, name: &str) -> std::path::PathBuf {
    let image = dir.path(name);
    let out = run("qemu-img", &["create", "-f", "qcow2", image.to_str().unwrap(), "64M"]);
    assert!(out.status.success(), "{out:?}");
    image
}

/// `--blockdev` and `--export` arguments serving qcow2 `image` on
/// `socket`, with `file_opts` on the file node and `export_opts` on the
/// export (",writable=on").
fn served(image: &Path, socket: &Path, file_opts: &str, export_opts: &str) -> Vec<String> {
    vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}{file_opts}", image.display()),
        "--blockdev".into(),
        "driver=qcow2,node-name=q0,file=f0".into(),
        "--export".into(),
        format!("type=vhost-user-blk,id=e0,node-name=q0,addr.type=unix,addr.path={}{export_opts}", socket.display()),
    ]
}

/// Runs a tool expected to fail; returns what it said.
fn refused(program: &str, args: &[&str]) -> String {
    let out = run(program, args);
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{program} {args:?} was allowed: {said}");
    said
}

fn allowed(program: &str, args: &[&str]) {
    let out = run(program, args);
    assert!(out.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_served_qcow2_image_is_refused_to_other_writers_and_to_readers_that_refuse_writers() {
    let dir = Scratch::new("lock-qcow2");
    let image = qcow2(&dir, "disk.qcow2");
    let path = image.to_str().unwrap();
    let _vsd = Daemon::vsd(&dir, &served(&image, &dir.path("a.sock"), "", ",writable=on"));

    let said = refused("qemu-img", &["info", path]);
    assert!(said.contains(SHARED_WRITE_LOCK) && said.contains("Is another process using the image"), "{said}");
    allowed("qemu-img", &["info", "-U", path]);
    let said = refused("qemu-io", &["-f", "qcow2", "-c", "write 0 4k", path]);
    assert!(said.contains(WRITE_LOCK), "{said}");

    // A second vsd: one line, exit status 1, nothing written.
    let before = std::fs::read(&image).unwrap();
    let out = run(
        VSD,
        &served(&image, &dir.path("b.sock"), "", ",writable=on").iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains(WRITE_LOCK) && stderr.contains(path), "{stderr}");
    assert!(!dir.path("b.sock").exists(), "nothing left behind");
    assert_eq!(std::fs::read(&image).unwrap(), before, "the refused daemon wrote nothing");

    // locking=off opts out, as in QEMU.
    let _unlocked = Daemon::vsd(&dir, &served(&image, &dir.path("c.sock"), ",locking=off", ""));
}

#[test]
fn vsd_sees_qemu_storage_daemons_locks() {
    let dir = Scratch::new("lock-qsd");
    let image = qcow2(&dir, "disk.qcow2");
    let _qsd = Daemon::qsd(&dir, &served(&image, &dir.path("qsd.sock"), "", ",writable=on"));
    let args = served(&image, &dir.path("vsd.sock"), "", "");
    let said = refused(VSD, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(said.contains(WRITE_LOCK), "a read-only qcow2 still takes the file as QEMU does: {said}");
}

#[test]
fn readers_share_and_raw_images_share_writes_as_qemu_does() {
    let dir = Scratch::new("lock-share");
    let image = qcow2(&dir, "disk.qcow2");
    let path = image.to_str().unwrap();
    let ro = |name: &str| {
        let file = format!("driver=file,node-name=f0,filename={path},read-only=on");
        let fmt = "driver=qcow2,node-name=q0,file=f0,read-only=on".to_string();
        let export =
            format!("type=vhost-user-blk,id=e0,node-name=q0,addr.type=unix,addr.path={}", dir.path(name).display());
        Daemon::vsd(&dir, &["--blockdev".into(), file, "--blockdev".into(), fmt, "--export".into(), export])
    };
    let (_a, _b) = (ro("a.sock"), ro("b.sock"));
    allowed("qemu-img", &["info", path]);
    assert!(refused("qemu-io", &["-f", "qcow2", "-c", "write 0 4k", path]).contains(WRITE_LOCK));

    // A raw image served writable is shared with other writers, as
    // qemu-storage-daemon shares it.
    let raw = dir.image("disk.raw", 1 << 20);
    let _vsd = Daemon::vsd(&dir, &common::file_export(&raw, &dir.path("raw.sock"), "", ",writable=on"));
    allowed("qemu-io", &["-f", "raw", "-c", "write 0 4k", raw.to_str().unwrap()]);
}

#[test]
fn an_inactive_node_holds_no_lock_until_it_takes_the_image() {
    let dir = Scratch::new("lock-inactive");
    let image = qcow2(&dir, "disk.qcow2");
    let qmp = |name: &str| {
        let socket = dir.path(name);
        (
            socket.clone(),
            vec![
                "--chardev".to_string(),
                format!("socket,id=m,path={},server=on,wait=off", socket.display()),
                "--monitor".into(),
                "chardev=m".into(),
            ],
        )
    };
    let (qmp_a, monitor_a) = qmp("a-qmp.sock");
    let mut args = served(&image, &dir.path("a.sock"), "", ",writable=on,allow-inactive=on");
    args.extend(monitor_a);
    let _a = Daemon::vsd(&dir, &args);
    // The destination of a migration opens it inactive: no lock, no error.
    let (qmp_b, monitor_b) = qmp("b-qmp.sock");
    let mut args = served(&image, &dir.path("b.sock"), ",active=off", ",writable=on,allow-inactive=on");
    args[3] = "driver=qcow2,node-name=q0,file=f0,active=off".into();
    args.extend(monitor_b);
    let _b = Daemon::vsd(&dir, &args);

    let mut a = QmpClient::connect(&qmp_a).unwrap();
    let mut b = QmpClient::connect(&qmp_b).unwrap();
    let set = |client: &mut QmpClient, active: bool| {
        client.execute("blockdev-set-active", json!({ "node-name": "q0", "active": active })).map_err(|e| e.to_string())
    };
    let taken = set(&mut b, true).unwrap_err();
    assert!(taken.contains(WRITE_LOCK), "while the source holds it: {taken}");
    set(&mut a, false).unwrap();
    allowed("qemu-img", &["check", image.to_str().unwrap()]);
    set(&mut b, true).unwrap();
    assert!(set(&mut a, true).unwrap_err().contains(WRITE_LOCK), "and now the other way");
}

/// The arguments of the job tests' daemons: raw files `a`, `b`, `c`, and
/// qcow2 chains over files (each `(layers, read_only)`: the layers' names,
/// base first, and those opened read-only), every file node with
/// `file_opts`; an NBD server on `nbd.sock`.
fn job_nodes(dir: &Scratch, file_opts: &str, chains: &[(&str, &str)]) -> Vec<String> {
    let mut args = Vec::new();
    let mut node = |options: String| args.extend(["--blockdev".to_string(), options]);
    for name in ["a", "b", "c"] {
        let image = dir.image(&format!("{name}.img"), 16 << 20);
        node(format!("file,node-name={name},filename={}{file_opts}", image.display()));
    }
    for (layers, read_only) in chains {
        let mut below: Option<&str> = None;
        for layer in layers.split(',') {
            let image = dir.path(&format!("{layer}.qcow2"));
            let mut create = vec!["create", "-q", "-f", "qcow2"];
            let backing = below.map(|b| dir.path(&format!("{b}.qcow2")).display().to_string());
            if let Some(backing) = &backing {
                create.extend(["-b", backing, "-F", "qcow2"]);
            }
            let image_arg = image.display().to_string();
            create.extend([image_arg.as_str(), "16M"]);
            common::ok("qemu-img", &create);
            node(format!("file,node-name={layer}-file,filename={}{file_opts}", image.display()));
            let backing = below.map_or(String::new(), |below| format!(",backing={below}"));
            let ro = if read_only.split(',').any(|r| r == layer) { ",read-only=on" } else { "" };
            node(format!("qcow2,node-name={layer},file={layer}-file{backing}{ro}"));
            below = Some(layer);
        }
    }
    args.extend(["--nbd-server".into(), format!("addr.type=unix,addr.path={}", dir.path("nbd.sock").display())]);
    args
}

/// An NBD export `id` of `node`, named as its id.
fn nbd_export(id: &str, node: &str, writable: bool) -> serde_json::Value {
    json!({"type": "nbd", "id": id, "node-name": node, "name": id, "writable": writable})
}

/// `auto-read-only=on` files, as QEMU's file driver keeps them: open
/// read-only while nothing writes them, for writing while an export, a
/// mirror's or a backup's target, an active commit's base or a stream's
/// overlay does, read-only again after, whatever way the job ended. Seen
/// from outside (`/proc`'s flags of the daemon's descriptors), on vsd and
/// on qemu-storage-daemon alike.
#[test]
fn auto_read_only_files_are_open_for_writing_only_while_a_user_writes_them() {
    for (program, start) in [(VSD, Daemon::vsd as fn(&Scratch, &[String]) -> Daemon), (QSD, Daemon::qsd)] {
        let dir = Scratch::new(&format!("lock-auto-ro-{}", program.len()));
        let qmp = dir.path("qmp.sock");
        let chains = [("c-base,c-top", "c-base"), ("s-base,s-top", "s-base,s-top")];
        let mut args = job_nodes(&dir, ",auto-read-only=on", &chains);
        args.extend(common::monitor(&qmp));
        let daemon = start(&dir, &args);
        let file = |name: &str| dir.path(name);
        let writing = |name: &str, expected: bool| common::await_open_for_writing(daemon.pid(), &file(name), expected);
        let mut qmp = Qmp::connect(&qmp);
        for (name, expected) in [("a.img", false), ("b.img", false), ("c-base.qcow2", false), ("s-top.qcow2", false)] {
            writing(name, expected);
        }
        writing("c-top.qcow2", true); // a writable qcow2 node writes its file

        qmp.ok("block-export-add", nbd_export("e", "a", true));
        writing("a.img", true);
        qmp.ok("block-export-del", json!({"id": "e"}));
        qmp.await_event("BLOCK_EXPORT_DELETED", json!({"id": "e"}));
        writing("a.img", false);

        qmp.ok("blockdev-mirror", json!({"job-id": "m", "device": "a", "target": "b", "sync": "full"}));
        qmp.await_event("BLOCK_JOB_READY", json!({"device": "m"}));
        writing("b.img", true);
        writing("a.img", false); // the source is only read
        qmp.ok("job-cancel", json!({"id": "m"}));
        qmp.await_event("JOB_STATUS_CHANGE", json!({"id": "m", "status": "null"}));
        writing("b.img", false);

        let backup = json!({"job-id": "k", "device": "a", "target": "b", "sync": "full", "auto-finalize": false});
        qmp.ok("blockdev-backup", backup);
        qmp.await_event("BLOCK_JOB_PENDING", json!({"id": "k"}));
        writing("b.img", true);
        qmp.ok("job-finalize", json!({"id": "k"}));
        qmp.await_event("JOB_STATUS_CHANGE", json!({"id": "k", "status": "null"}));
        writing("b.img", false);

        qmp.ok("block-commit", json!({"job-id": "c", "device": "c-top"}));
        qmp.await_event("BLOCK_JOB_READY", json!({"device": "c"}));
        writing("c-base.qcow2", true);
        qmp.ok("job-cancel", json!({"id": "c"}));
        qmp.await_event("JOB_STATUS_CHANGE", json!({"id": "c", "status": "null"}));
        writing("c-base.qcow2", false);

        qmp.ok("block-stream", json!({"job-id": "s", "device": "s-top", "auto-finalize": false}));
        qmp.await_event("BLOCK_JOB_PENDING", json!({"id": "s"}));
        writing("s-top.qcow2", true);
        qmp.ok("job-finalize", json!({"id": "s"}));
        qmp.await_event("JOB_STATUS_CHANGE", json!({"id": "s", "status": "null"}));
        writing("s-top.qcow2", false);
        drop(daemon);
        for image in ["c-top.qcow2", "c-base.qcow2", "s-top.qcow2"] {
            allowed("qemu-img", &["check", file(image).to_str().unwrap()]);
        }
    }
}

/// `text` with the names QEMU gives the nodes it makes (`#block123`) as
/// NODE_NAME, as the iotests' filters do.
fn node_names_out(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("#block") {
        out.push_str(&rest[..at]);
        out.push_str("NODE_NAME");
        rest = rest[at + "#block".len()..].trim_start_matches(|c: char| c.is_ascii_digit());
    }
    out + rest
}

const BB: &str = "an unnamed block device";

/// The words of a permission conflict on `node`.
fn conflict(node: &str, perms: &str, holder: (&str, &str), refuser: (&str, &str)) -> String {
    format!(
        "Permission conflict on node '{node}': permissions '{perms}' are both required by {} (uses node '{node}' as \
         '{}' child) and unshared by {} (uses node '{node}' as '{}' child).",
        holder.0, holder.1, refuser.0, refuser.1
    )
}

/// What a command answered: "ok", or its error's words (the names QEMU
/// gives nodes it makes as NODE_NAME).
fn said(answer: serde_json::Value) -> String {
    answer.get("error").map_or("ok".into(), |e| node_names_out(e["desc"].as_str().unwrap()))
}

/// Each job takes on its nodes what QEMU's takes, and what conflicts with
/// it (exports there before it starts, or added while it runs) is refused
/// in QEMU's words, the same on vsd and on qemu-storage-daemon; what was
/// there keeps serving, and a refused job leaves nothing (created, then
/// null).
#[test]
fn jobs_and_exports_refuse_each_other_what_qemu_refuses() {
    let mut logs = Vec::new();
    for (program, start) in [(VSD, Daemon::vsd as fn(&Scratch, &[String]) -> Daemon), (QSD, Daemon::qsd)] {
        let dir = Scratch::new(&format!("lock-conflicts-{}", program.len()));
        let qmp = dir.path("qmp.sock");
        let mut args = job_nodes(&dir, "", &[("base,mid,top", ""), ("s-base,s-mid,s-top", "")]);
        args.extend(common::monitor(&qmp));
        let _daemon = start(&dir, &args);
        let mut qmp = Qmp::connect(&qmp);
        let mut log = Vec::new();
        let exports = |qmp: &mut Qmp, log: &mut Vec<String>, added: &[(&str, &str, bool)]| {
            for &(id, node, writable) in added {
                log.push(said(qmp.answer("block-export-add", nbd_export(id, node, writable))));
            }
        };
        let ended = |qmp: &mut Qmp, id: &str| {
            qmp.ok("job-cancel", json!({ "id": id }));
            qmp.await_event("JOB_STATUS_CHANGE", json!({"id": id, "status": "null"}));
        };
        let mirror = json!({"job-id": "m", "device": "a", "target": "b", "sync": "full"});

        // A mirror onto an exported node; then exports of its nodes.
        exports(&mut qmp, &mut log, &[("b-ro", "b", false)]);
        log.push(said(qmp.answer("blockdev-mirror", mirror.clone())));
        qmp.await_event("JOB_STATUS_CHANGE", json!({"id": "m", "status": "null"}));
        qmp.ok("block-export-del", json!({"id": "b-ro"}));
        qmp.await_event("BLOCK_EXPORT_DELETED", json!({"id": "b-ro"}));
        qmp.ok("blockdev-mirror", mirror);
        qmp.await_event("BLOCK_JOB_READY", json!({"device": "m"}));
        exports(&mut qmp, &mut log, &[("b-ro", "b", false), ("b-rw", "b", true), ("a-rw", "a", true)]);
        ended(&mut qmp, "m");
        qmp.ok("block-export-del", json!({"id": "a-rw"}));
        qmp.await_event("BLOCK_EXPORT_DELETED", json!({"id": "a-rw"}));

        // A backup's source is written by nobody new; its target may be read.
        exports(&mut qmp, &mut log, &[("a-rw", "a", true)]);
        let backup = json!({"job-id": "k", "device": "a", "target": "c", "sync": "full", "auto-finalize": false});
        log.push(said(qmp.answer("blockdev-backup", backup)));
        exports(&mut qmp, &mut log, &[("a-rw2", "a", true), ("a-ro", "a", false), ("c-ro", "c", false)]);
        ended(&mut qmp, "k");

        // A commit's intermediate is read by nobody new, its base written
        // by nobody else; a stream's intermediates are written by nobody
        // (another chain: a cancelled commit may have changed this one).
        exports(&mut qmp, &mut log, &[("base-rw", "base", true)]);
        let commit = json!({"job-id": "c", "device": "top", "top-node": "mid", "auto-finalize": false});
        log.push(said(qmp.answer("block-commit", commit.clone())));
        qmp.ok("block-export-del", json!({"id": "base-rw"}));
        qmp.await_event("BLOCK_EXPORT_DELETED", json!({"id": "base-rw"}));
        log.push(said(qmp.answer("block-commit", commit)));
        exports(&mut qmp, &mut log, &[("mid-ro", "mid", false), ("base-rw", "base", true), ("base-ro", "base", false)]);
        ended(&mut qmp, "c");
        log.push(said(qmp.answer("block-stream", json!({"job-id": "s", "device": "s-top", "auto-finalize": false}))));
        let streamed = [("s-mid-rw", "s-mid", true), ("s-base-rw", "s-base", true), ("s-mid-ro", "s-mid", false)];
        exports(&mut qmp, &mut log, &streamed);
        exports(&mut qmp, &mut log, &[("s-top-rw", "s-top", true)]);
        ended(&mut qmp, "s");

        // What was refused left nothing; what was there still serves.
        let listed = qmp.ok("query-block-exports", json!({}));
        let mut ids: Vec<&str> = listed.as_array().unwrap().iter().map(|e| e["id"].as_str().unwrap()).collect();
        ids.sort();
        log.push(ids.join(" "));
        let uri = format!("nbd+unix:///a-rw?socket={}", dir.path("nbd.sock").display());
        allowed("qemu-io", &["-f", "raw", "-c", "write -P 0x5a 0 64k", "-c", "read -P 0x5a 0 64k", &uri]);
        logs.push(log);
    }
    assert_eq!(logs[0], logs[1], "vsd answers as qemu-storage-daemon");
    let expected = [
        "ok".into(),
        conflict("b", "consistent read", (BB, "root"), (BB, "root")),
        conflict("b", "consistent read", (BB, "root"), (BB, "root")),
        conflict("b", "consistent read, write", (BB, "root"), (BB, "root")),
        "ok".into(),
        "ok".into(),
        "ok".into(),
        conflict("a", "write", (BB, "root"), ("node 'NODE_NAME'", "file")),
        "ok".into(),
        "ok".into(),
        "ok".into(),
        conflict("base", "write", (BB, "root"), (BB, "root")),
        "ok".into(),
        conflict("mid", "consistent read", (BB, "root"), ("commit job 'c'", "intermediate node")),
        conflict("base", "write", (BB, "root"), (BB, "root")),
        "ok".into(),
        "ok".into(),
        conflict("s-mid", "write", (BB, "root"), ("stream job 's'", "intermediate node")),
        conflict("s-base", "write", (BB, "root"), ("stream job 's'", "intermediate node")),
        "ok".into(),
        "ok".into(),
        "a-ro a-rw base-ro c-ro s-mid-ro s-top-rw".to_string(),
    ];
    assert_eq!(logs[0], expected);
}
