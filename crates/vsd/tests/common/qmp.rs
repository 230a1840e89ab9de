//! A QMP connection of the tests' own that keeps every event, in order
//! (QEMU's events are part of what the tests compare).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

/// A QMP connection that keeps every event, in order.
pub struct Qmp {
    writer: UnixStream,
    reader: BufReader<UnixStream>,
    events: Vec<Value>,
    /// Events before this one were matched by [`Qmp::await_event`].
    seen: usize,
}

impl Qmp {
    /// Connects to the monitor at `path`, waiting while a socket that is
    /// bound but not yet listening refuses (QEMU binds, then listens).
    pub fn connect(path: &Path) -> Self {
        let mut tries = 0;
        let writer = loop {
            match UnixStream::connect(path) {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused && tries < 500 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
                connected => break connected.unwrap(),
            }
        };
        writer.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let reader = BufReader::new(writer.try_clone().unwrap());
        let mut qmp = Self { writer, reader, events: Vec::new(), seen: 0 };
        assert!(qmp.receive().get("QMP").is_some(), "a greeting");
        qmp.answer("qmp_capabilities", json!({}));
        qmp
    }

    fn receive(&mut self) -> Value {
        let mut line = String::new();
        let n = self.reader.read_line(&mut line).expect("a QMP message in time");
        assert!(n > 0, "the daemon hung up");
        serde_json::from_str(&line).unwrap()
    }

    /// The command's return value or its error (class and text).
    pub fn answer(&mut self, command: &str, args: Value) -> Value {
        let request = json!({"execute": command, "arguments": args});
        self.writer.write_all(format!("{request}\n").as_bytes()).unwrap();
        loop {
            let mut message = self.receive();
            if message.get("event").is_some() {
                self.events.push(message);
                continue;
            }
            if let Some(value) = message.get_mut("return") {
                return json!({ "return": value.take() });
            }
            return json!({ "error": message["error"].clone() });
        }
    }

    /// Runs a command that must succeed; returns what it returned.
    pub fn ok(&mut self, command: &str, args: Value) -> Value {
        let mut answer = self.answer(command, args.clone());
        assert!(answer.get("return").is_some(), "{command} {args}: {answer}");
        answer["return"].take()
    }

    /// Waits for an event `name` whose data holds every member of `data`.
    pub fn await_event(&mut self, name: &str, data: Value) -> Value {
        let matches = |event: &Value| {
            event["event"] == name && data.as_object().unwrap().iter().all(|(k, v)| &event["data"][k] == v)
        };
        loop {
            if let Some(at) = self.events[self.seen..].iter().position(matches) {
                self.seen += at + 1;
                return self.events[self.seen - 1]["data"].clone();
            }
            let message = self.receive();
            assert!(message.get("event").is_some(), "an event, not {message}");
            self.events.push(message);
        }
    }

    /// Every event's name and data so far (timestamps left out).
    pub fn event_log(&self) -> Vec<Value> {
        self.events.iter().map(|e| json!([e["event"], e["data"]])).collect()
    }
}
