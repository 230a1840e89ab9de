//! `--chardev` and `--monitor`, as qemu-storage-daemon takes them: QMP on
//! the daemon's standard input and output (`--chardev stdio,id=ID`), or on
//! a listening socket (`--chardev socket,id=ID,server=on,...` with `path=`,
//! `host=` and `port=`, or an inherited `fd=`), each used by one
//! `--monitor [chardev=]ID[,pretty=on]`.

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use vsd_block::options::OptionMap;
use vsd_control::qmp::{Dispatch, Events, Monitor, QmpListener, QmpServer, Stdio};

/// A `--chardev` a monitor can use.
#[derive(Debug, PartialEq)]
struct Chardev {
    id: String,
    /// The option string, as messages about it quote it.
    text: String,
    backend: Backend,
}

#[derive(Debug, PartialEq)]
enum Backend {
    /// Standard input and output.
    Stdio,
    /// A listening socket; with `wait`, the daemon goes on once a first
    /// client has connected (QEMU's default).
    Server { address: Address, wait: bool },
}

#[derive(Debug, PartialEq)]
enum Address {
    Unix(PathBuf),
    Inet {
        host: String,
        port: u16,
        ipv4: bool,
        ipv6: bool,
    },
    /// A listening socket the daemon inherited.
    Fd(RawFd),
}

/// A `--monitor` resolved to its `--chardev`.
#[derive(Debug, PartialEq)]
pub struct Planned {
    chardev: Chardev,
    pretty: bool,
}

/// Reads every `--chardev` and `--monitor`; nothing is opened yet. A
/// daemon (`--daemonize`) has no standard input and output to serve.
pub fn plan(chardevs: &[String], monitors: &[String], daemon: bool) -> Result<Vec<Planned>> {
    let mut defined: Vec<Chardev> = Vec::new();
    for text in chardevs {
        let chardev = chardev(text)?;
        if chardev.backend == Backend::Stdio && daemon {
            bail!("--chardev {text}: cannot use stdio with --daemonize");
        }
        if defined.iter().any(|c| c.id == chardev.id) {
            bail!("--chardev {text}: Duplicate ID '{}' for chardev", chardev.id);
        }
        if chardev.backend == Backend::Stdio && defined.iter().any(|c| c.backend == Backend::Stdio) {
            bail!("--chardev {text}: cannot use stdio by multiple character devices");
        }
        defined.push(chardev);
    }
    // Each chardev serves one monitor: taken out once used.
    let mut unused: Vec<Option<Chardev>> = defined.into_iter().map(Some).collect();
    let mut planned = Vec::new();
    for text in monitors {
        let (id, pretty) = monitor(text)?;
        let Some(slot) = unused.iter_mut().find(|c| c.as_ref().is_some_and(|c| c.id == id)) else {
            match planned.iter().any(|p: &Planned| p.chardev.id == id) {
                true => bail!("--monitor {text}: chardev '{id}' is already in use"),
                false => bail!("--monitor {text}: chardev \"{id}\" not found"),
            }
        };
        planned.push(Planned { chardev: slot.take().expect("found"), pretty });
    }
    Ok(planned)
}

/// A `--monitor`: its chardev's id and whether it pretty-prints.
fn monitor(text: &str) -> Result<(String, bool)> {
    let mut opts = OptionMap::parse_implied("--monitor", text, "chardev")?;
    let id = opts.require("chardev")?;
    if opts.take_choice("mode", &["control", "readline"])? == Some("readline") {
        return Err(opts.rejected("Only QMP is supported").into());
    }
    let pretty = opts.take_bool("pretty")?.unwrap_or(false);
    // A monitor's own name, which nothing refers to.
    opts.take("id");
    opts.finish()?;
    Ok((id, pretty))
}

