//! Listening sockets a manager hands over instead of paths to bind
//! (libvirt, a control plane, systemd): QEMU's `addr.type=fd`, whose
//! `addr.str` is a descriptor number or, as a vsd extension, the name
//! systemd's socket activation gives a socket (`FileDescriptorName=`).
//!
//! systemd passes its sockets from descriptor 3 on and describes them in
//! `LISTEN_PID` (the process they are for), `LISTEN_FDS` (how many) and
//! `LISTEN_FDNAMES` (their names, colon-separated), as sd_listen_fds(3)
//! reads them. vsd reads them once, on the first use of a passed socket;
//! the sockets are then marked close-on-exec and the variables removed,
//! so that no child takes them for its own.

use std::collections::HashSet;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use crate::check;

/// The descriptor socket activation passes first.
const FIRST_FD: RawFd = 3;
/// The variables socket activation sets.
const VARIABLES: [&str; 3] = ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"];

/// A listening socket's kind, as its users tell them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `AF_UNIX`.
    Unix,
    /// `AF_INET` or `AF_INET6`: TCP.
    Inet,
}

impl Family {
    fn name(self) -> &'static str {
        match self {
            Family::Unix => "unix",
            Family::Inet => "TCP",
        }
    }
}

/// Takes over the listening socket `text` names, a descriptor number or
/// the name socket activation gave it, if it is a stream socket of one of
/// `families`. One not yet listening (only bound) is made to listen, as
/// QEMU does. Each socket is taken once: a second export or server naming
/// it is refused. The errors are QEMU's words where QEMU has them.
pub fn take_listener(text: &str, families: &[Family]) -> io::Result<(OwnedFd, Family)> {
    let mut registry = registry();
    let fd = registry.activation.resolve(text)?;
    if registry.taken.contains(&fd) {
        return Err(io::Error::other(format!(
            "File descriptor '{text}' was taken already: a passed socket serves one export or server"
        )));
    }
    let family = check_listener(fd, text, families)?;
    registry.taken.insert(fd);
    // SAFETY: the descriptor is open (getsockopt answered for it) and its
    // owner is the manager that passed it, who handed it to vsd with its
    // number; `taken` keeps vsd from owning it twice. (A number naming a
    // socket vsd opened itself is a mistake this cannot tell, as in QEMU.)
    Ok((unsafe { OwnedFd::from_raw_fd(fd) }, family))
}

/// Reads the socket activation variables now: call it before any thread
/// starts (they leave the environment) and before the process forks to
/// become a daemon (`LISTEN_PID` names the process systemd started).
pub fn read_environment() {
    drop(registry());
}

/// What has been learnt of the passed sockets.
struct Registry {
    activation: Activation,
    /// Descriptors taken over: each is owned once.
    taken: HashSet<RawFd>,
}

fn registry() -> MutexGuard<'static, Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    let registry = REGISTRY.get_or_init(|| Mutex::new(Registry { activation: from_env(), taken: HashSet::new() }));
    // Every change is one insert: a panic leaves nothing half done.
    registry.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Reads and removes the socket activation variables; marks the sockets
/// they describe close-on-exec.
fn from_env() -> Activation {
    let [pid, fds, names] = VARIABLES.map(|name| std::env::var(name).ok());
    let activation = parse(std::process::id(), pid.as_deref(), fds.as_deref(), names.as_deref());
    let activation = match activation {
        Activation::Passed(names) => match (FIRST_FD..).take(names.len()).find(|&fd| set_cloexec(fd).is_err()) {
            Some(fd) => Activation::Broken(format!(
                "socket activation: LISTEN_FDS says {} sockets, but descriptor {fd} is not open",
                names.len()
            )),
            None => Activation::Passed(names),
        },
        other => other,
    };
    for name in VARIABLES {
        // SAFETY: the daemon reads them before any thread starts
        // (`read_environment`). Were another thread to run, Rust's readers
        // take the lock this takes, and glibc's unsetenv frees nothing that
        // a C reader (the resolver, librados) could still hold.
        unsafe { std::env::remove_var(name) };
    }
    activation
}

/// What socket activation passed this process.
#[derive(Debug, PartialEq, Eq)]
enum Activation {
    /// Nothing: `LISTEN_FDS` is not set.
    Nothing,
    /// Sockets from descriptor 3 on, by name.
    Passed(Vec<String>),
    /// Variables that do not add up: why, said when a name is looked up.
    Broken(String),
}

