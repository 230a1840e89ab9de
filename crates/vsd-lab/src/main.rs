//! `vsd-lab`: runs benchmark matrices against vsd, qemu-storage-daemon and
//! the bare host, and reports them (`vsd-lab run SPEC`, `vsd-lab report`).

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    match vsd_lab::cli::main(vsd_lab::cli::Args::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("vsd-lab: {e:#}");
            ExitCode::FAILURE
        }
    }
}