fn chardev(text: &str) -> Result<Chardev> {
    let mut opts = OptionMap::parse_implied("--chardev", text, "backend")?;
    let Some(id) = opts.take("id") else {
        return Err(opts.rejected("chardev: no id specified").into());
    };
    let Some(backend) = opts.take("backend") else {
        return Err(opts.rejected(format!("chardev: \"{id}\" missing backend")).into());
    };
    let backend = match backend.as_str() {
        "stdio" => stdio(&mut opts)?,
        "socket" => socket(&mut opts)?,
        _ => return Err(opts.invalid("backend", backend, "stdio or socket").into()),
    };
    opts.finish()?;
    Ok(Chardev { id, text: text.to_owned(), backend })
}

fn stdio(opts: &mut OptionMap) -> Result<Backend> {
    // vsd never puts the terminal into raw mode: Ctrl-C always stops it.
    if opts.take_bool("signal")? == Some(false) {
        return Err(opts.rejected("signal=off is not supported: vsd leaves the terminal as it is").into());
    }
    Ok(Backend::Stdio)
}

fn socket(opts: &mut OptionMap) -> Result<Backend> {
    let server = opts.take_bool("server")?.unwrap_or(false);
    let wait = opts.take_bool("wait")?;
    if !server && wait.is_some() {
        return Err(opts.rejected("'wait' option is incompatible with socket in client connect mode").into());
    }
    if !server {
        return Err(opts.rejected("vsd's monitor listens for clients: give server=on").into());
    }
    let address = address(opts)?;
    Ok(Backend::Server { address, wait: wait.unwrap_or(true) })
}

fn address(opts: &mut OptionMap) -> Result<Address> {
    let (path, host, fd) = (opts.take("path"), opts.take("host"), opts.take("fd"));
    let (ipv4, ipv6) = (opts.take_bool("ipv4")?, opts.take_bool("ipv6")?);
    let port = opts.take("port");
    match (path, host, fd) {
        (Some(path), None, None) => Ok(Address::Unix(PathBuf::from(path))),
        (None, Some(host), None) => {
            let Some(port) = port else {
                return Err(opts.rejected("chardev: socket: no port given").into());
            };
            let port = port.parse().map_err(|_| opts.invalid("port", port, "a port number"))?;
            // One family given on alone, or off, means only the other.
            let ipv4_only = ipv4 == Some(true) && ipv6 != Some(true) || ipv6 == Some(false);
            let ipv6_only = ipv6 == Some(true) && ipv4 != Some(true) || ipv4 == Some(false);
            Ok(Address::Inet { host, port, ipv4: !ipv6_only, ipv6: !ipv4_only })
        }
        (None, None, Some(fd)) => match fd.parse() {
            Ok(fd) => Ok(Address::Fd(fd)),
            Err(_) => Err(opts.rejected(format!("Unable to parse FD number {fd}")).into()),
        },
        (None, None, None) => Err(opts.rejected("vsd's monitor needs one of 'path', 'fd' or 'host'").into()),
        _ => Err(opts.rejected("None or one of 'path', 'fd' or 'host' option required.").into()),
    }
}

/// Starts every planned monitor. A socket whose chardev waits (QEMU's
/// default `wait=on`) has its first client connected on return.
pub fn start(planned: Vec<Planned>, dispatch: Arc<dyn Dispatch>, events: &Events) -> Result<Vec<QmpServer>> {
    let mut servers = Vec::new();
    for Planned { chardev, pretty } in planned {
        let monitor = Monitor::new(dispatch.clone(), events.clone()).pretty(pretty);
        let context = || format!("--chardev {}", chardev.text);
        match chardev.backend {
            Backend::Stdio => monitor.serve(Stdio, "vsd-qmp-stdio".to_owned()).with_context(context)?,
            Backend::Server { address, wait } => {
                let (listener, shown) = listen(&address).with_context(context)?;
                if wait {
                    eprintln!("vsd: {}: info: waiting for connection on: disconnected:{shown},server=on", context());
                }
                servers.push(QmpServer::start(listener, monitor, wait).with_context(context)?);
            }
        }
    }
    Ok(servers)
}

