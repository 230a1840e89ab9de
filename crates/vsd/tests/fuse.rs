//! `--export type=fuse`: a node shown as a regular file, exercised with
//! host tools (qemu-img, dd, cmp, fio, fallocate, truncate, lseek) on a
//! raw and a qcow2 node, beside qemu-storage-daemon's FUSE export doing
//! the same; coherence with another writer of the node, QMP, bad input,
//! and a daemon killed on its mount.

mod common;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

use common::qmp::Qmp;
use common::{Daemon, Scratch, monitor, ok, outcome, pattern, run};
use serde_json::json;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 32 * MIB;

/// A file node over `image`, a `format` node `disk` over it, and a FUSE
/// export of `disk` on `mountpoint`, with `opts` appended.
fn fuse_args(image: &Path, format: &str, mountpoint: &Path, opts: &str) -> Vec<String> {
    vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}", image.display()),
        "--blockdev".into(),
        format!("driver={format},node-name=disk,file=f0"),
        "--export".into(),
        format!("type=fuse,id=fx,node-name=disk,mountpoint={}{opts}", mountpoint.display()),
    ]
}

/// vsd's arguments: FUSE exports mount, which the sandbox forbids.
fn unsandboxed(mut args: Vec<String>) -> Vec<String> {
    args.extend(["--sandbox".into(), "off".into()]);
    args
}

/// An image of `format` with data at 0 and at 4 MiB and holes between.
fn image(dir: &Scratch, name: &str, format: &str) -> std::path::PathBuf {
    let path = dir.path(name);
    ok("qemu-img", &["create", "-q", "-f", format, path.to_str().unwrap(), &SIZE.to_string()]);
    for (at, byte) in [(0, "0x11"), (4 * MIB, "0x22")] {
        ok("qemu-io", &["-f", format, "-c", &format!("write -P {byte} {at} 1M"), path.to_str().unwrap()]);
    }
    path
}

/// An empty regular file to mount over.
fn mountpoint(dir: &Scratch, name: &str) -> std::path::PathBuf {
    let path = dir.path(name);
    File::create(&path).unwrap();
    path
}

/// The data extents of `file` as SEEK_DATA and SEEK_HOLE find them.
fn seek_map(file: &File) -> Vec<(u64, u64)> {
    let seek = |at: u64, whence| {
        // SAFETY: lseek on a descriptor `file` keeps open.
        let ret = unsafe { libc::lseek(file.as_raw_fd(), at as libc::off_t, whence) };
        (ret >= 0).then_some(ret as u64)
    };
    let mut extents = Vec::new();
    let mut at = 0;
    while let Some(data) = seek(at, libc::SEEK_DATA) {
        let hole = seek(data, libc::SEEK_HOLE).expect("a hole after data (the end at least)");
        extents.push((data, hole));
        at = hole;
    }
    extents
}

fn errno_of<T>(result: std::io::Result<T>) -> Option<i32> {
    result.err().and_then(|e| e.raw_os_error())
}

