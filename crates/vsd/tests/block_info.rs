//! `query-block`, `change-backing-file` and `block-job-change`, against
//! QEMU's own: query-block's shape as QEMU shows a guest's disk on the
//! same node, backing file names rewritten as qemu-storage-daemon
//! rewrites them (`qemu-img info` reads both), and a running background
//! mirror switched to write-blocking under a writer, with QEMU's answers
//! to each mistake.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::images::{BLOCK, MIB, Writer, info};
use common::qmp::Qmp;
use common::script::{Step, assert_same_as_qsd, assert_same_as_qsd_then};
use common::{Daemon, Scratch, monitor};
use serde_json::{Value, json};

fn qemu_img(args: &[&str]) {
    let out = Command::new("qemu-img").args(args).output().unwrap();
    assert!(out.status.success(), "qemu-img {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// base.img (raw) under mid.qcow2 under top.qcow2, other.qcow2 over
/// base.img too, and an empty base2.qcow2, in `dir`.
fn chain(dir: &Scratch) {
    let path = |name: &str| dir.path(name).display().to_string();
    qemu_img(&["create", "-q", "-f", "raw", &path("base.img"), "16M"]);
    qemu_img(&["create", "-q", "-f", "qcow2", "-b", "base.img", "-F", "raw", &path("mid.qcow2")]);
    qemu_img(&["create", "-q", "-f", "qcow2", "-b", "mid.qcow2", "-F", "qcow2", &path("top.qcow2")]);
    qemu_img(&["create", "-q", "-f", "qcow2", "-b", "base.img", "-F", "raw", &path("other.qcow2")]);
    // What mid.qcow2 is to name as its backing file.
    qemu_img(&["create", "-q", "-f", "qcow2", &path("base2.qcow2"), "16M"]);
}

/// `--blockdev`s of file node `{name}f` and format node `name` on `file`.
fn image(dir: &Scratch, name: &str, file: &str, format: &str) -> Vec<String> {
    let path = dir.path(file).display().to_string();
    vec![
        "--blockdev".into(),
        format!("driver=file,node-name={name}f,filename={path}"),
        "--blockdev".into(),
        format!("driver={format},node-name={name},file={name}f"),
    ]
}

/// The chain with every node named: b0 (raw) under m0 under q0, and oq
/// (over b0 too), q0 served over NBD.
fn named_chain(dir: &Scratch) -> Vec<String> {
    chain(dir);
    let mut args = image(dir, "b0", "base.img", "raw");
    args.extend(image(dir, "m0", "mid.qcow2", "qcow2"));
    args.last_mut().unwrap().push_str(",backing=b0");
    args.extend(image(dir, "q0", "top.qcow2", "qcow2"));
    args.last_mut().unwrap().push_str(",backing=m0");
    args.extend(image(dir, "oq", "other.qcow2", "qcow2"));
    args.last_mut().unwrap().push_str(",backing=b0");
    args.extend([
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", dir.path("nbd.sock").display()),
        "--export".into(),
        "type=nbd,id=e0,node-name=q0,name=rw,writable=on".into(),
    ]);
    args
}

fn backing_of(image: &Path) -> (Value, Value) {
    let info = info(image);
    (info["backing-filename"].clone(), info["backing-filename-format"].clone())
}

#[test]
fn change_backing_file_rewrites_the_header_as_qemu_storage_daemon_does() {
    let change = |device: &str, image: &str, file: &str| {
        Step::Command("change-backing-file", json!({"device": device, "image-node-name": image, "backing-file": file}))
    };
    let script = [
        change("nowhere", "m0", "x"),
        change("q0", "nowhere", "x"),
        change("q0", "b0", "x"),
        change("q0", "oq", "x"),
        change("m0", "m0", "x"),
        change("q0f", "q0f", "x"),
        Step::Command("change-backing-file", json!({"device": "q0", "image-node-name": "m0"})),
        Step::Command(
            "change-backing-file",
            json!({"device": "q0", "image-node-name": "m0", "backing-file": "x", "force": true}),
        ),
        change("q0", "m0", "base2.qcow2"),
        // Longer than QEMU opens: refused, the name left as it is.
        change("q0", "m0", &"x".repeat(1024)),
        change("q0", "q0", ""),
        change("oq", "oq", "../other/base.img"),
    ];
    assert_same_as_qsd_then("backing-file", &named_chain, &script, |_| Vec::new(), &|dir| {
        // QEMU names the image's own format as the backing file's.
        assert_eq!(backing_of(&dir.path("mid.qcow2")), (json!("base2.qcow2"), json!("qcow2")));
        assert_eq!(backing_of(&dir.path("top.qcow2")), (Value::Null, Value::Null), "none named");
        assert_eq!(backing_of(&dir.path("other.qcow2")), (json!("../other/base.img"), json!("qcow2")));
        qemu_img(&["check", "-q", &dir.path("mid.qcow2").display().to_string()]);
    });
}

/// A chain opened from the headers, its backing nodes read-only: the
/// image is made writable for the change, read-only again after, and the
/// chain reads as before (the new name counts from the next open).
#[test]
fn change_backing_file_of_a_read_only_image_reopens_it_for_the_change_only() {
    let dir = Scratch::new("backing-file-ro");
    chain(&dir);
    let mut args = image(&dir, "q0", "top.qcow2", "qcow2");
    args.extend(monitor(&dir.path("qmp.sock")));
    let socket = dir.path("vhost.sock");
    args.extend([
        "--export".into(),
        format!("type=vhost-user-blk,id=v0,node-name=q0,writable=on,addr.type=unix,addr.path={}", socket.display()),
    ]);
    let base = std::fs::OpenOptions::new().write(true).open(dir.path("base.img")).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&base, &[0x77; 4096], 0).unwrap();
    let daemon = Daemon::vsd(&dir, &args);
    let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
    let nodes = qmp.ok("query-named-block-nodes", json!({}));
    let top = nodes.as_array().unwrap().iter().find(|n| n["node-name"] == "q0").unwrap();
    let mid = top["children"]["backing"].as_str().unwrap().to_string();
    assert!(held_for_writing(&dir.path("top.qcow2")), "the top is written");
    assert!(!held_for_writing(&dir.path("mid.qcow2")), "its backing file is read-only");
    qmp.ok("change-backing-file", json!({"device": "q0", "image-node-name": mid, "backing-file": "base2.qcow2"}));
    assert!(!held_for_writing(&dir.path("mid.qcow2")), "read-only again");
    let mut client = daemon.connect(vsd_bench::ClientOptions::default());
    let mut back = vec![0; 4096];
    client.take_queue(0).unwrap().read_at(0, &mut back).unwrap();
    assert_eq!(back, [0x77; 4096], "the chain reads from base.img still");
    drop(client);
    daemon.stop();
    assert_eq!(backing_of(&dir.path("mid.qcow2")), (json!("base2.qcow2"), json!("qcow2")));
}

/// Whether another process holds `image` with the write permission (its
/// byte of QEMU's image locks).
fn held_for_writing(image: &Path) -> bool {
    let file = std::fs::File::open(image).unwrap();
    vsd_sys::lock::byte_locked_elsewhere(std::os::fd::AsFd::as_fd(&file), 101).unwrap()
}

/// QEMU (the system emulator) with a virtio-blk disk on a `-blockdev`
/// qcow2 node, stopped before it starts the guest; its QMP socket.
fn qemu_with_disk(dir: &Scratch, image: &Path) -> (Child, std::path::PathBuf) {
    let socket = dir.path("qemu-qmp.sock");
    let child = Command::new("qemu-system-x86_64")
        .args(["-M", "q35", "-S", "-nodefaults", "-display", "none", "-accel", "tcg", "-qmp"])
        .arg(format!("unix:{},server=on,wait=off", socket.display()))
        .arg("-blockdev")
        .arg(format!("driver=file,node-name=f0,filename={}", image.display()))
        .args(["-blockdev", "driver=qcow2,node-name=q0,file=f0", "-device", "virtio-blk-pci,drive=q0,id=vd0"])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !socket.exists() {
        assert!(Instant::now() < deadline, "QEMU did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    (child, socket)
}

/// vsd lists each export as QEMU lists a guest's disk on the same node
/// (qemu-storage-daemon lists none: its exports are not devices).
#[test]
fn query_block_lists_each_export_as_qemu_lists_a_disk() {
    let dir = Scratch::new("query-block");
    chain(&dir);
    let top = dir.path("top.qcow2");
    let (mut qemu, socket) = qemu_with_disk(&dir, &top);
    let theirs = Qmp::connect(&socket).ok("query-block", json!({}));
    qemu.kill().unwrap();
    qemu.wait().unwrap();
    let disk = &theirs[0];

    // Each daemon its own sockets.
    let args = |tag: &str| {
        let socket = |name: &str| dir.path(&format!("{tag}-{name}")).display().to_string();
        let mut args: Vec<String> = vec![
            "--blockdev".into(),
            format!("driver=file,node-name=f0,filename={}", top.display()),
            "--blockdev".into(),
            "driver=qcow2,node-name=q0,file=f0".into(),
            "--nbd-server".into(),
            format!("addr.type=unix,addr.path={}", socket("nbd.sock")),
            "--export".into(),
            "type=nbd,id=e0,node-name=q0".into(),
            "--export".into(),
            format!("type=vhost-user-blk,id=v0,node-name=q0,addr.type=unix,addr.path={}", socket("v.sock")),
        ];
        args.extend(monitor(Path::new(&socket("qmp.sock"))));
        args
    };
    let qsd = Daemon::qsd(&dir, &args("qsd"));
    assert_eq!(Qmp::connect(&dir.path("qsd-qmp.sock")).ok("query-block", json!({})), json!([]), "QSD lists none");
    drop(qsd);
    let _vsd = Daemon::vsd(&dir, &args("vsd"));
    let mut qmp = Qmp::connect(&dir.path("vsd-qmp.sock"));
    qmp.ok("block-set-write-threshold", json!({"node-name": "q0", "write-threshold": MIB}));
    let ours = qmp.ok("query-block", json!({}));
    let node = qmp
        .ok("query-named-block-nodes", json!({}))
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node-name"] == "q0")
        .cloned();
    assert_eq!(ours.as_array().unwrap().len(), 2, "one per export: {ours}");
    for (entry, id) in ours.as_array().unwrap().iter().zip(["e0", "v0"]) {
        assert_eq!(entry["qdev"], id, "in id order");
        for key in ["device", "type", "removable", "locked", "io-status"] {
            assert_eq!(entry[key], disk[key], "{key}");
        }
        assert_eq!(Some(&entry["inserted"]), node.as_ref(), "the node as query-named-block-nodes shows it");
        for key in ["node-name", "drv", "ro", "encrypted", "detect_zeroes", "backing_file_depth", "cache", "active"] {
            assert_eq!(entry["inserted"][key], disk["inserted"][key], "inserted.{key}");
        }
        assert_eq!(entry["inserted"]["write_threshold"], json!(MIB));
    }
    let refused = qmp.answer("query-block", json!({"flat": true}));
    assert_eq!(refused["error"]["desc"], "Parameter 'flat' is unexpected");
}

/// A 16 MiB raw disk `disk` over `f0` holding 0x11, served writable over
/// vhost-user, a raw target `tgt` of its size, and null nodes n0, n1.
fn mirrored(dir: &Scratch) -> Vec<String> {
    let image = dir.path("disk.img");
    std::fs::write(&image, vec![0x11; 16 * MIB as usize]).unwrap();
    let target = dir.image("tgt.img", 16 * MIB);
    vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}", image.display()),
        "--blockdev".into(),
        "driver=raw,node-name=disk,file=f0".into(),
        "--blockdev".into(),
        format!("driver=file,node-name=tgt,filename={}", target.display()),
        "--blockdev".into(),
        "driver=null-co,node-name=n0,size=16777216".into(),
        "--blockdev".into(),
        "driver=null-co,node-name=n1,size=16777216".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=v0,node-name=disk,writable=on,addr.type=unix,addr.path={}",
            dir.path("vhost.sock").display()
        ),
    ]
}

