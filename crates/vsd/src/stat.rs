//! `vsd stat`: asks a running daemon over QMP where its requests spend
//! their time, and prints the stage table and the events per I/O.

use std::path::PathBuf;

use anyhow::{Context, Result};
use serde_json::json;
use vsd_control::client::QmpClient;
use vsd_trace::ExportSnapshot;

/// `vsd stat` options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The daemon's QMP socket (its --chardev path).
    #[arg(long, value_name = "PATH")]
    qmp: PathBuf,
    /// Only this export (default: every export).
    #[arg(long, value_name = "ID")]
    export: Option<String>,
}

pub fn run(args: Args) -> Result<()> {
    let mut client =
        QmpClient::connect(&args.qmp).with_context(|| format!("cannot reach QMP at '{}'", args.qmp.display()))?;
    let stats = client.execute("query-blockstats", json!({})).context("query-blockstats")?;
    let mut shown = 0;
    for entry in stats.as_array().into_iter().flatten() {
        let id = entry["qdev"].as_str().unwrap_or_default();
        if args.export.as_deref().is_some_and(|wanted| wanted != id) {
            continue;
        }
        let snapshot: ExportSnapshot =
            serde_json::from_value(entry["x-vsd"].clone()).with_context(|| format!("export '{id}': bad statistics"))?;
        let merged = snapshot.merged();
        println!(
            "export '{id}' (node '{}'), {} queue(s)\n",
            entry["node-name"].as_str().unwrap_or("?"),
            snapshot.queues.len()
        );
        println!("{}", vsd_trace::stage_table(&merged));
        println!("{}", vsd_trace::events_table(&merged));
        shown += 1;
    }
    if shown == 0 {
        anyhow::bail!("no export{} to show", args.export.map(|id| format!(" named '{id}'")).unwrap_or_default());
    }
    Ok(())
}
