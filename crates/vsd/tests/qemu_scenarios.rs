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
use common::{Daemon, Scratch, VSD, monitor, ok, run};
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

/// The states inactive-node-nbd.out shows, in order.
const INACTIVE_NODE_STATES: [bool; 32] = [
    false, true, false, true, false, false, // exports activate unless allow-inactive
    true, true, false, // inactivating with an export
    true, true, false, false, // with a parent
    false, true, false, false, // an active overlay goes inactive with its base
    false, false, false, // the chain the jobs are refused on
    true, false, false, true, // mirror: the base activated
    true, true, true, false, // the chain activated, the target not
    false, false, false, true, // backup: the other way round
];

/// The refusals of inactive-node-nbd.out's jobs, in order (generated node
/// names filtered).
const INACTIVE_JOB_REFUSALS: [&str; 8] = [
    "Could not create node: Inactive 'snap-fmt' can't be a file child of active 'NODE_NAME'",
    "Inactive 'snap-fmt' can't be a backing child of active 'NODE_NAME'",
    "Inactive 'snap-fmt' can't be a backing child of active 'NODE_NAME'",
    "Inactive 'snap-fmt' can't be a backing child of active 'NODE_NAME'",
    "Inactive 'snap2-fmt' can't be a backing child of active 'NODE_NAME'",
    "Permission 'write' unavailable on inactive node",
    "Could not create node: Inactive 'target-fmt' can't be a target child of active 'NODE_NAME'",
    "Could not create node: Inactive 'snap2-fmt' can't be a file child of active 'NODE_NAME'",
];

/// inactive-node-nbd, all of it a storage daemon can run: exports of
/// inactive nodes, activation with parents, active nodes refused over
/// inactive ones, resizing, snapshots of an inactive node, block jobs on
/// inactive nodes, and what an NBD client may do on an export whose node
/// is inactive. Left out: `cont`, which a storage daemon has not, and the
/// read-only node of QEMU's later version of the test.
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
        inactive_snapshot(s);
        inactive_jobs(s);
        inactive_export_access(s);
    });
    assert_eq!(activity(&log), INACTIVE_NODE_STATES);
    let refused = |desc: &str| outcomes(&log).iter().filter(|o| o.as_str() == desc).count();
    assert_eq!(refused("Failed to inactivate node: Operation not permitted"), 2);
    assert_eq!(refused("Node has active parent node"), 1);
    assert_eq!(refused("Inactive 'disk-fmt' can't be a file child of active 'disk-filter'"), 2);
    assert_eq!(refused("Permission 'resize' unavailable on inactive node"), 1);
    let jobs: Vec<String> =
        outcomes(&log).into_iter().filter(|o| INACTIVE_JOB_REFUSALS.contains(&o.as_str())).collect();
    assert_eq!(jobs, INACTIVE_JOB_REFUSALS.map(String::from));
    // Made, then dropped: the jobs QEMU refuses once made (the two
    // intermediate commits, the mirror onto an inactive target).
    let made = log.iter().filter(|v| v["events"] == json!([job_status("created"), job_status("null")])).count();
    assert_eq!(made, 3);
    assert_eq!(noted(&log, "jobs-left"), &json!([]));
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
    let filter = json!({"driver": "raw", "file": "disk-fmt", "node-name": "disk-filter"});
    s.cmd("blockdev-add", filter.clone());
    s.cmd("blockdev-add", with_active(filter.clone(), true));
    s.cmd("blockdev-add", with_active(filter, false));
    s.cmd("blockdev-del", json!({"node-name": "disk-filter"}));
    s.cmd("block_resize", json!({"node-name": "disk-fmt", "size": 16 << 20}));
}

/// `options` with `active` set.
fn with_active(mut options: Value, active: bool) -> Value {
    options["active"] = json!(active);
    options
}

/// The `JOB_STATUS_CHANGE` of job `job0` to `status`, as logged.
fn job_status(status: &str) -> Value {
    json!(["JOB_STATUS_CHANGE", {"id": "job0", "status": status}])
}

/// Logs whether each of `nodes` is active.
fn states(s: &mut Session, nodes: &[&str]) {
    nodes.iter().for_each(|node| s.active(node));
}

/// Runs a job command; logs it, its answer and the events it sent
/// meanwhile (QEMU makes some jobs before it refuses them). Both daemons
/// send a command's events before its answer.
fn job_cmd(s: &mut Session, command: &str, args: Value) {
    let before = s.qmp.event_log().len();
    s.cmd(command, args);
    let sent = s.qmp.event_log().split_off(before);
    s.note(json!({ "events": sent }));
}

/// The overlay `snap-fmt` inactive-node-nbd snapshots `disk-fmt` with.
fn snap_fmt() -> Value {
    json!({"driver": "qcow2", "node-name": "snap-fmt", "file": "snap-file", "backing": null})
}

