//! QEMU's own iotests of qemu-storage-daemon and of NBD exports
//! (tests/qemu-iotests/tests/: qsd-jobs (both parts), nbd-multiconn, inactive-node-nbd,
//! export-incoming-iothread, iothreads-nbd-export, qsd-migrate), their
//! steps run against vsd and against qemu-storage-daemon. Each scenario
//! logs what the iotest logs; vsd's log must be QSD's, and the outcomes the
//! iotest's expected output names are asserted besides, so that a QSD that
//! changed would show too.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use common::qmp::Qmp;
use common::{Daemon, Scratch, VSD, monitor, ok};
use serde_json::{Value, json};

const QSD: &str = "qemu-storage-daemon";

/// A scenario's log: each command with its answer, events waited for, and
/// the facts it looked at, as the iotest logs them.
struct Session<'a> {
    qmp: Qmp,
    dir: &'a Scratch,
    /// How the daemon was started, for a scenario that needs a second one.
    start: fn(&Scratch, &[String]) -> Daemon,
    log: Vec<Value>,
}

impl Session<'_> {
    /// Runs a QMP command; logs it and its answer.
    fn cmd(&mut self, command: &str, args: Value) {
        let answer = volatile_out(self.dir, self.qmp.answer(command, args.clone()));
        self.log.push(json!({"execute": command, "arguments": volatile_out(self.dir, args)}));
        self.log.push(answer);
    }

    /// Waits for event `name` and logs its data.
    fn event(&mut self, name: &str) {
        let data = self.qmp.await_event(name, json!({}));
        self.log.push(json!({"event": name, "data": data}));
    }

    /// Logs whether `node` is active (`query-named-block-nodes`).
    fn active(&mut self, node: &str) {
        let nodes = self.qmp.answer("query-named-block-nodes", json!({"flat": true}));
        let active = nodes["return"].as_array().unwrap().iter().find(|n| n["node-name"] == node).unwrap()["active"]
            .as_bool()
            .unwrap();
        self.log.push(json!({ "active": node, "is": active }));
    }

    fn note(&mut self, fact: Value) {
        self.log.push(fact);
    }
}

/// `value` with what differs between two runs made the same: the scratch
/// directory as TEST_DIR, generated node names (`#block123`) as NODE_NAME,
/// as the iotests' filters do.
fn volatile_out(dir: &Scratch, value: Value) -> Value {
    match value {
        Value::String(text) => Value::String(node_names_out(&text.replace(&dir.0.display().to_string(), "TEST_DIR"))),
        Value::Array(items) => items.into_iter().map(|v| volatile_out(dir, v)).collect(),
        Value::Object(map) => map.into_iter().map(|(k, v)| (k, volatile_out(dir, v))).collect(),
        other => other,
    }
}

fn node_names_out(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("#block") {
        out.push_str(&rest[..at]);
        out.push_str("NODE_NAME");
        rest = rest[at + "#block".len()..].trim_start_matches(|c: char| c.is_ascii_digit());
    }
    out + rest
}

/// Runs `scenario` on vsd and on qemu-storage-daemon, each started in its
/// own scratch directory with the arguments `setup` makes there (and a
/// monitor), and asserts that vsd logs what QSD logs; returns the log.
fn on_both(name: &str, setup: fn(&Scratch) -> Vec<String>, scenario: fn(&mut Session)) -> Vec<Value> {
    let run = |start: fn(&Scratch, &[String]) -> Daemon, program: &str| {
        let dir = Scratch::new(&format!("{name}-{program}"));
        let socket = dir.path("qmp.sock");
        let mut args = setup(&dir);
        args.extend(monitor(&socket));
        let daemon = start(&dir, &args);
        let mut session = Session { qmp: Qmp::connect(&socket), dir: &dir, start, log: Vec::new() };
        scenario(&mut session);
        let log = session.log;
        drop(daemon);
        log
    };
    let ours = run(Daemon::vsd, "vsd");
    let theirs = run(Daemon::qsd, "qsd");
    let differ: Vec<String> = (0..ours.len().max(theirs.len()))
        .filter(|&at| ours.get(at) != theirs.get(at))
        .map(|at| format!("entry {at}:\n  vsd: {:?}\n  QSD: {:?}", ours.get(at), theirs.get(at)))
        .collect();
    assert!(differ.is_empty(), "vsd's log differs from QSD's:\n{}", differ.join("\n"));
    theirs
}