#[test]
fn block_job_change_answers_as_qemu_storage_daemon() {
    let change = |args: Value| Step::Command("block-job-change", args);
    let mirror = json!({"job-id": "m", "device": "disk", "target": "tgt", "sync": "full", "speed": 1024});
    let backup = json!({"job-id": "b", "device": "n0", "target": "n1", "sync": "full", "speed": 1024});
    let script = [
        Step::Command("blockdev-mirror", mirror),
        Step::Command("blockdev-backup", backup),
        change(json!({"id": "nowhere", "type": "mirror", "copy-mode": "write-blocking"})),
        change(json!({"id": "m", "copy-mode": "write-blocking"})),
        change(json!({"id": "m", "type": "mirror"})),
        change(json!({"id": "m", "type": "mirror", "copy-mode": "sideways"})),
        change(json!({"id": "m", "type": "sideways"})),
        change(json!({"id": "m", "type": "mirror", "copy-mode": "background", "speed": 1})),
        change(json!({"id": "b", "type": "backup"})),
        change(json!({"id": "b", "type": "mirror", "copy-mode": "write-blocking"})),
        change(json!({"id": "m", "type": "mirror", "copy-mode": "background"})),
        // QEMU 10 reads another type's options as background.
        change(json!({"id": "m", "type": "stream"})),
        change(json!({"id": "m", "type": "mirror", "copy-mode": "write-blocking"})),
        change(json!({"id": "m", "type": "mirror", "copy-mode": "write-blocking"})),
        change(json!({"id": "m", "type": "mirror", "copy-mode": "background"})),
        change(json!({"id": "m", "type": "commit"})),
        Step::Command("block-job-cancel", json!({"device": "b", "force": true})),
        Step::Command("block-job-cancel", json!({"device": "m", "force": true})),
        Step::Await("BLOCK_JOB_CANCELLED", json!({"device": "m"})),
    ];
    assert_same_as_qsd("block-job-change", &mirrored, &script, |_| Vec::new());
}

