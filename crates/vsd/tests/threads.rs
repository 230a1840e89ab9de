//! Queues served by fewer worker threads than queues (`num-threads`),
//! driven by libblkio and by the test front-end: every queue's data is
//! right and its requests are counted on it, the daemon runs as many
//! threads as asked (one per queue by default, no more than the CPUs),
//! named after their queues, and a thread restarts without losing the
//! requests of its other queues when one of them stops or the front-end
//! reconnects.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::frontend::{BlkFrontend, GuestMemory, QUEUE_SIZE};
use common::{Daemon, Scratch, VSD, file_export, pattern, run};
use serde_json::json;
use vhost::VhostBackend;
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN};
use vsd_bench::{ClientOptions, Queue};
use vsd_control::client::QmpClient;
use vsd_trace::{ExportSnapshot, OpKind};

const MIB: u64 = 1 << 20;
/// Each queue writes its own 16 MiB region.
const REGION: u64 = 16 * MIB;
const ROUNDS: u64 = 32;

/// vsd serving `node` (a `--blockdev` without its node name) as export
/// `e` with `export_opts`, with a QMP monitor.
fn start(dir: &Scratch, node: &str, export_opts: &str) -> (Daemon, PathBuf) {
    let qmp = dir.path("qmp.sock");
    let args: Vec<String> = vec![
        "--blockdev".into(),
        format!("{node},node-name=n"),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=e,node-name=n,addr.type=unix,addr.path={},writable=on{export_opts}",
            dir.path("e.sock").display()
        ),
        "--chardev".into(),
        format!("socket,id=qmp0,path={},server=on,wait=off", qmp.display()),
        "--monitor".into(),
        "chardev=qmp0".into(),
    ];
    (Daemon::vsd(dir, &args), qmp)
}

fn file_node(image: &Path) -> String {
    format!("driver=file,filename={}", image.display())
}

/// Export `e`'s worker threads: name -> the CPUs it may run on.
fn worker_threads(daemon: &Daemon) -> BTreeMap<String, String> {
    let mut threads = BTreeMap::new();
    for task in std::fs::read_dir(format!("/proc/{}/task", daemon.pid())).unwrap() {
        let task = task.unwrap().path();
        // A thread that just ended may be gone already.
        let (Ok(name), Ok(status)) =
            (std::fs::read_to_string(task.join("comm")), std::fs::read_to_string(task.join("status")))
        else {
            continue;
        };
        let cpus = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap().trim();
        if name.starts_with("vsd-e-q") {
            threads.insert(name.trim().to_string(), cpus.to_string());
        }
    }
    threads
}

fn thread_names(daemon: &Daemon) -> Vec<String> {
    worker_threads(daemon).into_keys().collect()
}

