//! The `vsd-lab` command line.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

use crate::matrix::Plan;
use crate::row::read_rows;
use crate::runner;
use crate::spec::Spec;
use crate::tools::Tools;

/// How the lab finds the programs it runs ([`Tools::locate`]).
const LOCATING: &str = "vsd and vsd-bench are taken from the directory of vsd-lab itself (cargo builds all three \
                        into target/<profile>/: cargo build --release -p vsd -p vsd-bench -p vsd-lab); \
                        VSD_LAB_VSD and VSD_LAB_BENCH name others. qemu-storage-daemon and fio come from PATH.";

/// Where results go unless `--results` says otherwise; `LAST` in it names
/// the latest results file, which `vsd-lab report` takes by default.
const RESULTS_DIR: &str = "lab-results";

/// `vsd-lab`'s arguments.
#[derive(Parser, Debug)]
#[command(name = "vsd-lab", version)]
#[command(about = "Run benchmark matrices (vsd, qemu-storage-daemon, the bare host) and report them")]
#[command(after_help = LOCATING)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run every configuration of a spec (lab/specs/*.toml), one JSON line
    /// per run; an interrupted run resumes when started again.
    Run {
        /// The spec (TOML).
        spec: PathBuf,
        /// Results file (default: lab-results/NAME.jsonl).
        #[arg(long)]
        results: Option<PathBuf>,
        /// Start over instead of resuming.
        #[arg(long)]
        fresh: bool,
        /// Only list the configurations.
        #[arg(long)]
        list: bool,
        /// Run only this matrix of the spec (repeatable).
        #[arg(long = "matrix", value_name = "NAME")]
        matrices: Vec<String>,
    },
    /// Make the HTML report of a results file.
    Report {
        /// Results file (default: the latest `vsd-lab run`'s).
        results: Option<PathBuf>,
        /// Output directory (default: next to the results, NAME-report/).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

/// Runs `vsd-lab ...`.
pub fn main(args: Args) -> Result<ExitCode> {
    match args.command {
        Command::Run { spec, results, fresh, list, matrices } => run(&spec, results, fresh, list, &matrices),
        Command::Report { results, out } => report(results, out),
    }
}

fn run(spec_path: &Path, results: Option<PathBuf>, fresh: bool, list: bool, matrices: &[String]) -> Result<ExitCode> {
    let mut spec = Spec::load(spec_path)?;
    spec.keep_matrices(matrices)?;
    if list {
        for planned in Plan::new(&spec).runs {
            println!("{}\t{}", planned.matrix, planned.config.id());
        }
        return Ok(ExitCode::SUCCESS);
    }
    let results = results.unwrap_or_else(|| Path::new(RESULTS_DIR).join(format!("{}.jsonl", spec.name)));
    let tools = Tools::locate()?;
    let outcome = runner::run(&spec, &results, fresh, &tools)?;
    let last = Path::new(RESULTS_DIR).join("LAST");
    std::fs::create_dir_all(RESULTS_DIR)?;
    std::fs::write(&last, results.display().to_string())?;
    eprintln!(
        "vsd-lab: {} runs recorded in {} ({} failed){}",
        outcome.recorded,
        results.display(),
        outcome.failed,
        if outcome.resumed > 0 { format!(", {} from before", outcome.resumed) } else { String::new() }
    );
    if outcome.interrupted {
        eprintln!("vsd-lab: interrupted; the finished runs are kept: run the same command again to resume");
        return Ok(ExitCode::from(130));
    }
    Ok(if outcome.failed > 0 { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

fn report(results: Option<PathBuf>, out: Option<PathBuf>) -> Result<ExitCode> {
    let results = match results {
        Some(path) => path,
        None => {
            let last = Path::new(RESULTS_DIR).join("LAST");
            let text = std::fs::read_to_string(&last)
                .with_context(|| format!("no results named, and no '{}' from a `vsd-lab run`", last.display()))?;
            PathBuf::from(text.trim())
        }
    };
    let rows = read_rows(&results)?;
    anyhow::ensure!(!rows.is_empty(), "'{}' holds no runs", results.display());
    let out = out.unwrap_or_else(|| {
        let stem = results.file_stem().map_or("lab".into(), |s| s.to_string_lossy().into_owned());
        results.with_file_name(format!("{stem}-report"))
    });
    let html = crate::report::write_report(&rows, &out)?;
    println!("{}", html.display());
    Ok(ExitCode::SUCCESS)
}
