//! The monitor against QEMU's own Python client, `qemu.qmp`, which sends
//! messages back to back, without newlines.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use serde_json::{Value, json};

/// Connects, runs commands, then waits for a line on stdin before pulling an
/// event; prints each result as a line of JSON.
const SCRIPT: &str = r#"
import json, sys
try:
    from qemu.qmp.legacy import QEMUMonitorProtocol
except ImportError as e:
    sys.exit(f"the Python module qemu.qmp is missing (pip install qemu.qmp): {e}")

qmp = QEMUMonitorProtocol(sys.argv[1])
print(json.dumps(qmp.connect()), flush=True)
print(json.dumps(qmp.cmd('echo', text='{"quoted"}', nested=[[1], {'a': None}])), flush=True)
print(json.dumps(qmp.cmd_raw('fail')), flush=True)
print(json.dumps(qmp.cmd_raw('echo', {'n': 2})), flush=True)
sys.stdin.readline()
print(json.dumps(qmp.pull_event(wait=20.0)), flush=True)
qmp.close()
"#;

#[test]
fn qemu_python_client() {
    let (server, events) = common::server("python");
    let mut python = Command::new("python3")
        .args(["-c", SCRIPT])
        .arg(server.path().unwrap())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut stdout = BufReader::new(python.stdout.take().unwrap());
    let mut greeting = String::new();
    stdout.read_line(&mut greeting).unwrap();
    // The greeting printed, the client has negotiated: the event reaches it.
    if !greeting.is_empty() {
        events.emit("BLOCK_IO_ERROR", json!({"device": "disk0"}));
    }
    python.stdin.take().unwrap().write_all(b"\n").unwrap();
    let output = python.wait_with_output().unwrap();
    assert!(output.status.success(), "python failed: {}", String::from_utf8_lossy(&output.stderr));

    let lines: Vec<Value> = [greeting]
        .into_iter()
        .chain(stdout.lines().map(Result::unwrap))
        .map(|l| serde_json::from_str(&l).unwrap())
        .collect();
    let [greeting, echo, fail, raw, event] = &lines[..] else { panic!("python printed {lines:?}") };
    assert_eq!(greeting["QMP"]["capabilities"], json!(["oob"]));
    assert_eq!(*echo, json!({"text": "{\"quoted\"}", "nested": [[1], {"a": null}]}));
    assert_eq!(fail["error"], json!({"class": "DeviceNotFound", "desc": "Device 'nope' not found"}), "{fail}");
    assert_eq!(raw["return"], json!({"n": 2}));
    assert_eq!((&event["event"], &event["data"]), (&json!("BLOCK_IO_ERROR"), &json!({"device": "disk0"})), "{event}");
}
