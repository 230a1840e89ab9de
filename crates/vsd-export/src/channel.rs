//! Messages the `vhost` crate does not hand over, seen before it reads them.
//!
//! The back-end request channel: how the export tells the front-end that
//! the device's config space changed (a resize), so that it re-reads it and
//! interrupts the guest. rust-vmm's `vhost` crate receives the channel
//! (SET_BACKEND_REQ_FD) but its `Backend` cannot send CONFIG_CHANGE_MSG and
//! does not give the socket back.
//!
//! SET_LOG_FD, the descriptor to signal when the dirty log was written
//! (as libvhost-user does), which the crate refuses as an invalid message.
//!
//! So the connection loop peeks at each message before the crate reads it;
//! a peek hands this process its own copy of any descriptor the message
//! carries. The channel's copy is kept here; SET_LOG_FD is read and
//! answered here, and the crate never sees it.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::{Mutex, PoisonError};

use crate::session::Session;

/// VHOST_USER_SET_LOG_FD, front-end to back-end.
const SET_LOG_FD: u32 = 7;
/// VHOST_USER_SET_BACKEND_REQ_FD, front-end to back-end.
const SET_BACKEND_REQ_FD: u32 = 21;
/// VHOST_USER_BACKEND_CONFIG_CHANGE_MSG, back-end to front-end.
const CONFIG_CHANGE_MSG: u32 = 2;
/// Header flags: protocol version 1, no reply wanted.
const VERSION_1: u32 = 1;
/// Header flag of a reply.
const REPLY: u32 = 1 << 2;
/// Header flag: the front-end wants to hear whether the message worked
/// (REPLY_ACK).
const NEED_REPLY: u32 = 1 << 3;
/// A message header: request, flags, payload size.
const HEADER: usize = 12;
/// The most payload a SET_LOG_FD may carry (the spec gives it none; some
/// front-ends send a u64).
const LOG_FD_PAYLOAD_MAX: usize = 8;

/// The back-end's end of the request channel.
pub(crate) struct BackendChannel(UnixStream);

/// What [`intercept`] made of the next message.
pub(crate) enum Intercepted {
    /// Nothing: the `vhost` crate reads it.
    Nothing,
    /// It hands the request channel over (the crate reads it too).
    Channel(BackendChannel),
    /// It was read and answered here: the crate must not wait for it.
    Taken,
}

/// Looks at the next message on the front-end's connection before the
/// `vhost` crate reads it: keeps a copy of the request channel it hands
/// over, if it does; takes SET_LOG_FD itself, giving the descriptor to
/// `session`.
pub(crate) fn intercept(connection: &UnixStream, session: &Mutex<Session>) -> io::Result<Intercepted> {
    let mut header = [0u8; HEADER];
    let (n, _) = vsd_sys::peek(connection.as_fd(), &mut header, false)?;
    let word = |at: usize| u32::from_le_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]]);
    match (n, word(0)) {
        (4.., SET_BACKEND_REQ_FD) => {
            let (_, fds) = vsd_sys::peek(connection.as_fd(), &mut header, true)?;
            let channel = fds.into_iter().next().map(|fd| BackendChannel(UnixStream::from(fd)));
            Ok(channel.map_or(Intercepted::Nothing, Intercepted::Channel))
        }
        (HEADER, SET_LOG_FD) => {
            take_log_fd(connection, session, word(4), word(8) as usize)?;
            Ok(Intercepted::Taken)
        }
        _ => Ok(Intercepted::Nothing),
    }
}

/// Reads a SET_LOG_FD of `size` payload bytes off the connection, hands its
/// descriptor to the session and answers it if asked to. A message that
/// cannot be right (an oversized payload) is an error: the connection goes.
fn take_log_fd(connection: &UnixStream, session: &Mutex<Session>, flags: u32, size: usize) -> io::Result<()> {
    if size > LOG_FD_PAYLOAD_MAX {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("SET_LOG_FD with {size} bytes of payload")));
    }
    let (_, fds) = vsd_sys::peek(connection.as_fd(), &mut [0u8; HEADER], true)?;
    // The message's own descriptors go with it: the peek's copies remain.
    (&*connection).read_exact(&mut [0u8; HEADER + LOG_FD_PAYLOAD_MAX][..HEADER + size])?;
    let taken = match fds.into_iter().next() {
        Some(fd) => session.lock().unwrap_or_else(PoisonError::into_inner).set_log_fd(File::from(fd)),
        None => Err(io::Error::new(io::ErrorKind::InvalidInput, "SET_LOG_FD without a descriptor")),
    };
    if let Err(e) = &taken {
        log::warn!("refusing the dirty log's descriptor: {e}");
    }
    if flags & NEED_REPLY == 0 {
        return Ok(());
    }
    let mut reply = [0u8; HEADER + 8];
    reply[..4].copy_from_slice(&SET_LOG_FD.to_le_bytes());
    reply[4..8].copy_from_slice(&(VERSION_1 | REPLY).to_le_bytes());
    reply[8..12].copy_from_slice(&8u32.to_le_bytes());
    reply[12..].copy_from_slice(&u64::from(taken.is_err()).to_le_bytes());
    (&*connection).write_all(&reply)
}

/// How long a front-end may leave the channel full before a message to it
/// fails: it must not hold up the command that sends it.
const WRITE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

impl BackendChannel {
    /// A second handle on the channel.
    pub(crate) fn try_clone(&self) -> io::Result<Self> {
        self.0.try_clone().map(Self)
    }

    /// Sends CONFIG_CHANGE_MSG. No reply is asked for: the front-end answers
    /// by reading the config space on the main connection, which the
    /// connection's own thread serves.
    pub(crate) fn config_changed(&mut self) -> io::Result<()> {
        self.0.set_write_timeout(Some(WRITE_TIMEOUT))?;
        let mut message = [0u8; 12];
        message[..4].copy_from_slice(&CONFIG_CHANGE_MSG.to_le_bytes());
        message[4..8].copy_from_slice(&VERSION_1.to_le_bytes());
        // Bytes 8..12: the payload size, 0.
        self.0.write_all(&message)
    }
}
