//! `vsd-bench`: benchmarks a vhost-user-blk back-end through libblkio.
//! See the library documentation for the flags and the JSON output.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use vsd_bench::bench::{self, Args};

fn main() -> anyhow::Result<ExitCode> {
    let config = Args::parse().into_config()?;
    let report = bench::run(&config).with_context(|| format!("benchmarking {}", config.socket.display()))?;
    if config.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{report}");
    }
    if report.results.errors > 0 {
        eprintln!("vsd-bench: {} requests failed", report.results.errors);
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}
