//! Character devices and QOM against qemu-storage-daemon: the same QMP
//! script runs on vsd and on QSD, and every answer (return value, or error
//! class and words) must be the same; what vsd lacks (QSD's other types
//! and properties) is left out of the comparison, never what vsd has.

mod common;

use std::os::unix::net::UnixStream;
use std::path::Path;

use common::qmp::Qmp;
use common::{Daemon, Scratch, monitor};
use serde_json::{Value, json};

type Start = fn(&Scratch, &[String]) -> Daemon;

/// Both daemons, each with a monitor, `extra` arguments and a scratch
/// directory of its own (`DIR` in `extra` names it).
fn both(name: &str, extra: &[&str]) -> Vec<(Scratch, Daemon, Qmp)> {
    let starts: [(&str, Start); 2] = [("vsd", Daemon::vsd), ("qsd", Daemon::qsd)];
    starts
        .into_iter()
        .map(|(program, start)| {
            let dir = Scratch::new(&format!("chardev-{name}-{program}"));
            let socket = dir.path("qmp.sock");
            let mut args = monitor(&socket);
            args.extend(extra.iter().map(|a| a.replace("DIR", &dir.0.display().to_string())));
            let daemon = start(&dir, &args);
            let qmp = Qmp::connect(&socket);
            (dir, daemon, qmp)
        })
        .collect()
}

/// `answer` with the scratch directory written `DIR`, and lists in a
/// fixed order (QEMU lists chardevs and QOM children in hash order).
fn comparable(answer: &Value, dir: &Scratch) -> Value {
    let text = answer.to_string().replace(&dir.0.display().to_string(), "DIR");
    sorted(serde_json::from_str(&text).unwrap())
}

fn sorted(value: Value) -> Value {
    match value {
        Value::Array(items) => {
            let mut items: Vec<Value> = items.into_iter().map(sorted).collect();
            items.sort_by_key(|item| item.to_string());
            Value::Array(items)
        }
        Value::Object(map) => Value::Object(map.into_iter().map(|(k, v)| (k, sorted(v))).collect()),
        other => other,
    }
}

/// Runs `script` on both daemons; asserts every answer is the same.
fn same_answers(name: &str, extra: &[&str], script: &[(&str, Value)]) -> Vec<Value> {
    let mut daemons = both(name, extra);
    let answers: Vec<Vec<Value>> = daemons
        .iter_mut()
        .map(|(dir, _, qmp)| {
            let dir: &Scratch = dir;
            script.iter().map(|(command, args)| comparable(&qmp.answer(command, args.clone()), dir)).collect()
        })
        .collect();
    for ((command, args), (ours, theirs)) in script.iter().zip(answers[0].iter().zip(&answers[1])) {
        assert_eq!(ours, theirs, "{command} {args}: vsd {ours}, QSD {theirs}");
    }
    answers.into_iter().next().unwrap()
}

fn ring(id: &str, data: Value) -> Value {
    json!({"id": id, "backend": {"type": "ringbuf", "data": data}})
}

fn null(id: &str) -> Value {
    json!({"id": id, "backend": {"type": "null", "data": {}}})
}

