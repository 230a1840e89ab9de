//! Prometheus text exposition, format 0.0.4.

use std::fmt::{Display, Write};

use crate::{ExportSnapshot, HistogramSnapshot, OpKind, OpSnapshot, QueueEvents, QueueSnapshot, Stage};

/// Labels identifying an export.
#[derive(Clone, Copy, Debug)]
pub struct ExportLabel<'a> {
    /// The export's id.
    pub export: &'a str,
    /// The block node it serves.
    pub node: &'a str,
}

/// Upper bounds of the latency histograms' buckets, in nanoseconds (1 µs to 1 s).
const LATENCY_BOUNDS_NS: [u64; 15] = [
    1_000,
    2_000,
    5_000,
    10_000,
    20_000,
    50_000,
    100_000,
    200_000,
    500_000,
    1_000_000,
    2_000_000,
    5_000_000,
    10_000_000,
    100_000_000,
    1_000_000_000,
];

type Field<T> = fn(&T) -> u64;

const OP_COUNTERS: [(&str, &str, Field<OpSnapshot>); 3] = [
    ("vsd_export_ops_total", "Requests completed.", |o| o.ops),
    ("vsd_export_bytes_total", "Bytes transferred.", |o| o.bytes),
    ("vsd_export_errors_total", "Requests completed with an error.", |o| o.failed),
];

const EXPORT_EVENTS: [(&str, &str, &str, Field<QueueEvents>); 2] = [
    ("vsd_export_invalid_total", "counter", "Requests rejected before reaching the I/O engine.", |e| e.invalid),
    ("vsd_export_in_flight", "gauge", "Requests in flight.", |e| e.in_flight),
];

const QUEUE_COUNTERS: [(&str, &str, Field<QueueEvents>); 7] = [
    ("vsd_queue_kicks_total", "Kicks found by the queue's worker.", |e| e.kicks),
    ("vsd_queue_calls_total", "Interrupts signalled to the guest.", |e| e.calls),
    ("vsd_queue_batches_total", "Rounds that took requests from the ring.", |e| e.batches),
    ("vsd_queue_requests_total", "Requests taken from the ring.", |e| e.requests),
    ("vsd_queue_wakeups_total", "Times the worker woke from its wait.", |e| e.wakeups),
    ("vsd_queue_kernel_entries_total", "Kernel entries of the I/O engine.", |e| e.kernel_entries),
    ("vsd_queue_poll_hits_total", "Polling rounds that found work without a kick.", |e| e.poll_hits),
];