/// A background mirror under a libblkio writer switched to write-blocking
/// while it copies: the export moves onto the filter, the mirror gets in
/// sync and says it is actively synced, the way back is refused, and
/// every write lands on both sides.
#[test]
fn a_running_mirror_switched_to_write_blocking_writes_both_sides() {
    let dir = Scratch::new("job-change");
    let mut args = mirrored(&dir);
    args.extend(monitor(&dir.path("qmp.sock")));
    let daemon = Daemon::vsd(&dir, &args);
    let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
    let writer = Writer::start(&daemon, 16 * MIB / BLOCK, Duration::from_micros(300));
    let mirror = json!({"job-id": "m", "device": "disk", "target": "tgt", "sync": "full", "speed": MIB});
    qmp.ok("blockdev-mirror", mirror);
    let served = |qmp: &mut Qmp| qmp.ok("query-block-exports", json!({}))[0]["node-name"].clone();
    assert_eq!(served(&mut qmp), json!("disk"));
    std::thread::sleep(Duration::from_millis(200));
    qmp.ok("block-job-change", json!({"id": "m", "type": "mirror", "copy-mode": "write-blocking"}));
    let deadline = Instant::now() + Duration::from_secs(10);
    while served(&mut qmp) != json!("#mirror_top-disk") {
        assert!(Instant::now() < deadline, "the export never moved onto the filter");
        std::thread::sleep(Duration::from_millis(20));
    }
    let synced = |qmp: &mut Qmp| qmp.ok("query-block-jobs", json!({}))[0]["actively-synced"].clone();
    assert_eq!(synced(&mut qmp), json!(false), "not in sync yet");
    qmp.ok("block-job-set-speed", json!({"device": "m", "speed": 0}));
    qmp.await_event("BLOCK_JOB_READY", json!({"device": "m"}));
    while synced(&mut qmp) != json!(true) {
        assert!(Instant::now() < deadline, "never actively synced");
        std::thread::sleep(Duration::from_millis(20));
    }
    let back = qmp.answer("block-job-change", json!({"id": "m", "type": "mirror", "copy-mode": "background"}));
    assert_eq!(
        back["error"],
        json!({"class": "GenericError", "desc": "Change to copy mode 'background' is not implemented"})
    );
    // Written through the filter while in sync.
    std::thread::sleep(Duration::from_millis(300));
    let last = writer.finish();
    assert!(last.len() > 100, "the client wrote throughout ({} blocks)", last.len());
    qmp.ok("block-job-cancel", json!({"device": "m"}));
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "m"}));
    assert!(done.get("error").is_none(), "{done}");
    assert_eq!(served(&mut qmp), json!("disk"), "back on the disk, no switch");
    daemon.stop();
    let (disk, tgt) = (dir.path("disk.img").display().to_string(), dir.path("tgt.img").display().to_string());
    qemu_img(&["compare", "-q", "-f", "raw", "-F", "raw", &disk, &tgt]);
    let expect = |at: u64| last.get(&(at / BLOCK)).copied().unwrap_or(0x11);
    assert_eq!(common::images::first_mismatch(&dir.path("tgt.img"), expect), None, "the copy holds every write");
}
