//! A back-end that stops answering (an NBD server frozen with SIGSTOP
//! under I/O) harms nobody else: QMP answers, an export on a file serves
//! on, and SIGTERM ends the daemon in bounded time, the frozen export's
//! requests abandoned and named.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::qmp::Qmp;
use common::{Daemon, Scratch, VSD};
use serde_json::json;

/// vsd-bench, built beside vsd, driving `socket` for `seconds`.
fn load(socket: &Path, rw: &str, seconds: u32) -> Child {
    let bench = Path::new(VSD).with_file_name("vsd-bench");
    Command::new(bench)
        .args(["--socket", &socket.display().to_string(), "--rw", rw, "--iodepth", "8"])
        .args(["--seconds", &seconds.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("vsd-bench is built beside vsd (cargo build --workspace)")
}

fn signal(pid: u32, signal: i32) {
    // SAFETY: kill() with the pid of a child we spawned and have not reaped.
    assert_eq!(unsafe { libc::kill(pid as i32, signal) }, 0);
}

#[test]
fn a_frozen_nbd_server_stalls_only_its_own_export() {
    let dir = Scratch::new("hung-nbd");
    let remote = dir.image("remote.img", 64 << 20);
    let local = dir.image("local.img", 64 << 20);
    let nbd = dir.path("nbd.sock");
    let server = Daemon::qsd(
        &dir,
        &[
            "--blockdev".into(),
            format!("driver=file,node-name=f0,filename={}", remote.display()),
            "--nbd-server".into(),
            format!("addr.type=unix,addr.path={}", nbd.display()),
            "--export".into(),
            "type=nbd,id=e0,node-name=f0,name=disk,writable=on".into(),
        ],
    );
    let (remote_sock, local_sock, qmp) = (dir.path("remote.sock"), dir.path("local.sock"), dir.path("qmp.sock"));
    let mut args = vec![
        "--blockdev".into(),
        format!("driver=nbd,node-name=n0,server.type=unix,server.path={},export=disk", nbd.display()),
        "--blockdev".into(),
        "raw,node-name=r0,file=n0".into(),
        "--export".into(),
        format!("vhost-user-blk,id=remote,node-name=r0,addr.type=unix,addr.path={},writable=on", remote_sock.display()),
        "--blockdev".into(),
        format!("file,node-name=l0,filename={}", local.display()),
        "--export".into(),
        format!("vhost-user-blk,id=local,node-name=l0,addr.type=unix,addr.path={},writable=on", local_sock.display()),
    ];
    args.extend(common::monitor(&qmp));
    let pidfile = dir.path("vsd.pid");
    // Its error stream is the test's to read.
    let mut daemon = Command::new(VSD)
        .args(common::sandboxed(&args))
        .arg("--pidfile")
        .arg(&pidfile)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while !pidfile.exists() {
        assert!(
            daemon.try_wait().unwrap().is_none() && started.elapsed() < Duration::from_secs(10),
            "vsd did not start"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut client = Qmp::connect(&qmp);

    let mut stuck = load(&remote_sock, "randwrite", 60);
    std::thread::sleep(Duration::from_secs(1));
    signal(server.pid(), libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(500));

    let asked = Instant::now();
    client.ok("query-version", json!({}));
    let stats = client.ok("query-blockstats", json!({}));
    assert!(asked.elapsed() < Duration::from_secs(1), "QMP took {:?} with the NBD server frozen", asked.elapsed());
    assert_eq!(stats.as_array().unwrap().len(), 2, "{stats}");

    let served = load(&local_sock, "randread", 2).wait_with_output().unwrap();
    let report = String::from_utf8_lossy(&served.stdout);
    assert!(served.status.success(), "the file's export: {report}{}", String::from_utf8_lossy(&served.stderr));
    let iops: f64 = report
        .lines()
        .find_map(|l| l.trim().strip_prefix("IOPS"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no IOPS in {report}"));
    assert!(iops > 100.0, "the file's export served {iops} IOPS beside the frozen one");

    let stopping = Instant::now();
    signal(daemon.id(), libc::SIGTERM);
    let status = loop {
        if let Some(status) = daemon.try_wait().unwrap() {
            break status;
        }
        assert!(stopping.elapsed() < Duration::from_secs(10), "SIGTERM did not end vsd within 10 s");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut log = String::new();
    std::io::Read::read_to_string(&mut daemon.stderr.take().unwrap(), &mut log).unwrap();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("export 'remote' still had requests in flight"), "{log}");
    assert!(!log.contains("'local'"), "{log}");

    signal(server.pid(), libc::SIGCONT);
    let _ = stuck.kill();
    let _ = stuck.wait();
}
