//! Driving one run and reading back its figures: vsd-bench against a
//! daemon, fio on the host file (the floor), or fio inside a QEMU guest.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;
use vsd_trace::QueueSnapshot;

use crate::child::{Watched, pinned};
use crate::config::{Bus, CacheMode, Engine, Format, Program, name};
use crate::matrix::{Planned, direct, writethrough};
use crate::row::{Breakdown, Latency, Measured};
use crate::serve::Daemon;
use crate::spec::RunSettings;
use crate::tools::Tools;

/// What every driver needs besides the run itself.
pub struct Setup<'a> {
    /// The spec's run settings.
    pub run: &'a RunSettings,
    /// The programs.
    pub tools: &'a Tools,
    /// A private directory for sockets and outputs.
    pub dir: &'a Path,
}

/// Time allowed beyond a run's own length (start-up, connecting, a guest's
/// boot under TCG).
const BENCH_SLACK: Duration = Duration::from_secs(60);
const GUEST_SLACK: Duration = Duration::from_secs(240);

fn deadline(p: &Planned, slack: Duration) -> Duration {
    Duration::from_secs_f64(p.ramp_seconds + p.seconds) + slack
}

/// vsd-bench (libblkio) against `daemon`, with vsd's breakdown over QMP.
pub fn bench(p: &Planned, daemon: &Daemon, setup: &Setup) -> Result<Measured> {
    let c = &p.config;
    let mut cmd = pinned(&setup.run.client_cpus, &setup.tools.bench);
    cmd.arg("--socket").arg(&daemon.socket);
    cmd.args(["--rw", &name(&c.rw), "--bs", &c.bs.to_string(), "--iodepth", &c.iodepth.to_string()]);
    cmd.args(["--queues", &c.queues.to_string(), "--jobs", &c.jobs.to_string()]);
    cmd.args(["--seconds", &p.seconds.to_string(), "--ramp-seconds", &p.ramp_seconds.to_string(), "--json"]);
    if c.program == Program::Vsd {
        cmd.arg("--breakdown").arg(&daemon.qmp);
    }
    let mut cpu = CpuWindow::new(p);
    let out = Watched::spawn(cmd, setup.dir, "vsd-bench")?
        .finish(deadline(p, BENCH_SLACK), |elapsed| cpu.tick(elapsed, || daemon.cpu_us()))?;
    let daemon_cpu = cpu.close(|| daemon.cpu_us());
    let json: Value = serde_json::from_str(&out).context("vsd-bench's output is not JSON")?;
    let r = &json["results"];
    let iops = number(r, "iops")?;
    let breakdown = json["breakdown"].get(0).map(|export| -> Result<Breakdown> {
        let stats: QueueSnapshot = serde_json::from_value(export["stats"].clone())?;
        Ok(Breakdown::from_snapshot(&stats))
    });
    Ok(Measured {
        iops,
        bw_mib_s: number(r, "bw_mib_s")?,
        lat_us: Latency {
            mean: number(&r["lat_us"], "mean")?,
            p50: number(&r["lat_us"], "p50")?,
            p99: number(&r["lat_us"], "p99")?,
            max: number(&r["lat_us"], "max")?,
        },
        daemon_cpu_pct: daemon_cpu.map(|(us, secs)| us / secs / 1e4),
        daemon_cpu_us_per_io: daemon_cpu.map(|(us, secs)| us / secs / iops.max(1.0)),
        client_cpu_pct: Some(number(r, "client_cpu_us")? / number(r, "duration_s")? / 1e4),
        breakdown: breakdown.transpose().context("vsd's breakdown")?,
    })
}

/// fio on the image file itself (or fio's null engine for `null-co`): the
/// floor no daemon can beat.
pub fn host_fio(p: &Planned, image: Option<&Path>, setup: &Setup) -> Result<Measured> {
    let c = &p.config;
    let mut cmd = pinned(&setup.run.client_cpus, &setup.tools.fio);
    cmd.args(["--name=lab", "--group_reporting", "--unified_rw_reporting=mixed", "--output-format=json"]);
    cmd.args(["--lat_percentiles=1", "--time_based"]);
    cmd.arg(format!("--rw={}", name(&c.rw)));
    cmd.arg(format!("--bs={}", c.bs));
    cmd.arg(format!("--iodepth={}", c.iodepth));
    cmd.arg(format!("--numjobs={}", c.jobs));
    cmd.arg(format!("--runtime={}ms", (p.seconds * 1000.0) as u64));
    cmd.arg(format!("--ramp_time={}ms", (p.ramp_seconds * 1000.0) as u64));
    cmd.arg(format!("--size={}", setup.run.image_size));
    match image {
        None => {
            cmd.arg("--ioengine=null");
        }
        Some(image) => {
            cmd.arg("--ioengine=io_uring").arg(format!("--filename={}", image.display()));
            cmd.arg(format!("--direct={}", u8::from(direct(c.cache))));
            if writethrough(c.cache) {
                cmd.arg("--sync=dsync");
            }
        }
    }
    let out = Watched::spawn(cmd, setup.dir, "fio")?.finish(deadline(p, BENCH_SLACK), |_| {})?;
    // fio may print warnings before its JSON.
    let json: Value = serde_json::from_str(&out[out.find('{').unwrap_or(0)..]).context("fio's output is not JSON")?;
    fio_figures(&json["jobs"][0])
}

