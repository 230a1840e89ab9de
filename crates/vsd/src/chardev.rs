//! Character devices, as QEMU's `/chardevs` holds them: those of the
//! command line (`--chardev`, the monitors' among them) and those QMP adds
//! (`chardev-add`, `chardev-change`, `chardev-remove`), with the backends
//! that make sense in a storage daemon: `ringbuf` (and its old name
//! `memory`), `null`, `file`, `socket` (listening) and `stdio`.
//!
//! Nothing but a monitor is ever a chardev's front-end here: a chardev QMP
//! adds has none, as in QEMU (no command attaches a monitor). A ring
//! buffer is written and read with `ringbuf-write` and `ringbuf-read`; a
//! socket nobody serves listens, its clients waiting in the backlog.

use std::collections::{BTreeMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use anyhow::{Context, Result, bail};
use base64::Engine;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use vsd_control::qmp::{QmpError, QmpListener};

use crate::qapi;

/// The backends vsd has, as `query-chardev-backends` lists them.
pub const BACKENDS: &[&str] = &["file", "memory", "null", "ringbuf", "socket", "stdio"];

/// A ring buffer's size unless told (QEMU's).
pub const DEFAULT_RING_SIZE: u64 = 65536;

/// Where a socket chardev listens.
#[derive(Debug, PartialEq)]
pub enum Address {
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

/// What a chardev is made of, from the command line or QMP.
#[derive(Debug, PartialEq)]
pub enum Spec {
    Null,
    /// `memory` is QEMU's old name of the same backend.
    Ringbuf {
        size: u64,
        memory: bool,
    },
    File {
        out: String,
        input: Option<String>,
        append: bool,
    },
    Stdio,
    /// A listening socket; with `wait`, the daemon goes on once a first
    /// client has connected (QEMU's default on the command line).
    Listen {
        address: Address,
        wait: bool,
    },
}

/// A chardev's definition: its backend and the log of what a front-end
/// writes to it (QEMU's `logfile`, `logappend`; `ringbuf-write` is not
/// logged, as in QEMU).
#[derive(Debug, PartialEq)]
pub struct Definition {
    pub spec: Spec,
    pub log: Option<(String, bool)>,
}

/// An open chardev.
struct Chardev {
    backend: Backend,
    /// Created or truncated when it opens, as QEMU does; only a front-end
    /// would write it, and none of vsd's chardevs has one but a monitor's.
    _log: Option<File>,
    /// Whether a monitor is its front-end: then it is busy and open.
    monitor: bool,
}

enum Backend {
    Null,
    Ring {
        ring: Ring,
        memory: bool,
    },
    File {
        _out: File,
        _input: Option<File>,
    },
    Stdio,
    /// `shown` is the address as QEMU prints it (`unix:PATH`); the
    /// listener is held here unless a monitor serves it.
    Socket {
        shown: String,
        _listener: Option<QmpListener>,
    },
}

impl Backend {
    /// QEMU's name for it (its QOM type without `chardev-`).
    fn kind(&self) -> &'static str {
        match self {
            Backend::Null => "null",
            Backend::Ring { memory: false, .. } => "ringbuf",
            Backend::Ring { memory: true, .. } => "memory",
            Backend::File { .. } => "file",
            Backend::Stdio => "stdio",
            Backend::Socket { .. } => "socket",
        }
    }
}

impl Chardev {
    /// `query-chardev`'s filename, as QEMU writes it. A monitor's socket
    /// reads as QEMU's does with its client connected; one nobody serves
    /// as QEMU's without a client.
    fn filename(&self) -> String {
        match &self.backend {
            Backend::Socket { shown, .. } if self.monitor => format!("{shown},server=on"),
            Backend::Socket { shown, .. } => format!("disconnected:{shown},server=on"),
            backend => backend.kind().to_string(),
        }
    }
}

/// A ring buffer: the last `capacity` bytes written and not read yet.
/// Memory grows with what is written, never to a size asked for.
struct Ring {
    capacity: u64,
    bytes: VecDeque<u8>,
}

impl Ring {
    /// Overwrites the oldest bytes once full.
    fn write(&mut self, data: &[u8]) {
        let keep = usize::try_from(self.capacity).unwrap_or(usize::MAX);
        let data = &data[data.len().saturating_sub(keep)..];
        self.bytes.extend(data);
        let excess = self.bytes.len().saturating_sub(keep);
        self.bytes.drain(..excess);
    }

    /// Takes up to `max` of the oldest bytes.
    fn read(&mut self, max: usize) -> Vec<u8> {
        let count = max.min(self.bytes.len());
        self.bytes.drain(..count).collect()
    }
}

/// Every chardev, by id.
#[derive(Default)]
pub struct Chardevs {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    by_id: BTreeMap<String, Chardev>,
    /// `--daemonize`: there is no standard input and output.
    daemonized: bool,
}

impl Chardevs {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Chardevs are inserted and removed whole.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Says the daemon has no standard input and output to give.
    pub fn set_daemonized(&self) {
        self.lock().daemonized = true;
    }

    /// Opens chardev `id` of the command line (or of QMP); QEMU's words for
    /// why not.
    pub fn open(&self, id: &str, definition: Definition) -> Result<(), String> {
        let mut inner = self.lock();
        if inner.by_id.contains_key(id) {
            return Err(format!("Chardev with id '{id}' already exists"));
        }
        let chardev = open(definition, &inner, None)?;
        inner.by_id.insert(id.to_string(), chardev);
        Ok(())
    }

    /// Records chardev `id` that a monitor serves: its standard streams,
    /// or its socket (`shown` as QEMU prints its address).
    pub fn add_monitor(&self, id: &str, socket: Option<String>) {
        let backend = match socket {
            Some(shown) => Backend::Socket { shown, _listener: None },
            None => Backend::Stdio,
        };
        self.lock().by_id.insert(id.to_string(), Chardev { backend, _log: None, monitor: true });
    }

    /// Each chardev's id and QOM type, for `qom-list`.
    pub fn qom_children(&self) -> Vec<(String, String)> {
        let inner = self.lock();
        inner.by_id.iter().map(|(id, c)| (id.clone(), format!("chardev-{}", c.backend.kind()))).collect()
    }
}

/// Opens `definition`; `replacing` names a chardev it takes the place of
/// (`chardev-change`), whose standard streams it may take.
fn open(definition: Definition, inner: &Inner, replacing: Option<&str>) -> Result<Chardev, String> {
    let log = definition.log.map(|(path, append)| open_log(&path, append)).transpose()?;
    let backend = match definition.spec {
        Spec::Null => Backend::Null,
        Spec::Ringbuf { size, memory } => Backend::Ring { ring: ring(size)?, memory },
        Spec::File { out, input, append } => open_file(&out, input.as_deref(), append)?,
        Spec::Stdio => {
            stdio_free(inner, replacing)?;
            Backend::Stdio
        }
        Spec::Listen { wait: true, .. } => {
            return Err("wait=on is not supported by vsd on a socket no monitor serves".into());
        }
        Spec::Listen { address, wait: false } => {
            let (listener, shown) = listen(&address).map_err(|e| format!("{e:#}"))?;
            Backend::Socket { shown, _listener: Some(listener) }
        }
    };
    Ok(Chardev { backend, _log: log, monitor: false })
}

/// A ring of `size` bytes, a power of two (QEMU counts 0 as one).
fn ring(size: u64) -> Result<Ring, String> {
    if size & size.wrapping_sub(1) != 0 {
        return Err("size of ringbuf chardev must be power of two".into());
    }
    Ok(Ring { capacity: size, bytes: VecDeque::new() })
}

/// Standard input and output serve one chardev, and none in a daemon.
fn stdio_free(inner: &Inner, replacing: Option<&str>) -> Result<(), String> {
    if inner.daemonized {
        return Err("cannot use stdio with --daemonize".into());
    }
    let taken = inner.by_id.iter().any(|(id, c)| matches!(c.backend, Backend::Stdio) && Some(id.as_str()) != replacing);
    match taken {
        true => Err("cannot use stdio by multiple character devices".into()),
        false => Ok(()),
    }
}

/// A file written from its start, or at its end with `append`.
fn created(path: &str, append: bool) -> std::io::Result<File> {
    OpenOptions::new().write(true).create(true).append(append).truncate(!append).mode(0o666).open(path)
}

fn open_log(path: &str, append: bool) -> Result<File, String> {
    created(path, append).map_err(|e| format!("Could not create '{path}': {}", os_error(&e)))
}

/// `out` first, then `input`, as QEMU opens them.
fn open_file(out: &str, input: Option<&str>, append: bool) -> Result<Backend, String> {
    let could_not = |path: &str, e: std::io::Error| format!("Could not open '{path}': {}", os_error(&e));
    let out_file = created(out, append).map_err(|e| could_not(out, e))?;
    let input = input.map(|path| File::open(path).map_err(|e| could_not(path, e))).transpose()?;
    Ok(Backend::File { _out: out_file, _input: input })
}

fn os_error(e: &std::io::Error) -> String {
    vsd_job::strerror(e.raw_os_error().unwrap_or(libc::EIO))
}

/// The listening socket for `address`, and how QEMU shows it.
pub fn listen(address: &Address) -> Result<(QmpListener, String)> {
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
pub(crate) fn inherited(fd: RawFd) -> Result<(QmpListener, String)> {
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

// QMP's arguments, with QEMU's names, types and optionality.

/// `chardev-add` and `chardev-change`.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ChardevArgs {
    id: String,
    /// QEMU's ChardevBackend: see [`ChardevBackend::parse`].
    backend: Union,
}

/// A QAPI union in QMP's older shape: its kind in `type`, its members in
/// `data`, which are read once the kind is known (as `transaction`'s
/// actions), so that errors name them by their path.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct Union {
    r#type: String,
    data: Value,
}

impl Union {
    /// QEMU's refusal of a kind it lacks (it names the bare member).
    fn unknown(&self) -> QmpError {
        QmpError::generic(format!("Parameter 'type' does not accept value '{}'", self.r#type))
    }
}

/// QEMU's ChardevBackend, of the kinds vsd has.
enum ChardevBackend {
    File(ChardevFile),
    Socket(ChardevSocket, SocketAddressLegacy),
    Null(ChardevCommon),
    Stdio(ChardevStdio),
    Ringbuf(ChardevRingbuf),
    Memory(ChardevRingbuf),
}

impl ChardevBackend {
    /// The backend `union` at `path` describes.
    fn parse(union: Union, path: &str) -> Result<Self, QmpError> {
        let data = format!("{path}.data");
        Ok(match union.r#type.as_str() {
            "file" => ChardevBackend::File(qapi::parse_member(&data, union.data)?),
            "socket" => {
                let (socket, address) = socket_members(&data, union.data)?;
                ChardevBackend::Socket(socket, address)
            }
            "null" => ChardevBackend::Null(qapi::parse_member(&data, union.data)?),
            "stdio" => ChardevBackend::Stdio(qapi::parse_member(&data, union.data)?),
            "ringbuf" => ChardevBackend::Ringbuf(qapi::parse_member(&data, union.data)?),
            "memory" => ChardevBackend::Memory(qapi::parse_member(&data, union.data)?),
            _ => return Err(union.unknown()),
        })
    }
}

/// A socket's members at `path`, and its address (a union among them).
fn socket_members(path: &str, data: Value) -> Result<(ChardevSocket, SocketAddressLegacy), QmpError> {
    let mut socket: ChardevSocket = qapi::parse_member(path, data)?;
    let (at, data) = (format!("{path}.addr.data"), std::mem::take(&mut socket.addr.data));
    let address = match socket.addr.r#type.as_str() {
        "inet" => SocketAddressLegacy::Inet(qapi::parse_member(&at, data)?),
        "unix" => SocketAddressLegacy::Unix(qapi::parse_member(&at, data)?),
        "vsock" => SocketAddressLegacy::Vsock(qapi::parse_member(&at, data)?),
        "fd" => SocketAddressLegacy::Fd(qapi::parse_member(&at, data)?),
        _ => return Err(socket.addr.unknown()),
    };
    Ok((socket, address))
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ChardevCommon {
    logfile: Option<String>,
    logappend: Option<bool>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ChardevFile {
    logfile: Option<String>,
    logappend: Option<bool>,
    #[serde(rename = "in")]
    input: Option<String>,
    out: String,
    append: Option<bool>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ChardevStdio {
    logfile: Option<String>,
    logappend: Option<bool>,
    signal: Option<bool>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ChardevRingbuf {
    logfile: Option<String>,
    logappend: Option<bool>,
    size: Option<i64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct ChardevSocket {
    logfile: Option<String>,
    logappend: Option<bool>,
    /// QEMU's SocketAddressLegacy: see [`socket_members`].
    addr: Union,
    tls_creds: Option<String>,
    tls_authz: Option<String>,
    server: Option<bool>,
    wait: Option<bool>,
    /// Taken: no data goes through a socket that nobody serves.
    #[serde(rename = "nodelay")]
    _nodelay: Option<bool>,
    telnet: Option<bool>,
    tn3270: Option<bool>,
    websocket: Option<bool>,
    reconnect: Option<i64>,
    reconnect_ms: Option<i64>,
}

/// QEMU's SocketAddressLegacy.
enum SocketAddressLegacy {
    Inet(InetSocketAddress),
    Unix(UnixSocketAddress),
    Vsock(VsockSocketAddress),
    Fd(FdSocketAddress),
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct InetSocketAddress {
    host: String,
    port: String,
    /// Taken: a numeric host resolves to itself.
    #[serde(rename = "numeric")]
    _numeric: Option<bool>,
    to: Option<u16>,
    ipv4: Option<bool>,
    ipv6: Option<bool>,
    /// Taken: it would apply to connections, which nobody serves.
    #[serde(rename = "keep-alive")]
    _keep_alive: Option<bool>,
    mptcp: Option<bool>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct UnixSocketAddress {
    path: String,
    #[serde(rename = "abstract")]
    is_abstract: Option<bool>,
    /// Only abstract sockets use it.
    #[serde(rename = "tight")]
    _tight: Option<bool>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct VsockSocketAddress {
    cid: String,
    port: String,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct FdSocketAddress {
    str: String,
}

/// `chardev-remove` and `chardev-send-break`.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ChardevId {
    id: String,
}

/// `ringbuf-write`.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RingbufWrite {
    device: String,
    data: String,
    format: Option<DataFormat>,
}

/// `ringbuf-read`.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RingbufRead {
    device: String,
    size: i64,
    format: Option<DataFormat>,
}

#[derive(Deserialize, JsonSchema, Clone, Copy, PartialEq, Default)]
#[serde(rename_all = "lowercase")]
enum DataFormat {
    #[default]
    Utf8,
    Base64,
}

/// The log of a QMP backend's common members.
fn log(logfile: Option<String>, logappend: Option<bool>) -> Option<(String, bool)> {
    logfile.map(|path| (path, logappend.unwrap_or(false)))
}

/// The refusal of a QEMU option vsd does not have.
fn unsupported(what: &str) -> String {
    format!("'{what}' is not supported by vsd")
}

impl ChardevBackend {
    fn definition(self) -> Result<Definition, String> {
        Ok(match self {
            ChardevBackend::Null(c) => Definition { spec: Spec::Null, log: log(c.logfile, c.logappend) },
            ChardevBackend::Ringbuf(c) => ring_definition(c, false),
            ChardevBackend::Memory(c) => ring_definition(c, true),
            ChardevBackend::File(c) => Definition {
                spec: Spec::File { out: c.out, input: c.input, append: c.append.unwrap_or(false) },
                log: log(c.logfile, c.logappend),
            },
            ChardevBackend::Stdio(c) => {
                if c.signal == Some(false) {
                    return Err("signal=off is not supported: vsd leaves the terminal as it is".into());
                }
                Definition { spec: Spec::Stdio, log: log(c.logfile, c.logappend) }
            }
            ChardevBackend::Socket(c, address) => socket_definition(c, address)?,
        })
    }
}

fn ring_definition(c: ChardevRingbuf, memory: bool) -> Definition {
    // QEMU reads the size as unsigned: -1 is not a power of two.
    let size = c.size.map_or(DEFAULT_RING_SIZE, |size| size as u64);
    Definition { spec: Spec::Ringbuf { size, memory }, log: log(c.logfile, c.logappend) }
}

/// A QMP socket: a listening one (QMP's default), without the protocols
/// and options vsd lacks.
fn socket_definition(c: ChardevSocket, address: SocketAddressLegacy) -> Result<Definition, String> {
    let refused = [
        ("tls-creds", c.tls_creds.is_some()),
        ("tls-authz", c.tls_authz.is_some()),
        ("telnet", c.telnet == Some(true)),
        ("tn3270", c.tn3270 == Some(true)),
        ("websocket", c.websocket == Some(true)),
        ("reconnect", c.reconnect.is_some()),
        ("reconnect-ms", c.reconnect_ms.is_some()),
    ];
    if let Some((name, _)) = refused.iter().find(|(_, given)| *given) {
        return Err(unsupported(name));
    }
    if c.server == Some(false) {
        return Err("vsd's chardev sockets listen for clients: give server=true".into());
    }
    let address = match address {
        SocketAddressLegacy::Unix(unix) if unix.is_abstract == Some(true) => return Err(unsupported("abstract")),
        SocketAddressLegacy::Unix(unix) => Address::Unix(PathBuf::from(unix.path)),
        SocketAddressLegacy::Inet(inet) => inet_address(inet)?,
        SocketAddressLegacy::Vsock(v) => {
            return Err(format!("vsock sockets ({}:{}) are not supported by vsd", v.cid, v.port));
        }
        // A number could name a descriptor the daemon owns already (vsd
        // has no `getfd` to pass one in).
        SocketAddressLegacy::Fd(fd) => return Err(unsupported(&format!("fd {}", fd.str))),
    };
    Ok(Definition { spec: Spec::Listen { address, wait: c.wait.unwrap_or(false) }, log: log(c.logfile, c.logappend) })
}

fn inet_address(inet: InetSocketAddress) -> Result<Address, String> {
    if inet.to.is_some() {
        return Err(unsupported("to"));
    }
    if inet.mptcp == Some(true) {
        return Err(unsupported("mptcp"));
    }
    let port = inet.port.parse().map_err(|_| format!("Parameter 'port' expects a port number, not '{}'", inet.port))?;
    let (ipv4, ipv6) = families(inet.ipv4, inet.ipv6);
    Ok(Address::Inet { host: inet.host, port, ipv4, ipv6 })
}

/// Which families an inet address listens on: one given on alone, or
/// off, means only the other.
pub fn families(ipv4: Option<bool>, ipv6: Option<bool>) -> (bool, bool) {
    let ipv4_only = ipv4 == Some(true) && ipv6 != Some(true) || ipv6 == Some(false);
    let ipv6_only = ipv6 == Some(true) && ipv4 != Some(true) || ipv4 == Some(false);
    (!ipv6_only, !ipv4_only)
}

// The commands.

/// `query-chardev-backends`.
pub fn backends() -> Value {
    BACKENDS.iter().map(|name| json!({ "name": name })).collect()
}

fn not_found(id: &str) -> QmpError {
    QmpError::generic(format!("Chardev '{id}' not found"))
}

impl Chardevs {
    /// `chardev-add`: returns QEMU's ChardevReturn (no `pty` here).
    pub fn add(&self, args: ChardevArgs) -> Result<Value, QmpError> {
        let backend = ChardevBackend::parse(args.backend, "backend")?;
        let failed = |why: String| QmpError::generic(format!("Failed to add chardev '{}': {why}", args.id));
        if self.lock().by_id.contains_key(&args.id) {
            return Err(QmpError::generic(format!("Chardev with id '{}' already exists", args.id)));
        }
        let definition = backend.definition().map_err(failed)?;
        self.open(&args.id, definition).map_err(|why| match why.starts_with("Chardev with id") {
            true => QmpError::generic(why),
            false => failed(why),
        })?;
        Ok(json!({}))
    }

    /// `chardev-change`: a chardev without a front-end is replaced by the
    /// new one; one a monitor uses is refused, as QEMU's monitors refuse.
    /// Unlike QEMU, a new backend that fails to open leaves the old one.
    pub fn change(&self, args: ChardevArgs) -> Result<Value, QmpError> {
        let backend = ChardevBackend::parse(args.backend, "backend")?;
        let mut inner = self.lock();
        match inner.by_id.get(&args.id) {
            None => return Err(QmpError::generic(format!("Chardev '{}' does not exist", args.id))),
            Some(c) if c.monitor => return Err(QmpError::generic("Chardev user does not support chardev hotswap")),
            Some(_) => {}
        }
        let failed = |why: String| QmpError::generic(format!("Failed to add chardev '{}': {why}", args.id));
        let definition = backend.definition().map_err(failed)?;
        let chardev = open(definition, &inner, Some(&args.id)).map_err(failed)?;
        inner.by_id.insert(args.id, chardev);
        Ok(json!({}))
    }

    /// `chardev-remove`: not while a monitor uses it.
    pub fn remove(&self, args: ChardevId) -> Result<Value, QmpError> {
        let id = &args.id;
        let mut inner = self.lock();
        match inner.by_id.get(id) {
            None => Err(not_found(id)),
            Some(c) if c.monitor => Err(QmpError::generic(format!("Chardev '{id}' is busy"))),
            Some(_) => {
                inner.by_id.remove(id);
                Ok(json!({}))
            }
        }
    }

    /// `chardev-send-break`: a break goes to the front-end, which no
    /// backend of vsd's passes on.
    pub fn send_break(&self, args: ChardevId) -> Result<Value, QmpError> {
        match self.lock().by_id.contains_key(&args.id) {
            true => Ok(json!({})),
            false => Err(not_found(&args.id)),
        }
    }

    /// `query-chardev`.
    pub fn query(&self) -> Value {
        let inner = self.lock();
        let info =
            |(id, c): (&String, &Chardev)| json!({ "label": id, "filename": c.filename(), "frontend-open": c.monitor });
        inner.by_id.iter().map(info).collect()
    }

    /// `ringbuf-write`: the data's UTF-8, or what its base64 decodes to.
    pub fn ringbuf_write(&self, args: RingbufWrite) -> Result<Value, QmpError> {
        let mut inner = self.lock();
        let chardev = ring_chardev(&mut inner, &args.device)?;
        let data = match args.format.unwrap_or_default() {
            DataFormat::Utf8 => qemu_utf8(&args.data),
            DataFormat::Base64 => crate::objects::decode_base64(args.data.as_bytes()).map_err(QmpError::generic)?,
        };
        if let Backend::Ring { ring, .. } = &mut chardev.backend {
            ring.write(&data);
        }
        Ok(json!({}))
    }

    /// `ringbuf-read`: up to `size` bytes, consumed.
    pub fn ringbuf_read(&self, args: RingbufRead) -> Result<Value, QmpError> {
        let mut inner = self.lock();
        let chardev = ring_chardev(&mut inner, &args.device)?;
        if args.size <= 0 {
            return Err(QmpError::generic("size must be greater than zero"));
        }
        let Backend::Ring { ring, .. } = &mut chardev.backend else { unreachable!("ring_chardev checked") };
        let bytes = ring.read(usize::try_from(args.size).unwrap_or(usize::MAX));
        Ok(Value::String(match args.format.unwrap_or_default() {
            DataFormat::Base64 => base64::engine::general_purpose::STANDARD.encode(bytes),
            DataFormat::Utf8 => text_as_qemu_sends_it(&bytes),
        }))
    }
}

/// The ring buffer chardev `id`, or QEMU's refusal.
fn ring_chardev<'a>(inner: &'a mut Inner, id: &str) -> Result<&'a mut Chardev, QmpError> {
    match inner.by_id.get_mut(id) {
        None => Err(QmpError::generic(format!("Device '{id}' not found"))),
        Some(c) if !matches!(c.backend, Backend::Ring { .. }) => {
            Err(QmpError::generic(format!("{id} is not a ringbuf device")))
        }
        Some(c) => Ok(c),
    }
}

/// QMP text as QEMU holds it: UTF-8, with U+0000 as the two bytes C0 80
/// (QEMU's parser makes C strings).
fn qemu_utf8(text: &str) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(text.len());
    for piece in text.split('\0') {
        bytes.extend_from_slice(piece.as_bytes());
        bytes.extend_from_slice(&[0xC0, 0x80]);
    }
    bytes.truncate(bytes.len() - 2);
    bytes
}

/// Bytes read as QEMU returns them as a string: up to the first NUL (it
/// passes a C string), C0 80 back to U+0000, and each invalid sequence
/// as U+FFFD.
fn text_as_qemu_sends_it(bytes: &[u8]) -> String {
    let until_nul = bytes.split(|&b| b == 0).next().unwrap_or_default();
    let mut text = String::new();
    let mut rest = until_nul;
    while let Some(at) = rest.windows(2).position(|pair| pair == [0xC0, 0x80]) {
        text.push_str(&String::from_utf8_lossy(&rest[..at]));
        text.push('\0');
        rest = &rest[at + 2..];
    }
    text.push_str(&String::from_utf8_lossy(rest));
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_keeps_the_newest_bytes_and_reading_consumes_them() {
        let mut ring = ring(8).unwrap();
        ring.write(b"hello");
        ring.write(b"world!");
        assert_eq!(ring.read(100), b"loworld!");
        assert_eq!(ring.read(100), b"");
        ring.write(b"0123456789abcdef");
        assert_eq!(ring.read(3), b"89a");
        assert_eq!(ring.read(100), b"bcdef");
        // QEMU takes 0 as a power of two: such a ring holds nothing.
        let mut empty = super::ring(0).unwrap();
        empty.write(b"x");
        assert_eq!(empty.read(1), b"");
        assert!(super::ring(7).is_err());
        assert!(super::ring(u64::MAX).is_err());
        // A huge ring costs only what is written.
        super::ring(1 << 62).unwrap().write(b"x");
    }

    #[test]
    fn text_crosses_as_qemu_carries_it() {
        assert_eq!(qemu_utf8("ab\0cd"), b"ab\xC0\x80cd");
        assert_eq!(qemu_utf8("\0"), b"\xC0\x80");
        assert_eq!(qemu_utf8("é"), "é".as_bytes());
        assert_eq!(text_as_qemu_sends_it(b"ab\xC0\x80cd"), "ab\0cd");
        assert_eq!(text_as_qemu_sends_it(b"a\0b"), "a");
        assert_eq!(text_as_qemu_sends_it(b"\xffABC\xffDE"), "\u{fffd}ABC\u{fffd}DE");
        assert_eq!(text_as_qemu_sends_it(b"\xf0\x9f\x98"), "\u{fffd}");
        assert_eq!(text_as_qemu_sends_it(b"\xc3"), "\u{fffd}");
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

    #[test]
    fn one_family_given_means_only_it() {
        assert_eq!(families(None, None), (true, true));
        assert_eq!(families(Some(true), None), (true, false));
        assert_eq!(families(None, Some(true)), (false, true));
        assert_eq!(families(Some(true), Some(true)), (true, true));
        assert_eq!(families(Some(false), None), (false, true));
        assert_eq!(families(None, Some(false)), (true, false));
    }
}
