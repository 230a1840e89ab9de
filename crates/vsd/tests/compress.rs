//! `driver=compress`: every write through the filter is stored compressed,
//! in whole clusters, as QEMU's filter stores them. vsd and
//! qemu-storage-daemon serve the same writes over NBD and must leave the
//! same image, by `qemu-img map` and `qemu-img check`.

mod common;

use common::{Daemon, Scratch, ok, outcome};
use serde_json::Value;

type Start = fn(&Scratch, &[String]) -> Daemon;

/// `--blockdev`s of a qcow2 image at `image` with a compress node `c` over it.
fn compressed_disk(image: &str) -> Vec<String> {
    [
        "--blockdev",
        &format!("driver=file,node-name=f,filename={image}"),
        "--blockdev",
        "driver=qcow2,node-name=q,file=f",
        "--blockdev",
        "driver=compress,node-name=c,file=q",
    ]
    .map(String::from)
    .into()
}

/// Daemon `start` serving a compress node over a new 4 MiB qcow2 image
/// `name` as writable NBD export `c`: the daemon, the image, the socket.
fn serve_compressed(dir: &Scratch, start: Start, name: &str) -> (Daemon, String, std::path::PathBuf) {
    let image = dir.path(name).display().to_string();
    ok("qemu-img", &["create", "-q", "-f", "qcow2", &image, "4M"]);
    let socket = dir.path(&format!("{name}.sock"));
    let mut args = compressed_disk(&image);
    args.extend([
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", socket.display()),
        "--export".into(),
        "type=nbd,id=e0,node-name=c,writable=on".into(),
    ]);
    (start(dir, &args), image, socket)
}

/// Writes through daemon `start`'s export of a compress node over a new
/// 4 MiB qcow2 image; `qemu-img map` of the image afterwards.
fn written_through(dir: &Scratch, start: Start, name: &str) -> Value {
    let (daemon, image, socket) = serve_compressed(dir, start, name);
    let uri = format!("nbd+unix:///c?socket={}", socket.display());
    let info = ok("nbdinfo", &[&uri]);
    assert!(info.contains("block_size_minimum: 65536"), "{name}: whole clusters are asked for: {info}");
    let writes = [
        "write -P 0x11 0 64k",
        // Less than a cluster, and across two: the client pads them.
        "write -P 0x12 128k 4k",
        "write -P 0x13 200k 64k",
        "write -f -P 0x14 1M 128k",
        "write -z 2M 64k",
        "write -P 0x15 4032k 64k",
    ];
    let mut qemu_io = vec!["-f", "raw"];
    writes.iter().for_each(|write| qemu_io.extend(["-c", write]));
    qemu_io.push(&uri);
    ok("qemu-io", &qemu_io);
    let (overwritten, out) = outcome("qemu-io", &["-f", "raw", "-c", "write -P 0x16 0 64k", &uri]);
    assert!(!overwritten && out.contains("Input/output error"), "{name}: compression overwrites nothing: {out}");
    drop(daemon);

    let check = ok("qemu-img", &["check", &image]);
    assert!(check.contains("No errors were found") && check.contains("100.00% compressed clusters"), "{check}");
    let reads = ["read -P 0x11 0 64k", "read -P 0x12 128k 4k", "read -P 0 132k 68k", "read -P 0x13 200k 64k"];
    let mut qemu_io = vec!["-r", "-f", "qcow2"];
    reads.iter().for_each(|read| qemu_io.extend(["-c", read]));
    qemu_io.push(&image);
    let read = ok("qemu-io", &qemu_io);
    assert!(!read.contains("Pattern verification failed"), "{name}: {read}");
    serde_json::from_str(&ok("qemu-img", &["map", "--output=json", &image])).unwrap()
}

