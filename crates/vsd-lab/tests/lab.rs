//! `vsd-lab`: the quick spec runs end to end against the real daemons (vsd,
//! qemu-storage-daemon, host fio, QEMU guests), its rows cover every
//! configuration, the report holds every plot; Ctrl-C keeps the finished
//! rows and a second run resumes.
//!
//! vsd-lab runs the vsd and vsd-bench built beside it: build the workspace
//! first (`cargo build --workspace`, as scripts/test.sh does).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process};
use tempfile::TempDir;
use vsd_lab::config::{Driver, Program};
use vsd_lab::row::{Row, read_rows};

const VSD_LAB: &str = env!("CARGO_BIN_EXE_vsd-lab");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2).unwrap().to_path_buf()
}

/// A scratch directory for one test, removed when it ends.
fn scratch(name: &str) -> TempDir {
    tempfile::Builder::new().prefix(&format!("vsd-lab-test-{name}-")).tempdir().unwrap()
}

/// vsd-lab run in `dir`. It finds the guest script above itself, which a
/// build outside the source tree (`CARGO_TARGET_DIR`) is not: it is named.
fn lab_command(dir: &TempDir) -> Command {
    let mut command = Command::new(VSD_LAB);
    command.current_dir(dir.path()).env("VSD_GUEST_SCRIPT", repo().join("scripts/guest/run-guest.sh"));
    command
}

fn lab(dir: &TempDir, args: &[&str]) -> Output {
    let out = lab_command(dir).args(args).output().unwrap();
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    out
}

/// `vsd-lab run --list`: (matrix, configuration id) of every planned run.
fn planned(dir: &TempDir, spec: &Path) -> BTreeSet<(String, String)> {
    let out = lab(dir, &["run", "--list", spec.to_str().unwrap()]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    text.lines().map(|l| l.split_once('\t').unwrap()).map(|(m, id)| (m.to_owned(), id.to_owned())).collect()
}

fn covered(rows: &[Row]) -> BTreeSet<(String, String)> {
    rows.iter().map(|r| (r.matrix.clone(), r.id.clone())).collect()
}

#[test]
fn quick_spec_runs_and_reports() {
    let dir = scratch("quick");
    let spec = repo().join("lab/specs/quick.toml");
    let configs = planned(&dir, &spec);
    assert!(configs.len() >= 20, "{configs:?}");

    let run = lab(&dir, &["run", spec.to_str().unwrap()]);
    assert!(run.status.success(), "vsd-lab run failed");
    let rows = read_rows(&dir.path().join("lab-results/quick.jsonl")).unwrap();
    assert_eq!(rows.len(), configs.len(), "one run per configuration (repetitions = 1)");
    assert_eq!(covered(&rows), configs);
    for row in &rows {
        assert_eq!(row.error, None, "{}", row.id);
        let m = row.result.as_ref().unwrap();
        assert!(m.iops > 0.0 && m.lat_us.mean > 0.0 && m.lat_us.p99 >= m.lat_us.p50, "{}: {m:?}", row.id);
        let c = &row.config;
        let has_daemon = matches!(c.program, Program::Vsd | Program::Qsd);
        assert_eq!(m.daemon_cpu_us_per_io.is_some(), has_daemon, "{}", row.id);
        if c.driver == Driver::Bench {
            assert!(m.daemon_cpu_pct.is_some_and(|pct| pct > 0.0), "{}: {m:?}", row.id);
        }
        if c.driver != Driver::Guest && c.program == Program::Vsd {
            let b = m.breakdown.as_ref().unwrap_or_else(|| panic!("{}: no breakdown", row.id));
            assert_eq!(b.stages.len(), 5);
            assert!(b.total_mean_us > 0.0 && b.total_mean_us < m.lat_us.mean * 2.0, "{}: {b:?}", row.id);
        } else {
            assert!(m.breakdown.is_none(), "{}", row.id);
        }
    }
    assert!(rows.iter().any(|r| r.config.driver == Driver::Guest && r.config.program == Program::Qemu));
    assert!(rows.iter().any(|r| r.config.driver == Driver::Fio));
    assert_eq!(rows[0].machine.daemon_cpus, "0");

    let report = lab(&dir, &["report"]);
    assert!(report.status.success(), "vsd-lab report failed");
    let html_path = PathBuf::from(String::from_utf8(report.stdout).unwrap().trim());
    let html = std::fs::read_to_string(dir.path().join(&html_path)).unwrap();
    let svg_files: Vec<PathBuf> = std::fs::read_dir(dir.path().join(&html_path).parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "svg"))
        .collect();
    // Per group of a matrix: IOPS, CPU (bench groups) and latency; plus
    // the breakdown plot of the vsd runs.
    assert!(svg_files.len() >= 8, "{svg_files:?}");
    for svg in &svg_files {
        let text = std::fs::read_to_string(svg).unwrap();
        assert!(text.starts_with("<svg") && text.contains("<rect"), "{}", svg.display());
        let id = svg.file_stem().unwrap().to_string_lossy();
        assert!(html.contains(&format!("id=\"{id}\"")), "the report lacks figure {id}");
    }
    assert_eq!(html.matches("<svg").count(), svg_files.len(), "every plot inlined once");
    for (matrix, _) in &configs {
        assert!(html.contains(matrix.as_str()), "no section for matrix {matrix}");
    }
    assert!(html.contains("functional"), "guest figures are labelled as functional");
}

/// Ctrl-C stops the lab after the run in progress, keeping the finished
/// rows; the same command then makes only the missing runs.
#[test]
fn interrupted_lab_resumes() {
    let dir = scratch("resume");
    let spec = dir.path().join("resume.toml");
    std::fs::write(
        &spec,
        "name = \"resume\"\n[run]\nseconds = 1\nramp-seconds = 0\nrepetitions = 2\nimage-size = \"16M\"\n\
         [[matrix]]\nname = \"m\"\ndaemons = [\"vsd\"]\nbackends = [\"null-co\"]\nbs = [\"4k\"]\nrw = [\"randread\"]\n\
         iodepth = [1, 2]\n",
    )
    .unwrap();
    let results = dir.path().join("lab-results/resume.jsonl");
    let mut child = lab_command(&dir).args(["run", spec.to_str().unwrap()]).stderr(Stdio::null()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while read_rows(&results).unwrap().is_empty() {
        assert!(Instant::now() < deadline, "no run finished");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The child is ours and not yet reaped, so its pid names no other process.
    kill_process(Pid::from_child(&child), Signal::INT).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "an interrupted lab says so");
    let kept = read_rows(&results).unwrap();
    assert!(!kept.is_empty() && kept.len() < 4, "{} rows", kept.len());

    let again = lab(&dir, &["run", spec.to_str().unwrap()]);
    assert!(again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains(&format!("{} already recorded", kept.len())));
    let rows = read_rows(&results).unwrap();
    assert_eq!(rows.len(), 4);
    let runs: BTreeSet<(String, u32)> = rows.iter().map(|r| (r.id.clone(), r.rep)).collect();
    assert_eq!(runs.len(), 4, "no run made twice");
    assert_eq!(rows[..kept.len()], kept[..], "the kept rows are untouched");
}