/// Asserts the worker threads come to be `expected`: a thread that ended
/// may be listed in /proc a moment after it was joined.
fn assert_threads(daemon: &Daemon, expected: &[&str], why: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let names = thread_names(daemon);
        if names == expected {
            return;
        }
        assert!(Instant::now() < deadline, "{why}: {names:?}, not {expected:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Where queue `q` writes in round `round`, and how much: distinct places
/// (37 and 64 are coprime), none overlapping.
fn extent(q: usize, round: u64) -> (u64, usize) {
    (q as u64 * REGION + (round * 37 % 64) * 256 * 1024, 4096 * (1 + (round as usize % 16)))
}

fn data(q: usize, round: u64) -> Vec<u8> {
    pattern(q as u64 * 1000 + round, extent(q, round).1)
}

/// Every queue writes its rounds and reads each back, all queues at once;
/// then flushes. Queue `q` of `queues` writes region `region_of(q)`.
fn write_on_every_queue(queues: Vec<Queue>, region_of: fn(usize) -> usize) {
    let workers: Vec<_> = queues
        .into_iter()
        .enumerate()
        .map(|(q, mut queue)| {
            std::thread::spawn(move || {
                let region = region_of(q);
                for round in 0..ROUNDS {
                    let (offset, len) = extent(region, round);
                    queue.write_at(offset, &data(region, round)).unwrap();
                    let mut back = vec![0u8; len];
                    queue.read_at(offset, &mut back).unwrap();
                    assert_eq!(back, data(region, round), "queue {q} round {round}");
                }
                queue.flush().unwrap();
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
}

/// Every queue reads back what was written to region `region_of(q)`.
fn read_on_every_queue(queues: Vec<Queue>, region_of: fn(usize) -> usize) {
    for (q, mut queue) in queues.into_iter().enumerate() {
        let region = region_of(q);
        for round in 0..ROUNDS {
            let (offset, len) = extent(region, round);
            let mut back = vec![0u8; len];
            queue.read_at(offset, &mut back).unwrap();
            assert_eq!(back, data(region, round), "queue {q} reading region {region}, round {round}");
        }
    }
}

fn assert_on_disk(image: &Path, regions: usize) {
    let file = std::fs::File::open(image).unwrap();
    for region in 0..regions {
        for round in 0..ROUNDS {
            let (offset, len) = extent(region, round);
            let mut on_disk = vec![0u8; len];
            file.read_exact_at(&mut on_disk, offset).unwrap();
            assert_eq!(on_disk, data(region, round), "region {region} round {round} on disk");
        }
    }
}

/// Export `e`'s statistics, per queue.
fn queue_stats(qmp: &Path) -> ExportSnapshot {
    let mut client = QmpClient::connect(qmp).unwrap();
    let all = client.execute("query-blockstats", json!({})).unwrap();
    let entry = all.as_array().unwrap().iter().find(|e| e["qdev"] == "e").cloned().expect("stats of export e");
    serde_json::from_value(entry["x-vsd"].clone()).unwrap()
}

fn own(q: usize) -> usize {
    q
}

#[test]
fn four_queues_on_two_threads_each_serve_and_count_their_own_requests() {
    let dir = Scratch::new("threads-shared");
    let image = dir.image("disk.img", 4 * REGION);
    let (daemon, qmp) = start(&dir, &file_node(&image), ",num-queues=4,num-threads=2");
    let mut client = daemon.connect(ClientOptions { num_queues: 4, ..Default::default() });
    write_on_every_queue(client.take_queues(), own);
    assert_on_disk(&image, 4);

    assert_eq!(thread_names(&daemon), ["vsd-e-q0,2", "vsd-e-q1,3"], "queue q on thread q % 2");
    let stats = queue_stats(&qmp);
    assert_eq!(stats.queues.len(), 4);
    for (q, queue) in stats.queues.iter().enumerate() {
        let ops = |kind| queue.op(kind).ops;
        assert_eq!((ops(OpKind::Write), ops(OpKind::Read), ops(OpKind::Flush)), (ROUNDS, ROUNDS, 1), "queue {q}");
        assert_eq!(queue.op(OpKind::Write).failed + queue.op(OpKind::Read).failed, 0, "queue {q}");
        assert!(queue.events.kicks > 0 && queue.events.calls > 0, "queue {q}: {:?}", queue.events);
    }
}

#[test]
fn threads_default_to_one_per_queue_up_to_the_cpus() {
    let dir = Scratch::new("threads-default");
    let (daemon, _) = start(&dir, "driver=null-co,read-zeroes=on", ",num-queues=4");
    let mut client = daemon.connect(ClientOptions { num_queues: 4, ..Default::default() });
    for mut queue in client.take_queues() {
        queue.read_at(0, &mut [0u8; 512]).unwrap();
    }
    // The daemon inherits this process's CPUs.
    let cpus = vsd_sys::allowed_cpus().unwrap().len();
    let names = thread_names(&daemon);
    assert_eq!(names.len(), cpus.min(4), "{names:?} on {cpus} CPUs");
    let mut served: Vec<u16> = names
        .iter()
        .flat_map(|name| name.strip_prefix("vsd-e-q").unwrap().split(',').map(|q| q.parse::<u16>().unwrap()))
        .collect();
    served.sort();
    assert_eq!(served, [0, 1, 2, 3], "every queue on one thread: {names:?}");
}

#[test]
fn threads_are_pinned_to_the_cpus_cpu_affinity_names_in_turn() {
    let dir = Scratch::new("threads-pinned");
    let (daemon, _) = start(&dir, "driver=null-co,read-zeroes=on", ",num-queues=4,num-threads=2,cpu-affinity=1:0");
    let mut client = daemon.connect(ClientOptions { num_queues: 4, ..Default::default() });
    for mut queue in client.take_queues() {
        queue.read_at(0, &mut [0u8; 512]).unwrap();
    }
    let pinned = worker_threads(&daemon);
    let got: Vec<(&str, &str)> = pinned.iter().map(|(n, c)| (n.as_str(), c.as_str())).collect();
    assert_eq!(got, [("vsd-e-q0,2", "1"), ("vsd-e-q1,3", "0")], "thread t on the t-th CPU listed");
}

/// A front-end that comes back with fewer queues gets threads for those
/// only, and every queue reads what the previous connection wrote.
#[test]
fn reconnecting_restarts_the_threads_with_the_queues_set_up() {
    let dir = Scratch::new("threads-reconnect");
    let image = dir.image("disk.img", 4 * REGION);
    let (daemon, _) = start(&dir, &file_node(&image), ",num-queues=4,num-threads=2");
    let mut client = daemon.connect(ClientOptions { num_queues: 4, ..Default::default() });
    write_on_every_queue(client.take_queues(), own);
    drop(client);

    // Each queue reads another queue's region. (Once a queue has served,
    // the front-end has set every queue up.)
    let mut client = daemon.connect(ClientOptions { num_queues: 3, ..Default::default() });
    read_on_every_queue(client.take_queues(), |q| (q + 1) % 4);
    assert_threads(&daemon, &["vsd-e-q0,2", "vsd-e-q1"], "three queues");
    drop(client);

    let mut client = daemon.connect(ClientOptions { num_queues: 4, ..Default::default() });
    read_on_every_queue(client.take_queues(), |q| 3 - q);
    assert_threads(&daemon, &["vsd-e-q0,2", "vsd-e-q1,3"], "four queues again");
}

/// Stopping one queue (GET_VRING_BASE) restarts its thread: a request in
/// flight on the other queue completes first, as a stop's requests do, and
/// that queue goes on serving, as does the stopped one once restarted.
#[test]
fn stopping_one_queue_of_a_thread_completes_the_others_requests_and_keeps_them_served() {
    let dir = Scratch::new("threads-stop");
    let latency = Duration::from_millis(300);
    let node = format!("driver=null-co,read-zeroes=on,latency-ns={}", latency.as_nanos());
    let (daemon, qmp) = start(&dir, &node, ",num-queues=2,num-threads=1");
    let mut fe = BlkFrontend::connect(&daemon.socket, GuestMemory::new()).unwrap();
    assert_eq!(thread_names(&daemon), ["vsd-e-q0,1"]);

    let started = Instant::now();
    let head = fe.start_io(0, VIRTIO_BLK_T_IN, 0, &[0u8; 4096]);
    // Stop queue 1 only once the thread has taken the request: one still in
    // the ring would be taken after the restart, not drained by the stop.
    while queue_stats(&qmp).queues[0].events.in_flight == 0 {
        assert!(started.elapsed() < latency, "queue 0's request was not taken within its latency");
        std::thread::sleep(Duration::from_millis(1));
    }
    fe.conn.get_vring_base(1).unwrap();
    let used = fe.wait_used(0, Duration::ZERO).expect("queue 0's request completed before queue 1 stopped");
    assert!(started.elapsed() >= latency, "the request took its latency: {:?}", started.elapsed());
    assert_eq!(used.id, u32::from(head));
    assert_threads(&daemon, &["vsd-e-q0"], "the thread goes on with queue 0 alone");

    let ok = VIRTIO_BLK_S_OK as u8;
    assert_eq!(fe.io(0, VIRTIO_BLK_T_IN, 8, &mut [0u8; 4096]), Some((ok, 4097)), "queue 0 still served");
    fe.start_queue(1).unwrap();
    assert_threads(&daemon, &["vsd-e-q0,1"], "queue 1 back");
    for q in 0..2 {
        assert_eq!(fe.io(q, VIRTIO_BLK_T_IN, 16, &mut [0u8; 4096]), Some((ok, 4097)), "queue {q}");
    }
}

/// A ring the guest broke stays given up when its thread restarts for
/// another queue's sake (that queue stopped and set up again), even once
/// the guest makes the ring look sane again.
#[test]
fn a_broken_ring_stays_given_up_when_its_thread_restarts() {
    let dir = Scratch::new("threads-broken");
    let (daemon, _) = start(&dir, "driver=null-co,read-zeroes=on", ",num-queues=2,num-threads=1");
    let mut fe = BlkFrontend::connect(&daemon.socket, GuestMemory::new()).unwrap();
    let silence = Duration::from_millis(300);
    fe.set_avail_idx(0, QUEUE_SIZE + 1); // more new entries than the ring holds
    fe.kick(0);
    assert_eq!(fe.wait_used(0, silence), None, "a broken ring gets no answer");
    fe.set_avail_idx(0, 0);
    fe.start_io(0, VIRTIO_BLK_T_IN, 0, &[0u8; 4096]);
    assert_eq!(fe.wait_used(0, silence), None, "the broken ring is given up");

    fe.conn.get_vring_base(1).unwrap();
    fe.start_queue(1).unwrap();
    let ok = VIRTIO_BLK_S_OK as u8;
    assert_eq!(fe.io(1, VIRTIO_BLK_T_IN, 8, &mut [0u8; 4096]), Some((ok, 4097)), "queue 1 served again");
    fe.kick(0);
    assert_eq!(fe.wait_used(0, silence), None, "the restarted thread still leaves the broken ring alone");
}

#[test]
fn num_threads_outside_one_to_num_queues_is_refused() {
    let dir = Scratch::new("threads-bad");
    let image = dir.image("disk.img", MIB);
    for opts in [",num-queues=2,num-threads=0", ",num-queues=2,num-threads=3"] {
        let args = file_export(&image, &dir.path("e.sock"), "", opts);
        let out = run(VSD, &args.iter().map(String::as_str).collect::<Vec<_>>());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{opts}: accepted");
        assert!(stderr.contains("num-threads") && stderr.contains("from 1 to num-queues (2)"), "{opts}: {stderr}");
    }
}
