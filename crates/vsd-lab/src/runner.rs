//! `vsd-lab run`: every run of a plan, one JSON line each, resumable.
//!
//! Repetitions are interleaved: the whole plan runs once, then again, so
//! that a slow phase of a noisy machine falls on every configuration alike
//! rather than on all repetitions of one. A results file that already holds
//! a run (same matrix, configuration and repetition) is not run again, so an
//! interrupted lab resumes where it stopped.

use std::collections::HashSet;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

use crate::child::{self, Interrupted};
use crate::config::{Driver, Program};
use crate::drive::{self, Setup};
use crate::image::Images;
use crate::matrix::{Plan, Planned};
use crate::row::{Machine, Measured, Row, append_row, read_rows};
use crate::serve::Daemon;
use crate::spec::Spec;
use crate::tools::Tools;

/// What a lab run did.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Runs made and recorded now.
    pub recorded: usize,
    /// Of those, runs that failed (recorded with their error).
    pub failed: usize,
    /// Runs already in the results file, not repeated.
    pub resumed: usize,
    /// Whether Ctrl-C (or SIGTERM) stopped the lab early.
    pub interrupted: bool,
}

/// Runs `spec`, appending rows to `results` (emptied first if `fresh`).
pub fn run(spec: &Spec, results: &Path, fresh: bool, tools: &Tools) -> Result<Outcome> {
    child::note_termination_signals().context("installing the Ctrl-C handler")?;
    let plan = Plan::new(spec);
    if fresh {
        let _ = std::fs::remove_file(results);
    }
    let done: HashSet<(String, String, u32)> =
        read_rows(results)?.into_iter().map(|r| (r.matrix, r.id, r.rep)).collect();
    let todo: Vec<(&Planned, u32)> =
        interleaved(&plan).filter(|(p, rep)| !done.contains(&(p.matrix.clone(), p.config.id(), *rep))).collect();
    let mut outcome = Outcome { resumed: plan.total_runs() as usize - todo.len(), ..Outcome::default() };
    eprintln!("{}", plan_summary(spec, &plan, todo.len(), outcome.resumed));

    if let Some(dir) = results.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut file = OpenOptions::new().create(true).append(true).open(results)?;
    let machine = Machine::probe(&spec.run, env!("CARGO_PKG_VERSION"));
    let workdir = WorkDir::new()?;
    let setup = Setup { run: &spec.run, tools, dir: &workdir.0 };
    let mut images = Images::new(&spec.run);
    let progress = progress_bar(&todo);

    for (n, &(planned, rep)) in todo.iter().enumerate() {
        let started_unix = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        progress.set_message(format!("{}/{} {}", n + 1, todo.len(), planned.config.id()));
        let result = run_one(planned, &mut images, &setup);
        if matches!(&result, Err(e) if e.is::<Interrupted>()) || child::termination_noted() {
            outcome.interrupted = true;
            break;
        }
        let (result, error) = match result {
            Ok(measured) => (Some(measured), None),
            Err(e) => (None, Some(format!("{e:#}"))),
        };
        outcome.failed += usize::from(error.is_some());
        let row = Row {
            spec: spec.name.clone(),
            matrix: planned.matrix.clone(),
            id: planned.config.id(),
            rep,
            started_unix,
            seconds: planned.seconds,
            config: planned.config.clone(),
            result,
            error,
            machine: machine.clone(),
        };
        append_row(&mut file, &row)?;
        outcome.recorded += 1;
        report_line(&progress, &row);
        progress.inc(expected_secs(planned));
    }
    progress.finish_and_clear();
    Ok(outcome)
}

/// Every (configuration, repetition), repetition by repetition.
fn interleaved(plan: &Plan) -> impl Iterator<Item = (&Planned, u32)> {
    let most = plan.runs.iter().map(|p| p.repetitions).max().unwrap_or(0);
    (0..most).flat_map(move |rep| plan.runs.iter().filter(move |p| rep < p.repetitions).map(move |p| (p, rep)))
}

fn run_one(planned: &Planned, images: &mut Images, setup: &Setup) -> Result<Measured> {
    let c = &planned.config;
    let image = images.for_run(c)?;
    let image = image.as_deref();
    match c.program {
        Program::Fio => drive::host_fio(planned, image, setup),
        Program::Qemu => drive::guest(planned, None, image, setup),
        Program::Vsd | Program::Qsd => {
            let daemon = Daemon::start(c, image, setup.run.image_size, &setup.run.daemon_cpus, setup.tools, setup.dir)?;
            match c.driver {
                Driver::Guest => drive::guest(planned, Some(&daemon), image, setup),
                Driver::Bench | Driver::Fio => drive::bench(planned, &daemon, setup),
            }
        }
    }
}

/// A rough duration of one run, for the progress bar's estimate: start-up
/// and connecting take about a second, a guest's boot under TCG about 30.
fn expected_secs(p: &Planned) -> u64 {
    let overhead = if p.config.driver == Driver::Guest { 30.0 } else { 1.0 };
    (p.ramp_seconds + p.seconds + overhead).ceil() as u64
}

fn plan_summary(spec: &Spec, plan: &Plan, todo: usize, resumed: usize) -> String {
    let mut text = format!(
        "vsd-lab: spec '{}': {} configurations, {} runs ({todo} to make, {resumed} already recorded)",
        spec.name,
        plan.runs.len(),
        plan.total_runs()
    );
    for (reason, count) in &plan.skipped {
        text.push_str(&format!("\n  left out {count} combinations: {reason}"));
    }
    text
}

fn progress_bar(todo: &[(&Planned, u32)]) -> ProgressBar {
    let total = todo.iter().map(|(p, _)| expected_secs(p)).sum();
    let bar = ProgressBar::new(total);
    let style = ProgressStyle::with_template("{elapsed_precise} [{wide_bar}] eta {eta_precise}  {msg}")
        .expect("the template is valid")
        .progress_chars("=> ");
    bar.set_style(style);
    bar.enable_steady_tick(Duration::from_millis(500));
    bar
}

/// One line per finished run: above the bar on a terminal, else on stderr.
fn report_line(progress: &ProgressBar, row: &Row) {
    let line = match (&row.result, &row.error) {
        (Some(m), _) => format!(
            "{} #{}: {:.0} IOPS, {:.1} MiB/s, mean {:.1} µs, p99 {:.1} µs{}",
            row.id,
            row.rep,
            m.iops,
            m.bw_mib_s,
            m.lat_us.mean,
            m.lat_us.p99,
            m.daemon_cpu_pct.map(|c| format!(", daemon CPU {c:.0}%")).unwrap_or_default()
        ),
        (None, error) => format!("{} #{}: FAILED: {}", row.id, row.rep, error.as_deref().unwrap_or("?")),
    };
    if progress.is_hidden() {
        eprintln!("{line}");
    } else {
        progress.println(line);
    }
}

/// A private directory for one lab's sockets and outputs, removed at the end.
struct WorkDir(PathBuf);

impl WorkDir {
    fn new() -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("vsd-lab-{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot make '{}'", dir.display()))?;
        Ok(Self(dir))
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