#[test]
fn ring_buffers_are_written_and_read_as_qemu_storage_daemon_does() {
    let write = |data: &str, format: &str| json!({"device": "r0", "data": data, "format": format});
    let read = |size: i64, format: &str| json!({"device": "r0", "size": size, "format": format});
    let script = [
        ("query-chardev", json!({})),
        ("chardev-add", ring("r0", json!({"size": 8}))),
        ("chardev-add", ring("big", json!({}))),
        ("chardev-add", null("n0")),
        ("query-chardev", json!({})),
        ("ringbuf-write", json!({"device": "r0", "data": "hello"})),
        // Eight bytes hold the newest eight: the ring wraps.
        ("ringbuf-write", write("world!", "utf8")),
        ("ringbuf-read", json!({"device": "r0", "size": 100})),
        ("ringbuf-read", read(100, "utf8")),
        ("ringbuf-write", write("aGVsbG8=", "base64")),
        ("ringbuf-read", read(2, "base64")),
        ("ringbuf-read", read(100, "utf8")),
        // U+0000 goes in as C0 80, and comes back.
        ("ringbuf-write", write("ab\u{0}cd", "utf8")),
        ("ringbuf-read", read(8, "base64")),
        ("ringbuf-write", write("ab\u{0}cd", "utf8")),
        ("ringbuf-read", read(8, "utf8")),
        // Invalid UTF-8 reads as U+FFFD; a NUL ends the text, the bytes
        // after it consumed all the same.
        ("ringbuf-write", write("/0FCQ/9ERQ==", "base64")),
        ("ringbuf-read", read(8, "utf8")),
        ("ringbuf-write", write("YQBi", "base64")),
        ("ringbuf-read", read(8, "utf8")),
        ("ringbuf-read", read(8, "utf8")),
        // Half a character at a time.
        ("ringbuf-write", write("é", "utf8")),
        ("ringbuf-read", read(1, "utf8")),
        ("ringbuf-read", read(1, "utf8")),
        ("ringbuf-write", write("wrapped around", "utf8")),
        ("ringbuf-read", read(3, "base64")),
        ("ringbuf-write", write("0123456789", "utf8")),
        ("ringbuf-write", write("tail", "utf8")),
        ("chardev-send-break", json!({"id": "r0"})),
        ("chardev-send-break", json!({"id": "m"})),
        ("ringbuf-read", read(100, "utf8")),
        ("chardev-remove", json!({"id": "r0"})),
        ("query-chardev", json!({})),
        ("ringbuf-read", read(1, "utf8")),
    ];
    let answers = same_answers("ring", &[], &script);
    // What both said, which could have been otherwise.
    assert_eq!(answers[7], json!({"return": "loworld!"}));
    assert_eq!(answers[10], json!({"return": "aGU="}));
    assert_eq!(answers[13], json!({"return": "YWLAgGNk"}));
    assert_eq!(answers[15], json!({"return": "ab\u{0}cd"}));
    assert_eq!(answers[17], json!({"return": "\u{fffd}ABC\u{fffd}DE"}));
    assert_eq!(answers[19], json!({"return": "a"}));
    assert_eq!(answers[25], json!({"return": "ZCBh"}));
    assert_eq!(answers[30], json!({"return": "6789tail"}));
    assert_eq!(labels(&answers[4]), ["big", "m", "n0", "r0"]);
    assert_eq!(labels(&answers[32]), ["big", "m", "n0"]);
}

/// The labels `query-chardev` listed, sorted.
fn labels(answer: &Value) -> Vec<&str> {
    let mut labels: Vec<&str> =
        answer["return"].as_array().unwrap().iter().map(|c| c["label"].as_str().unwrap()).collect();
    labels.sort();
    labels
}

