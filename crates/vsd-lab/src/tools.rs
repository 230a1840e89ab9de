//! The programs a lab run needs, and where they are.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Paths of the programs the lab starts.
#[derive(Clone, Debug)]
pub struct Tools {
    /// The vsd daemon, built next to vsd-lab (`VSD_LAB_VSD` overrides).
    pub vsd: PathBuf,
    /// vsd-bench, built next to vsd-lab (`VSD_LAB_BENCH` overrides).
    pub bench: PathBuf,
    /// qemu-storage-daemon, from `PATH`.
    pub qsd: PathBuf,
    /// fio, from `PATH`.
    pub fio: PathBuf,
    /// `scripts/guest/run-guest.sh` of the vsd source tree, found above the
    /// executable or the working directory (`VSD_GUEST_SCRIPT` overrides);
    /// only guest matrices need it.
    pub guest: Option<PathBuf>,
}

impl Tools {
    /// Finds every program. vsd and vsd-bench must exist: cargo builds them
    /// into the same directory as vsd-lab, which is where they are looked
    /// for. The others are checked when a run needs them.
    pub fn locate() -> Result<Self> {
        let exe = std::env::current_exe().context("cannot find this program's path")?;
        let beside = |var: &str, name: &str| -> Result<PathBuf> {
            let path = env_path(var).unwrap_or_else(|| exe.with_file_name(name));
            anyhow::ensure!(
                path.is_file(),
                "{name} not found at '{}' (build it beside vsd-lab: cargo build -p {name}, with the same \
                 profile; or set {var})",
                path.display()
            );
            Ok(path)
        };
        let vsd = beside("VSD_LAB_VSD", "vsd")?;
        let bench = beside("VSD_LAB_BENCH", "vsd-bench")?;
        let guest = env_path("VSD_GUEST_SCRIPT").or_else(|| {
            let cwd = std::env::current_dir().ok()?;
            [exe.as_path(), cwd.as_path()].iter().find_map(|start| find_above(start, "scripts/guest/run-guest.sh"))
        });
        Ok(Self { vsd, bench, qsd: "qemu-storage-daemon".into(), fio: "fio".into(), guest })
    }
}

fn env_path(var: &str) -> Option<PathBuf> {
    std::env::var_os(var).map(PathBuf::from)
}

/// `relative` under `start` or the nearest of its ancestors that has it.
fn find_above(start: &Path, relative: &str) -> Option<PathBuf> {
    start.ancestors().map(|dir| dir.join(relative)).find(|path| path.is_file())
}
