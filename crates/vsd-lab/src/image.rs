//! The images runs are served from.
//!
//! Each (back-end, format) gets one template, made on first use. A run that
//! only reads is served the template itself; a run that writes gets a fresh
//! copy, so every daemon starts from the same state and one run's
//! allocations do not speed up the next.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::config::{Backend, Config, Format, Rw};
use crate::spec::RunSettings;

/// Where the images of a lab run live; removed when dropped.
pub struct Images {
    roots: HashMap<Backend, PathBuf>,
    dirs: HashMap<Backend, PathBuf>,
    templates: HashMap<(Backend, Format), PathBuf>,
    size: u64,
    fill: bool,
}

impl Images {
    /// A private directory on tmpfs and on the disk, made when first needed.
    pub fn new(run: &RunSettings) -> Self {
        Self {
            roots: HashMap::from([(Backend::Tmpfs, run.tmpfs_dir.clone()), (Backend::Disk, run.disk_dir.clone())]),
            dirs: HashMap::new(),
            templates: HashMap::new(),
            size: run.image_size,
            fill: run.fill_images,
        }
    }

    /// The image `config` is served from (`None` for `null-co`).
    pub fn for_run(&mut self, config: &Config) -> Result<Option<PathBuf>> {
        if config.backend == Backend::NullCo {
            return Ok(None);
        }
        let template = self.template(config.backend, config.format)?;
        if !writes(config.rw) {
            return Ok(Some(template));
        }
        let copy = template.with_file_name(format!("run.{}", extension(config.format)));
        if self.fill {
            std::fs::copy(&template, &copy).with_context(|| format!("copying '{}'", template.display()))?;
        } else {
            self.create_fresh(&copy, config.format)?;
        }
        Ok(Some(copy))
    }

    fn template(&mut self, backend: Backend, format: Format) -> Result<PathBuf> {
        if let Some(path) = self.templates.get(&(backend, format)) {
            return Ok(path.clone());
        }
        let path = self.dir(backend)?.join(format!("template-{}.{}", crate::config::name(&format), extension(format)));
        match (self.fill, format) {
            (false, _) => self.create_fresh(&path, format)?,
            (true, Format::Raw) => fill_random(&path, self.size)?,
            (true, _) => {
                let raw = self.template(backend, Format::Raw)?;
                qemu_img(&["convert", "-f", "raw", "-O", "qcow2", "-o", &preallocation(format)], &[&raw, &path])?;
            }
        }
        self.templates.insert((backend, format), path.clone());
        Ok(path)
    }

    /// The private directory of `backend`, made on first use.
    fn dir(&mut self, backend: Backend) -> Result<PathBuf> {
        if let Some(dir) = self.dirs.get(&backend) {
            return Ok(dir.clone());
        }
        let root = self.roots.get(&backend).context("null-co has no directory")?;
        let dir = root.join(format!("vsd-lab-{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot make '{}'", dir.display()))?;
        self.dirs.insert(backend, dir.clone());
        Ok(dir)
    }

    fn create_fresh(&self, path: &Path, format: Format) -> Result<()> {
        let fmt = if format == Format::Raw { "raw" } else { "qcow2" };
        qemu_img(&["create", "-q", "-f", fmt, "-o", &preallocation(format)], &[path, Path::new(&self.size.to_string())])
    }
}

impl Drop for Images {
    fn drop(&mut self) {
        for dir in self.dirs.values() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Whether the pattern writes.
pub fn writes(rw: Rw) -> bool {
    !matches!(rw, Rw::Randread | Rw::Read)
}

fn extension(format: Format) -> &'static str {
    if format == Format::Raw { "img" } else { "qcow2" }
}

fn preallocation(format: Format) -> String {
    let mode = match format {
        Format::Raw | Format::Qcow2 => "off",
        Format::Qcow2Metadata => "metadata",
        Format::Qcow2Full => "full",
    };
    format!("preallocation={mode}")
}

fn qemu_img(args: &[&str], paths: &[&Path]) -> Result<()> {
    let out = Command::new("qemu-img").args(args).args(paths).output().context("cannot run qemu-img")?;
    if !out.status.success() {
        bail!("qemu-img {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// Writes `size` bytes of cheap pseudo-random data: real data, so reads of
/// a tmpfs file go through the page cache instead of skipping holes, and
/// nothing a compressing layer could shrink.
fn fill_random(path: &Path, size: u64) -> Result<()> {
    const CHUNK: usize = 1 << 20;
    let mut file = File::create(path).with_context(|| format!("cannot create '{}'", path.display()))?;
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut chunk = vec![0u8; CHUNK];
    let mut left = size;
    while left > 0 {
        for word in chunk.chunks_exact_mut(8) {
            // xorshift64: fast, and random enough for disk contents.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            word.copy_from_slice(&state.to_le_bytes());
        }
        let n = left.min(CHUNK as u64) as usize;
        file.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    file.sync_all()?;
    Ok(())
}
