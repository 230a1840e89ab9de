//! `vsd`: serves block nodes over vhost-user-blk and NBD, with
//! qemu-storage-daemon's command line: `--blockdev` defines nodes (a node
//! may use earlier ones), `--export` serves one, `--chardev` + `--monitor`
//! open a QMP socket. `vsd stat` prints a running export's statistics.

mod backing_file;
mod bitmaps;
mod chain;
mod chardev;
mod commands;
mod commit;
mod create;
mod daemon;
mod drive;
mod inactive;
mod internal_snapshot;
mod jobs;
mod mirror;
mod monitor;
mod nbd_legacy;
mod objects;
mod pidfile;
mod qapi;
mod query_block;
mod reopen;
mod run_as;
mod sandbox;
mod schema;
mod service;
mod snapshot;
mod stat;
mod stream;
mod threshold;
mod trace;
mod transaction;
mod writers;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use vsd_block::options::OptionMap;
use vsd_control::metrics::{MetricsServer, Sources};

use daemon::Daemon;
use pidfile::Pidfile;
use run_as::RunAs;

#[derive(Parser, Debug)]
#[command(
    name = "vsd",
    version,
    about = "A storage daemon for virtual machines: vhost-user-blk and NBD exports, with qemu-storage-daemon's command line and QMP"
)]
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
    /// Print the manual page (roff) made from this command line's
    /// definition, as scripts/install.sh installs it.
    #[command(hide = true)]
    Man,
}

#[derive(clap::Args, Debug)]
struct DaemonArgs {
    /// An object others refer to by id (the types are listed by `cli()`)
    #[arg(long, value_name = "OPTIONS")]
    object: Vec<String>,
    /// A block node (the drivers are listed by `cli()`)
    #[arg(long, value_name = "OPTIONS")]
    blockdev: Vec<String>,
    /// An export (the types are listed by `cli()`)
    #[arg(long, value_name = "OPTIONS")]
    export: Vec<String>,
    /// The NBD server: addr.type=unix,addr.path=SOCKET or addr.type=inet,addr.host=HOST,addr.port=PORT[,tls-creds=ID]
    #[arg(long, value_name = "OPTIONS")]
    nbd_server: Option<String>,
    /// A character device: stdio,id=ID, socket,id=ID,server=on[,wait=off] with path=PATH, host=HOST,port=PORT or fd=N (where monitors talk), or ringbuf|null|file,id=ID,...
    #[arg(long, value_name = "OPTIONS")]
    chardev: Vec<String>,
    /// A QMP monitor on a --chardev: [chardev=]ID[,pretty=on]
    #[arg(long, value_name = "OPTIONS")]
    monitor: Vec<String>,
    /// Serve Prometheus metrics at http://ADDR:PORT/metrics, and a live status page at http://ADDR:PORT/
    #[arg(long, value_name = "ADDR:PORT")]
    metrics: Option<String>,
    /// Write the daemon's PID here once every export accepts connections.
    #[arg(long, value_name = "PATH")]
    pidfile: Option<PathBuf>,
    /// Drop privileges once every socket listens and the pidfile is written:
    /// user=NAME (its groups) or user=UID:GID, as QEMU's -run-with.
    #[arg(long, value_name = "user=USER")]
    run_with: Option<String>,
    /// Confine the daemon once it serves (on|off, as QEMU's -sandbox):
    /// no new privileges, no capabilities, a seccomp list of system calls.
    #[arg(long, value_name = "on|off")]
    sandbox: Option<String>,
    /// Run in the background; the command returns once every export
    /// serves (0), or with the error that stopped the daemon (1).
    #[arg(long)]
    daemonize: bool,
    /// Log what the layers behind QEMU's trace events do: QEMU's
    /// [enable=]PATTERN[,events=FILE][,file=FILE] (`-T help` lists them).
    #[arg(short = 'T', long, value_name = "OPTIONS")]
    trace: Vec<String>,
}