#[test]
fn mistakes_are_refused_in_qemu_words_and_change_nothing() {
    let script = [
        ("chardev-add", ring("r0", json!({"size": 16}))),
        ("chardev-add", null("n0")),
        ("ringbuf-write", json!({"device": "r0", "data": "kept"})),
        ("query-chardev", json!({})),
        // Ids.
        ("chardev-add", ring("r0", json!({}))),
        ("chardev-add", null("m")),
        ("chardev-add", json!({"backend": {"type": "null", "data": {}}})),
        // Backends.
        ("chardev-add", json!({"id": "x", "backend": {"type": "bogus", "data": {}}})),
        ("chardev-add", json!({"id": "x", "backend": {"data": {}}})),
        ("chardev-add", json!({"id": "x", "backend": {"type": "null"}})),
        ("chardev-add", json!({"id": "x", "backend": {"type": 5, "data": {}}})),
        ("chardev-add", json!({"id": "x", "backend": 5})),
        ("chardev-add", json!({"id": "x", "backend": {"type": "null", "data": {}, "y": 1}})),
        ("chardev-add", json!({"id": "x", "backend": {"type": "null", "data": {"y": 1}}})),
        ("chardev-add", json!({"id": "x", "backend": {"type": "null", "data": {}}, "z": 1})),
        (
            "chardev-add",
            json!({"id": "x", "backend": {"type": "socket", "data": {"addr": {"type": "bogus", "data": {}}}}}),
        ),
        ("chardev-add", json!({"id": "x", "backend": {"type": "socket", "data": {"addr": {"type": "unix"}}}})),
        // Sizes.
        ("chardev-add", ring("x", json!({"size": 7}))),
        ("chardev-add", ring("x", json!({"size": -1}))),
        ("chardev-add", ring("x", json!({"size": "8"}))),
        // Files.
        ("chardev-add", json!({"id": "x", "backend": {"type": "file", "data": {"out": "/nonexistent/out"}}})),
        ("chardev-add", json!({"id": "x", "backend": {"type": "file", "data": {}}})),
        ("chardev-add", json!({"id": "x", "backend": {"type": "null", "data": {"logfile": "/nonexistent/log"}}})),
        // In use by the monitor, or not there.
        ("chardev-remove", json!({"id": "m"})),
        ("chardev-change", json!({"id": "m", "backend": {"type": "null", "data": {}}})),
        ("chardev-remove", json!({"id": "nope"})),
        ("chardev-change", json!({"id": "nope", "backend": {"type": "null", "data": {}}})),
        ("chardev-send-break", json!({"id": "nope"})),
        // Ring buffer commands on what is not one.
        ("ringbuf-write", json!({"device": "n0", "data": "x"})),
        ("ringbuf-read", json!({"device": "n0", "size": 1})),
        ("ringbuf-write", json!({"device": "m", "data": "x"})),
        ("ringbuf-write", json!({"device": "nope", "data": "x"})),
        ("ringbuf-read", json!({"device": "nope", "size": 1})),
        ("ringbuf-read", json!({"device": "r0", "size": 0})),
        ("ringbuf-read", json!({"device": "r0", "size": -5})),
        ("ringbuf-read", json!({"device": "r0"})),
        ("ringbuf-read", json!({"device": "r0", "size": 1, "format": "hex"})),
        ("ringbuf-write", json!({"device": "r0", "data": "%%%", "format": "base64"})),
        ("ringbuf-write", json!({"device": "r0", "data": 5})),
        ("query-chardev", json!({"x": 1})),
        ("query-chardev-backends", json!({"x": 1})),
        // Nothing changed.
        ("query-chardev", json!({})),
        ("ringbuf-read", json!({"device": "r0", "size": 100})),
    ];
    let answers = same_answers("mistakes", &[], &script);
    for (answer, (command, args)) in answers[4..answers.len() - 2].iter().zip(&script[4..]) {
        assert!(answer["error"]["desc"].is_string(), "{command} {args} must fail: {answer}");
    }
    let last = answers.len() - 1;
    assert_eq!(answers[last - 1], answers[3], "a refusal changed the chardevs");
    assert_eq!(answers[last], json!({"return": "kept"}));
    assert_eq!(answers[23]["error"]["desc"], "Chardev 'm' is busy");
    assert_eq!(answers[7]["error"]["desc"], "Parameter 'type' does not accept value 'bogus'");
}

#[test]
fn backends_are_qemu_storage_daemons() {
    let mut daemons = both("backends", &[]);
    let names = |qmp: &mut Qmp| -> Vec<String> {
        let listed = qmp.ok("query-chardev-backends", json!({}));
        listed.as_array().unwrap().iter().map(|b| b["name"].as_str().unwrap().to_string()).collect()
    };
    let (ours, theirs) = (names(&mut daemons[0].2), names(&mut daemons[1].2));
    assert_eq!(ours, ["file", "memory", "null", "ringbuf", "socket", "stdio"]);
    for name in &ours {
        assert!(theirs.contains(name), "{name} is not one of QSD's: {theirs:?}");
    }
    // What vsd lacks, it refuses as QEMU refuses a kind it lacks.
    let pty = daemons[0].2.answer("chardev-add", json!({"id": "p", "backend": {"type": "pty", "data": {}}}));
    assert_eq!(pty["error"]["desc"], "Parameter 'type' does not accept value 'pty'");
    // A descriptor number could be one the daemon owns: QMP cannot name one.
    let fd = json!({"id": "s", "backend": {"type": "socket", "data": {"addr": {"type": "fd", "data": {"str": "3"}}}}});
    let refused = daemons[0].2.answer("chardev-add", fd);
    assert_eq!(refused["error"]["desc"], "Failed to add chardev 's': 'fd 3' is not supported by vsd");
    assert_eq!(labels(&daemons[0].2.answer("query-chardev", json!({}))), ["m"]);
}