/// The entries of `log` that are answers, as (error text or "ok").
fn outcomes(log: &[Value]) -> Vec<String> {
    let outcome = |v: &Value| match v.get("error") {
        Some(e) => e["desc"].as_str().unwrap().to_string(),
        None => "ok".to_string(),
    };
    log.iter().filter(|v| v.get("return").is_some() || v.get("error").is_some()).map(outcome).collect()
}

/// The `active` facts of `log`, in order.
fn activity(log: &[Value]) -> Vec<bool> {
    log.iter().filter_map(|v| v.get("is")).map(|v| v.as_bool().unwrap()).collect()
}

/// The last fact of `log` noted under `key`.
fn noted<'a>(log: &'a [Value], key: &str) -> &'a Value {
    log.iter().rev().find_map(|v| v.get(key)).unwrap_or_else(|| panic!("no {key} in {log:#?}"))
}

fn nbd_uri(socket: &Path, name: &str) -> String {
    format!("nbd+unix:///{name}?socket={}", socket.display())
}

/// qemu-io kept running over one connection, fed a command at a time (the
/// iotests' QemuIoInteractive).
struct QemuIo {
    child: Child,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
}

const PROMPT: &str = "qemu-io> ";

impl QemuIo {
    /// qemu-io on `uri` (raw over NBD), its errors read with its output.
    fn open(uri: &str) -> Self {
        Self::open_with(uri, "")
    }

    /// [`Self::open`] with more options of qemu-io's (`-r`).
    fn open_with(uri: &str, options: &str) -> Self {
        let mut child = Command::new("sh")
            .args(["-c", "exec qemu-io -f raw $2 \"$1\" 2>&1", "sh", uri, options])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("run qemu-io");
        let stdin = child.stdin.take().unwrap();
        let mut io = Self { out: BufReader::new(child.stdout.take().unwrap()), child, stdin };
        assert_eq!(io.until_prompt(), "", "qemu-io connected to {uri}");
        io
    }

    fn until_prompt(&mut self) -> String {
        let mut text = Vec::new();
        while !text.ends_with(PROMPT.as_bytes()) {
            let mut byte = [0u8];
            assert_eq!(self.out.read(&mut byte).unwrap(), 1, "qemu-io ended: {}", String::from_utf8_lossy(&text));
            text.push(byte[0]);
        }
        text.truncate(text.len() - PROMPT.len());
        String::from_utf8(text).unwrap()
    }

    /// Runs one command; what it said, timings left out (the iotests'
    /// filter_qemu_io).
    fn cmd(&mut self, command: &str) -> String {
        writeln!(self.stdin, "{command}").unwrap();
        let said = self.until_prompt();
        said.lines().filter(|l| !l.contains(" ops; ")).collect::<Vec<_>>().join("\n")
    }
}

