//! A spec's matrices expanded into the runs to make.
//!
//! Each matrix is the product of its axes, then each combination is fitted
//! to what its daemon and driver can do:
//!
//! * an axis that does not apply is dropped (`None`): a `null-co` node has no
//!   cache mode, engine or format other than raw; host fio has no engine of
//!   the daemon's and no queues;
//! * a combination that cannot exist is skipped, with the reason counted:
//!   host fio on a qcow2 image or on `null-co`, vsd-bench with more jobs than queues (it
//!   drives one queue per job), a QEMU-served bus outside a guest matrix, a
//!   daemon other than vsd/qsd behind vhost-user-blk, QEMU's buses on
//!   `null-co`.
//!
//! Combinations that become equal after fitting are run once.

use std::collections::{BTreeMap, HashSet};

use crate::config::{Backend, Bus, CacheMode, Config, Driver, Format, Program, Rw};
use crate::spec::{MatrixSpec, Spec};

/// One configuration to run, with its run settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Planned {
    /// The matrix it came from.
    pub matrix: String,
    /// What to run.
    pub config: Config,
    /// Measured seconds.
    pub seconds: f64,
    /// Warm-up seconds.
    pub ramp_seconds: f64,
    /// Repetitions.
    pub repetitions: u32,
}

/// Every configuration of a spec, and what was left out.
#[derive(Debug, Default)]
pub struct Plan {
    /// In the order they run.
    pub runs: Vec<Planned>,
    /// Combinations left out, counted by reason.
    pub skipped: BTreeMap<&'static str, usize>,
}

impl Plan {
    /// Expands every matrix of `spec`.
    pub fn new(spec: &Spec) -> Plan {
        let mut plan = Plan::default();
        for m in &spec.matrix {
            let mut seen = HashSet::new();
            for combination in combinations(spec, m) {
                match fit(combination) {
                    Ok(config) if seen.insert(config.clone()) => plan.runs.push(Planned {
                        matrix: m.name.clone(),
                        config,
                        seconds: m.seconds.unwrap_or(spec.run.seconds),
                        ramp_seconds: m.ramp_seconds.unwrap_or(spec.run.ramp_seconds),
                        repetitions: m.repetitions.unwrap_or(spec.run.repetitions),
                    }),
                    Ok(_) => {}
                    Err(reason) => *plan.skipped.entry(reason).or_default() += 1,
                }
            }
        }
        plan
    }

    /// Runs to make, repetitions counted.
    pub fn total_runs(&self) -> u64 {
        self.runs.iter().map(|p| u64::from(p.repetitions)).sum()
    }
}

/// The raw product of a matrix's axes, before fitting. The daemons vary
/// fastest: those of one configuration run back to back, so that a slow
/// phase of a noisy machine falls on all of them alike.
fn combinations(spec: &Spec, m: &MatrixSpec) -> Vec<Config> {
    let base = Config {
        daemon: String::new(),
        program: Program::Vsd,
        export_options: String::new(),
        driver: m.driver,
        bus: None,
        backend: Backend::NullCo,
        format: Format::Raw,
        cache: None,
        engine: None,
        queues: 1,
        jobs: 1,
        bs: 4096,
        rw: Rw::Randread,
        iodepth: 1,
    };
    let mut all = vec![base];
    if m.driver == Driver::Guest {
        all = product(all, &m.buses, |c, bus| c.bus = Some(bus));
    }
    all = product(all, &m.backends, |c, backend| c.backend = backend);
    all = product(all, &m.formats, |c, format| c.format = format);
    all = product(all, &m.cache, |c, cache| c.cache = Some(cache));
    all = product(all, &m.engines, |c, engine| c.engine = Some(engine));
    all = product(all, &m.queue_job_pairs(), |c, (queues, jobs)| (c.queues, c.jobs) = (queues, jobs));
    all = product(all, &m.bs, |c, bs| c.bs = bs);
    all = product(all, &m.rw, |c, rw| c.rw = rw);
    all = product(all, &m.iodepth, |c, iodepth| c.iodepth = iodepth);
    let daemons: Vec<(&String, Program, &str)> = m
        .daemons
        .iter()
        .map(|daemon| {
            let (program, export_options) = spec.program(daemon).expect("daemons are checked when the spec loads");
            (daemon, program, export_options)
        })
        .collect();
    product(all, &daemons, |c, (daemon, program, export_options)| {
        (c.daemon, c.program, c.export_options) = (daemon.clone(), program, export_options.to_owned())
    })
}

/// Every config of `configs` once with each of `values`.
fn product<T: Copy>(configs: Vec<Config>, values: &[T], set: impl Fn(&mut Config, T)) -> Vec<Config> {
    let mut out = Vec::with_capacity(configs.len() * values.len());
    for config in configs {
        for &value in values {
            let mut c = config.clone();
            set(&mut c, value);
            out.push(c);
        }
    }
    out
}

