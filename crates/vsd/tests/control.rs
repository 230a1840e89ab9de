//! The QMP socket, driven by QEMU's own Python client (`qemu.qmp`, through
//! scripts/qmp.py) and by socat; statistics checked against the I/O a
//! libblkio client did; Prometheus metrics read by Prometheus' own parser.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Daemon, Scratch, VSD, pattern, run};
use serde_json::{Value, json};
use vsd_bench::ClientOptions;
use vsd_control::client::QmpClient;

const MIB: u64 = 1 << 20;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// vsd serving a null-co node on `exp0`, with a QMP monitor, and `extra`
/// arguments.
fn daemon_with_monitor(dir: &Scratch, extra: Vec<String>) -> (Daemon, PathBuf) {
    let qmp = dir.path("qmp.sock");
    let mut args: Vec<String> = vec![
        "--blockdev".into(),
        "driver=null-co,node-name=null0,size=64M,read-zeroes=on".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=exp0,node-name=null0,addr.type=unix,addr.path={}",
            dir.path("exp0.sock").display()
        ),
        "--chardev".into(),
        format!("socket,id=qmp0,path={},server=on,wait=off", qmp.display()),
        "--monitor".into(),
        "chardev=qmp0".into(),
    ];
    args.extend(extra);
    (Daemon::vsd(dir, &args), qmp)
}

/// A file node `f1` on `image`, a raw node `r1` over it, and a writable
/// export `exp1` of it on `socket`, with `export_opts` (",key=value").
fn raw_export(image: &Path, socket: &Path, export_opts: &str) -> Vec<String> {
    vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f1,filename={}", image.display()),
        "--blockdev".into(),
        "driver=raw,node-name=r1,file=f1".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=exp1,node-name=r1,addr.type=unix,addr.path={},writable=on{export_opts}",
            socket.display()
        ),
    ]
}

/// One command through QEMU's Python client; the reply (`return` or `error`).
fn qmp(socket: &Path, command: &str, args: Value) -> Value {
    qmp_with(socket, command, args, None).0
}

