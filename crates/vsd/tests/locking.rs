//! Image locking as QEMU does it: vsd, qemu-storage-daemon, qemu-img and
//! qemu-io see each other's locks on an image, both ways, with QEMU's
//! wording; `locking=off` opts out; read-only users share; an inactive
//! node (a live migration's other end) holds no lock.

mod common;

use std::path::Path;

use common::{Daemon, Scratch, VSD, run};
use serde_json::json;
use vsd_control::client::QmpClient;

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
