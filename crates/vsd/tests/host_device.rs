//! Block devices with QEMU's driver, `driver=host_device`, on a loop
//! device: served, read, written, discarded and zeroed through vsd, with
//! its size from the device; `driver=file` refuses a device and
//! `host_device` a regular file, in QEMU's words.

mod common;

use std::path::{Path, PathBuf};

use common::{Daemon, Scratch, VSD, pattern, run};
use vsd_bench::ClientOptions;

const MIB: u64 = 1 << 20;

/// A loop device over a file, detached when dropped.
struct Loop(PathBuf);

impl Loop {
    fn over(file: &Path) -> Self {
        let out = run("losetup", &["--find", "--show", file.to_str().unwrap()]);
        assert!(out.status.success(), "losetup: {}", String::from_utf8_lossy(&out.stderr));
        Self(PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()))
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = run("losetup", &["-d", self.0.to_str().unwrap()]);
    }
}

fn device_export(driver: &str, path: &Path, socket: &Path) -> Vec<String> {
    vec![
        "--blockdev".into(),
        format!("driver={driver},node-name=d0,filename={},discard=unmap", path.display()),
        "--blockdev".into(),
        "driver=raw,node-name=disk0,file=d0".into(),
        "--export".into(),
        format!("type=vhost-user-blk,id=e0,node-name=disk0,addr.type=unix,addr.path={},writable=on", socket.display()),
    ]
}

fn one_error_line(args: &[String]) -> String {
    let out = run(VSD, &args.iter().map(String::as_str).collect::<Vec<_>>());
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    stderr
}

#[test]
fn a_loop_device_is_served_as_a_host_device() {
    let dir = Scratch::new("host-device");
    let backing = dir.image("backing.img", 64 * MIB);
    std::fs::write(&backing, pattern(3, 64 * MIB as usize)).unwrap();
    let device = Loop::over(&backing);
    let socket = dir.path("d.sock");

    let wrong = one_error_line(&device_export("file", &device.0, &socket));
    assert!(
        wrong.contains(&format!("'file' driver requires '{}' to be a regular file", device.0.display())),
        "{wrong}"
    );
    let wrong = one_error_line(&device_export("host_device", &backing, &socket));
    assert!(wrong.contains("to be either a character or block device"), "{wrong}");

    let daemon = Daemon::vsd(&dir, &device_export("host_device", &device.0, &socket));
    let mut client = daemon.connect(ClientOptions::default());
    assert_eq!(client.capacity().unwrap(), 64 * MIB, "the size comes from the device");
    let mut queue = client.take_queue(0).unwrap();
    let mut back = vec![0u8; 4096];
    queue.read_at(8 * MIB, &mut back).unwrap();
    assert!(back[..] == pattern(3, 64 * MIB as usize)[8 * MIB as usize..8 * MIB as usize + 4096], "reads the device");
    let data = pattern(9, 64 * 1024);
    queue.write_at(MIB, &data).unwrap();
    queue.discard(2 * MIB, MIB).unwrap();
    queue.write_zeroes(4 * MIB, MIB, false).unwrap();
    queue.write_zeroes(5 * MIB, MIB, true).unwrap();
    queue.flush().unwrap();
    let mut zeroes = vec![0xffu8; MIB as usize];
    for at in [4 * MIB, 5 * MIB] {
        queue.read_at(at, &mut zeroes).unwrap();
        assert!(zeroes.iter().all(|&b| b == 0), "write-zeroes at {at:#x} reads back as zeroes");
    }
    drop((queue, client));
    assert_eq!(daemon.stop().code(), Some(0));
    // What vsd wrote is on the device (and in the file behind it).
    let written = std::fs::read(&backing).unwrap();
    assert!(written[MIB as usize..MIB as usize + data.len()] == data[..]);
    assert!(written[4 * MIB as usize..6 * MIB as usize].iter().all(|&b| b == 0));
}
