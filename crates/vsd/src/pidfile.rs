//! `--pidfile`: the daemon's process id, for service managers and scripts.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// The pidfile, removed when the daemon exits, however it exits. After
/// `--run-with`, removing it (and the sockets) takes a directory the user
/// may write; otherwise it stays, and the next start overwrites it.
pub(crate) struct Pidfile(PathBuf);

impl Pidfile {
    /// Writes this process' id and a newline to `path`, kept absolute: a
    /// daemon (`--daemonize`) leaves its working directory before it exits.
    pub(crate) fn write(path: &Path) -> Result<Self> {
        std::fs::write(path, format!("{}\n", std::process::id()))
            .with_context(|| format!("cannot write pidfile '{}'", path.display()))?;
        Ok(Self(std::path::absolute(path)?))
    }
}

impl Drop for Pidfile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_the_pid_while_it_lives() {
        let path = std::env::temp_dir().join(format!("vsd-pidfile-test-{}", std::process::id()));
        std::fs::write(&path, "stale\n").unwrap();
        let pidfile = Pidfile::write(&path).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("{}\n", std::process::id()));
        drop(pidfile);
        assert!(!path.exists(), "removed on drop");
    }

    #[test]
    fn names_the_path_it_cannot_write() {
        let err = Pidfile::write(Path::new("/nonexistent-vsd-dir/vsd.pid")).err().unwrap();
        assert_eq!(err.to_string(), "cannot write pidfile '/nonexistent-vsd-dir/vsd.pid'");
    }
}