#[test]
fn sockets_listen_until_removed() {
    let mut daemons = both("sockets", &[]);
    for (dir, _, qmp) in &mut daemons {
        let path = dir.path("s.sock");
        let args = json!({"id": "s", "backend": {"type": "socket", "data": {
            "addr": {"type": "unix", "data": {"path": path}}, "server": true, "wait": false}}});
        qmp.ok("chardev-add", args);
        let tcp = json!({"id": "t", "backend": {"type": "socket", "data": {
            "addr": {"type": "inet", "data": {"host": "127.0.0.1", "port": "0"}}}}});
        qmp.ok("chardev-add", tcp);
        let listed = comparable(&qmp.ok("query-chardev", json!({})), dir);
        let filename = |label: &str| {
            let chardev = listed.as_array().unwrap().iter().find(|c| c["label"] == label).unwrap();
            chardev["filename"].as_str().unwrap().to_string()
        };
        assert_eq!(filename("s"), "disconnected:unix:DIR/s.sock,server=on");
        assert!(filename("t").starts_with("disconnected:tcp:127.0.0.1:"), "{}", filename("t"));
        assert!(!filename("t").ends_with(":0,server=on"), "the port bound is shown: {}", filename("t"));
        assert_eq!(filename("m"), "unix:DIR/qmp.sock,server=on");
        // A client gets in (QSD takes it and reads nothing; vsd leaves it
        // in the backlog).
        UnixStream::connect(&path).unwrap();
        qmp.ok("chardev-remove", json!({"id": "s"}));
        assert!(!Path::new(&path).exists(), "the socket file goes with its chardev");
        assert!(UnixStream::connect(&path).is_err());
    }
}

#[test]
fn command_line_chardevs_are_listed_as_qemu_storage_daemon_lists_them() {
    let extra = [
        "--chardev",
        "ringbuf,id=r,size=4k",
        "--chardev",
        "memory,id=mem",
        "--chardev",
        "null,id=n,logfile=DIR/null.log",
        "--chardev",
        "file,id=f,path=DIR/out.txt,append=on",
        "--chardev",
        "socket,id=spare,path=DIR/spare.sock,server=on,wait=off",
    ];
    let script = [
        ("query-chardev", json!({})),
        ("ringbuf-write", json!({"device": "r", "data": "x".repeat(5000)})),
        ("ringbuf-read", json!({"device": "r", "size": 10000, "format": "base64"})),
        ("chardev-remove", json!({"id": "spare"})),
        ("chardev-remove", json!({"id": "r"})),
        ("query-chardev", json!({})),
    ];
    let answers = same_answers("cli", &extra, &script);
    assert_eq!(labels(&answers[0]), ["f", "m", "mem", "n", "r", "spare"]);
    // 4 KiB kept of the 5000 bytes written.
    let kept = answers[2]["return"].as_str().unwrap().len();
    assert_eq!(kept, 4096 / 3 * 4 + 4);
    assert_eq!(labels(&answers[5]), ["f", "m", "mem", "n"]);
}

#[test]
fn command_line_mistakes_are_qemu_storage_daemons() {
    let dir = Scratch::new("chardev-cli-mistakes");
    let mut args = monitor(&dir.path("qmp.sock"));
    for chardev in ["ringbuf,id=r,size=7", "file,id=f", "null,id=n,logfile=/nonexistent/log"] {
        args.extend(["--chardev".to_string(), chardev.to_string()]);
        let ours = common::vsd_fails(&args);
        let out = std::process::Command::new("qemu-storage-daemon").args(&args).output().unwrap();
        let theirs = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{theirs}");
        // vsd quotes the option string as it read it.
        let words = |text: &str| {
            let (_, option) = text.split_once("--chardev ")?;
            option.split_once(": ").map(|(_, words)| words.trim().to_string())
        };
        assert_eq!(words(&ours), words(&theirs), "vsd {ours}, QSD {theirs}");
        assert!(words(&ours).is_some(), "{ours}");
        args.truncate(args.len() - 2);
    }
    // A monitor needs a chardev that carries QMP.
    let ours = common::vsd_fails(&["--chardev", "ringbuf,id=r", "--monitor", "r"]);
    assert!(ours.contains("vsd's monitors serve stdio and socket chardevs"), "{ours}");
}

