//! Lab specs: a small TOML file naming the matrices to run.
//!
//! ```toml
//! name = "quick"
//! description = "A 2-minute smoke run"
//!
//! [run]                     # every key optional; defaults below
//! seconds = 5               # measured seconds per run
//! ramp-seconds = 1          # warm-up before measuring
//! repetitions = 3
//! image-size = "1G"
//! fill-images = true        # images hold data (else fresh, as a new VM disk)
//! daemon-cpus = "0"         # taskset list for the daemon ("" = not pinned)
//! client-cpus = "1"         # and for the driver
//! tmpfs-dir = "/dev/shm"
//! disk-dir = "/var/tmp"
//!
//! [variants.vsd-nopoll]     # a daemon under another name, with export options
//! program = "vsd"
//! export-options = "poll-us=0"
//!
//! [[matrix]]
//! name = "mq"
//! driver = "bench"          # bench (vsd-bench) or guest (fio in a QEMU guest)
//! daemons = ["vsd", "qsd", "fio"]
//! backends = ["null-co", "tmpfs"]
//! formats = ["raw"]
//! cache = ["writeback"]
//! engines = ["io_uring"]
//! queues-jobs = [[1, 1], [2, 2]]   # or: queues = [1, 2] and jobs = [1, 2]
//! bs = ["4k", "64k"]
//! rw = ["randread"]
//! iodepth = [1, 32]
//! buses = ["vhost-user-blk"]       # guest matrices only
//! ```
//!
//! A matrix may override `seconds`, `ramp-seconds` and `repetitions`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Deserializer};

use crate::config::{Backend, Bus, CacheMode, Driver, Engine, Format, Program, Rw};

/// A parsed spec.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Spec {
    /// Names the results file and the report.
    pub name: String,
    /// What the spec reproduces, for the report.
    #[serde(default)]
    pub description: String,
    /// Settings shared by every matrix.
    #[serde(default)]
    pub run: RunSettings,
    /// Daemons under other names, with their own export options.
    #[serde(default)]
    pub variants: BTreeMap<String, Variant>,
    /// The matrices, run in order.
    pub matrix: Vec<MatrixSpec>,
}

/// Settings of every run.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case", default)]
pub struct RunSettings {
    /// Measured seconds per run.
    pub seconds: f64,
    /// Warm-up seconds before measuring.
    pub ramp_seconds: f64,
    /// Runs of each configuration.
    pub repetitions: u32,
    /// Size of every image (and of `null-co` nodes).
    #[serde(deserialize_with = "size")]
    pub image_size: u64,
    /// Whether images hold data: raw images are filled with random bytes
    /// and qcow2 images converted from them, so reads read. Otherwise images
    /// are fresh, as a new VM's disk, and writes allocate.
    pub fill_images: bool,
    /// CPUs for the daemon (`taskset -c`), "" for none.
    pub daemon_cpus: String,
    /// CPUs for the driver (vsd-bench, host fio, or QEMU).
    pub client_cpus: String,
    /// Where `tmpfs` images go.
    pub tmpfs_dir: PathBuf,
    /// Where `disk` images go.
    pub disk_dir: PathBuf,
}

impl Default for RunSettings {
    fn default() -> Self {
        Self {
            seconds: 5.0,
            ramp_seconds: 1.0,
            repetitions: 3,
            image_size: 1 << 30,
            fill_images: true,
            daemon_cpus: "0".into(),
            client_cpus: "1".into(),
            tmpfs_dir: "/dev/shm".into(),
            disk_dir: "/var/tmp".into(),
        }
    }
}

/// A daemon under another name.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Variant {
    /// `vsd` or `qsd`.
    pub program: Program,
    /// Appended to the export's options, e.g. "poll-us=0".
    #[serde(default)]
    pub export_options: String,
}