/// The command line, its lists of object types, drivers and export types
/// taken from the tables the daemon itself uses (and the manual's test).
fn cli() -> clap::Command {
    let list = |items: &[&str]| items.join("|");
    Cli::command()
        .mut_arg("object", |arg| {
            arg.help(format!(
                "An object others refer to by id: [qom-type=]{},id=ID,... (`--object TYPE,help` lists a type's properties)",
                list(objects::TYPES)
            ))
        })
        .mut_arg("blockdev", |arg| {
            arg.help(format!(
                "A block node: [driver=]{},node-name=NAME,... or a JSON object (`--blockdev DRIVER,help` lists a driver's options)",
                list(vsd_block::DRIVERS)
            ))
        })
        .mut_arg("export", |arg| {
            arg.help(format!(
                "An export: [type=]{},id=ID,node-name=NAME,... (`--export TYPE,help` lists a type's options)",
                list(daemon::EXPORT_TYPES)
            ))
        })
}

fn main() -> ExitCode {
    let cli = match cli().try_get_matches().and_then(|matches| Cli::from_arg_matches(&matches)) {
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
        Some(Command::Stat(args)) => start_logging(&trace::Trace::default()).and_then(|()| stat::run(args)),
        Some(Command::Man) => man_page(),
        None => match help(&cli.daemon) {
            Some(text) => {
                print!("{text}");
                Ok(())
            }
            None => run(cli.daemon),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            service::say(service::ERR, &format!("{e:#}"));
            ExitCode::FAILURE
        }
    }
}

/// The lists QEMU's `help` values ask for (`--object help`, `-T help`),
/// and vsd's drivers and export types, which QSD does not list.
fn help(args: &DaemonArgs) -> Option<String> {
    kind_help(&args.object, "qom-type=", "List of user creatable objects", objects::TYPES, objects::properties)
        .or_else(|| kind_help(&args.blockdev, "driver=", "Block drivers", vsd_block::DRIVERS, schema::blockdev_help))
        .or_else(|| kind_help(&args.export, "type=", "Export types", daemon::EXPORT_TYPES, schema::export_help))
        .or_else(|| args.trace.iter().any(|t| t == "help").then(trace::help))
}

/// `OPTION help` lists the kinds (`title`); `OPTION KIND,help` the options
/// of that kind, and an unknown kind the kinds, as QEMU does.
fn kind_help(
    values: &[String],
    key: &str,
    title: &str,
    kinds: &[&str],
    options: fn(&str) -> Option<Vec<String>>,
) -> Option<String> {
    let lines = |items: &[&str]| items.iter().map(|item| format!("  {item}\n")).collect::<String>();
    let listing = || format!("{title}:\n{}", lines(kinds));
    if values.iter().any(|v| v == "help") {
        return Some(listing());
    }
    let kind = values.iter().find_map(|v| v.strip_suffix(",help"))?;
    let kind = kind.strip_prefix(key).unwrap_or(kind);
    Some(match options(kind) {
        Some(options) => format!("{kind} options:\n{}", lines(&options.iter().map(String::as_str).collect::<Vec<_>>())),
        None => listing(),
    })
}

/// The man page, from the same definition as `--help`.
fn man_page() -> Result<()> {
    clap_mangen::Man::new(cli()).render(&mut std::io::stdout().lock()).context("writing the man page")
}

/// The log on standard error (or `-T file=`), at `warn` unless RUST_LOG
/// says otherwise, and in full for the layers `-T` names. Journald stamps
/// the lines it reads itself and takes their level from a prefix.
fn start_logging(trace: &trace::Trace) -> Result<()> {
    use std::io::Write;
    let mut logger = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"));
    for target in &trace.targets {
        logger.filter_module(target, log::LevelFilter::Trace);
    }
    match trace.open_file()? {
        Some(file) => {
            logger.target(env_logger::Target::Pipe(Box::new(file)));
        }
        None if service::stderr_is_journal() => {
            logger.format(|out, record| {
                writeln!(out, "<{}>{}: {}", service::priority(record.level()), record.target(), record.args())
            });
        }
        None => {}
    }
    logger.init();
    if let Some(warning) = trace.warning() {
        service::say(service::WARNING, &warning);
    }
    Ok(())
}

