//! Same bytes as QEMU: what vsd writes, qemu-io and qemu-storage-daemon
//! read, and the other way round.

mod common;

use common::{Daemon, Scratch, file_export, pattern, run};
use vsd_bench::ClientOptions;

const MIB: u64 = 1 << 20;

/// Runs one qemu-io command on a raw image; `read -P` fails (non-zero exit,
/// "Pattern verification failed") when the bytes differ.
fn try_qemu_io(image: &std::path::Path, command: &str) -> (bool, String) {
    let out = run("qemu-io", &["-f", "raw", "-c", command, image.to_str().unwrap()]);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success() && !text.contains("Pattern verification failed"), text)
}

fn qemu_io(image: &std::path::Path, command: &str) {
    let (ok, text) = try_qemu_io(image, command);
    assert!(ok, "qemu-io -c '{command}': {text}");
}

#[test]
fn vsd_writes_qemu_io_verifies() {
    let dir = Scratch::new("vsd2qemu");
    let image = dir.image("disk.img", 16 * MIB);
    let daemon = Daemon::vsd(&dir, &file_export(&image, &dir.path("s.sock"), "", ",writable=on,num-queues=2"));
    let mut client = daemon.connect(ClientOptions { num_queues: 2, ..Default::default() });
    let mut queues = client.take_queues();
    queues[0].write_at(0, &vec![0x5a; MIB as usize]).unwrap();
    queues[1].write_at(5 * MIB, &vec![0xc3; 3 * MIB as usize]).unwrap();
    queues[0].flush().unwrap();
    drop(queues);
    drop(client);
    drop(daemon);
    qemu_io(&image, "read -P 0x5a 0 1M");
    qemu_io(&image, "read -P 0xc3 5M 3M");
    qemu_io(&image, "read -P 0 1M 4M");
    // A negative control: qemu-io really checks the pattern.
    let (ok, text) = try_qemu_io(&image, "read -P 0x77 0 4k");
    assert!(!ok && text.contains("Pattern verification failed"), "{text}");
}

#[test]
fn qemu_io_writes_vsd_reads() {
    let dir = Scratch::new("qemu2vsd");
    let image = dir.image("disk.img", 16 * MIB);
    qemu_io(&image, "write -P 0xa5 1M 2M");
    qemu_io(&image, "write -P 0x3c 12M 64k");
    let daemon = Daemon::vsd(&dir, &file_export(&image, &dir.path("s.sock"), "", ""));
    let mut client = daemon.connect(ClientOptions { read_only: true, ..Default::default() });
    let mut queue = client.take_queue(0).unwrap();
    let mut buf = vec![0u8; 4 * MIB as usize];
    queue.read_at(0, &mut buf).unwrap();
    assert!(buf[..MIB as usize].iter().all(|&b| b == 0));
    assert!(buf[MIB as usize..3 * MIB as usize].iter().all(|&b| b == 0xa5));
    assert!(buf[3 * MIB as usize..].iter().all(|&b| b == 0));
    let mut small = vec![0u8; 65536];
    queue.read_at(12 * MIB, &mut small).unwrap();
    assert!(small.iter().all(|&b| b == 0x3c));
}

/// The same client, the same image, served alternately by vsd and QSD.
#[test]
fn vsd_and_qemu_storage_daemon_see_the_same_bytes() {
    let dir = Scratch::new("qsd");
    let image = dir.image("disk.img", 16 * MIB);
    let sock = dir.path("s.sock");
    let export = |daemon: &Daemon, offset: u64, seed: u64| {
        let mut client = daemon.connect(ClientOptions::default());
        let mut queue = client.take_queue(0).unwrap();
        queue.write_at(offset, &pattern(seed, MIB as usize)).unwrap();
        queue.flush().unwrap();
    };
    let check = |daemon: &Daemon, offset: u64, seed: u64| {
        let mut client = daemon.connect(ClientOptions::default());
        let mut queue = client.take_queue(0).unwrap();
        let mut back = vec![0u8; MIB as usize];
        queue.read_at(offset, &mut back).unwrap();
        assert!(back == pattern(seed, MIB as usize), "bytes at {offset} differ");
    };
    let args = file_export(&image, &sock, "", ",writable=on");
    let vsd = Daemon::vsd(&dir, &args);
    export(&vsd, 2 * MIB, 1);
    drop(vsd);
    let qsd = Daemon::qsd(&dir, &args);
    check(&qsd, 2 * MIB, 1);
    export(&qsd, 9 * MIB, 2);
    drop(qsd);
    let vsd = Daemon::vsd(&dir, &args);
    check(&vsd, 9 * MIB, 2);
    check(&vsd, 2 * MIB, 1);
}
