//! `vsd`: serves block nodes to virtual machines over vhost-user-blk.
//!
//! The command line follows qemu-storage-daemon's, so existing scripts keep
//! working: `--blockdev` defines nodes (in order, a node may use earlier
//! ones), `--export` serves a node on a socket.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use vsd_block::BlockGraph;
use vsd_block::options::OptionMap;
use vsd_export::{ExportConfig, VhostUserBlkExport};

#[derive(Parser, Debug)]
#[command(name = "vsd", version, about = "A vhost-user-blk storage daemon for virtual machines")]
#[command(
    after_help = "Examples:\n  vsd --blockdev driver=file,node-name=f,filename=disk.img,cache.direct=on \\\n      --export type=vhost-user-blk,id=e0,node-name=f,addr.type=unix,addr.path=/run/vsd.sock,writable=on,num-queues=2"
)]
struct Cli {
    /// A block node: driver=file|raw|null-co,node-name=NAME,... (or a JSON object)
    #[arg(long, value_name = "OPTIONS")]
    blockdev: Vec<String>,
    /// An export: type=vhost-user-blk,id=ID,node-name=NAME,addr.type=unix,addr.path=SOCKET,...
    #[arg(long, value_name = "OPTIONS")]
    export: Vec<String>,
    /// Write the daemon's PID here once every export accepts connections.
    #[arg(long, value_name = "PATH")]
    pidfile: Option<PathBuf>,
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
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vsd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    // Before any thread starts, so all of them inherit the mask and the
    // signals reach the sigwait below.
    vsd_sys::block_termination_signals().context("blocking signals")?;

    let mut graph = BlockGraph::new();
    for text in &cli.blockdev {
        graph.add(OptionMap::parse("--blockdev", text)?)?;
    }
    if cli.export.is_empty() {
        anyhow::bail!("nothing to serve: give at least one --export");
    }
    // Files this run created; removed on exit, or at once if startup fails.
    let mut created = Created::default();
    for text in &cli.export {
        let mut opts = OptionMap::parse("--export", text)?;
        let config = ExportConfig::from_options(&mut opts)?;
        opts.finish()?;
        let node = graph
            .get(&config.node_name)
            .with_context(|| format!("export '{}': no node named '{}'", config.id, config.node_name))?;
        let export = VhostUserBlkExport::start(config, node)?;
        created.0.push(export.config().socket.clone());
        log::info!("export '{}' listening on {}", export.config().id, export.config().socket.display());
    }
    if let Some(path) = &cli.pidfile {
        write_pidfile(path)?;
        created.0.push(path.clone());
    }
    let signal = vsd_sys::wait_for_termination().context("waiting for signals")?;
    log::info!("signal {signal}: shutting down");
    // Cached metadata (qcow2) reaches the image before the process ends.
    for node in graph.nodes() {
        if let Err(e) = node.close() {
            log::error!("node '{}': writing back cached state failed: {e}", node.name());
        }
    }
    Ok(())
}

fn write_pidfile(path: &Path) -> Result<()> {
    std::fs::write(path, format!("{}\n", std::process::id()))
        .with_context(|| format!("cannot write pidfile '{}'", path.display()))
}

/// Paths to remove when the daemon exits, however it exits.
#[derive(Default)]
struct Created(Vec<PathBuf>);

impl Drop for Created {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}
