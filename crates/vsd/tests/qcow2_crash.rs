//! Crash consistency of qcow2 images: vsd is killed with SIGKILL at random
//! moments of an allocating write + flush workload on two queues. After
//! each kill, `qemu-img check` must find no corruption (leaked clusters
//! are tolerated, as QEMU tolerates them), and every write acknowledged
//! before a completed flush must read back intact.

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Daemon, Scratch, json_count, pattern, qcow2_export, run};
use vsd_bench::ClientOptions;

const MIB: u64 = 1 << 20;
const DISK: u64 = 64 * MIB;
const ITERATIONS: u64 = 25;

/// What one queue's thread knows survived: writes acknowledged before its
/// last completed flush.
#[derive(Default)]
struct Journal {
    durable: Vec<(u64, usize, u64)>,
    pending: Vec<(u64, usize, u64)>,
}

/// A tiny deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn qemu_img_check(image: &Path) -> String {
    let out = run("qemu-img", &["check", "--output=json", image.to_str().unwrap()]);
    let report = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    // 0 clean, 2 corruptions, 3 leaks only: anything else is a check that
    // did not run, which must not read as "no corruptions".
    assert!(matches!(out.status.code(), Some(0 | 2 | 3)), "qemu-img check did not run: {report}");
    report
}

/// Each queue writes fresh 4-128 KiB ranges of its half of the disk (so
/// most writes allocate) and flushes every few writes.
fn workload(queue: &mut vsd_bench::Queue, half: u64, seed: u64, journal: &Mutex<Journal>) {
    let mut rng = Rng(seed | 1);
    let mut next = half * DISK / 2;
    let end = (half + 1) * DISK / 2;
    loop {
        let len = ((rng.next() % 32 + 1) * 4096) as usize;
        // Skip ahead sometimes, so writes start inside clusters too.
        next += (rng.next() % 4) * 512;
        if next + len as u64 > end {
            return;
        }
        let data = pattern(next ^ seed, len);
        if queue.write_at(next, &data).is_err() {
            return;
        }
        journal.lock().unwrap().pending.push((next, len, next ^ seed));
        next += len as u64;
        if rng.next().is_multiple_of(4) {
            if queue.flush().is_err() {
                return;
            }
            let mut j = journal.lock().unwrap();
            let done = std::mem::take(&mut j.pending);
            j.durable.extend(done);
        }
    }
}

/// vsd serving `image` on two queues, with `export_opts` appended.
fn serve(dir: &Scratch, image: &Path, export_opts: &str) -> Daemon {
    Daemon::vsd(dir, &qcow2_export(image, &dir.path("crash.sock"), &format!(",num-queues=2{export_opts}")))
}

#[test]
fn kill_9_never_corrupts_and_keeps_flushed_writes() {
    let dir = Scratch::new("qcow2-crash");
    let mut rng = Rng(0x5eed_cafe);
    // Cluster sizes that make allocation touch every kind of metadata:
    // 512 bytes grows the refcount table and allocates many L2 tables.
    let kinds = [
        "cluster_size=512",
        "cluster_size=4096",
        "cluster_size=65536",
        "extended_l2=on,cluster_size=65536",
        "lazy_refcounts=on,cluster_size=65536",
    ];
    let mut total_checked = 0;
    for iteration in 0..ITERATIONS {
        let kind = kinds[(iteration % kinds.len() as u64) as usize];
        let image = dir.path(&format!("crash{iteration}.qcow2"));
        let out = run("qemu-img", &["create", "-f", "qcow2", "-o", kind, image.to_str().unwrap(), &DISK.to_string()]);
        assert!(out.status.success(), "qemu-img create: {out:?}");

        let daemon = serve(&dir, &image, ",writable=on");
        let mut client = daemon.connect(ClientOptions {
            num_queues: 2,
            // Killed mid-request, the daemon never answers: give up soon.
            io_timeout: Duration::from_secs(1),
            ..Default::default()
        });
        let journals: Vec<Arc<Mutex<Journal>>> = (0..2).map(|_| Arc::default()).collect();
        let threads: Vec<_> = client
            .take_queues()
            .into_iter()
            .zip(&journals)
            .enumerate()
            .map(|(half, (mut queue, journal))| {
                let journal = journal.clone();
                let seed = iteration * 1000 + half as u64;
                std::thread::spawn(move || workload(&mut queue, half as u64, seed, &journal))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50 + rng.next() % 400));
        // SAFETY: kill() on the pid of the daemon this test spawned.
        unsafe { libc::kill(daemon.pid() as i32, libc::SIGKILL) };
        for t in threads {
            t.join().unwrap();
        }
        drop(client);
        drop(daemon);
        common::wait_until_unlocked(&image);

        if kind.starts_with("lazy") {
            // Refcounts may lag behind: the dirty bit says so, and opening
            // the image for writing rebuilds them, as QEMU does.
            let header = std::fs::read(&image).unwrap();
            let incompatible = u64::from_be_bytes(header[72..80].try_into().unwrap());
            assert_eq!(incompatible & 1, 1, "iteration {iteration}: a lazy-refcount image killed mid-write is dirty");
            assert_eq!(serve(&dir, &image, ",writable=on").stop().code(), Some(0));
        }
        let report = qemu_img_check(&image);
        assert_eq!(json_count(&report, "corruptions"), 0, "{kind}, iteration {iteration}: {report}");
        assert!(!report.contains("\"check-errors\": 1"), "{kind}, iteration {iteration}: {report}");

        let daemon = serve(&dir, &image, "");
        let mut client = daemon.connect(ClientOptions { num_queues: 1, read_only: true, ..Default::default() });
        let mut queue = client.take_queue(0).unwrap();
        let mut checked = 0u64;
        for journal in &journals {
            for &(offset, len, seed) in &journal.lock().unwrap().durable {
                let mut back = vec![0u8; len];
                queue.read_at(offset, &mut back).unwrap();
                assert!(back == pattern(seed, len), "{kind}, iteration {iteration}: flushed write at {offset} lost");
                checked += 1;
            }
        }
        total_checked += checked;
        drop(queue);
        drop(client);
        drop(daemon);
        std::fs::remove_file(&image).unwrap();
    }
    eprintln!("{total_checked} flushed writes checked after {ITERATIONS} kills");
    // The kills must land mid-workload with flushed data behind them, or
    // the test proves nothing.
    assert!(total_checked >= ITERATIONS, "only {total_checked} flushed writes were checked");
}

