//! A monitor's clients: the connections its socket accepts, or the
//! daemon's standard input and output, each served by the same session.

use std::fs;
use std::io::{self, Read};
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use serde_json::{Value, json};
use vsd_sys::ListenError;

use super::inband::{InBand, Sink, respond};
use super::output::Output;
use super::session::{CAPABILITIES, Request, Session, Step};
use super::stream::JsonStreamer;
use super::transport::Transport;
use super::{Dispatch, Events};
use crate::listener::{AcceptLoop, Listener};

/// The most read from a client at once.
pub(crate) const READ_SIZE: usize = 16 * 1024;

/// What a monitor's clients share: the commands they run, the events they
/// receive and how their JSON is laid out.
#[derive(Clone)]
pub struct Monitor {
    dispatch: Arc<dyn Dispatch>,
    events: Events,
    pretty: bool,
}

impl Monitor {
    /// A monitor writing one line per message.
    pub fn new(dispatch: Arc<dyn Dispatch>, events: Events) -> Self {
        Self { dispatch, events, pretty: false }
    }

    /// Pretty-prints messages as QEMU's `pretty=on` does.
    pub fn pretty(self, pretty: bool) -> Self {
        Self { pretty, ..self }
    }

    /// Serves one client on threads of its own, `name` reading and
    /// `name-out` writing, until its input ends (or, for a transport whose
    /// output outlives its input, until [`Served::finish`]).
    pub fn serve<T: Transport>(&self, client: T, name: String) -> io::Result<Served> {
        let output = Output::start(client.duplicate()?, format!("{name}-out"), self.pretty)?;
        let session = (self.dispatch.clone(), self.events.clone(), output.clone());
        let spawned = thread::Builder::new().name(name).spawn(move || {
            let (dispatch, events, output) = session;
            run_connection(client, &output, dispatch, events)
        });
        if spawned.is_err() {
            output.close();
        }
        spawned.map(|_| Served(output))
    }
}

/// A client being served.
pub struct Served(Arc<Output>);

impl Served {
    /// Writes what waits for the client, for at most `timeout`, then ends
    /// the connection: the daemon's standard output gets the events of its
    /// shutdown before it exits.
    pub fn finish(self, timeout: Duration) {
        self.0.finish_within(timeout);
    }
}

/// A listening socket for a monitor.
pub struct QmpListener {
    socket: Socket,
    /// The socket file vsd created for it, removed when done.
    file: Option<SocketFile>,
}

enum Socket {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl QmpListener {
    /// Binds a unix socket at `path`, readable and writable by the daemon's
    /// user only. A stale socket file is replaced; a socket in use, or a
    /// path that is not a socket, is an error naming the path.
    pub fn bind_unix(path: &Path) -> io::Result<Self> {
        let listener = bind(path)?;
        Ok(Self { socket: Socket::Unix(listener), file: Some(SocketFile(path.to_owned())) })
    }
}

impl From<UnixListener> for QmpListener {
    fn from(listener: UnixListener) -> Self {
        Self { socket: Socket::Unix(listener), file: None }
    }
}

impl From<TcpListener> for QmpListener {
    fn from(listener: TcpListener) -> Self {
        Self { socket: Socket::Tcp(listener), file: None }
    }
}

/// A socket file to remove once its server stops.
struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_file(&self.0) {
            log::warn!("QMP: cannot remove '{}': {e}", self.0.display());
        }
    }
}

/// A monitor's listening socket: one thread accepts, and each connection
/// is served as [`Monitor::serve`] does. Dropping it stops accepting and
/// removes the socket file vsd created; open connections live on until
/// they close.
pub struct QmpServer {
    /// The accept thread's [`AcceptLoop`], of whichever socket, kept for
    /// its `Drop`: accepting stops before the file goes.
    _accept: Box<dyn Send>,
    file: Option<SocketFile>,
}

impl QmpServer {
    /// Binds `path` as [`QmpListener::bind_unix`] does and serves it as
    /// `Monitor::new(dispatch, events)` on background threads.
    pub fn listen(path: &Path, dispatch: Arc<dyn Dispatch>, events: Events) -> io::Result<Self> {
        Self::start(QmpListener::bind_unix(path)?, Monitor::new(dispatch, events), false)
    }