/// Runs the host tools on the mounted file of a writable, not growable
/// export of `image` (of `format`) served by `daemon`; asserts what must
/// hold, and returns what was seen, for comparing daemons.
fn exercise(dir: &Scratch, mnt: &Path, image: &Path, format: &str, daemon: &str) -> Vec<String> {
    let mut seen = Vec::new();
    // QEMU 10's export fails fio's verification from depth 4 on (blocks
    // read back from other offsets), so it is asked for one at a time.
    let depth = if daemon == "vsd" { 16 } else { 1 };
    let meta = std::fs::metadata(mnt).unwrap();
    assert_eq!(meta.len(), SIZE);
    seen.push(format!("size {} mode {:o}", meta.len(), meta.mode()));
    let info = ok("qemu-img", &["info", "-U", "--output=json", "-f", "raw", mnt.to_str().unwrap()]);
    assert!(info.contains(&format!("\"virtual-size\": {SIZE}")), "{info}");
    let file = File::options().read(true).write(true).open(mnt).unwrap();
    // A raw file's holes are the image file's own; QEMU 10 shows a raw
    // node as data throughout, so only vsd's are checked, and only a qcow2
    // node's maps compared.
    let map = |when: &str, seen: &mut Vec<String>| {
        let found = seek_map(&file);
        match format {
            "raw" if daemon == "vsd" => assert_eq!(found, seek_map(&File::open(image).unwrap()), "map {when}"),
            "raw" => {}
            _ => seen.push(format!("map {when} {found:?}")),
        }
    };

    // The image's data, as the image has it.
    let mut buf = vec![0; MIB as usize];
    file.read_exact_at(&mut buf, 4 * MIB).unwrap();
    assert!(buf.iter().all(|&b| b == 0x22));
    map("before", &mut seen);

    // dd writes, read back through the file.
    let data = pattern(7, 256 << 10);
    let source = dir.path("pattern");
    std::fs::write(&source, &data).unwrap();
    let of = format!("of={}", mnt.display());
    ok("dd", &[&format!("if={}", source.display()), &of, "bs=64k", "seek=32", "conv=notrunc,fsync", "status=none"]);
    let mut back = vec![0; data.len()];
    file.read_exact_at(&mut back, 2 * MIB).unwrap();
    assert!(back == data, "dd's bytes read back");

    // Short at the end, as QEMU's export.
    let mut page = vec![0; 4096];
    seen.push(format!("read at end-100: {:?}", file.read_at(&mut page, SIZE - 100).ok()));
    seen.push(format!("read past end: {:?}", file.read_at(&mut page, SIZE + 4096).ok()));
    seen.push(format!("write at end-100: {:?}", file.write_at(&page, SIZE - 100).ok()));
    seen.push(format!("write at end: errno {:?}", errno_of(file.write_at(&page, SIZE))));
    assert_eq!(std::fs::metadata(mnt).unwrap().len(), SIZE, "not growable");

    // fallocate: punched and zeroed ranges read as zeroes.
    let path = mnt.to_str().unwrap();
    ok("fallocate", &["--punch-hole", "-o", &(4 * MIB).to_string(), "-l", "512KiB", path]);
    ok("fallocate", &["--zero-range", "--keep-size", "-o", &(2 * MIB).to_string(), "-l", "64KiB", path]);
    file.read_exact_at(&mut buf, 4 * MIB).unwrap();
    assert!(buf[..512 << 10].iter().all(|&b| b == 0) && buf[512 << 10..].iter().all(|&b| b == 0x22));
    file.read_exact_at(&mut back, 2 * MIB).unwrap();
    assert!(back[..64 << 10].iter().all(|&b| b == 0) && back[64 << 10..] == data[64 << 10..]);
    let (punched, text) = outcome("fallocate", &["-o", "0", "-l", "4096", path]);
    seen.push(format!("plain fallocate inside: {punched} {}", text.contains("Operation not supported")));
    map("after fallocate", &mut seen);

    // fio's own pattern, verified, through io_uring.
    let fio = ok(
        "fio",
        &[
            "--name=verify",
            &format!("--filename={path}"),
            "--ioengine=io_uring",
            "--direct=1",
            &format!("--iodepth={depth}"),
            "--rw=randwrite",
            "--bs=4k",
            "--offset=8M",
            "--size=4M",
            "--verify=crc32c",
            "--verify_fatal=1",
            // A failed verification writes its state file into the working directory otherwise.
            "--verify_state_save=0",
            "--output-format=terse",
        ],
    );
    assert!(!fio.is_empty());

    // truncate resizes the node; st_size follows at once.
    ok("truncate", &["-s", &(SIZE + MIB).to_string(), path]);
    assert_eq!(std::fs::metadata(mnt).unwrap().len(), SIZE + MIB);
    ok("truncate", &["-s", &SIZE.to_string(), path]);
    assert_eq!(file.metadata().unwrap().len(), SIZE);
    map("at the end", &mut seen);

    // chmod as QEMU allows it; times cannot be set.
    ok("chmod", &["640", path]);
    seen.push(format!("after chmod 640: {:o}", std::fs::metadata(mnt).unwrap().mode()));
    ok("chmod", &["600", path]);
    seen.push(format!("touch: {:?}", outcome("touch", &[path]).0));

    // What went through the file is in the image.
    ok("qemu-img", &["compare", "-U", "-f", format, "-F", "raw", image.to_str().unwrap(), path]);
    if format == "raw" {
        ok("cmp", &[image.to_str().unwrap(), path]);
    }
    seen
}

