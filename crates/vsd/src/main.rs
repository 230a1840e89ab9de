//! `vsd`: serves block nodes to virtual machines over vhost-user-blk.
//!
//! The command line follows qemu-storage-daemon's, so existing scripts keep
//! working: `--blockdev` defines nodes (in order, a node may use earlier
//! ones), `--export` serves a node on a socket, `--chardev` + `--monitor`
//! open a QMP socket. `vsd stat` prints a running export's statistics;
//! `vsd lab` runs benchmark matrices and reports them.

mod commands;
mod daemon;
mod monitor;
mod stat;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use vsd_block::options::OptionMap;
use vsd_control::metrics::MetricsServer;
use vsd_control::qmp::QmpServer;

use daemon::Daemon;

#[derive(Parser, Debug)]
#[command(name = "vsd", version, about = "A vhost-user-blk storage daemon for virtual machines")]
#[command(args_conflicts_with_subcommands = true)]
#[command(
    after_help = "Examples:\n  vsd --blockdev driver=file,node-name=f,filename=disk.img,cache.direct=on \\\n      --export type=vhost-user-blk,id=e0,node-name=f,addr.type=unix,addr.path=/run/vsd.sock,writable=on,num-queues=2 \\\n      --chardev socket,id=qmp,path=/run/vsd-qmp.sock,server=on,wait=off --monitor chardev=qmp\n  vsd stat --qmp /run/vsd-qmp.sock"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    daemon: DaemonArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print a running daemon's per-stage latency and events per I/O.
    Stat(stat::Args),
    /// Run benchmark matrices (vsd, qemu-storage-daemon, the bare host) and report them.
    Lab(vsd_lab::cli::Args),
}

#[derive(clap::Args, Debug)]
struct DaemonArgs {
    /// A block node: driver=file|raw|qcow2|null-co,node-name=NAME,... (or a JSON object)
    #[arg(long, value_name = "OPTIONS")]
    blockdev: Vec<String>,
    /// An export: type=vhost-user-blk,id=ID,node-name=NAME,addr.type=unix,addr.path=SOCKET,...
    #[arg(long, value_name = "OPTIONS")]
    export: Vec<String>,
    /// The NBD server: addr.type=unix,addr.path=SOCKET or addr.type=inet,addr.host=HOST,addr.port=PORT
    #[arg(long, value_name = "OPTIONS")]
    nbd_server: Option<String>,
    /// A socket for a monitor: socket,id=ID,path=PATH,server=on,wait=off
    #[arg(long, value_name = "OPTIONS")]
    chardev: Vec<String>,
    /// A QMP monitor on a --chardev: chardev=ID
    #[arg(long, value_name = "OPTIONS")]
    monitor: Vec<String>,
    /// Serve Prometheus metrics at http://ADDR:PORT/metrics
    #[arg(long, value_name = "ADDR:PORT")]
    metrics: Option<String>,
    /// Write the daemon's PID here once every export accepts connections.
    #[arg(long, value_name = "PATH")]
    pidfile: Option<PathBuf>,
    /// Drop privileges once every socket listens and the pidfile is written:
    /// user=NAME (its groups) or user=UID:GID, as QEMU's -run-with.
    #[arg(long, value_name = "user=USER")]
    run_with: Option<String>,
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            // --help and --version
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let text = e.to_string();
            let first = text.lines().next().unwrap_or_default().trim_start_matches("error: ");
            eprintln!("vsd: {first} (see vsd --help)");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Some(Command::Stat(args)) => stat::run(args).map(|()| ExitCode::SUCCESS),
        Some(Command::Lab(args)) => vsd_lab::cli::main(args),
        None => run(cli.daemon).map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("vsd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: DaemonArgs) -> Result<()> {
    // Before any thread starts, so all of them inherit the mask and the
    // signals reach the sigwait below.
    vsd_sys::block_termination_signals().context("blocking signals")?;
    // Resolved before anything is opened, so that a mistake leaves nothing behind.
    let run_as = args.run_with.as_deref().map(RunAs::parse).transpose()?;

    let daemon = Arc::new(Daemon::new());
    for text in &args.blockdev {
        daemon.add_blockdev(OptionMap::parse("--blockdev", text)?)?;
    }
    let monitors = monitor::sockets(&args.chardev, &args.monitor)?;
    if args.export.is_empty() && monitors.is_empty() && args.nbd_server.is_none() {
        anyhow::bail!("nothing to serve: give at least one --export, --nbd-server or --monitor");
    }
    if let Some(text) = &args.nbd_server {
        daemon.start_nbd_server(OptionMap::parse("--nbd-server", text)?)?;
    }
    for text in &args.export {
        daemon.add_export(OptionMap::parse("--export", text)?)?;
    }
    let _monitors = monitors
        .iter()
        .map(|path| {
            QmpServer::listen(path, daemon.clone(), daemon.events.clone())
                .with_context(|| format!("cannot open the QMP socket '{}'", path.display()))
        })
        .collect::<Result<Vec<_>>>()?;
    let _metrics = match &args.metrics {
        Some(addr) => {
            let source = daemon.clone();
            let render = Arc::new(move || commands::metrics(&source));
            Some(MetricsServer::start(addr, render).with_context(|| format!("cannot serve metrics on '{addr}'"))?)
        }
        None => None,
    };
    let _pidfile = args.pidfile.as_deref().map(Pidfile::write).transpose()?;
    if let Some(run_as) = &run_as {
        run_as.drop_privileges()?;
    }
    let signal = vsd_sys::wait_for_termination().context("waiting for signals")?;
    log::info!("signal {signal}: shutting down");
    daemon.shutdown();
    Ok(())
}

/// The user `--run-with user=...` names, which the daemon becomes once it
/// has opened what needs privileges: images, sockets, the pidfile.
struct RunAs {
    /// As the option said it, for messages.
    user: String,
    uid: u32,
    gid: u32,
    groups: Vec<u32>,
}

impl RunAs {
    /// QEMU's `-run-with user=NAME|UID:GID`. A name brings its primary
    /// group and the groups it is a member of; `UID:GID` that one group
    /// alone. Root is refused: it would drop nothing.
    fn parse(text: &str) -> Result<Self> {
        let mut opts = OptionMap::parse("--run-with", text)?;
        let user = opts.take("user");
        // QEMU's chroot= and async-teardown= are not vsd's: named as unknown.
        opts.finish()?;
        let Some(user) = user else { anyhow::bail!("--run-with: give user=NAME or user=UID:GID") };
        let context = || format!("--run-with user={user}");
        let (uid, gid, groups) = if let Some(ids) = vsd_sys::user_by_name(&user).with_context(context)? {
            (ids.uid, ids.gid, vsd_sys::group_list(&user, ids.gid).with_context(context)?)
        } else if let Some((uid, gid)) = numeric_ids(&user) {
            (uid, gid, vec![gid])
        } else {
            anyhow::bail!("--run-with user={user}: no such user (give a user name or UID:GID)");
        };
        if uid == 0 || gid == 0 {
            anyhow::bail!("--run-with user={user}: that is root's user or group, which would drop nothing");
        }
        Ok(Self { user, uid, gid, groups })
    }

