//! Starting vsd or qemu-storage-daemon for one run, with the same command
//! line for both (vsd takes qemu-storage-daemon's).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::child::{self, Watched, pinned};
use crate::config::{CacheMode, Config, Engine, Format, Program, name};
use crate::matrix::{direct, writethrough};
use crate::tools::Tools;

/// How long a daemon may take to open its images and listen.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A daemon serving one export, `lab`, for one run; stopped when dropped.
pub struct Daemon {
    child: Watched,
    /// The export's vhost-user socket.
    pub socket: PathBuf,
    /// The daemon's QMP socket.
    pub qmp: PathBuf,
}

impl Daemon {
    /// Starts the daemon of `config` on `image` (`None`: a `null-co` node of
    /// `size` bytes), pinned to `cpus`, with its sockets in `dir`.
    pub fn start(
        config: &Config,
        image: Option<&Path>,
        size: u64,
        cpus: &str,
        tools: &Tools,
        dir: &Path,
    ) -> Result<Self> {
        let program = match config.program {
            Program::Vsd => &tools.vsd,
            Program::Qsd => &tools.qsd,
            other => bail!("{} is not a vhost-user-blk daemon", name(&other)),
        };
        let socket = dir.join("lab.sock");
        let qmp = dir.join("qmp.sock");
        let pidfile = dir.join("daemon.pid");
        for stale in [&socket, &qmp, &pidfile] {
            let _ = std::fs::remove_file(stale);
        }
        let mut cmd = pinned(cpus, program);
        for blockdev in blockdevs(config, image, size) {
            cmd.arg("--blockdev").arg(blockdev);
        }
        cmd.arg("--export").arg(export(config, &socket));
        cmd.arg("--chardev").arg(format!("socket,id=qmp,path={},server=on,wait=off", escape(&qmp)));
        cmd.args(["--monitor", "chardev=qmp", "--pidfile"]).arg(&pidfile);
        let mut child = Watched::spawn(cmd, dir, "daemon")?;
        let start = Instant::now();
        while !pidfile.exists() {
            if !child.running() {
                bail!("{} did not start: {}", config.daemon, child.stderr_tail());
            }
            if start.elapsed() > START_TIMEOUT {
                bail!("{} did not start within {} s", config.daemon, START_TIMEOUT.as_secs());
            }
            child::sleep(Duration::from_millis(10))?;
        }
        Ok(Self { child, socket, qmp })
    }

    /// CPU time the daemon has used so far, in microseconds.
    pub fn cpu_us(&self) -> Result<f64> {
        child::cpu_us(self.child.pid())
    }
}

/// The block graph: a file node and a format node named `disk0`, or a
/// `null-co` node.
fn blockdevs(config: &Config, image: Option<&Path>, size: u64) -> Vec<String> {
    let Some(image) = image else {
        return vec![format!("driver=null-co,node-name=disk0,size={size}")];
    };
    let aio = match config.engine.unwrap_or(Engine::IoUring) {
        Engine::IoUring => "io_uring",
        Engine::Threads => "threads",
    };
    let file = format!(
        "driver=file,node-name=file0,filename={},aio={aio},cache.direct={},cache.no-flush={}",
        escape(image),
        on_off(direct(config.cache)),
        on_off(config.cache == Some(CacheMode::Unsafe)),
    );
    let format = if config.format == Format::Raw { "raw" } else { "qcow2" };
    vec![file, format!("driver={format},node-name=disk0,file=file0")]
}

fn export(config: &Config, socket: &Path) -> String {
    let mut export = format!(
        "type=vhost-user-blk,id=lab,node-name=disk0,addr.type=unix,addr.path={},writable=on,num-queues={}",
        escape(socket),
        config.queues
    );
    if writethrough(config.cache) {
        export.push_str(",writethrough=on");
    }
    if !config.export_options.is_empty() {
        export.push(',');
        export.push_str(&config.export_options);
    }
    export
}

fn on_off(on: bool) -> &'static str {
    if on { "on" } else { "off" }
}

/// A path as an option value: QEMU's option syntax doubles commas.
fn escape(path: &Path) -> String {
    path.display().to_string().replace(',', ",,")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Backend, Driver, Rw};

    fn config() -> Config {
        Config {
            daemon: "qsd".into(),
            program: Program::Qsd,
            export_options: String::new(),
            driver: Driver::Bench,
            bus: None,
            backend: Backend::Tmpfs,
            format: Format::Qcow2Metadata,
            cache: Some(CacheMode::Directsync),
            engine: Some(Engine::Threads),
            queues: 2,
            jobs: 2,
            bs: 4096,
            rw: Rw::Randwrite,
            iodepth: 8,
        }
    }

    #[test]
    fn cache_modes_become_qemu_options() {
        let args = blockdevs(&config(), Some(Path::new("/t/a,b.qcow2")), 1 << 30);
        assert_eq!(
            args,
            [
                "driver=file,node-name=file0,filename=/t/a,,b.qcow2,aio=threads,cache.direct=on,cache.no-flush=off",
                "driver=qcow2,node-name=disk0,file=file0",
            ]
        );
        let export = export(&Config { export_options: "poll-us=0".into(), ..config() }, Path::new("/s"));
        assert_eq!(
            export,
            "type=vhost-user-blk,id=lab,node-name=disk0,addr.type=unix,addr.path=/s,writable=on,num-queues=2,\
             writethrough=on,poll-us=0"
        );
        let unsafe_cache = Config { cache: Some(CacheMode::Unsafe), ..config() };
        assert!(blockdevs(&unsafe_cache, Some(Path::new("/i")), 1)[0].ends_with("cache.direct=off,cache.no-flush=on"));
        assert_eq!(blockdevs(&config(), None, 512), ["driver=null-co,node-name=disk0,size=512"]);
    }
}
