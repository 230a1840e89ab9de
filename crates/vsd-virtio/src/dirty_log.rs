//! The dirty page log of a live migration (vhost-user's LOG_SHMFD): while
//! the front-end has VHOST_F_LOG_ALL on, every byte the back-end writes into
//! guest memory sets its 4 KiB page's bit in a shared bitmap, which QEMU
//! reads to send those pages again.
//!
//! A page is marked after its bytes are written: QEMU clears the bits it has
//! read, so a mark that became visible before the data could be taken, the
//! old page sent and the data lost. Marks are atomic ORs, as QEMU's own and
//! other back-ends' marks land in the same bytes at the same time.
//!
//! The log is fixed for a worker's lifetime: a new log (QEMU sends one when
//! guest memory grows) is put in place by stopping the workers, which finish
//! their requests into the old log first, and starting them on the new one
//! before the front-end is answered; only then does QEMU read the old log a
//! last time and drop it.

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use vm_memory::FileOffset;
use vm_memory::mmap::MmapRegion;

use crate::ram::GuestRam;

/// Guest bytes covered by one bit of the log.
pub const LOG_PAGE: u64 = 4096;

/// A log region the front-end shared with SET_LOG_BASE, mapped.
#[derive(Debug)]
pub struct DirtyLog {
    map: MmapRegion,
    /// Where the bitmap starts in the mapping.
    offset: usize,
    /// Bytes of bitmap.
    len: usize,
    /// A mark fell outside the bitmap (said once, not per request).
    overflowed: AtomicBool,
}

impl DirtyLog {
    /// Maps `size` bytes of bitmap at `offset` in `file`. The file must
    /// hold them all: touching a page past its end would kill the daemon.
    pub fn map(file: File, size: u64, offset: u64) -> io::Result<Self> {
        let invalid = |why: String| io::Error::new(io::ErrorKind::InvalidInput, format!("dirty log: {why}"));
        let end = offset.checked_add(size).filter(|&end| size > 0 && end <= isize::MAX as u64);
        let end = end.ok_or_else(|| invalid(format!("{size} bytes at offset {offset} is not a usable region")))?;
        let meta = file.metadata().map_err(|e| invalid(format!("the log descriptor: {e}")))?;
        if !meta.is_file() {
            return Err(invalid("the log descriptor is not a file that can be mapped (QEMU shares a memfd)".into()));
        }
        let file_len = meta.len();
        if file_len < end {
            return Err(invalid(format!("{size} bytes at offset {offset} run past its file ({file_len} bytes)")));
        }
        // Mapped from the file's start: mmap wants a page-aligned offset,
        // the front-end's need not be.
        let map = MmapRegion::from_file(FileOffset::new(file, 0), end as usize)
            .map_err(|e| invalid(format!("cannot map it: {e}")))?;
        Ok(Self { map, offset: offset as usize, len: size as usize, overflowed: AtomicBool::new(false) })
    }

    /// Whether the log has a bit for every page of guest bytes `0..end`.
    pub fn covers(&self, end: u64) -> bool {
        end.div_ceil(LOG_PAGE).div_ceil(8) <= self.len as u64
    }

    /// Marks the pages of guest bytes `addr..addr + len` dirty.
    pub fn mark(&self, addr: u64, len: u64) {
        if len == 0 {
            return;
        }
        let first = addr / LOG_PAGE;
        let last = addr.saturating_add(len - 1) / LOG_PAGE;
        for page in first..=last {
            let Some(byte) = self.byte(page / 8) else {
                if !self.overflowed.swap(true, Ordering::Relaxed) {
                    log::error!("dirty log: guest page {page:#x} lies past the log's {} bytes; not marked", self.len);
                }
                return;
            };
            // Release: the bytes written to the page are visible before the
            // mark that tells QEMU to send it again.
            byte.fetch_or(1 << (page % 8), Ordering::Release);
        }
    }