/// inactive-node-nbd's snapshots of the inactive `disk-fmt`: an active
/// overlay is made inactive with it, an inactive one just taken.
fn inactive_snapshot(s: &mut Session) {
    let snapshot = json!({"node": "disk-fmt", "overlay": "snap-fmt"});
    s.cmd("blockdev-add", snap_fmt());
    states(s, &["disk-fmt", "snap-fmt"]);
    s.cmd("blockdev-snapshot", snapshot.clone());
    states(s, &["disk-fmt", "snap-fmt"]);
    s.cmd("blockdev-del", json!({"node-name": "snap-fmt"}));
    s.cmd("blockdev-add", with_active(snap_fmt(), false));
    s.cmd("blockdev-snapshot", snapshot);
}

/// inactive-node-nbd's block jobs on inactive nodes, each refused: a
/// stream and commits of the inactive chain, mirrors and backups with an
/// inactive source or target.
fn inactive_jobs(s: &mut Session) {
    let [chain, all] =
        [&["disk-fmt", "snap-fmt", "snap2-fmt"][..], &["disk-fmt", "snap-fmt", "snap2-fmt", "target-fmt"]];
    job_cmd(s, "block-stream", json!({"device": "snap-fmt"}));
    job_cmd(s, "block-commit", json!({"job-id": "job0", "device": "snap-fmt"}));
    let snap2 = json!({"driver": "qcow2", "node-name": "snap2-fmt", "file": "snap2-file", "backing": "snap-fmt"});
    s.cmd("blockdev-add", with_active(snap2, false));
    states(s, chain);
    let intermediate = json!({"job-id": "job0", "device": "snap2-fmt", "top-node": "snap-fmt"});
    job_cmd(s, "block-commit", intermediate.clone());
    set_active(s, "disk-fmt", true);
    job_cmd(s, "block-commit", intermediate);
    let copy = json!({"job-id": "job0", "device": "snap2-fmt", "target": "target-fmt", "sync": "full"});
    job_cmd(s, "blockdev-mirror", copy.clone());
    states(s, all);
    set_active(s, "snap2-fmt", true);
    set_active(s, "target-fmt", false);
    states(s, all);
    job_cmd(s, "blockdev-mirror", copy.clone());
    job_cmd(s, "blockdev-backup", copy.clone());
    set_active(s, "snap2-fmt", false);
    set_active(s, "target-fmt", true);
    states(s, all);
    job_cmd(s, "blockdev-backup", copy);
    let jobs = s.qmp.ok("query-jobs", json!({}));
    s.note(json!({ "jobs-left": jobs }));
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

/// inactive-node-nbd's images and nodes, `snap.qcow2` with an internal
/// snapshot `old`.
fn inactive_snapshotted_setup(dir: &Scratch) -> Vec<String> {
    let args = inactive_node_setup(dir);
    ok("qemu-img", &["snapshot", "-c", "old", &dir.path("snap.qcow2").display().to_string()]);
    args
}

/// What `image` says of itself: its snapshots' names, whether it names a
/// backing file, whether `qemu-img check` finds it clean.
fn image_facts(image: &Path) -> Value {
    let image = image.display().to_string();
    let info: Value = serde_json::from_str(&ok("qemu-img", &["info", "-U", "--output=json", &image])).unwrap();
    let snapshots: Vec<&Value> =
        info["snapshots"].as_array().map(|s| s.iter().map(|s| &s["name"]).collect()).unwrap_or_default();
    let clean = run("qemu-img", &["check", "-U", "-q", &image]).status.success();
    json!({"snapshots": snapshots, "backing": info["backing-filename"].is_string(), "clean": clean})
}

/// The other commands on inactive nodes, as QSD answers them: dirty
/// bitmaps (taken), internal snapshots (refused, and none found to
/// delete), an external snapshot made by `blockdev-snapshot-sync`, a
/// `blockdev-create` job (fails), `drive-mirror` and `drive-backup` of an
/// inactive node (refused, their new images made first, as QEMU makes
/// them); no image is changed but the new ones, and no job is left.
#[test]
fn inactive_node_commands() {
    let log = on_both("inactive-commands", inactive_snapshotted_setup, |s| {
        s.cmd("blockdev-add", with_active(snap_fmt(), false));
        for (command, args) in [
            ("block-dirty-bitmap-add", json!({"node": "snap-fmt", "name": "b0"})),
            ("block-dirty-bitmap-add", json!({"node": "disk-fmt", "name": "b1"})),
            ("block-dirty-bitmap-disable", json!({"node": "disk-fmt", "name": "b1"})),
            ("block-dirty-bitmap-enable", json!({"node": "disk-fmt", "name": "b1"})),
            ("block-dirty-bitmap-clear", json!({"node": "disk-fmt", "name": "b1"})),
            ("block-dirty-bitmap-merge", json!({"node": "disk-fmt", "target": "b1", "bitmaps": ["b1"]})),
            ("block-dirty-bitmap-remove", json!({"node": "disk-fmt", "name": "b1"})),
            ("block_resize", json!({"node-name": "snap-fmt", "size": 16 << 20})),
            ("blockdev-snapshot-internal-sync", json!({"device": "snap-fmt", "name": "new"})),
        ] {
            s.cmd(command, args);
        }
        let overlay = s.dir.path("overlay.qcow2");
        let sync = json!({"node-name": "snap-fmt", "snapshot-file": overlay, "snapshot-node-name": "overlay"});
        s.cmd("blockdev-snapshot-sync", sync);
        s.note(json!({ "overlay": image_facts(&overlay) }));
        s.active("snap-fmt");
        // Inactive as its only parent is.
        set_active(s, "disk-file", false);
        let create = json!({"driver": "qcow2", "file": "disk-file", "size": 1 << 20});
        s.cmd("blockdev-create", json!({"job-id": "job0", "options": create}));
        s.qmp.await_event("JOB_STATUS_CHANGE", json!({"id": "job0", "status": "concluded"}));
        let jobs = s.qmp.ok("query-jobs", json!({}));
        s.note(json!({ "create": jobs[0]["error"] }));
        s.cmd("job-dismiss", json!({"id": "job0"}));
        let made = |name: &str| s.dir.path(name).display().to_string();
        let mirror = json!({"job-id": "job0", "device": "snap-fmt", "target": made("m.qcow2"), "sync": "full"});
        job_cmd(s, "drive-mirror", mirror);
        let backup = json!({"job-id": "job0", "device": "snap-fmt", "target": made("b.qcow2"), "sync": "full"});
        job_cmd(s, "drive-backup", backup);
        let made = ["m.qcow2", "b.qcow2"].map(|name| s.dir.path(name).exists());
        s.note(json!({ "made": made }));
        let jobs = s.qmp.ok("query-jobs", json!({}));
        s.note(json!({ "jobs-left": jobs }));
        s.note(json!({ "snap": image_facts(&s.dir.path("snap.qcow2")) }));
        s.note(json!({ "disk-size": std::fs::metadata(s.dir.path("disk.img")).unwrap().len() }));
    });
    let answers = outcomes(&log);
    assert!(answers[..8].iter().all(|a| a == "ok"), "bitmaps are taken on inactive nodes: {answers:?}");
    assert_eq!(answers[8], "Permission 'resize' unavailable on inactive node");
    assert_eq!(answers[9], "Block format 'qcow2' used by device 'snap-fmt' does not support internal snapshots");
    assert_eq!(answers[10], "ok", "blockdev-snapshot-sync");
    assert_eq!(noted(&log, "overlay"), &json!({"snapshots": [], "backing": true, "clean": true}));
    assert_eq!(noted(&log, "create"), "Permission 'write, resize' unavailable on inactive node");
    let refused =
        ["backing", "file"].map(|role| format!("Inactive 'snap-fmt' can't be a {role} child of active 'NODE_NAME'"));
    assert_eq!(answers[answers.len() - 2..], [refused[0].clone(), format!("Could not create node: {}", refused[1])]);
    assert_eq!(noted(&log, "made"), &json!([true, true]));
    assert_eq!(noted(&log, "jobs-left"), &json!([]));
    assert_eq!(noted(&log, "snap"), &json!({"snapshots": ["old"], "backing": true, "clean": true}));
    assert_eq!(noted(&log, "disk-size"), &json!(10 << 20));
}

/// Deleting an internal snapshot of an inactive node: QSD 10 writes the
/// image anyway and aborts on its own assertion; vsd refuses and writes
/// nothing.
#[test]
fn inactive_node_snapshot_deletion() {
    let dir = Scratch::new("inactive-snapshot-delete-vsd");
    let socket = dir.path("qmp.sock");
    let mut args = inactive_snapshotted_setup(&dir);
    args.extend(monitor(&socket));
    let _vsd = Daemon::vsd(&dir, &args);
    let mut qmp = Qmp::connect(&socket);
    qmp.ok("blockdev-add", with_active(snap_fmt(), false));
    let refused = qmp.answer("blockdev-snapshot-delete-internal-sync", json!({"device": "snap-fmt", "name": "old"}));
    let desc = refused["error"]["desc"].as_str().unwrap_or_default();
    assert!(desc.starts_with("Failed to remove snapshot from snapshot list: "), "{refused}");
    assert_eq!(image_facts(&dir.path("snap.qcow2"))["snapshots"], json!(["old"]));
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
