//! The back-end request channel: how the export tells the front-end that
//! the device's config space changed (a resize), so that it re-reads it and
//! interrupts the guest.
//!
//! rust-vmm's `vhost` crate receives the channel (SET_BACKEND_REQ_FD) but
//! its `Backend` cannot send CONFIG_CHANGE_MSG and does not give the socket
//! back. So the connection loop peeks at each message before the crate reads
//! it; a peek hands this process its own copy of any descriptor the message
//! carries, and the copy of the channel is kept here.

use std::io::{self, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

/// VHOST_USER_SET_BACKEND_REQ_FD, front-end to back-end.
const SET_BACKEND_REQ_FD: u32 = 21;
/// VHOST_USER_BACKEND_CONFIG_CHANGE_MSG, back-end to front-end.
const CONFIG_CHANGE_MSG: u32 = 2;
/// Header flags: protocol version 1, no reply wanted.
const VERSION_1: u32 = 1;

/// The back-end's end of the request channel.
pub(crate) struct BackendChannel(UnixStream);

impl BackendChannel {
    /// Looks at the next message on the front-end's connection without
    /// consuming it; if it hands over the request channel, keeps a copy.
    pub(crate) fn intercept(connection: &UnixStream) -> io::Result<Option<Self>> {
        let mut header = [0u8; 4];
        let (n, _) = vsd_sys::peek(connection.as_fd(), &mut header, false)?;
        if n < header.len() || u32::from_le_bytes(header) != SET_BACKEND_REQ_FD {
            return Ok(None);
        }
        let (_, fds) = vsd_sys::peek(connection.as_fd(), &mut header, true)?;
        Ok(fds.into_iter().next().map(|fd| Self(UnixStream::from(fd))))
    }

    /// Sends CONFIG_CHANGE_MSG. No reply is asked for: the front-end answers
    /// by reading the config space on the main connection, which the
    /// connection's own thread serves.
    pub(crate) fn config_changed(&mut self) -> io::Result<()> {
        let mut message = [0u8; 12];
        message[..4].copy_from_slice(&CONFIG_CHANGE_MSG.to_le_bytes());
        message[4..8].copy_from_slice(&VERSION_1.to_le_bytes());
        // Bytes 8..12: the payload size, 0.
        self.0.write_all(&message)
    }
}
