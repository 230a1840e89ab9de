//! The monitor socket and its connections.

use std::fs;
use std::io::{self, Read};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread;

use serde_json::{Value, json};
use vsd_sys::ListenError;

use super::output::Output;
use super::session::{Session, reply};
use super::stream::JsonStreamer;
use super::{Dispatch, Events, QmpError};
use crate::listener::AcceptLoop;

/// The most read from a client at once.
pub(crate) const READ_SIZE: usize = 16 * 1024;

/// A listening QMP monitor socket: one thread accepts, one thread serves each
/// connection. Dropping it stops accepting and removes the socket file;
/// open connections live on until they close.
pub struct QmpServer {
    path: PathBuf,
    _accept: AcceptLoop<UnixListener>,
}

impl QmpServer {
    /// Binds `path` and serves it on background threads. A stale socket file
    /// is replaced; a socket in use, or a path that is not a socket, is an
    /// error naming the path.
    pub fn listen(path: &Path, dispatch: Arc<dyn Dispatch>, events: Events) -> io::Result<Self> {
        let listener = bind(path)?;
        let mut connections = 0u64;
        let accept = AcceptLoop::spawn("vsd-qmp", listener, move |stream| {
            connections += 1;
            let (dispatch, events) = (dispatch.clone(), events.clone());
            let name = format!("vsd-qmp-{connections}");
            let spawned =
                thread::Builder::new().name(name.clone()).spawn(move || run_connection(stream, dispatch, events, name));
            if let Err(e) = spawned {
                log::error!("QMP: cannot serve a connection: {e}");
            }
        })?;
        Ok(Self { path: path.to_owned(), _accept: accept })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for QmpServer {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_file(&self.path) {
            log::warn!("QMP: cannot remove '{}': {e}", self.path.display());
        }
    }
}

/// Creates the listening socket, readable and writable by the daemon's
/// user only, replacing only a stale socket file of this user.
fn bind(path: &Path) -> io::Result<UnixListener> {
    let shown = path.display();
    vsd_sys::listen_unix(path, 0o600).map_err(|e| match e {
        ListenError::NotASocket => {
            io::Error::new(io::ErrorKind::AlreadyExists, format!("'{shown}' exists and is not a socket"))
        }
        ListenError::InUse => {
            io::Error::new(io::ErrorKind::AddrInUse, format!("socket '{shown}' is in use by another process"))
        }
        ListenError::NotOwned { uid } => io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("'{shown}' is a stale socket of user {uid}; vsd replaces only its own"),
        ),
        ListenError::Io(e) => io::Error::new(e.kind(), format!("cannot listen on '{shown}': {e}")),
    })
}

fn run_connection(stream: UnixStream, dispatch: Arc<dyn Dispatch>, events: Events, name: String) {
    let output = match stream.try_clone().and_then(|writer| Output::start(writer, format!("{name}-out"))) {
        Ok(output) => output,
        Err(e) => return log::error!("QMP: cannot serve a connection: {e}"),
    };
    match serve(stream, &output, dispatch, events) {
        Ok(()) => {
            log::debug!("QMP: client done");
            output.finish();
        }
        Err(e) => {
            log::debug!("QMP: connection closed: {e}");
            output.close();
        }
    }
}

/// Serves one client until it disconnects, its replies and events going
/// out through `output`.
fn serve(mut stream: UnixStream, output: &Arc<Output>, dispatch: Arc<dyn Dispatch>, events: Events) -> io::Result<()> {
    output.send(&greeting(), false)?;
    events.listen(output);
    let mut inbound = Inbound::new(dispatch, JsonStreamer::default());
    let mut chunk = [0; READ_SIZE];
    loop {
        let len = match stream.read(&mut chunk) {
            Ok(0) => return Ok(()),
            Ok(len) => len,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        inbound.receive(&chunk[..len], |answer, negotiated| output.send(answer, negotiated))?;
    }
}

/// A connection's input side: the client's bytes in, one reply per
/// message (or per error in the input) out, in order.
pub(crate) struct Inbound {
    session: Session,
    input: JsonStreamer,
}

impl Inbound {
    pub(crate) fn new(dispatch: Arc<dyn Dispatch>, input: JsonStreamer) -> Self {
        Self { session: Session::new(dispatch), input }
    }

    /// Takes bytes read from the client and runs the messages they
    /// complete, handing each reply to `send` with the session's
    /// negotiation state after it. Stops at the first reply `send` fails.
    pub(crate) fn receive(
        &mut self,
        bytes: &[u8],
        mut send: impl FnMut(&Value, bool) -> io::Result<()>,
    ) -> io::Result<()> {
        self.input.push(bytes);
        while let Some(message) = self.input.next_value() {
            let answer = match message {
                Ok(message) => self.session.handle(message),
                Err(parse_error) => reply(Err(QmpError::generic(parse_error)), None),
            };
            let sent = send(&answer, self.session.negotiated());
            self.session.after_reply();
            sent?;
        }
        Ok(())
    }

    /// Bytes of input held for a message not complete yet.
    #[cfg(feature = "fuzzing")]
    pub(crate) fn buffered(&self) -> usize {
        self.input.buffered()
    }
}

/// What the server says on connection: who it is and which capabilities it
/// offers (none).
fn greeting() -> Value {
    let number = |version: &str| version.parse::<u64>().unwrap_or_default();
    json!({"QMP": {
        "version": {
            "qemu": {
                "major": number(env!("CARGO_PKG_VERSION_MAJOR")),
                "minor": number(env!("CARGO_PKG_VERSION_MINOR")),
                "micro": number(env!("CARGO_PKG_VERSION_PATCH")),
            },
            "package": concat!("vsd ", env!("CARGO_PKG_VERSION")),
        },
        "capabilities": [],
    }})
}
