//! The QMP server, driven over its socket.

mod common;

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::thread;
use std::time::Duration;

use common::{RawClient, error_of, server, socket_path};
use serde_json::{Map, Value, json};
use vsd_control::client::{ClientError, QmpClient};
use vsd_control::qmp::{Dispatch, ErrorClass, Events, QmpError, QmpServer};

#[test]
fn greeting_names_the_qemu_release_vsd_speaks_and_offers_oob() {
    let (server, _) = server("greeting");
    let greeting = RawClient::connect(&server).greeting;
    let version = &greeting["QMP"]["version"];
    assert_eq!(version["qemu"], json!({"major": 10, "minor": 0, "micro": 0}));
    assert_eq!(version["package"], json!(format!("vsd {}", env!("CARGO_PKG_VERSION"))));
    assert_eq!(greeting["QMP"]["capabilities"], json!(["oob"]));
}

#[test]
fn only_qmp_capabilities_is_accepted_before_negotiation() {
    let (server, _) = server("negotiation");
    let mut client = RawClient::connect(&server);
    for command in [r#"{"execute": "echo"}"#, r#"{"execute": "no-such-command"}"#] {
        let reply = client.command(command);
        assert_eq!(error_of(&reply), ("CommandNotFound", "Expecting capabilities negotiation with 'qmp_capabilities'"));
    }
    let refusals = [
        (r#"{"enable": ["oob", "foo"]}"#, "Parameter 'null' does not accept value 'foo'"),
        (r#"{"enable": [1]}"#, "Invalid parameter type for 'enable[0]', expected: string"),
        (r#"{"enable": "oob"}"#, "Invalid parameter type for 'enable', expected: array"),
        (r#"{"oob": true}"#, "Parameter 'oob' is unexpected"),
    ];
    for (arguments, words) in refusals {
        let reply = client.command(&format!(r#"{{"execute": "qmp_capabilities", "arguments": {arguments}}}"#));
        assert_eq!(error_of(&reply), ("GenericError", words), "{arguments}");
    }
    let reply = client.command(r#"{"execute": "echo"}"#);
    assert_eq!(error_of(&reply).0, "CommandNotFound", "a failed negotiation leaves negotiation mode on");

    let reply = client.command(r#"{"execute": "qmp_capabilities", "arguments": {"enable": []}}"#);
    assert_eq!(reply, json!({"return": {}}));
    let reply = client.command(r#"{"execute": "qmp_capabilities"}"#);
    assert_eq!(error_of(&reply), ("CommandNotFound", "Capabilities negotiation is already complete, command ignored"));
}

#[test]
fn commands_reach_the_dispatcher_after_negotiation() {
    let (server, _) = server("commands");
    let mut client = RawClient::negotiated(&server);
    let reply = client.command(r#"{"execute": "echo", "arguments": {"a": [1, {"b": "}"}]}}"#);
    assert_eq!(reply, json!({"return": {"a": [1, {"b": "}"}]}}));
    assert_eq!(client.command(r#"{"execute": "echo"}"#), json!({"return": {}}));
    assert_eq!(client.command(r#"{"execute": "nothing"}"#), json!({"return": {}}));
    assert_eq!(error_of(&client.command(r#"{"execute": "fail"}"#)), ("DeviceNotFound", "Device 'nope' not found"));
    let reply = client.command(r#"{"execute": "frobnicate"}"#);
    assert_eq!(error_of(&reply), ("CommandNotFound", "The command frobnicate has not been found"));
}

/// `wait` blocks until the test lets it go; `echo` may run out-of-band.
struct Gate(Mutex<mpsc::Receiver<()>>);

impl Dispatch for Gate {
    fn execute(&self, command: &str, arguments: Map<String, Value>) -> Result<Value, QmpError> {
        if command == "wait" {
            self.0.lock().unwrap().recv_timeout(common::TIMEOUT).expect("let go");
        }
        Ok(Value::Object(arguments))
    }

    fn execute_oob(&self, command: &str, arguments: Map<String, Value>) -> Result<Value, QmpError> {
        match command {
            "echo" => self.execute(command, arguments),
            _ => Err(QmpError::generic(format!("The command {command} does not support OOB"))),
        }
    }
}

#[test]
fn out_of_band_commands_are_answered_while_an_in_band_one_blocks() {
    let (let_go, gate) = mpsc::channel();
    let server = QmpServer::listen(&socket_path("oob"), Arc::new(Gate(Mutex::new(gate))), Events::new()).unwrap();
    let mut client = RawClient::connect(&server);
    let reply = client.command(r#"{"execute": "qmp_capabilities", "arguments": {"enable": ["oob", "oob"]}}"#);
    assert_eq!(reply, json!({"return": {}}));

    client.send(concat!(
        r#"{"execute": "wait", "id": 1}"#,
        r#"{"execute": "echo", "arguments": {"n": 2}, "id": 2}"#,
        r#"{"exec-oob": "echo", "arguments": {"n": 3}, "id": 3}"#,
        r#"{"exec-oob": "wait", "id": 4}"#,
        r#"{"exec-oob": 5, "id": 5}"#,
        r#"{"execute": "echo", "exec-oob": "echo", "id": 6}"#,
        "\n",
    ));
    // Answered at once, in the order sent: the in-band ones wait.
    assert_eq!(client.receive(), json!({"return": {"n": 3}, "id": 3}));
    let refusal = |id: u64, desc: &str| json!({"error": {"class": "GenericError", "desc": desc}, "id": id});
    assert_eq!(client.receive(), refusal(4, "The command wait does not support OOB"));
    // Malformed messages are in-band requests too, as in QEMU.
    let_go.send(()).unwrap();
    assert_eq!(client.receive(), json!({"return": {}, "id": 1}));
    assert_eq!(client.receive(), json!({"return": {"n": 2}, "id": 2}));
    assert_eq!(client.receive(), refusal(5, "QMP input member 'exec-oob' must be a string"));
    assert_eq!(client.receive(), refusal(6, "QMP input member 'execute' clashes with 'exec-oob'"));
}

#[test]
fn exec_oob_is_unexpected_unless_the_client_enabled_oob() {
    let (_let_go, gate) = mpsc::channel();
    let server = QmpServer::listen(&socket_path("no-oob"), Arc::new(Gate(Mutex::new(gate))), Events::new()).unwrap();
    let mut client = RawClient::negotiated(&server);
    let reply = client.command(r#"{"exec-oob": "echo", "id": 1}"#);
    assert_eq!(error_of(&reply), ("GenericError", "QMP input member 'exec-oob' is unexpected"));
}

#[test]
fn dispatcher_hears_of_successful_replies() {
    /// Like the daemon's `quit`: acts once its reply is out.
    struct Recorder(mpsc::Sender<String>);
    impl Dispatch for Recorder {
        fn execute(&self, command: &str, _: Map<String, Value>) -> Result<Value, QmpError> {
            if command == "quit" { Ok(Value::Null) } else { Err(QmpError::generic("no")) }
        }
        fn after_reply(&self, command: &str) {
            self.0.send(command.to_owned()).unwrap();
        }
    }
    let (sender, replied) = mpsc::channel();
    let server = QmpServer::listen(&socket_path("after-reply"), Arc::new(Recorder(sender)), Events::new()).unwrap();
    let mut client = RawClient::negotiated(&server);
    assert_eq!(error_of(&client.command(r#"{"execute": "fail"}"#)).1, "no");
    assert_eq!(client.command(r#"{"execute": "quit"}"#), json!({"return": {}}));
    assert_eq!(replied.recv_timeout(common::TIMEOUT).unwrap(), "quit", "neither fail nor qmp_capabilities");
}

#[test]
fn id_is_echoed_whatever_its_type() {
    let (server, _) = server("id");
    let mut client = RawClient::connect(&server);
    let reply = client.command(r#"{"execute": "echo", "id": 7}"#);
    assert_eq!(reply["id"], json!(7), "errors before negotiation too");
    assert_eq!(client.command(r#"{"execute": "qmp_capabilities", "id": "n"}"#), json!({"return": {}, "id": "n"}));
    for id in [json!(1), json!("one"), json!({"a": [1, "}"]}), json!(null)] {
        let reply = client.command(&json!({"execute": "echo", "arguments": {"x": 1}, "id": id}).to_string());
        assert_eq!(reply, json!({"return": {"x": 1}, "id": id}));
    }
    let reply = client.command(r#"{"execute": "fail", "id": [2]}"#);
    assert_eq!(reply["id"], json!([2]));
    let reply = client.command(r#"{"execute": "echo", "arguments": 3, "id": 3}"#);
    assert_eq!((error_of(&reply).0, &reply["id"]), ("GenericError", &json!(3)), "malformed input too");
}

#[test]
fn malformed_input_is_refused_in_qemu_words() {
    let (server, _) = server("malformed");
    let mut client = RawClient::negotiated(&server);
    let cases = [
        ("[1, 2]", "QMP input must be a JSON object"),
        (r#""execute""#, "QMP input must be a JSON object"),
        (r#"{"arguments": {}}"#, "QMP input lacks member 'execute'"),
        (r#"{"execute": ["echo"]}"#, "QMP input member 'execute' must be a string"),
        (r#"{"execute": "echo", "arguments": [1]}"#, "QMP input member 'arguments' must be an object"),
        (r#"{"execute": "echo", "extra": 1}"#, "QMP input member 'extra' is unexpected"),
        (r#"{"exec-oob": "echo"}"#, "QMP input member 'exec-oob' is unexpected"),
        ("}", "JSON parse error, stray '}'"),
        ("quit", "JSON parse error, stray 'q'"),
    ];
    for (input, desc) in cases {
        assert_eq!(error_of(&client.command(input)), ("GenericError", desc), "{input}");
    }
    for input in [r#"{"execute": echo}"#, "{\"execute\": \"\u{7}\"}", "{\"execute\": \"\\ud800\"}"] {
        let reply = client.command(input);
        let (class, desc) = error_of(&reply);
        assert!(class == "GenericError" && desc.starts_with("JSON parse error, "), "{input}: {reply}");
    }
    client.send(b"{\"execute\": \"\xff\"}\n");
    assert!(error_of(&client.receive()).1.starts_with("JSON parse error, "));
    assert_eq!(client.command(r#"{"execute": "echo", "id": "alive"}"#), json!({"return": {}, "id": "alive"}));
}

/// As qemu-storage-daemon: one error for the bad word, then the command
/// after it on the same line runs.
#[test]
fn a_bad_word_is_one_error_and_what_follows_it_runs() {
    let (server, _) = server("garbage");
    let mut client = RawClient::negotiated(&server);
    client.send("garbage {\"execute\": \"echo\", \"id\": 1}\n{\"execute\": \"echo\", \"id\": 2}\n");
    assert_eq!(error_of(&client.receive()), ("GenericError", "JSON parse error, stray 'g'"));
    assert_eq!(client.receive(), json!({"return": {}, "id": 1}));
    assert_eq!(client.receive(), json!({"return": {}, "id": 2}));
}

#[test]
fn input_need_not_be_split_in_lines() {
    let (server, _) = server("stream");
    let mut client = RawClient::negotiated(&server);
    client.send(r#"{"execute":"echo","id":1}{"execute":"echo","arguments":{"s":"\"}"},"id":2}"#);
    assert_eq!(client.receive(), json!({"return": {}, "id": 1}));
    assert_eq!(client.receive(), json!({"return": {"s": "\"}"}, "id": 2}));
    for part in [r#"{"execute":"ec"#, r#"ho","argu"#, r#"ments":{"n":[[3]]},"id":3"#, "}"] {
        client.send(part);
        thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(client.receive(), json!({"return": {"n": [[3]]}, "id": 3}));
}

#[test]
fn huge_line_is_refused_and_the_connection_survives() {
    let (server, _) = server("huge");
    let mut client = RawClient::negotiated(&server);
    let huge = format!("{{\"execute\": \"echo\", \"arguments\": {{\"x\": \"{}\"}}}}\n", "x".repeat(4 << 20));
    client.send(huge);
    let reply = client.receive();
    let (class, desc) = error_of(&reply);
    assert!(class == "GenericError" && desc.starts_with("JSON parse error, "), "{desc}");
    assert_eq!(client.command(r#"{"execute": "echo", "id": "next"}"#), json!({"return": {}, "id": "next"}));
}

#[test]
fn events_reach_only_negotiated_connections() {
    let (server, events) = server("events");
    let mut early = RawClient::negotiated(&server);
    let mut late = RawClient::connect(&server);
    events.emit("FIRST", json!({"n": 1}));
    let event = early.receive();
    assert_eq!((&event["event"], &event["data"]), (&json!("FIRST"), &json!({"n": 1})));
    assert!(event["timestamp"]["seconds"].as_u64().is_some_and(|s| s > 1_500_000_000), "{event}");
    assert!(event["timestamp"]["microseconds"].as_u64().is_some_and(|us| us < 1_000_000), "{event}");

    assert_eq!(late.command(r#"{"execute": "qmp_capabilities"}"#), json!({"return": {}}), "FIRST was not sent");
    events.emit("SECOND", json!({}));
    assert_eq!(late.receive()["event"], "SECOND");
    assert_eq!(early.receive()["event"], "SECOND");
}

#[test]
fn events_do_not_split_replies() {
    const EVENTS: usize = 200;
    let (server, events) = server("interleave");
    let mut client = RawClient::negotiated(&server);
    let emitter = thread::spawn(move || {
        for n in 0..EVENTS {
            events.emit("TICK", json!({"n": n, "padding": "e".repeat(10_000)}));
        }
    });
    let mut received = 0;
    let arguments = json!({"padding": "r".repeat(100_000)});
    for id in 0..20 {
        client.send(format!("{}\n", json!({"execute": "echo", "arguments": arguments, "id": id})));
        // `receive` fails on any line that is not exactly one message.
        let reply = loop {
            let message = client.receive();
            if message["event"] != "TICK" {
                break message;
            }
            assert_eq!(message["data"]["n"], json!(received));
            received += 1;
        };
        assert_eq!(reply, json!({"return": arguments, "id": id}));
    }
    while received < EVENTS {
        assert_eq!(client.receive()["data"]["n"], json!(received));
        received += 1;
    }
    emitter.join().unwrap();
}

/// A client that does not read holds up no one: events are emitted at
/// once and reach the client that reads; the other gets every one of them,
/// in order, once it reads, as long as they fit in what the monitor keeps
/// for it.
#[test]
fn a_client_that_does_not_read_holds_up_no_one() {
    const EVENTS: usize = 400;
    let (server, events) = server("slow-reader");
    let mut slow = RawClient::negotiated(&server);
    let mut reader = RawClient::negotiated(&server);
    // 4 KiB each: 1.6 MB in all, several times what a socket buffers.
    let padding = "p".repeat(4096);
    let emitter = thread::spawn(move || {
        for n in 0..EVENTS {
            events.emit("TICK", json!({"n": n, "padding": padding}));
        }
    });
    for n in 0..EVENTS {
        assert_eq!(reader.receive()["data"]["n"], json!(n), "the reading client");
    }
    emitter.join().unwrap();
    for n in 0..EVENTS {
        assert_eq!(slow.receive()["data"]["n"], json!(n), "the client that read late");
    }
    assert_eq!(slow.command(r#"{"execute": "nothing"}"#), json!({"return": {}}));
}

/// Past 4 MiB waiting, a client that does not read is disconnected; the
/// others go on.
#[test]
fn a_client_that_stops_reading_for_good_is_disconnected() {
    let (server, events) = server("stopped-reader");
    let mut stopped = RawClient::negotiated(&server);
    let mut reader = RawClient::negotiated(&server);
    let padding = "p".repeat(64 * 1024);
    // 6 MiB: more than the monitor keeps plus what the socket buffers.
    for n in 0..96 {
        events.emit("TICK", json!({"n": n, "padding": padding}));
        assert_eq!(reader.receive()["data"]["n"], json!(n));
    }
    let mut lines = 0;
    while stopped.try_receive().is_some() {
        lines += 1;
    }
    assert!(lines < 96, "all {lines} events reached a client that did not read");
    assert_eq!(reader.command(r#"{"execute": "nothing"}"#), json!({"return": {}}));
}

#[test]
fn clients_are_served_at_the_same_time() {
    let (server, _) = server("two");
    let mut first = RawClient::negotiated(&server);
    let mut second = RawClient::negotiated(&server);
    first.send(r#"{"execute": "echo", "arguments": {"who": "#);
    assert_eq!(second.command(r#"{"execute": "echo", "arguments": {"who": 2}}"#), json!({"return": {"who": 2}}));
    first.send("1}}\n");
    assert_eq!(first.receive(), json!({"return": {"who": 1}}));
}

#[test]
fn stale_socket_is_replaced() {
    let path = socket_path("stale");
    drop(UnixListener::bind(&path).unwrap());
    let (server, _) = server("stale");
    RawClient::negotiated(&server);
}

#[test]
fn socket_in_use_is_not_taken_over() {
    let (server, events) = server("in-use");
    let error = QmpServer::listen(server.path().unwrap(), Arc::new(common::FakeDispatch), events).err().unwrap();
    assert_eq!(error.kind(), std::io::ErrorKind::AddrInUse);
    assert!(error.to_string().contains(&*server.path().unwrap().to_string_lossy()), "{error}");
    RawClient::negotiated(&server);
}

#[test]
fn path_that_is_not_a_socket_is_left_alone() {
    let path = socket_path("not-a-socket");
    std::fs::write(&path, "data").unwrap();
    let error = QmpServer::listen(&path, Arc::new(common::FakeDispatch), Default::default()).err().unwrap();
    assert!(error.to_string().contains(&*path.to_string_lossy()), "{error}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "data");
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn dropping_the_server_removes_its_socket() {
    let (server, _) = server("drop");
    let path = server.path().unwrap().to_owned();
    let mut client = RawClient::negotiated(&server);
    drop(server);
    assert!(!path.exists());
    assert!(UnixStream::connect(&path).is_err());
    assert_eq!(client.command(r#"{"execute": "echo"}"#), json!({"return": {}}), "connections live on");
}

#[test]
fn socat_session() {
    let (server, _) = server("socat");
    let mut socat = Command::new("socat")
        .args(["-t", "10", "-", &format!("UNIX-CONNECT:{}", server.path().unwrap().display())])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("socat");
    let input = "{\"execute\": \"qmp_capabilities\"}\n{ \"execute\": \"echo\",\n  \"arguments\": {\"a\": 1} }\n";
    socat.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let output = socat.wait_with_output().unwrap();
    let lines: Vec<Value> =
        String::from_utf8(output.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert_eq!(lines[1..], [json!({"return": {}}), json!({"return": {"a": 1}})]);
}

#[test]
fn client_runs_commands() {
    let (server, events) = server("client");
    let mut client = QmpClient::connect(server.path().unwrap()).expect("connect");
    assert_eq!(client.execute("echo", json!({"a": 1})).unwrap(), json!({"a": 1}));
    assert_eq!(client.execute("nothing", Value::Null).unwrap(), json!({}));
    events.emit("SKIPPED", json!({}));
    match client.execute("fail", Value::Null) {
        Err(ClientError::Qmp(error)) => assert_eq!(error.class, ErrorClass::DeviceNotFound),
        other => panic!("{other:?}"),
    }
    assert_eq!(client.execute("echo", json!({"b": 2})).unwrap(), json!({"b": 2}), "the event was skipped");
}

#[test]
fn client_refuses_a_server_that_is_not_qmp() {
    let path = socket_path("client-not-qmp");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let server = thread::spawn(move || listener.accept().unwrap().0.write_all(b"{\"hello\": 1}\n").unwrap());
    let error = QmpClient::connect(&path).err().unwrap();
    assert_eq!(error.kind(), std::io::ErrorKind::InvalidData, "{error}");
    server.join().unwrap();
    std::fs::remove_file(&path).unwrap();
}
