//! `--chardev` and `--monitor`, as qemu-storage-daemon takes them: QMP on
//! the daemon's standard input and output (`--chardev stdio,id=ID`), or on
//! a listening socket (`--chardev socket,id=ID,server=on,...` with `path=`,
//! `host=` and `port=`, or an inherited `fd=`), each used by one
//! `--monitor [chardev=]ID[,pretty=on]`. Chardevs no monitor uses (those,
//! and `ringbuf`, `memory`, `null`, `file`) are opened as QMP's are.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use vsd_block::options::OptionMap;
use vsd_control::qmp::{Monitor, QmpServer, Served, Stdio};

use crate::chardev::{self, Address, Definition, Spec};
use crate::daemon::Daemon;

/// A `--chardev`.
#[derive(Debug, PartialEq)]
struct Chardev {
    id: String,
    /// The option string, as messages about it quote it.
    text: String,
    definition: Definition,
}

/// A `--monitor` resolved to its `--chardev`.
#[derive(Debug, PartialEq)]
pub struct Planned {
    chardev: Chardev,
    pretty: bool,
}

/// Every `--chardev`: those a monitor uses, and the others.
#[derive(Debug)]
pub struct Plan {
    monitors: Vec<Planned>,
    unused: Vec<Chardev>,
    daemonized: bool,
}

impl Plan {
    /// Whether there is no monitor.
    pub fn is_empty(&self) -> bool {
        self.monitors.is_empty()
    }
}

/// Reads every `--chardev` and `--monitor`; nothing is opened yet. A
/// daemon (`--daemonize`) has no standard input and output to serve.
pub fn plan(chardevs: &[String], monitors: &[String], daemon: bool) -> Result<Plan> {
    let mut defined: Vec<Chardev> = Vec::new();
    for text in chardevs {
        let chardev = chardev(text)?;
        let stdio = chardev.definition.spec == Spec::Stdio;
        if stdio && daemon {
            bail!("--chardev {text}: cannot use stdio with --daemonize");
        }
        if defined.iter().any(|c| c.id == chardev.id) {
            bail!("--chardev {text}: Duplicate ID '{}' for chardev", chardev.id);
        }
        if stdio && defined.iter().any(|c| c.definition.spec == Spec::Stdio) {
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
        let chardev = slot.take().expect("found");
        if !matches!(chardev.definition.spec, Spec::Stdio | Spec::Listen { .. }) {
            bail!("--monitor {text}: vsd's monitors serve stdio and socket chardevs");
        }
        if chardev.definition.log.is_some() {
            bail!("--monitor {text}: vsd does not log a monitor's chardev: leave 'logfile' out");
        }
        planned.push(Planned { chardev, pretty });
    }
    Ok(Plan { monitors: planned, unused: unused.into_iter().flatten().collect(), daemonized: daemon })
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
    let log = opts.take("logfile").map(|path| opts.take_bool("logappend").map(|append| (path, append == Some(true))));
    let log = log.transpose()?;
    let spec = match backend.as_str() {
        "stdio" => stdio(&mut opts)?,
        "socket" => socket(&mut opts)?,
        "null" => Spec::Null,
        "ringbuf" | "memory" => ringbuf(&mut opts, backend == "memory")?,
        "file" => file(&mut opts)?,
        _ => return Err(opts.invalid("backend", backend, &chardev::BACKENDS.join(", ")).into()),
    };
    opts.finish()?;
    Ok(Chardev { id, text: text.to_owned(), definition: Definition { spec, log } })
}

/// QEMU reads `size` into a C int, where 0 (or a multiple of 4 GiB)
/// means its default and a value past 2 GiB turns negative.
fn ringbuf(opts: &mut OptionMap, memory: bool) -> Result<Spec> {
    let size = match opts.take_size("size")?.map(|size| size as u32 as i32) {
        None | Some(0) => chardev::DEFAULT_RING_SIZE,
        Some(size) => i64::from(size) as u64,
    };
    Ok(Spec::Ringbuf { size, memory })
}

/// QEMU's `path` is the file written, `input-path` the one read.
fn file(opts: &mut OptionMap) -> Result<Spec> {
    let Some(out) = opts.take("path") else {
        return Err(opts.rejected("chardev: file: no filename given").into());
    };
    let append = opts.take_bool("append")?.unwrap_or(false);
    Ok(Spec::File { out, input: opts.take("input-path"), append })
}

fn stdio(opts: &mut OptionMap) -> Result<Spec> {
    // vsd never puts the terminal into raw mode: Ctrl-C always stops it.
    if opts.take_bool("signal")? == Some(false) {
        return Err(opts.rejected("signal=off is not supported: vsd leaves the terminal as it is").into());
    }
    Ok(Spec::Stdio)
}

fn socket(opts: &mut OptionMap) -> Result<Spec> {
    let server = opts.take_bool("server")?.unwrap_or(false);
    let wait = opts.take_bool("wait")?;
    if !server && wait.is_some() {
        return Err(opts.rejected("'wait' option is incompatible with socket in client connect mode").into());
    }
    if !server {
        return Err(opts.rejected("vsd's chardev sockets listen for clients: give server=on").into());
    }
    let address = address(opts)?;
    Ok(Spec::Listen { address, wait: wait.unwrap_or(true) })
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
            let (ipv4, ipv6) = chardev::families(ipv4, ipv6);
            Ok(Address::Inet { host, port, ipv4, ipv6 })
        }
        (None, None, Some(fd)) => match fd.parse() {
            Ok(fd) => Ok(Address::Fd(fd)),
            Err(_) => Err(opts.rejected(format!("Unable to parse FD number {fd}")).into()),
        },
        (None, None, None) => Err(opts.rejected("vsd's chardev sockets need one of 'path', 'fd' or 'host'").into()),
        _ => Err(opts.rejected("None or one of 'path', 'fd' or 'host' option required.").into()),
    }
}

