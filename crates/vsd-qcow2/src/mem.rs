//! An image file in memory, for tests and fuzzing.

use std::io;

use crate::SyncIo;

/// A file held in a `Vec`, growing on writes up to a cap, so that an image
/// whose metadata points terabytes away costs an error, not the memory.
#[derive(Clone, Debug, Default)]
pub struct MemFile {
    /// The file's bytes.
    pub bytes: Vec<u8>,
    max_len: u64,
}

impl MemFile {
    /// A file holding `bytes`, allowed to grow to `max_len` bytes.
    pub fn new(bytes: Vec<u8>, max_len: u64) -> Self {
        Self { bytes, max_len }
    }

    /// A new qcow2 image of `size` (qemu-img's spelling) with qemu-img's
    /// defaults, made by qemu-img; `name` keeps tests running at once apart.
    #[cfg(test)]
    pub(crate) fn made_by_qemu_img(name: &str, size: &str) -> Self {
        Self::made_by_qemu_img_with(name, &[], size)
    }

    /// [`MemFile::made_by_qemu_img`] with more `qemu-img create` arguments
    /// (`-o` options, a backing file).
    #[cfg(test)]
    pub(crate) fn made_by_qemu_img_with(name: &str, args: &[&str], size: &str) -> Self {
        let path = std::env::temp_dir().join(format!("vsd-qcow2-{name}-{}.qcow2", std::process::id()));
        let status = std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .args(args)
            .arg(&path)
            .arg(size)
            .status()
            .expect("qemu-img runs");
        assert!(status.success(), "qemu-img create {args:?} {size}");
        let bytes = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        Self::new(bytes, 64 << 20)
    }
}

impl SyncIo for MemFile {
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        buf.fill(0);
        let len = self.bytes.len() as u64;
        let (start, end) = (offset.min(len) as usize, offset.saturating_add(buf.len() as u64).min(len) as usize);
        buf[..end - start].copy_from_slice(&self.bytes[start..end]);
        Ok(())
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        let end = offset.checked_add(buf.len() as u64).filter(|&e| e <= self.max_len);
        let end = end.ok_or_else(|| io::Error::from(io::ErrorKind::StorageFull))? as usize;
        if self.bytes.len() < end {
            self.bytes.resize(end, 0);
        }
        self.bytes[offset as usize..end].copy_from_slice(buf);
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn discard(&mut self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }
}

/// One in-memory file for several threads (tests of requests racing).
#[cfg(test)]
#[derive(Clone)]
pub(crate) struct SharedFile(pub(crate) std::sync::Arc<std::sync::Mutex<MemFile>>);

#[cfg(test)]
impl SyncIo for SharedFile {
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.0.lock().unwrap().read_at(buf, offset)
    }
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.0.lock().unwrap().write_at(buf, offset)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
    fn discard(&mut self, _: u64, _: u64) -> io::Result<()> {
        Ok(())
    }
}
