//! Which runs go together: the report's sections and figures, and their names.

use std::collections::BTreeSet;

use crate::config::{Backend, CacheMode, Config, Driver, Engine, Format, Rw, name, size_label};
use crate::row::{Measured, Row};

/// What guest figures say about themselves wherever they appear.
pub(crate) const GUEST_NOTE: &str = "Guest under QEMU TCG: functional figures, not performance";

/// A run that measured something (failed runs are listed, never plotted).
#[derive(Clone, Copy)]
pub(crate) struct Run<'a> {
    pub row: &'a Row,
    pub measured: &'a Measured,
}

impl<'a> Run<'a> {
    /// The successful runs of `rows`, in file order.
    pub fn all(rows: &'a [Row]) -> Vec<Run<'a>> {
        rows.iter().filter_map(|row| Some(Run { row, measured: row.result.as_ref()? })).collect()
    }

    pub fn config(&self) -> &'a Config {
        &self.row.config
    }
}

/// Where the I/O was driven from. Guest runs under TCG say nothing about
/// performance, so they never share a figure with host runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Placement {
    Host,
    Guest,
}

impl Placement {
    fn of(config: &Config) -> Self {
        if config.driver == Driver::Guest { Placement::Guest } else { Placement::Host }
    }
}

/// The runs of one matrix from one placement: a section of the report.
pub(crate) struct Section<'a> {
    pub matrix: &'a str,
    pub placement: Placement,
    pub runs: Vec<Run<'a>>,
}

impl Section<'_> {
    /// The prefix of every id in the section.
    pub fn id(&self) -> String {
        let placement = match self.placement {
            Placement::Host => "host",
            Placement::Guest => "guest",
        };
        slug(&format!("{}-{placement}", self.matrix))
    }

    pub fn is_guest(&self) -> bool {
        self.placement == Placement::Guest
    }

    pub fn heading(&self) -> String {
        match self.placement {
            Placement::Host => format!("Matrix {}", self.matrix),
            Placement::Guest => format!("Matrix {}: guest runs", self.matrix),
        }
    }

    /// A plot's own title, marked in a guest section: an SVG file may travel alone.
    pub fn plot_title(&self, title: &str) -> String {
        if self.is_guest() { format!("{title} (guest, TCG)") } else { title.to_owned() }
    }

    /// A caption, led by the guest note in a guest section.
    pub fn caption(&self, text: &str) -> String {
        if self.is_guest() { format!("{GUEST_NOTE}. {text}") } else { text.to_owned() }
    }
}

/// The sections of `runs`: matrices in order of appearance, every host
/// section before the guest ones.
pub(crate) fn sections<'a>(runs: &[Run<'a>]) -> Vec<Section<'a>> {
    let keyed = runs.iter().map(|run| ((run.row.matrix.as_str(), Placement::of(run.config())), *run));
    let mut sections: Vec<Section<'a>> =
        grouped(keyed).into_iter().map(|((matrix, placement), runs)| Section { matrix, placement, runs }).collect();
    sections.sort_by_key(|section| section.placement);
    sections
}

/// What a run is called in a figure's legend: its daemon, and in a guest
/// its bus too, so that buses are compared side by side ("qemu · ide").
pub(crate) fn series_label(config: &Config) -> String {
    match config.bus {
        Some(bus) => format!("{} · {}", config.daemon, name(&bus)),
        None => config.daemon.clone(),
    }
}

/// The axes one comparison figure holds fixed: every axis but those it
/// compares (daemon and bus, queues, jobs) and the driver (its section
/// fixes the placement, and host drivers differ only by daemon: fio is the
/// floor).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct FigureKey {
    backend: Backend,
    format: Format,
    cache: Option<CacheMode>,
    engine: Option<Engine>,
    bs: u64,
    rw: Rw,
    iodepth: u32,
}

impl FigureKey {
    fn of(config: &Config) -> Self {
        let Config { backend, format, cache, engine, bs, rw, iodepth, .. } = *config;
        FigureKey { backend, format, cache, engine, bs, rw, iodepth }
    }

