//! `driver=preallocate`: a qcow2 image on the filter grows its file in
//! steps of allocated room ahead of its writes, and is cut back to where
//! its data ends when the daemon stops, leaving an image `qemu-img check`
//! finds clean. vsd and qemu-storage-daemon alike.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use common::{Daemon, Scratch, ok, outcome};

type Start = fn(&Scratch, &[String]) -> Daemon;

const MIB: u64 = 1 << 20;

/// The bytes the host allocated for `path`.
fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

/// Serves a new 64 MiB qcow2 image on a preallocate node (4 MiB ahead, in
/// whole MiB) over NBD through `start`, writes it in three steps, and
/// checks what the host allocated after each and after the daemon stops.
fn grows_in_steps(dir: &Scratch, start: Start, name: &str) {
    let image = dir.path(name);
    let path = image.display().to_string();
    ok("qemu-img", &["create", "-q", "-f", "qcow2", &path, "64M"]);
    let socket = dir.path(&format!("{name}.sock"));
    let args: Vec<String> = [
        "--blockdev",
        &format!("driver=file,node-name=f,filename={path}"),
        "--blockdev",
        "driver=preallocate,node-name=p,file=f,prealloc-size=4194304,prealloc-align=1048576",
        "--blockdev",
        "driver=qcow2,node-name=q,file=p",
        "--nbd-server",
        &format!("addr.type=unix,addr.path={}", socket.display()),
        "--export",
        "type=nbd,id=e0,node-name=q,writable=on",
    ]
    .map(String::from)
    .into();
    let daemon = start(dir, &args);
    let uri = format!("nbd+unix:///q?socket={}", socket.display());
    let write = |command: &str| {
        ok("qemu-io", &["-f", "raw", "-c", command, "-c", "flush", &uri]);
        allocated(&image)
    };
    let first = write("write -P 0x11 0 1M");
    assert!(first >= 5 * MIB, "{name}: 4 MiB allocated past the first MiB of data: {first}");
    let second = write("write -P 0x22 8M 2M");
    assert_eq!(second, first, "{name}: the clusters of 2 MiB more fit in the room allocated");
    let third = write("write -P 0x33 20M 2M");
    assert!(third >= first + 4 * MIB, "{name}: past the room, another step: {first} then {third}");
    drop(daemon);

    let check = ok("qemu-img", &["check", &path]);
    assert!(check.contains("No errors were found"), "{name}: {check}");
    let end: u64 = check.lines().find_map(|l| l.strip_prefix("Image end offset: ")).unwrap().trim().parse().unwrap();
    assert_eq!(std::fs::metadata(&image).unwrap().len(), end, "{name}: the file ends where its data does");
    assert!(allocated(&image) < third, "{name}: the room left over is given back");
    let read = ok("qemu-io", &["-r", "-f", "qcow2", "-c", "read -P 0x11 0 1M", "-c", "read -P 0x33 20M 2M", &path]);
    assert!(!read.contains("verification failed"), "{name}: {read}");
}

#[test]
fn the_file_grows_in_steps_and_ends_where_its_data_does() {
    let dir = Scratch::new("preallocate");
    grows_in_steps(&dir, Daemon::vsd, "vsd.qcow2");
    grows_in_steps(&dir, Daemon::qsd, "qsd.qcow2");
}

#[test]
fn bad_options_are_refused_as_qemu_refuses_them() {
    let help = ok(common::VSD, &["--blockdev", "help"]);
    assert!(help.lines().any(|l| l.trim() == "preallocate"), "--blockdev help lists it");
    let dir = Scratch::new("preallocate-refused");
    let file = format!("file.driver=file,file.filename={}", dir.image("disk", MIB).display());
    let cases = [
        (
            format!("driver=preallocate,node-name=p,{file},prealloc-align=3"),
            "prealloc-align parameter of preallocate filter is not aligned to 512",
        ),
        (format!("driver=preallocate,node-name=p,{file},prealloc-size=1M"), "parameter 'prealloc-size' expects"),
        ("driver=preallocate,node-name=p".into(), "parameter 'file' is missing"),
    ];
    for (blockdev, words) in cases {
        for program in [common::VSD, "qemu-storage-daemon"] {
            let (started, out) = outcome(program, &["--blockdev", &blockdev]);
            assert!(!started && out.to_lowercase().contains(&words.to_lowercase()), "{program} {blockdev}: {out}");
        }
    }
}
