//! The guest's `bench` job (one timed fio run, scripts/guest/init) on each
//! disk the benchmark lab compares: an image file served by QEMU's own block
//! layer on virtio-blk, virtio-scsi and IDE (an ATA disk on the q35 AHCI
//! controller), and vhost-user-blk to a running vsd. Each boot checks that
//! the disk reached the guest through the intended drivers and that fio's
//! figures came back whole and plausible.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use common::{Daemon, Scratch, file_export};

const MIB: u64 = 1 << 20;

/// A short bench run: 2 s of fio on the first 16 MiB, two queues (and two
/// vCPUs, so that both carry I/O).
const BENCH: [&str; 8] = ["--job", "bench", "--runtime", "2", "--size", "16M", "--queues", "2"];

/// Runs the bench job with `args` added to [`BENCH`].
fn bench(dir: &Scratch, args: &[&str]) -> HashMap<String, String> {
    common::run_guest(&dir.path("console.log"), BENCH.iter().chain(args))
}

/// A 64 MiB image made by `qemu-img create`, as a user would make one.
fn qemu_image(dir: &Scratch, name: &str, format: &str) -> PathBuf {
    let path = dir.path(name);
    let out = common::run("qemu-img", &["create", "-f", format, path.to_str().unwrap(), "64M"]);
    assert!(out.status.success(), "{out:?}");
    path
}

fn number(facts: &HashMap<String, String>, key: &str) -> f64 {
    let value = facts.get(key).unwrap_or_else(|| panic!("no {key} in {facts:?}"));
    value.parse().unwrap_or_else(|e| panic!("{key}={value}: {e}"))
}

/// The guest found the disk as `disk` behind `drivers` (innermost first),
/// fio ran cleanly, and its figures hang together.
fn assert_bench(facts: &HashMap<String, String>, disk: &str, drivers: &str) {
    assert_eq!(facts["disk"], disk);
    assert_eq!(facts["disk_drivers"], drivers, "the disk's driver stack");
    assert_eq!(facts["bench_status"], "0");
    assert_eq!(facts["bench_error"], "0");
    let iops = number(facts, "bench_iops");
    let mean = number(facts, "bench_lat_mean_us");
    let (p50, p99, max) =
        (number(facts, "bench_lat_p50_us"), number(facts, "bench_lat_p99_us"), number(facts, "bench_lat_max_us"));
    assert!(iops > 0.0 && number(facts, "bench_bw_kib") > 0.0, "no I/O done: {facts:?}");
    assert!(mean > 0.0 && mean <= max, "mean latency {mean} us, max {max} us");
    assert!(p50 > 0.0 && p50 <= p99 && p99 <= max, "percentiles out of order: {p50} {p99} {max}");
    // fio ran for about --runtime; it must not have stopped early.
    assert!(number(facts, "bench_runtime_ms") >= 1900.0, "{facts:?}");
}

#[test]
fn bench_on_virtio_blk() {
    let dir = Scratch::new("bus-virtio-blk");
    let image = qemu_image(&dir, "disk.raw", "raw");
    let facts = bench(&dir, &["--bus", "virtio-blk", "--image", image.to_str().unwrap(), "--cache", "writeback"]);
    assert_bench(&facts, "vda", "virtio_blk,virtio-pci");
    assert_eq!(facts["queues"], "2", "num-queues reached virtio_blk");
    assert_eq!(facts["wce"], "1", "cache=writeback shows a write cache");
    assert_eq!(facts["capacity_bytes"], (64 * MIB).to_string());
}

#[test]
fn bench_on_virtio_scsi() {
    let dir = Scratch::new("bus-virtio-scsi");
    let image = qemu_image(&dir, "disk.raw", "raw");
    let facts = bench(
        &dir,
        &["--bus", "virtio-scsi", "--image", image.to_str().unwrap(), "--cache", "writeback", "--rw", "randwrite"],
    );
    assert_bench(&facts, "sda", "sd,virtio_scsi,virtio-pci");
    assert_eq!(facts["queues"], "2", "num_queues reached virtio_scsi");
    assert_eq!(facts["wce"], "1");
    assert_eq!(facts["capacity_bytes"], (64 * MIB).to_string());
}

#[test]
fn bench_on_ide() {
    let dir = Scratch::new("bus-ide");
    let image = qemu_image(&dir, "disk.raw", "raw");
    let facts = bench(&dir, &["--bus", "ide", "--image", image.to_str().unwrap(), "--cache", "writeback"]);
    assert_bench(&facts, "sda", "sd,ahci");
    assert_eq!(facts["queues"], "1", "AHCI has a single queue");
    assert_eq!(facts["wce"], "1");
    assert_eq!(facts["capacity_bytes"], (64 * MIB).to_string());
}

/// Mixed reads and writes on qcow2: writes allocate clusters, and the image
/// is consistent afterwards.
#[test]
fn bench_on_virtio_scsi_qcow2() {
    let dir = Scratch::new("bus-virtio-scsi-qcow2");
    let image = qemu_image(&dir, "disk.qcow2", "qcow2");
    let path = image.to_str().unwrap();
    let facts = bench(
        &dir,
        &["--bus", "virtio-scsi", "--image", path, "--format", "qcow2", "--cache", "writeback", "--rw", "randrw"],
    );
    assert_bench(&facts, "sda", "sd,virtio_scsi,virtio-pci");
    assert_eq!(facts["capacity_bytes"], (64 * MIB).to_string(), "the virtual size, not the file's");
    let check = common::run("qemu-img", &["check", "--output=json", path]);
    let report = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "{report}");
    assert!(common::json_count(&report, "allocated-clusters") > 0, "the guest's writes allocated clusters: {report}");
}

#[test]
fn bench_on_vhost_user_blk_to_vsd() {
    let dir = Scratch::new("bus-vhost-user-blk");
    let image = dir.image("disk.img", 64 * MIB);
    let socket = dir.path("vsd.sock");
    let args = file_export(&image, &socket, "", ",writable=on,num-queues=2,serial=vsd-bench-0001");
    let mut daemon = Daemon::vsd(&dir, &args);
    let facts = bench(&dir, &["--socket", socket.to_str().unwrap(), "--rw", "randwrite"]);
    assert_bench(&facts, "vda", "virtio_blk,virtio-pci");
    assert_eq!(facts["serial"], "vsd-bench-0001", "the disk is vsd's export");
    assert_eq!(facts["queues"], "2");
    assert!(daemon.is_running(), "vsd survived the guest's shutdown");
    let written = std::fs::read(&image).unwrap();
    assert!(written[..16 * MIB as usize].iter().any(|&b| b != 0), "fio's writes reached the image");
}
