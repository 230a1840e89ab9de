//! QMP's `blockdev-create`, as a job of type `create`: a new image file
//! (`driver: file`) or a new qcow2 image on a file node (`driver: qcow2`),
//! so a management tool can make backup targets, scratch images and
//! snapshot overlays without qemu-img. As QEMU, the job waits for
//! `job-dismiss` once concluded.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use vsd_block::BlockNode;
use vsd_control::qmp::QmpError;
use vsd_job::{Job, JobBody, JobSpec};
use vsd_qcow2::create::{NewImage, new_image};

use crate::daemon::Daemon;

/// The drivers whose images vsd can make.
const CREATORS: [&str; 2] = ["file", "qcow2"];
/// Drivers vsd knows that make no images (QEMU's raw, null-co... too).
const NOT_CREATORS: [&str; 8] = ["raw", "null-co", "nbd", "rbd", "throttle", "blkdebug", "host_device", "luks"];

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct CreateArgs {
    job_id: String,
    #[schemars(with = "Options")]
    options: Value,
}

#[derive(Deserialize, JsonSchema)]
#[serde(tag = "driver", rename_all = "kebab-case", deny_unknown_fields)]
enum Options {
    File(FileOptions),
    Qcow2(Qcow2Options),
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct FileOptions {
    filename: PathBuf,
    size: u64,
    #[serde(default)]
    preallocation: Preallocation,
    #[serde(default)]
    nocow: bool,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct Qcow2Options {
    /// A node name (QEMU also takes inline options here).
    file: Value,
    size: u64,
    version: Option<Version>,
    cluster_size: Option<u64>,
    #[serde(default)]
    preallocation: Preallocation,
    #[serde(default)]
    lazy_refcounts: bool,
    refcount_bits: Option<u32>,
    backing_file: Option<String>,
    backing_fmt: Option<String>,
    #[serde(default)]
    extended_l2: bool,
    compression_type: Option<Compression>,
    /// Taken to be refused: vsd makes neither.
    #[schemars(skip)]
    data_file: Option<Value>,
    #[schemars(skip)]
    encrypt: Option<Value>,
}

#[derive(Deserialize, JsonSchema, Clone, Copy, Default, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Preallocation {
    #[default]
    Off,
    Metadata,
    Falloc,
    Full,
}

#[derive(Deserialize, JsonSchema, Clone, Copy, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Version {
    V2,
    V3,
}

#[derive(Deserialize, JsonSchema, Clone, Copy, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Compression {
    Zlib,
    Zstd,
}

fn generic(text: impl Into<String>) -> QmpError {
    QmpError::generic(text)
}

/// What the job makes, or why it fails (QEMU's create job, not the
/// command, finds a missing node or an impossible image).
enum Creation {
    File { path: PathBuf, size: u64, preallocation: Preallocation },
    Qcow2 { file: Arc<dyn BlockNode>, image: NewImage },
    Fails(String),
}

impl Daemon {
    pub(crate) fn blockdev_create(&self, args: CreateArgs) -> Result<Value, QmpError> {
        let driver = args.options.get("driver").and_then(Value::as_str).unwrap_or_default().to_string();
        if !CREATORS.contains(&driver.as_str()) {
            return Err(generic(match NOT_CREATORS.contains(&driver.as_str()) {
                true => "Driver does not support blockdev-create".to_string(),
                false => format!("Parameter 'driver' does not accept value '{driver}'"),
            }));
        }
        let options: Options = crate::qapi::parse_member("options", args.options)?;
        let (creation, nodes) = match options {
            Options::File(o) => {
                if o.nocow {
                    return Err(generic("nocow=on is not supported by vsd"));
                }
                if o.preallocation == Preallocation::Metadata {
                    return Err(generic("Unsupported preallocation mode 'metadata'"));
                }
                (Creation::File { path: o.filename, size: o.size, preallocation: o.preallocation }, Vec::new())
            }
            Options::Qcow2(o) => self.qcow2_creation(o)?,
        };
        let spec = JobSpec {
            id: args.job_id,
            kind: "create",
            auto_finalize: true,
            auto_dismiss: false,
            speed: 0,
            nodes,
            group: None,
        };
        self.jobs.start(spec, Box::new(Create(Some(creation)))).map_err(generic)?;
        Ok(json!({}))
    }

    fn qcow2_creation(&self, o: Qcow2Options) -> Result<(Creation, Vec<String>), QmpError> {
        let Some(name) = o.file.as_str() else {
            return Err(generic("vsd takes the node name of an existing file node as 'file'"));
        };
        let Some(file) = self.state().graph.get(name) else {
            let missing = format!("Cannot find device='{name}' nor node-name='{name}'");
            return Ok((Creation::Fails(missing), Vec::new()));
        };
        if let Some((job, _)) = self.jobs.user_of(name) {
            return Err(generic(crate::jobs::busy(name, &job)));
        }
        if o.data_file.is_some() || o.encrypt.is_some() {
            return Err(generic("vsd makes qcow2 images without a data file or encryption"));
        }
        if o.preallocation != Preallocation::Off {
            return Err(generic("vsd makes qcow2 images with preallocation=off only"));
        }
        let image = NewImage {
            size: o.size,
            version: if o.version == Some(Version::V2) { 2 } else { 3 },
            cluster_size: o.cluster_size.unwrap_or(65536),
            lazy_refcounts: o.lazy_refcounts,
            refcount_bits: o.refcount_bits.unwrap_or(16),
            extended_l2: o.extended_l2,
            zstd: o.compression_type == Some(Compression::Zstd),
            backing_file: o.backing_file,
            backing_format: o.backing_fmt,
        };
        let creation = match new_image(&image) {
            Ok(_) if !file.active() => Creation::Fails(crate::inactive::unavailable("write, resize")),
            Ok(_) => Creation::Qcow2 { file, image },
            Err(why) => Creation::Fails(why),
        };
        Ok((creation, vec![name.to_string()]))
    }
}