/// The monitors serving, until dropped: the sockets stop accepting, and
/// standard output gets what waits for it (the events of the shutdown)
/// before the daemon exits.
pub struct Monitors {
    _servers: Vec<QmpServer>,
    stdio: Option<Served>,
    /// Where each monitor serves, as QEMU shows it (`unix:PATH`, `stdio`).
    pub addresses: Vec<String>,
}

impl Drop for Monitors {
    fn drop(&mut self) {
        if let Some(stdio) = self.stdio.take() {
            stdio.finish(STDOUT_DRAIN);
        }
    }
}

/// The longest the daemon waits at exit for standard output to take what
/// waits for it.
const STDOUT_DRAIN: Duration = Duration::from_secs(5);

/// Starts every planned monitor, and opens the chardevs no monitor uses;
/// all of them go into the daemon's table. A socket whose chardev waits
/// (QEMU's default `wait=on`) has its first client connected on return.
pub fn start(plan: Plan, daemon: &Arc<Daemon>) -> Result<Monitors> {
    let chardevs = &daemon.objects.chardevs;
    if plan.daemonized {
        chardevs.set_daemonized();
    }
    let (mut servers, mut stdio, mut addresses) = (Vec::new(), None, Vec::new());
    for Planned { chardev, pretty } in plan.monitors {
        let monitor = Monitor::new(daemon.clone(), daemon.events.clone()).pretty(pretty);
        let context = || format!("--chardev {}", chardev.text);
        match chardev.definition.spec {
            Spec::Listen { address, wait } => {
                let (listener, shown) = chardev::listen(&address).with_context(context)?;
                if wait {
                    eprintln!("vsd: {}: info: waiting for connection on: disconnected:{shown},server=on", context());
                }
                servers.push(QmpServer::start(listener, monitor, wait).with_context(context)?);
                addresses.push(shown.clone());
                chardevs.add_monitor(&chardev.id, Some(shown));
            }
            _ => {
                stdio = Some(monitor.serve(Stdio, "vsd-qmp-stdio".to_owned()).with_context(context)?);
                addresses.push("stdio".into());
                chardevs.add_monitor(&chardev.id, None);
            }
        }
    }
    for chardev in plan.unused {
        chardevs
            .open(&chardev.id, chardev.definition)
            .map_err(|e| anyhow::anyhow!("--chardev {}: {e}", chardev.text))?;
    }
    Ok(Monitors { _servers: servers, stdio, addresses })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    fn planned(chardevs: &[&str], monitors: &[&str]) -> Vec<Planned> {
        plan(&strings(chardevs), &strings(monitors), false).unwrap().monitors
    }

    fn error(chardevs: &[&str], monitors: &[&str]) -> String {
        plan(&strings(chardevs), &strings(monitors), false).unwrap_err().to_string()
    }

    fn spec(chardev: &str) -> Spec {
        planned(&[chardev], &["m"]).remove(0).chardev.definition.spec
    }

    #[test]
    fn qsd_style_monitor_resolves_to_its_socket() {
        let monitors = planned(&["socket,id=qmp0,path=/tmp/q.sock,server=on,wait=off"], &["chardev=qmp0"]);
        let address = Address::Unix(PathBuf::from("/tmp/q.sock"));
        assert_eq!(monitors[0].chardev.definition.spec, Spec::Listen { address, wait: false });
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
        assert_eq!(spec("socket,id=m,path=/p,server=on"), Spec::Listen { address: unix, wait: true });
        let Spec::Listen { address: Address::Fd(5), wait: false } = spec("socket,id=m,fd=5,server=on,wait=off") else {
            panic!("fd=5 expected");
        };
    }

    #[test]
    fn inet_families() {
        let inet = |extra: &str| match spec(&format!("socket,id=m,host=::1,port=4444,server=on{extra}")) {
            Spec::Listen { address: Address::Inet { host, port: 4444, ipv4, ipv6 }, .. } if host == "::1" => {
                (ipv4, ipv6)
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(inet(""), (true, true));
        assert_eq!(inet(",ipv4=on"), (true, false));
        assert_eq!(inet(",ipv6=on"), (false, true));
    }

    #[test]
    fn chardevs_no_monitor_uses_are_kept_with_their_logs() {
        let plan = plan(
            &strings(&["ringbuf,id=r,size=4k,logfile=/l,logappend=on", "null,id=n", "file,id=f,path=/o,append=on"]),
            &[],
            false,
        )
        .unwrap();
        let definitions: Vec<_> = plan.unused.iter().map(|c| (c.id.as_str(), &c.definition)).collect();
        let ring = Definition { spec: Spec::Ringbuf { size: 4096, memory: false }, log: Some(("/l".into(), true)) };
        let file = Spec::File { out: "/o".into(), input: None, append: true };
        assert_eq!(
            definitions,
            [
                ("r", &ring),
                ("n", &Definition { spec: Spec::Null, log: None }),
                ("f", &Definition { spec: file, log: None })
            ]
        );
        assert!(plan.is_empty());
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
        assert!(error(&["pty,id=a"], &[]).contains("backend"));
        assert!(error(&["file,id=a"], &[]).contains("chardev: file: no filename given"));
        assert!(error(&["ringbuf,id=a,size=big"], &[]).contains("size"));
        assert!(error(&["ringbuf,id=a"], &["a"]).contains("vsd's monitors serve stdio and socket chardevs"));
        assert!(error(&["stdio,id=a,logfile=/l"], &["a"]).contains("leave 'logfile' out"));
        assert!(error(&["stdio,id=a,signal=off"], &[]).contains("signal=off"));
        assert!(error(&[open], &["chardev=a,mode=readline"]).contains("Only QMP is supported"));
        assert!(error(&[open], &["chardev=a,pretty=maybe"]).contains("pretty"));
        assert!(error(&[open], &["pretty=on"]).contains("chardev"));
    }
}
