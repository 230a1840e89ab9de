//! Plain-text tables for `vsd stat` and `vsd-bench --breakdown`.

use std::fmt::Write;

use crate::{HistogramSnapshot, QueueSnapshot, Stage};

/// Where each stage's time goes, after the classic virtualization-latency
/// breakdown: one row per stage and a total row, with the mean, the running
/// sum of means, the share of the total mean, p50 and p99, in microseconds.
pub fn stage_table(s: &QueueSnapshot) -> String {
    let total_ns = s.total.mean_ns();
    let mut cumulative_ns = 0.0;
    let mut rows: Vec<_> = Stage::ALL
        .iter()
        .map(|&stage| {
            let h = s.stage(stage);
            cumulative_ns += h.mean_ns();
            stage_row(stage.label(), h, cumulative_ns, total_ns)
        })
        .collect();
    rows.push(stage_row("total (kick -> call)", &s.total, total_ns, total_ns));
    table(["stage", "requests", "mean (µs)", "cumulative (µs)", "share (%)", "p50 (µs)", "p99 (µs)"], &rows)
}

fn stage_row(label: &str, h: &HistogramSnapshot, cumulative_ns: f64, total_ns: f64) -> [String; 7] {
    let mut row = [
        label.to_owned(),
        h.count().to_string(),
        micros(h.mean_ns()),
        micros(cumulative_ns),
        ratio(100.0 * h.mean_ns(), total_ns),
        micros(h.quantile_ns(0.5) as f64),
        micros(h.quantile_ns(0.99) as f64),
    ];
    if h.count() == 0 {
        // No request went through this stage: its figures would be made up.
        row[2..].fill("-".to_owned());
    }
    row
}

/// How much the queue's events cost per request: kicks, interrupts, kernel
/// entries, wake-ups and poll hits per I/O, and requests per batch.
pub fn events_table(s: &QueueSnapshot) -> String {
    let e = &s.events;
    let per_io = |label: &str, n: u64| [label.to_owned(), n.to_string(), ratio(n as f64, e.requests as f64)];
    let absolute = |label: &str, n: u64| [label.to_owned(), n.to_string(), "-".to_owned()];
    let rows = [
        absolute("requests", e.requests),
        per_io("kicks", e.kicks),
        per_io("calls", e.calls),
        per_io("io_uring_enter", e.kernel_entries),
        per_io("wakeups", e.wakeups),
        per_io("poll hits", e.poll_hits),
        per_io("batches", e.batches),
        per_io("invalid", e.invalid),
        absolute("in flight", e.in_flight),
    ];
    let mut out = table(["event", "count", "per I/O"], &rows);
    let _ = writeln!(out, "requests per batch: {}", ratio(e.requests as f64, e.batches as f64));
    out
}

fn micros(ns: f64) -> String {
    format!("{:.2}", ns / 1000.0)
}

/// `n / d` with two decimals, or "-" when `d` is zero.
fn ratio(n: f64, d: f64) -> String {
    if d == 0.0 { "-".to_owned() } else { format!("{:.2}", n / d) }
}

/// Aligns `rows` under `header`: labels to the left, figures to the right.
fn table<const N: usize>(header: [&str; N], rows: &[[String; N]]) -> String {
    let mut widths = header.map(|h| h.chars().count());
    for row in rows {
        widths.iter_mut().zip(row).for_each(|(w, cell)| *w = (*w).max(cell.chars().count()));
    }
    let mut out = String::new();
    for row in std::iter::once(header.map(str::to_owned)).chain(rows.iter().cloned()) {
        for (i, (cell, width)) in row.iter().zip(widths).enumerate() {
            // Writing to a String cannot fail.
            let _ = if i == 0 { write!(out, "{cell:<width$}") } else { write!(out, "  {cell:>width$}") };
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::OpKind;
    use crate::QueueStats;

    /// Stage i takes (i + 1) µs, 10 requests each; the total is their sum.
    /// Quantiles show the upper bounds of the buckets: 1007, 3007, 5119 and 15103 ns.
    fn constructed() -> QueueSnapshot {
        let q = QueueStats::new();
        for stage in Stage::ALL {
            q.stage(stage).record_n(1000 * (stage.index() as u64 + 1), 10);
        }
        q.op(OpKind::Read).latency.record_n(15_000, 10);
        q.requests.add(10);
        q.kicks.add(5);
        q.batches.add(4);
        q.snapshot()
    }

    fn row<'a>(table: &'a str, label: &str) -> Vec<&'a str> {
        let line = table.lines().find(|l| l.starts_with(label)).unwrap_or_else(|| panic!("no {label} row"));
        line[label.len()..].split_whitespace().collect()
    }

    #[test]
    fn stage_table_shows_cumulative_means() {
        let t = stage_table(&constructed());
        for stage in Stage::ALL {
            assert!(t.contains(stage.label()), "{t}");
        }
        assert_eq!(row(&t, "kick -> pop"), ["10", "1.00", "1.00", "6.67", "1.01", "1.01"]);
        assert_eq!(row(&t, "submit -> complete"), ["10", "3.00", "6.00", "20.00", "3.01", "3.01"]);
        assert_eq!(row(&t, "used -> call"), ["10", "5.00", "15.00", "33.33", "5.12", "5.12"]);
        assert_eq!(row(&t, "total (kick -> call)"), ["10", "15.00", "15.00", "100.00", "15.10", "15.10"]);
        let widths: Vec<usize> = t.lines().map(|l| l.chars().count()).collect();
        assert!(widths.windows(2).all(|w| w[0] == w[1]), "misaligned:\n{t}");
    }

    #[test]
    fn events_table_shows_rates() {
        let t = events_table(&constructed());
        assert_eq!(row(&t, "kicks"), ["5", "0.50"]);
        assert_eq!(row(&t, "batches"), ["4", "0.40"]);
        assert_eq!(row(&t, "requests per batch:"), ["2.50"]);
    }

    #[test]
    fn empty_snapshot_has_no_nan() {
        let empty = QueueSnapshot::default();
        for t in [stage_table(&empty), events_table(&empty)] {
            assert!(!t.contains("NaN") && !t.contains("inf"), "{t}");
            assert!(t.contains('-'));
        }
        assert_eq!(row(&stage_table(&empty), "kick -> pop"), ["0", "-", "-", "-", "-", "-"]);
    }
}