    /// Serves every connection `listener` accepts. With `wait` (QEMU's
    /// `wait=on`), it first waits for a client, and returns once that one
    /// is being served.
    pub fn start(listener: QmpListener, monitor: Monitor, wait: bool) -> io::Result<Self> {
        let accept: Box<dyn Send> = match listener.socket {
            Socket::Unix(socket) => Box::new(accept(socket, monitor, wait)?),
            Socket::Tcp(socket) => Box::new(accept(socket, monitor, wait)?),
        };
        Ok(Self { _accept: accept, file: listener.file })
    }

    /// The socket file's path, for a socket vsd bound at one.
    pub fn path(&self) -> Option<&Path> {
        self.file.as_ref().map(|file| file.0.as_path())
    }
}

/// Starts the accept thread, each connection on threads named after it.
fn accept<L: Listener>(listener: L, monitor: Monitor, wait: bool) -> io::Result<AcceptLoop<L>>
where
    L::Stream: Transport,
{
    let mut connections = 0u64;
    let mut serve = move |stream| {
        connections += 1;
        if let Err(e) = monitor.serve(stream, format!("vsd-qmp-{connections}")) {
            log::error!("QMP: cannot serve a connection: {e}");
        }
    };
    if wait {
        serve(listener.accept_stream()?);
    }
    AcceptLoop::spawn("vsd-qmp", listener, serve)
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

fn run_connection<T: Transport>(client: T, output: &Arc<Output>, dispatch: Arc<dyn Dispatch>, events: Events) {
    let output_stays = client.outlives_input();
    match serve(client, output, dispatch, events) {
        Ok(()) if output_stays => log::debug!("QMP: input ended; events still go out"),
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

/// Serves one client until its input ends, its replies and events going
/// out through `output`.
fn serve(mut input: impl Read, output: &Arc<Output>, dispatch: Arc<dyn Dispatch>, events: Events) -> io::Result<()> {
    output.send(&greeting(), false)?;
    events.listen(output);
    let name = format!("{}-in-band", thread::current().name().unwrap_or("vsd-qmp"));
    let mut inbound = Inbound::new(dispatch, JsonStreamer::default(), output.clone(), Some(name));
    let mut chunk = [0; READ_SIZE];
    loop {
        let len = match input.read(&mut chunk) {
            Ok(0) => return Ok(()),
            Ok(len) => len,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        inbound.receive(&chunk[..len])?;
    }
}

/// A connection's input side: the client's bytes in, one reply per
/// message (or per error in the input) out, in-band ones in order.
pub(crate) struct Inbound {
    session: Session,
    input: JsonStreamer,
    dispatch: Arc<dyn Dispatch>,
    sink: Arc<dyn Sink>,
    /// The thread in-band requests run on once the client enabled `oob`;
    /// until then they run on the reading thread, one at a time.
    in_band: Option<InBand>,
    /// That thread's name; none to keep every request on the reading
    /// thread (the fuzz target's harness).
    in_band_name: Option<String>,
}

impl Inbound {
    pub(crate) fn new(
        dispatch: Arc<dyn Dispatch>,
        input: JsonStreamer,
        sink: Arc<dyn Sink>,
        in_band_name: Option<String>,
    ) -> Self {
        Self { session: Session::new(dispatch.clone()), input, dispatch, sink, in_band: None, in_band_name }
    }

    /// Takes bytes read from the client and handles the messages they
    /// complete. Stops at the first reply that cannot be sent.
    pub(crate) fn receive(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.input.push(bytes);
        while let Some(message) = self.input.next_value() {
            match self.session.handle(message) {
                Step::Answered(reply) => self.sink.send(&reply, self.session.negotiated())?,
                Step::InBand(request) => self.run_in_band(request)?,
            }
        }
        Ok(())
    }

    fn run_in_band(&mut self, request: Request) -> io::Result<()> {
        if self.in_band.is_none()
            && self.session.out_of_band()
            && let Some(name) = &self.in_band_name
        {
            self.in_band = Some(InBand::start(name.clone(), self.dispatch.clone(), self.sink.clone())?);
        }
        match &self.in_band {
            Some(in_band) => in_band.push(request),
            None => respond(request, &*self.dispatch, &*self.sink),
        }
    }

    /// Bytes of input held for a message not complete yet.
    #[cfg(feature = "fuzzing")]
    pub(crate) fn buffered(&self) -> usize {
        self.input.buffered()
    }
}

/// What the server says on connection: the QEMU release whose QMP it
/// speaks, and the capabilities it offers.
fn greeting() -> Value {
    json!({"QMP": {"version": super::version(), "capabilities": CAPABILITIES}})
}
