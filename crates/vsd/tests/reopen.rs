//! `blockdev-reopen`: the same commands, valid and refused, answered as
//! qemu-storage-daemon answers them; a read-only qcow2 image made
//! writable and written through a new export (exports already serving it
//! restart on it), clean afterwards, its persistent bitmaps loaded and
//! stored back; children defined inline reopened with their parent; the
//! image locks other programs see before and after, as with QEMU; writable
//! reopens refused by another process's locks or by the file's
//! permissions, nothing changed; a qcow2 overlay's backing node changed
//! and detached (answers and refusals as qemu-storage-daemon's), its
//! exports reading through the new one at once and the header unchanged.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use common::images::{MIB, assert_clean};
use common::qmp::Qmp;
use common::script::{Step, assert_same_as_qsd};
use common::{Daemon, Scratch, monitor, ok, run};
use serde_json::{Value, json};
use vsd_bench::{Client, ClientOptions};

const WRITE_LOCK: &str = "Failed to get \"write\" lock";

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn qcow2(dir: &Scratch, name: &str) -> PathBuf {
    let image = dir.path(name);
    ok("qemu-img", &["create", "-q", "-f", "qcow2", path(&image), "64M"]);
    image
}

fn blockdev(text: String) -> [String; 2] {
    ["--blockdev".into(), text]
}

/// `blockdev-reopen` of these entries.
fn reopen(entries: Value) -> Step {
    Step::Command("blockdev-reopen", json!({ "options": entries }))
}

/// A `file` node's entry.
fn file(node: &str, filename: &Path, read_only: bool) -> Value {
    json!({"driver": "file", "node-name": node, "filename": path(filename), "read-only": read_only})
}

/// A format node's entry over `file`.
fn format(driver: &str, node: &str, file: &str, read_only: bool) -> Value {
    json!({"driver": driver, "node-name": node, "file": file, "read-only": read_only})
}

/// The images and nodes of the differential script, the same in each
/// daemon's directory: `q0` (qcow2) over `f0`, both read-only; `w0` (raw)
/// over `r0`; `x1` (qcow2) over `x0` and `w1` (raw) over `f1`, exported
/// writable over NBD; `c0`, whose header names a backing file; `s0` and
/// `t0` for a backup.
fn differential_nodes(dir: &Scratch) -> Vec<String> {
    let (a, x, c) = (qcow2(dir, "a.qcow2"), qcow2(dir, "x.qcow2"), dir.path("c.qcow2"));
    let backing = dir.image("backing.raw", 64 * MIB);
    ok("qemu-img", &["create", "-q", "-f", "qcow2", "-b", path(&backing), "-F", "raw", path(&c)]);
    let raw = |name: &str| dir.image(name, 64 * MIB).display().to_string();
    let nodes = [
        format!("driver=file,node-name=f0,filename={},read-only=on", a.display()),
        "driver=qcow2,node-name=q0,file=f0,read-only=on".into(),
        format!("driver=file,node-name=r0,filename={}", raw("b.raw")),
        "driver=raw,node-name=w0,file=r0".into(),
        format!("driver=file,node-name=x0,filename={}", x.display()),
        "driver=qcow2,node-name=x1,file=x0".into(),
        format!("driver=file,node-name=f1,filename={}", raw("d.raw")),
        "driver=raw,node-name=w1,file=f1".into(),
        format!("driver=file,node-name=cf0,filename={}", c.display()),
        "driver=qcow2,node-name=c0,file=cf0".into(),
        format!("driver=file,node-name=s0,filename={}", raw("s.raw")),
        format!("driver=file,node-name=t0,filename={}", raw("t.raw")),
    ];
    let mut args: Vec<String> = nodes.into_iter().flat_map(blockdev).collect();
    args.extend([
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", dir.path("nbd.sock").display()),
        "--export".into(),
        "type=nbd,id=ex,node-name=x1,name=x,writable=on".into(),
        "--export".into(),
        "type=nbd,id=ew,node-name=w1,name=w,writable=on".into(),
    ]);
    args
}

