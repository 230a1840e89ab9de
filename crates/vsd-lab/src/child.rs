//! Child processes of a run: pinned, output to files, watched for a
//! deadline and for Ctrl-C.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rustix::process::{Pid, Signal, kill_process};
use signal_hook::consts::{SIGINT, SIGTERM};

/// The lab was asked to stop (SIGINT or SIGTERM): the run is not recorded.
#[derive(Debug, thiserror::Error)]
#[error("interrupted")]
pub struct Interrupted;

/// How often a waiting run looks at its child and the clock.
const TICK: Duration = Duration::from_millis(20);

/// Set by SIGINT or SIGTERM once [`note_termination_signals`] ran.
static TERMINATION_NOTED: LazyLock<Arc<AtomicBool>> = LazyLock::new(Arc::default);

/// SIGINT and SIGTERM set a flag, read by [`termination_noted`], instead of
/// killing the lab, so it can stop its children and keep its results. The
/// handler is reset by `exec`, so children keep the default action.
pub fn note_termination_signals() -> std::io::Result<()> {
    for signal in [SIGINT, SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&TERMINATION_NOTED))?;
    }
    Ok(())
}

/// Whether SIGINT or SIGTERM arrived since [`note_termination_signals`].
pub fn termination_noted() -> bool {
    TERMINATION_NOTED.load(Ordering::Relaxed)
}

/// `program args...` under `taskset -c cpus` (unless `cpus` is empty).
pub fn pinned(cpus: &str, program: &Path) -> Command {
    if cpus.is_empty() {
        return Command::new(program);
    }
    let mut cmd = Command::new("taskset");
    cmd.arg("-c").arg(cpus).arg(program);
    cmd
}

/// A child whose stdout and stderr go to files in a work directory.
pub struct Watched {
    child: Child,
    name: String,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl Watched {
    /// Starts `cmd`, with its output in `dir/NAME.out` and `dir/NAME.err`.
    pub fn spawn(mut cmd: Command, dir: &Path, name: &str) -> Result<Self> {
        let stdout = dir.join(format!("{name}.out"));
        let stderr = dir.join(format!("{name}.err"));
        let child = cmd
            .stdin(Stdio::null())
            .stdout(File::create(&stdout)?)
            .stderr(File::create(&stderr)?)
            .spawn()
            .with_context(|| format!("cannot start {name} ({:?})", cmd.get_program()))?;
        Ok(Self { child, name: name.to_owned(), stdout, stderr })
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the child is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits for the child to exit by itself, calling `tick` with the time
    /// since it started every few milliseconds; returns its stdout. A
    /// non-zero exit is an error carrying the end of its stderr.
    pub fn finish(mut self, deadline: Duration, mut tick: impl FnMut(Duration)) -> Result<String> {
        let start = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait()? {
                break status;
            }
            if termination_noted() {
                self.stop();
                return Err(Interrupted.into());
            }
            if start.elapsed() > deadline {
                self.stop();
                bail!("{} did not finish within {} s", self.name, deadline.as_secs());
            }
            tick(start.elapsed());
            std::thread::sleep(TICK);
        };
        let out = std::fs::read_to_string(&self.stdout).unwrap_or_default();
        if !status.success() {
            bail!("{} failed ({status}): {}", self.name, self.stderr_tail());
        }
        Ok(out)
    }

    /// The last lines of the child's stderr, for error messages.
    pub fn stderr_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        lines[lines.len().saturating_sub(3)..].join(" | ")
    }

    /// Asks the child to stop (SIGTERM), then kills it if it lingers.
    pub fn stop(&mut self) {
        if !self.running() {
            return;
        }
        // The pid is our unreaped child's, so it cannot name another process.
        let _ = kill_process(Pid::from_child(&self.child), Signal::TERM);
        let give_up = Instant::now() + Duration::from_secs(10);
        while self.running() && Instant::now() < give_up {
            std::thread::sleep(TICK);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Sleeps `duration`, unless the lab is asked to stop first.
pub fn sleep(duration: Duration) -> Result<()> {
    let end = Instant::now() + duration;
    while Instant::now() < end {
        if termination_noted() {
            return Err(Interrupted.into());
        }
        std::thread::sleep(TICK.min(end - Instant::now()));
    }
    Ok(())
}

/// User plus system CPU time of a process so far, in microseconds.
pub fn cpu_us(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name may hold spaces and parentheses: fields start after the last ')'.
    let fields: Vec<&str> = stat.rsplit_once(')').context("odd /proc stat")?.1.split_whitespace().collect();
    let tick = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
    let ticks = tick(11).zip(tick(12)).map(|(user, system)| user + system).context("odd /proc stat")?;
    Ok(ticks as f64 * 1e6 / rustix::param::clock_ticks_per_second() as f64)
}