/// Both daemons on copies of one image: the same facts, and every tool
/// agreeing with the image.
fn same_as_qsd(format: &str) {
    let dir = Scratch::new(&format!("fuse-{format}"));
    let ours = image(&dir, "vsd.img", format);
    let theirs = dir.path("qsd.img");
    std::fs::copy(&ours, &theirs).unwrap();
    let (mnt, qsd_mnt) = (mountpoint(&dir, "vsd.mnt"), mountpoint(&dir, "qsd.mnt"));
    let vsd = Daemon::vsd(&dir, &unsandboxed(fuse_args(&ours, format, &mnt, ",writable=on")));
    let seen = exercise(&dir, &mnt, &ours, format, "vsd");
    drop(vsd);
    let qsd = Daemon::qsd(&dir, &fuse_args(&theirs, format, &qsd_mnt, ",writable=on"));
    let qsd_seen = exercise(&dir, &qsd_mnt, &theirs, format, "qsd");
    drop(qsd);
    assert_eq!(seen, qsd_seen, "vsd's FUSE file against QSD's");
    assert_eq!(std::fs::metadata(&mnt).unwrap().len(), 0, "unmounted when the daemon stops");
}

#[test]
fn a_raw_node_as_a_file_behaves_as_qsds() {
    same_as_qsd("raw");
}

#[test]
fn a_qcow2_node_as_a_file_behaves_as_qsds() {
    same_as_qsd("qcow2");
}

#[test]
fn a_growable_file_grows_with_writes_past_its_end_as_qsds() {
    let dir = Scratch::new("fuse-growable");
    let grown = |daemon: fn(&Scratch, &[String]) -> Daemon, name: &str| {
        let image = dir.image(&format!("{name}.img"), MIB);
        let mnt = mountpoint(&dir, &format!("{name}.mnt"));
        let _daemon = daemon(&dir, &unsandboxed_for(name, fuse_args(&image, "raw", &mnt, ",writable=on,growable=on")));
        let file = File::options().write(true).open(&mnt).unwrap();
        let written = file.write_at(&pattern(3, 8192), MIB + 4096).unwrap();
        (written, std::fs::metadata(&mnt).unwrap().len(), std::fs::metadata(&image).unwrap().len())
    };
    let ours = grown(Daemon::vsd, "vsd");
    assert_eq!(ours, (8192, MIB + 12288, MIB + 12288));
    assert_eq!(ours, grown(Daemon::qsd, "qsd"));
}

/// vsd's arguments unsandboxed, QSD's as they are.
fn unsandboxed_for(daemon: &str, args: Vec<String>) -> Vec<String> {
    if daemon == "vsd" { unsandboxed(args) } else { args }
}

