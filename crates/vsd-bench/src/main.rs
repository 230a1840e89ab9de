//! `vsd-bench`: benchmarks a vhost-user-blk back-end through libblkio.
//! See the library documentation for the flags and the JSON output.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use vsd_bench::bench::{self, Args};
use vsd_bench::breakdown::Breakdown;

fn main() -> anyhow::Result<ExitCode> {
    let args = Args::parse();
    let breakdown = args.breakdown.as_deref().map(Breakdown::start).transpose()?;
    let config = args.into_config()?;
    let report = bench::run(&config).with_context(|| format!("benchmarking {}", config.socket.display()))?;
    let daemon = breakdown.map(Breakdown::finish).transpose()?.unwrap_or_default();
    if config.json {
        let mut json = serde_json::to_value(&report)?;
        if !daemon.is_empty() {
            json["breakdown"] = daemon.iter().map(|d| d.to_json()).collect();
        }
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else {
        println!("{report}");
        for export in &daemon {
            println!("\n{}", export.render(report.results.lat_us.mean));
        }
    }
    if report.results.errors > 0 {
        eprintln!("vsd-bench: {} requests failed", report.results.errors);
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}