fn run(args: DaemonArgs) -> Result<()> {
    start_logging(&trace::Trace::parse(&args.trace)?)?;
    // While the process is systemd's child alone.
    vsd_sys::activation::read_environment();
    let notify = service::Notify::from_env();
    // First of all: no thread may run yet when the daemon forks.
    let detached = args.daemonize.then(vsd_sys::daemon::daemonize).transpose().context("--daemonize")?;
    // Before any thread starts, so all of them inherit the mask and the
    // signals reach the sigwait below.
    vsd_sys::block_termination_signals().context("blocking signals")?;
    // Resolved before anything is opened, so that a mistake leaves nothing behind.
    let run_as = args.run_with.as_deref().map(RunAs::parse).transpose()?;
    let sandbox = args.sandbox.as_deref().map(sandbox::parse).transpose()?.unwrap_or(false);
    if sandbox {
        sandbox::prepare(run_as.is_some())?;
    }

    let daemon = Arc::new(Daemon::new());
    let serving = start(&args, &daemon).map_err(|e| match sandbox && run_as.is_none() {
        true => sandbox::started_without_capabilities(e),
        false => e,
    })?;
    // All that needs privileges is open.
    if let Some(run_as) = &run_as {
        run_as.drop_privileges()?;
    }
    if detached.is_some() {
        // As QEMU's daemon: it holds no directory of the caller's.
        std::env::set_current_dir("/").context("--daemonize")?;
    }
    if sandbox {
        sandbox::enter()?;
    }
    // Said while standard error is still the caller's.
    service::say_serving(&daemon, &serving.monitors.addresses);
    notify.ready(&daemon, detached.is_some());
    if let Some(detached) = detached {
        detached.ready().context("--daemonize")?;
    }
    let signal = vsd_sys::wait_for_termination().context("waiting for signals")?;
    log::info!("signal {signal}: shutting down");
    notify.stopping();
    let hung = daemon.shutdown();
    if !hung.is_empty() {
        // Their threads still wait on the back-end: the process's exit
        // ends them, not a drop that would wait with them.
        drop(serving);
        let names: Vec<String> = hung.iter().map(|id| format!("'{id}'")).collect();
        let (what, whose) = if names.len() == 1 { ("export", "its") } else { ("exports", "their") };
        service::say(
            service::WARNING,
            &format!(
                "{what} {} still had requests in flight after {} s ({whose} back-end does not answer); \
                 exiting without them",
                names.join(", "),
                daemon::STOP_LIMIT.as_secs()
            ),
        );
        std::process::exit(1);
    }
    Ok(())
}

/// What the daemon serves with besides its exports, kept until it stops;
/// dropped in this order.
struct Serving {
    _pidfile: Option<Pidfile>,
    _metrics: Option<MetricsServer>,
    monitors: monitor::Monitors,
}

/// Opens every object and node, starts the NBD server, every export and
/// monitor and the metrics, then writes the pidfile.
fn start(args: &DaemonArgs, daemon: &Arc<Daemon>) -> Result<Serving> {
    for text in &args.object {
        daemon.objects.add(OptionMap::parse_implied("--object", text, "qom-type")?).map_err(anyhow::Error::msg)?;
    }
    for text in &args.blockdev {
        daemon.add_blockdev(OptionMap::parse_implied("--blockdev", text, "driver")?)?;
    }
    let monitors = monitor::plan(&args.chardev, &args.monitor, args.daemonize)?;
    if args.export.is_empty() && monitors.is_empty() && args.nbd_server.is_none() {
        anyhow::bail!("nothing to serve: give at least one --export, --nbd-server or --monitor");
    }
    if let Some(text) = &args.nbd_server {
        daemon.start_nbd_server(OptionMap::parse("--nbd-server", text)?)?;
    }
    for text in &args.export {
        daemon.add_export(OptionMap::parse_implied("--export", text, "type")?)?;
    }
    let monitors = monitor::start(monitors, daemon)?;
    let metrics = match &args.metrics {
        Some(addr) => {
            let (metrics, status) = (daemon.clone(), daemon.clone());
            let sources = Sources {
                metrics: Arc::new(move || commands::metrics(&metrics)),
                status: Arc::new(move || commands::status(&status)),
            };
            Some(MetricsServer::start(addr, sources).with_context(|| format!("cannot serve metrics on '{addr}'"))?)
        }
        None => None,
    };
    // Last: it says every socket listens.
    let pidfile = args.pidfile.as_deref().map(Pidfile::write).transpose()?;
    Ok(Serving { _pidfile: pidfile, _metrics: metrics, monitors })
}
