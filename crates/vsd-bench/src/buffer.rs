//! I/O buffers in memory regions mapped into the back-end.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};

use blkio::{Blkio, MemoryRegion};

use crate::error::{Error, Result};

/// The libblkio instance, shared by the client, its queues and its buffers so
/// that it outlives all of them.
pub(crate) type SharedBlkio = Arc<Mutex<Blkio>>;

/// Locks the shared libblkio instance; a panic in another thread while it was
/// held does not make the instance unusable, so poisoning is ignored.
pub(crate) fn lock(blkio: &Mutex<Blkio>) -> MutexGuard<'_, Blkio> {
    blkio.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A zero-initialised byte buffer in a libblkio memory region that is mapped
/// into the back-end, usable as the data buffer of requests.
///
/// The region is rounded up to whole pages; [`Buffer::len`] is the length
/// that was asked for. Each buffer uses one of the back-end's memory slots
/// (libblkio property `max-mem-regions`), so prefer a few large buffers to
/// many small ones. Dropping the buffer unmaps and frees the region.
///
/// If a request using the buffer timed out, the back-end may still write to
/// it later; its contents are then unspecified (but always valid bytes).
pub struct Buffer {
    region: MemoryRegion,
    len: usize,
    blkio: SharedBlkio,
    /// Set when a request that uses the buffer may still be in flight: the
    /// region is then left mapped and is freed with the libblkio instance.
    abandoned: bool,
}

impl Buffer {
    /// Allocates and maps a buffer of `len` bytes.
    pub(crate) fn alloc(blkio: &SharedBlkio, len: usize) -> Result<Buffer> {
        let region_len = round_up_to_page(len.max(1))
            .ok_or_else(|| Error::InvalidArgument(format!("buffer length {len} is too large")))?;
        let mut guard = lock(blkio);
        let region = guard
            .alloc_mem_region(region_len)
            .map_err(|e| Error::setup(format!("allocating a {region_len}-byte buffer"), &e))?;
        if let Err(e) = guard.map_mem_region(&region) {
            guard.free_mem_region(&region);
            return Err(Error::setup(format!("mapping a {region_len}-byte buffer into the back-end"), &e));
        }
        drop(guard);
        Ok(Buffer { region, len, blkio: Arc::clone(blkio), abandoned: false })
    }

    /// The usable length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has zero usable bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Drops the buffer but leaves its region mapped, to be freed together
    /// with the libblkio instance, because the back-end may still use it.
    pub(crate) fn abandon(mut self) {
        self.abandoned = true;
    }

    /// Start of the buffer, for submitting requests.
    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.region.addr as *const u8
    }

    /// Start of the buffer, for submitting requests that fill it.
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.region.addr as *mut u8
    }
}

impl Deref for Buffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `region` is a live, readable and writable shared mapping of
        // `region.len >= len` bytes created by `alloc` and only unmapped in
        // `drop`; it is initialised (memfd pages read as zero) and u8 has no
        // invalid values. Requests that let the back-end write into it are
        // either submitted through `Queue` methods taking `&mut Buffer` that
        // wait for completion before returning, or by the bench engine,
        // which never borrows its buffer while requests are in flight; so no
        // write is in flight while this borrow lives (except after a
        // timeout, documented on the type).
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }
}

impl DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` makes this the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), self.len) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.abandoned {
            return;
        }
        let mut guard = lock(&self.blkio);
        guard.unmap_mem_region(&self.region);
        guard.free_mem_region(&self.region);
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("addr", &format_args!("{:#x}", self.region.addr))
            .field("len", &self.len)
            .finish()
    }
}

/// Rounds `len` up to a whole number of pages, `None` on overflow.
fn round_up_to_page(len: usize) -> Option<usize> {
    let page = vsd_sys::process::page_size();
    len.checked_add(page - 1).map(|l| l / page * page)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_to_pages() {
        let page = vsd_sys::process::page_size();
        assert_eq!(round_up_to_page(1), Some(page));
        assert_eq!(round_up_to_page(page), Some(page));
        assert_eq!(round_up_to_page(page + 1), Some(2 * page));
        assert_eq!(round_up_to_page(usize::MAX), None);
    }
}
