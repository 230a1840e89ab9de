//! vsd proven with a real vhost-user-blk client: libblkio (crate `blkio`)
//! through the bench client's library.

mod common;

use std::os::unix::fs::FileExt;

use common::{Daemon, Scratch, file_export, pattern};
use vsd_bench::{BatchOp, ClientOptions, Error};

const MIB: u64 = 1 << 20;

/// Each queue writes its own patterns into its own region, concurrently,
/// then reads them back; the image file must hold the same bytes.
fn patterns_on_queues(file_opts: &str, queues: usize) {
    let dir = Scratch::new(&format!("patterns{queues}{}", file_opts.len()));
    let image = dir.image("disk.img", 64 * MIB);
    let args = file_export(&image, &dir.path("s.sock"), file_opts, ",writable=on,num-queues=4");
    let daemon = Daemon::vsd(&dir, &args);
    let mut client = daemon.connect(ClientOptions { num_queues: queues, ..Default::default() });
    assert_eq!(client.capacity().unwrap(), 64 * MIB);
    let threads: Vec<_> = client
        .take_queues()
        .into_iter()
        .enumerate()
        .map(|(q, mut queue)| {
            std::thread::spawn(move || {
                let base = q as u64 * 16 * MIB;
                for round in 0..64u64 {
                    let len = 4096 * (1 + (round as usize % 16));
                    let offset = base + (round * 37 % 64) * 64 * 1024;
                    let data = pattern(q as u64 * 1000 + round, len);
                    queue.write_at(offset, &data).unwrap();
                    let mut back = vec![0u8; len];
                    queue.read_at(offset, &mut back).unwrap();
                    assert_eq!(back, data, "queue {q} round {round}");
                }
                queue.flush().unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // The last round of each queue is on disk, byte for byte.
    let file = std::fs::File::open(&image).unwrap();
    for q in 0..queues as u64 {
        let round = 63u64;
        let len = 4096 * (1 + (round as usize % 16));
        let mut on_disk = vec![0u8; len];
        file.read_exact_at(&mut on_disk, q * 16 * MIB + (round * 37 % 64) * 64 * 1024).unwrap();
        assert_eq!(on_disk, pattern(q * 1000 + round, len));
    }
}

#[test]
fn patterns_on_one_queue() {
    patterns_on_queues("", 1);
}

#[test]
fn patterns_on_four_queues_concurrently() {
    patterns_on_queues("", 4);
}

#[test]
fn patterns_on_four_queues_with_the_thread_pool() {
    patterns_on_queues(",aio=threads", 4);
}

/// On a disk file system and on tmpfs, which has no ZERO_RANGE: write-
/// zeroes then takes a second step (punching a hole), which must not wait
/// for the next request to be submitted.
#[test]
fn flush_discard_and_write_zeroes() {
    for parent in [std::env::temp_dir(), "/dev/shm".into()] {
        flush_discard_and_write_zeroes_in(Scratch::new_in(&parent, "ranges"));
    }
}

fn flush_discard_and_write_zeroes_in(dir: Scratch) {
    let image = dir.image("disk.img", 16 * MIB);
    let mut args = file_export(&image, &dir.path("s.sock"), ",discard=unmap", ",writable=on");
    // Each node acts on discards only with discard=unmap, as in QEMU.
    args[3].push_str(",discard=unmap");
    let daemon = Daemon::vsd(&dir, &args);
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    let data = pattern(7, 256 * 1024);
    let mut back = vec![0u8; data.len()];

    for no_unmap in [true, false] {
        queue.write_at(MIB, &data).unwrap();
        queue.write_zeroes(MIB + 4096, 64 * 1024, no_unmap).unwrap();
        queue.read_at(MIB, &mut back).unwrap();
        assert_eq!(back[..4096], data[..4096]);
        assert!(back[4096..4096 + 65536].iter().all(|&b| b == 0), "zeroed (no_unmap={no_unmap})");
        assert_eq!(back[4096 + 65536..], data[4096 + 65536..]);
    }
    queue.discard(MIB, 128 * 1024).unwrap();
    // discard=unmap on a file punches a hole: the range now reads zeroes.
    queue.read_at(MIB, &mut back).unwrap();
    assert!(back[..128 * 1024].iter().all(|&b| b == 0));
    assert_eq!(back[128 * 1024..], data[128 * 1024..]);
    queue.flush().unwrap();
    // Write-zeroes past the end fails and the queue goes on working.
    let err = queue.write_zeroes(15 * MIB, 2 * MIB, true).unwrap_err();
    assert_eq!(err.errno(), libc::EIO, "{err}");
    queue.flush().unwrap();
}

#[test]
fn requests_past_the_end_fail_without_hanging() {
    let dir = Scratch::new("pastend");
    let image = dir.image("disk.img", 4 * MIB);
    let daemon = Daemon::vsd(&dir, &file_export(&image, &dir.path("s.sock"), "", ",writable=on"));
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    let mut buf = vec![0u8; 8192];
    for offset in [4 * MIB, 4 * MIB - 4096, u64::MAX - 4095] {
        let err = queue.read_at(offset, &mut buf).unwrap_err();
        assert!(matches!(err, Error::Request { .. }), "read at {offset}: {err}");
        assert_eq!(err.errno(), libc::EIO);
        let err = queue.write_at(offset, &buf).unwrap_err();
        assert_eq!(err.errno(), libc::EIO, "write at {offset}: {err}");
    }
    // Nothing was written past the end of the image.
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 4 * MIB);
    queue.read_at(4 * MIB - 8192, &mut buf).unwrap();
}

#[test]
fn read_only_export_refuses_writes() {
    let dir = Scratch::new("ro");
    let image = dir.image("disk.img", 4 * MIB);
    std::fs::write(&image, pattern(3, 4 * MIB as usize)).unwrap();
    let daemon = Daemon::vsd(&dir, &file_export(&image, &dir.path("s.sock"), ",read-only=on", ",writable=off"));
    // The device is read-only (VIRTIO_BLK_F_RO): a read-write client is refused.
    match vsd_bench::Client::connect(&daemon.socket, ClientOptions::default()) {
        Err(Error::DeviceReadOnly) => {}
        Err(e) => panic!("expected DeviceReadOnly, got {e}"),
        Ok(_) => panic!("a read-write client was accepted by a read-only export"),
    }
    let mut client = daemon.connect(ClientOptions { read_only: true, ..Default::default() });
    let mut queue = client.take_queue(0).unwrap();
    let mut buf = vec![0u8; 65536];
    queue.read_at(0, &mut buf).unwrap();
    assert_eq!(buf, pattern(3, 4 * MIB as usize)[..65536]);
    assert!(queue.write_at(0, &buf).is_err());
    assert!(queue.write_zeroes(0, 4096, false).is_err());
    assert!(queue.discard(0, 4096).is_err());
    assert_eq!(std::fs::read(&image).unwrap(), pattern(3, 4 * MIB as usize), "image untouched");
}

#[test]
fn a_writable_export_of_a_read_only_node_is_refused() {
    let dir = Scratch::new("ronode");
    let image = dir.image("disk.img", MIB);
    let out = common::run(
        common::VSD,
        &file_export(&image, &dir.path("s.sock"), ",read-only=on", ",writable=on")
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("read-only"));
}

#[test]
fn clients_come_and_go_and_data_stays() {
    let dir = Scratch::new("reconnect");
    let image = dir.image("disk.img", 8 * MIB);
    let daemon = Daemon::vsd(&dir, &file_export(&image, &dir.path("s.sock"), "", ",writable=on,num-queues=2"));
    for round in 0..5u64 {
        let mut client = daemon.connect(ClientOptions { num_queues: 2, ..Default::default() });
        let mut queue = client.take_queue((round % 2) as usize).unwrap();
        if round > 0 {
            let mut back = vec![0u8; 65536];
            queue.read_at((round - 1) * MIB, &mut back).unwrap();
            assert_eq!(back, pattern(round - 1, 65536), "written by the previous client");
        }
        queue.write_at(round * MIB, &pattern(round, 65536)).unwrap();
        // Dropping the client closes the connection; the daemon must serve
        // the next one on the same socket.
    }
}

/// vsd serving a writable null-co node `n` (with `node_opts`) as export
/// `e` (with `export_opts`) on `dir`'s s.sock.
fn null_co_daemon(dir: &Scratch, node_opts: &str, export_opts: &str) -> Daemon {
    let sock = dir.path("s.sock");
    let args: Vec<String> = vec![
        "--blockdev".into(),
        format!("driver=null-co,node-name=n{node_opts}"),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=e,node-name=n,addr.type=unix,addr.path={},writable=on{export_opts}",
            sock.display()
        ),
    ];
    Daemon::vsd(dir, &args)
}

#[test]
fn null_co_serves_reads_and_writes() {
    let dir = Scratch::new("null");
    let daemon = null_co_daemon(&dir, ",size=1073741824,read-zeroes=on", "");
    let mut client = daemon.connect(ClientOptions::default());
    assert_eq!(client.capacity().unwrap(), 1 << 30);
    let mut queue = client.take_queue(0).unwrap();
    let mut buf = vec![0xaau8; 8192];
    queue.write_at(4096, &buf).unwrap();
    queue.read_at(4096, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0), "read-zeroes=on");
}

/// Batches of 32 requests in flight, past three wraps of the rings' 16-bit
/// indices: the guest moves its available index while the worker reads it
/// (a read torn between two byte loads once took 0x3fff -> 0x4000 for
/// 0x40ff, and the queue for broken).
#[test]
fn ring_indices_wrap_under_load() {
    let dir = Scratch::new("wrap");
    let daemon = null_co_daemon(&dir, ",size=1073741824", "");
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    let batch: Vec<BatchOp> = (0..32).map(|i| BatchOp::WriteZeroes(i * 4096, 4096)).collect();
    for round in 0..3 * 65536 / batch.len() + 1 {
        queue.run_batch(&batch).unwrap_or_else(|e| panic!("round {round}: {e}"));
    }
    assert!(!queue.is_broken());
}

#[test]
fn queue_workers_run_on_the_cpus_cpu_affinity_names() {
    let dir = Scratch::new("affinity");
    let daemon = null_co_daemon(&dir, ",read-zeroes=on", ",num-queues=3,num-threads=3,cpu-affinity=1:0");
    let opts = ClientOptions { num_queues: 3, ..ClientOptions::default() };
    let mut client = daemon.connect(opts);
    let mut queue = client.take_queue(2).unwrap();
    queue.read_at(0, &mut [0u8; 512]).unwrap();
    let mut pinned = std::collections::BTreeMap::new();
    for task in std::fs::read_dir(format!("/proc/{}/task", daemon.pid())).unwrap() {
        let task = task.unwrap().path();
        let name = std::fs::read_to_string(task.join("comm")).unwrap().trim().to_string();
        let status = std::fs::read_to_string(task.join("status")).unwrap();
        let cpus = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap().trim().to_string();
        if name.starts_with("vsd-e-q") {
            pinned.insert(name, cpus);
        }
    }
    let expected: Vec<(&str, &str)> = vec![("vsd-e-q0", "1"), ("vsd-e-q1", "0"), ("vsd-e-q2", "1")];
    let got: Vec<(&str, &str)> = pinned.iter().map(|(n, c)| (n.as_str(), c.as_str())).collect();
    assert_eq!(got, expected, "queue q runs on the q-th listed CPU, cycling");
}