    /// Whether a run with this key belongs in the figure of `other`. An axis
    /// that does not apply to the run (`None`) matches any value, so the host
    /// floor, which has no engine, is drawn beside every engine's daemons.
    fn covers(&self, other: &FigureKey) -> bool {
        fn matches<T: PartialEq>(mine: Option<T>, theirs: Option<T>) -> bool {
            mine.is_none() || mine == theirs
        }
        matches(self.cache, other.cache)
            && matches(self.engine, other.engine)
            && FigureKey { cache: other.cache, engine: other.engine, ..self.clone() } == *other
    }

    /// The values of the axes, for titles and ids.
    pub fn parts(&self) -> Vec<String> {
        [
            Some(name(&self.backend)),
            Some(name(&self.format)),
            self.cache.map(|cache| name(&cache)),
            self.engine.map(|engine| name(&engine)),
            Some(size_label(self.bs)),
            Some(name(&self.rw)),
            Some(format!("qd{}", self.iodepth)),
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}

/// The comparison figures of `runs`, one per distinct key, each with every
/// run its key covers. A key covering another makes no figure of its own.
pub(crate) fn figure_groups<'a>(runs: &[Run<'a>]) -> Vec<(FigureKey, Vec<Run<'a>>)> {
    let keys: BTreeSet<FigureKey> = runs.iter().map(|run| FigureKey::of(run.config())).collect();
    keys.iter()
        .filter(|key| !keys.iter().any(|other| other != *key && key.covers(other)))
        .map(|key| {
            let members = runs.iter().filter(|run| FigureKey::of(run.config()).covers(key)).copied().collect();
            (key.clone(), members)
        })
        .collect()
}

/// The values of `pairs` grouped by key, keys in order of first appearance.
pub(crate) fn grouped<K: PartialEq, V>(pairs: impl IntoIterator<Item = (K, V)>) -> Vec<(K, Vec<V>)> {
    let mut groups: Vec<(K, Vec<V>)> = Vec::new();
    for (key, value) in pairs {
        match groups.iter_mut().find(|(known, _)| *known == key) {
            Some((_, values)) => values.push(value),
            None => groups.push((key, vec![value])),
        }
    }
    groups
}

/// `items` in order of first appearance, each once.
pub(crate) fn first_appearances<T: PartialEq>(items: impl IntoIterator<Item = T>) -> Vec<T> {
    let mut unique = Vec::new();
    for item in items {
        if !unique.contains(&item) {
            unique.push(item);
        }
    }
    unique
}

/// "mq2-1jobs": the virtqueues and jobs of a configuration, as RSD's figures name them.
pub(crate) fn mq_label(queues: u32, jobs: u32) -> String {
    format!("mq{queues}-{jobs}jobs")
}

/// Axis values joined for a human: "tmpfs · raw · 4k · randread".
pub(crate) fn title(parts: &[String]) -> String {
    parts.join(" · ")
}

/// `text` as an HTML id and file name: lower-case letters, digits, `_` and `-`.
pub(crate) fn slug(text: &str) -> String {
    text.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c.to_ascii_lowercase() } else { '-' }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Program;

    fn config(daemon: &str, engine: Option<Engine>) -> Config {
        Config {
            daemon: daemon.into(),
            program: Program::Vsd,
            export_options: String::new(),
            driver: Driver::Bench,
            bus: None,
            backend: Backend::Tmpfs,
            format: Format::Raw,
            cache: Some(CacheMode::Writeback),
            engine,
            queues: 1,
            jobs: 1,
            bs: 4096,
            rw: Rw::Randread,
            iodepth: 32,
        }
    }

    #[test]
    fn axes_that_do_not_apply_match_any_value() {
        let floor = FigureKey::of(&config("fio", None));
        let uring = FigureKey::of(&config("vsd", Some(Engine::IoUring)));
        let threads = FigureKey::of(&config("vsd", Some(Engine::Threads)));
        assert!(floor.covers(&uring) && floor.covers(&threads) && uring.covers(&uring));
        assert!(!uring.covers(&floor) && !uring.covers(&threads));
        assert_eq!(uring.parts().join("-"), "tmpfs-raw-writeback-io_uring-4k-randread-qd32");
    }

    #[test]
    fn slugs_keep_only_safe_characters() {
        assert_eq!(slug("Big matrix/1 · x"), "big-matrix-1---x");
    }
}
