//! `-T/--trace`, as qemu-storage-daemon takes it:
//! `[enable=]PATTERN[,events=FILE][,file=FILE]`. QEMU's patterns name its
//! trace events (`nbd_*`, `qcow2_*`); vsd has no such events, but each
//! family of them belongs to one of vsd's layers, whose log lines a pattern
//! turns on at the most detailed level. Patterns no layer answers are
//! named in one warning, as QEMU warns of an event it does not have, and
//! the daemon starts all the same.

use std::fs::File;
use std::path::PathBuf;

use anyhow::{Context, Result};
use vsd_block::options::OptionMap;

/// The families of QEMU's trace events vsd answers: the prefixes of their
/// names, and the log targets (crates and modules) of the layer doing that
/// work in vsd.
const FAMILIES: &[(&[&str], &[&str])] = &[
    (&["nbd_"], &["vsd_nbd", "vsd_nbd_client", "vsd_nbd_proto"]),
    (&["vhost_user_", "vu_", "virtio_blk_"], &["vsd_export", "vsd_virtio"]),
    (&["qcow2_"], &["vsd_qcow2", "vsd_block::drivers::qcow2"]),
    (&["qemu_rbd_"], &["vsd_rbd", "vsd_block::drivers::rbd"]),
    (&["file_", "raw_", "luring_", "laio_", "paio_"], &["vsd_engine", "vsd_block::drivers::file"]),
    (&["bdrv_", "blk_", "throttle_"], &["vsd_block"]),
    (&["job_", "block_job_", "mirror_", "backup_", "stream_", "commit_"], &["vsd_job"]),
    (&["monitor_", "handle_qmp_command", "qmp_"], &["vsd_control"]),
];

/// What every `-T` asked for.
#[derive(Debug, Default, PartialEq)]
pub struct Trace {
    /// The log targets to show in full.
    pub targets: Vec<&'static str>,
    /// `file=`: where the log goes instead of standard error.
    pub file: Option<PathBuf>,
    /// Patterns no layer of vsd answers.
    pub unknown: Vec<String>,
}

impl Trace {
    /// Reads every `-T` option; `events=` files are read now, one pattern
    /// a line (`#` comments and blank lines skipped), as QEMU reads them.
    pub fn parse(options: &[String]) -> Result<Self> {
        let mut trace = Trace::default();
        for text in options {
            let mut opts = OptionMap::parse_implied("-T", text, "enable")?;
            if let Some(pattern) = opts.take("enable") {
                trace.enable(&pattern);
            }
            if let Some(path) = opts.take("events") {
                let events = std::fs::read_to_string(&path).with_context(|| format!("-T events={path}"))?;
                let patterns = events.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#'));
                patterns.for_each(|pattern| trace.enable(pattern));
            }
            if let Some(path) = opts.take("file") {
                trace.file = Some(path.into());
            }
            opts.finish()?;
        }
        Ok(trace)
    }

    /// Turns on the layers `pattern` reaches. A leading `-` turns events
    /// off in QEMU; nothing is on in vsd unless asked for, so it is
    /// honoured by doing nothing.
    fn enable(&mut self, pattern: &str) {
        if pattern.starts_with('-') {
            return;
        }
        // What every event the glob matches begins with.
        let head = &pattern[..pattern.find(['*', '?']).unwrap_or(pattern.len())];
        let reached: Vec<_> = FAMILIES
            .iter()
            .filter(|(prefixes, _)| prefixes.iter().any(|p| head.starts_with(p) || p.starts_with(head)))
            .flat_map(|(_, targets)| targets.iter().copied())
            .collect();
        if reached.is_empty() {
            self.unknown.push(pattern.to_string());
        }
        for target in reached {
            if !self.targets.contains(&target) {
                self.targets.push(target);
            }
        }
    }

    /// The warning for patterns vsd cannot honour, if any.
    pub fn warning(&self) -> Option<String> {
        (!self.unknown.is_empty()).then(|| {
            let unknown: Vec<_> = self.unknown.iter().map(|p| format!("'{p}'")).collect();
            format!("-T: warning: no trace in vsd for {} (see vsd -T help)", unknown.join(", "))
        })
    }

    /// The log's destination: `file=`, created or truncated, as QEMU's.
    pub fn open_file(&self) -> Result<Option<File>> {
        let Some(path) = &self.file else { return Ok(None) };
        File::create(path).map(Some).with_context(|| format!("-T file={}", path.display()))
    }
}

/// `-T help`: the patterns vsd answers, and what each shows.
pub fn help() -> String {
    let mut text = String::from("QEMU trace event families vsd answers, and the layers whose log they show:\n");
    for (prefixes, targets) in FAMILIES {
        let patterns: Vec<_> = prefixes.iter().map(|p| format!("{p}*")).collect();
        text += &format!("  {:<56} {}\n", patterns.join(" "), targets.join(", "));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(options: &[&str]) -> Trace {
        Trace::parse(&options.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn patterns_reach_the_layers_of_their_events() {
        let trace = parse(&["nbd_*", "enable=qcow2_alloc*", "-bdrv_*"]);
        assert_eq!(
            trace.targets,
            ["vsd_nbd", "vsd_nbd_client", "vsd_nbd_proto", "vsd_qcow2", "vsd_block::drivers::qcow2"]
        );
        assert!(trace.unknown.is_empty());
        assert_eq!(parse(&["n*"]).targets, ["vsd_nbd", "vsd_nbd_client", "vsd_nbd_proto"], "a shorter glob too");
        assert_eq!(parse(&["*"]).targets.len(), FAMILIES.iter().map(|(_, t)| t.len()).sum::<usize>());
        assert!(parse(&["-qcow2_*"]).targets.is_empty(), "turning events off asks for nothing");
    }

    #[test]
    fn unknown_patterns_are_one_warning_not_an_error() {
        let trace = parse(&["foo_bar", "nbd_co_send*", "kvm_*"]);
        assert_eq!(trace.unknown, ["foo_bar", "kvm_*"]);
        let warning = trace.warning().unwrap();
        assert_eq!(warning, "-T: warning: no trace in vsd for 'foo_bar', 'kvm_*' (see vsd -T help)");
        assert!(parse(&["nbd_*"]).warning().is_none());
    }

    #[test]
    fn events_files_and_the_output_file() {
        let dir = tempfile::tempdir().unwrap();
        let events = dir.path().join("events");
        std::fs::write(&events, "# ours\nvhost_user_*\n\n  job_*  \n").unwrap();
        let out = dir.path().join("out");
        let trace = parse(&[&format!("events={},file={}", events.display(), out.display())]);
        assert_eq!(trace.targets, ["vsd_export", "vsd_virtio", "vsd_job"]);
        assert_eq!(trace.file.as_deref(), Some(out.as_path()));
        trace.open_file().unwrap().unwrap();
        assert!(out.exists());
        let missing = Trace::parse(&["events=/nonexistent/e".to_string()]).unwrap_err();
        assert!(format!("{missing:#}").starts_with("-T events=/nonexistent/e: No such file"), "{missing:#}");
        assert!(Trace::parse(&["nbd_*,colour=red".to_string()]).is_err());
    }
}