/// vsd's one departure: a chardev-change whose new backend fails keeps the
/// old chardev (QEMU has removed it by then, and loses it).
#[test]
fn a_failed_change_keeps_the_chardev() {
    let dir = Scratch::new("chardev-change");
    let socket = dir.path("qmp.sock");
    let _vsd = Daemon::vsd(&dir, &monitor(&socket));
    let mut qmp = Qmp::connect(&socket);
    qmp.ok("chardev-add", ring("r", json!({"size": 8})));
    qmp.ok("ringbuf-write", json!({"device": "r", "data": "kept"}));
    let refused = qmp.answer("chardev-change", ring("r", json!({"size": 3})));
    assert_eq!(refused["error"]["desc"], "Failed to add chardev 'r': size of ringbuf chardev must be power of two");
    assert_eq!(qmp.ok("ringbuf-read", json!({"device": "r", "size": 8})), "kept");
    // A change that works starts the new backend empty.
    qmp.ok("ringbuf-write", json!({"device": "r", "data": "gone"}));
    qmp.ok("chardev-change", ring("r", json!({"size": 16})));
    assert_eq!(qmp.ok("ringbuf-read", json!({"device": "r", "size": 8})), "");
    qmp.ok("chardev-change", null("r"));
    let listed = qmp.ok("query-chardev", json!({}));
    assert!(listed.as_array().unwrap().contains(&json!({"label": "r", "filename": "null", "frontend-open": false})));
    assert_eq!(
        qmp.answer("ringbuf-read", json!({"device": "r", "size": 8}))["error"]["desc"],
        "r is not a ringbuf device"
    );
}

/// The objects and chardevs both daemons have, for the QOM tests.
const QOM_OBJECTS: &[&str] = &[
    "--object",
    "secret,id=sec0,data=x",
    "--object",
    "throttle-group,id=tg0,limits.iops-total=100",
    "--object",
    "iothread,id=io0",
    "--chardev",
    "ringbuf,id=ring",
    "--chardev",
    "null,id=nul",
];