    /// Drops to the user for good, then checks that no thread of the
    /// process kept other ids.
    fn drop_privileges(&self) -> Result<()> {
        vsd_sys::drop_privileges(self.uid, self.gid, &self.groups)
            .with_context(|| format!("cannot drop privileges to user {}", self.user))?;
        match threads_not_running_as(self.uid, self.gid) {
            Ok(others) if others.is_empty() => {}
            // Only kernel-made threads can be here (see below). They serve
            // the images already open, so the daemon carries on, but says so.
            Ok(others) => log::warn!(
                "threads that kept their ids after dropping privileges to user {}: {}",
                self.user,
                others.join(", ")
            ),
            Err(e) => log::warn!("cannot check the threads' ids after dropping privileges: {e:#}"),
        }
        log::info!("running as user {} (uid {}, gid {})", self.user, self.uid, self.gid);
        Ok(())
    }
}

/// `UID:GID`, both numbers; `None` otherwise. -1 is not an id.
fn numeric_ids(text: &str) -> Option<(u32, u32)> {
    let (uid, gid) = text.split_once(':')?;
    let id = |t: &str| t.parse::<u32>().ok().filter(|&id| id != u32::MAX);
    Some((id(uid)?, id(gid)?))
}

/// The threads whose real, effective, saved or filesystem ids are not
/// `uid` and `gid`, described. glibc changes every thread it made; threads
/// the kernel made for the process keep the ids they started with: those
/// are io_uring's workers (`iou-wrk-*`), started only if a front-end
/// connected and did I/O before the drop.
fn threads_not_running_as(uid: u32, gid: u32) -> Result<Vec<String>> {
    let mut others = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").context("listing /proc/self/task")? {
        let path = task?.path().join("status");
        let status = match std::fs::read_to_string(&path) {
            Ok(status) => status,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue, // it exited meanwhile
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        let field = |key: &str| status.lines().find_map(|line| line.strip_prefix(key)).unwrap_or_default().trim();
        let is = |key: &str, want: u32| field(key).split_whitespace().all(|id| id == want.to_string());
        if !(is("Uid:", uid) && is("Gid:", gid)) {
            others.push(format!("'{}' (uid {}, gid {})", field("Name:"), field("Uid:"), field("Gid:")));
        }
    }
    Ok(others)
}

/// The pidfile, removed when the daemon exits, however it exits. After
/// `--run-with`, removing it (and the sockets) takes a directory the user
/// may write; otherwise it stays, and the next start overwrites it.
struct Pidfile(PathBuf);

impl Pidfile {
    fn write(path: &Path) -> Result<Self> {
        std::fs::write(path, format!("{}\n", std::process::id()))
            .with_context(|| format!("cannot write pidfile '{}'", path.display()))?;
        Ok(Self(path.to_path_buf()))
    }
}

impl Drop for Pidfile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
