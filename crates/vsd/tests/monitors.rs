//! Monitors as qemu-storage-daemon has them: QMP on standard input and
//! output (how QEMU's iotests drive QSD), on TCP, on an inherited socket,
//! pretty-printed, and a socket that waits for its first client. Every
//! scenario runs the same script against vsd and against the real
//! qemu-storage-daemon, and compares what each did.

mod common;

use std::io::{BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use common::{Scratch, VSD};
use serde_json::{Value, json};

const QSD: &str = "qemu-storage-daemon";

/// Generous: only a broken daemon takes this long.
const TIMEOUT: Duration = Duration::from_secs(20);

/// What a client saw of one scripted session, in the terms vsd and QSD
/// must agree on (their versions and capabilities differ, for one).
#[derive(Debug, PartialEq)]
struct Outcome {
    /// The greeting's members, and its version's.
    greeting: Vec<String>,
    /// The error class of a command sent before `qmp_capabilities`.
    before_negotiation: String,
    negotiation: Value,
    /// The members of `query-version`'s reply, and the id it echoed.
    version: Vec<String>,
    id: Value,
    /// The error class of an unknown command.
    unknown: String,
    /// The statuses a `blockdev-create` job went through, from its events.
    job: Vec<String>,
    dismissed: Value,
    quit: Value,
    /// After `quit`'s reply, the stream ends.
    ended: bool,
}

/// Reads whole JSON messages, one line each or pretty-printed over many.
struct Messages<R: Read> {
    values: serde_json::StreamDeserializer<'static, serde_json::de::IoRead<BufReader<R>>, Value>,
    /// Events read while waiting for a reply.
    events: Vec<Value>,
}

impl<R: Read> Messages<R> {
    fn new(reader: R) -> Self {
        Self { values: serde_json::Deserializer::from_reader(BufReader::new(reader)).into_iter(), events: Vec::new() }
    }

    fn next(&mut self) -> Option<Value> {
        self.values.next().map(|value| value.expect("a JSON message"))
    }

    /// The next message that is not an event.
    fn reply(&mut self) -> Value {
        loop {
            let message = self.next().expect("a reply before the stream ended");
            match message.get("event") {
                Some(_) => self.events.push(message),
                None => return message,
            }
        }
    }

    /// Reads until event `name` whose data has `status`.
    fn await_status(&mut self, name: &str, status: &str) {
        while !self.events.iter().any(|e| e["event"] == name && e["data"]["status"] == status) {
            let message = self.next().expect("an event before the stream ended");
            if message.get("event").is_some() {
                self.events.push(message);
            }
        }
    }
}

fn keys(value: &Value) -> Vec<String> {
    value.as_object().map(|members| members.keys().cloned().collect()).unwrap_or_default()
}

fn error_class(reply: &Value) -> String {
    reply["error"]["class"].as_str().unwrap_or_else(|| panic!("an error, not {reply}")).to_owned()
}

/// The script: greeting, a command too early, negotiation, a command, an
/// unknown one, a job with its events, and `quit`. `image` is created by
/// the job.
fn script(input: &mut impl Write, output: impl Read, image: &Path) -> Outcome {
    let mut messages = Messages::new(output);
    let mut send = |message: Value| input.write_all(format!("{message}\n").as_bytes()).expect("send");
    let greeting = messages.next().expect("a greeting");
    let mut greeting_keys = keys(&greeting["QMP"]);
    greeting_keys.extend(keys(&greeting["QMP"]["version"]));
    send(json!({"execute": "query-version"}));
    let before_negotiation = error_class(&messages.reply());
    send(json!({"execute": "qmp_capabilities"}));
    let negotiation = messages.reply();
    send(json!({"execute": "query-version", "id": ["x", {"n": 1}]}));
    let version = messages.reply();
    send(json!({"execute": "no-such-command"}));
    let unknown = error_class(&messages.reply());
    let options = json!({"driver": "file", "filename": image, "size": 1 << 20});
    send(json!({"execute": "blockdev-create", "arguments": {"job-id": "j0", "options": options}}));
    assert_eq!(messages.reply(), json!({"return": {}}));
    messages.await_status("JOB_STATUS_CHANGE", "concluded");
    send(json!({"execute": "job-dismiss", "arguments": {"id": "j0"}}));
    let dismissed = messages.reply();
    send(json!({"execute": "quit"}));
    let quit = messages.reply();
    let mut ended = true;
    // QSD reads a byte at a time and exits with quit's newline unread: the
    // kernel resets such a connection, an end as good as any.
    while let Some(Ok(message)) = messages.values.next() {
        match message.get("event") {
            Some(_) => messages.events.push(message),
            None => ended = false,
        }
    }
    let job = messages.events.iter().filter(|e| e["event"] == "JOB_STATUS_CHANGE");
    Outcome {
        greeting: greeting_keys,
        before_negotiation,
        negotiation,
        version: keys(&version["return"]),
        id: version["id"].clone(),
        unknown,
        job: job.map(|e| e["data"]["status"].as_str().unwrap_or_default().to_owned()).collect(),
        dismissed,
        quit,
        ended,
    }
}

/// A file of `program`'s own in a scratch directory: `vsd.sock`.
fn file(program: &str, extension: &str) -> String {
    format!("{}.{extension}", Path::new(program).file_name().unwrap().to_string_lossy())
}

fn spawn(program: &str, args: &[String]) -> Child {
    Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"))
}

/// Waits for `child` to exit; its status code.
fn exit_code(mut child: Child) -> Option<i32> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the daemon did not exit");
        }
        thread::sleep(Duration::from_millis(10));
    }
}

