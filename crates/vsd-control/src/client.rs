//! A blocking QMP client for vsd's own tools.

use std::io::{self, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use serde::Deserialize;
use serde_json::de::IoRead;
use serde_json::{StreamDeserializer, Value, json};

use crate::qmp::QmpError;

/// Why a command did not return.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The connection failed.
    #[error("QMP connection: {0}")]
    Io(#[from] io::Error),
    /// The server answered with an error.
    #[error("{0}")]
    Qmp(QmpError),
    /// The server said something that is not QMP.
    #[error("QMP protocol error: {0}")]
    Protocol(String),
}

/// A connection to a QMP monitor in command mode.
pub struct QmpClient {
    writer: UnixStream,
    /// Messages are read as a stream of JSON values: servers are not bound
    /// to one message per line (QEMU's `pretty=on`).
    messages: StreamDeserializer<'static, IoRead<BufReader<UnixStream>>, Value>,
    next_id: u64,
}

impl QmpClient {
    /// Connects, reads the greeting and negotiates capabilities. A server
    /// that does not speak QMP is an `InvalidData` error.
    pub fn connect(path: &Path) -> io::Result<Self> {
        let writer = UnixStream::connect(path)?;
        let reader = BufReader::new(writer.try_clone()?);
        let messages = serde_json::Deserializer::from_reader(reader).into_iter();
        let mut client = Self { writer, messages, next_id: 0 };
        client.negotiate().map_err(|e| match e {
            ClientError::Io(e) => e,
            e => io::Error::new(io::ErrorKind::InvalidData, e),
        })?;
        Ok(client)
    }

    fn negotiate(&mut self) -> Result<(), ClientError> {
        let greeting = self.receive()?;
        if greeting.get("QMP").is_none() {
            return Err(ClientError::Protocol(format!("expected a greeting, got {greeting}")));
        }
        self.execute("qmp_capabilities", Value::Null).map(drop)
    }

    /// Runs `command` with `arguments` (an object, or `Null` for none) and
    /// returns what it returned. Events arriving meanwhile are skipped.
    pub fn execute(&mut self, command: &str, arguments: Value) -> Result<Value, ClientError> {
        let id = self.next_id;
        self.next_id += 1;
        let mut request = json!({"execute": command, "id": id});
        if !arguments.is_null() {
            request["arguments"] = arguments;
        }
        self.writer.write_all(format!("{request}\n").as_bytes())?;
        loop {
            let message = self.receive()?;
            if message.get("event").is_some() {
                continue;
            }
            // A reply without an id answers input the server could not read.
            if message.get("id").is_some_and(|echoed| echoed != id) {
                return Err(ClientError::Protocol(format!("expected the reply to command {id}, got {message}")));
            }
            return returned(message);
        }
    }

    fn receive(&mut self) -> Result<Value, ClientError> {
        match self.messages.next() {
            Some(Ok(message)) => Ok(message),
            Some(Err(e)) if e.is_io() || e.is_eof() => Err(ClientError::Io(e.into())),
            Some(Err(e)) => Err(ClientError::Protocol(format!("invalid JSON: {e}"))),
            None => Err(ClientError::Io(io::Error::new(io::ErrorKind::UnexpectedEof, "the server hung up"))),
        }
    }
}

/// What a reply says the command returned.
fn returned(mut reply: Value) -> Result<Value, ClientError> {
    if let Some(value) = reply.get_mut("return") {
        return Ok(value.take());
    }
    match reply.get("error").map(QmpError::deserialize) {
        Some(Ok(error)) => Err(ClientError::Qmp(error)),
        _ => Err(ClientError::Protocol(format!("expected a reply, got {reply}"))),
    }
}
