//! What a QMP session runs over: a unix or TCP connection, or the daemon's
//! own standard input and output.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;

/// A byte stream a monitor serves one client on. The session reads it on
/// one thread and writes a duplicate of it on another.
pub trait Transport: Read + Write + Send + Sync + Sized + 'static {
    /// Another handle on the same stream.
    fn duplicate(&self) -> io::Result<Self>;

    /// Ends the stream from any thread, so that a read or a write blocked
    /// on it returns: best effort, it may be a no-op.
    fn hang_up(&self);

    /// Events still go out once the input ended: a socket's client that
    /// closed its side is gone, while the daemon's standard output stays
    /// (QSD goes on writing events there until it exits).
    fn outlives_input(&self) -> bool {
        false
    }
}

impl Transport for UnixStream {
    fn duplicate(&self) -> io::Result<Self> {
        self.try_clone()
    }

    fn hang_up(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

impl Transport for TcpStream {
    fn duplicate(&self) -> io::Result<Self> {
        self.try_clone()
    }

    fn hang_up(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

/// The daemon's standard input (commands) and output (replies and events),
/// as `--chardev stdio` has them.
pub struct Stdio;

impl Read for Stdio {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        io::stdin().read(buf)
    }
}

impl Write for Stdio {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        io::stdout().write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stdout().flush()
    }
}

impl Transport for Stdio {
    fn duplicate(&self) -> io::Result<Self> {
        Ok(Stdio)
    }

    /// Nothing wakes a read of a terminal or a pipe: the reader stays until
    /// input ends, and the writer stops on its own.
    fn hang_up(&self) {}

    fn outlives_input(&self) -> bool {
        true
    }
}