#[test]
fn writes_are_stored_compressed_as_qemu_stores_them() {
    let dir = Scratch::new("compress");
    let vsd = written_through(&dir, Daemon::vsd, "vsd.qcow2");
    let qsd = written_through(&dir, Daemon::qsd, "qsd.qcow2");
    let compressed = vsd.as_array().unwrap().iter().filter(|e| e["compressed"] == true).count();
    assert_eq!(compressed, 4, "{vsd}");
    let extents = |map: &Value| {
        map.as_array()
            .unwrap()
            .iter()
            .map(|e| (e["start"].clone(), e["length"].clone(), e["zero"].clone(), e["compressed"].clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(extents(&vsd), extents(&qsd), "vsd's image is mapped as qemu-storage-daemon's");
}

/// A bare NBD client (fixed newstyle, `NBD_OPT_EXPORT_NAME`, simple
/// replies) that sends one write of `argv[3]` bytes at `argv[2]` to export
/// `c` on socket `argv[1]`, whatever block sizes the server asks for, and
/// prints the error the server answers.
const RAW_WRITE: &str = r#"
import socket, struct, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
def take(n):
    b = b""
    while len(b) < n:
        b += s.recv(n - len(b))
    return b
assert take(16) == b"NBDMAGICIHAVEOPT"; take(2)
s.sendall(struct.pack(">I", 3) + b"IHAVEOPT" + struct.pack(">II", 1, 1) + b"c")
take(10)
offset, length = int(sys.argv[2]), int(sys.argv[3])
s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 1, 7, offset, length) + b"Z" * length)
magic, error, handle = struct.unpack(">IIQ", take(16))
print(error)
"#;

/// The NBD error a write of `len` bytes at `offset` sent as it is gets.
fn raw_write(socket: &std::path::Path, offset: u64, len: u64) -> u32 {
    let socket = socket.display().to_string();
    let out = ok("python3", &["-c", RAW_WRITE, &socket, &offset.to_string(), &len.to_string()]);
    out.trim().parse().unwrap()
}

#[test]
fn a_write_not_in_whole_clusters_that_reaches_the_node_fails() {
    let dir = Scratch::new("compress-misaligned");
    for (daemon, start) in [("vsd", Daemon::vsd as Start), ("qemu-storage-daemon", Daemon::qsd)] {
        let (running, image, socket) = serve_compressed(&dir, start, &format!("{daemon}.qcow2"));
        let errors = [raw_write(&socket, 4096, 4096), raw_write(&socket, 1 << 20, 64 << 10)];
        drop(running);
        // QEMU pads the write to the cluster, reading the rest; vsd
        // answers what a qcow2 image does to a compressed write that is
        // not whole clusters (EINVAL), and the aligned one succeeds.
        let misaligned = if daemon == "vsd" { libc::EINVAL as u32 } else { 0 };
        assert_eq!(errors, [misaligned, 0], "{daemon}");
        let check = ok("qemu-img", &["check", &image]);
        assert!(check.contains("No errors were found") && check.contains("100.00% compressed clusters"), "{check}");
    }
}

#[test]
fn a_child_that_cannot_store_compressed_data_is_refused() {
    let help = ok(common::VSD, &["--blockdev", "help"]);
    assert!(help.lines().any(|l| l.trim() == "compress"), "--blockdev help lists it");
    let dir = Scratch::new("compress-refused");
    let raw = dir.image("disk.raw", 1 << 20).display().to_string();
    let args = [
        "--blockdev",
        &format!("driver=file,node-name=f,filename={raw}"),
        "--blockdev",
        "driver=compress,node-name=c,file=f",
    ];
    for program in [common::VSD, "qemu-storage-daemon"] {
        let (started, out) = outcome(program, &args);
        assert!(!started, "{program}: {out}");
        assert!(out.contains("Compression is not supported for underlying format: file"), "{program}: {out}");
    }
    let (started, out) = outcome(common::VSD, &["--blockdev", "driver=compress,node-name=c"]);
    assert!(!started && out.to_lowercase().contains("parameter 'file' is missing"), "{out}");
}
