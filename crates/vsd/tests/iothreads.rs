//! Exports sharing an I/O thread (`--object iothread`, `iothread=` on the
//! export, QMP `object-add`/`object-del`): one thread serves the queues
//! of several exports, each export's data is right while the others run,
//! an export leaves the thread without stopping the others, and mistakes
//! are QEMU's errors.

mod common;

use std::path::Path;

use common::{Daemon, Scratch, pattern, vsd_fails};
use serde_json::json;
use vsd_bench::{Client, ClientOptions};
use vsd_control::client::QmpClient;

const MIB: u64 = 1 << 20;

fn export(dir: &Scratch, id: &str, extra: &str) -> String {
    format!(
        "type=vhost-user-blk,id={id},node-name={id}n,addr.type=unix,addr.path={},writable=on,num-queues=2{extra}",
        dir.path(&format!("{id}.sock")).display()
    )
}

/// The daemon's threads whose names start with `prefix`.
fn threads(daemon: &Daemon, prefix: &str) -> Vec<String> {
    let mut names = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{}/task", daemon.pid())).unwrap() {
        if let Ok(name) = std::fs::read_to_string(task.unwrap().path().join("comm"))
            && name.starts_with(prefix)
        {
            names.push(name.trim().to_string());
        }
    }
    names
}

/// Each queue of `client` writes its own blocks and reads them back,
/// `rounds` times; the blocks depend on `seed`.
fn write_and_verify(client: &mut Client, seed: u64, rounds: u64) {
    let queues = client.take_queues();
    let workers: Vec<_> = queues
        .into_iter()
        .enumerate()
        .map(|(q, mut queue)| {
            std::thread::spawn(move || {
                for round in 0..rounds {
                    let offset = (q as u64 * 8 + round % 8) * MIB;
                    let data = pattern(seed * 1000 + q as u64 * 100 + round, 64 * 1024);
                    queue.write_at(offset, &data).unwrap();
                    let mut back = vec![0; data.len()];
                    queue.read_at(offset, &mut back).unwrap();
                    assert!(back == data, "queue {q} round {round}");
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
}

#[test]
fn exports_share_an_io_thread_and_leave_it_without_stopping_the_others() {
    let dir = Scratch::new("iothreads");
    let mut args: Vec<String> = vec!["--object".into(), "iothread,id=io0,poll-max-ns=20000".into()];
    for id in ["a", "b"] {
        let image = dir.image(&format!("{id}.raw"), 32 * MIB);
        args.extend([
            "--blockdev".into(),
            format!("driver=file,node-name={id}n,filename={}", image.display()),
            "--export".into(),
            export(&dir, id, ",iothread=io0"),
        ]);
    }
    args.extend([
        "--chardev".into(),
        format!("socket,id=m,path={},server=on,wait=off", dir.path("qmp.sock").display()),
        "--monitor".into(),
        "chardev=m".into(),
    ]);
    let mut daemon = Daemon::vsd(&dir, &args);
    let options = || ClientOptions { num_queues: 2, ..Default::default() };
    let mut a = Client::connect(&dir.path("a.sock"), options()).unwrap();
    let mut b = Client::connect(&dir.path("b.sock"), options()).unwrap();
    let busy_b = std::thread::spawn(move || {
        write_and_verify(&mut b, 2, 400);
        b
    });
    write_and_verify(&mut a, 1, 200);
    let b = busy_b.join().unwrap();
    assert_eq!(threads(&daemon, "vsd-io-io0"), ["vsd-io-io0"], "one thread serves both exports");
    assert!(threads(&daemon, "vsd-a-q").is_empty() && threads(&daemon, "vsd-b-q").is_empty(), "no queue threads");

    // Export a leaves while b's client goes on; b's requests keep completing.
    let mut qmp = QmpClient::connect(&dir.path("qmp.sock")).unwrap();
    let busy_b = std::thread::spawn(move || {
        let mut b = b;
        write_and_verify(&mut b, 3, 400);
    });
    drop(a);
    qmp.execute("block-export-del", json!({ "id": "a" })).unwrap();
    busy_b.join().unwrap();
    let in_use = qmp.execute("object-del", json!({ "id": "io0" })).unwrap_err();
    assert!(in_use.to_string().contains("object 'io0' is in use, can not be deleted"), "{in_use}");

    // A new export joins the thread over QMP, and a second thread comes and goes.
    qmp.execute("object-add", json!({ "qom-type": "iothread", "id": "io1" })).unwrap();
    let c = dir.image("c.raw", 32 * MIB);
    qmp.execute("blockdev-add", json!({ "driver": "file", "node-name": "cn", "filename": c })).unwrap();
    qmp.execute(
        "block-export-add",
        json!({ "type": "vhost-user-blk", "id": "c", "node-name": "cn", "writable": true, "num-queues": 2,
                "iothread": "io1", "addr": { "type": "unix", "path": dir.path("c.sock") } }),
    )
    .unwrap();
    let mut c = Client::connect(&dir.path("c.sock"), options()).unwrap();
    write_and_verify(&mut c, 4, 100);
    assert_eq!(threads(&daemon, "vsd-io-io1"), ["vsd-io-io1"]);
    drop(c);
    qmp.execute("block-export-del", json!({ "id": "c" })).unwrap();
    // The export lets go of the thread once its last request is done.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while qmp.execute("object-del", json!({ "id": "io1" })).is_err() {
        assert!(std::time::Instant::now() < deadline, "io1 still in use");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(threads(&daemon, "vsd-io-io1").is_empty(), "the deleted thread ended");
    assert!(daemon.is_running());
}

#[test]
fn mistakes_are_one_error_line() {
    let dir = Scratch::new("iothreads-errors");
    let image = dir.image("d.raw", MIB);
    let node = format!("driver=file,node-name=dn,filename={}", image.display());
    for (objects, extra, expected) in [
        (vec![], ",iothread=nope", "iothread \"nope\" not found"),
        (vec!["iothread,id=io0"], ",iothread=io0,num-threads=1", "without num-threads, cpu-affinity or poll-us"),
        (vec!["iothread,id=io0,cpu-affinity=999"], "", "CPU 999 is not available"),
        (vec!["iothread,id=io0", "iothread,id=io0"], "", "attempt to add duplicate property 'io0'"),
        (vec!["iothread,id=io0,poll-max-ns=-1"], "", "poll-max-ns"),
    ] {
        let socket = dir.path("never.sock");
        let export =
            format!("type=vhost-user-blk,id=d,node-name=dn,addr.type=unix,addr.path={}{extra}", socket.display());
        let mut args: Vec<&str> = objects.iter().flat_map(|object| ["--object", object]).collect();
        args.extend(["--blockdev", &node, "--export", &export]);
        let stderr = vsd_fails(&args);
        assert!(stderr.contains(expected), "{objects:?} {extra}: {stderr}");
        assert!(!Path::new(&socket).exists());
    }
}