/// The listening socket for `address`, and how to show it.
fn listen(address: &Address) -> Result<(QmpListener, String)> {
    match address {
        Address::Unix(path) => Ok((QmpListener::bind_unix(path)?, format!("unix:{}", path.display()))),
        Address::Inet { host, port, ipv4, ipv6 } => {
            let listener = listen_inet(host, *port, *ipv4, *ipv6)?;
            let shown = format!("tcp:{}", listener.local_addr()?);
            Ok((listener.into(), shown))
        }
        Address::Fd(fd) => inherited(*fd),
    }
}

fn listen_inet(host: &str, port: u16, ipv4: bool, ipv6: bool) -> Result<TcpListener> {
    let resolution = |reason: &dyn std::fmt::Display| format!("address resolution failed for {host}:{port}: {reason}");
    let resolved = (host, port).to_socket_addrs().map_err(|e| anyhow::anyhow!(resolution(&e)))?;
    let wanted: Vec<SocketAddr> = resolved.filter(|a| if a.is_ipv4() { ipv4 } else { ipv6 }).collect();
    if wanted.is_empty() {
        bail!(resolution(&"Address family for hostname not supported"));
    }
    TcpListener::bind(&wanted[..]).context("Failed to find an available port")
}

/// Takes over descriptor `fd`, which must be a listening unix or TCP socket.
fn inherited(fd: RawFd) -> Result<(QmpListener, String)> {
    let option = |name| {
        let mut value: libc::c_int = 0;
        let mut len = size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt(2) writes at most `len` bytes into `value`;
        // on a descriptor that is not an open socket it only fails.
        let ret = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, name, (&raw mut value).cast(), &mut len) };
        (ret == 0).then_some(value)
    };
    let (Some(domain), Some(kind), Some(listening)) =
        (option(libc::SO_DOMAIN), option(libc::SO_TYPE), option(libc::SO_ACCEPTCONN))
    else {
        bail!("File descriptor '{fd}' is not a socket");
    };
    if kind != libc::SOCK_STREAM || listening == 0 {
        bail!("File descriptor '{fd}' is not a listening stream socket");
    }
    if domain != libc::AF_UNIX && domain != libc::AF_INET && domain != libc::AF_INET6 {
        bail!("File descriptor '{fd}' is neither a unix nor a TCP socket");
    }
    // SAFETY: `fd` is an open socket, checked above, that nothing else in
    // the daemon owns: the command line hands it to this chardev.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    if domain == libc::AF_UNIX {
        let listener = UnixListener::from(fd);
        let path = listener.local_addr()?.as_pathname().map(|p| p.display().to_string()).unwrap_or_default();
        return Ok((listener.into(), format!("unix:{path}")));
    }
    let listener = TcpListener::from(fd);
    let shown = format!("tcp:{}", listener.local_addr()?);
    Ok((listener.into(), shown))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    fn planned(chardevs: &[&str], monitors: &[&str]) -> Vec<Planned> {
        plan(&strings(chardevs), &strings(monitors), false).unwrap()
    }

    fn error(chardevs: &[&str], monitors: &[&str]) -> String {
        plan(&strings(chardevs), &strings(monitors), false).unwrap_err().to_string()
    }

    fn backend(chardev: &str) -> Backend {
        planned(&[chardev], &["m"]).remove(0).chardev.backend
    }

    #[test]
    fn qsd_style_monitor_resolves_to_its_socket() {
        let monitors = planned(&["socket,id=qmp0,path=/tmp/q.sock,server=on,wait=off"], &["chardev=qmp0"]);
        let address = Address::Unix(PathBuf::from("/tmp/q.sock"));
        assert_eq!(monitors[0].chardev.backend, Backend::Server { address, wait: false });
        assert!(!monitors[0].pretty);
    }

    #[test]
    fn stdio_with_the_implied_chardev_key_and_pretty() {
        let monitors = planned(&["stdio,id=m"], &["m,pretty=on,mode=control,id=mon0"]);
        assert_eq!(monitors, [Planned { chardev: chardev("stdio,id=m").unwrap(), pretty: true }]);
    }

    #[test]
    fn sockets_wait_unless_told_not_to() {
        let unix = Address::Unix(PathBuf::from("/p"));
        assert_eq!(backend("socket,id=m,path=/p,server=on"), Backend::Server { address: unix, wait: true });
        let Backend::Server { address: Address::Fd(5), wait: false } = backend("socket,id=m,fd=5,server=on,wait=off")
        else {
            panic!("fd=5 expected");
        };
    }

    #[test]
    fn inet_families() {
        let inet = |extra: &str| match backend(&format!("socket,id=m,host=::1,port=4444,server=on{extra}")) {
            Backend::Server { address: Address::Inet { host, port: 4444, ipv4, ipv6 }, .. } if host == "::1" => {
                (ipv4, ipv6)
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(inet(""), (true, true));
        assert_eq!(inet(",ipv4=on"), (true, false));
        assert_eq!(inet(",ipv6=on"), (false, true));
        assert_eq!(inet(",ipv4=on,ipv6=on"), (true, true));
        assert_eq!(inet(",ipv4=off"), (false, true));
        assert_eq!(inet(",ipv6=off"), (true, false));
    }

    #[test]
    fn mistakes_are_named_in_qemu_words() {
        let open = "socket,id=a,path=/p,server=on,wait=off";
        assert!(error(&[open], &["chardev=b"]).contains("chardev \"b\" not found"));
        assert!(error(&[open], &["a", "a"]).contains("chardev 'a' is already in use"));
        assert!(error(&[open, open], &[]).contains("Duplicate ID 'a' for chardev"));
        assert!(error(&["stdio,id=a", "stdio,id=b"], &[]).contains("cannot use stdio by multiple character devices"));
        let daemon = plan(&strings(&["stdio,id=m"]), &strings(&["m"]), true).unwrap_err().to_string();
        assert_eq!(daemon, "--chardev stdio,id=m: cannot use stdio with --daemonize");
        assert!(error(&["socket,id=a,path=/p,wait=off"], &[]).contains("incompatible with socket in client connect"));
        assert!(error(&["socket,id=a,path=/p"], &[]).contains("server=on"));
        assert!(
            error(&["socket,id=a,path=/p,host=h,server=on"], &[]).contains("None or one of 'path', 'fd' or 'host'")
        );
        assert!(error(&["socket,id=a,server=on"], &[]).contains("one of 'path', 'fd' or 'host'"));
        assert!(error(&["socket,id=a,host=h,server=on"], &[]).contains("no port given"));
        assert!(error(&["socket,id=a,host=h,port=x,server=on"], &[]).contains("'port'"));
        assert!(error(&["socket,id=a,fd=x,server=on"], &[]).contains("Unable to parse FD number x"));
        assert!(error(&["socket,id=a,path=/p,server=on,telnet=on"], &[]).contains("telnet"));
        assert!(error(&["stdio"], &[]).contains("no id specified"));
        assert!(error(&["id=a"], &[]).contains("\"a\" missing backend"));
        assert!(error(&["file,id=a,path=/p"], &[]).contains("backend"));
        assert!(error(&["stdio,id=a,signal=off"], &[]).contains("signal=off"));
        assert!(error(&[open], &["chardev=a,mode=readline"]).contains("Only QMP is supported"));
        assert!(error(&[open], &["chardev=a,pretty=maybe"]).contains("pretty"));
        assert!(error(&[open], &["pretty=on"]).contains("chardev"));
    }

    #[test]
    fn an_inherited_descriptor_must_be_a_listening_socket() {
        let message = |fd| inherited(fd).err().unwrap().to_string();
        assert_eq!(message(-1), "File descriptor '-1' is not a socket");
        let file = std::fs::File::open("/dev/null").unwrap();
        assert!(message(std::os::fd::AsRawFd::as_raw_fd(&file)).contains("is not a socket"));
        let (stream, _) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(message(std::os::fd::AsRawFd::as_raw_fd(&stream)).contains("not a listening stream socket"));
    }
}