/// One matrix: the product of its axes.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct MatrixSpec {
    /// Its name in results and the report.
    pub name: String,
    /// `bench` (default) or `guest`.
    #[serde(default = "default_driver")]
    pub driver: Driver,
    /// Daemon names: `vsd`, `qsd`, `fio` (the host floor), `qemu` (QEMU's
    /// own block layer, guest matrices), or a variant's name.
    pub daemons: Vec<String>,
    /// Where images live.
    pub backends: Vec<Backend>,
    /// Image formats (default raw).
    #[serde(default = "default_formats")]
    pub formats: Vec<Format>,
    /// Cache modes (default writeback).
    #[serde(default = "default_cache")]
    pub cache: Vec<CacheMode>,
    /// I/O engines (default io_uring).
    #[serde(default = "default_engines")]
    pub engines: Vec<Engine>,
    /// Explicit (queues, jobs) pairs; else `queues` x `jobs`.
    #[serde(default)]
    pub queues_jobs: Vec<(u32, u32)>,
    /// Device queues (default 1).
    #[serde(default = "one")]
    pub queues: Vec<u32>,
    /// Jobs (default 1).
    #[serde(default = "one")]
    pub jobs: Vec<u32>,
    /// Block sizes.
    #[serde(deserialize_with = "sizes")]
    pub bs: Vec<u64>,
    /// Access patterns.
    pub rw: Vec<Rw>,
    /// Requests in flight per job.
    pub iodepth: Vec<u32>,
    /// Guest buses (guest matrices only; default vhost-user-blk).
    #[serde(default = "default_buses")]
    pub buses: Vec<Bus>,
    /// Overrides [`RunSettings::seconds`].
    pub seconds: Option<f64>,
    /// Overrides [`RunSettings::ramp_seconds`].
    pub ramp_seconds: Option<f64>,
    /// Overrides [`RunSettings::repetitions`].
    pub repetitions: Option<u32>,
}

impl MatrixSpec {
    /// The (queues, jobs) pairs the matrix covers.
    pub fn queue_job_pairs(&self) -> Vec<(u32, u32)> {
        if !self.queues_jobs.is_empty() {
            return self.queues_jobs.clone();
        }
        self.queues.iter().flat_map(|&q| self.jobs.iter().map(move |&j| (q, j))).collect()
    }
}

impl Spec {
    /// Reads and checks a spec file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read '{}'", path.display()))?;
        Self::parse(&text).with_context(|| format!("spec '{}'", path.display()))
    }

    /// Parses and checks a spec.
    pub fn parse(text: &str) -> Result<Self> {
        let spec: Spec = toml::from_str(text)?;
        spec.check()?;
        Ok(spec)
    }

    /// Keeps only the matrices named (all of them if `names` is empty).
    pub fn keep_matrices(&mut self, names: &[String]) -> Result<()> {
        if let Some(unknown) = names.iter().find(|n| !self.matrix.iter().any(|m| m.name == **n)) {
            let known: Vec<&str> = self.matrix.iter().map(|m| m.name.as_str()).collect();
            bail!("spec '{}' has no matrix '{unknown}' (it has: {})", self.name, known.join(", "));
        }
        if !names.is_empty() {
            self.matrix.retain(|m| names.contains(&m.name));
        }
        Ok(())
    }

    /// The program behind a daemon name.
    pub fn program(&self, daemon: &str) -> Option<(Program, &str)> {
        if let Some(v) = self.variants.get(daemon) {
            return Some((v.program, &v.export_options));
        }
        let program = serde_json::from_value(serde_json::Value::String(daemon.into())).ok()?;
        Some((program, ""))
    }

    fn check(&self) -> Result<()> {
        let r = &self.run;
        if !(r.seconds > 0.0 && r.ramp_seconds >= 0.0) {
            bail!("run.seconds must be > 0 and run.ramp-seconds >= 0");
        }
        if r.repetitions == 0 || r.image_size == 0 {
            bail!("run.repetitions and run.image-size must be > 0");
        }
        for (name, v) in &self.variants {
            if !matches!(v.program, Program::Vsd | Program::Qsd) {
                bail!("variant '{name}': program must be vsd or qsd");
            }
        }
        let mut names = std::collections::HashSet::new();
        for m in &self.matrix {
            if !names.insert(&m.name) {
                bail!("two matrices are named '{}'", m.name);
            }
            self.check_matrix(m).with_context(|| format!("matrix '{}'", m.name))?;
        }
        if self.matrix.is_empty() {
            bail!("no [[matrix]]");
        }
        Ok(())
    }

    fn check_matrix(&self, m: &MatrixSpec) -> Result<()> {
        if let Some(d) = m.daemons.iter().find(|d| self.program(d).is_none()) {
            bail!("unknown daemon '{d}' (vsd, qsd, fio, qemu or a [variants] name)");
        }
        let axes = [
            ("daemons", m.daemons.len()),
            ("backends", m.backends.len()),
            ("formats", m.formats.len()),
            ("cache", m.cache.len()),
            ("engines", m.engines.len()),
            ("queues x jobs", m.queue_job_pairs().len()),
            ("bs", m.bs.len()),
            ("rw", m.rw.len()),
            ("iodepth", m.iodepth.len()),
            ("buses", m.buses.len()),
        ];
        if let Some((axis, _)) = axes.iter().find(|(_, n)| *n == 0) {
            bail!("'{axis}' is empty");
        }
        if m.queue_job_pairs().iter().any(|&(q, j)| q == 0 || j == 0) || m.iodepth.contains(&0) {
            bail!("queues, jobs and iodepth must be >= 1");
        }
        if m.bs.iter().any(|bs| *bs == 0 || !bs.is_multiple_of(512)) {
            bail!("block sizes must be multiples of 512");
        }
        if m.seconds.is_some_and(|s| s <= 0.0) || m.repetitions == Some(0) {
            bail!("seconds and repetitions must be > 0");
        }
        if m.driver == Driver::Fio {
            bail!("driver must be bench or guest (fio on the host is the daemon 'fio')");
        }
        Ok(())
    }
}