#[test]
fn the_file_shows_what_another_export_writes_and_a_resize_at_once() {
    let dir = Scratch::new("fuse-coherent");
    let image = dir.image("disk.img", SIZE);
    let (mnt, qmp_sock, nbd_sock) = (mountpoint(&dir, "disk.mnt"), dir.path("qmp.sock"), dir.path("nbd.sock"));
    let mut args = vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}", image.display()),
        "--blockdev".into(),
        "driver=raw,node-name=disk,file=f0".into(),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", nbd_sock.display()),
        "--export".into(),
        "type=nbd,id=n0,node-name=disk,name=disk,writable=on".into(),
    ];
    args.extend(monitor(&qmp_sock));
    let _vsd = Daemon::vsd(&dir, &unsandboxed(args));
    let mut qmp = Qmp::connect(&qmp_sock);
    let export = json!({"type": "fuse", "id": "fx", "node-name": "disk", "mountpoint": mnt, "writable": true});
    qmp.ok("block-export-add", export);
    let listed = qmp.ok("query-block-exports", json!({}));
    assert!(listed.as_array().unwrap().iter().any(|e| e["type"] == "fuse" && e["id"] == "fx"), "{listed}");

    let url = format!("nbd+unix:///disk?socket={}", nbd_sock.display());
    let file = File::open(&mnt).unwrap();
    let mut page = vec![0; 4096];
    for byte in [0x5a, 0xa5] {
        ok("qemu-io", &["-f", "raw", "-c", &format!("write -P {byte} 1M 4k"), &url]);
        file.read_exact_at(&mut page, MIB).unwrap();
        assert!(page.iter().all(|&b| b == byte), "the file shows the NBD client's write of {byte:#x} at once");
    }
    qmp.ok("block_resize", json!({"node-name": "disk", "size": SIZE * 2}));
    assert_eq!(file.metadata().unwrap().len(), SIZE * 2, "st_size follows block_resize at once");

    let stats = qmp.ok("query-blockstats", json!({}));
    let fuse = stats.as_array().unwrap().iter().find(|s| s["qdev"] == "fx").expect("the export's statistics");
    assert!(fuse["stats"]["rd_operations"].as_u64().unwrap() >= 2, "{fuse}");

    drop(file);
    qmp.ok("block-export-del", json!({"id": "fx"}));
    qmp.await_event("BLOCK_EXPORT_DELETED", json!({"id": "fx"}));
    assert_eq!(std::fs::metadata(&mnt).unwrap().len(), 0, "unmounted");
}