fn stdio_args(monitor: &str) -> Vec<String> {
    ["--chardev", "stdio,id=m0", "--monitor", monitor].map(String::from).into()
}

/// The script over a daemon's standard input and output; the outcome and
/// the daemon's exit status.
fn over_stdio(program: &str, dir: &Scratch) -> (Outcome, Option<i32>) {
    let mut child = spawn(program, &stdio_args("chardev=m0"));
    let mut stdin = child.stdin.take().unwrap();
    let outcome = script(&mut stdin, child.stdout.take().unwrap(), &dir.path(&file(program, "img")));
    (outcome, exit_code(child))
}

#[test]
fn stdio_session_matches_qsd_and_quit_exits_0() {
    let dir = Scratch::new("monitors-stdio");
    let (vsd, vsd_exit) = over_stdio(VSD, &dir);
    let (qsd, qsd_exit) = over_stdio(QSD, &dir);
    assert_eq!(vsd, qsd);
    assert_eq!(vsd.before_negotiation, "CommandNotFound");
    assert_eq!(vsd.job, ["created", "running", "waiting", "pending", "concluded", "null"]);
    assert!(vsd.ended);
    assert_eq!((vsd_exit, qsd_exit), (Some(0), Some(0)));
}

/// Waits for `program` to create `path`.
fn await_file(path: &Path, program: &str) {
    let deadline = Instant::now() + TIMEOUT;
    while !path.exists() {
        assert!(Instant::now() < deadline, "{program} did not create {}", path.display());
        thread::sleep(Duration::from_millis(10));
    }
}

