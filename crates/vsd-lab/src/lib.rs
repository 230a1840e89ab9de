//! `vsd-lab`: benchmark matrices as commands anyone can re-run.
//!
//! A *spec* (TOML, [`spec`]) names the axes of one or more matrices; [`matrix`]
//! expands them into run configurations ([`config::Config`]); [`runner`]
//! starts each daemon ([`serve`]), drives it ([`drive`]), samples its CPU and
//! asks vsd for its per-stage breakdown, and appends one JSON line per run
//! ([`row::Row`]); [`report`] turns a results file into an HTML report with
//! plots. [`cli`] is the `vsd-lab` command line. The lab is a program of
//! its own, so that the daemon that serves disks links none of this.

pub mod child;
pub mod cli;
pub mod config;
pub mod drive;
pub mod image;
pub mod machine;
pub mod matrix;
pub mod report;
pub mod row;
pub mod runner;
pub mod serve;
pub mod spec;
pub mod tools;
