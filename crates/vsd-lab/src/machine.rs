//! The facts of the machine a run was made on, recorded in every row.

use std::path::Path;
use std::process::Command;

use crate::row::Machine;
use crate::spec::RunSettings;

impl Machine {
    /// Looks at this machine; `vsd_version` names the daemon under test.
    pub fn probe(run: &RunSettings, vsd_version: &str) -> Machine {
        let cpuinfo = read("/proc/cpuinfo");
        let meminfo = read("/proc/meminfo");
        Machine {
            cpu_model: field(&cpuinfo, "model name").unwrap_or_default(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
            mem_gib: field(&meminfo, "MemTotal")
                .and_then(|kib| kib.trim_end_matches(" kB").parse::<f64>().ok())
                .map_or(0.0, |kib| (kib / f64::from(1 << 20) * 10.0).round() / 10.0),
            kernel: read("/proc/sys/kernel/osrelease").trim().to_owned(),
            clocksource: read("/sys/devices/system/clocksource/clocksource0/current_clocksource").trim().to_owned(),
            vsd_version: vsd_version.to_owned(),
            qemu_version: first_line("qemu-storage-daemon", "--version"),
            fio_version: first_line("fio", "--version"),
            daemon_cpus: run.daemon_cpus.clone(),
            client_cpus: run.client_cpus.clone(),
            disk_fs: fs_type(&run.disk_dir),
        }
    }
}

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The value of the first `key : value` line.
fn field(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(':')?;
        (k.trim() == key).then(|| v.trim().to_owned())
    })
}

/// A program's first line of output, or "" if it cannot run.
fn first_line(program: &str, arg: &str) -> String {
    Command::new(program)
        .arg(arg)
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or_default().to_owned())
        .unwrap_or_default()
}

/// The type of the file system holding `dir` (`ext4`, `tmpfs`...), from the
/// longest mount point of /proc/mounts that contains it.
fn fs_type(dir: &Path) -> String {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_owned());
    read("/proc/mounts")
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (_, mount, fs) = (fields.next()?, fields.next()?, fields.next()?);
            dir.starts_with(mount).then(|| (mount.len(), fs.to_owned()))
        })
        .max()
        .map(|(_, fs)| fs)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_are_found() {
        let m = Machine::probe(&RunSettings::default(), "test");
        assert!(m.cpus >= 1 && m.mem_gib > 0.0, "{m:?}");
        assert!(!m.kernel.is_empty() && !m.cpu_model.is_empty(), "{m:?}");
        assert_eq!(m.disk_fs, fs_type(Path::new("/var/tmp")));
        assert_eq!(fs_type(Path::new("/proc/self")), "proc");
    }
}