/// As [`qmp`], also waiting for `event` after the reply.
fn qmp_with(socket: &Path, command: &str, args: Value, event: Option<&str>) -> (Value, Option<Value>) {
    let mut cmd = Command::new("python3");
    cmd.arg(repo().join("scripts/qmp.py")).arg(socket).arg(command).arg(args.to_string());
    if let Some(event) = event {
        cmd.args(["--event", event]);
    }
    let out = cmd.output().expect("run python3 scripts/qmp.py");
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines().map(|l| serde_json::from_str::<Value>(l).unwrap());
    let reply = lines.next().unwrap_or_else(|| {
        panic!(
            "qmp.py {command} failed (is the qemu.qmp package installed? scripts/setup.sh installs it): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    // A QMP error is the script's exit status 1, so that shell scripts stop on it.
    let expected = if reply.get("error").is_some() { Some(1) } else { Some(0) };
    assert_eq!(out.status.code(), expected, "qmp.py {command}: {reply}");
    (reply, lines.next())
}

fn returned(reply: &Value) -> &Value {
    reply.get("return").unwrap_or_else(|| panic!("expected success, got {reply}"))
}

fn error_desc(reply: &Value) -> String {
    reply["error"]["desc"].as_str().unwrap_or_else(|| panic!("expected an error, got {reply}")).to_string()
}

/// The `query-blockstats` entry of export `id`.
fn export_stats(client: &mut QmpClient, id: &str) -> Value {
    let all = client.execute("query-blockstats", json!({})).unwrap();
    all.as_array().unwrap().iter().find(|e| e["qdev"] == id).cloned().unwrap_or_else(|| panic!("no stats for {id}"))
}

#[test]
fn qmp_adds_serves_and_removes_nodes_and_exports() {
    let dir = Scratch::new("qmp-live");
    let (mut daemon, qmp_sock) = daemon_with_monitor(&dir, Vec::new());

    let version = qmp(&qmp_sock, "query-version", json!({}));
    assert!(returned(&version)["package"].as_str().unwrap().starts_with("vsd "));
    let commands = qmp(&qmp_sock, "query-commands", json!({}));
    let names: Vec<&str> =
        returned(&commands).as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
    for name in ["blockdev-add", "block-export-del", "query-blockstats", "block_resize", "quit"] {
        assert!(names.contains(&name), "query-commands lacks {name}: {names:?}");
    }

    // A file and a raw node over it, then an export, all while running.
    let image = dir.image("disk.img", 32 * MIB);
    let file = json!({ "driver": "file", "node-name": "file1", "filename": image });
    returned(&qmp(&qmp_sock, "blockdev-add", file));
    returned(&qmp(&qmp_sock, "blockdev-add", json!({ "driver": "raw", "node-name": "disk1", "file": "file1" })));
    let duplicate = qmp(&qmp_sock, "blockdev-add", json!({ "driver": "null-co", "node-name": "disk1" }));
    assert!(error_desc(&duplicate).contains("already exists"));
    let socket = dir.path("exp1.sock");
    let export = json!({
        "type": "vhost-user-blk", "id": "exp1", "node-name": "disk1",
        "addr": { "type": "unix", "path": socket }, "writable": true, "num-queues": 2,
    });
    returned(&qmp(&qmp_sock, "block-export-add", export.clone()));
    assert!(error_desc(&qmp(&qmp_sock, "block-export-add", export)).contains("already in use"));

    let exports = qmp(&qmp_sock, "query-block-exports", json!({}));
    let ids: Vec<&str> = returned(&exports).as_array().unwrap().iter().map(|e| e["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["exp0", "exp1"]);
    let nodes = qmp(&qmp_sock, "query-named-block-nodes", json!({}));
    let raw = returned(&nodes).as_array().unwrap().iter().find(|n| n["node-name"] == "disk1").unwrap().clone();
    assert_eq!((raw["drv"].as_str(), raw["children"]["file"].as_str()), (Some("raw"), Some("file1")));
    assert_eq!(raw["image"]["virtual-size"], 32 * MIB);

    // Data written through the new export reaches the image.
    let mut client = vsd_bench::Client::connect(&socket, ClientOptions::default()).unwrap();
    let mut queue = client.take_queue(0).unwrap();
    let data = pattern(7, 64 * 1024);
    queue.write_at(MIB, &data).unwrap();
    queue.flush().unwrap();
    let mut back = vec![0; 3 * 4096];
    queue.read_at(MIB, &mut back).unwrap();
    assert_eq!(&std::fs::read(&image).unwrap()[MIB as usize..][..data.len()], &data[..]);

    // Its statistics are exactly what this client did.
    let stats = qmp(&qmp_sock, "query-blockstats", json!({}));
    let exp1 = returned(&stats).as_array().unwrap().iter().find(|e| e["qdev"] == "exp1").unwrap().clone();
    let counts = &exp1["stats"];
    assert_eq!((counts["wr_operations"].as_u64(), counts["wr_bytes"].as_u64()), (Some(1), Some(64 * 1024)));
    assert_eq!((counts["rd_operations"].as_u64(), counts["rd_bytes"].as_u64()), (Some(1), Some(3 * 4096)));
    assert_eq!(counts["flush_operations"], 1);

    // Resized while running: the next front-end sees the new capacity.
    drop((queue, client));
    returned(&qmp(&qmp_sock, "block_resize", json!({ "node-name": "disk1", "size": 40 * MIB })));
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 40 * MIB);
    let mut client = vsd_bench::Client::connect(&socket, ClientOptions::default()).unwrap();
    assert_eq!(client.capacity().unwrap(), 40 * MIB);
    let mut queue = client.take_queue(0).unwrap();
    queue.write_at(36 * MIB, &data).unwrap();

    // Nodes in use and exports with a front-end are not removed.
    let busy = qmp(&qmp_sock, "blockdev-del", json!({ "node-name": "file1" }));
    assert_eq!(error_desc(&busy), "Block device file1 is in use", "QEMU's words for a file child");
    assert!(
        error_desc(&qmp(&qmp_sock, "blockdev-del", json!({ "node-name": "disk1" }))).contains("exported by 'exp1'")
    );
    let busy = qmp(&qmp_sock, "block-export-del", json!({ "id": "exp1" }));
    assert!(error_desc(&busy).contains("still in use"), "{busy}");

    // mode=hard cuts the front-end off; the event follows.
    let (reply, event) =
        qmp_with(&qmp_sock, "block-export-del", json!({ "id": "exp1", "mode": "hard" }), Some("BLOCK_EXPORT_DELETED"));
    returned(&reply);
    let event = event.expect("BLOCK_EXPORT_DELETED");
    assert_eq!(event["data"]["id"], "exp1");
    assert!(event["timestamp"]["seconds"].as_u64().unwrap() > 0);
    assert!(!socket.exists(), "the export's socket is removed");
    queue.set_timeout(Duration::from_secs(5));
    assert!(queue.read_at(0, &mut vec![0; 4096]).is_err(), "the cut-off front-end gets no more service");
    drop((queue, client));

    returned(&qmp(&qmp_sock, "blockdev-del", json!({ "node-name": "disk1" })));
    returned(&qmp(&qmp_sock, "blockdev-del", json!({ "node-name": "file1" })));
    let missing = qmp(&qmp_sock, "blockdev-del", json!({ "node-name": "file1" }));
    assert!(error_desc(&missing).contains("Failed to find node"));
    let missing = qmp(&qmp_sock, "block-export-del", json!({ "id": "nope" }));
    assert!(error_desc(&missing).contains("not found"));

    // An idle export goes in safe mode.
    returned(&qmp(&qmp_sock, "block-export-del", json!({ "id": "exp0" })));

    // quit answers, then the daemon stops cleanly and removes its sockets.
    returned(&qmp(&qmp_sock, "quit", json!({})));
    let deadline = Instant::now() + Duration::from_secs(10);
    while daemon.is_running() {
        assert!(Instant::now() < deadline, "vsd still running after quit");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!qmp_sock.exists(), "the QMP socket is removed at exit");
}

/// What a monitor answers to `garbage` sent after negotiation, then to a
/// query-version: (error replies, whether the query was answered), read
/// for at most 5 s while the client goes on writing.
fn answers_to(qmp_sock: &Path, garbage: &[u8]) -> (usize, bool) {
    let stream = UnixStream::connect(qmp_sock).unwrap();
    stream.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    writer.write_all(b"{\"execute\":\"qmp_capabilities\"}\n").unwrap();
    line.clear();
    reader.read_line(&mut line).unwrap();
    // The client writes everything before it reads, as a careless one does.
    let mut all = garbage.to_vec();
    all.extend_from_slice(b"{\"execute\":\"query-version\",\"id\":\"after\"}\n");
    writer.write_all(&all).unwrap();
    let (mut errors, deadline) = (0, Instant::now() + Duration::from_secs(5));
    while Instant::now() < deadline {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) => break,
            Ok(_) if line.contains("\"error\"") => errors += 1,
            Ok(_) if line.contains("\"after\"") => return (errors, true),
            _ => {}
        }
    }
    (errors, false)
}

/// A user's report: after a line of 200,000 'x', vsd answered every byte
/// with an error and dropped the client. Now, as qemu-storage-daemon, one
/// error per bad token, and the next command is answered at once.
#[test]
fn a_long_line_of_garbage_costs_one_error_and_the_connection_carries_on() {
    let dir = Scratch::new("qmp-long-garbage");
    let (_vsd, vsd_sock) = daemon_with_monitor(&dir, Vec::new());
    let qsd_sock = dir.path("qsd-qmp.sock");
    let qsd_args = [
        "--chardev".to_string(),
        format!("socket,id=m,path={},server=on,wait=off", qsd_sock.display()),
        "--monitor".into(),
        "chardev=m".into(),
        "--blockdev".into(),
        "driver=null-co,node-name=n,size=1048576".into(),
        "--export".into(),
        format!("type=vhost-user-blk,id=e,node-name=n,addr.type=unix,addr.path={}", dir.path("qsd.sock").display()),
    ];
    let _qsd = Daemon::qsd(&dir, &qsd_args);
    let mut long = vec![b'x'; 200_000];
    long.push(b'\n');
    let words = b"this is not json\n".repeat(2000);
    for (sock, who) in [(&vsd_sock, "vsd"), (&qsd_sock, "qemu-storage-daemon")] {
        assert_eq!(answers_to(sock, &long), (1, true), "{who}: 200,000 'x' then a command");
        assert_eq!(answers_to(sock, &words), (8000, true), "{who}: one error per word");
        assert!(answers_to(sock, b"\xff\xfe{\"a\": 1}\n").1, "{who}: invalid UTF-8");
    }
}

#[test]
fn qmp_answers_garbage_with_errors_and_keeps_serving() {
    let dir = Scratch::new("qmp-garbage");
    let (mut daemon, qmp_sock) = daemon_with_monitor(&dir, Vec::new());
    let stream = UnixStream::connect(&qmp_sock).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    let mut reply = |text: &[u8]| -> Value {
        writer.write_all(text).unwrap();
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad reply line {line:?}: {e}"))
    };
    assert!(reply(b"").get("QMP").is_some(), "greeting first");
    let early = reply(b"{\"execute\":\"query-version\"}\n");
    assert_eq!(early["error"]["class"], "CommandNotFound");
    assert!(reply(b"{\"execute\":\"qmp_capabilities\"}\n").get("return").is_some());

    let huge = format!("{{\"execute\":\"query-version\",\"arguments\":{{\"x\":\"{}\"}}}}\n", "a".repeat(4 << 20));
    let cases: Vec<(&[u8], &str)> = vec![
        // An unfinished value gets no reply until it ends, here as bad JSON.
        (b"{\"execute\":\n}\n", "GenericError"),
        // One error per word, as QEMU's lexer gives them.
        (b"this is not json\n", "GenericError"),
        (b"", "GenericError"),
        (b"", "GenericError"),
        (b"", "GenericError"),
        (b"[1, 2, 3]\n", "GenericError"),
        (b"{\"execute\": 42}\n", "GenericError"),
        (b"{\"execute\": \"no-such-command\"}\n", "CommandNotFound"),
        (b"{\"execute\": \"blockdev-del\", \"arguments\": {\"node-name\": 7}}\n", "GenericError"),
        (b"{\"execute\": \"blockdev-del\", \"arguments\": []}\n", "GenericError"),
        (b"{\"execute\": \"query-blockstats\", \"arguments\": {\"bogus\": true}}\n", "GenericError"),
        (b"{\"execute\": \"block_resize\", \"arguments\": {\"node-name\": \"null0\", \"size\": -5}}\n", "GenericError"),
        (
            b"{\"execute\": \"blockdev-add\", \"arguments\": {\"driver\": \"nope\", \"node-name\": \"x\"}}\n",
            "GenericError",
        ),
        (huge.as_bytes(), "GenericError"),
        (b"\xff\xfe{\"execute\":\"query-version\"}\n", "GenericError"),
    ];
    for (input, class) in cases {
        let answer = reply(input);
        assert_eq!(
            answer["error"]["class"],
            class,
            "for {:?}: {answer}",
            String::from_utf8_lossy(&input[..input.len().min(80)])
        );
        let desc = answer["error"]["desc"].as_str().unwrap();
        assert!(!desc.is_empty());
    }
    // Still answering on the same connection, and the daemon still serves.
    let version = reply(b"{\"execute\":\"query-version\",\"id\":\"after\"}");
    assert_eq!(version["id"], "after");
    assert!(version["return"]["package"].is_string());
    assert!(daemon.is_running());

    // socat, as an operator would use it: two commands on one line.
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "printf '%s' '{{\"execute\":\"qmp_capabilities\"}}{{\"execute\":\"query-block-exports\"}}' | socat -t 2 - UNIX-CONNECT:{}",
            qmp_sock.display()
        ))
        .output()
        .expect("run socat");
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3, "greeting and two replies: {text}");
    assert_eq!(lines[2]["return"][0]["id"], "exp0");
}