fn default_driver() -> Driver {
    Driver::Bench
}
fn default_formats() -> Vec<Format> {
    vec![Format::Raw]
}
fn default_cache() -> Vec<CacheMode> {
    vec![CacheMode::Writeback]
}
fn default_engines() -> Vec<Engine> {
    vec![Engine::IoUring]
}
fn default_buses() -> Vec<Bus> {
    vec![Bus::VhostUserBlk]
}
fn one() -> Vec<u32> {
    vec![1]
}

/// A size as a number of bytes or a string with a suffix ("4k").
#[derive(Deserialize)]
#[serde(untagged)]
enum Size {
    Bytes(u64),
    Text(String),
}

impl Size {
    fn bytes<E: serde::de::Error>(self) -> Result<u64, E> {
        match self {
            Size::Bytes(n) => Ok(n),
            Size::Text(t) => vsd_sys::size::parse_size(&t).map_err(E::custom),
        }
    }
}

fn size<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    Size::deserialize(d)?.bytes()
}

fn sizes<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u64>, D::Error> {
    Vec::<Size>::deserialize(d)?.into_iter().map(Size::bytes).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
        name = "t"
        [[matrix]]
        name = "m"
        daemons = ["vsd", "fast"]
        backends = ["tmpfs"]
        bs = ["4k", 65536]
        rw = ["randread"]
        iodepth = [1]
        [variants.fast]
        program = "vsd"
        export-options = "poll-us=0"
    "#;

    #[test]
    fn defaults_fill_what_a_spec_leaves_out() {
        let spec = Spec::parse(MINIMAL).unwrap();
        let m = &spec.matrix[0];
        assert_eq!(m.bs, [4096, 65536]);
        assert_eq!(m.formats, [Format::Raw]);
        assert_eq!(m.queue_job_pairs(), [(1, 1)]);
        assert_eq!(spec.run.repetitions, 3);
        assert_eq!(spec.program("fast"), Some((Program::Vsd, "poll-us=0")));
        assert_eq!(spec.program("fio"), Some((Program::Fio, "")));
    }

    #[test]
    fn mistakes_are_named() {
        let cases = [
            (MINIMAL.replace("\"fast\"]", "\"spdk\"]"), "unknown daemon 'spdk'"),
            (MINIMAL.replace("iodepth = [1]", "iodepth = []"), "'iodepth' is empty"),
            (MINIMAL.replace("65536", "\"4q\""), "unknown suffix"),
            (MINIMAL.replace("rw = ", "rws = "), "unknown field `rws`"),
            (MINIMAL.replace("65536", "1000"), "multiples of 512"),
        ];
        for (text, want) in cases {
            let err = format!("{:#}", Spec::parse(&text).unwrap_err());
            assert!(err.contains(want), "{want:?} not in {err:?}");
        }
    }

    #[test]
    fn matrices_can_be_picked() {
        let mut spec = Spec::parse(MINIMAL).unwrap();
        let err = spec.keep_matrices(&["x".into()]).unwrap_err().to_string();
        assert!(err.contains("no matrix 'x' (it has: m)"), "{err}");
        spec.keep_matrices(&[]).unwrap();
        assert_eq!(spec.matrix.len(), 1);
    }

    #[test]
    fn queues_times_jobs_unless_pairs_are_given() {
        let text = MINIMAL.replace("iodepth = [1]", "iodepth = [1]\nqueues = [1, 2]\njobs = [1, 2]");
        assert_eq!(Spec::parse(&text).unwrap().matrix[0].queue_job_pairs(), [(1, 1), (1, 2), (2, 1), (2, 2)]);
        let text = MINIMAL.replace("iodepth = [1]", "iodepth = [1]\nqueues-jobs = [[2, 1], [4, 4]]");
        assert_eq!(Spec::parse(&text).unwrap().matrix[0].queue_job_pairs(), [(2, 1), (4, 4)]);
    }
}