/// The differential script, for the images of [`differential_nodes`] in `dir`.
fn differential_script(dir: &Path) -> Vec<Step> {
    let at = |name: &str| dir.join(name);
    let (a, b, d, x, s, t) = (at("a.qcow2"), at("b.raw"), at("d.raw"), at("x.qcow2"), at("s.raw"), at("t.raw"));
    let f0 = |ro| file("f0", &a, ro);
    let q0 = |ro| format("qcow2", "q0", "f0", ro);
    vec![
        // The arguments' shape, as QEMU's schema checks it.
        Step::Command("blockdev-reopen", json!({})),
        Step::Command("blockdev-reopen", json!({"options": {}})),
        reopen(json!([5])),
        Step::Command("blockdev-reopen", json!({"options": [f0(true)], "x": 1})),
        reopen(json!([{"node-name": "f0", "filename": path(&a)}])),
        reopen(json!([{"driver": "file", "node-name": "f0", "filename": path(&a), "read-only": "yes"}])),
        reopen(json!([{"driver": "file", "node-name": 5, "filename": path(&a)}])),
        // The nodes, then their options: only read-only may change.
        reopen(json!([{"driver": "file", "filename": path(&a)}])),
        reopen(json!([f0(true), file("nope", &a, true)])),
        reopen(json!([file("f0", &b, true)])),
        reopen(json!([{"driver": "file", "node-name": "r0", "filename": path(&b), "aio": "threads"}])),
        reopen(json!([format("raw", "q0", "f0", true)])),
        reopen(json!([{"driver": "qcow2", "node-name": "q0", "read-only": true}])),
        reopen(json!([{"driver": "qcow2", "node-name": "q0", "file": {"driver": "file", "filename": path(&a)}}])),
        reopen(json!([format("qcow2", "c0", "cf0", false)])),
        reopen(json!([{"driver": "file", "node-name": "r0", "filename": path(&b), "cache": {"direct": false}}])),
        reopen(json!([file("r0", &b, true), file("r0", &b, false)])),
        // A format needs its file writable, and keeps it so while writable.
        reopen(json!([q0(false)])),
        reopen(json!([f0(false), q0(false)])),
        reopen(json!([f0(true)])),
        reopen(json!([f0(true), q0(true)])),
        reopen(json!([q0(false)])),
        reopen(json!([q0(true), f0(true)])),
        // A raw node follows its users.
        reopen(json!([format("raw", "w0", "r0", true)])),
        reopen(json!([file("r0", &b, true)])),
        reopen(json!([file("r0", &b, false), format("raw", "w0", "r0", false)])),
        // Nodes written by an export, or by a job.
        reopen(json!([format("qcow2", "x1", "x0", true)])),
        reopen(json!([file("x0", &x, true), format("qcow2", "x1", "x0", true)])),
        reopen(json!([file("x0", &x, true)])),
        reopen(json!([format("raw", "w1", "f1", true), file("f1", &d, true)])),
        reopen(json!([file("f1", &d, true), format("raw", "w1", "f1", false)])),
        Step::Command(
            "blockdev-backup",
            json!({"job-id": "j", "device": "s0", "target": "t0", "sync": "full", "speed": 1}),
        ),
        reopen(json!([file("t0", &t, true)])),
        reopen(json!([file("s0", &s, true)])),
        reopen(json!([file("s0", &s, false)])),
    ]
}

#[test]
fn reopen_answers_as_qemu_storage_daemon_does() {
    // QEMU drains a job's node around a reopen (paused, running): vsd's
    // jobs never stop for one, so only the answers are compared. One
    // script names the images of both daemons: through a link to the
    // directory of the daemon that runs it.
    let link = Link(std::env::temp_dir().join(format!("vsd-test-reopen-images-{}", std::process::id())));
    let setup = |dir: &Scratch| {
        link.to(&dir.0);
        let (real, linked) = (dir.0.display().to_string(), link.0.display().to_string());
        differential_nodes(dir).into_iter().map(|arg| arg.replace(&real, &linked)).collect()
    };
    assert_same_as_qsd("reopen-qmp", &setup, &differential_script(&link.0), |_| Vec::new());
}

/// A symbolic link, removed on drop.
struct Link(PathBuf);

