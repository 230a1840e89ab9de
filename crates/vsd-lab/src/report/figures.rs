//! The comparison figures, in the shape of RSD's: for one figure group, a
//! metric of every daemon, clustered by virtqueues and jobs ("mqX-Yjobs").

use std::collections::BTreeSet;

use super::group::{FigureKey, Run, Section, first_appearances, mq_label, series_label, title};
use super::plot::{Bar, BarChart, BarSeries, color};
use super::stats::{Spread, median};
use crate::row::{Measured, Row};

/// Reads a quantity from a run's figures (`None`: the run has none).
type Read = fn(&Measured) -> Option<f64>;

/// A quantity every run measures, and how its figure reads.
struct Metric {
    /// Ends the figure's id.
    slug: &'static str,
    /// What the figure shows.
    what: &'static str,
    y_desc: &'static str,
    /// What the caption adds to the common explanation.
    note: &'static str,
    value: Read,
    /// A second quantity, drawn as a marker on each bar, and its legend entry.
    marker: Option<(&'static str, Read)>,
}

const METRICS: [Metric; 3] = [
    Metric { slug: "iops", what: "IOPS", y_desc: "IOPS", note: "", value: |m| Some(m.iops), marker: None },
    Metric {
        slug: "cpu",
        what: "Daemon CPU usage",
        y_desc: "% of one CPU",
        note: " Runs without a daemon process (the host floor, QEMU's own buses) have no bar.",
        value: |m| m.daemon_cpu_pct,
        marker: None,
    },
    Metric {
        slug: "latency",
        what: "Latency",
        y_desc: "µs",
        note: " The latency is the driver's; ▲ marks its p99 (median over the repetitions).",
        value: |m| Some(m.lat_us.mean),
        marker: Some(("p99", |m| Some(m.lat_us.p99))),
    },
];

/// Every series label of a report ([`series_label`]), in order of first
/// appearance: a daemon keeps its colour in every figure.
pub(crate) struct Daemons(Vec<String>);

impl Daemons {
    pub fn of(rows: &[Row]) -> Self {
        Daemons(first_appearances(rows.iter().map(|row| series_label(&row.config))))
    }

    /// The daemons that ran in `runs`, with their colour indices.
    fn among<'a>(&'a self, runs: &'a [Run]) -> impl Iterator<Item = (usize, &'a str)> {
        let ran = |daemon: &str| runs.iter().any(|run| series_label(run.config()) == daemon);
        self.0.iter().enumerate().filter(move |(_, daemon)| ran(daemon)).map(|(i, daemon)| (i, daemon.as_str()))
    }
}

/// One comparison figure, ready for the page.
pub(crate) struct Comparison {
    /// Ends the figure's id.
    pub slug: &'static str,
    pub caption: String,
    pub chart: BarChart,
}

/// The figures of one group: IOPS, daemon CPU usage (when any daemon has
/// it) and latency.
pub(crate) fn comparisons(section: &Section, key: &FigureKey, runs: &[Run], daemons: &Daemons) -> Vec<Comparison> {
    let axes = title(&key.parts());
    let clusters: BTreeSet<(u32, u32)> = runs.iter().map(|run| (run.config().queues, run.config().jobs)).collect();
    let clusters: Vec<(u32, u32)> = clusters.into_iter().collect();
    METRICS
        .iter()
        .filter_map(|metric| {
            let series: Vec<BarSeries> = daemons
                .among(runs)
                .filter_map(|(index, daemon)| series(metric, daemon, index, &clusters, runs))
                .collect();
            if series.is_empty() {
                return None;
            }
            let caption = format!(
                "{} of each daemon, {axes}, by virtqueues (mqX) and jobs (Yjobs). Bars: median over the \
                 repetitions; whiskers: their lowest to highest.{}",
                metric.what, metric.note
            );
            let chart = BarChart {
                title: section.plot_title(&format!("{} · {axes}", metric.what)),
                y_desc: metric.y_desc.to_owned(),
                clusters: clusters.iter().map(|&(queues, jobs)| mq_label(queues, jobs)).collect(),
                series,
                marker_label: metric.marker.map(|(label, _)| label.to_owned()),
            };
            Some(Comparison { slug: metric.slug, caption: section.caption(&caption), chart })
        })
        .collect()
}

/// One daemon's bars, or `None` when it has no value anywhere.
fn series(metric: &Metric, daemon: &str, index: usize, clusters: &[(u32, u32)], runs: &[Run]) -> Option<BarSeries> {
    let bars: Vec<Option<Bar>> = clusters
        .iter()
        .map(|&(queues, jobs)| {
            let reps: Vec<&Measured> = runs
                .iter()
                .filter(|run| {
                    let config = run.config();
                    series_label(config) == daemon && config.queues == queues && config.jobs == jobs
                })
                .map(|run| run.measured)
                .collect();
            bar(metric, &reps)
        })
        .collect();
    bars.iter().any(Option::is_some).then(|| BarSeries { label: daemon.to_owned(), color: color(index), bars })
}

fn bar(metric: &Metric, reps: &[&Measured]) -> Option<Bar> {
    let spread = Spread::of(reps.iter().filter_map(|m| (metric.value)(m)))?;
    let marker = metric.marker.and_then(|(_, marker)| median(reps.iter().filter_map(|m| marker(m))));
    Some(Bar { spread, marker })
}