/// Reads the variables as process `our_pid` sees them. Without
/// `LISTEN_FDNAMES`, every socket is named `unknown`, as systemd names them.
fn parse(our_pid: u32, pid: Option<&str>, fds: Option<&str>, names: Option<&str>) -> Activation {
    let Some(fds) = fds else { return Activation::Nothing };
    let broken = |why: String| Activation::Broken(format!("socket activation: {why}"));
    match pid.map(str::parse::<u32>) {
        None => return broken("LISTEN_FDS is set but LISTEN_PID is not".into()),
        Some(Ok(pid)) if pid == our_pid => {}
        Some(_) => {
            let pid = pid.unwrap_or_default();
            return broken(format!(
                "LISTEN_PID is '{pid}', not vsd's pid {our_pid}: the sockets are another process's"
            ));
        }
    }
    let count = match fds.parse::<u16>() {
        Ok(count) => usize::from(count),
        Err(_) => return broken(format!("LISTEN_FDS is '{fds}', not a number of sockets")),
    };
    let names: Vec<String> = match names {
        None => vec!["unknown".into(); count],
        Some("") if count == 0 => Vec::new(),
        Some(names) => names.split(':').map(String::from).collect(),
    };
    if names.len() != count {
        return broken(format!("LISTEN_FDNAMES names {} sockets, LISTEN_FDS says {count}", names.len()));
    }
    Activation::Passed(names)
}

impl Activation {
    /// The descriptor `text` names: a number, or a name socket activation
    /// gave a socket.
    fn resolve(&self, text: &str) -> io::Result<RawFd> {
        if let Ok(fd) = text.parse::<RawFd>() {
            return Ok(fd);
        }
        let why = match self {
            Activation::Nothing => {
                format!("Unable to parse FD number {text} (nor does socket activation name it: LISTEN_FDS is not set)")
            }
            Activation::Broken(why) => format!("no socket named '{text}': {why}"),
            Activation::Passed(names) => {
                let mut found = (FIRST_FD..).zip(names).filter(|(_, name)| *name == text).map(|(fd, _)| fd);
                match (found.next(), found.next()) {
                    (Some(fd), None) => return Ok(fd),
                    (Some(_), Some(_)) => format!(
                        "several sockets passed are named '{text}' (LISTEN_FDNAMES): give each its own FileDescriptorName="
                    ),
                    (None, _) => format!("no socket named '{text}' was passed (LISTEN_FDNAMES: {})", names.join(", ")),
                }
            }
        };
        Err(io::Error::new(io::ErrorKind::NotFound, why))
    }
}

/// Checks that `fd` is a stream socket of one of `families` and makes it
/// listen if it does not yet; returns its family.
fn check_listener(fd: RawFd, text: &str, families: &[Family]) -> io::Result<Family> {
    let refuse = |what: String| io::Error::new(io::ErrorKind::InvalidInput, format!("File descriptor '{text}' {what}"));
    // A descriptor that is not open is not a socket either, as QEMU says.
    let kind = socket_option(fd, libc::SO_TYPE).map_err(|_| refuse("is not a socket".into()))?;
    if kind != libc::SOCK_STREAM {
        return Err(refuse("is not a stream socket".into()));
    }
    let family = match socket_option(fd, libc::SO_DOMAIN)? {
        libc::AF_UNIX => Some(Family::Unix),
        libc::AF_INET | libc::AF_INET6 => Some(Family::Inet),
        _ => None,
    };
    let Some(family) = family.filter(|f| families.contains(f)) else {
        let names: Vec<_> = families.iter().map(|f| f.name()).collect();
        return Err(refuse(format!("is not a {} socket", names.join(" or "))));
    };
    if socket_option(fd, libc::SO_ACCEPTCONN)? == 0 {
        // SAFETY: listen(2) touches no memory.
        check(unsafe { libc::listen(fd, libc::SOMAXCONN) }.into())
            .map_err(|e| io::Error::new(e.kind(), format!("Failed to listen on fd socket: {e}")))?;
    }
    set_cloexec(fd)?;
    Ok(family)
}

/// An integer `SOL_SOCKET` option of `fd`.
fn socket_option(fd: RawFd, name: libc::c_int) -> io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `value`, a live
    // local; a descriptor that is not an open socket is an error.
    check(unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, name, (&raw mut value).cast(), &mut len) }.into())?;
    Ok(value)
}