/// Renders the statistics of `exports`, each family's samples after its
/// `# HELP` and `# TYPE` lines.
pub fn prometheus(exports: &[(ExportLabel<'_>, &ExportSnapshot)]) -> String {
    let merged: Vec<(String, QueueSnapshot)> =
        exports.iter().map(|(l, s)| (labels(&[("export", l.export), ("node", l.node)]), s.merged())).collect();
    let mut out = Exposition(String::new());

    for (name, help, field) in OP_COUNTERS {
        out.family(name, "counter", help);
        for (export, q) in &merged {
            for kind in OpKind::ALL {
                out.sample(name, &format!("{export},op=\"{}\"", kind.name()), field(q.op(kind)));
            }
        }
    }
    for (name, kind, help, field) in EXPORT_EVENTS {
        out.family(name, kind, help);
        for (export, q) in &merged {
            out.sample(name, export, field(&q.events));
        }
    }

    let name = "vsd_export_latency_seconds";
    out.family(name, "histogram", "Latency from kick noticed to used entry published.");
    for (export, q) in &merged {
        for kind in OpKind::ALL {
            out.histogram(name, &format!("{export},op=\"{}\"", kind.name()), &q.op(kind).latency);
        }
    }

    let name = "vsd_stage_latency_seconds";
    out.family(name, "histogram", "Time requests spend in each stage; total is kick noticed to guest notified.");
    for (export, q) in &merged {
        let stages = Stage::ALL.iter().map(|&s| (s.name(), q.stage(s))).chain([("total", &q.total)]);
        for (stage, h) in stages {
            out.histogram(name, &format!("{export},stage=\"{stage}\""), h);
        }
    }

    for (name, help, field) in QUEUE_COUNTERS {
        out.family(name, "counter", help);
        for (label, snapshot) in exports {
            for (i, q) in snapshot.queues.iter().enumerate() {
                out.sample(name, &format!("{},queue=\"{i}\"", labels(&[("export", label.export)])), field(&q.events));
            }
        }
    }
    out.0
}

/// `name="value"` pairs, comma separated, values escaped.
fn labels(pairs: &[(&str, &str)]) -> String {
    let mut out = String::new();
    for (i, (name, value)) in pairs.iter().enumerate() {
        out += if i == 0 { "" } else { "," };
        out += name;
        out += "=\"";
        for c in value.chars() {
            match c {
                '\\' => out += "\\\\",
                '"' => out += "\\\"",
                '\n' => out += "\\n",
                c => out.push(c),
            }
        }
        out.push('"');
    }
    out
}

struct Exposition(String);

impl Exposition {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        self.line(format_args!("# HELP {name} {help}"));
        self.line(format_args!("# TYPE {name} {kind}"));
    }

    fn sample(&mut self, name: &str, labels: &str, value: impl Display) {
        self.line(format_args!("{name}{{{labels}}} {value}"));
    }

    /// Cumulative buckets at `LATENCY_BOUNDS_NS`, then `+Inf`, sum and count, in seconds.
    fn histogram(&mut self, name: &str, labels: &str, h: &HistogramSnapshot) {
        let bucket = format!("{name}_bucket");
        for bound in LATENCY_BOUNDS_NS {
            self.sample(&bucket, &format!("{labels},le=\"{}\"", seconds(bound)), h.count_le(bound));
        }
        self.sample(&bucket, &format!("{labels},le=\"+Inf\""), h.count());
        self.sample(&format!("{name}_sum"), labels, seconds(h.sum_ns()));
        self.sample(&format!("{name}_count"), labels, h.count());
    }

    fn line(&mut self, line: std::fmt::Arguments<'_>) {
        // Writing to a String cannot fail.
        let _ = writeln!(self.0, "{line}");
    }
}

fn seconds(ns: u64) -> f64 {
    ns as f64 / 1e9
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use super::*;
    use crate::QueueStats;

    fn export(scale: u64) -> ExportSnapshot {
        let queues = (0..2).map(|_| QueueStats::new()).collect::<Vec<_>>();
        for (i, q) in queues.iter().enumerate() {
            let n = scale * (i as u64 + 1);
            for v in [500, 1_500, 7_000, 40_000, 3_000_000, 2_000_000_000] {
                q.op(OpKind::Read).latency.record_n(v, n);
                q.stage(Stage::Complete).record_n(v, n);
            }
            q.op(OpKind::Read).ops.add(6 * n);
            q.kicks.add(n);
            q.in_flight.set(1);
        }
        ExportSnapshot::from_queues(queues.iter().map(QueueStats::snapshot).collect())
    }

    /// Splits `name{labels} value`.
    fn parse_sample(line: &str) -> (&str, &str, f64) {
        let (series, value) = line.rsplit_once(' ').unwrap();
        let (name, labels) = series.split_once('{').unwrap();
        (name, labels.strip_suffix('}').unwrap(), value.parse().unwrap_or_else(|_| panic!("bad value: {line}")))
    }

    #[test]
    fn exposition_is_well_formed() {
        let (a, b) = (export(1), export(10));
        let text = prometheus(&[
            (ExportLabel { export: "disk0", node: "qcow2 \"a\"\\b\n" }, &a),
            (ExportLabel { export: "disk1", node: "raw" }, &b),
        ]);
        let mut types = HashMap::new();
        let mut helps = HashSet::new();
        // Per histogram series (name and labels without le): the last cumulative count.
        let mut last_bucket = HashMap::<String, f64>::new();
        let mut inf = HashMap::<String, f64>::new();
        let mut counts = 0;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                assert!(helps.insert(rest.split(' ').next().unwrap().to_owned()), "duplicate HELP: {line}");
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                assert!(helps.contains(name), "TYPE before HELP: {line}");
                assert!(types.insert(name.to_owned(), kind.to_owned()).is_none(), "duplicate TYPE: {line}");
            } else {
                let (name, labels, value) = parse_sample(line);
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s).filter(|f| types.get(*f).is_some_and(|t| t == "histogram")))
                    .unwrap_or(name);
                assert!(types.contains_key(family), "sample without TYPE: {line}");
                assert!(!labels.contains('\n'));
                if let Some((series, le)) = labels.rsplit_once(",le=") {
                    let key = format!("{name}{{{series}}}");
                    let prev = last_bucket.insert(key.clone(), value).unwrap_or(0.0);
                    assert!(value >= prev, "bucket decreased: {line}");
                    if le == "\"+Inf\"" {
                        inf.insert(key.replace("_bucket{", "_count{"), value);
                    }
                } else if name.ends_with("_count") {
                    assert_eq!(inf.get(&format!("{name}{{{labels}}}")), Some(&value), "+Inf != count: {line}");
                    counts += 1;
                }
            }
        }
        // 2 exports x (4 ops + 5 stages + total).
        assert_eq!(counts, 2 * 10);
        assert!(text.contains(r#"node="qcow2 \"a\"\\b\n""#), "label not escaped");
        for metric in ["vsd_export_ops_total", "vsd_export_in_flight", "vsd_queue_poll_hits_total"] {
            assert!(types.contains_key(metric), "{metric} missing");
        }
    }

    #[test]
    fn figures_add_up() {
        let a = export(1);
        let text = prometheus(&[(ExportLabel { export: "d", node: "n" }, &a)]);
        let value = |series: &str| {
            text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse::<f64>().ok()).unwrap()
        };
        // Queues of scale 1 and 2: 3 of each of the six latencies.
        assert_eq!(value(r#"vsd_export_ops_total{export="d",node="n",op="read"}"#), 18.0);
        assert_eq!(value(r#"vsd_export_in_flight{export="d",node="n"}"#), 2.0);
        assert_eq!(value(r#"vsd_queue_kicks_total{export="d",queue="1"}"#), 2.0);
        let read = r#"vsd_export_latency_seconds_bucket{export="d",node="n",op="read""#;
        assert_eq!(value(&format!(r#"{read},le="0.000001"}}"#)), 3.0);
        assert_eq!(value(&format!(r#"{read},le="0.00001"}}"#)), 9.0);
        assert_eq!(value(&format!(r#"{read},le="1"}}"#)), 15.0);
        assert_eq!(value(&format!(r#"{read},le="+Inf"}}"#)), 18.0);
        let stage = r#"vsd_stage_latency_seconds_count{export="d",node="n",stage="#;
        assert_eq!(value(&format!(r#"{stage}"complete"}}"#)), 18.0);
        assert_eq!(value(&format!(r#"{stage}"pop"}}"#)), 0.0);
        assert_eq!(value(&format!(r#"{stage}"total"}}"#)), 18.0);
        let sum = value(r#"vsd_stage_latency_seconds_sum{export="d",node="n",stage="total"}"#);
        assert!((sum - 3.0 * 2.003_049_0).abs() < 1e-9, "{sum}");
    }
}
