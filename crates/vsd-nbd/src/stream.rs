//! A connected client, over a unix or a TCP socket.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// One client's socket.
pub(crate) enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

macro_rules! both {
    ($self:expr, $s:ident => $e:expr) => {
        match $self {
            Stream::Unix($s) => $e,
            Stream::Tcp($s) => $e,
        }
    };
}

impl Stream {
    pub(crate) fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
        })
    }

    /// Cuts the connection: the serving thread's reads and writes fail.
    pub(crate) fn shutdown(&self) {
        let _ = both!(self, s => s.shutdown(Shutdown::Both));
    }

    pub(crate) fn set_timeouts(&self, timeout: Option<Duration>) -> io::Result<()> {
        both!(self, s => s.set_read_timeout(timeout))?;
        both!(self, s => s.set_write_timeout(timeout))
    }

    pub(crate) fn set_nonblocking(&self) -> io::Result<()> {
        both!(self, s => s.set_nonblocking(true))
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        both!(self, s => (&*s).read(buf))
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        both!(self, s => (&*s).write(buf))
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        both!(self, s => (&*s).write_vectored(bufs))
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        both!(self, s => s.as_raw_fd())
    }
}
