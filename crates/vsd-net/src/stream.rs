//! A connection over a unix or a TCP socket, and the [`Wire`] the
//! transmission phase speaks on: the socket itself, or TLS over it.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// One connection's socket.
pub enum Stream {
    /// A unix socket.
    Unix(UnixStream),
    /// A TCP socket.
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
    /// Another handle on the same socket.
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
        })
    }

    /// Cuts the connection: the serving thread's reads and writes fail.
    pub fn shutdown(&self) {
        let _ = both!(self, s => s.shutdown(Shutdown::Both));
    }

    /// Read and write timeouts (`None`: wait for ever).
    pub fn set_timeouts(&self, timeout: Option<Duration>) -> io::Result<()> {
        both!(self, s => s.set_read_timeout(timeout))?;
        both!(self, s => s.set_write_timeout(timeout))
    }

    /// Makes reads and writes return `WouldBlock` instead of waiting.
    pub fn set_nonblocking(&self) -> io::Result<()> {
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

/// What the transmission phase reads requests from and writes replies to,
/// non-blocking. The plain socket is one; [`crate::TlsStream`] the
/// other. Generic, so that plain connections pay for no TLS branch.
pub trait Wire: AsRawFd + Send {
    /// As [`Read::read`]: `WouldBlock` when nothing is there.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize>;
    /// As [`Write::write_vectored`]: the bytes taken are the wire's to send.
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize>;
    /// Sends what the wire took but could not send yet; true if any went out.
    fn flush_held(&mut self) -> io::Result<bool> {
        Ok(false)
    }
    /// Whether the wire still holds bytes taken and not sent.
    fn holds_back(&self) -> bool {
        false
    }
    /// Ends the session politely, without waiting.
    fn close(&mut self) {}
    /// The socket itself, if bytes may be written to it directly (by
    /// `splice(2)`, between the wire's writes): a plain socket. A wire
    /// that transforms what it sends (TLS) answers `None`.
    fn splice_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
}

impl Wire for Stream {
    #[inline]
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
    #[inline]
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        Write::write_vectored(&mut &*self, bufs)
    }
    fn splice_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(both!(self, s => s.as_fd()))
    }
}