/// The job's body: the image made on the job's thread.
struct Create(Option<Creation>);

impl JobBody for Create {
    fn run(&mut self, job: &Arc<Job>) -> Result<(), String> {
        job.set_total(1);
        match self.0.take() {
            Some(Creation::File { path, size, preallocation }) => create_file(&path, size, preallocation)?,
            Some(Creation::Qcow2 { file, image }) => vsd_block::create_qcow2(&*file, &image)
                .map_err(|e| format!("Could not write qcow2 header: {}", strerror(&e)))?,
            Some(Creation::Fails(why)) => return Err(why),
            None => {}
        }
        job.add_progress(1);
        Ok(())
    }
}

fn strerror(e: &io::Error) -> String {
    e.raw_os_error().map_or_else(|| e.to_string(), vsd_job::strerror)
}

/// A new file of `size` bytes (an existing one is emptied first, as QEMU's
/// file driver does), unless another user of it refuses to let it be
/// written or resized.
fn create_file(path: &Path, size: u64, preallocation: Preallocation) -> Result<(), String> {
    let could_not = |e: io::Error| format!("Could not create '{}': {}", path.display(), strerror(&e));
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .open(path)
        .map_err(could_not)?;
    refuse_if_used(&file)?;
    fill(&mut file, size, preallocation).map_err(could_not)
}

/// QEMU's check before it empties a file: the write and resize it needs,
/// and resize it lets no one else share, in its words.
fn refuse_if_used(file: &File) -> Result<(), String> {
    let checks = [
        (201, "Failed to get \"write\" lock"),
        (203, "Failed to get \"resize\" lock"),
        (103, "Failed to get shared \"resize\" lock"),
    ];
    for (byte, refusal) in checks {
        if vsd_sys::lock::byte_locked_elsewhere(file.as_fd(), byte).unwrap_or(false) {
            return Err(refusal.into());
        }
    }
    Ok(())
}

/// Empties `file`, then gives it `size` bytes as `preallocation` says.
fn fill(file: &mut File, size: u64, preallocation: Preallocation) -> io::Result<()> {
    file.set_len(0)?;
    match preallocation {
        Preallocation::Falloc => vsd_sys::fallocate(file.as_fd(), 0, 0, size),
        Preallocation::Full => {
            let zeroes = vec![0u8; 1 << 20];
            let mut left = size;
            while left > 0 {
                let n = left.min(zeroes.len() as u64) as usize;
                file.write_all(&zeroes[..n])?;
                left -= n as u64;
            }
            file.sync_all()
        }
        Preallocation::Off | Preallocation::Metadata => file.set_len(size),
    }
}

/// The formats [`create_image`] makes (QEMU's protocol `file` among them).
pub(crate) const IMAGE_FORMATS: [&str; 3] = ["qcow2", "raw", "file"];

/// A new image at `path` of `size` bytes in `format`, naming `backing`
/// (its file name and format) as its backing file, as QEMU's
/// `bdrv_img_create` makes the new images of `drive-mirror`,
/// `drive-backup` and `blockdev-snapshot-sync`; refusals in its words.
pub(crate) fn create_image(path: &Path, format: &str, size: u64, backing: Option<(&str, &str)>) -> Result<(), String> {
    if !IMAGE_FORMATS.contains(&format) {
        return Err(match vsd_block::DRIVERS.contains(&format) {
            true => format!("Format driver '{format}' does not support image creation"),
            false => format!("Unknown file format '{format}'"),
        });
    }
    if let Some((file, _)) = backing {
        if format != "qcow2" {
            return Err(format!("Backing file not supported for file format '{format}'"));
        }
        if Path::new(file) == path {
            return Err("Error: Trying to create an image with the same filename as the backing file".into());
        }
    }
    if format != "qcow2" {
        return create_file(path, size, Preallocation::Off);
    }
    let image = NewImage {
        size,
        backing_file: backing.map(|(file, _)| file.to_string()),
        backing_format: backing.map(|(_, format)| format.to_string()),
        ..NewImage::default()
    };
    let clusters = new_image(&image)?;
    create_file(path, 0, Preallocation::Off)?;
    write_clusters(path, &clusters).map_err(|e| format!("Could not write qcow2 header: {}", strerror(&e)))
}

/// Writes a new image's bytes where they go, durably.
fn write_clusters(path: &Path, clusters: &[(u64, Vec<u8>)]) -> io::Result<()> {
    let file = OpenOptions::new().write(true).open(path)?;
    for (at, bytes) in clusters {
        file.write_all_at(bytes, *at)?;
    }
    file.sync_all()
}