impl Link {
    /// Points the link at `target`.
    fn to(&self, target: &Path) {
        let _ = std::fs::remove_file(&self.0);
        std::os::unix::fs::symlink(target, &self.0).unwrap();
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The read-only flag of each node the daemon has, by name.
fn read_only(qmp: &mut Qmp) -> Vec<(String, bool)> {
    let nodes = qmp.ok("query-named-block-nodes", json!({}));
    let mut flags: Vec<(String, bool)> = nodes
        .as_array()
        .unwrap()
        .iter()
        .map(|n| (n["node-name"].as_str().unwrap().to_string(), n["ro"].as_bool().unwrap()))
        .collect();
    flags.sort();
    flags
}

fn named(pairs: &[(&str, bool)]) -> Vec<(String, bool)> {
    pairs.iter().map(|(name, ro)| (name.to_string(), *ro)).collect()
}

/// A daemon `program` starts with qcow2 node `q0` over file node `f0` on
/// `image`, both read-only unless `writable`, an NBD server on
/// `nbd.sock` and a monitor on `qmp.sock` in `dir`, and `extra` arguments.
fn served_qcow2(
    program: fn(&Scratch, &[String]) -> Daemon,
    dir: &Scratch,
    image: &Path,
    writable: bool,
    extra: &[String],
) -> (Daemon, Qmp) {
    let ro = if writable { "off" } else { "on" };
    let socket = dir.path("qmp.sock");
    let mut args: Vec<String> = [
        format!("driver=file,node-name=f0,filename={},read-only={ro}", image.display()),
        format!("driver=qcow2,node-name=q0,file=f0,read-only={ro}"),
    ]
    .into_iter()
    .flat_map(blockdev)
    .collect();
    args.extend(["--nbd-server".into(), format!("addr.type=unix,addr.path={}", dir.path("nbd.sock").display())]);
    args.extend(monitor(&socket));
    args.extend_from_slice(extra);
    let daemon = program(dir, &args);
    let qmp = Qmp::connect(&socket);
    (daemon, qmp)
}

fn both(read_only: bool, image: &Path) -> Value {
    let (f0, q0) = (file("f0", image, read_only), format("qcow2", "q0", "f0", read_only));
    // Writable: the file first; read-only: the format first (either is taken).
    if read_only { json!({ "options": [q0, f0] }) } else { json!({ "options": [f0, q0] }) }
}

/// qemu-io on NBD export `name` of the server on `socket` (read-only
/// unless the command writes).
fn nbd_io(socket: &Path, name: &str, command: &str) -> std::process::Output {
    let uri = format!("nbd+unix:///{name}?socket={}", socket.display());
    let mut args = vec!["-f", "raw", "-c", command, &uri];
    if !command.starts_with("write") {
        args.insert(0, "-r");
    }
    run("qemu-io", &args)
}

#[test]
fn a_read_only_qcow2_image_made_writable_takes_writes_and_is_left_clean() {
    let dir = Scratch::new("reopen-writable");
    let image = qcow2(&dir, "disk.qcow2");
    ok("qemu-io", &["-f", "qcow2", "-c", "write -P 0x11 0 1M", path(&image)]);
    let vhost =
        format!("type=vhost-user-blk,id=v0,node-name=q0,addr.type=unix,addr.path={}", dir.path("v.sock").display());
    let (daemon, mut qmp) = served_qcow2(Daemon::vsd, &dir, &image, false, &["--export".into(), vhost]);
    let nbd = dir.path("nbd.sock");
    // A reader whose queue has seen the image before it was reopened.
    let mut client =
        Client::connect(&dir.path("v.sock"), ClientOptions { read_only: true, ..Default::default() }).unwrap();
    let mut reader = client.take_queue(0).unwrap();
    let mut block = vec![0u8; 4096];
    reader.read_at(MIB, &mut block).unwrap();
    assert!(block.iter().all(|b| *b == 0), "nothing there yet");
    qmp.ok("block-export-add", json!({"type": "nbd", "id": "ro", "node-name": "q0", "name": "ro"}));
    let refused =
        qmp.answer("block-export-add", json!({"type": "nbd", "id": "rw", "node-name": "q0", "writable": true}));
    assert!(refused.get("error").is_some(), "a writable export of a read-only node: {refused}");

    qmp.ok("blockdev-reopen", both(false, &image));
    assert_eq!(read_only(&mut qmp), named(&[("f0", false), ("q0", false)]));
    qmp.ok("block-export-add", json!({"type": "nbd", "id": "rw", "node-name": "q0", "name": "rw", "writable": true}));
    let wrote = nbd_io(&nbd, "rw", "write -P 0x22 1M 1M");
    assert!(wrote.status.success(), "{}", String::from_utf8_lossy(&wrote.stderr));
    reader.read_at(MIB, &mut block).unwrap();
    assert!(block.iter().all(|b| *b == 0x22), "the export restarted on the image as reopened");
    for (export, command) in [("rw", "read -P 0x11 0 1M"), ("ro", "read -P 0x22 1M 1M")] {
        let read = nbd_io(&nbd, export, command);
        assert!(read.status.success(), "{export}: {command}: {:?}", read);
    }

    // Read-only again once the writer is gone: written back and clean at
    // once, and other readers let in.
    qmp.ok("block-export-del", json!({"id": "rw"}));
    qmp.ok("blockdev-reopen", both(true, &image));
    let contents = ["-r", "-f", "qcow2", "-c", "read -P 0x11 0 1M", "-c", "read -P 0x22 1M 1M", path(&image)];
    assert_clean(&image);
    ok("qemu-io", &contents);
    drop((reader, client, qmp));
    assert!(daemon.stop().success());
    assert_clean(&image);
    ok("qemu-io", &contents);
}

/// The persistent bitmaps vsd lists on node `q0`: name and count.
fn bitmaps(qmp: &mut Qmp) -> Vec<(String, u64)> {
    let nodes = qmp.ok("query-named-block-nodes", json!({}));
    let q0 = nodes.as_array().unwrap().iter().find(|n| n["node-name"] == "q0").unwrap().clone();
    let listed = q0["dirty-bitmaps"].as_array().cloned().unwrap_or_default();
    listed.iter().map(|b| (b["name"].as_str().unwrap().to_string(), b["count"].as_u64().unwrap())).collect()
}

#[test]
fn persistent_bitmaps_load_when_writable_and_are_stored_when_read_only_again() {
    let dir = Scratch::new("reopen-bitmaps");
    let image = qcow2(&dir, "disk.qcow2");
    ok("qemu-img", &["bitmap", "--add", path(&image), "b0"]);
    let (_daemon, mut qmp) = served_qcow2(Daemon::vsd, &dir, &image, false, &[]);
    qmp.ok("blockdev-reopen", both(false, &image));
    assert_eq!(bitmaps(&mut qmp), [("b0".to_string(), 0)]);
    let flags = || common::images::info(&image)["format-specific"]["data"]["bitmaps"][0]["flags"].clone();
    assert_eq!(flags(), json!(["in-use", "auto"]), "flagged in use while writable");
    qmp.ok("block-export-add", json!({"type": "nbd", "id": "rw", "node-name": "q0", "name": "rw", "writable": true}));
    let wrote = nbd_io(&dir.path("nbd.sock"), "rw", "write -P 0x44 0 64k");
    assert!(wrote.status.success(), "{wrote:?}");
    qmp.ok("block-export-del", json!({"id": "rw"}));

    qmp.ok("blockdev-reopen", both(true, &image));
    assert_eq!(flags(), json!(["auto"]), "stored, and no longer in use");
    qmp.ok("blockdev-reopen", both(false, &image));
    assert_eq!(bitmaps(&mut qmp), [("b0".to_string(), 65536)], "the write recorded, through the image");
}

#[test]
fn children_defined_inline_are_reopened_with_their_parent_as_in_qemu() {
    let flags = |program: fn(&Scratch, &[String]) -> Daemon, name: &str| {
        let dir = Scratch::new(name);
        let image = qcow2(&dir, "disk.qcow2");
        let socket = dir.path("qmp.sock");
        let node = json!({"driver": "qcow2", "node-name": "q0", "read-only": true,
            "file": {"driver": "file", "filename": path(&image)}});
        let mut args = blockdev(node.to_string()).to_vec();
        args.extend(monitor(&socket));
        let _daemon = program(&dir, &args);
        let mut qmp = Qmp::connect(&socket);
        // Each daemon names the child its own way.
        let child = read_only(&mut qmp).into_iter().map(|(name, _)| name).find(|name| name != "q0").unwrap();
        let mut seen = Vec::new();
        for ro in [false, true] {
            qmp.ok("blockdev-reopen", json!({"options": [format("qcow2", "q0", &child, ro)]}));
            let named = |(name, ro): (String, bool)| (if name == child { "child".into() } else { name }, ro);
            seen.push(read_only(&mut qmp).into_iter().map(named).collect::<Vec<_>>());
        }
        seen
    };
    let vsd = flags(Daemon::vsd, "reopen-inline-vsd");
    assert_eq!(vsd, flags(Daemon::qsd, "reopen-inline-qsd"));
    assert_eq!(vsd, [named(&[("child", false), ("q0", false)]), named(&[("child", true), ("q0", true)])]);
}

/// What other programs may do with `image`, as each says it (the first
/// line, the image's name left out): `qemu-img info` with and without
/// `-U`, and `qemu-io` reading and writing.
fn probes(image: &Path) -> Vec<(bool, String)> {
    let image = path(image);
    let commands: [&[&str]; 4] = [
        &["qemu-img", "info", image],
        &["qemu-img", "info", "-U", image],
        &["qemu-io", "-r", "-f", "qcow2", "-c", "read 0 4k", image],
        &["qemu-io", "-f", "qcow2", "-c", "write 0 4k", image],
    ];
    commands
        .iter()
        .map(|command| {
            let out = run(command[0], &command[1..]);
            let said = String::from_utf8_lossy(&out.stderr).lines().next().unwrap_or_default().replace(image, "IMAGE");
            (out.status.success(), said)
        })
        .collect()
}

#[test]
fn other_programs_see_the_locks_of_a_reopened_node_as_qemu_storage_daemon_leaves_them() {
    let see = |program: fn(&Scratch, &[String]) -> Daemon, name: &str| {
        let dir = Scratch::new(name);
        let image = qcow2(&dir, "disk.qcow2");
        let (_daemon, mut qmp) = served_qcow2(program, &dir, &image, true, &[]);
        let writable = probes(&image);
        qmp.ok("blockdev-reopen", both(true, &image));
        let read_only = probes(&image);
        qmp.ok("blockdev-reopen", both(false, &image));
        [writable, read_only, probes(&image)]
    };
    let vsd = see(Daemon::vsd, "reopen-locks-vsd");
    let qsd = see(Daemon::qsd, "reopen-locks-qsd");
    assert_eq!(vsd, qsd);
    let allowed = |seen: &[(bool, String)]| seen.iter().map(|(ok, _)| *ok).collect::<Vec<_>>();
    assert_eq!(allowed(&vsd[0]), [false, true, false, false], "writable: only a reader that shares writes");
    assert_eq!(allowed(&vsd[1]), [true, true, true, false], "read-only: any reader, no writer");
    assert_eq!(vsd[2], vsd[0], "writable again");
}

/// A `qemu-io` holding `image` open read-only (which refuses writers)
/// until dropped.
struct Holder(Child);

impl Holder {
    /// Once qemu-io has read from the image: it has it open.
    fn qemu_io(image: &Path) -> Self {
        let mut child = Command::new("qemu-io")
            .args(["-r", "-f", "qcow2", path(image)])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.as_mut().unwrap().write_all(b"read 0 512\n").unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let read = lines.find(|line| line.as_ref().is_ok_and(|l| l.contains("read 512/512 bytes")));
        assert!(read.is_some(), "qemu-io did not read {}", image.display());
        Self(child)
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_writable_reopen_refused_by_another_process_changes_nothing() {
    let dir = Scratch::new("reopen-refused");
    let image = qcow2(&dir, "disk.qcow2");
    ok("qemu-io", &["-f", "qcow2", "-c", "write -P 0x33 0 64k", path(&image)]);
    let (_daemon, mut qmp) = served_qcow2(Daemon::vsd, &dir, &image, false, &[]);
    let nbd = dir.path("nbd.sock");
    let read_only_nodes = named(&[("f0", true), ("q0", true)]);

    // A second vsd, then qemu-io, each with the image open read-only.
    let other_dir = Scratch::new("reopen-refused-other");
    let other = served_qcow2(Daemon::vsd, &other_dir, &image, false, &[]);
    let qemu_io = Holder::qemu_io(&image);
    let refused = json!({"error": {"class": "GenericError", "desc": WRITE_LOCK}});
    assert_eq!(qmp.answer("blockdev-reopen", both(false, &image)), refused, "both hold it");
    assert_eq!(read_only(&mut qmp), read_only_nodes);
    drop(other);
    assert_eq!(qmp.answer("blockdev-reopen", both(false, &image)), refused, "qemu-io holds it");
    assert_eq!(read_only(&mut qmp), read_only_nodes);
    drop(qemu_io);

    // Still read-only and usable; writable once nobody refuses writers.
    qmp.ok("block-export-add", json!({"type": "nbd", "id": "ro", "node-name": "q0", "name": "ro"}));
    let read = nbd_io(&nbd, "ro", "read -P 0x33 0 64k");
    assert!(read.status.success(), "{read:?}");
    qmp.ok("blockdev-reopen", both(false, &image));
    assert_eq!(read_only(&mut qmp), named(&[("f0", false), ("q0", false)]));
}

/// Makes `file` immutable (even to root) until dropped.
struct Immutable(PathBuf);

impl Immutable {
    fn new(file: &Path) -> Option<Self> {
        run("chattr", &["+i", path(file)]).status.success().then(|| Self(file.to_path_buf()))
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        let _ = run("chattr", &["-i", path(&self.0)]);
    }
}

#[test]
fn a_file_that_cannot_be_opened_writable_stays_read_only_as_in_qemu() {
    let answer = |program: fn(&Scratch, &[String]) -> Daemon, name: &str| {
        let dir = Scratch::new(name);
        let image = dir.image("locked.raw", MIB);
        let socket = dir.path("qmp.sock");
        let mut args = blockdev(format!("driver=file,node-name=i0,filename={},read-only=on", image.display())).to_vec();
        args.extend(monitor(&socket));
        let daemon = program(&dir, &args);
        let mut qmp = Qmp::connect(&socket);
        let _immutable = Immutable::new(&image)?;
        let refused = qmp.answer("blockdev-reopen", json!({ "options": [file("i0", &image, false)] }));
        let flags = read_only(&mut qmp);
        drop(daemon);
        // The daemons' directories differ: the message names the image.
        Some((refused.to_string().replace(path(&image), "IMAGE"), flags))
    };
    let Some(vsd) = answer(Daemon::vsd, "reopen-immutable-vsd") else {
        eprintln!("skipped: chattr +i is not available here");
        return;
    };
    assert_eq!(Some(&vsd), answer(Daemon::qsd, "reopen-immutable-qsd").as_ref());
    assert!(vsd.0.contains("Could not open 'IMAGE': Operation not permitted"), "{}", vsd.0);
    assert_eq!(vsd.1, named(&[("i0", true)]));
}

/// The images and nodes of the backing script, the same in each daemon's
/// directory: `o` (qcow2 over `fo`, its header naming `base1.raw`) over
/// `b1` (raw, all 0x11), `b2` (qcow2, all 0x22), `s` (a smaller qcow2),
/// `w` (raw). `o` holds 0x33 in its first MiB.
fn backing_nodes(dir: &Scratch) -> Vec<String> {
    let (base1, base2, small, overlay) =
        (dir.image("base1.raw", 4 * MIB), dir.path("base2.qcow2"), dir.path("s.qcow2"), dir.path("o.qcow2"));
    ok("qemu-io", &["-f", "raw", "-c", "write -P 0x11 0 4M", path(&base1)]);
    ok("qemu-img", &["create", "-q", "-f", "qcow2", path(&base2), "4M"]);
    ok("qemu-io", &["-f", "qcow2", "-c", "write -P 0x22 0 4M", path(&base2)]);
    ok("qemu-img", &["create", "-q", "-f", "qcow2", path(&small), "1M"]);
    ok("qemu-img", &["create", "-q", "-f", "qcow2", "-b", path(&base1), "-F", "raw", path(&overlay), "4M"]);
    ok("qemu-io", &["-f", "qcow2", "-c", "write -P 0x33 0 1M", path(&overlay)]);
    let file = |node: &str, image: &Path| format!("driver=file,node-name={node},filename={}", image.display());
    let nodes = [
        file("fb1", &base1),
        "driver=raw,node-name=b1,file=fb1".into(),
        file("fb2", &base2),
        "driver=qcow2,node-name=b2,file=fb2".into(),
        file("fs", &small),
        "driver=qcow2,node-name=s,file=fs".into(),
        file("fo", &overlay),
        "driver=qcow2,node-name=o,file=fo,backing=b1".into(),
        file("fw", &dir.image("w.raw", 4 * MIB)),
        "driver=raw,node-name=w,file=fw".into(),
    ];
    nodes.into_iter().flat_map(blockdev).collect()
}

/// A qcow2 node's entry over `file`, with `backing` if it is not absent
/// (`Value::Null` is `"backing": null`).
fn qcow2_entry(node: &str, file: &str, backing: Option<Value>) -> Value {
    let mut entry = json!({"driver": "qcow2", "node-name": node, "file": file});
    if let Some(backing) = backing {
        entry["backing"] = backing;
    }
    entry
}

fn read_only_entry(mut entry: Value) -> Value {
    entry["read-only"] = json!(true);
    entry
}

/// The backing script, for the nodes of [`backing_nodes`].
fn backing_script() -> Vec<Step> {
    let o = |backing: Option<Value>| qcow2_entry("o", "fo", backing);
    let b2 = |backing: Option<Value>| qcow2_entry("b2", "fb2", backing);
    let to = |name: &str| Some(json!(name));
    let inline = json!({"driver": "raw", "file": "fb2"});
    vec![
        // The schema: only formats with backing files take one, a node
        // name, null or options.
        reopen(json!([o(Some(json!(5)))])),
        reopen(json!([{"driver": "raw", "node-name": "w", "file": "fw", "backing": "b1"}])),
        reopen(json!([{"driver": "raw", "node-name": "w", "file": "fw", "backing": null}])),
        // Left out, unknown, inline, or a loop.
        reopen(json!([o(None)])),
        reopen(json!([o(to("nope"))])),
        reopen(json!([o(to(""))])),
        reopen(json!([o(Some(inline))])),
        reopen(json!([o(to("o"))])),
        reopen(json!([b2(to("o"))])),
        reopen(json!([o(to("b2")), b2(to("o"))])),
        reopen(json!([b2(to("o")), o(to("b2"))])),
        // Its first error wins over the entry's other options.
        reopen(json!([qcow2_entry("o", "fb2", to("nope"))])),
        // Changed: another node, a smaller one, the same, none (the header
        // still names a file: `backing` is still wanted), and back.
        reopen(json!([o(to("b2"))])),
        reopen(json!([o(to("s"))])),
        reopen(json!([o(to("s")), o(to("b2"))])),
        reopen(json!([o(Some(Value::Null))])),
        reopen(json!([o(None)])),
        reopen(json!([o(to("b1")), b2(Some(Value::Null))])),
        // With its read-only flag.
        reopen(json!([read_only_entry(o(to("b2")))])),
        // An inactive node cannot be the backing of an active one.
        Step::Command("blockdev-set-active", json!({"node-name": "s", "active": false})),
        reopen(json!([o(to("s"))])),
        Step::Command("blockdev-set-active", json!({"node-name": "s", "active": true})),
        // A stream freezes the links it goes down.
        reopen(json!([o(to("b1"))])),
        Step::Command("block-stream", json!({"job-id": "j", "device": "o", "speed": 1})),
        reopen(json!([o(to("b2"))])),
        reopen(json!([o(Some(Value::Null))])),
        reopen(json!([o(to("b1"))])),
        Step::Command("block-job-cancel", json!({"device": "j"})),
        Step::Await("BLOCK_JOB_CANCELLED", json!({"device": "j"})),
        reopen(json!([o(to("b2"))])),
    ]
}

#[test]
fn backing_changes_answer_as_qemu_storage_daemon_does() {
    assert_same_as_qsd("reopen-backing", &backing_nodes, &backing_script(), |_| Vec::new());
}

/// Whether every byte of `len` bytes at `offset` that `queue` reads is `byte`.
fn reads(queue: &mut vsd_bench::Queue, offset: u64, len: usize, byte: u8) -> bool {
    let mut data = vec![0u8; len];
    queue.read_at(offset, &mut data).unwrap();
    data.iter().all(|b| *b == byte)
}

#[test]
fn exports_read_through_the_new_backing_node_at_once_and_the_header_stays() {
    let dir = Scratch::new("reopen-backing-reads");
    let socket = dir.path("qmp.sock");
    let mut args = backing_nodes(&dir);
    let vhost = format!(
        "type=vhost-user-blk,id=v,node-name=o,writable=on,addr.type=unix,addr.path={}",
        dir.path("v.sock").display()
    );
    args.extend(["--export".into(), vhost]);
    args.extend(["--nbd-server".into(), format!("addr.type=unix,addr.path={}", dir.path("nbd.sock").display())]);
    args.extend(["--export".into(), "type=nbd,id=n,node-name=o,name=o".into()]);
    args.extend(monitor(&socket));
    let daemon = Daemon::vsd(&dir, &args);
    let mut qmp = Qmp::connect(&socket);
    // A queue opened before any change, kept across them.
    let mut client = Client::connect(&dir.path("v.sock"), ClientOptions::default()).unwrap();
    let mut queue = client.take_queue(0).unwrap();
    let nbd_reads = |command: &str| nbd_io(&dir.path("nbd.sock"), "o", command).status.success();
    let (own, below) = (0, 2 * MIB);
    assert!(reads(&mut queue, own, 4096, 0x33) && reads(&mut queue, below, 4096, 0x11));

    qmp.ok("blockdev-reopen", json!({"options": [qcow2_entry("o", "fo", Some(json!("b2")))]}));
    assert!(reads(&mut queue, below, MIB as usize, 0x22), "unallocated clusters read from the new backing node");
    assert!(reads(&mut queue, own, MIB as usize, 0x33), "the overlay's own clusters stay");
    assert!(nbd_reads("read -P 0x22 2M 1M") && nbd_reads("read -P 0x33 0 1M"), "the NBD export too");
    // A write into part of a cluster copies the rest from the new backing node.
    queue.write_at(3 * MIB, &[0x44; 4096]).unwrap();
    assert!(reads(&mut queue, 3 * MIB + 4096, 60 << 10, 0x22));

    qmp.ok("blockdev-reopen", json!({"options": [qcow2_entry("o", "fo", Some(Value::Null))]}));
    assert!(reads(&mut queue, below, MIB as usize, 0), "no backing node: unallocated clusters read zeroes");
    assert!(reads(&mut queue, 3 * MIB, 4096, 0x44) && reads(&mut queue, 3 * MIB + 4096, 4096, 0x22));
    assert!(nbd_reads("read -P 0 2M 1M"));
    let nodes = qmp.ok("query-named-block-nodes", json!({}));
    assert!(nodes.as_array().unwrap().iter().any(|n| n["node-name"] == "b1"), "the old backing node stays");

    qmp.ok("blockdev-reopen", json!({"options": [qcow2_entry("o", "fo", Some(json!("b1")))]}));
    assert!(reads(&mut queue, below, 4096, 0x11), "a backing node again");
    drop((queue, client, qmp));
    assert!(daemon.stop().success());
    let image = dir.path("o.qcow2");
    assert_clean(&image);
    assert_eq!(common::images::info(&image)["backing-filename"], json!(path(&dir.path("base1.raw"))), "as created");
}

/// Where vsd is stricter than QEMU: a backing node changes only where no
/// job uses the node and nothing reads it through another node in use
/// (their queues were opened on the old chain); refused, nothing changes.
#[test]
fn a_backing_change_under_a_job_or_a_reader_above_is_refused() {
    let dir = Scratch::new("reopen-backing-refused");
    let images = common::images::qcow2_chain(&dir);
    let (_daemon, mut qmp) = common::images::served_chain(&dir, &images);
    let reopen = |node: &str, backing: Value| {
        let file = format!("{node}-file");
        json!({"options": [{"driver": "qcow2", "node-name": node, "file": file, "backing": backing}]})
    };
    let refused = qmp.answer("blockdev-reopen", reopen("mid", Value::Null));
    let read_through = "Node 'mid' is read through node 'top', which is in use: vsd changes its backing only where \
                        nothing uses it through another node";
    assert_eq!(refused["error"]["desc"], read_through, "{refused}");

    let target = dir.image("target.img", common::images::CHAIN_SIZE);
    qmp.ok("blockdev-add", json!({"driver": "file", "node-name": "target", "filename": target}));
    qmp.ok("blockdev-mirror", json!({"job-id": "m", "device": "top", "target": "target", "sync": "full", "speed": 1}));
    let refused = qmp.answer("blockdev-reopen", reopen("top", json!("base")));
    let used = "Node 'top' is used by job 'm': vsd changes its backing only unused";
    assert_eq!(refused["error"]["desc"], used, "{refused}");
    let nodes = qmp.ok("query-named-block-nodes", json!({"flat": true}));
    let top = nodes.as_array().unwrap().iter().find(|n| n["node-name"] == "top").unwrap();
    assert_eq!(top["backing_file_depth"], 2, "top still reads mid, then base: {top}");
}
