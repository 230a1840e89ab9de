//! `blockdev-backup` with `compress: true` into qcow2 targets (zlib and
//! zstd, clusters smaller and larger than the source's), the same script
//! against vsd and qemu-storage-daemon: the same answers and events, raw
//! targets refused in QEMU's words, and targets QEMU finds clean, equal to
//! the source, compressed, and smaller than the data; and a daemon killed
//! during a compressed backup leaving its target consistent.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::images::assert_consistent;
use common::qmp::Qmp;
use common::script::Step::{self, Await, Command};
use common::script::stable;
use common::{Daemon, Scratch, monitor, ok, pattern, qcow2_node, run};
use serde_json::{Value, json};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// Not a whole number of clusters: the last one is partial.
const SIZE: u64 = 8 * MIB + 40 * KIB;

/// Text-like bytes: compress well, but not to nothing.
fn text(seed: u64, len: usize) -> Vec<u8> {
    let words = [&b"qcow2 "[..], b"cluster ", b"backup ", b"compressed ", b"daemon ", b"zlib ", b"zstd\n"];
    let noise = pattern(seed, len);
    let mut out = Vec::with_capacity(len + 16);
    for &n in &noise {
        out.extend_from_slice(words[n as usize % words.len()]);
        if out.len() >= len {
            break;
        }
    }
    out.truncate(len);
    out
}

/// The bytes of [`source`] that are data: neither holes nor zero clusters.
const DATA: u64 = 3 * MIB + 16 * 8 * KIB + (SIZE - 6 * MIB) - 128 * KIB;

/// A qcow2 source of [`SIZE`] bytes at `path` holding compressible and
/// incompressible clusters, clusters of data then zeroes, holes, and
/// zero clusters.
fn source(dir: &Scratch, path: &Path) {
    let mut raw = vec![0u8; SIZE as usize];
    let mut put = |at: u64, bytes: &[u8]| raw[at as usize..at as usize + bytes.len()].copy_from_slice(bytes);
    put(0, &text(1, 2 * MIB as usize));
    put(2 * MIB, &pattern(2, MIB as usize));
    // 3-4 MiB: a hole.
    for cluster in 0..16 {
        put(4 * MIB + cluster * 64 * KIB, &pattern(10 + cluster, 8 * KIB as usize));
    }
    // 5-6 MiB: a hole; the rest text, up to the partial last cluster.
    put(6 * MIB, &text(3, (SIZE - 6 * MIB) as usize));
    let flat = dir.path("source.raw");
    std::fs::write(&flat, &raw).unwrap();
    let (flat, image) = (flat.to_str().unwrap(), path.to_str().unwrap());
    ok("qemu-img", &["convert", "-q", "-f", "raw", "-O", "qcow2", flat, image]);
    // Zero clusters over data, as a guest's write-zeroes leaves them.
    ok("qemu-io", &["-c", "write -q -z 1M 128k", image]);
    std::fs::remove_file(flat).unwrap();
}

/// The targets: node name and `qemu-img create -o` options.
const TARGETS: [(&str, &str); 4] = [
    ("zlib", "cluster_size=64k"),
    ("zstd", "compression_type=zstd"),
    ("small", "cluster_size=32k"),
    ("large", "cluster_size=128k"),
];

fn setup(dir: &Scratch) -> Vec<String> {
    let src = dir.path("src.qcow2");
    source(dir, &src);
    let mut args = qcow2_node("src", &src);
    for (name, options) in TARGETS {
        let image = dir.path(&format!("{name}.qcow2"));
        ok("qemu-img", &["create", "-q", "-f", "qcow2", "-o", options, image.to_str().unwrap(), &SIZE.to_string()]);
        args.extend(qcow2_node(name, &image));
    }
    let raw = dir.image("raw.img", SIZE);
    args.extend(["--blockdev".into(), format!("driver=file,node-name=raw-file,filename={}", raw.display())]);
    args.extend(["--blockdev".into(), "driver=raw,node-name=raw,file=raw-file".into()]);
    args
}

fn script() -> Vec<Step> {
    let backup =
        |target: &str| json!({"job-id": target, "device": "src", "target": target, "sync": "full", "compress": true});
    let mut steps = vec![Command("blockdev-backup", backup("raw")), Command("blockdev-backup", backup("raw-file"))];
    for (target, _) in TARGETS {
        steps.push(Command("blockdev-backup", backup(target)));
        steps.push(Await("JOB_STATUS_CHANGE", json!({"status": "null", "id": target})));
    }
    steps.push(Command("query-jobs", json!({})));
    steps
}