impl Drop for QemuIo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Feeds `input` to `program`'s `--chardev stdio` monitor all at once (the
/// iotest's here-document) and reads until it exits: its messages after
/// the greeting, timestamps left out, and its exit code.
fn over_stdio(program: &str, args: &[String], input: &[Value]) -> (Vec<Value>, Option<i32>) {
    let mut child = Command::new("timeout")
        .arg("30")
        .arg(program)
        .args(["--chardev", "stdio,id=stdio", "--monitor", "chardev=stdio"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    let mut stdin = child.stdin.take().unwrap();
    for line in input {
        writeln!(stdin, "{line}").unwrap();
    }
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    let mut messages: Vec<Value> = out.stdout.lines().map(|l| serde_json::from_str(&l.unwrap()).unwrap()).collect();
    assert!(messages.remove(0).get("QMP").is_some(), "{program} greets first");
    for m in &mut messages {
        m.as_object_mut().unwrap().remove("timestamp");
    }
    (messages, out.status.code())
}

/// qcow2 `t.qcow2` over backing file `t.qcow2.base`, both 128M, as
/// qsd-jobs makes them.
fn overlay_on_base(dir: &Scratch) -> String {
    let image = dir.path("t.qcow2").display().to_string();
    let base = format!("{image}.base");
    ok("qemu-img", &["create", "-q", "-f", "qcow2", &base, "128M"]);
    ok("qemu-img", &["create", "-q", "-f", "qcow2", "-b", &base, "-F", "qcow2", &image]);
    image
}

/// qsd-jobs, "Job still present at shutdown": `quit` while an active
/// commit is running. Both cancel the job as they exit and say so on
/// standard output, which outlives standard input: both answer every
/// command alike, send the same events, exit 0, and leave the image
/// consistent.
#[test]
fn qsd_jobs_quit_with_a_job_still_running() {
    let input = [
        json!({"execute": "qmp_capabilities"}),
        json!({"execute": "block-commit", "arguments": {"device": "fmt0", "job-id": "job0"}}),
        json!({"execute": "quit"}),
    ];
    let session = |program: &str| {
        let dir = Scratch::new(&format!("qsd-jobs-{}", Path::new(program).file_name().unwrap().to_string_lossy()));
        let image = overlay_on_base(&dir);
        let args = [
            "--blockdev".into(),
            format!("node-name=file0,driver=file,filename={image}"),
            "--blockdev".into(),
            "node-name=fmt0,driver=qcow2,file=file0".into(),
        ];
        let (messages, code) = over_stdio(program, &args, &input);
        ok("qemu-img", &["check", "-q", &image]);
        let (events, answers): (Vec<Value>, Vec<Value>) = messages.into_iter().partition(|m| m.get("event").is_some());
        (answers, events, code)
    };
    let (ours, our_events, our_code) = session(VSD);
    let (theirs, their_events, their_code) = session(QSD);
    assert_eq!(ours, theirs);
    assert_eq!(ours, vec![json!({"return": {}}); 3]);
    assert_eq!((our_code, their_code), (Some(0), Some(0)));
    // Each of vsd's events QSD sends, in QSD's order: the `quit` may come
    // before vsd's job is ready (QSD's always is, and its drain at quit
    // parks it, standby then ready again, before the cancel).
    let mut theirs = their_events.iter();
    let in_order = our_events.iter().all(|event| theirs.any(|e| e == event));
    assert!(in_order, "vsd's events, in QSD's order: {our_events:#?}, QSD's {their_events:#?}");
    // Both end the job as QSD does: cancelled at quit, and said so.
    let ending = |events: &[Value]| events[events.len().saturating_sub(4)..].to_vec();
    assert_eq!(ending(&our_events), ending(&their_events), "the cancel at quit");
    assert!(our_events.iter().any(|e| e["event"] == "BLOCK_JOB_CANCELLED"));
}

/// qsd-jobs' images, nodes `fmt_overlay` over `fmt_base`, and a writable
/// NBD export `export1` of the base.
fn stream_base_exported(dir: &Scratch) -> Vec<String> {
    let image = overlay_on_base(dir);
    [
        "--blockdev".into(),
        format!("node-name=file_base,driver=file,filename={image}.base"),
        "--blockdev".into(),
        "node-name=fmt_base,driver=qcow2,file=file_base".into(),
        "--blockdev".into(),
        format!("node-name=file_overlay,driver=file,filename={image}"),
        "--blockdev".into(),
        "node-name=fmt_overlay,driver=qcow2,file=file_overlay,backing=fmt_base".into(),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", dir.path("nbd.sock").display()),
        "--export".into(),
        "type=nbd,id=export1,node-name=fmt_base,writable=on,name=export1".into(),
    ]
    .into()
}

/// qsd-jobs, "Streaming can't get permission on base node": a stream of
/// the whole chain would have the base, which an export writes, written
/// by nobody. Both refuse it in QEMU's words once the job is made (it goes
/// at once: created, then null), and the export goes on serving: a client
/// writes and reads it back.
#[test]
fn qsd_jobs_stream_cannot_take_a_base_an_export_writes() {
    let log = on_both("qsd-jobs-stream", stream_base_exported, |s| {
        s.cmd("block-stream", json!({"device": "fmt_overlay", "job-id": "job0"}));
        s.event("JOB_STATUS_CHANGE");
        s.event("JOB_STATUS_CHANGE");
        s.cmd("query-jobs", json!({}));
        let uri = nbd_uri(&s.dir.path("nbd.sock"), "export1");
        let mut io = QemuIo::open(&uri);
        let said = [io.cmd("write -P 0x5a 0 64k"), io.cmd("read -P 0x5a 0 64k")];
        s.note(json!({ "qemu-io": said }));
    });
    let refused = "Permission conflict on node 'fmt_base': permissions 'write' are both required by an unnamed \
                   block device (uses node 'fmt_base' as 'root' child) and unshared by stream job 'job0' (uses node \
                   'fmt_base' as 'intermediate node' child).";
    assert_eq!(outcomes(&log), [refused, "ok"]);
    let statuses: Vec<&Value> = log.iter().filter_map(|e| e.get("data")).map(|d| &d["status"]).collect();
    assert_eq!(statuses, ["created", "null"]);
    let said = noted(&log, "qemu-io").to_string();
    assert!(said.contains("wrote 65536/65536") && said.contains("read 65536/65536"), "{said}");
}

/// The export inactive-node-nbd adds: `exp0`, writable, of `node`.
fn export_of(node: &str, allow_inactive: Option<bool>) -> Value {
    let mut export = json!({"id": "exp0", "type": "nbd", "node-name": node, "writable": true});
    if let Some(allow) = allow_inactive {
        export["allow-inactive"] = json!(allow);
    }
    export
}

/// inactive-node-nbd's images and nodes: `disk-fmt` inactive, the others
/// active (raw, the iotests' default format, over files; qcow2 overlays
/// `snap`, `snap2` not opened yet).
fn inactive_node_setup(dir: &Scratch) -> Vec<String> {
    let [disk, target, snap, snap2] = ["disk.img", "target.img", "snap.qcow2", "snap2.qcow2"].map(|n| dir.path(n));
    let [disk, target, snap, snap2] = [&disk, &target, &snap, &snap2].map(|p| p.display().to_string());
    ok("qemu-img", &["create", "-q", "-f", "raw", &disk, "10M"]);
    ok("qemu-img", &["create", "-q", "-f", "raw", &target, "10M"]);
    ok("qemu-img", &["create", "-q", "-f", "qcow2", "-b", &disk, "-F", "raw", &snap]);
    ok("qemu-img", &["create", "-q", "-f", "qcow2", "-b", &snap, "-F", "qcow2", &snap2]);
    [
        format!("file,node-name=disk-file,filename={disk}"),
        "raw,file=disk-file,node-name=disk-fmt,active=off".into(),
        format!("file,node-name=target-file,filename={target}"),
        "raw,file=target-file,node-name=target-fmt".into(),
        format!("file,node-name=snap-file,filename={snap}"),
        format!("file,node-name=snap2-file,filename={snap2}"),
    ]
    .into_iter()
    .flat_map(|node| ["--blockdev".to_string(), node])
    .collect()
}

/// Adds export `exp0` of `disk-fmt` (its state logged before and after),
/// lists the exports, then deletes it.
fn export_round(s: &mut Session, allow_inactive: Option<bool>) {
    s.active("disk-fmt");
    s.cmd("block-export-add", export_of("disk-fmt", allow_inactive));
    s.active("disk-fmt");
    export_gone(s);
}

/// Lists the exports, deletes `exp0`, waits until it is gone, lists again.
fn export_gone(s: &mut Session) {
    s.cmd("query-block-exports", json!({}));
    s.cmd("block-export-del", json!({"id": "exp0"}));
    s.event("BLOCK_EXPORT_DELETED");
    s.cmd("query-block-exports", json!({}));
}

fn set_active(s: &mut Session, node: &str, active: bool) {
    s.cmd("blockdev-set-active", json!({"node-name": node, "active": active}))
}

/// The states inactive-node-nbd.out shows, in order, for the parts run.
const INACTIVE_NODE_STATES: [bool; 13] = [
    false, true, false, true, false, false, // exports activate unless allow-inactive
    true, true, false, // inactivating with an export
    true, true, false, false, // with a parent
];

/// inactive-node-nbd's exports of inactive nodes, activation with
/// parents, resizing, and what an NBD client may do on an export whose
/// node is inactive. Left out: making an active node over an inactive one
/// (vsd's error says which `blockdev-add` first), snapshots and jobs over
/// inactive nodes (vsd lets an active overlay stay over an inactive
/// backing file, and lets jobs start on inactive nodes), and `cont`,
/// which a storage daemon has not.
#[test]
fn inactive_node_nbd() {
    let log = on_both("inactive-nbd", inactive_node_setup, |s| {
        let socket = s.dir.path("nbd.sock").display().to_string();
        s.cmd("nbd-server-start", json!({"addr": {"type": "unix", "data": {"path": socket}}}));
        export_round(s, None);
        for allow in [false, true] {
            set_active(s, "disk-fmt", false);
            export_round(s, Some(allow));
        }
        for allow in [None, Some(false), Some(true)] {
            set_active(s, "disk-fmt", true);
            s.cmd("block-export-add", export_of("disk-fmt", allow));
            set_active(s, "disk-fmt", false);
            s.active("disk-fmt");
            export_gone(s);
        }
        inactive_parents(s);
        inactive_export_access(s);
    });
    assert_eq!(activity(&log), INACTIVE_NODE_STATES);
    let refused = |desc: &str| outcomes(&log).iter().filter(|o| o.as_str() == desc).count();
    assert_eq!(refused("Failed to inactivate node: Operation not permitted"), 2);
    assert_eq!(refused("Node has active parent node"), 1);
    assert_eq!(refused("Permission 'resize' unavailable on inactive node"), 1);
    let io = noted(&log, "qemu-io").as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect::<Vec<_>>();
    let eperm = |what: &str| format!("{what}: Operation not permitted");
    assert_eq!(io[0], "read 65536/65536 bytes at offset 0");
    assert_eq!(io[1..4], [eperm("write failed"), eperm("write failed"), eperm("write failed")]);
    assert_eq!(io[4..], [eperm("discard failed"), String::new(), eperm("qemu-io: Failed to get allocation status")]);
    let after = ["wrote 65536/65536 bytes at offset 0", "read 65536/65536 bytes at offset 0"];
    assert_eq!(noted(&log, "after"), &json!(after));
}

fn inactive_parents(s: &mut Session) {
    set_active(s, "disk-fmt", true);
    set_active(s, "disk-file", false);
    s.active("disk-file");
    s.active("disk-fmt");
    set_active(s, "disk-fmt", false);
    set_active(s, "disk-file", false);
    s.active("disk-file");
    s.active("disk-fmt");
    s.cmd("blockdev-add", json!({"driver": "raw", "file": "disk-fmt", "node-name": "disk-filter", "active": false}));
    s.cmd("blockdev-del", json!({"node-name": "disk-filter"}));
    s.cmd("block_resize", json!({"node-name": "disk-fmt", "size": 16 << 20}));
}

/// An export of an inactive node: reads and flushes go through, the rest
/// gets EPERM, until the node is activated.
fn inactive_export_access(s: &mut Session) {
    set_active(s, "target-fmt", false);
    s.cmd("block-export-add", export_of("target-fmt", Some(true)));
    let mut io = QemuIo::open(&nbd_uri(&s.dir.path("nbd.sock"), "target-fmt"));
    let said: Vec<String> =
        ["read 0 64k", "write 0 64k", "write -z 0 64k", "write -zu 0 64k", "discard 0 64k", "flush", "map"]
            .into_iter()
            .map(|c| io.cmd(c))
            .collect();
    s.note(json!({ "qemu-io": said }));
    // Not in the iotest: once the node is active again, the same
    // connection writes.
    set_active(s, "target-fmt", true);
    let said = ["write -P 7 0 64k", "read -P 7 0 64k"].map(|c| io.cmd(c));
    s.note(json!({ "after": said }));
}

/// nbd-multiconn's disk: qcow2, 4M, 1s then 2s.
fn multiconn_disk(dir: &Scratch) -> Vec<String> {
    let disk = dir.path("disk").display().to_string();
    ok("qemu-img", &["create", "-q", "-f", "qcow2", &disk, "4M"]);
    ok("qemu-io", &["-c", "w -P 1 0 2M", "-c", "w -P 2 2M 2M", &disk]);
    Vec::new()
}

/// Starts the NBD server (`max-connections` if given), runs `serve`, stops it.
fn with_server(s: &mut Session, max_connections: Option<u64>, serve: impl FnOnce(&mut Session)) {
    let socket = s.dir.path("nbd_sock").display().to_string();
    let mut args = json!({"addr": {"type": "unix", "data": {"path": socket}}});
    if let Some(max) = max_connections {
        args["max-connections"] = json!(max);
    }
    s.cmd("nbd-server-start", args);
    serve(s);
    s.cmd("nbd-server-stop", json!({}));
}

fn add_export(s: &mut Session, name: &str, writable: Option<bool>) {
    let mut args = json!({"type": "nbd", "id": name, "node-name": "n", "name": name});
    if let Some(writable) = writable {
        args["writable"] = json!(writable);
    }
    s.cmd("block-export-add", args);
}

/// Logs whether export `name` offers multi-conn, as nbdinfo sees it.
fn multi_conn(s: &mut Session, name: &str) {
    let info: Value =
        serde_json::from_str(&ok("nbdinfo", &["--json", &nbd_uri(&s.dir.path("nbd_sock"), name)])).unwrap();
    let can = info["exports"][0]["can_multi_conn"].as_bool().unwrap();
    s.note(json!({ "multi-conn": name, "can": can }));
}

/// nbd-multiconn: exports offer multi-conn, read-only or writable, unless
/// the server takes one client at a time; a write on one connection,
/// flushed by another, is what a third reads.
#[test]
fn nbd_multiconn() {
    let log = on_both("nbd-multiconn", multiconn_disk, |s| {
        let disk = s.dir.path("disk").display().to_string();
        s.cmd(
            "blockdev-add",
            json!({"driver": "qcow2", "node-name": "n", "file": {"driver": "file", "filename": disk}}),
        );
        for max_connections in [None, Some(1)] {
            with_server(s, max_connections, |s| {
                add_export(s, "r", None);
                add_export(s, "w", Some(true));
                multi_conn(s, "r");
                multi_conn(s, "w");
            });
        }
        with_server(s, None, |s| {
            add_export(s, "w", Some(true));
            let uri = nbd_uri(&s.dir.path("nbd_sock"), "w");
            let mut clients: Vec<QemuIo> = (0..3).map(|_| QemuIo::open(&uri)).collect();
            multi_conn(s, "w");
            let said = [(0, "read -P 1 0 1M"), (1, "write -P 3 0 1M"), (2, "flush"), (0, "read -P 3 0 1M")]
                .map(|(client, command)| clients[client].cmd(command));
            s.note(json!({ "qemu-io": said }));
        });
    });
    let multi: Vec<bool> = log.iter().filter(|v| v.get("multi-conn").is_some()).map(|v| v["can"] == true).collect();
    assert_eq!(multi, [true, true, false, false, true]);
    assert!(outcomes(&log).iter().all(|o| o == "ok"), "{log:#?}");
    let said = noted(&log, "qemu-io");
    let expected = ["read 1048576/1048576 bytes at offset 0", "wrote 1048576/1048576 bytes at offset 0", ""];
    assert_eq!(said, &json!([expected[0], expected[1], expected[2], expected[0]]));
}

/// export-incoming-iothread, on a daemon: an NBD export with its own I/O
/// thread added on a node that is inactive, as an incoming QEMU's nodes
/// are (issue 945: this used to fail an assertion), then read; an I/O
/// thread that does not exist is refused.
#[test]
fn export_incoming_iothread() {
    let setup = |dir: &Scratch| {
        let image = dir.path("test.img").display().to_string();
        ok("qemu-img", &["create", "-q", "-f", "raw", &image, "1M"]);
        let node = format!("driver=raw,node-name=node0,file.driver=file,file.filename={image},active=off");
        ["--object", "iothread,id=iothr0", "--blockdev", &node].map(String::from).into()
    };
    let log = on_both("export-incoming-iothread", setup, |s| {
        let socket = s.dir.path("nbd.sock").display().to_string();
        s.cmd("nbd-server-start", json!({"addr": {"type": "unix", "data": {"path": socket}}}));
        s.cmd("block-export-add", json!({"type": "nbd", "id": "exp0", "node-name": "node0", "iothread": "iothr0"}));
        s.active("node0");
        let read = QemuIo::open_with(&nbd_uri(&s.dir.path("nbd.sock"), "node0"), "-r").cmd("read -P 0 0 64k");
        s.note(json!({ "qemu-io": read }));
        let unknown = json!({"type": "nbd", "id": "exp1", "node-name": "node0", "name": "n1", "iothread": "nope"});
        s.cmd("block-export-add", unknown);
    });
    assert_eq!(outcomes(&log), ["ok", "ok", "iothread \"nope\" not found"]);
    assert_eq!(activity(&log), [true], "the export took the node over");
    assert_eq!(noted(&log, "qemu-io"), "read 65536/65536 bytes at offset 0");
}

/// A QEMU without a guest OS (TCG, no default devices, no display): the
/// block layer is what the scenarios look at. Its output (what HMP's
/// qemu-io says) goes to a log; it is killed on drop.
struct Vm {
    child: Child,
    qmp: Qmp,
    log: std::path::PathBuf,
}

impl Vm {
    fn launch(dir: &Scratch, name: &str, args: &[String]) -> Self {
        let socket = dir.path(&format!("{name}.qmp"));
        let log = dir.path(&format!("{name}.log"));
        let output = std::fs::File::create(&log).unwrap();
        let mut child = Command::new("qemu-system-x86_64")
            .args(["-accel", "tcg", "-nodefaults", "-display", "none", "-qmp"])
            .arg(format!("unix:{},server=on,wait=off", socket.display()))
            .args(args)
            .stdin(Stdio::null())
            .stdout(output.try_clone().unwrap())
            .stderr(output)
            .spawn()
            .expect("run qemu-system-x86_64");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !socket.exists() {
            assert!(
                child.try_wait().unwrap().is_none(),
                "QEMU {name} exited: {}",
                std::fs::read_to_string(&log).unwrap()
            );
            assert!(Instant::now() < deadline, "QEMU {name} did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        Self { qmp: Qmp::connect(&socket), child, log }
    }

    /// Runs `command` (qemu-io's) on device `qdev`'s block backend over
    /// HMP, as the iotests' hmp_qemu_io; its answer.
    fn qemu_io(&mut self, qdev: &str, command: &str) -> Value {
        let line = format!("qemu-io -d {qdev} \"{command}\"");
        self.qmp.answer("human-monitor-command", json!({ "command-line": line }))
    }

    /// Quits; what it wrote, timings left out.
    fn quit(mut self) -> Vec<String> {
        self.qmp.answer("quit", json!({}));
        let _ = self.child.wait();
        let text = std::fs::read_to_string(&self.log).unwrap();
        text.lines().filter(|l| !l.contains(" ops; ")).map(String::from).collect()
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The options that let QEMU share its RAM with a vhost-user back-end.
fn shared_memory() -> Vec<String> {
    ["-m", "128M", "-object", "memory-backend-memfd,id=mem,size=128M,share=on", "-machine", "memory-backend=mem"]
        .map(String::from)
        .into()
}

/// iothreads-nbd-export, with the guest's disk served by the daemon: a
/// qcow2 node on an I/O thread, used by a guest over vhost-user-blk and
/// exported over NBD to a qemu-io; the guest is reset ten times (its
/// device stopped and started again each time); the guest, the daemon and
/// the NBD client go on.
#[test]
fn iothreads_nbd_export() {
    let setup = |dir: &Scratch| {
        let disk = dir.path("disk1.img").display().to_string();
        ok("qemu-img", &["create", "-q", "-f", "qcow2", &disk, "10M"]);
        let vhost = format!(
            "type=vhost-user-blk,id=v0,node-name=disk,addr.type=unix,addr.path={},writable=on,iothread=iothread0",
            dir.path("vhost.sock").display()
        );
        [
            "--object",
            "iothread,id=iothread0",
            "--blockdev",
            &format!("file,node-name=disk-file,filename={disk}"),
            "--blockdev",
            "qcow2,node-name=disk,file=disk-file",
            "--export",
            &vhost,
        ]
        .map(String::from)
        .into()
    };
    let log = on_both("iothreads-nbd-export", setup, |s| {
        let socket = s.dir.path("nbd.sock").display().to_string();
        s.cmd("nbd-server-start", json!({"addr": {"type": "unix", "data": {"path": socket}}}));
        s.cmd("block-export-add", json!({"type": "nbd", "id": "exp0", "node-name": "disk", "writable": true}));
        let mut qemu_io = QemuIo::open(&nbd_uri(&s.dir.path("nbd.sock"), "disk"));
        let mut args = shared_memory();
        let chardev = format!("socket,id=vu,path={}", s.dir.path("vhost.sock").display());
        args.extend(["-chardev", &chardev, "-device", "vhost-user-blk-pci,chardev=vu,id=virtio0"].map(String::from));
        let mut vm = Vm::launch(s.dir, "vm", &args);
        for _ in 0..10 {
            let reset = vm.qmp.answer("system_reset", json!({}));
            s.note(json!({ "system_reset": reset }));
            std::thread::sleep(Duration::from_millis(100));
        }
        let status = vm.qmp.answer("query-status", json!({}));
        s.note(json!({ "status": status }));
        let said = ["write -P 5 0 64k", "read -P 5 0 64k"].map(|c| qemu_io.cmd(c));
        s.note(json!({ "qemu-io": said }));
        drop(qemu_io);
        vm.quit();
        s.active("disk");
    });
    let resets = log.iter().filter(|v| v.get("system_reset") == Some(&json!({"return": {}}))).count();
    assert_eq!(resets, 10);
    assert_eq!(noted(&log, "status"), &json!({"return": {"running": true, "status": "running"}}));
    let said = ["wrote 65536/65536 bytes at offset 0", "read 65536/65536 bytes at offset 0"];
    assert_eq!(noted(&log, "qemu-io"), &json!(said));
    assert_eq!(outcomes(&log), ["ok", "ok"]);
}

/// qsd-migrate's daemon: qcow2 `disk-fmt` on `image`, exported over NBD
/// (`nbd-NAME.sock` in `dir`) with allow-inactive; `active` says whether
/// its nodes start active (the source) or not (the destination).
fn migrating_daemon(dir: &Scratch, image: &Path, name: &str, active: bool) -> Vec<String> {
    let off = if active { "" } else { ",active=off" };
    let socket = dir.path(&format!("nbd-{name}.sock"));
    [
        "--blockdev".into(),
        format!("file,node-name=disk-file,filename={}{off}", image.display()),
        "--blockdev".into(),
        format!("qcow2,file=disk-file,node-name=disk-fmt{off}"),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", socket.display()),
        "--export".into(),
        "nbd,id=exp0,node-name=disk-fmt,writable=true,allow-inactive=true".into(),
    ]
    .into()
}

/// A QEMU whose virtio-blk disk `virtio0` is the NBD export on `socket`.
fn nbd_guest(dir: &Scratch, name: &str, socket: &Path, incoming: Option<&Path>) -> Vm {
    let mut args: Vec<String> = vec![
        "-blockdev".into(),
        format!("nbd,node-name=disk,server.type=unix,server.path={},export=disk-fmt", socket.display()),
        "-device".into(),
        "virtio-blk,drive=disk,id=virtio0".into(),
    ];
    if let Some(socket) = incoming {
        args.extend(["-incoming".into(), format!("unix:{}", socket.display())]);
    }
    Vm::launch(dir, name, &args)
}

const BACKEND: &str = "virtio0/virtio-backend";

/// Runs qemu-io `command` in `vm`'s disk; logs the HMP answer.
fn guest_io(s: &mut Session, vm: &mut Vm, command: &str) {
    let answer = vm.qemu_io(BACKEND, command);
    s.note(json!({ "hmp": command, "answer": answer }));
}

/// qsd-migrate: a guest whose disk is an NBD export migrates to a QEMU
/// served by a second daemon; before the switch-over the source's daemon
/// hands the image over (inactivates it) and the destination's takes it
/// (activates it): both sides read meanwhile, and afterwards the
/// destination reads what the source wrote and writes on.
#[test]
fn qsd_migrate() {
    let setup = |dir: &Scratch| {
        let image = dir.path("disk.img");
        ok("qemu-img", &["create", "-q", "-f", "qcow2", &image.display().to_string(), "10M"]);
        migrating_daemon(dir, &image, "src", true)
    };
    let log = on_both("qsd-migrate", setup, |s| {
        let mut src = nbd_guest(s.dir, "vm-src", &s.dir.path("nbd-src.sock"), None);
        let qmp_dst = s.dir.path("qsd-dst.qmp");
        let mut dst_args = migrating_daemon(s.dir, &s.dir.path("disk.img"), "dst", false);
        dst_args.extend(monitor(&qmp_dst));
        let dst_daemon_dir =
            Scratch::new(&format!("qsd-migrate-dst-{}", s.dir.0.file_name().unwrap().to_string_lossy()));
        let dst_daemon = (s.start)(&dst_daemon_dir, &dst_args);
        let mut qsd_dst = Qmp::connect(&qmp_dst);
        let migration = s.dir.path("migrate.sock");
        let mut dst = nbd_guest(s.dir, "vm-dst", &s.dir.path("nbd-dst.sock"), Some(&migration));

        guest_io(s, &mut src, "write -P 0x11 0 4k");
        guest_io(s, &mut src, "read -P 0x11 0 4k");

        let caps = json!({"capabilities": [
            {"capability": "events", "state": true},
            {"capability": "pause-before-switchover", "state": true},
        ]});
        for vm in [&mut src, &mut dst] {
            let answer = vm.qmp.answer("migrate-set-capabilities", caps.clone());
            s.note(answer);
        }
        let uri = format!("unix:{}", migration.display());
        s.note(src.qmp.answer("migrate", json!({ "uri": uri })));
        src.qmp.await_event("MIGRATION", json!({"status": "pre-switchover"}));

        s.cmd("blockdev-set-active", json!({"active": false}));
        guest_io(s, &mut src, "read -P 0x11 0 4k");
        guest_io(s, &mut dst, "read 0 4k");
        s.note(qsd_dst.answer("blockdev-set-active", json!({"active": true})));

        s.note(src.qmp.answer("migrate-continue", json!({"state": "pre-switchover"})));
        dst.qmp.await_event("MIGRATION", json!({"status": "completed"}));
        guest_io(s, &mut dst, "read -P 0x11 0 4k");
        guest_io(s, &mut dst, "write -P 0x22 0 4k");
        guest_io(s, &mut dst, "read -P 0x22 0 4k");

        s.note(json!({ "src-log": src.quit() }));
        s.note(json!({ "dst-log": dst.quit() }));
        drop(dst_daemon);
    });
    let answers: Vec<&Value> = log.iter().filter_map(|v| v.get("answer")).collect();
    assert_eq!(answers, [&json!({"return": ""}); 7], "every qemu-io over HMP ran");
    assert_eq!(outcomes(&log), ["ok"; 6]);
    let (wrote, read) = ("wrote 4096/4096 bytes at offset 0", "read 4096/4096 bytes at offset 0");
    assert_eq!(noted(&log, "src-log"), &json!([wrote, read, read]));
    assert_eq!(noted(&log, "dst-log"), &json!([read, read, wrote, read]));
}