/// Without any guest flush, a clean stop (SIGTERM) still writes the cached
/// metadata back: QEMU's tools find the image clean and the data there.
#[test]
fn sigterm_writes_back_metadata_the_guest_never_flushed() {
    let dir = Scratch::new("qcow2-sigterm");
    let image = dir.path("t.qcow2");
    let out = run("qemu-img", &["create", "-f", "qcow2", image.to_str().unwrap(), "16M"]);
    assert!(out.status.success(), "{out:?}");
    let daemon = serve(&dir, &image, ",writable=on");
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    queue.write_at(MIB, &pattern(3, 256 * 1024)).unwrap();
    drop(queue);
    drop(client);
    assert_eq!(daemon.stop().code(), Some(0));
    let report = qemu_img_check(&image);
    assert_eq!(json_count(&report, "corruptions") + json_count(&report, "leaks"), 0, "{report}");
    let copy = dir.path("t.raw");
    let out = run("qemu-img", &["convert", "-O", "raw", image.to_str().unwrap(), copy.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let raw = std::fs::read(&copy).unwrap();
    assert!(raw[MIB as usize..MIB as usize + 256 * 1024] == pattern(3, 256 * 1024)[..], "data lost at stop");
}

/// With `writethrough=on` every acknowledged write is durable, allocation
/// included: a SIGKILL right after the acknowledgement, with no flush,
/// loses nothing.
#[test]
fn writethrough_writes_survive_kill_9_without_a_flush() {
    let dir = Scratch::new("qcow2-writethrough");
    let image = dir.path("w.qcow2");
    let out = run("qemu-img", &["create", "-f", "qcow2", image.to_str().unwrap(), "16M"]);
    assert!(out.status.success(), "{out:?}");
    let daemon = serve(&dir, &image, ",writable=on,writethrough=on");
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    // An allocating write, then an in-place one into the same clusters.
    queue.write_at(2 * MIB, &pattern(5, 128 * 1024)).unwrap();
    queue.write_at(2 * MIB + 128 * 1024, &pattern(6, 64 * 1024)).unwrap();
    // SAFETY: kill() on the pid of the daemon this test spawned.
    unsafe { libc::kill(daemon.pid() as i32, libc::SIGKILL) };
    drop(queue);
    drop(client);
    drop(daemon);
    common::wait_until_unlocked(&image);
    let report = qemu_img_check(&image);
    assert_eq!(json_count(&report, "corruptions"), 0, "{report}");
    let copy = dir.path("w.raw");
    let out = run("qemu-img", &["convert", "-O", "raw", image.to_str().unwrap(), copy.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let raw = std::fs::read(&copy).unwrap();
    let at = 2 * MIB as usize;
    assert!(raw[at..at + 128 * 1024] == pattern(5, 128 * 1024)[..], "acknowledged writethrough write lost");
    assert!(raw[at + 128 * 1024..at + 192 * 1024] == pattern(6, 64 * 1024)[..], "second write lost");
}
