//! `--breakdown`: the daemon's own account of a run, asked over QMP, set
//! beside the latency the client measured: how much of what the guest (here
//! the client) waits for is spent inside the daemon, and in which stage.

use std::fmt::Write;
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::{Value, json};
use vsd_control::client::QmpClient;
use vsd_trace::{ExportSnapshot, QueueSnapshot};

/// Every export's statistics when the run began.
pub struct Breakdown {
    qmp: QmpClient,
    baseline: Vec<(String, QueueSnapshot)>,
}

/// What one export did during the run.
#[derive(Debug, Serialize)]
pub struct ExportBreakdown {
    /// The export's id.
    pub export: String,
    /// Its queues' statistics summed, counting only the run.
    pub stats: QueueSnapshot,
}

impl Breakdown {
    /// Connects to the daemon's QMP socket and notes where every export is.
    pub fn start(qmp: &Path) -> Result<Self> {
        let mut qmp = QmpClient::connect(qmp).with_context(|| format!("cannot reach QMP at '{}'", qmp.display()))?;
        let baseline = exports(&mut qmp)?;
        Ok(Self { qmp, baseline })
    }

    /// The exports that served requests since [`Breakdown::start`].
    pub fn finish(mut self) -> Result<Vec<ExportBreakdown>> {
        let now = exports(&mut self.qmp)?;
        let busy = now.into_iter().filter_map(|(export, stats)| {
            let before = self.baseline.iter().find(|(id, _)| *id == export).map(|(_, s)| s.clone());
            let stats = stats.since(&before.unwrap_or_default());
            (stats.total.count() > 0 || stats.events.requests > 0).then_some(ExportBreakdown { export, stats })
        });
        Ok(busy.collect())
    }
}

fn exports(qmp: &mut QmpClient) -> Result<Vec<(String, QueueSnapshot)>> {
    let entries = qmp.execute("query-blockstats", json!({})).context("query-blockstats")?;
    let entries = entries.as_array().cloned().unwrap_or_default();
    entries
        .into_iter()
        .filter(|e| e.get("x-vsd").is_some())
        .map(|mut e| {
            let id = e["qdev"].as_str().unwrap_or_default().to_string();
            let snapshot: ExportSnapshot = serde_json::from_value(e["x-vsd"].take())
                .with_context(|| format!("export '{id}': statistics not understood"))?;
            Ok((id, snapshot.merged()))
        })
        .collect()
}

impl ExportBreakdown {
    /// The stage table, the daemon's share of the client's mean latency,
    /// and the events per I/O.
    pub fn render(&self, client_mean_us: f64) -> String {
        let mut out = format!("daemon breakdown, export '{}' (vsd, over QMP)\n", self.export);
        out.push_str(&vsd_trace::stage_table(&self.stats));
        let inside_us = self.stats.total.mean_ns() / 1000.0;
        if client_mean_us > 0.0 && inside_us > 0.0 {
            let _ = writeln!(
                out,
                "client latency {client_mean_us:.2} us = daemon {inside_us:.2} us ({:.1}%) + outside the daemon \
                 {:.2} us (client library, wake-ups, kicks and calls in flight)",
                100.0 * inside_us / client_mean_us,
                client_mean_us - inside_us
            );
        }
        out.push_str(&vsd_trace::events_table(&self.stats));
        out
    }

    /// The same, for `--json`.
    pub fn to_json(&self) -> Value {
        json!({ "export": self.export, "stats": self.stats })
    }
}