/// The figures of fio's job group, reads and writes together
/// (`unified_rw_reporting=mixed`: fio merges them itself, percentiles too).
fn fio_figures(job: &Value) -> Result<Measured> {
    let mixed = &job["mixed"];
    let lat = &mixed["lat_ns"];
    let us = |ns: f64| ns / 1000.0;
    let percentile =
        |q: &str| lat["percentile"][q].as_f64().map(us).with_context(|| format!("no p{q} in fio's output"));
    anyhow::ensure!(number(mixed, "total_ios")? > 0.0, "fio completed no I/O");
    Ok(Measured {
        iops: number(mixed, "iops")?,
        bw_mib_s: number(mixed, "bw")? / 1024.0,
        lat_us: Latency {
            mean: us(number(lat, "mean")?),
            p50: percentile("50.000000")?,
            p99: percentile("99.000000")?,
            max: us(number(lat, "max")?),
        },
        client_cpu_pct: Some(number(job, "usr_cpu")? + number(job, "sys_cpu")?),
        ..Measured::default()
    })
}

/// fio inside a Linux guest under QEMU, its disk on `daemon`'s socket
/// (vhost-user-blk) or served by QEMU itself from `image`. TCG makes these
/// functional figures; the latency is fio's completion latency (the guest
/// reports no other). The daemon's CPU is counted over the guest's whole
/// life (boot included) and divided by the I/Os fio reported.
pub fn guest(p: &Planned, daemon: Option<&Daemon>, image: Option<&Path>, setup: &Setup) -> Result<Measured> {
    let c = &p.config;
    let script = setup.tools.guest.as_ref().context("scripts/guest/run-guest.sh not found (set VSD_GUEST_SCRIPT)")?;
    let bus = c.bus.unwrap_or(Bus::VhostUserBlk);
    let mut cmd = pinned(&setup.run.client_cpus, script);
    cmd.args(["--job", "bench", "--bus", &name(&bus), "--rw", &name(&c.rw)]);
    cmd.args(["--bs", &c.bs.to_string(), "--iodepth", &c.iodepth.to_string(), "--numjobs", &c.jobs.to_string()]);
    cmd.args(["--queues", &c.queues.to_string(), "--runtime", &(p.seconds.ceil() as u64).to_string()]);
    cmd.args(["--size", &setup.run.image_size.to_string()]);
    cmd.args(["--timeout", &deadline(p, GUEST_SLACK).as_secs().to_string()]);
    match (daemon, image) {
        (Some(daemon), _) => {
            cmd.arg("--socket").arg(&daemon.socket);
        }
        (None, Some(image)) => {
            let format = if c.format == Format::Raw { "raw" } else { "qcow2" };
            let aio = c.engine.map_or("threads", |e| if e == Engine::IoUring { "io_uring" } else { "threads" });
            cmd.arg("--image").arg(image).args(["--format", format, "--aio", aio]);
            cmd.args(["--cache", &name(&c.cache.unwrap_or(CacheMode::Writeback))]);
        }
        (None, None) => bail!("QEMU's own buses serve image files, not null-co"),
    }
    let before = daemon.map(Daemon::cpu_us).transpose()?;
    let out = Watched::spawn(cmd, setup.dir, "guest")?.finish(deadline(p, GUEST_SLACK) + BENCH_SLACK, |_| {})?;
    let fact = |key: &str| -> Result<f64> {
        let prefix = format!("VSD-GUEST {key}=");
        let value = out
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix(&prefix))
            .with_context(|| format!("the guest did not report {key}"))?;
        value.trim().parse().with_context(|| format!("guest fact {key}={value}"))
    };
    let iops = fact("bench_iops")?;
    let daemon_cpu_us = match (daemon, before) {
        (Some(d), Some(before)) => Some(d.cpu_us()? - before),
        _ => None,
    };
    Ok(Measured {
        iops,
        bw_mib_s: fact("bench_bw_kib")? / 1024.0,
        lat_us: Latency {
            mean: fact("bench_lat_mean_us")?,
            p50: fact("bench_lat_p50_us")?,
            p99: fact("bench_lat_p99_us")?,
            max: fact("bench_lat_max_us")?,
        },
        daemon_cpu_pct: None,
        daemon_cpu_us_per_io: daemon_cpu_us.map(|us| us / (iops * p.seconds).max(1.0)),
        client_cpu_pct: None,
        breakdown: None,
    })
}

/// The daemon's CPU time over the measured window (after the ramp).
struct CpuWindow {
    from: Duration,
    to: Duration,
    start: Option<(Instant, f64)>,
    end: Option<(Instant, f64)>,
}

impl CpuWindow {
    fn new(p: &Planned) -> Self {
        let from = Duration::from_secs_f64(p.ramp_seconds);
        Self { from, to: from + Duration::from_secs_f64(p.seconds), start: None, end: None }
    }

    fn tick(&mut self, elapsed: Duration, sample: impl Fn() -> Result<f64>) {
        let take = || sample().ok().map(|us| (Instant::now(), us));
        if self.start.is_none() && elapsed >= self.from {
            self.start = take();
        } else if self.end.is_none() && self.start.is_some() && elapsed >= self.to {
            self.end = take();
        }
    }

    /// CPU microseconds and wall seconds of the window, closing it now if
    /// the driver finished before the window's end.
    fn close(mut self, sample: impl Fn() -> Result<f64>) -> Option<(f64, f64)> {
        if self.end.is_none() {
            self.end = sample().ok().map(|us| (Instant::now(), us));
        }
        let ((t0, cpu0), (t1, cpu1)) = (self.start?, self.end?);
        let secs = (t1 - t0).as_secs_f64();
        (secs > 0.0).then_some((cpu1 - cpu0, secs))
    }
}

fn number(v: &Value, key: &str) -> Result<f64> {
    v[key].as_f64().with_context(|| format!("no number '{key}' in {}", short(v)))
}

fn short(v: &Value) -> String {
    let text = v.to_string();
    text.chars().take(120).collect()
}
