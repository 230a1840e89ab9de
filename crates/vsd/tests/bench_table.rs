//! BENCHMARKS.md's "Where vsd stands" table is the one
//! scripts/bench/standings.json makes (`scripts/bench.py table --check`),
//! and every study the table's commands name is one `scripts/bench.py list`
//! knows.

use std::path::PathBuf;
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn bench(args: &[&str]) -> std::process::Output {
    Command::new("python3")
        .arg(repo().join("scripts/bench.py"))
        .args(args)
        .output()
        .expect("python3 runs scripts/bench.py")
}

#[test]
fn the_standing_table_is_the_one_its_file_makes() {
    let out = bench(&["table", "--check"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn every_command_of_the_table_names_a_study() {
    let list = bench(&["list"]);
    assert!(list.status.success(), "{}", String::from_utf8_lossy(&list.stderr));
    let list = String::from_utf8(list.stdout).unwrap();
    let studies: Vec<&str> = list.lines().filter_map(|l| l.split_whitespace().next()).collect();
    let standings = std::fs::read_to_string(repo().join("scripts/bench/standings.json")).unwrap();
    let named: Vec<&str> =
        standings.split("scripts/bench.py run ").skip(1).map(|rest| rest.split_whitespace().next().unwrap()).collect();
    assert!(!named.is_empty());
    for study in named {
        assert!(studies.contains(&study), "standings.json runs '{study}', which `scripts/bench.py list` lacks");
    }
}
