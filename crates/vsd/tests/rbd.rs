//! `driver=rbd` against a real Ceph cluster (one monitor, one in-memory
//! OSD, started by scripts/ceph.sh), checked with Ceph's own `rbd` tool,
//! libblkio's client and QEMU's tools.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use common::{Cluster, Daemon, Scratch, VSD, pattern, run, vsd_fails};
use serde_json::{Value, json};
use vsd_bench::ClientOptions;
use vsd_control::client::QmpClient;

const MIB: u64 = 1 << 20;

/// The cluster most tests here use.
fn ceph() -> &'static Cluster {
    Cluster::shared()
}

/// vsd serving `node` (an rbd node's options, named `r0`) as raw on
/// `exp0`, with `export_opts`, and a QMP monitor.
fn serve(dir: &Scratch, node: String, export_opts: &str) -> Daemon {
    serve_with(dir, &[], node, "", export_opts)
}

/// As [`serve`], the raw node with `raw_opts`.
fn serve_raw(dir: &Scratch, node: String, raw_opts: &str, export_opts: &str) -> Daemon {
    serve_with(dir, &[], node, raw_opts, export_opts)
}

/// As [`serve`], with `extra` arguments first (`--object`s).
fn serve_with(dir: &Scratch, extra: &[&str], node: String, raw_opts: &str, export_opts: &str) -> Daemon {
    let mut args: Vec<String> = extra.iter().map(|arg| arg.to_string()).collect();
    args.extend([
        "--blockdev".into(),
        node,
        "--blockdev".into(),
        format!("driver=raw,node-name=d0,file=r0{raw_opts}"),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=exp0,node-name=d0,addr.type=unix,addr.path={}{export_opts}",
            dir.path("exp0.sock").display()
        ),
        "--chardev".into(),
        format!("socket,id=m0,path={},server=on,wait=off", dir.path("qmp.sock").display()),
        "--monitor".into(),
        "chardev=m0".into(),
    ]);
    Daemon::vsd(dir, &args)
}

fn rbd_info(image: &str) -> Value {
    serde_json::from_str(&ceph().rbd(&["info", "--format", "json", image])).unwrap()
}

