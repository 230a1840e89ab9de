//! A minimal HTTP/1.1 endpoint for Prometheus to scrape, with a status
//! page for people at `/` that polls `/status.json`.
//!
//! Requests are served one at a time on a single thread. A request has a
//! deadline to arrive and another to be answered, and its size is capped, so
//! a slow or hostile client holds the thread up for a few seconds at most.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::listener::AcceptLoop;

/// How long a client has to send its request, and again to take the
/// response.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest request head read; a scrape's is a few hundred bytes.
const MAX_HEAD_LEN: usize = 16 * 1024;

/// The most input left unread after the head that is read and dropped
/// before closing the connection.
const MAX_DRAINED: u64 = 64 * 1024;

/// The Prometheus text exposition format.
const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The status page: one file, its style and script inline, so that it
/// needs nothing but this server.
const STATUS_PAGE: &str = include_str!("status_page.html");

/// Renders a response body.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// What the server serves.
#[derive(Clone)]
pub struct Sources {
    /// The metrics, in the Prometheus text format (`/metrics`).
    pub metrics: Render,
    /// The daemon's state as JSON, which the status page polls
    /// (`/status.json`).
    pub status: Render,
}

/// A running metrics endpoint. Dropping it stops the server.
pub struct MetricsServer {
    local_addr: SocketAddr,
    _accept: AcceptLoop<TcpListener>,
}

impl MetricsServer {
    /// Listens on the TCP address `addr` (port 0 picks a free port) and
    /// serves `GET /metrics` and `GET /status.json` from `sources`, and the
    /// status page at `GET /`.
    pub fn start(addr: &str, sources: Sources) -> io::Result<Self> {
        let listener =
            TcpListener::bind(addr).map_err(|e| io::Error::new(e.kind(), format!("cannot listen on '{addr}': {e}")))?;
        let local_addr = listener.local_addr()?;
        let accept = AcceptLoop::spawn("vsd-metrics", listener, move |stream| {
            if let Err(e) = serve(stream, &sources) {
                log::debug!("metrics: request dropped: {e}");
            }
        })?;
        Ok(Self { local_addr, _accept: accept })
    }

    /// The address listened on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

fn serve(mut stream: TcpStream, sources: &Sources) -> io::Result<()> {
    let response = match read_head(&mut stream, Instant::now() + REQUEST_TIMEOUT)? {
        Some(head) => respond(&head, sources),
        None => failure("431 Request Header Fields Too Large", ""),
    };
    time_out_at(&stream, Instant::now() + REQUEST_TIMEOUT)?;
    stream.write_all(response.as_bytes())?;
    linger(&stream);
    Ok(())
}

/// Reads the request up to its blank line, or `None` if it is too long.
fn read_head(stream: &mut TcpStream, deadline: Instant) -> io::Result<Option<Vec<u8>>> {
    let mut head = Vec::new();
    let mut chunk = [0; 4096];
    while !ends_head(&head) {
        if head.len() > MAX_HEAD_LEN {
            return Ok(None);
        }
        time_out_at(stream, deadline)?;
        let len = stream.read(&mut chunk)?;
        if len == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        head.extend_from_slice(&chunk[..len]);
    }
    Ok(Some(head))
}

/// Makes reads from and writes to `stream` fail at `deadline`.
fn time_out_at(stream: &TcpStream, deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    stream.set_read_timeout(Some(left))?;
    stream.set_write_timeout(Some(left))
}

/// Lets the client close first, within the current deadline: closing with
/// its input unread would reset the connection, which can destroy the
/// response before the client reads it.
fn linger(stream: &TcpStream) {
    // Best effort: the response is out either way.
    let _ = stream.shutdown(Shutdown::Write).and_then(|()| io::copy(&mut stream.take(MAX_DRAINED), &mut io::sink()));
}

/// Whether `input` holds a whole request head (HTTP allows bare newlines).
fn ends_head(input: &[u8]) -> bool {
    input.windows(4).any(|w| w == b"\r\n\r\n") || input.windows(2).any(|w| w == b"\n\n")
}

/// Answers the request `head`.
fn respond(head: &[u8], sources: &Sources) -> String {
    let request_line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let mut words = request_line.trim_ascii().split(|&b| b == b' ');
    match (words.next(), words.next().map(without_query)) {
        (Some(b"GET"), Some(b"/metrics")) => response("200 OK", "", METRICS_CONTENT_TYPE, &(sources.metrics)()),
        (Some(b"GET"), Some(b"/status.json")) => {
            response("200 OK", "Cache-Control: no-store\r\n", "application/json", &(sources.status)())
        }
        (Some(b"GET"), Some(b"/")) => response("200 OK", "", "text/html; charset=utf-8", STATUS_PAGE),
        (Some(b"GET"), Some(_)) => failure("404 Not Found", ""),
        (Some(_), Some(_)) => failure("405 Method Not Allowed", "Allow: GET\r\n"),
        _ => failure("400 Bad Request", ""),
    }
}

fn without_query(target: &[u8]) -> &[u8] {
    target.split(|&b| b == b'?').next().unwrap_or_default()
}

/// A response saying what went wrong.
fn failure(status: &str, headers: &str) -> String {
    response(status, headers, "text/plain; charset=utf-8", &format!("{status}\n"))
}

/// A whole response; `headers` are extra lines, each ending with CRLF.
fn response(status: &str, headers: &str, content_type: &str, body: &str) -> String {
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n{headers}\r\n{body}",
        body.len()
    )
}