/// The bytes `qemu-img map --output=json` says are compressed.
fn compressed_bytes(image: &Path) -> u64 {
    let map: Value = serde_json::from_str(&ok("qemu-img", &["map", "--output=json", image.to_str().unwrap()])).unwrap();
    let extents = map.as_array().unwrap().iter();
    extents.filter(|e| e["compressed"] == json!(true)).map(|e| e["length"].as_u64().unwrap()).sum()
}

/// What a finished compressed backup left: per target, the file's size.
fn check_targets(dir: &Scratch) -> Vec<(&'static str, u64)> {
    let src = dir.path("src.qcow2");
    let mut sizes = Vec::new();
    for (name, _) in TARGETS {
        let image = dir.path(&format!("{name}.qcow2"));
        let (src_path, image_path) = (src.to_str().unwrap(), image.to_str().unwrap());
        let check = run("qemu-img", &["check", image_path]);
        let report = String::from_utf8_lossy(&check.stdout);
        assert!(check.status.success() && report.contains("No errors were found"), "{name}: {report}");
        ok("qemu-img", &["compare", src_path, image_path]);
        let compressed = compressed_bytes(&image);
        // The text and the data-then-zeroes clusters; never the noise.
        assert!(compressed >= 4 * MIB, "{name}: {compressed} bytes compressed");
        let size = std::fs::metadata(&image).unwrap().len();
        assert!(size < DATA / 2, "{name}: {size} bytes for {DATA} of data");
        sizes.push((name, size));
    }
    sizes
}

/// A backup with `compress: true` answers and notifies as QEMU's does, a
/// raw target (format or protocol node) is refused in its words, and each
/// qcow2 target is clean, equal to the source and compressed; vsd's
/// targets are no larger than qemu-storage-daemon's by more than a tenth.
#[test]
fn compressed_backups_answer_as_qemu_and_make_the_same_images() {
    // vsd's first, then qemu-storage-daemon's.
    let sizes: Mutex<Vec<Vec<(&str, u64)>>> = Mutex::new(Vec::new());
    let after = |dir: &Scratch| sizes.lock().unwrap().push(check_targets(dir));
    common::script::assert_same_as_qsd_then("backup-compress", &setup, &script(), stable, &after);
    let sizes = sizes.into_inner().unwrap();
    let (ours, theirs) = (&sizes[0], &sizes[1]);
    eprintln!("target sizes, vsd vs qemu-storage-daemon: {ours:?} {theirs:?}");
    for ((name, ours), (_, theirs)) in ours.iter().zip(theirs) {
        assert!(*ours <= theirs + theirs / 10, "{name}: vsd {ours} bytes, QEMU {theirs}");
    }
}

/// A second compressed backup into a full target fails with EIO, as in
/// QEMU (compression can't overwrite anything; how far QEMU's parallel
/// copy gets first varies, so this is not compared). A daemon killed
/// while a compressed backup runs leaves the target consistent (leaks
/// allowed, as QEMU's), every cluster it maps readable.
#[test]
fn a_full_target_fails_and_a_kill_leaves_the_target_consistent() {
    let dir = Scratch::new("backup-compress-kill");
    let mut args = setup(&dir);
    let socket = dir.path("qmp.sock");
    args.extend(monitor(&socket));
    let daemon = Daemon::vsd(&dir, &args);
    let mut qmp = Qmp::connect(&socket);
    for expect in [None, Some("Input/output error")] {
        let backup = json!({"job-id": "z", "device": "src", "target": "zstd", "sync": "full", "compress": true});
        qmp.ok("blockdev-backup", backup);
        let done = qmp.await_event("BLOCK_JOB_COMPLETED", json!({"device": "z"}));
        assert_eq!(done["error"].as_str(), expect, "{done}");
    }
    let backup =
        json!({"job-id": "b", "device": "src", "target": "zlib", "sync": "full", "compress": true, "speed": 4 * MIB});
    qmp.ok("blockdev-backup", backup);
    // Killed once some clusters are written (a debug build compresses slowly).
    let deadline = Instant::now() + Duration::from_secs(60);
    let progress = loop {
        let progress = qmp.ok("query-jobs", json!({}))[0]["current-progress"].as_u64().unwrap();
        if progress > 0 || Instant::now() > deadline {
            break progress;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(progress > 0 && progress < SIZE, "mid-way: {progress}");
    daemon.kill();
    let target: PathBuf = dir.path("zlib.qcow2");
    assert_consistent(&target);
    let flat = dir.path("zlib.raw");
    ok("qemu-img", &["convert", "-O", "raw", target.to_str().unwrap(), flat.to_str().unwrap()]);
}