#[test]
fn bad_mountpoints_are_refused_in_qsds_words() {
    let dir = Scratch::new("fuse-bad");
    let image = dir.image("disk.img", MIB);
    let missing = dir.path("missing");
    let refused = |mnt: &Path| {
        let ours = common::vsd_fails(&unsandboxed(fuse_args(&image, "raw", mnt, "")));
        let args = fuse_args(&image, "raw", mnt, "");
        let qsd = run("qemu-storage-daemon", &args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(!qsd.status.success());
        (ours, String::from_utf8_lossy(&qsd.stderr).into_owned())
    };
    for (mnt, words) in [
        (&missing, format!("Failed to stat '{}': No such file or directory", missing.display())),
        (&dir.0, format!("'{}' is not a regular file", dir.0.display())),
    ] {
        let (ours, qsd) = refused(mnt);
        assert!(ours.contains(&words), "{ours}");
        assert!(qsd.contains(&words), "{qsd}");
    }
    // The sandbox keeps its list of system calls: mounting is not on it.
    let mnt = mountpoint(&dir, "disk.mnt");
    let sandboxed = common::vsd_fails(&common::sandboxed(&fuse_args(&image, "raw", &mnt, "")));
    assert!(sandboxed.contains("Failed to mount FUSE session to export: Operation not permitted"), "{sandboxed}");
}

#[test]
fn a_mountpoint_in_use_or_unmounted_under_the_daemon_harms_nothing_else() {
    let dir = Scratch::new("fuse-unmounted");
    let image = dir.image("disk.img", SIZE);
    let (mnt, other, qmp_sock) = (mountpoint(&dir, "disk.mnt"), mountpoint(&dir, "other.mnt"), dir.path("qmp.sock"));
    let mut args = fuse_args(&image, "raw", &mnt, ",writable=on");
    args.extend(monitor(&qmp_sock));
    let _vsd = Daemon::vsd(&dir, &unsandboxed(args));
    let mut qmp = Qmp::connect(&qmp_sock);
    let again = json!({"type": "fuse", "id": "fy", "node-name": "disk", "mountpoint": mnt});
    let answer = qmp.answer("block-export-add", again);
    let words = format!("There already is a FUSE export on '{}'", mnt.display());
    assert_eq!(answer["error"]["desc"], words, "{answer}");
    qmp.ok("block-export-add", json!({"type": "fuse", "id": "fy", "node-name": "disk", "mountpoint": other}));

    ok("umount", &[mnt.to_str().unwrap()]);
    assert_eq!(std::fs::metadata(&mnt).unwrap().len(), 0, "the plain file again");
    let mut page = vec![0; 4096];
    File::open(&other).unwrap().read_exact_at(&mut page, 0).unwrap();
    qmp.ok("block-export-del", json!({"id": "fx"}));
    qmp.await_event("BLOCK_EXPORT_DELETED", json!({"id": "fx"}));
    qmp.ok("block-export-add", json!({"type": "fuse", "id": "fx", "node-name": "disk", "mountpoint": mnt}));
    assert_eq!(std::fs::metadata(&mnt).unwrap().len(), SIZE, "mounted again");
    assert_eq!(std::fs::metadata(&other).unwrap().len(), SIZE, "the other export served on");
}

#[test]
fn a_daemon_killed_on_its_mount_leaves_nothing_that_blocks_the_next() {
    let dir = Scratch::new("fuse-killed");
    let image = dir.image("disk.img", SIZE);
    let mnt = mountpoint(&dir, "disk.mnt");
    let args = unsandboxed(fuse_args(&image, "raw", &mnt, ",writable=on"));
    let vsd = Daemon::vsd(&dir, &args);
    File::options().write(true).open(&mnt).unwrap().write_all_at(&[0x77; 4096], 0).unwrap();
    vsd.kill();
    let stale = std::fs::metadata(&mnt).map(drop);
    assert_eq!(errno_of(stale), Some(libc::ENOTCONN), "the dead daemon's mount is left");
    let _vsd = Daemon::vsd(&dir, &args);
    let mut page = vec![0; 4096];
    File::open(&mnt).unwrap().read_exact_at(&mut page, 0).unwrap();
    assert!(page.iter().all(|&b| b == 0x77), "the next daemon serves the file");
}

#[test]
fn a_live_snapshot_under_io_moves_the_file_onto_the_overlay() {
    let dir = Scratch::new("fuse-snapshot");
    let base = image(&dir, "base.qcow2", "qcow2");
    let (overlay, mnt, qmp_sock) = (dir.path("overlay.qcow2"), mountpoint(&dir, "disk.mnt"), dir.path("qmp.sock"));
    let mut args = fuse_args(&base, "qcow2", &mnt, ",writable=on");
    args.extend(monitor(&qmp_sock));
    let _vsd = Daemon::vsd(&dir, &unsandboxed(args));
    let mut qmp = Qmp::connect(&qmp_sock);
    let path = mnt.to_str().unwrap();
    let fio = std::process::Command::new("fio")
        .args(["--name=busy", &format!("--filename={path}"), "--ioengine=io_uring", "--direct=1", "--iodepth=16"])
        .args(["--rw=randread", "--bs=4k", "--time_based", "--runtime=2", "--output-format=terse"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));

    let (b, o) = (base.to_str().unwrap(), overlay.to_str().unwrap());
    ok("qemu-img", &["create", "-q", "-f", "qcow2", "-b", b, "-F", "qcow2", o, &SIZE.to_string()]);
    let file = json!({"driver": "file", "filename": overlay});
    qmp.ok("blockdev-add", json!({"driver": "qcow2", "node-name": "s1", "file": file, "backing": null}));
    qmp.ok("blockdev-snapshot", json!({"node": "disk", "overlay": "s1"}));
    let listed = qmp.ok("query-block-exports", json!({}));
    assert_eq!(listed[0]["node-name"], "s1", "{listed}");
    let fio = fio.wait_with_output().unwrap();
    assert!(fio.status.success(), "fio read on through the snapshot: {}", String::from_utf8_lossy(&fio.stderr));

    let file = File::options().read(true).write(true).open(&mnt).unwrap();
    file.write_all_at(&[0x99; 4096], 8 * MIB).unwrap();
    let mut page = vec![0; 4096];
    file.read_exact_at(&mut page, 4 * MIB).unwrap();
    assert!(page.iter().all(|&b| b == 0x22), "the base's data, read through the overlay");
    ok("qemu-io", &["-r", "-U", "-f", "qcow2", "-c", "read -P 0x99 8M 4k", o]);
    ok("qemu-io", &["-r", "-U", "-f", "qcow2", "-c", "read -P 0 8M 4k", b]);
}