#[test]
fn statistics_count_what_a_client_did_and_time_every_stage() {
    let dir = Scratch::new("qmp-stats");
    let image = dir.image("disk.img", 16 * MIB);
    let metrics_port = free_port();
    // Without polling, every request of this one-at-a-time client comes
    // with a kick, which the event counts below check.
    let mut extra = raw_export(&image, &dir.path("exp1.sock"), ",poll-us=0");
    extra.extend(["--metrics".into(), format!("127.0.0.1:{metrics_port}")]);
    let (_daemon, qmp_sock) = daemon_with_monitor(&dir, extra);
    let mut qmp = QmpClient::connect(&qmp_sock).unwrap();
    let boundaries = json!({ "id": "exp1", "boundaries": [10_000, 100_000, 1_000_000] });
    qmp.execute("block-latency-histogram-set", boundaries).unwrap();

    let (reads, writes) = (300u64, 200u64);
    let mut client = vsd_bench::Client::connect(&dir.path("exp1.sock"), ClientOptions::default()).unwrap();
    let mut queue = client.take_queue(0).unwrap();
    let data = pattern(1, 4096);
    for i in 0..writes {
        queue.write_at(i * 4096, &data).unwrap();
    }
    queue.flush().unwrap();
    let mut buf = vec![0; 4096];
    for i in 0..reads {
        queue.read_at(i * 4096, &mut buf).unwrap();
    }
    assert!(queue.read_at(16 * MIB, &mut buf).is_err(), "past the end");

    let entry = export_stats(&mut qmp, "exp1");
    let stats = &entry["stats"];
    assert_eq!(entry["node-name"], "r1");
    assert_eq!(stats["rd_operations"], reads);
    assert_eq!(stats["rd_bytes"], reads * 4096);
    assert_eq!(stats["wr_operations"], writes);
    assert_eq!(stats["wr_bytes"], writes * 4096);
    assert_eq!(stats["flush_operations"], 1);
    assert!(stats["rd_total_time_ns"].as_u64().unwrap() > 0);
    let bins: u64 = stats["rd_latency_histogram"]["bins"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap()).sum();
    assert_eq!(bins, reads, "every read lands in one bin");
    assert_eq!(stats["rd_latency_histogram"]["boundaries"], json!([10_000, 100_000, 1_000_000]));

    // Every request that reached the engine went through every stage, and
    // the stages add up to the total (they share timestamps), to the
    // nanosecond each histogram's sum is rounded to.
    let snapshot: vsd_trace::ExportSnapshot = serde_json::from_value(entry["x-vsd"].clone()).unwrap();
    let merged = snapshot.merged();
    let served = reads + writes + 1;
    assert_eq!(merged.total.count(), served);
    let mut stage_sum = 0;
    for stage in vsd_trace::Stage::ALL {
        assert_eq!(merged.stage(stage).count(), served, "{}", stage.label());
        stage_sum += merged.stage(stage).sum_ns();
    }
    let total = merged.total.sum_ns();
    assert!(stage_sum.abs_diff(total) <= 5, "stages add up to {stage_sum} ns, the total is {total} ns");
    assert_eq!(merged.events.requests, served + 1, "the out-of-range read was taken too");
    assert_eq!(merged.events.invalid, 1);
    assert!(merged.events.kicks >= served, "interrupt-mode client: a kick per request");
    // The client may catch a completion before it sleeps, and then asks
    // for no call (EVENT_IDX): at most one call per request.
    assert!(merged.events.calls > 0 && merged.events.calls <= merged.events.requests);
    // One io_uring_enter per request at qd1, except where reads and writes
    // complete inline (tmpfs, if the temporary directory is one); the
    // flush always goes through the ring.
    let entries = merged.events.kernel_entries;
    assert!((1..=2 * served).contains(&entries), "{entries} kernel entries for {served} requests");

    // Each node counts what it was sent: the raw node the export's valid
    // requests (the export counted them, kick to call), the file node
    // below it the same, one for one, timed from submission to completion.
    let all = qmp.execute("query-blockstats", json!({ "query-nodes": true })).unwrap();
    let export_ns = stats["rd_total_time_ns"].as_u64().unwrap();
    for name in ["r1", "f1"] {
        let node = all.as_array().unwrap().iter().find(|e| e["node-name"] == name && e.get("qdev").is_none());
        let node_stats = &node.unwrap_or_else(|| panic!("no entry for node {name}: {all}"))["stats"];
        for key in ["rd_operations", "rd_bytes", "wr_operations", "wr_bytes", "flush_operations"] {
            assert_eq!(node_stats[key], stats[key], "{name}: {key}");
        }
        assert_eq!(node_stats["failed_rd_operations"], 0, "{name}");
        let node_ns = node_stats["rd_total_time_ns"].as_u64().unwrap();
        match name {
            "r1" => assert_eq!(node_ns, export_ns),
            _ => assert!(node_ns > 0 && node_ns < export_ns, "{name}: {node_ns} ns of the export's {export_ns} ns"),
        }
    }

    // vsd stat prints the tables from the same figures.
    let out = Command::new(VSD).args(["stat", "--qmp"]).arg(&qmp_sock).args(["--export", "exp1"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for label in ["kick -> pop", "pop -> submit", "submit -> complete", "complete -> used", "used -> call", "kicks"] {
        assert!(text.contains(label), "vsd stat lacks {label}:\n{text}");
    }
    assert!(text.contains(&served.to_string()), "request count shown:\n{text}");

    // Prometheus' own parser reads the same counts.
    let script = format!(
        "import urllib.request, json\n\
         from prometheus_client.parser import text_string_to_metric_families as parse\n\
         text = urllib.request.urlopen('http://127.0.0.1:{metrics_port}/metrics').read().decode()\n\
         out = {{}}\n\
         for family in parse(text):\n\
         \x20   for s in family.samples:\n\
         \x20       if s.labels.get('export') == 'exp1' and 'queue' not in s.labels:\n\
         \x20           out[s.name + '/' + s.labels.get('op', s.labels.get('stage', '')) + '/' + s.labels.get('le', '')] = s.value\n\
         print(json.dumps(out))\n"
    );
    let out = Command::new("python3").arg("-c").arg(script).output().unwrap();
    assert!(out.status.success(), "prometheus parse failed: {}", String::from_utf8_lossy(&out.stderr));
    let samples: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(samples["vsd_export_ops_total/read/"], reads as f64);
    assert_eq!(samples["vsd_export_bytes_total/write/"], (writes * 4096) as f64);
    assert_eq!(samples["vsd_export_latency_seconds_count/read/"], reads as f64);
    assert_eq!(samples["vsd_export_latency_seconds_bucket/read/+Inf"], reads as f64);
    assert_eq!(samples["vsd_stage_latency_seconds_count/total/"], served as f64);
}

#[test]
fn block_resize_grows_the_image_and_new_clients_see_it() {
    let dir = Scratch::new("qmp-resize");
    let image = dir.image("disk.img", 16 * MIB);
    let socket = dir.path("exp1.sock");
    let (_daemon, qmp_sock) = daemon_with_monitor(&dir, raw_export(&image, &socket, ""));
    let mut qmp = QmpClient::connect(&qmp_sock).unwrap();

    let before = vsd_bench::Client::connect(&socket, ClientOptions::default()).unwrap();
    assert_eq!(before.capacity().unwrap(), 16 * MIB);
    drop(before);
    qmp.execute("block_resize", json!({ "node-name": "r1", "size": 48 * MIB })).unwrap();
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 48 * MIB);
    let mut after = vsd_bench::Client::connect(&socket, ClientOptions::default()).unwrap();
    assert_eq!(after.capacity().unwrap(), 48 * MIB);
    let mut queue = after.take_queue(0).unwrap();
    let data = pattern(3, 4096);
    queue.write_at(40 * MIB, &data).unwrap();
    let mut back = vec![0; 4096];
    queue.read_at(40 * MIB, &mut back).unwrap();
    assert_eq!(back, data, "the new space is usable");

    let mut refuse = |args: Value| qmp.execute("block_resize", args).unwrap_err().to_string();
    assert!(refuse(json!({ "node-name": "r1", "size": 1000 })).contains("multiple of 512"));
    assert!(refuse(json!({ "node-name": "nope", "size": 4096 })).contains("nope"));
    assert!(refuse(json!({ "node-name": "null0", "size": 0 })).contains("multiple of 512"));
}

#[test]
fn deleting_an_export_that_waits_for_its_requests_blocks_no_other_command() {
    let dir = Scratch::new("qmp-slow-stop");
    let metrics_port = free_port();
    let (socket, second) = (dir.path("slow.sock"), dir.path("qmp1.sock"));
    // Every request of this node takes 4 s: deleting its export waits that long.
    let extra: Vec<String> = vec![
        "--blockdev".into(),
        "driver=null-co,node-name=slow,size=16M,latency-ns=4000000000".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=slowexp,node-name=slow,addr.type=unix,addr.path={},writable=on",
            socket.display()
        ),
        "--chardev".into(),
        format!("socket,id=qmp1,path={},server=on,wait=off", second.display()),
        "--monitor".into(),
        "chardev=qmp1".into(),
        "--metrics".into(),
        format!("127.0.0.1:{metrics_port}"),
    ];
    let (_daemon, qmp_sock) = daemon_with_monitor(&dir, extra);
    let in_flight = r#"vsd_export_in_flight{export="slowexp",node="slow"} "#;
    let mut client = vsd_bench::Client::connect(&socket, ClientOptions::default()).unwrap();
    let mut queue = client.take_queue(0).unwrap();
    let reading = std::thread::spawn(move || queue.read_at(0, &mut [0; 4096]).map_err(|e| e.to_string()));
    wait_for(|| http_get(metrics_port, "/metrics").lines().any(|l| l == format!("{in_flight}1")), "the read in flight");

    let started = Instant::now();
    let deleting = std::thread::spawn(move || {
        let (reply, event) = qmp_with(
            &qmp_sock,
            "block-export-del",
            json!({ "id": "slowexp", "mode": "hard" }),
            Some("BLOCK_EXPORT_DELETED"),
        );
        (reply, event, started.elapsed())
    });
    let mut other = QmpClient::connect(&second).unwrap();
    wait_for(|| shutting_down(&mut other, "slowexp"), "slowexp listed as shutting down");
    // While it waits for the read: metrics answer, its node stays busy and
    // its id taken, and other exports can be added.
    assert!(http_get(metrics_port, "/metrics").contains("vsd_export_ops_total"));
    let busy = other.execute("blockdev-del", json!({ "node-name": "slow" })).unwrap_err().to_string();
    assert!(busy.contains("slowexp, shutting down"), "{busy}");
    let again = json!({
        "type": "vhost-user-blk", "id": "slowexp", "node-name": "null0",
        "addr": { "type": "unix", "path": dir.path("again.sock") },
    });
    assert!(other.execute("block-export-add", again).unwrap_err().to_string().contains("already in use"));
    let twice = other.execute("block-export-del", json!({ "id": "slowexp" })).unwrap_err().to_string();
    assert!(twice.contains("already shutting down"), "{twice}");
    let extra_export = json!({
        "type": "vhost-user-blk", "id": "meanwhile", "node-name": "null0",
        "addr": { "type": "unix", "path": dir.path("meanwhile.sock") },
    });
    other.execute("block-export-add", extra_export).unwrap();
    assert!(!deleting.is_finished(), "all this happened while the deletion waited");

    let (reply, event, took) = deleting.join().unwrap();
    returned(&reply);
    assert_eq!(event.expect("BLOCK_EXPORT_DELETED")["data"]["id"], "slowexp");
    assert!(took >= Duration::from_secs(2), "the deletion waited for the read ({took:?})");
    assert!(reading.join().unwrap().is_ok(), "the read in flight completed before the export stopped");
    assert!(!shutting_down(&mut other, "slowexp"), "gone once stopped");
    other.execute("blockdev-del", json!({ "node-name": "slow" })).unwrap();
    other.execute("block-export-del", json!({ "id": "meanwhile" })).unwrap();
}