fn set_cloexec(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl(F_SETFD) takes and returns plain integers.
    check(unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) }.into()).map(drop)
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;
    use std::os::unix::net::{UnixDatagram, UnixListener};

    use super::*;

    fn passed(names: &[&str]) -> Activation {
        Activation::Passed(names.iter().map(|n| n.to_string()).collect())
    }

    #[test]
    fn variables_for_this_process_name_its_sockets() {
        assert_eq!(parse(7, Some("7"), Some("2"), Some("nbd:e0")), passed(&["nbd", "e0"]));
        assert_eq!(parse(7, Some("7"), Some("2"), None), passed(&["unknown", "unknown"]), "systemd's default");
        assert_eq!(parse(7, Some("7"), Some("0"), Some("")), passed(&[]));
        assert_eq!(parse(7, None, None, None), Activation::Nothing);
        assert_eq!(parse(7, Some("7"), None, Some("a")), Activation::Nothing, "no LISTEN_FDS, nothing passed");
    }

    #[test]
    fn variables_that_do_not_add_up_are_broken() {
        let why = |pid, fds, names| match parse(7, pid, fds, names) {
            Activation::Broken(why) => why,
            other => panic!("{pid:?} {fds:?} {names:?}: {other:?}"),
        };
        assert!(why(Some("8"), Some("1"), None).contains("LISTEN_PID is '8', not vsd's pid 7"));
        assert!(why(None, Some("1"), None).contains("LISTEN_PID is not"));
        assert!(why(Some("x"), Some("1"), None).contains("LISTEN_PID is 'x'"));
        assert!(why(Some("7"), Some("two"), None).contains("LISTEN_FDS is 'two'"));
        assert!(why(Some("7"), Some("3"), Some("a:b")).contains("names 2 sockets, LISTEN_FDS says 3"));
        assert!(why(Some("7"), Some("1"), Some("a:b")).contains("names 2 sockets, LISTEN_FDS says 1"));
    }

    #[test]
    fn names_resolve_to_their_descriptors_numbers_to_themselves() {
        let sockets = passed(&["nbd", "e0", "dup", "dup"]);
        assert_eq!(sockets.resolve("e0").unwrap(), 4);
        assert_eq!(sockets.resolve("9").unwrap(), 9);
        assert_eq!(Activation::Nothing.resolve("-1").unwrap(), -1, "QEMU's integer: refused as not a socket");
        let err = |a: &Activation, text| a.resolve(text).unwrap_err().to_string();
        assert!(err(&sockets, "dup").contains("several sockets passed are named 'dup'"));
        assert!(err(&sockets, "e1").contains("no socket named 'e1' was passed (LISTEN_FDNAMES: nbd, e0, dup, dup)"));
        assert!(err(&Activation::Nothing, "abc").starts_with("Unable to parse FD number abc"));
        let broken = Activation::Broken("socket activation: LISTEN_FDS is 'x'".into());
        assert_eq!(err(&broken, "nbd"), "no socket named 'nbd': socket activation: LISTEN_FDS is 'x'");
    }

    #[test]
    fn only_stream_sockets_of_the_families_asked_for_pass() {
        let dir = std::env::temp_dir().join(format!("vsd-sys-passed-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let unix = UnixListener::bind(dir.join("s")).unwrap();
        let fd = unix.as_raw_fd();
        assert_eq!(check_listener(fd, "n", &[Family::Unix, Family::Inet]).unwrap(), Family::Unix);
        let err = check_listener(fd, "n", &[Family::Inet]).unwrap_err().to_string();
        assert_eq!(err, "File descriptor 'n' is not a TCP socket");
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let err = check_listener(tcp.as_raw_fd(), "t", &[Family::Unix]).unwrap_err().to_string();
        assert_eq!(err, "File descriptor 't' is not a unix socket");
        let datagram = UnixDatagram::unbound().unwrap();
        let err = check_listener(datagram.as_raw_fd(), "d", &[Family::Unix]).unwrap_err().to_string();
        assert_eq!(err, "File descriptor 'd' is not a stream socket");
        let file = std::fs::File::open("/dev/null").unwrap();
        let err = check_listener(file.as_raw_fd(), "f", &[Family::Unix]).unwrap_err().to_string();
        assert_eq!(err, "File descriptor 'f' is not a socket");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_bound_socket_is_made_to_listen_an_unbound_one_is_refused() {
        // SAFETY: socket(2) touches no memory; the descriptor is owned here.
        let unbound = unsafe { OwnedFd::from_raw_fd(libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0)) };
        let err = check_listener(unbound.as_raw_fd(), "u", &[Family::Unix]).unwrap_err().to_string();
        assert!(err.starts_with("Failed to listen on fd socket: Invalid argument"), "{err}");
        // A bound TCP socket that does not listen yet (std's listeners
        // bind and listen at once).
        // SAFETY: as above.
        let bound = unsafe { OwnedFd::from_raw_fd(libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0)) };
        let addr = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes([127, 0, 0, 1]) },
            sin_zero: [0; 8],
        };
        // SAFETY: bind reads `addr`, a live local of the length given.
        let ret = unsafe {
            libc::bind(bound.as_raw_fd(), (&raw const addr).cast(), size_of::<libc::sockaddr_in>() as libc::socklen_t)
        };
        assert_eq!(ret, 0);
        assert_eq!(socket_option(bound.as_raw_fd(), libc::SO_ACCEPTCONN).unwrap(), 0);
        assert_eq!(check_listener(bound.as_raw_fd(), "b", &[Family::Inet]).unwrap(), Family::Inet);
        assert_eq!(socket_option(bound.as_raw_fd(), libc::SO_ACCEPTCONN).unwrap(), 1);
    }
}