/// Drops the axes a combination ignores, or says why it cannot run.
fn fit(mut c: Config) -> Result<Config, &'static str> {
    if c.backend == Backend::NullCo {
        if c.format != Format::Raw {
            return Err("null-co has no image format");
        }
        c.cache = None;
        c.engine = None;
    }
    match (c.program, c.driver) {
        (Program::Fio, Driver::Bench) => {
            if c.format != Format::Raw {
                return Err("host fio reads files, not qcow2 images");
            }
            if c.backend == Backend::NullCo {
                // fio's null engine does no I/O at all: no floor for a daemon.
                return Err("host fio has no null-co to compare with");
            }
            c.driver = Driver::Fio;
            c.engine = None;
            c.queues = 1;
        }
        (Program::Fio, _) => return Err("host fio is not a guest's back-end"),
        (Program::Qemu, Driver::Bench) => return Err("QEMU's own buses need a guest"),
        (Program::Qemu, _) if c.backend == Backend::NullCo => return Err("QEMU's buses here serve image files"),
        (Program::Vsd | Program::Qsd, Driver::Bench) if c.jobs > c.queues => {
            return Err("vsd-bench drives one queue per job");
        }
        _ => {}
    }
    match (c.program, c.bus) {
        (Program::Vsd | Program::Qsd, Some(bus)) if bus != Bus::VhostUserBlk => {
            return Err("vsd and qsd serve vhost-user-blk only");
        }
        (Program::Qemu, Some(Bus::VhostUserBlk)) => return Err("vhost-user-blk needs a daemon"),
        (Program::Qemu, Some(Bus::Ide)) => c.queues = 1,
        _ => {}
    }
    Ok(c)
}

/// Whether the cache mode opens the file with O_DIRECT.
pub fn direct(cache: Option<CacheMode>) -> bool {
    matches!(cache, Some(CacheMode::None | CacheMode::Directsync))
}

/// Whether every write is synchronous (the guest-visible write cache is off).
pub fn writethrough(cache: Option<CacheMode>) -> bool {
    matches!(cache, Some(CacheMode::Writethrough | CacheMode::Directsync))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(matrix: &str) -> Plan {
        let text = format!("name = \"t\"\n[[matrix]]\nname = \"m\"\n{matrix}");
        Plan::new(&Spec::parse(&text).unwrap())
    }

    #[test]
    fn axes_that_do_not_apply_collapse() {
        let p = plan(
            r#"daemons = ["vsd", "fio"]
               backends = ["null-co", "tmpfs"]
               formats = ["raw", "qcow2"]
               cache = ["none", "writeback"]
               engines = ["io_uring", "threads"]
               queues-jobs = [[1, 1], [2, 2]]
               bs = ["4k"]
               rw = ["randread"]
               iodepth = [1]"#,
        );
        let ids: Vec<String> = p.runs.iter().map(|r| r.config.id()).collect();
        // vsd: null-co (2 pairs) + tmpfs (2 formats x 2 caches x 2 engines x 2 pairs).
        // fio: queues fixed at 1, so per job count: tmpfs raw x 2 caches.
        assert_eq!(p.runs.len(), 2 + 16 + 2 * 2, "{ids:#?}");
        assert!(ids.contains(&"vsd/null-co/raw/-/-/mq2-2jobs/4k/randread/qd1".to_string()));
        assert!(ids.contains(&"fio/tmpfs/raw/none/-/mq1-1jobs/4k/randread/qd1".to_string()));
        assert!(!ids.iter().any(|id| id.starts_with("fio/tmpfs/qcow2")));
        // Per daemon: qcow2 x 2 caches x 2 engines x 2 pairs.
        assert_eq!(p.skipped["null-co has no image format"], 2 * 8);
        assert_eq!(p.skipped["host fio reads files, not qcow2 images"], 8);
        assert_eq!(p.skipped["host fio has no null-co to compare with"], 2 * 2 * 2);
        assert_eq!(p.total_runs(), 22 * 3);
    }

    #[test]
    fn guest_matrices_pair_buses_with_their_servers() {
        let p = plan(
            r#"driver = "guest"
               daemons = ["vsd", "qemu", "fio"]
               buses = ["vhost-user-blk", "virtio-blk", "ide"]
               backends = ["tmpfs"]
               queues-jobs = [[2, 4]]
               bs = ["4k"]
               rw = ["randrw"]
               iodepth = [4]"#,
        );
        let ids: Vec<String> = p.runs.iter().map(|r| r.config.id()).collect();
        assert_eq!(
            ids,
            [
                "vsd/vhost-user-blk/tmpfs/raw/writeback/io_uring/mq2-4jobs/4k/randrw/qd4",
                "qemu/virtio-blk/tmpfs/raw/writeback/io_uring/mq2-4jobs/4k/randrw/qd4",
                "qemu/ide/tmpfs/raw/writeback/io_uring/mq1-4jobs/4k/randrw/qd4",
            ]
        );
        assert_eq!(p.skipped["host fio is not a guest's back-end"], 3);
    }

    #[test]
    fn bench_needs_a_queue_per_job() {
        let p = plan(
            r#"daemons = ["qsd"]
               backends = ["tmpfs"]
               queues = [1, 2]
               jobs = [1, 2]
               bs = ["4k"]
               rw = ["randread"]
               iodepth = [1]"#,
        );
        assert_eq!(p.runs.len(), 3);
        assert_eq!(p.skipped["vsd-bench drives one queue per job"], 1);
    }
}
