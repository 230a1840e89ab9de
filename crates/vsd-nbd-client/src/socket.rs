//! The connection's socket: unix or TCP.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use vsd_nbd_proto::Address;

pub(crate) enum Socket {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Socket {
    /// Connects, with `timeout` on every later read and write (the
    /// handshake's; the transmission phase is non-blocking).
    pub(crate) fn connect(address: &Address, timeout: Duration) -> io::Result<Self> {
        let socket = match address {
            Address::Unix(path) => Socket::Unix(UnixStream::connect(path)?),
            Address::Inet { host, port } => {
                let stream = TcpStream::connect((host.as_str(), *port))?;
                // Requests are small and latency-bound: no Nagle delay.
                stream.set_nodelay(true)?;
                Socket::Tcp(stream)
            }
        };
        match &socket {
            Socket::Unix(s) => s.set_read_timeout(Some(timeout)).and_then(|()| s.set_write_timeout(Some(timeout)))?,
            Socket::Tcp(s) => s.set_read_timeout(Some(timeout)).and_then(|()| s.set_write_timeout(Some(timeout)))?,
        }
        Ok(socket)
    }

    pub(crate) fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Socket::Unix(s) => s.set_nonblocking(on),
            Socket::Tcp(s) => s.set_nonblocking(on),
        }
    }
}

impl Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Socket::Unix(s) => s.read(buf),
            Socket::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Socket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Socket::Unix(s) => s.write(buf),
            Socket::Tcp(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for Socket {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Socket::Unix(s) => s.as_raw_fd(),
            Socket::Tcp(s) => s.as_raw_fd(),
        }
    }
}