/// Two queues write their own patterns concurrently and read them back;
/// `rbd export` then shows the same bytes where they wrote and zeroes
/// elsewhere.
#[test]
fn what_two_queues_write_is_what_rbd_exports() {
    let dir = Scratch::new("rbd-verify");
    let image = ceph().image("verify", 32 * MIB);
    let daemon = serve(&dir, image.node("r0"), ",writable=on,num-queues=2");
    let mut client = daemon.connect(ClientOptions { num_queues: 2, ..Default::default() });
    assert_eq!(client.capacity().unwrap(), 32 * MIB);
    let writes =
        |q: u64| (0..32u64).map(move |i| (q * 16 * MIB + i * 192 * 1024, pattern(q * 100 + i, 4096 << (i % 5))));
    let threads: Vec<_> = client
        .take_queues()
        .into_iter()
        .enumerate()
        .map(|(q, mut queue)| {
            std::thread::spawn(move || {
                for (offset, data) in writes(q as u64) {
                    queue.write_at(offset, &data).unwrap();
                    let mut back = vec![0; data.len()];
                    queue.read_at(offset, &mut back).unwrap();
                    assert_eq!(back, data, "queue {q} at {offset}");
                }
                queue.flush().unwrap();
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    drop(client);
    daemon.stop();

    let mut expected = vec![0u8; 32 * MIB as usize];
    for (offset, data) in (0..2).flat_map(writes) {
        expected[offset as usize..offset as usize + data.len()].copy_from_slice(&data);
    }
    assert!(image.export() == expected, "rbd export differs from what vsd acknowledged");
}

/// What `rbd import` wrote reads back through vsd, from the image and
/// from a snapshot, which refuses writes.
#[test]
fn imported_data_and_snapshots_read_back_and_snapshots_refuse_writes() {
    let dir = Scratch::new("rbd-import");
    let source = dir.path("source.raw");
    let content = pattern(7, 8 * MIB as usize);
    std::fs::write(&source, &content).unwrap();
    let image = ceph().image_named("import");
    ceph().rbd(&["import", "--no-progress", source.to_str().unwrap(), &image.name]);
    ceph().rbd(&["snap", "create", &format!("{}@before", image.name)]);

    let daemon = serve(&dir, image.node("r0"), ",writable=on");
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    let mut back = vec![0u8; content.len()];
    for (i, chunk) in back.chunks_mut(MIB as usize).enumerate() {
        queue.read_at(i as u64 * MIB, chunk).unwrap();
    }
    assert!(back == content, "vsd reads what rbd import wrote");
    queue.write_at(0, &pattern(8, 4096)).unwrap();
    queue.flush().unwrap();
    drop((queue, client));
    daemon.stop();

    let snap_dir = Scratch::new("rbd-snap");
    let writable = format!("{},snapshot=before", image.node("r0"));
    let out = Command::new(VSD).args(["--blockdev", &writable]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("rbd snapshots are read-only"));

    let snapshot = format!("{writable},read-only=on");
    let out = Command::new(VSD)
        .args(["--blockdev", &snapshot, "--blockdev", "driver=raw,node-name=d0,file=r0", "--export"])
        .arg(format!(
            "type=vhost-user-blk,id=e0,node-name=d0,addr.type=unix,addr.path={},writable=on",
            snap_dir.path("w.sock").display()
        ))
        .output()
        .unwrap();
    assert!(!out.status.success(), "a snapshot cannot be exported writable");
    let daemon = serve(&snap_dir, snapshot, "");
    assert!(vsd_bench::Client::connect(&daemon.socket, ClientOptions::default()).is_err(), "the device is read-only");
    let mut client = daemon.connect(ClientOptions { read_only: true, ..Default::default() });
    let mut queue = client.take_queue(0).unwrap();
    let mut first = vec![0u8; 4096];
    queue.read_at(0, &mut first).unwrap();
    assert_eq!(first, content[..4096], "the snapshot shows the image as it was");
}

/// Discard and write-zeroes read back as zeroes, through vsd and in `rbd
/// export`; a flush reaches librbd.
#[test]
fn discard_and_write_zeroes_read_back_as_zeroes() {
    let dir = Scratch::new("rbd-zeroes");
    let image = ceph().image("zeroes", 16 * MIB);
    // Both nodes act on discards (discard=unmap), as in QEMU.
    let daemon = serve_raw(&dir, format!("{},discard=unmap", image.node("r0")), ",discard=unmap", ",writable=on");
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    let data = pattern(9, 4 * MIB as usize);
    queue.write_at(0, &data).unwrap();
    queue.write_zeroes(MIB, MIB, false).unwrap();
    queue.write_zeroes(2 * MIB, 64 * 1024, true).unwrap();
    queue.discard(3 * MIB, MIB).unwrap();
    queue.flush().unwrap();
    let mut back = vec![0xffu8; 4 * MIB as usize];
    queue.read_at(0, &mut back).unwrap();
    let mut expected = data.clone();
    for (start, len) in [(MIB, MIB), (2 * MIB, 64 * 1024), (3 * MIB, MIB)] {
        expected[start as usize..(start + len) as usize].fill(0);
    }
    assert!(back == expected, "zeroed ranges read as zeroes, the rest as written");
    drop((queue, client));
    daemon.stop();
    assert!(image.export()[..4 * MIB as usize] == expected[..], "and so does rbd export");
}

/// block_resize changes the image's size in the cluster and the guest's
/// view; a resize by another client shows after a refresh.
#[test]
fn block_resize_resizes_the_image() {
    let dir = Scratch::new("rbd-resize");
    let image = ceph().image("resize", 16 * MIB);
    let daemon = serve(&dir, image.node("r0"), ",writable=on");
    let mut qmp = QmpClient::connect(&dir.path("qmp.sock")).unwrap();
    qmp.execute("block_resize", json!({ "node-name": "d0", "size": 48 * MIB })).unwrap();
    assert_eq!(rbd_info(&image.name)["size"], 48 * MIB);
    let mut client = daemon.connect(ClientOptions::default());
    assert_eq!(client.capacity().unwrap(), 48 * MIB);
    let mut queue = client.take_queue(0).unwrap();
    let data = pattern(11, 4096);
    queue.write_at(47 * MIB, &data).unwrap();
    let mut back = vec![0; 4096];
    queue.read_at(47 * MIB, &mut back).unwrap();
    assert_eq!(back, data, "the new space is usable");
    drop((queue, client));

    // Resized by another client: the guest sees it once told over QMP.
    ceph().rbd(&["resize", "--size", "64M", &image.name]);
    qmp.execute("block_resize", json!({ "node-name": "d0", "size": 64 * MIB })).unwrap();
    let client = daemon.connect(ClientOptions::default());
    assert_eq!(client.capacity().unwrap(), 64 * MIB);

    // Statistics count RBD exports as they count file exports.
    let stats = qmp.execute("query-blockstats", json!({})).unwrap();
    let exp = stats.as_array().unwrap().iter().find(|e| e["qdev"] == "exp0").unwrap().clone();
    assert_eq!(exp["stats"]["wr_operations"], 1, "{exp}");
    assert_eq!(exp["stats"]["rd_operations"], 1, "{exp}");
}

/// A qcow2 image on an RBD image: vsd writes through the format, which
/// grows the RBD image as it allocates, and qemu-img (QEMU's own rbd
/// driver) finds a consistent image holding the same data.
#[test]
fn qcow2_over_rbd_is_consistent_for_qemu_img() {
    let dir = Scratch::new("rbd-qcow2");
    let image = ceph().image_named("qcow2");
    let conf = &ceph().conf;
    let uri = format!("rbd:rbd/{}:conf={}", image.name, conf.display());
    let created = run("qemu-img", &["create", "-f", "qcow2", &uri, "64M"]);
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    let args: Vec<String> = vec![
        "--blockdev".into(),
        image.node("r0"),
        "--blockdev".into(),
        "driver=qcow2,node-name=q0,file=r0".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=exp0,node-name=q0,addr.type=unix,addr.path={},writable=on",
            dir.path("exp0.sock").display()
        ),
    ];
    let daemon = Daemon::vsd(&dir, &args);
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    let data = pattern(12, 256 * 1024);
    for i in 0..8u64 {
        queue.write_at(i * 7 * MIB, &data).unwrap();
    }
    queue.flush().unwrap();
    drop((queue, client));
    daemon.stop();

    let check = run("qemu-img", &["check", &uri]);
    assert!(check.status.success(), "qemu-img check: {}", String::from_utf8_lossy(&check.stdout));
    let converted = dir.path("converted.raw");
    let out = run("qemu-img", &["convert", "-O", "raw", &uri, converted.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let bytes = std::fs::read(&converted).unwrap();
    for i in 0..8u64 {
        let at = (i * 7 * MIB) as usize;
        assert!(bytes[at..at + data.len()] == data[..], "write {i} reads back through QEMU's rbd driver");
    }
    assert!(bytes[..7 * MIB as usize].iter().skip(data.len()).all(|&b| b == 0));
}

/// Mistakes in the options or the cluster's answer: one line naming the
/// cause, in QEMU's words where QEMU has them, and no socket left behind.
#[test]
fn a_wrong_pool_image_or_monitor_is_one_clear_error() {
    let dir = Scratch::new("rbd-errors");
    let conf = &ceph().conf;
    let slow_conf = dir.path("unreachable.conf");
    std::fs::write(&slow_conf, "[global]\nmon_host = 127.0.0.1:1\nclient_mount_timeout = 2\n").unwrap();
    let garbled_conf = dir.path("garbled.conf");
    std::fs::write(&garbled_conf, "[global\nmon_host = = =\n").unwrap();
    let socket = dir.path("never.sock");
    for (node, expected) in [
        (format!("driver=rbd,node-name=r0,pool=nopool,image=x,conf={}", conf.display()), "error opening pool nopool"),
        (
            format!("driver=rbd,node-name=r0,pool=rbd,image=x,conf={}", garbled_conf.display()),
            "error reading conf file",
        ),
        (
            format!("driver=rbd,node-name=r0,pool=rbd,image=noimage,conf={}", conf.display()),
            "error reading header from noimage",
        ),
        (format!("driver=rbd,node-name=r0,pool=rbd,image=x,conf={}", slow_conf.display()), "error connecting"),
        (
            format!("driver=rbd,node-name=r0,pool=rbd,image=x,conf={}", dir.path("none.conf").display()),
            "error reading conf file",
        ),
        ("driver=rbd,node-name=r0,pool=rbd,image=x,key-secret=k0".into(), "No secret with id 'k0'"),
        ("driver=rbd,node-name=r0,pool=rbd,image=x,auth-client-required.0=kerberos".into(), "a list of cephx, none"),
    ] {
        let export = format!("type=vhost-user-blk,id=e0,node-name=d0,addr.type=unix,addr.path={}", socket.display());
        let stderr =
            vsd_fails(&["--blockdev", &node, "--blockdev", "driver=raw,node-name=d0,file=r0", "--export", &export]);
        assert!(stderr.contains(expected), "{node}: {stderr}{}", ceph().report());
        assert!(!Path::new(&socket).exists());
    }
}

/// blockdev-add over QMP takes the same options, monitors given as a
/// `server` list instead of a conf file.
#[test]
fn qmp_blockdev_add_with_a_server_list() {
    let dir = Scratch::new("rbd-qmp");
    let image = ceph().image("qmp", 8 * MIB);
    let daemon = serve(&dir, "driver=null-co,node-name=r0,size=1M".into(), "");
    let mut qmp = QmpClient::connect(&dir.path("qmp.sock")).unwrap();
    let port = std::fs::read_to_string(&ceph().conf).unwrap();
    let port = port.lines().find_map(|l| l.strip_prefix("mon_host = v2:127.0.0.1:")).unwrap().to_string();
    qmp.execute(
        "blockdev-add",
        json!({
            "driver": "rbd", "node-name": "rq", "pool": "rbd", "image": image.name,
            "server": [{ "host": "127.0.0.1", "port": port }],
            "auth-client-required": ["none"],
        }),
    )
    .unwrap();
    let nodes = qmp.execute("query-named-block-nodes", json!({})).unwrap();
    let node = nodes.as_array().unwrap().iter().find(|n| n["node-name"] == "rq").unwrap().clone();
    assert_eq!(node["drv"], "rbd");
    assert_eq!(node["image"]["virtual-size"], 8 * MIB);
    let bad = qmp.execute(
        "blockdev-add",
        json!({ "driver": "rbd", "node-name": "rx", "pool": "rbd", "image": "gone", "conf": ceph().conf }),
    );
    assert!(bad.unwrap_err().to_string().contains("error reading header from gone"));
    qmp.execute("blockdev-del", json!({ "node-name": "rq" })).unwrap();
    drop(daemon);
}

/// A Linux guest under TCG runs fio write + verify on an RBD-backed disk,
/// raw and as qcow2 over RBD; what it wrote is in the cluster.
#[test]
fn linux_guest_runs_fio_verify_on_rbd_raw_and_qcow2() {
    for format in ["raw", "qcow2"] {
        let dir = Scratch::new(&format!("rbd-guest-{format}"));
        let image = ceph().image_named(&format!("guest-{format}"));
        let uri = format!("rbd:rbd/{}:conf={}", image.name, ceph().conf.display());
        let created = run("qemu-img", &["create", "-f", format, &uri, "128M"]);
        assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
        let socket = dir.path("exp0.sock");
        let args: Vec<String> = vec![
            "--blockdev".into(),
            image.node("r0"),
            "--blockdev".into(),
            format!("driver={format},node-name=d0,file=r0"),
            "--export".into(),
            format!(
                "type=vhost-user-blk,id=exp0,node-name=d0,addr.type=unix,addr.path={},writable=on,num-queues=2",
                socket.display()
            ),
        ];
        let mut daemon = Daemon::vsd(&dir, &args);
        let run_args = ["--socket", socket.to_str().unwrap(), "--queues", "2", "--size", "48M", "--bs", "4k"];
        let facts = common::run_guest(&dir.path("console.log"), run_args);
        assert_eq!(facts["capacity_bytes"], (128 * MIB).to_string(), "{format}");
        assert_eq!(facts["fio_write_status"], "0", "{format}");
        assert_eq!(facts["fio_verify_status"], "0", "{format}");
        assert_eq!(facts["fio_verify_read_bytes"], facts["fio_expected_bytes"], "{format}");
        assert!(daemon.is_running());
        daemon.stop();
        if format == "qcow2" {
            let check = run("qemu-img", &["check", &uri]);
            assert!(check.status.success(), "qemu-img check: {}", String::from_utf8_lossy(&check.stdout));
        }
        let converted = dir.path("guest.raw");
        let out = run("qemu-img", &["convert", "-O", "raw", &uri, converted.to_str().unwrap()]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let bytes = std::fs::read(&converted).unwrap();
        assert!(bytes[..48 * MIB as usize].iter().any(|&b| b != 0), "{format}: fio's data is in the cluster");
    }
}

/// vsd killed with SIGKILL while writes are in flight: a new vsd serves
/// the image, and every write acknowledged before the last completed flush
/// reads back.
#[test]
fn flushed_writes_survive_a_killed_daemon() {
    let dir = Scratch::new("rbd-kill");
    let image = ceph().image("kill", 64 * MIB);
    let daemon = serve(&dir, image.node("r0"), ",writable=on");
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    let block = |i: u64| pattern(1000 + i, 64 * 1024);
    for i in 0..64 {
        queue.write_at(i * 64 * 1024, &block(i)).unwrap();
    }
    queue.flush().unwrap();
    // More writes, never flushed, still going when the daemon dies.
    let writer = std::thread::spawn(move || {
        for i in 64..512 {
            if queue.write_at(i * 64 * 1024, &block(i)).is_err() {
                break;
            }
        }
    });
    std::thread::sleep(std::time::Duration::from_millis(200));
    daemon.kill();
    writer.join().unwrap();
    drop(client);

    // The dead client's exclusive lock on the image lasts until the OSD
    // notices its watch is gone; reads do not need it.
    let again = Scratch::new("rbd-kill-again");
    let daemon = serve(&again, image.node("r0"), ",writable=on");
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    let mut back = vec![0u8; 64 * 1024];
    for i in 0..64 {
        queue.read_at(i * 64 * 1024, &mut back).unwrap();
        assert!(back == block(i), "flushed block {i} survived");
    }
    // Writing takes the lock over once librbd has broken the dead one's.
    queue.set_timeout(std::time::Duration::from_secs(120));
    queue.write_at(0, &block(7)).unwrap();
    queue.read_at(0, &mut back).unwrap();
    assert!(back == block(7));
}

/// Held while a test has the shared cluster's OSD stopped: another's
/// SIGCONT would end the stop early.
static OSD_STOPPED: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The OSD stops answering for a few seconds under I/O (SIGSTOP), then
/// answers again: requests wait rather than fail, every one completes
/// with its data, and vsd keeps running.
#[test]
fn requests_wait_while_the_cluster_stops_answering() {
    let dir = Scratch::new("rbd-stall");
    let image = ceph().image("stall", 64 * MIB);
    let mut daemon = serve(&dir, image.node("r0"), ",writable=on");
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    queue.set_timeout(std::time::Duration::from_secs(120));
    let osd = ceph().osd_pid();
    let io = std::thread::spawn(move || {
        let start = std::time::Instant::now();
        let mut rounds = 0u64;
        while start.elapsed() < std::time::Duration::from_secs(8) {
            let offset = (rounds % 256) * 256 * 1024;
            let data = pattern(rounds, 64 * 1024);
            queue.write_at(offset, &data).unwrap();
            let mut back = vec![0; data.len()];
            queue.read_at(offset, &mut back).unwrap();
            assert!(back == data, "round {rounds}");
            rounds += 1;
        }
        queue.flush().unwrap();
        rounds
    });
    std::thread::sleep(std::time::Duration::from_secs(1));
    let _stopped = OSD_STOPPED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    // SAFETY: signals to the test cluster's OSD, a process of this user.
    unsafe { libc::kill(osd, libc::SIGSTOP) };
    std::thread::sleep(std::time::Duration::from_secs(5));
    // SAFETY: as above.
    unsafe { libc::kill(osd, libc::SIGCONT) };
    let rounds = io.join().expect("every request completed with its data");
    assert!(rounds > 0);
    assert!(daemon.is_running());
}

/// SIGTERM while the cluster does not answer (the OSD stopped under I/O):
/// the daemon gives the requests in flight a bounded time, then exits
/// without them (status 1), rather than waiting for the cluster forever.
#[test]
fn sigterm_ends_the_daemon_while_the_cluster_stops_answering() {
    let dir = Scratch::new("rbd-stall-stop");
    let image = ceph().image("stall-stop", 16 * MIB);
    let daemon = serve(&dir, image.node("r0"), ",writable=on");
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    // Its writes fail once the daemon is gone, or time out before: only
    // the exit is judged.
    queue.set_timeout(std::time::Duration::from_secs(3));
    let osd = ceph().osd_pid();
    let io = std::thread::spawn(move || while queue.write_at(0, &pattern(1, 64 * 1024)).is_ok() {});
    std::thread::sleep(std::time::Duration::from_millis(500));
    let _stopped = OSD_STOPPED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    // SAFETY: signals to the test cluster's OSD, a process of this user.
    unsafe { libc::kill(osd, libc::SIGSTOP) };
    std::thread::sleep(std::time::Duration::from_secs(1));
    let stopping = std::time::Instant::now();
    let status = daemon.stop();
    let took = stopping.elapsed();
    // SAFETY: as above.
    unsafe { libc::kill(osd, libc::SIGCONT) };
    assert_eq!(status.code(), Some(1), "vsd was killed after waiting {took:?} for the cluster");
    assert!(took < std::time::Duration::from_secs(10), "{took:?}");
    io.join().unwrap();
}

/// The image is deleted while served (its client fenced first, as `rbd rm`
/// refuses an image in use): its requests fail with an error status, and
/// the daemon's other export keeps serving.
#[test]
fn an_image_deleted_while_served_fails_only_its_own_export() {
    let dir = Scratch::new("rbd-deleted");
    let image = ceph().image("deleted", 16 * MIB);
    let mut args = vec![
        "--blockdev".into(),
        "driver=null-co,node-name=n0,read-zeroes=on".to_string(),
        "--export".into(),
        format!("type=vhost-user-blk,id=exp1,node-name=n0,addr.type=unix,addr.path={}", dir.path("n.sock").display()),
    ];
    args.extend([
        "--blockdev".into(),
        image.node("r0"),
        "--blockdev".into(),
        "driver=raw,node-name=d0,file=r0".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=exp0,node-name=d0,addr.type=unix,addr.path={},writable=on",
            dir.path("exp0.sock").display()
        ),
    ]);
    let mut daemon = Daemon::vsd(&dir, &args);
    let mut client = vsd_bench::Client::connect(&dir.path("exp0.sock"), ClientOptions::default()).unwrap();
    let mut queue = client.take_queue(0).unwrap();
    queue.write_at(0, &pattern(1, 4096)).unwrap();

    let status: Value = serde_json::from_str(&ceph().rbd(&["status", "--format", "json", &image.name])).unwrap();
    let watcher = status["watchers"][0]["address"].as_str().unwrap().to_string();
    let blocklist = |args: &[&str]| ceph().tool("ceph", &[&["osd", "blocklist"], args].concat());
    assert!(blocklist(&["add", &watcher]).status.success());
    ceph().rbd(&["rm", "--no-progress", &image.name]);
    assert!(queue.write_at(4096, &pattern(2, 4096)).is_err(), "a write to the deleted image fails");
    let mut back = vec![0u8; 4096];
    assert!(queue.read_at(0, &mut back).is_err(), "so does a read");

    let read_only = ClientOptions { read_only: true, ..Default::default() };
    let mut other = vsd_bench::Client::connect(&dir.path("n.sock"), read_only).unwrap();
    let mut other = other.take_queue(0).unwrap();
    other.read_at(0, &mut back).unwrap();
    assert!(daemon.is_running(), "the daemon survives");
    blocklist(&["rm", &watcher]);
}

/// The cluster that requires cephx keys, for one test at a time: one of
/// them restarts its OSD.
fn cephx() -> (&'static Cluster, MutexGuard<'static, ()>) {
    static TURN: Mutex<()> = Mutex::new(());
    let turn = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    (Cluster::cephx(), turn)
}

/// With cephx the key comes from `--object secret` or QMP `object-add`,
/// as QEMU takes it (qemu-img opens the image with the same secret); no
/// key, a wrong key or an unknown user is one clear error line.
#[test]
fn cephx_keys_come_from_secret_objects() {
    let (cluster, _turn) = cephx();
    let dir = Scratch::new("rbd-cephx");
    let image = cluster.image("cephx", 8 * MIB);
    // A conf that names the monitor only: the key can come from nowhere but the secret.
    let conf = dir.path("client.conf");
    let cluster_conf = std::fs::read_to_string(&cluster.conf).unwrap();
    let mon_host = cluster_conf.lines().find(|line| line.starts_with("mon_host")).unwrap();
    std::fs::write(&conf, format!("[global]\n{mon_host}\n")).unwrap();
    let key_file = cluster.file("admin.key");
    let secret = format!("secret,id=k0,file={},format=base64", key_file.display());
    let node =
        |extra: &str| format!("driver=rbd,node-name=r0,pool=rbd,image={},conf={}{extra}", image.name, conf.display());

    let daemon = serve_with(&dir, &["--object", &secret], node(",key-secret=k0"), "", ",writable=on");
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    let data = pattern(42, 64 * 1024);
    queue.write_at(MIB, &data).unwrap();
    queue.flush().unwrap();
    assert!(image.export()[MIB as usize..][..data.len()] == data[..]);

    let mut qmp = QmpClient::connect(&dir.path("qmp.sock")).unwrap();
    let key = std::fs::read_to_string(&key_file).unwrap();
    qmp.execute("object-add", json!({ "qom-type": "secret", "id": "k1", "data": key.trim(), "format": "base64" }))
        .unwrap();
    let node_args = json!({
        "driver": "rbd", "node-name": "q", "pool": "rbd", "image": image.name, "conf": conf, "key-secret": "k1",
        "read-only": true,
    });
    qmp.execute("blockdev-add", node_args).unwrap();
    // The node took the key when it opened.
    qmp.execute("object-del", json!({ "id": "k1" })).unwrap();
    let nodes = qmp.execute("query-named-block-nodes", json!({})).unwrap();
    let listed = nodes.as_array().unwrap().iter().find(|n| n["node-name"] == "q").unwrap().clone();
    assert_eq!(listed["image"]["virtual-size"], 8 * MIB);
    let again = qmp.execute("object-del", json!({ "id": "k1" })).unwrap_err();
    assert!(again.to_string().contains("object 'k1' not found"), "{again}");
    drop(qmp);
    drop(client);
    daemon.stop();

    // QEMU reads the same secret the same way.
    let copy = dir.path("copy.raw");
    let opts = format!("driver=rbd,pool=rbd,image={},conf={},key-secret=k0", image.name, conf.display());
    let out =
        run("qemu-img", &["convert", "--object", &secret, "--image-opts", &opts, "-O", "raw", copy.to_str().unwrap()]);
    assert!(out.status.success(), "qemu-img: {}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::read(&copy).unwrap()[MIB as usize..][..data.len()] == data[..]);

    let wrong_key = String::from_utf8(run("ceph-authtool", &["--gen-print-key"]).stdout).unwrap();
    let wrong = format!("secret,id=k0,data={},format=base64", wrong_key.trim());
    let socket = dir.path("never.sock");
    for (objects, extra, expected) in [
        (vec![], String::new(), "error connecting (as client.admin): Permission denied"),
        (vec!["--object", &wrong], ",key-secret=k0".into(), "error connecting (as client.admin): Permission denied"),
        (vec!["--object", &secret], ",key-secret=k0,user=nobody".into(), "error connecting (as client.nobody)"),
    ] {
        let export = format!("type=vhost-user-blk,id=e0,node-name=r0,addr.type=unix,addr.path={}", socket.display());
        let node = node(&extra);
        let stderr = vsd_fails(&[objects, vec!["--blockdev", &node, "--export", &export]].concat());
        assert!(stderr.contains(expected), "{extra}: {stderr}");
        assert!(!socket.exists());
    }
}

/// The OSD is stopped under I/O and started again a few seconds later
/// (its objects are on bluestore, so they survive): requests wait, then
/// complete, every write reads back through vsd and from `rbd export`, and
/// vsd keeps running.
#[test]
fn requests_complete_across_an_osd_restart() {
    let (cluster, _turn) = cephx();
    let dir = Scratch::new("rbd-osd-restart");
    let image = cluster.image("restart", 64 * MIB);
    let mut daemon = serve(&dir, image.node("r0"), ",writable=on");
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    queue.set_timeout(Duration::from_secs(120));
    const SLOTS: u64 = 256;
    let slot = |round: u64| (round % SLOTS) * 256 * 1024;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let done = std::sync::Arc::new(AtomicU64::new(0));
    let io = std::thread::spawn({
        let (stop, done) = (stop.clone(), done.clone());
        move || {
            let mut rounds = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let data = pattern(rounds, 64 * 1024);
                queue.write_at(slot(rounds), &data).unwrap();
                let mut back = vec![0; data.len()];
                queue.read_at(slot(rounds), &mut back).unwrap();
                assert!(back == data, "round {rounds}");
                rounds += 1;
                done.store(rounds, Ordering::Relaxed);
            }
            queue.flush().unwrap();
            (queue, rounds)
        }
    });
    std::thread::sleep(Duration::from_secs(1));
    let osd = cluster.osd_pid();
    // SAFETY: a signal to the test cluster's OSD, a process of this user.
    unsafe { libc::kill(osd, libc::SIGTERM) };
    // SAFETY: signal 0 only asks whether the process is still there.
    while unsafe { libc::kill(osd, 0) } == 0 {
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(3));
    let conf = cluster.conf.to_str().unwrap();
    let restarted_at = done.load(Ordering::Relaxed);
    let started = Command::new("ceph-osd").args(["-c", conf, "-i", "0"]).stderr(Stdio::null()).status().unwrap();
    assert!(started.success());
    // I/O goes on after the restart, until every slot was written (a busy
    // machine brings the OSD back in seconds or in a minute).
    let enough = (restarted_at + 32).max(SLOTS + 1);
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while done.load(Ordering::Relaxed) < enough && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::Relaxed);
    let (mut queue, rounds) = io.join().expect("every request completed with its data");
    assert!(rounds >= enough, "I/O went on after the restart ({restarted_at} rounds before it, {rounds} in all)");
    assert!(daemon.is_running());

    // The last write to each slot, through vsd and in the cluster.
    let last = |s: u64| (0..rounds).rev().find(|r| r % SLOTS == s).unwrap();
    let mut back = vec![0; 64 * 1024];
    for s in 0..SLOTS {
        queue.read_at(slot(s), &mut back).unwrap();
        assert!(back == pattern(last(s), back.len()), "slot {s}");
    }
    drop(queue);
    drop(client);
    daemon.stop();
    let exported = image.export();
    for s in 0..SLOTS {
        assert!(exported[slot(s) as usize..][..back.len()] == pattern(last(s), back.len())[..], "slot {s}");
    }
}

/// librados' pool of threads that dispatch and complete librbd's requests
/// has one thread when vsd runs on one CPU (two could not run at once and
/// would only hand requests to each other), librados' two with more, and
/// what ceph.conf says whenever it says.
#[test]
fn the_librados_pool_fits_the_cpus_unless_ceph_conf_sizes_it() {
    let dir = Scratch::new("rbd-pool");
    let image = ceph().image("pool", 16 * MIB);
    let sized_conf = dir.path("sized.conf");
    let conf = std::fs::read_to_string(&ceph().conf).unwrap();
    std::fs::write(&sized_conf, conf.replacen("[global]\n", "[global]\nlibrados_thread_count = 3\n", 1)).unwrap();
    let sized = format!("driver=rbd,node-name=r0,pool=rbd,image={},conf={}", image.name, sized_conf.display());
    let cpus = vsd_sys::allowed_cpus().unwrap();
    for (node, on, expected) in [
        (image.node("r0"), &cpus[..1], 1),
        (sized, &cpus[..1], 3),
        (image.node("r0"), &cpus[..], if cpus.len() > 1 { 2 } else { 1 }),
    ] {
        // The daemon's threads inherit this thread's CPUs.
        vsd_sys::set_thread_affinity(on).unwrap();
        let daemon = serve(&dir, node.clone(), "");
        vsd_sys::set_thread_affinity(&cpus).unwrap();
        let pool = std::fs::read_dir(format!("/proc/{}/task", daemon.pid()))
            .unwrap()
            .filter(|task| {
                let comm = std::fs::read_to_string(task.as_ref().unwrap().path().join("comm"));
                comm.is_ok_and(|name| name.trim() == "io_context_pool")
            })
            .count();
        daemon.stop();
        assert_eq!(pool, expected, "{node} on CPUs {on:?}");
    }
}
