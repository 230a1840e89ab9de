//! Telling the service manager how the daemon is doing, as sd_notify(3)
//! does without libsystemd: each state is one datagram of `KEY=value`
//! lines sent to the unix socket `NOTIFY_SOCKET` names, a path or, when it
//! begins with `@`, a name in the abstract namespace.

use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// The variable the service manager names its socket in.
const VARIABLE: &str = "NOTIFY_SOCKET";

/// A socket connected to the service manager's.
#[derive(Debug)]
pub struct Notifier {
    socket: UnixDatagram,
}

impl Notifier {
    /// Reads and removes `NOTIFY_SOCKET` (no child is to take it for its
    /// own) and connects to the socket it names: `None` if it is not set,
    /// an error naming it if it cannot be reached (nothing there, not a
    /// datagram socket). Call it before any thread starts, as it changes
    /// the environment.
    pub fn from_env() -> Option<io::Result<Self>> {
        let name = std::env::var_os(VARIABLE)?;
        // SAFETY: no other thread runs yet (see above); Rust's readers take
        // the lock this takes.
        unsafe { std::env::remove_var(VARIABLE) };
        let name = name.to_string_lossy().into_owned();
        Some(Self::connect(&name).map_err(|e| io::Error::new(e.kind(), format!("{VARIABLE}='{name}': {e}"))))
    }

    /// Connects to the socket `name` names: a path, or `@` and an abstract name.
    pub fn connect(name: &str) -> io::Result<Self> {
        let addr = match name.strip_prefix('@') {
            Some(abstract_name) => SocketAddr::from_abstract_name(abstract_name)?,
            None if name.starts_with('/') => SocketAddr::from_pathname(name)?,
            None => return Err(io::Error::new(io::ErrorKind::InvalidInput, "neither an absolute path nor @NAME")),
        };
        let socket = UnixDatagram::unbound()?;
        socket.connect_addr(&addr)?;
        Ok(Self { socket })
    }

    /// Sends one state change: newline-separated `KEY=value` assignments
    /// (`READY=1`, `STATUS=...`, `STOPPING=1`, `MAINPID=...`).
    pub fn notify(&self, state: &str) -> io::Result<()> {
        self.socket.send(state.as_bytes()).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn received(server: &UnixDatagram) -> String {
        let mut buf = [0u8; 256];
        let n = server.recv(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[test]
    fn each_state_is_one_datagram_on_a_path_or_an_abstract_name() {
        let path = std::env::temp_dir().join(format!("vsd-sys-notify-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let server = UnixDatagram::bind(&path).unwrap();
        let notifier = Notifier::connect(path.to_str().unwrap()).unwrap();
        notifier.notify("READY=1\nSTATUS=serving").unwrap();
        notifier.notify("STOPPING=1").unwrap();
        assert_eq!(received(&server), "READY=1\nSTATUS=serving");
        assert_eq!(received(&server), "STOPPING=1");
        std::fs::remove_file(&path).unwrap();

        let name = format!("vsd-sys-notify-{}", std::process::id());
        let server = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        Notifier::connect(&format!("@{name}")).unwrap().notify("READY=1").unwrap();
        assert_eq!(received(&server), "READY=1");
    }

    #[test]
    fn a_name_that_is_no_datagram_socket_is_refused() {
        let kind = |name: &str| Notifier::connect(name).unwrap_err().kind();
        assert_eq!(kind("/nonexistent-vsd-dir/notify"), io::ErrorKind::NotFound);
        assert_eq!(kind("relative/notify"), io::ErrorKind::InvalidInput);
        // A regular file, and a name nobody bound.
        assert_eq!(kind("/dev/null"), io::ErrorKind::ConnectionRefused);
        assert_eq!(kind("@vsd-sys-notify-nobody"), io::ErrorKind::ConnectionRefused);
    }
}