/// A free TCP port on 127.0.0.1, as far as anyone can tell.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Connects, retrying while the daemon starts.
fn connect<S>(mut attempt: impl FnMut() -> std::io::Result<S>) -> S {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        match attempt() {
            Ok(stream) => return stream,
            Err(e) if Instant::now() > deadline => panic!("cannot connect: {e}"),
            Err(_) => thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn over_tcp(program: &str, dir: &Scratch) -> (Outcome, Option<i32>) {
    let port = free_port();
    let chardev = format!("socket,id=m0,host=127.0.0.1,port={port},server=on,wait=off,ipv4=on");
    let child = spawn(program, &["--chardev".into(), chardev, "--monitor".into(), "m0".into()]);
    let stream = connect(|| TcpStream::connect(("127.0.0.1", port)));
    stream.set_read_timeout(Some(TIMEOUT)).unwrap();
    let outcome = script(&mut stream.try_clone().unwrap(), stream, &dir.path(&file(program, "img")));
    (outcome, exit_code(child))
}

#[test]
fn tcp_session_matches_qsd() {
    let dir = Scratch::new("monitors-tcp");
    let (vsd, vsd_exit) = over_tcp(VSD, &dir);
    let (qsd, qsd_exit) = over_tcp(QSD, &dir);
    assert_eq!(vsd, qsd);
    assert_eq!((vsd_exit, qsd_exit), (Some(0), Some(0)));
}

/// The script over a listening unix socket the daemon inherits as `fd=N`.
fn over_inherited_socket(program: &str, dir: &Scratch) -> (Outcome, Option<i32>) {
    let path = dir.path(&file(program, "sock"));
    let listener = UnixListener::bind(&path).unwrap();
    let fd = listener.as_raw_fd();
    // SAFETY: fcntl(2) on a descriptor this test owns; the child inherits
    // it without FD_CLOEXEC, and the test's copy closes once it runs.
    assert_eq!(unsafe { libc::fcntl(fd, libc::F_SETFD, 0) }, 0);
    let chardev = format!("socket,id=m0,fd={fd},server=on,wait=off");
    let pidfile = dir.path(&file(program, "pid"));
    let args = ["--chardev", &chardev, "--monitor", "chardev=m0", "--pidfile", &pidfile.display().to_string()];
    let child = spawn(program, &args.map(String::from));
    drop(listener);
    // The socket listens already, but QSD greets a client that connected
    // before its monitor was set up twice.
    await_file(&pidfile, program);
    let stream = connect(|| UnixStream::connect(&path));
    stream.set_read_timeout(Some(TIMEOUT)).unwrap();
    let outcome = script(&mut stream.try_clone().unwrap(), stream, &dir.path(&file(program, "img")));
    (outcome, exit_code(child))
}

#[test]
fn inherited_socket_session_matches_qsd() {
    let dir = Scratch::new("monitors-fd");
    let (vsd, vsd_exit) = over_inherited_socket(VSD, &dir);
    let (qsd, qsd_exit) = over_inherited_socket(QSD, &dir);
    assert_eq!(vsd, qsd);
    assert_eq!((vsd_exit, qsd_exit), (Some(0), Some(0)));
}

/// What a pretty monitor writes for the greeting and the reply to
/// `qmp_capabilities`, line ends as LF.
fn pretty_text(program: &str) -> (String, String) {
    let mut child = spawn(program, &stdio_args("chardev=m0,pretty=on"));
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let greeting = read_message(&mut stdout);
    stdin.write_all(b"{\"execute\": \"qmp_capabilities\"}\n{\"execute\": \"quit\"}\n").unwrap();
    let negotiated = read_message(&mut stdout);
    assert_eq!(read_message(&mut stdout), negotiated, "quit's reply is the same empty return");
    assert_eq!(exit_code(child), Some(0));
    (greeting, negotiated)
}

/// One pretty-printed message: the lines up to the one that closes it.
fn read_message(stdout: &mut ChildStdout) -> String {
    let mut text = String::new();
    let mut byte = [0];
    while !text.ends_with("\n}\n") {
        assert_eq!(stdout.read(&mut byte).unwrap(), 1, "the message ended early: {text:?}");
        if byte[0] != b'\r' {
            text.push(byte[0] as char);
        }
    }
    text
}

#[test]
fn pretty_output_is_laid_out_as_qsd_lays_it_out() {
    let (vsd_greeting, vsd_reply) = pretty_text(VSD);
    let (qsd_greeting, qsd_reply) = pretty_text(QSD);
    assert_eq!(vsd_reply, "{\n    \"return\": {\n    }\n}\n");
    assert_eq!(vsd_reply, qsd_reply);
    // The same layout for the greeting, whose contents differ.
    let layout = |text: &str| -> Vec<usize> { text.lines().map(|l| l.len() - l.trim_start().len()).collect() };
    let (vsd_value, qsd_value): (Value, Value) =
        (serde_json::from_str(&vsd_greeting).unwrap(), serde_json::from_str(&qsd_greeting).unwrap());
    assert_eq!(keys(&vsd_value["QMP"]), keys(&qsd_value["QMP"]));
    assert!(layout(&vsd_greeting).iter().all(|indent| indent % 4 == 0), "{vsd_greeting}");
    assert!(layout(&qsd_greeting).iter().all(|indent| indent % 4 == 0), "{qsd_greeting}");
}

/// Whether `program` with a waiting monitor socket writes its pidfile
/// before a client connects (it must after), and its stderr.
fn waits_for_a_client(program: &str, dir: &Scratch) -> (bool, String) {
    let (socket, pidfile) = (dir.path(&file(program, "sock")), dir.path(&file(program, "pid")));
    let chardev = format!("socket,id=m0,path={},server=on", socket.display());
    let args = ["--chardev", &chardev, "--monitor", "chardev=m0", "--pidfile", &pidfile.display().to_string()];
    let mut child = spawn(program, &args.map(String::from));
    await_file(&socket, program);
    // Time to go on wrongly before looking.
    thread::sleep(Duration::from_millis(300));
    let before = pidfile.exists();
    let client = connect(|| UnixStream::connect(&socket));
    let mut messages = Messages::new(client.try_clone().unwrap());
    assert!(messages.next().expect("a greeting").get("QMP").is_some());
    await_file(&pidfile, program);
    (&client).write_all(b"{\"execute\": \"qmp_capabilities\"}\n{\"execute\": \"quit\"}\n").unwrap();
    assert_eq!(messages.reply(), json!({"return": {}}));
    assert_eq!(messages.reply(), json!({"return": {}}));
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert_eq!(exit_code(child), Some(0));
    (before, stderr)
}

#[test]
fn a_waiting_socket_holds_the_daemon_until_a_client_connects_as_qsd_does() {
    let dir = Scratch::new("monitors-wait");
    let (vsd_before, vsd_stderr) = waits_for_a_client(VSD, &dir);
    let (qsd_before, qsd_stderr) = waits_for_a_client(QSD, &dir);
    assert_eq!((vsd_before, qsd_before), (false, false));
    for stderr in [&vsd_stderr, &qsd_stderr] {
        assert!(stderr.contains("waiting for connection on: disconnected:unix:"), "{stderr}");
    }
}

/// Whether `program` still runs a while after its standard input ended,
/// and its exit status once SIGTERM stopped it.
fn outlives_stdin(program: &str) -> (bool, Option<i32>) {
    let mut child = spawn(program, &stdio_args("m0"));
    let mut messages = Messages::new(child.stdout.take().unwrap());
    assert!(messages.next().expect("a greeting").get("QMP").is_some());
    drop(child.stdin.take());
    thread::sleep(Duration::from_millis(300));
    let running = child.try_wait().unwrap().is_none();
    // SAFETY: kill(2) on the child this test spawned and has not reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    (running, exit_code(child))
}

#[test]
fn the_end_of_stdin_leaves_the_daemon_running_as_qsd_does() {
    let vsd = outlives_stdin(VSD);
    assert_eq!(vsd, outlives_stdin(QSD));
    assert_eq!(vsd, (true, Some(0)));
}

/// The first line `program` writes on stderr when it refuses `args`.
fn refusal(program: &str, args: &[&str]) -> String {
    let out = Command::new(program).args(args).stdin(Stdio::null()).output().expect("run");
    assert_eq!(out.status.code(), Some(1), "{program} {args:?} must fail");
    String::from_utf8_lossy(&out.stderr).lines().next().unwrap_or_default().to_owned()
}

#[test]
fn mistakes_are_refused_with_qsds_words() {
    let cases: [(&[&str], &str); 7] = [
        (&["--chardev", "stdio,id=a", "--chardev", "stdio,id=b"], "cannot use stdio by multiple character devices"),
        (&["--chardev", "stdio,id=a", "--monitor", "b"], "chardev \"b\" not found"),
        (&["--chardev", "stdio,id=a", "--monitor", "a", "--monitor", "a"], "chardev 'a' is already in use"),
        (&["--chardev", "stdio,id=a", "--monitor", "a,mode=readline"], "Only QMP is supported"),
        (&["--chardev", "socket,id=a,path=/nonexistent/a,wait=off"], "incompatible with socket in client connect mode"),
        (&["--chardev", "socket,id=a,host=localhost,server=on,wait=off"], "no port given"),
        (
            &["--chardev", "socket,id=a,fd=999,server=on,wait=off", "--monitor", "a"],
            "File descriptor '999' is not a socket",
        ),
    ];
    for (args, words) in cases {
        for program in [VSD, QSD] {
            let message = refusal(program, args);
            assert!(message.contains(words), "{program} {args:?}: {message}");
        }
    }
}