fn shutting_down(qmp: &mut QmpClient, id: &str) -> bool {
    let exports = qmp.execute("query-block-exports", json!({})).unwrap();
    exports.as_array().unwrap().iter().any(|e| e["id"] == id && e["shutting-down"] == true)
}

/// Waits up to 20 s for `done`.
fn wait_for(mut done: impl FnMut() -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The body of an HTTP GET of `path` on 127.0.0.1:`port`.
fn http_get(port: u16, path: &str) -> String {
    use std::io::Read;
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response.split_once("\r\n\r\n").map(|(_, body)| body.to_string()).unwrap_or_default()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Growing a qcow2 image, within its L1 table's clusters and past them (the
/// table moves: with 512-byte clusters one L1 cluster spans 2 MiB), and
/// shrinking one; QEMU then finds both images consistent and reads what
/// vsd wrote.
#[test]
fn block_resize_grows_a_qcow2_image_that_qemu_img_then_reads() {
    let dir = Scratch::new("qmp-resize-qcow2");
    let image = dir.path("disk.qcow2");
    let small = dir.path("small.qcow2");
    for (path, opts, size) in [(&image, "cluster_size=65536", "64M"), (&small, "cluster_size=512", "1M")] {
        let out = common::run("qemu-img", &["create", "-q", "-f", "qcow2", "-o", opts, path.to_str().unwrap(), size]);
        assert!(out.status.success(), "{out:?}");
    }
    let socket = dir.path("q.sock");
    let mut extra = common::qcow2_export(&image, &socket, ",writable=on");
    let small_socket = dir.path("small.sock");
    let l1_offset = |path: &Path| u64::from_be_bytes(std::fs::read(path).unwrap()[40..48].try_into().unwrap());
    let small_l1 = l1_offset(&small);
    extra.extend([
        "--blockdev".into(),
        format!("driver=file,node-name=sf,filename={}", small.display()),
        "--blockdev".into(),
        "driver=qcow2,node-name=small,file=sf".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=e1,node-name=small,addr.type=unix,addr.path={},writable=on",
            small_socket.display()
        ),
    ]);
    let (daemon, qmp_sock) = daemon_with_monitor(&dir, extra);
    let mut qmp = QmpClient::connect(&qmp_sock).unwrap();

    let before = pattern(11, 64 * 1024);
    let kept = pattern(10, 64 * 1024);
    let after = pattern(12, 64 * 1024);
    let mut client = vsd_bench::Client::connect(&socket, ClientOptions::default()).unwrap();
    let mut queue = client.take_queue(0).unwrap();
    queue.write_at(64 * MIB - 64 * 1024, &before).unwrap();
    queue.write_at(16 * MIB, &kept).unwrap();
    drop((queue, client));
    qmp.execute("block_resize", json!({ "node-name": "q0", "size": 3 * 1024 * MIB })).unwrap();
    let mut client = vsd_bench::Client::connect(&socket, ClientOptions::default()).unwrap();
    assert_eq!(client.capacity().unwrap(), 3 * 1024 * MIB);
    let mut queue = client.take_queue(0).unwrap();
    queue.write_at(3 * 1024 * MIB - 64 * 1024, &after).unwrap();
    for (offset, data) in [(64 * MIB - 64 * 1024, &before), (3 * 1024 * MIB - 64 * 1024, &after)] {
        let mut back = vec![0; data.len()];
        queue.read_at(offset, &mut back).unwrap();
        assert!(&back == data, "{offset:#x} reads back after growing");
    }
    let mut fresh = vec![0xff; 4096];
    queue.read_at(MIB * 1024, &mut fresh).unwrap();
    assert!(fresh.iter().all(|&b| b == 0), "the new space reads as zeroes");
    queue.flush().unwrap();
    drop((queue, client));

    let refuse = |qmp: &mut QmpClient, node: &str, size: u64| {
        qmp.execute("block_resize", json!({ "node-name": node, "size": size })).unwrap_err().to_string()
    };

    // Shrinking drops everything past the new end, as QEMU does.
    qmp.execute("block_resize", json!({ "node-name": "q0", "size": 32 * MIB })).unwrap();
    let mut client = vsd_bench::Client::connect(&socket, ClientOptions::default()).unwrap();
    assert_eq!(client.capacity().unwrap(), 32 * MIB);
    let mut queue = client.take_queue(0).unwrap();
    let mut back = vec![0; kept.len()];
    queue.read_at(16 * MIB, &mut back).unwrap();
    assert!(back == kept, "what lies before the new end stays");
    assert!(queue.read_at(32 * MIB, &mut back).is_err(), "past the new end");
    drop((queue, client));

    // The small image: its L1 table moves to grow past 2 MiB, and again
    // past 4 MiB, with data written before, between and after.
    let small_writes =
        [(MIB - 4096, pattern(13, 4096)), (3 * MIB, pattern(14, 4096)), (8 * MIB - 4096, pattern(15, 4096))];
    for (size, (offset, data)) in [0, 4 * MIB, 8 * MIB].into_iter().zip(&small_writes) {
        if size > 0 {
            qmp.execute("block_resize", json!({ "node-name": "small", "size": size })).unwrap();
        }
        let mut client = vsd_bench::Client::connect(&small_socket, ClientOptions::default()).unwrap();
        let mut queue = client.take_queue(0).unwrap();
        queue.write_at(*offset, data).unwrap();
        queue.flush().unwrap();
    }
    let too_far = refuse(&mut qmp, "small", 32 * MIB);
    assert!(too_far.contains("reopen it to grow further"), "room for 16 times the size at open: {too_far}");
    assert_eq!(daemon.stop().code(), Some(0));

    assert_eq!(virtual_size(&image), 32 * MIB);
    for path in [&image, &small] {
        let check = common::run("qemu-img", &["check", path.to_str().unwrap()]);
        let report = String::from_utf8_lossy(&check.stdout);
        assert!(check.status.success() && report.contains("No errors were found"), "{}: {report}", path.display());
    }
    assert_eq!(virtual_size(&small), 8 * MIB);
    assert_ne!(l1_offset(&small), small_l1, "the small image's L1 table moved");
    let small_raw = dir.path("small.raw");
    let out = common::run("qemu-img", &["convert", "-O", "raw", small.to_str().unwrap(), small_raw.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let small_bytes = std::fs::read(&small_raw).unwrap();
    for (offset, data) in &small_writes {
        assert!(
            small_bytes[*offset as usize..][..data.len()] == data[..],
            "qemu-img reads {offset:#x} of the small image"
        );
    }
    let converted = dir.path("converted.raw");
    let out = common::run("qemu-img", &["convert", "-O", "raw", image.to_str().unwrap(), converted.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let file = std::fs::File::open(&converted).unwrap();
    let mut back = vec![0; kept.len()];
    std::os::unix::fs::FileExt::read_exact_at(&file, &mut back, 16 * MIB).unwrap();
    assert!(back == kept, "qemu-img reads what vsd wrote before the new end");
    assert_eq!(file.metadata().unwrap().len(), 32 * MIB);
}

/// The virtual size `qemu-img info` reports.
fn virtual_size(image: &Path) -> u64 {
    let info = common::run("qemu-img", &["info", "--output=json", image.to_str().unwrap()]);
    let info: Value = serde_json::from_slice(&info.stdout).unwrap();
    info["virtual-size"].as_u64().unwrap()
}

/// Call batching holds a call only while more requests are in flight: a
/// lone request is answered at once even with the longest window, and a
/// deep queue still completes every request.
#[test]
fn call_batching_never_holds_a_lone_request() {
    let dir = Scratch::new("qmp-call-batch");
    let image = dir.image("disk.img", 64 * MIB);
    let (_daemon, qmp_sock) =
        daemon_with_monitor(&dir, raw_export(&image, &dir.path("exp1.sock"), ",call-batch-us=10000"));
    let mut client = vsd_bench::Client::connect(&dir.path("exp1.sock"), ClientOptions::default()).unwrap();
    let mut queue = client.take_queue(0).unwrap();
    let data = pattern(7, 4096);
    let start = Instant::now();
    for i in 0..100 {
        queue.write_at(i * 4096, &data).unwrap();
    }
    // Held for the whole window, 100 requests would take a second at least.
    assert!(start.elapsed() < Duration::from_millis(500), "{:?} for 100 requests", start.elapsed());
    drop(queue);
    drop(client);

    let socket = dir.path("exp1.sock");
    let args = ["vsd-bench", "--socket", socket.to_str().unwrap(), "--rw", "randread", "--iodepth", "16"];
    let config = <vsd_bench::bench::Args as clap::Parser>::parse_from([&args[..], &["--seconds", "1"]].concat())
        .into_config()
        .unwrap();
    let report = vsd_bench::bench::run(&config).unwrap();
    assert_eq!(report.results.errors, 0);
    let mut qmp = QmpClient::connect(&qmp_sock).unwrap();
    let snapshot: vsd_trace::ExportSnapshot =
        serde_json::from_value(export_stats(&mut qmp, "exp1")["x-vsd"].clone()).unwrap();
    let merged = snapshot.merged();
    assert_eq!(merged.events.in_flight, 0, "every request completed");
    assert!(merged.events.calls > 0 && merged.events.calls <= merged.events.requests);
    // Past the 10 ms window by a loaded machine's scheduling delays at most.
    assert!(merged.stage(vsd_trace::Stage::Call).quantile_ns(1.0) < 100_000_000, "no call held past the window");
}

/// Requests to an O_DIRECT file reach the kernel in groups of at most
/// `DIRECT_BATCH`, however many the guest queued at once (see the io_uring
/// engine: long bursts slowed the disks measured): the worker takes more
/// requests per batch than that, and enters the kernel once per group.
#[test]
fn direct_requests_are_submitted_in_short_groups() {
    let dir = Scratch::new("qmp-submit-each");
    let image = dir.image("disk.img", 64 * MIB);
    let mut export = raw_export(&image, &dir.path("exp1.sock"), "");
    export[1].push_str(",cache.direct=on");
    let (_daemon, qmp_sock) = daemon_with_monitor(&dir, export);
    let socket = dir.path("exp1.sock");
    let args = ["vsd-bench", "--socket", socket.to_str().unwrap(), "--rw", "randread", "--iodepth", "16"];
    let config = <vsd_bench::bench::Args as clap::Parser>::parse_from([&args[..], &["--seconds", "1"]].concat())
        .into_config()
        .unwrap();
    assert_eq!(vsd_bench::bench::run(&config).unwrap().results.errors, 0);
    let mut qmp = QmpClient::connect(&qmp_sock).unwrap();
    let snapshot: vsd_trace::ExportSnapshot =
        serde_json::from_value(export_stats(&mut qmp, "exp1")["x-vsd"].clone()).unwrap();
    let events = snapshot.merged().events;
    let group = vsd_engine::DIRECT_BATCH as u64;
    assert!(events.requests > group * events.batches, "longer batches than a group: {events:?}");
    assert!(events.kernel_entries * group >= events.requests, "an io_uring_enter per group: {events:?}");
}

/// The `query-nodes` entry of node `name`.
fn node_stats(client: &mut QmpClient, name: &str) -> Value {
    let all = client.execute("query-blockstats", json!({ "query-nodes": true })).unwrap();
    let entry = all.as_array().unwrap().iter().find(|e| e["node-name"] == name && e.get("qdev").is_none()).cloned();
    entry.unwrap_or_else(|| panic!("no node entry for {name}: {all}"))["stats"].clone()
}

/// Inner nodes count what they are sent, not what the guest asked: a qcow2
/// image's file node sees its metadata I/O as well, and a node that fails
/// requests itself counts the failures, which never reach the node below.
#[test]
fn inner_nodes_count_metadata_io_and_failures() {
    let dir = Scratch::new("qmp-node-stats");
    let qcow2 = dir.path("disk.qcow2");
    run("qemu-img", &["create", "-f", "qcow2", qcow2.to_str().unwrap(), "64M"]);
    let raw = dir.image("disk.img", 16 * MIB);
    let blockdevs = [
        format!("driver=file,node-name=qfile,filename={}", qcow2.display()),
        "driver=qcow2,node-name=q,file=qfile".into(),
        format!("driver=file,node-name=rfile,filename={}", raw.display()),
        "driver=blkdebug,node-name=dbg,image=rfile,inject-error.0.iotype=read".into(),
        "driver=raw,node-name=r,file=dbg".into(),
    ];
    let mut extra: Vec<String> = blockdevs.into_iter().flat_map(|b| ["--blockdev".into(), b]).collect();
    for (id, node) in [("eq", "q"), ("er", "r")] {
        let socket = dir.path(&format!("{id}.sock"));
        extra.extend([
            "--export".into(),
            format!(
                "type=vhost-user-blk,id={id},node-name={node},addr.type=unix,addr.path={},writable=on",
                socket.display()
            ),
        ]);
    }
    let (_daemon, qmp_sock) = daemon_with_monitor(&dir, extra);
    let mut qmp = QmpClient::connect(&qmp_sock).unwrap();

    // Eight clusters allocated, then flushed: L2 table and refcount updates
    // go to the file with the data.
    let writes = 8u64;
    let mut client = vsd_bench::Client::connect(&dir.path("eq.sock"), ClientOptions::default()).unwrap();
    let mut queue = client.take_queue(0).unwrap();
    let data = pattern(3, 4096);
    for i in 0..writes {
        queue.write_at(i * 65536, &data).unwrap();
    }
    queue.flush().unwrap();
    let q = node_stats(&mut qmp, "q");
    assert_eq!(q["wr_operations"], writes);
    assert_eq!(q["flush_operations"], 1);
    let file = node_stats(&mut qmp, "qfile");
    let file_writes = file["wr_operations"].as_u64().unwrap();
    assert!(file_writes > writes, "the file got {file_writes} writes: the guest's {writes} and the metadata");
    assert!(file["wr_bytes"].as_u64().unwrap() > writes * 4096);
    assert!(file["flush_operations"].as_u64().unwrap() >= 2, "a qcow2 flush orders metadata with flushes: {file}");
    assert!(file["wr_total_time_ns"].as_u64().unwrap() > 0);

    let reads = 5u64;
    let mut client = vsd_bench::Client::connect(&dir.path("er.sock"), ClientOptions::default()).unwrap();
    let mut queue = client.take_queue(0).unwrap();
    let mut buf = vec![0; 4096];
    for i in 0..reads {
        assert!(queue.read_at(i * 4096, &mut buf).is_err(), "blkdebug fails every read");
    }
    // As in QEMU, a failed request counts as failed, not as an operation.
    for (name, failed) in [("r", reads), ("dbg", reads), ("rfile", 0)] {
        let stats = node_stats(&mut qmp, name);
        assert_eq!(stats["failed_rd_operations"], failed, "{name}: {stats}");
        assert_eq!(stats["rd_operations"], 0, "{name}: {stats}");
        assert_eq!(stats["rd_bytes"], 0, "{name}: failed reads transfer nothing");
    }
}

/// The names of the nodes `query-named-block-nodes` lists.
fn node_names(socket: &Path) -> Vec<String> {
    let nodes = qmp(socket, "query-named-block-nodes", json!({}));
    returned(&nodes).as_array().unwrap().iter().map(|n| n["node-name"].as_str().unwrap().to_string()).collect()
}

/// Children defined inline, as QEMU takes them: dotted keys on the command
/// line, a nested object in `blockdev-add` (QEMU's Python client). They
/// become nodes named `#block<n>` unless named, and go with their parent.
#[test]
fn blockdev_add_takes_children_defined_inline() {
    let dir = Scratch::new("qmp-inline");
    let qcow2 = dir.path("disk.qcow2");
    run("qemu-img", &["create", "-f", "qcow2", qcow2.to_str().unwrap(), "16M"]);
    let raw = dir.image("disk.img", 16 * MIB);
    let cli = vec![
        "--blockdev".into(),
        format!("driver=raw,node-name=r,file.driver=file,file.filename={},file.cache.no-flush=on", raw.display()),
    ];
    let (_daemon, qmp_sock) = daemon_with_monitor(&dir, cli);
    let inline = json!({ "driver": "qcow2", "node-name": "q", "file": { "driver": "file", "filename": qcow2 } });
    returned(&qmp(&qmp_sock, "blockdev-add", inline));
    assert_eq!(node_names(&qmp_sock), ["null0", "#block1", "r", "#block2", "q"]);
    let nodes = qmp(&qmp_sock, "query-named-block-nodes", json!({}));
    let cache = |name: &str| {
        returned(&nodes).as_array().unwrap().iter().find(|n| n["node-name"] == name).unwrap()["cache"].clone()
    };
    assert_eq!(
        cache("#block1"),
        json!({ "writeback": true, "direct": false, "no-flush": true }),
        "the inline node's own options"
    );
    assert_eq!(cache("#block2"), json!({ "writeback": true, "direct": false, "no-flush": false }));

    let socket = dir.path("q.sock");
    let export = json!({
        "type": "vhost-user-blk", "id": "eq", "node-name": "q", "addr": { "type": "unix", "path": socket }, "writable": true,
    });
    returned(&qmp(&qmp_sock, "block-export-add", export));
    let mut client = vsd_bench::Client::connect(&socket, ClientOptions::default()).unwrap();
    let mut queue = client.take_queue(0).unwrap();
    let data = pattern(9, 65536);
    queue.write_at(MIB, &data).unwrap();
    queue.flush().unwrap();
    drop(queue);
    drop(client);
    let busy = qmp(&qmp_sock, "blockdev-del", json!({ "node-name": "#block2" }));
    assert_eq!(error_desc(&busy), "Block device #block2 is in use", "{busy}");
    returned(&qmp(&qmp_sock, "block-export-del", json!({ "id": "eq" })));
    returned(&qmp(&qmp_sock, "blockdev-del", json!({ "node-name": "q" })));
    assert_eq!(node_names(&qmp_sock), ["null0", "#block1", "r"], "the inline file node went with its parent");

    // What vsd wrote is in the image, as qemu-img reads it.
    let out = dir.path("out.raw");
    run("qemu-img", &["convert", "-O", "raw", qcow2.to_str().unwrap(), out.to_str().unwrap()]);
    let back = std::fs::read(&out).unwrap();
    assert_eq!(&back[MIB as usize..MIB as usize + data.len()], &data[..]);
}

/// The one capability vsd offers, `oob`: a client that enabled it has
/// vsd's queries answered out-of-band while a `blockdev-add` hangs on an
/// NBD server that accepted the connection and never speaks; the in-band
/// commands behind it wait their turn; commands that may not run
/// out-of-band are refused as QEMU refuses them.
#[test]
fn out_of_band_queries_are_answered_while_a_blockdev_add_hangs() {
    let dir = Scratch::new("qmp-oob");
    let (_vsd, qmp_sock) = daemon_with_monitor(&dir, Vec::new());
    let silent = std::os::unix::net::UnixListener::bind(dir.path("silent.sock")).unwrap();
    let stream = UnixStream::connect(&qmp_sock).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    let mut receive = || {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        serde_json::from_str::<Value>(&line).unwrap()
    };
    assert_eq!(receive()["QMP"]["capabilities"], json!(["oob"]));
    writer.write_all(b"{\"execute\": \"qmp_capabilities\", \"arguments\": {\"enable\": [\"oob\"]}}\n").unwrap();
    assert_eq!(receive(), json!({"return": {}}));

    let hanging = json!({"execute": "blockdev-add", "id": "hangs", "arguments": {
        "driver": "nbd", "node-name": "remote", "server": {"type": "unix", "path": dir.path("silent.sock")}}});
    let lines = [
        hanging,
        json!({"execute": "query-version", "id": "in-band"}),
        json!({"exec-oob": "query-jobs", "id": "jobs"}),
        json!({"exec-oob": "query-version", "id": "version"}),
        json!({"exec-oob": "query-block-exports", "id": "exports"}),
        json!({"exec-oob": "no-such-command", "id": "unknown"}),
    ];
    for line in &lines {
        writer.write_all(format!("{line}\n").as_bytes()).unwrap();
    }
    let started = Instant::now();
    assert_eq!(receive(), json!({"return": [], "id": "jobs"}));
    assert_eq!(receive()["id"], json!("version"));
    let refusal = |class: &str, desc: &str, id: &str| json!({"error": {"class": class, "desc": desc}, "id": id});
    assert_eq!(receive(), refusal("GenericError", "The command query-block-exports does not support OOB", "exports"));
    assert_eq!(receive(), refusal("CommandNotFound", "The command no-such-command has not been found", "unknown"));
    assert!(started.elapsed() < Duration::from_secs(5), "answered while the blockdev-add waits");

    drop(silent);
    let failed = receive();
    assert_eq!((&failed["id"], failed["error"]["class"].as_str()), (&json!("hangs"), Some("GenericError")), "{failed}");
    let version = receive();
    assert_eq!((&version["id"], &version["return"]["qemu"]["major"]), (&json!("in-band"), &json!(10)), "{version}");
}