    fn byte(&self, index: u64) -> Option<&AtomicU8> {
        let index = usize::try_from(index).ok().filter(|&i| i < self.len)?;
        // SAFETY: `offset + index` lies inside the mapping (`index < len`,
        // and `map` checked that `offset + len` bytes are mapped), which
        // lives as long as `self`; the front-end updates the same bytes, but
        // only atomically.
        Some(unsafe { AtomicU8::from_ptr(self.map.as_ptr().add(self.offset + index)) })
    }
}

/// Where a worker records the guest memory its requests wrote: the dirty
/// log during a migration, nothing otherwise. The worker picks one per
/// batch, so that without a log the request path pays nothing per request.
pub trait GuestWrites {
    /// Whether anything is recorded: without, the caller skips working out
    /// what a request wrote.
    const RECORDS: bool = true;
    /// Host bytes `host..host + len` of `ram` were written.
    fn wrote(&self, ram: &GuestRam, host: *const u8, len: usize);
}

/// No migration: nothing to record.
pub struct Unlogged;

impl GuestWrites for Unlogged {
    const RECORDS: bool = false;
    #[inline(always)]
    fn wrote(&self, _: &GuestRam, _: *const u8, _: usize) {}
}

impl GuestWrites for DirtyLog {
    fn wrote(&self, ram: &GuestRam, host: *const u8, len: usize) {
        // Buffers were split at region boundaries when the request was
        // parsed, so each lies in one region.
        match ram.guest_addr(host) {
            Some(addr) => self.mark(addr, len as u64),
            None => log::error!("dirty log: a buffer written by the device is not in guest memory; not marked"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_of(size: u64, offset: u64) -> (DirtyLog, File) {
        let file = vsd_sys::memfd("vsd-test-log").unwrap();
        file.set_len(size + offset).unwrap();
        (DirtyLog::map(file.try_clone().unwrap(), size, offset).unwrap(), file)
    }

    fn bits(log: &DirtyLog) -> Vec<u64> {
        (0..log.len as u64 * 8)
            .filter(|&page| log.byte(page / 8).unwrap().load(Ordering::Relaxed) & (1 << (page % 8)) != 0)
            .collect()
    }

    #[test]
    fn a_range_marks_every_page_it_touches_and_no_other() {
        let (log, _file) = log_of(16, 8);
        log.mark(0x1fff, 2);
        assert_eq!(bits(&log), [1, 2], "two bytes across a page boundary");
        log.mark(0x10_000, 0x3000);
        assert_eq!(bits(&log), [1, 2, 16, 17, 18]);
        log.mark(0x20_000, 0);
        assert_eq!(bits(&log), [1, 2, 16, 17, 18], "an empty range marks nothing");
    }

    #[test]
    fn marks_past_the_log_are_dropped_not_written() {
        let (log, file) = log_of(2, 0);
        assert!(log.covers(16 * LOG_PAGE));
        assert!(!log.covers(16 * LOG_PAGE + 1));
        log.mark(15 * LOG_PAGE, 3 * LOG_PAGE);
        assert_eq!(bits(&log), [15]);
        log.mark(u64::MAX - 1, 10);
        assert_eq!(vsd_sys::file_size(&file).unwrap(), 2, "nothing written past the region");
    }

    #[test]
    fn regions_that_do_not_fit_their_file_are_refused() {
        let file = vsd_sys::memfd("vsd-test-log").unwrap();
        file.set_len(4096).unwrap();
        for (size, offset) in [(4097, 0), (4096, 1), (0, 0), (u64::MAX, 2)] {
            let error = DirtyLog::map(file.try_clone().unwrap(), size, offset).err().unwrap();
            assert_eq!(error.kind(), io::ErrorKind::InvalidInput, "{size} at {offset}: {error}");
        }
        let (read, _write) = std::io::pipe().unwrap();
        assert!(DirtyLog::map(File::from(std::os::fd::OwnedFd::from(read)), 8, 0).is_err(), "a pipe is no log");
    }
}
