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
    // Joined before object-del answers; the kernel may list the task a
    // moment longer.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !threads(&daemon, "vsd-io-io1").is_empty() {
        assert!(std::time::Instant::now() < deadline, "the deleted thread did not end");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(daemon.is_running());
}

/// CPU time (user and system, in clock ticks) of the daemon's thread named `name`.
fn cpu_ticks(daemon: &Daemon, name: &str) -> u64 {
    for task in std::fs::read_dir(format!("/proc/{}/task", daemon.pid())).unwrap() {
        let task = task.unwrap().path();
        if std::fs::read_to_string(task.join("comm")).is_ok_and(|comm| comm.trim() == name) {
            let stat = std::fs::read_to_string(task.join("stat")).unwrap();
            // The fields after the name, which is in parentheses: utime and stime are 14 and 15.
            let fields: Vec<&str> = stat.rsplit_once(") ").unwrap().1.split(' ').collect();
            return fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        }
    }
    panic!("no thread {name}");
}

/// Reads on `queues` until thread `busy` has run for 5 clock ticks more;
/// returns how many more `idle` ran meanwhile.
fn drive(daemon: &Daemon, queues: &mut [vsd_bench::Queue], busy: &str, idle: &str) -> u64 {
    let (busy_from, idle_from) = (cpu_ticks(daemon, busy), cpu_ticks(daemon, idle));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut buf = [0u8; 512];
    while cpu_ticks(daemon, busy) < busy_from + 5 {
        assert!(std::time::Instant::now() < deadline, "{busy} did not serve the reads");
        for _ in 0..1000 {
            for queue in queues.iter_mut() {
                queue.read_at(0, &mut buf).unwrap();
            }
        }
    }
    cpu_ticks(daemon, idle) - idle_from
}

#[test]
fn iothread_vq_mapping_puts_each_queue_on_its_io_thread() {
    let dir = Scratch::new("iothread-vq-mapping");
    let args: Vec<String> = [
        "--object",
        "iothread,id=io0,poll-max-ns=0",
        "--object",
        "iothread,id=io1,poll-max-ns=0",
        "--blockdev",
        "driver=null-co,node-name=n,size=64M,read-zeroes=on",
        "--chardev",
        &format!("socket,id=m,path={},server=on,wait=off", dir.path("qmp.sock").display()),
        "--monitor",
        "chardev=m",
    ]
    .map(String::from)
    .into();
    let daemon = Daemon::vsd(&dir, &args);
    let mut qmp = QmpClient::connect(&dir.path("qmp.sock")).unwrap();
    qmp.execute(
        "block-export-add",
        json!({ "type": "vhost-user-blk", "id": "e", "node-name": "n", "num-queues": 4, "writable": true,
                "iothread-vq-mapping": [{ "iothread": "io0", "vqs": [0, 3] }, { "iothread": "io1", "vqs": [2, 1] }],
                "addr": { "type": "unix", "path": dir.path("e.sock") } }),
    )
    .unwrap();
    let mut client =
        Client::connect(&dir.path("e.sock"), ClientOptions { num_queues: 4, ..Default::default() }).unwrap();
    let mut queues = client.take_queues();
    assert!(threads(&daemon, "vsd-e-q").is_empty(), "no queue threads of the export's own");
    let (mut on_io0, mut on_io1): (Vec<_>, Vec<_>) = queues.drain(..).enumerate().partition(|(q, _)| q % 3 == 0);
    let mut on_io0: Vec<_> = on_io0.drain(..).map(|(_, queue)| queue).collect();
    let mut on_io1: Vec<_> = on_io1.drain(..).map(|(_, queue)| queue).collect();
    let idle = drive(&daemon, &mut on_io0, "vsd-io-io0", "vsd-io-io1");
    assert!(idle <= 1, "queues 0 and 3 are io0's: io1 ran {idle} ticks meanwhile");
    let idle = drive(&daemon, &mut on_io1, "vsd-io-io1", "vsd-io-io0");
    assert!(idle <= 1, "queues 1 and 2 are io1's: io0 ran {idle} ticks meanwhile");
}

#[test]
fn mistakes_are_one_error_line() {
    let dir = Scratch::new("iothreads-errors");
    let image = dir.image("d.raw", MIB);
    let node = format!("driver=file,node-name=dn,filename={}", image.display());
    for (objects, extra, expected) in [
        (vec![], ",iothread=nope", "iothread \"nope\" not found"),
        (vec!["iothread,id=io0"], ",iothread=io0,num-threads=1", "num-threads cannot be set with I/O threads"),
        (vec!["iothread,id=io0"], ",iothread-vq-mapping.0.iothread=nope", "iothread \"nope\" not found"),
        (
            vec!["iothread,id=io0"],
            ",num-queues=2,iothread-vq-mapping.0.iothread=io0,iothread-vq-mapping.0.vqs.0=1",
            "missing vq 0 IOThread assignment in iothread-vq-mapping",
        ),
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
