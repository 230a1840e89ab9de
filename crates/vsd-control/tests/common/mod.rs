//! A QMP server with a fake command set, and a raw line-oriented client.

#![allow(dead_code)] // Each test binary uses its own part.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value, json};
use vsd_control::qmp::{Dispatch, ErrorClass, Events, QmpError, QmpServer};

/// Generous: only a broken server takes this long.
pub const TIMEOUT: Duration = Duration::from_secs(20);

/// `echo` returns its arguments, `nothing` returns nothing, `fail` fails.
pub struct FakeDispatch;

impl Dispatch for FakeDispatch {
    fn execute(&self, command: &str, arguments: Map<String, Value>) -> Result<Value, QmpError> {
        match command {
            "echo" => Ok(Value::Object(arguments)),
            "nothing" => Ok(Value::Null),
            "fail" => Err(QmpError::new(ErrorClass::DeviceNotFound, "Device 'nope' not found")),
            _ => Err(QmpError::new(ErrorClass::CommandNotFound, format!("The command {command} has not been found"))),
        }
    }
}

/// A socket path of its own for each test.
pub fn socket_path(test: &str) -> PathBuf {
    std::env::temp_dir().join(format!("vsd-control-{test}-{}.sock", std::process::id()))
}

/// A server for `test`, with the events it broadcasts.
pub fn server(test: &str) -> (QmpServer, Events) {
    let events = Events::new();
    let server = QmpServer::listen(&socket_path(test), Arc::new(FakeDispatch), events.clone()).expect("listen");
    (server, events)
}

/// A client that sends raw bytes and reads replies line by line.
pub struct RawClient {
    stream: UnixStream,
    reader: BufReader<UnixStream>,
    /// The server's greeting.
    pub greeting: Value,
}

impl RawClient {
    /// Connects and reads the greeting.
    pub fn connect(server: &QmpServer) -> Self {
        let stream = UnixStream::connect(server.path().unwrap()).expect("connect");
        stream.set_read_timeout(Some(TIMEOUT)).unwrap();
        let reader = BufReader::new(stream.try_clone().unwrap());
        let mut client = Self { stream, reader, greeting: Value::Null };
        client.greeting = client.receive();
        client
    }

    /// Connects and completes capabilities negotiation.
    pub fn negotiated(server: &QmpServer) -> Self {
        let mut client = Self::connect(server);
        assert_eq!(client.command(r#"{"execute": "qmp_capabilities"}"#), json!({"return": {}}));
        client
    }

    pub fn send(&mut self, input: impl AsRef<[u8]>) {
        self.stream.write_all(input.as_ref()).expect("send");
    }

    /// Reads one line, which must be one JSON value.
    pub fn receive(&mut self) -> Value {
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("receive");
        assert!(line.ends_with('\n'), "unterminated message {line:?}");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
    }

    /// Reads one whole line if the server sends one before closing.
    pub fn try_receive(&mut self) -> Option<Value> {
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(_) if line.ends_with('\n') => Some(serde_json::from_str(&line).expect("one JSON value")),
            _ => None,
        }
    }

    /// Sends `input` as a line and reads the reply.
    pub fn command(&mut self, input: &str) -> Value {
        self.send(format!("{input}\n"));
        self.receive()
    }
}

/// An error reply's class and description.
pub fn error_of(reply: &Value) -> (&str, &str) {
    let error = &reply["error"];
    (error["class"].as_str().expect("an error reply"), error["desc"].as_str().expect("a description"))
}