#[test]
fn qom_lists_the_tree_as_qemu_storage_daemon_does() {
    let path = |path: &str| json!({ "path": path });
    let script = [
        ("chardev-add", json!({"id": "mem", "backend": {"type": "memory", "data": {"size": 16}}})),
        ("chardev-add", json!({"id": "f", "backend": {"type": "file", "data": {"out": "/dev/null"}}})),
        ("qom-list", path("/")),
        ("qom-list", path("/backend")),
        ("qom-list", path("/objects")),
        ("qom-list", path("/objects/")),
        ("qom-list", path("/objects/sec0")),
        ("qom-list", path("/objects/tg0")),
        ("qom-list", path("/chardevs")),
        ("qom-list", path("/chardevs/m")),
        ("qom-list", path("/chardevs/ring")),
        ("qom-list", path("/chardevs/mem")),
        ("qom-list", path("/chardevs/nul")),
        ("qom-list", path("/chardevs/f")),
        // Partial paths: the one node they end.
        ("qom-list", path("sec0")),
        ("qom-list", path("objects/tg0")),
        ("qom-list", path("ring")),
        ("qom-list", path("//chardevs//m/")),
        // And the refusals.
        ("qom-list", path("")),
        ("qom-list", path("nope")),
        ("qom-list", path("/nope")),
        ("qom-list", path("/objects/sec0/data")),
        ("qom-list", json!({})),
        ("qom-list", json!({"path": 1})),
        ("chardev-add", null("sec0")),
        ("qom-list", path("sec0")),
        ("qom-list-properties", json!({"typename": "nope"})),
        ("qom-list-properties", json!({"typename": "user-creatable"})),
        ("qom-list-properties", json!({})),
        ("qom-list-types", json!({"implements": "nope"})),
        ("qom-list-types", json!({"bogus": true})),
    ];
    let answers = same_answers("qom", QOM_OBJECTS, &script);
    let names = |answer: &Value| -> Vec<String> {
        answer["return"].as_array().unwrap().iter().map(|p| format!("{} {}", p["name"], p["type"])).collect()
    };
    assert_eq!(
        names(&answers[4]),
        [
            r#""io0" "child<iothread>""#,
            r#""sec0" "child<secret>""#,
            r#""tg0" "child<throttle-group>""#,
            r#""type" "string""#
        ]
    );
    assert!(names(&answers[9]).contains(&r#""addr" "SocketAddress""#.to_string()));
    assert_eq!(answers[18]["error"]["desc"], "Path '' is ambiguous");
    assert_eq!(answers[19]["error"]["class"], "DeviceNotFound");
    assert_eq!(answers[25]["error"]["desc"], "Path 'sec0' is ambiguous");
}

/// A QOM listing's entries as text, those vsd leaves out of its own
/// (`cpu-affinity`, vsd's) dropped.
fn entries(answer: &Value) -> Vec<String> {
    let listed = answer["return"].as_array().unwrap_or_else(|| panic!("a list: {answer}"));
    listed.iter().map(Value::to_string).filter(|entry| !entry.contains("cpu-affinity")).collect()
}

#[test]
fn qom_types_and_properties_are_qemu_storage_daemons() {
    let mut daemons = both("qom-types", QOM_OBJECTS);
    let ask = |daemons: &mut Vec<(Scratch, Daemon, Qmp)>, command: &str, args: Value| {
        let [ours, theirs] = [0, 1].map(|i| daemons[i].2.answer(command, args.clone()));
        (entries(&ours), entries(&theirs))
    };
    // Every type vsd lists, QSD lists alike; and it lists what it has.
    let queries = [
        json!({}),
        json!({"abstract": true}),
        json!({"implements": "chardev"}),
        json!({"implements": "chardev", "abstract": true}),
        json!({"implements": "user-creatable"}),
        json!({"implements": "interface", "abstract": true}),
        json!({"implements": "secret_common", "abstract": true}),
    ];
    for query in queries {
        let (ours, theirs) = ask(&mut daemons, "qom-list-types", query.clone());
        assert!(!ours.is_empty(), "{query}");
        for entry in &ours {
            assert!(theirs.contains(entry), "{query}: {entry} is not QSD's: {theirs:?}");
        }
    }
    let (creatable, _) = ask(&mut daemons, "qom-list-types", json!({"implements": "user-creatable"}));
    for kind in ["iothread", "secret", "throttle-group", "tls-creds-x509"] {
        assert!(creatable.iter().any(|entry| entry.contains(&format!("\"{kind}\""))), "{kind}: {creatable:?}");
    }
    // Each type's properties: those vsd has are QSD's, with QSD's types.
    let (types, _) = ask(&mut daemons, "qom-list-types", json!({"abstract": true}));
    for entry in types {
        let name = serde_json::from_str::<Value>(&entry).unwrap()["name"].as_str().unwrap().to_string();
        let (ours, theirs) = ask_properties(&mut daemons, &name);
        for property in &ours {
            assert!(theirs.contains(property), "{name}: {property} is not QSD's: {theirs:?}");
        }
    }
    // Those with all of QSD's, exactly.
    for name in ["secret", "throttle-group", "chardev-socket", "chardev-ringbuf", "container"] {
        let (mut ours, mut theirs) = ask_properties(&mut daemons, name);
        ours.sort();
        theirs.sort();
        assert_eq!(ours, theirs, "{name}");
    }
    // An object's listing is its type's properties.
    let (ours, theirs) = ask(&mut daemons, "qom-list", json!({"path": "/objects/io0"}));
    assert!(ours.iter().all(|p| theirs.contains(p)) && ours.len() == 4, "{ours:?} of {theirs:?}");
}

/// `qom-list-properties` of `name` on both daemons, as [`entries`].
fn ask_properties(daemons: &mut [(Scratch, Daemon, Qmp)], name: &str) -> (Vec<String>, Vec<String>) {
    let args = json!({ "typename": name });
    let [ours, theirs] = [0, 1].map(|i| daemons[i].2.answer("qom-list-properties", args.clone()));
    match (ours.get("return"), theirs.get("return")) {
        (Some(_), Some(_)) => (entries(&ours), entries(&theirs)),
        // Interfaces have none, on both.
        _ => {
            assert_eq!(ours, theirs, "{name}");
            (Vec::new(), Vec::new())
        }
    }
}
