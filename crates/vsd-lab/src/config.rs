//! One run's configuration: every axis of a lab matrix, fixed.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The program that serves (or, for the floor, does) the I/O.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Program {
    /// vsd, over vhost-user-blk.
    Vsd,
    /// qemu-storage-daemon, over vhost-user-blk.
    Qsd,
    /// fio on the host file itself, no virtualization: the floor.
    Fio,
    /// QEMU's own block layer behind an emulated bus (guest runs only).
    Qemu,
}

/// What drives the I/O.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Driver {
    /// `vsd-bench`, a libblkio vhost-user-blk client on the host.
    Bench,
    /// fio on the host (the `fio` program only).
    Fio,
    /// fio inside a Linux guest under QEMU (TCG here: functional figures).
    Guest,
}

/// How the guest's disk is attached (guest runs only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Bus {
    /// vhost-user-blk-pci to the daemon's socket.
    VhostUserBlk,
    /// QEMU's virtio-blk-pci.
    VirtioBlk,
    /// QEMU's virtio-scsi-pci with a scsi-hd.
    VirtioScsi,
    /// QEMU's IDE (AHCI on q35) with an ide-hd.
    Ide,
}

/// Where the image lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    /// No image: `null-co` (fio: `ioengine=null`).
    NullCo,
    /// A file on tmpfs.
    Tmpfs,
    /// A file on the disk the spec names.
    Disk,
}

/// The image format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Format {
    /// A raw file.
    Raw,
    /// qcow2, `preallocation=off`.
    Qcow2,
    /// qcow2, `preallocation=metadata`.
    Qcow2Metadata,
    /// qcow2, `preallocation=full`.
    Qcow2Full,
}

/// QEMU's cache modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CacheMode {
    /// O_DIRECT, flushes honoured.
    None,
    /// The page cache, flushes honoured.
    Writeback,
    /// The page cache, every write synchronous.
    Writethrough,
    /// O_DIRECT, every write synchronous.
    Directsync,
    /// The page cache, flushes ignored.
    Unsafe,
}

/// The daemon's I/O engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Engine {
    /// `aio=io_uring`.
    #[serde(rename = "io_uring")]
    IoUring,
    /// `aio=threads`: a thread pool.
    Threads,
}

/// fio's access patterns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Rw {
    /// Random reads.
    Randread,
    /// Random writes.
    Randwrite,
    /// Random reads and writes, half each.
    Randrw,
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
}

/// Every axis of one run. Axes that do not apply to the run are `None`
/// (a `null-co` node has no cache mode; fio on the host has no engine of
/// the daemon's, and so on), so a configuration is measured once, not once
/// per value of an axis it ignores.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Config {
    /// The name the spec gave this daemon ("vsd", "qsd", "fio", or a
    /// variant such as "vsd-nopoll"); plots and tables label runs by it.
    pub daemon: String,
    /// The program behind [`Config::daemon`].
    pub program: Program,
    /// Extra export options given to the daemon (e.g. "poll-us=0").
    pub export_options: String,
    /// What drives the I/O.
    pub driver: Driver,
    /// How a guest's disk is attached (guest runs only).
    pub bus: Option<Bus>,
    /// Where the image lives.
    pub backend: Backend,
    /// The image format (`raw` for `null-co`).
    pub format: Format,
    /// Cache mode (`None` for `null-co`).
    pub cache: Option<CacheMode>,
    /// The daemon's I/O engine (`None` for `null-co` and the host floor).
    pub engine: Option<Engine>,
    /// Virtqueues of the device (1 for the host floor).
    pub queues: u32,
    /// Jobs (client threads, or fio jobs) issuing I/O.
    pub jobs: u32,
    /// Block size in bytes.
    pub bs: u64,
    /// Access pattern.
    pub rw: Rw,
    /// Requests in flight per job.
    pub iodepth: u32,
}

impl Config {
    /// A short, stable, human-readable key, unique within a matrix:
    /// `vsd/tmpfs/raw/writeback/io_uring/mq2-1jobs/4k/randread/qd32`
    /// (with the bus for guest runs, and `-` for an axis that does not apply).
    pub fn id(&self) -> String {
        let bus = self.bus.map(|b| format!("/{}", name(&b))).unwrap_or_default();
        format!(
            "{}{bus}/{}/{}/{}/{}/mq{}-{}jobs/{}/{}/qd{}",
            self.daemon,
            name(&self.backend),
            name(&self.format),
            self.cache.map(|c| name(&c)).unwrap_or_else(|| "-".into()),
            self.engine.map(|e| name(&e)).unwrap_or_else(|| "-".into()),
            self.queues,
            self.jobs,
            size_label(self.bs),
            name(&self.rw),
            self.iodepth,
        )
    }
}

impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.id())
    }
}

/// The word an axis value is spelled with in specs and JSON.
pub fn name<T: Serialize>(value: &T) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(s)) => s,
        other => format!("{other:?}"),
    }
}

/// `4096` -> "4k", `65536` -> "64k", `1048576` -> "1m", `1000` -> "1000".
pub fn size_label(bytes: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "g"), (1 << 20, "m"), (1 << 10, "k")];
    UNITS
        .iter()
        .find(|(unit, _)| bytes >= *unit && bytes.is_multiple_of(*unit))
        .map(|(unit, suffix)| format!("{}{suffix}", bytes / unit))
        .unwrap_or_else(|| bytes.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_name_every_axis() {
        let config = Config {
            daemon: "vsd".into(),
            program: Program::Vsd,
            export_options: String::new(),
            driver: Driver::Bench,
            bus: None,
            backend: Backend::NullCo,
            format: Format::Raw,
            cache: None,
            engine: Some(Engine::IoUring),
            queues: 2,
            jobs: 1,
            bs: 4096,
            rw: Rw::Randread,
            iodepth: 32,
        };
        assert_eq!(config.id(), "vsd/null-co/raw/-/io_uring/mq2-1jobs/4k/randread/qd32");
        let guest = Config { bus: Some(Bus::VirtioScsi), format: Format::Qcow2Metadata, ..config };
        assert_eq!(guest.id(), "vsd/virtio-scsi/null-co/qcow2-metadata/-/io_uring/mq2-1jobs/4k/randread/qd32");
    }

    #[test]
    fn sizes_read_as_fio_writes_them() {
        assert_eq!(size_label(4096), "4k");
        assert_eq!(size_label(65536), "64k");
        assert_eq!(size_label(1 << 20), "1m");
        assert_eq!(size_label(512), "512");
        assert_eq!(size_label(1536), "1536");
    }
}
