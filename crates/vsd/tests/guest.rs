//! A real Linux guest (QEMU under TCG, the Debian kernel's virtio_blk
//! driver) whose disk is served by vsd: fio writes with crc32c verification
//! and reads everything back.

mod common;

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::Path;

use common::{Daemon, Scratch, file_export};

const MIB: u64 = 1 << 20;

/// Boots the guest on `socket`; returns its `VSD-GUEST key=value` facts.
fn boot(dir: &Scratch, socket: &Path, extra: &[&str]) -> HashMap<String, String> {
    let socket_args = [OsStr::new("--socket"), socket.as_os_str()];
    common::run_guest(&dir.path("console.log"), socket_args.into_iter().chain(extra.iter().map(OsStr::new)))
}

#[test]
fn linux_guest_runs_fio_verify_on_two_queues() {
    let dir = Scratch::new("guest");
    let image = dir.image("disk.img", 256 * MIB);
    let socket = dir.path("vsd.sock");
    let args = file_export(&image, &socket, "", ",writable=on,num-queues=2,serial=vsd-guest-0001");
    let mut daemon = Daemon::vsd(&dir, &args);
    let facts = boot(&dir, &socket, &["--queues", "2", "--size", "64M", "--bs", "4k"]);
    assert_eq!(facts["capacity_bytes"], (256 * MIB).to_string());
    assert_eq!(facts["serial"], "vsd-guest-0001", "GET_ID answered with the export's serial");
    assert_eq!(facts["queues"], "2", "the guest uses both virtqueues");
    assert_eq!(facts["wce"], "1", "writeback cache visible to the guest");
    assert_eq!(facts["ro"], "0");
    assert_eq!(facts["fio_write_status"], "0");
    assert_eq!(facts["fio_verify_status"], "0");
    assert_eq!(facts["fio_verify_read_bytes"], facts["fio_expected_bytes"]);
    assert_ne!(facts["discard_max_bytes"], "0", "discard offered");
    if !facts["vq_interrupts"].is_empty() {
        let per_queue: Vec<u64> = facts["vq_interrupts"].split(',').map(|n| n.parse().unwrap()).collect();
        assert_eq!(per_queue.len(), 2);
        assert!(per_queue.iter().all(|&n| n > 0), "both queues carried I/O: {per_queue:?}");
    }
    assert!(daemon.is_running(), "vsd survived the guest's shutdown");
    // The data fio wrote is in the image: not all zeroes any more.
    let written = std::fs::read(&image).unwrap();
    assert!(written[..64 * MIB as usize].iter().any(|&b| b != 0));
}

#[test]
fn guest_sees_writethrough_and_read_only() {
    let dir = Scratch::new("guest-ro");
    let image = dir.image("disk.img", 32 * MIB);
    let socket = dir.path("vsd.sock");
    let args = file_export(&image, &socket, "", ",writable=off,writethrough=on,logical-block-size=4096");
    let _daemon = Daemon::vsd(&dir, &args);
    let facts = boot(&dir, &socket, &["--queues", "1", "--job", "info"]);
    assert_eq!(facts["ro"], "1");
    assert_eq!(facts["wce"], "0");
    assert_eq!(facts["write_cache"], "write through");
    assert_eq!(facts["logical_block_size"], "4096");
    assert_eq!(facts["capacity_bytes"], (32 * MIB).to_string());
}

/// The guest's fio verify on a qcow2 image over a raw backing file: every
/// write allocates clusters and copies the backing data around it, on two
/// queues at once; then the guest discards half of it, which must read as
/// zeroes (not as the backing file). QEMU's tools then find the image clean
/// and equal to what the guest saw.
#[test]
fn linux_guest_runs_fio_verify_on_qcow2_over_a_backing_file() {
    let dir = Scratch::new("guest-qcow2");
    let base = dir.image("base.raw", 128 * MIB);
    std::fs::write(&base, common::pattern(7, 128 * MIB as usize)).unwrap();
    let image = dir.path("top.qcow2");
    let out = common::run(
        "qemu-img",
        &["create", "-f", "qcow2", "-b", "base.raw", "-F", "raw", image.to_str().unwrap(), "128M"],
    );
    assert!(out.status.success(), "{out:?}");
    let socket = dir.path("vsd.sock");
    let mut args = common::qcow2_export(&image, &socket, ",writable=on,num-queues=2");
    // The qcow2 node acts on the guest's discards only with discard=unmap,
    // as QEMU's.
    args[3].push_str(",discard=unmap");
    let daemon = Daemon::vsd(&dir, &args);
    let facts = boot(&dir, &socket, &["--queues", "2", "--size", "48M", "--bs", "4k", "--append", "vsd.discard=on"]);
    assert_eq!(facts["fio_write_status"], "0");
    assert_eq!(facts["fio_verify_status"], "0");
    assert_eq!(facts["fio_verify_read_bytes"], facts["fio_expected_bytes"]);
    assert_eq!(facts["discard_status"], "0");
    assert_eq!(facts["discard_bytes"], (24 * MIB).to_string());
    assert_eq!(facts["discard_reads_zero"], "1", "the guest's discard left data behind");
    assert_eq!(daemon.stop().code(), Some(0));

    let check = common::run("qemu-img", &["check", image.to_str().unwrap()]);
    let report = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success() && report.contains("No errors were found"), "{report}");
    // Past what fio wrote, the backing file still shows through.
    let tail = dir.path("tail.raw");
    let out = common::run("qemu-img", &["convert", "-O", "raw", image.to_str().unwrap(), tail.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let converted = std::fs::read(&tail).unwrap();
    let original = std::fs::read(&base).unwrap();
    assert!(converted[64 * MIB as usize..] == original[64 * MIB as usize..], "backing data beyond fio's range");
    assert!(converted[..24 * MIB as usize].iter().all(|&b| b == 0), "discarded clusters read as zeroes");
    assert!(converted[24 * MIB as usize..48 * MIB as usize] != original[24 * MIB as usize..48 * MIB as usize]);
}

/// QMP `block_resize` while the guest runs: the front-end hears of it on the
/// back-end request channel, and the guest's virtio_blk picks up the new
/// capacity without a reboot.
#[test]
fn guest_sees_block_resize_live() {
    let dir = Scratch::new("guest-resize");
    let image = dir.image("disk.img", 32 * MIB);
    let socket = dir.path("vsd.sock");
    let qmp = dir.path("qmp.sock");
    let mut args = file_export(&image, &socket, "", ",writable=on");
    args.extend([
        "--chardev".into(),
        format!("socket,id=m,path={},server=on,wait=off", qmp.display()),
        "--monitor".into(),
        "chardev=m".into(),
    ]);
    let _daemon = Daemon::vsd(&dir, &args);
    let facts = std::thread::scope(|s| {
        let guest = s.spawn(|| boot(&dir, &socket, &["--queues", "1", "--job", "resize", "--append", "vsd.wait=120"]));
        let log = dir.path("console.log");
        while !std::fs::read_to_string(&log).unwrap_or_default().contains("VSD-GUEST resize_ready") {
            assert!(!guest.is_finished(), "the guest ended before it was ready");
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let mut client = vsd_control::client::QmpClient::connect(&qmp).unwrap();
        let size = serde_json::json!({ "node-name": "disk0", "size": 96 * MIB });
        client.execute("block_resize", size).unwrap();
        guest.join().unwrap()
    });
    assert_eq!(facts["capacity_bytes"], (32 * MIB).to_string());
    assert_eq!(facts["resized_bytes"], (96 * MIB).to_string());
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 96 * MIB);
}
