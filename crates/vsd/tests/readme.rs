//! The README as a newcomer follows it: its tour's blocks run as written,
//! and its links and the manual's lead somewhere. The tour runs the
//! binaries cargo built for the tests, put on PATH as the README's
//! "Build" step puts the release ones.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

fn readme() -> String {
    std::fs::read_to_string(repo().join("README.md")).unwrap()
}

/// The text of the README's section `heading`, up to the next one.
fn section<'a>(text: &'a str, heading: &str) -> &'a str {
    let start = text.find(&format!("\n## {heading}\n")).unwrap_or_else(|| panic!("README has no '## {heading}'"));
    let rest = &text[start + 1..];
    let end = rest[3..].find("\n## ").map_or(rest.len(), |at| at + 3);
    &rest[..end]
}

/// The ```sh blocks of `text`.
fn shell_blocks(text: &str) -> Vec<&str> {
    text.split("```sh\n").skip(1).filter_map(|rest| rest.split("```").next()).collect()
}

#[test]
fn the_readme_is_short_and_starts_with_its_two_commands() {
    let text = readme();
    let lines = text.lines().count();
    assert!(lines < 200, "README.md has {lines} lines: the manual is docs/manual/");
    let first: Vec<&str> = text.lines().take(5).collect();
    assert_eq!(first[1], "```sh", "{first:?}");
    assert!(first[2].starts_with("scripts/demo.sh "), "{first:?}");
    assert!(first[3].starts_with("scripts/test.sh "), "{first:?}");
    assert_eq!(first[4], "```", "{first:?}");
}

#[test]
fn every_tour_block_runs_as_written() {
    let text = readme();
    let blocks = shell_blocks(section(&text, "A five-minute tour"));
    assert!(blocks.len() >= 5, "the tour has {} blocks", blocks.len());
    let bin = Path::new(env!("CARGO_BIN_EXE_vsd")).parent().unwrap().to_path_buf();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let mut failures = Vec::new();
    for block in blocks {
        let (status, stdout, stderr) = run_block(block, &path);
        if status.is_none_or(|s| !s.success()) {
            let tail = |text: String| {
                text.lines().rev().take(15).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
            };
            let status = status.map_or("timed out".to_string(), |s| s.to_string());
            failures.push(format!("{block}\n=> {status}\nstdout:\n{}\nstderr:\n{}", tail(stdout), tail(stderr)));
        }
    }
    assert!(failures.is_empty(), "tour blocks failed:\n{}", failures.join("\n\n"));
}

/// The longest a tour block may take (a guest booted under TCG on a busy
/// machine is the slowest).
const BLOCK_LIMIT: Duration = Duration::from_secs(900);

/// Runs `block` in bash, in a process group of its own, its output in
/// files: a process it leaves behind (a QEMU) holds no pipe of the test's
/// open, and is killed with the group when the block ends or overruns.
fn run_block(block: &str, path: &str) -> (Option<ExitStatus>, String, String) {
    let dir = std::env::temp_dir().join(format!("vsd-readme-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (out, err) = (dir.join("stdout"), dir.join("stderr"));
    let mut child = Command::new("bash")
        .args(["-euo", "pipefail", "-c", block])
        .current_dir(repo())
        .env("PATH", path)
        .stdin(Stdio::null())
        .stdout(File::create(&out).unwrap())
        .stderr(File::create(&err).unwrap())
        .process_group(0)
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > BLOCK_LIMIT {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // SAFETY: kill() of the process group of a child we spawned as its leader.
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    let _ = child.wait();
    let read = |file: &Path| std::fs::read_to_string(file).unwrap_or_default();
    let said = (status, read(&out), read(&err));
    let _ = std::fs::remove_dir_all(&dir);
    said
}

/// Relative links of the README and the manual name files that exist.
#[test]
fn links_lead_to_files() {
    let root = repo();
    let mut pages = vec![root.join("README.md"), root.join("BENCHMARKS.md")];
    let manual = root.join("docs/manual");
    pages.extend(
        std::fs::read_dir(&manual).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension() == Some("md".as_ref())),
    );
    let mut broken = Vec::new();
    for page in pages {
        let text = std::fs::read_to_string(&page).unwrap();
        for target in text.split("](").skip(1).filter_map(|rest| rest.split(')').next()) {
            let file = target.split('#').next().unwrap_or_default();
            if file.is_empty() || file.contains("://") || file.starts_with("mailto:") {
                continue;
            }
            if !page.parent().unwrap().join(file).exists() {
                broken.push(format!("{}: {target}", page.strip_prefix(&root).unwrap().display()));
            }
        }
    }
    assert!(broken.is_empty(), "links to nothing: {broken:#?}");
}

/// The working tree speaks of the project in dates and commits, never in
/// internal work-period numbers.
#[test]
fn no_file_names_a_work_period() {
    let root = repo();
    let out = Command::new("git").args(["ls-files", "-z"]).current_dir(&root).output().unwrap();
    assert!(out.status.success());
    let pattern = regex_free_work_period;
    let mut found = Vec::new();
    for name in String::from_utf8(out.stdout).unwrap().split('\0').filter(|n| !n.is_empty()) {
        let Ok(text) = std::fs::read_to_string(root.join(name)) else { continue };
        if pattern(name) {
            found.push(format!("{name} (its name)"));
        }
        for (n, line) in text.lines().enumerate() {
            if pattern(line) {
                found.push(format!("{name}:{}: {line}", n + 1));
            }
        }
    }
    assert!(found.is_empty(), "work-period numbers: {found:#?}");
}

/// `session` followed by a number, in any case, with any space between.
fn regex_free_work_period(text: &str) -> bool {
    let lower = text.to_ascii_lowercase();
    lower.match_indices("session").any(|(at, word)| {
        let rest = lower[at + word.len()..].trim_start_matches([' ', '_', '-']);
        rest.starts_with(|c: char| c.is_ascii_digit())
    })
}
