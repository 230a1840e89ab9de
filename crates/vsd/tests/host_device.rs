//! Block devices with QEMU's driver, `driver=host_device`, on a loop
//! device: served, read, written, discarded and zeroed through vsd, with
//! its size from the device; `driver=file` refuses a device and
//! `host_device` a regular file, in QEMU's words; a 4096-byte-sector
//! device under `cache.direct=on` serves 512-byte requests (bounced).

mod common;

use std::path::{Path, PathBuf};

use common::{Daemon, Scratch, pattern, run, vsd_fails};
use vsd_bench::{BatchOp, ClientOptions};

const MIB: u64 = 1 << 20;

/// A loop device over a file, detached when dropped.
struct Loop(PathBuf);

impl Loop {
    fn over(file: &Path) -> Self {
        Self::with_sector_size(file, 512)
    }

    fn with_sector_size(file: &Path, sector: u32) -> Self {
        let sector = sector.to_string();
        let out = run("losetup", &["--sector-size", &sector, "--find", "--show", file.to_str().unwrap()]);
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

#[test]
fn a_loop_device_is_served_as_a_host_device() {
    let dir = Scratch::new("host-device");
    let backing = dir.image("backing.img", 64 * MIB);
    std::fs::write(&backing, pattern(3, 64 * MIB as usize)).unwrap();
    let device = Loop::over(&backing);
    let socket = dir.path("d.sock");

    let wrong = vsd_fails(&device_export("file", &device.0, &socket));
    assert!(
        wrong.contains(&format!("'file' driver requires '{}' to be a regular file", device.0.display())),
        "{wrong}"
    );
    let wrong = vsd_fails(&device_export("host_device", &backing, &socket));
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

/// Small random numbers for the test's requests (xorshift).
struct Dice(u64);

impl Dice {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// vsd serving `device` with `cache.direct=on` as a two-queue disk of
/// 512-byte logical blocks on `socket`.
fn serve_with_512_byte_blocks(dir: &Scratch, device: &Loop, socket: &Path) -> Daemon {
    let args = vec![
        "--blockdev".into(),
        format!("driver=host_device,node-name=d0,filename={},cache.direct=on", device.0.display()),
        "--blockdev".into(),
        "driver=raw,node-name=disk0,file=d0".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=e0,node-name=disk0,addr.type=unix,addr.path={},writable=on,num-queues=2,\
             logical-block-size=512",
            socket.display()
        ),
    ];
    Daemon::vsd(dir, &args)
}

/// A 512-byte-sector disk on a 4096-byte-sector device with O_DIRECT:
/// every request below is misaligned for the device, so vsd reads the
/// blocks around it, merges and writes them back. Two queues write
/// alternate sectors of the same blocks at once (four requests in flight
/// each), so a read-modify-write that ignored the other's would bring back
/// old sectors; each queue checks its own sectors as it goes, and at the
/// end the device holds every write.
#[test]
fn a_4096_byte_sector_device_serves_512_byte_requests_with_cache_direct() {
    const SPAN: u64 = MIB;
    let dir = Scratch::new("host-device-4k");
    let backing = dir.image("backing.img", 64 * MIB);
    let original = pattern(5, 64 * MIB as usize);
    std::fs::write(&backing, &original).unwrap();
    let device = Loop::with_sector_size(&backing, 4096);
    let socket = dir.path("d.sock");
    let daemon = serve_with_512_byte_blocks(&dir, &device, &socket);
    let mut client = daemon.connect(ClientOptions { num_queues: 2, ..Default::default() });
    assert_eq!(client.capacity().unwrap(), 64 * MIB);
    let threads: Vec<_> = client
        .take_queues()
        .into_iter()
        .enumerate()
        .map(|(q, mut queue)| {
            let mut model = original[..SPAN as usize].to_vec();
            std::thread::spawn(move || {
                let mut dice = Dice(0x1234_5678 + q as u64);
                // Queue q owns the sectors whose number has q's parity.
                let mine = |sector: u64| sector % 2 == q as u64;
                for round in 0..400u64 {
                    if dice.below(3) == 0 {
                        let (sector, count) = (dice.below(SPAN / 512 - 16), 1 + dice.below(16));
                        let mut back = vec![0u8; 512 * count as usize];
                        queue.read_at(sector * 512, &mut back).unwrap();
                        for s in (sector..sector + count).filter(|&s| mine(s)) {
                            let (at, model_at) = (((s - sector) * 512) as usize, (s * 512) as usize);
                            assert!(
                                back[at..at + 512] == model[model_at..model_at + 512],
                                "queue {q} round {round}: sector {s} reads back wrong"
                            );
                        }
                        continue;
                    }
                    // Four single-sector writes at once, some in one block.
                    let base = dice.below(SPAN / 4096 - 1) * 8;
                    let mut sectors: Vec<u64> =
                        (0..4).map(|_| base + dice.below(16)).map(|s| s - s % 2 + q as u64).collect();
                    sectors.sort_unstable();
                    sectors.dedup();
                    let data: Vec<Vec<u8>> = sectors.iter().map(|&s| pattern(round * 100 + s, 512)).collect();
                    let batch: Vec<BatchOp> =
                        sectors.iter().zip(&data).map(|(&s, d)| BatchOp::Write(s * 512, d)).collect();
                    queue.run_batch(&batch).unwrap();
                    for (&s, d) in sectors.iter().zip(&data) {
                        model[(s * 512) as usize..(s * 512 + 512) as usize].copy_from_slice(d);
                    }
                }
                // A request larger than a bounce buffer, starting and
                // ending mid-block, in this queue's own megabyte.
                let at = (8 + q as u64) * MIB + 1536;
                let big = pattern(77 + q as u64, 300 * 1024 + 512);
                queue.write_at(at, &big).unwrap();
                let mut back = vec![0u8; big.len()];
                queue.read_at(at, &mut back).unwrap();
                assert!(back == big, "queue {q}: a large misaligned write reads back");
                queue.flush().unwrap();
                (q, model, queue)
            })
        })
        .collect();
    let mut done: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let mut expected = original.clone();
    for (q, model, _) in &done {
        for s in (0..SPAN / 512).filter(|s| s % 2 == *q as u64) {
            let at = (s * 512) as usize;
            expected[at..at + 512].copy_from_slice(&model[at..at + 512]);
        }
        let at = ((8 + *q as u64) * MIB + 1536) as usize;
        expected[at..at + 300 * 1024 + 512].copy_from_slice(&pattern(77 + *q as u64, 300 * 1024 + 512));
    }

    // Zeroing that starts and ends mid-block.
    let (_, _, mut queue) = done.remove(0);
    let (zero_at, zero_len) = (16 * MIB + 512, 19 * 512 + 8192);
    queue.write_zeroes(zero_at, zero_len, true).unwrap();
    expected[zero_at as usize..(zero_at + zero_len) as usize].fill(0);
    let mut back = vec![0u8; 64 * 1024];
    queue.read_at(16 * MIB - 4096, &mut back).unwrap();
    assert!(
        back[..] == expected[(16 * MIB - 4096) as usize..(16 * MIB + 60 * 1024) as usize],
        "zeroed exactly its range"
    );
    drop((queue, done, client));
    assert_eq!(daemon.stop().code(), Some(0));
    let on_disk = std::fs::read(&backing).unwrap();
    let first_wrong = on_disk.iter().zip(&expected).position(|(a, b)| a != b);
    assert_eq!(first_wrong, None, "the device holds every write and nothing else changed");
}

/// A Linux guest on that disk (512-byte logical blocks over a
/// 4096-byte-sector device, O_DIRECT): fio writes and verifies 512-byte
/// blocks on two queues, then mke2fs formats the disk with 1 KiB blocks;
/// the host's e2fsck finds the file system clean.
#[test]
fn linux_guest_formats_and_uses_a_512_byte_disk_on_a_4096_byte_sector_device() {
    let dir = Scratch::new("guest-4k");
    let backing = dir.image("backing.img", 64 * MIB);
    let device = Loop::with_sector_size(&backing, 4096);
    let socket = dir.path("vsd.sock");
    let daemon = serve_with_512_byte_blocks(&dir, &device, &socket);
    let socket_args = ["--socket", socket.to_str().unwrap()];
    let job = ["--queues", "2", "--size", "8M", "--bs", "512", "--append", "vsd.mkfs=on"];
    let facts = common::run_guest(&dir.path("console.log"), socket_args.iter().chain(&job));
    assert_eq!(facts["logical_block_size"], "512");
    assert_eq!(facts["fio_write_status"], "0");
    assert_eq!(facts["fio_verify_status"], "0");
    assert_eq!(facts["fio_verify_read_bytes"], facts["fio_expected_bytes"]);
    assert_eq!(facts["mkfs_status"], "0");
    assert_eq!(daemon.stop().code(), Some(0));
    let fsck = run("e2fsck", &["-f", "-n", device.0.to_str().unwrap()]);
    assert!(
        fsck.status.success(),
        "e2fsck: {}{}",
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );
}
