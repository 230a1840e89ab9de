//! The readahead cache, as QEMU's curl driver keeps it: the last few
//! ranges fetched, each a read and the readahead after it. A read inside
//! one is served from it, or waits for it while it is on its way, so a
//! sequential reader with several requests in flight fetches each byte once.

use std::collections::VecDeque;
use std::io;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

/// Bytes `start..start + data.len()` of the image, once fetched.
pub(crate) struct Chunk {
    pub(crate) start: u64,
    end: u64,
    /// `None` once the fetch failed.
    fetched: OnceLock<Option<Vec<u8>>>,
}

/// A chunk that has come, as its reader sees it.
pub(crate) struct Bytes<'a> {
    pub(crate) start: u64,
    pub(crate) data: &'a [u8],
}

pub(crate) struct Cache {
    /// Most recently used first.
    chunks: Mutex<VecDeque<Arc<Chunk>>>,
    capacity: usize,
}

impl Cache {
    /// A cache of at most `capacity` chunks.
    pub(crate) fn new(capacity: usize) -> Self {
        Self { chunks: Mutex::new(VecDeque::with_capacity(capacity + 1)), capacity }
    }

    /// Reads `start..end` through the cache: from the chunk that holds it,
    /// or from a new chunk `start..fetch_end` that `fetch` brings. Calls
    /// `with` with the chunk's bytes.
    pub(crate) fn read<F, W>(&self, start: u64, end: u64, fetch_end: u64, fetch: F, with: W) -> io::Result<()>
    where
        F: FnOnce(u64, u64) -> io::Result<Vec<u8>>,
        W: FnOnce(Bytes<'_>) -> io::Result<()>,
    {
        let (chunk, mine) = self.find_or_add(start, end, fetch_end);
        if mine {
            let fetched = fetch(chunk.start, chunk.end);
            let failed = fetched.as_ref().err().map(|e| io::Error::new(e.kind(), e.to_string()));
            // Only the chunk's maker sets it.
            let _ = chunk.fetched.set(fetched.ok());
            if let Some(e) = failed {
                self.forget(&chunk);
                return Err(e);
            }
        }
        match chunk.fetched.wait() {
            Some(data) => with(Bytes { start: chunk.start, data }),
            None => Err(io::Error::other("the read it waited for failed")),
        }
    }

    /// The chunk holding `start..end`, fetched or on its way, or a new one
    /// for `start..fetch_end` that the caller must fetch (`true`).
    fn find_or_add(&self, start: u64, end: u64, fetch_end: u64) -> (Arc<Chunk>, bool) {
        let mut chunks = self.chunks.lock().unwrap_or_else(PoisonError::into_inner);
        let hit =
            chunks.iter().position(|c| c.start <= start && end <= c.end && !matches!(c.fetched.get(), Some(None)));
        if let Some(at) = hit {
            chunks.make_contiguous()[..=at].rotate_right(1);
            return (chunks[0].clone(), false);
        }
        let chunk = Arc::new(Chunk { start, end: fetch_end, fetched: OnceLock::new() });
        chunks.push_front(chunk.clone());
        chunks.truncate(self.capacity);
        (chunk, true)
    }

    /// Drops a chunk whose fetch failed, so that the next read tries again.
    fn forget(&self, chunk: &Arc<Chunk>) {
        self.chunks.lock().unwrap_or_else(PoisonError::into_inner).retain(|c| !Arc::ptr_eq(c, chunk));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn bytes(start: u64, end: u64) -> Vec<u8> {
        (start..end).map(|i| i as u8).collect()
    }

    /// Reads `start..end` through `cache`, counting fetches in `fetches`.
    fn read(cache: &Cache, fetches: &AtomicUsize, start: u64, end: u64, fetch_end: u64) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        cache.read(
            start,
            end,
            fetch_end,
            |s, e| {
                fetches.fetch_add(1, Ordering::Relaxed);
                Ok(bytes(s, e))
            },
            |b| {
                let at = (start - b.start) as usize;
                out.extend_from_slice(&b.data[at..at + (end - start) as usize]);
                Ok(())
            },
        )?;
        Ok(out)
    }

    #[test]
    fn reads_inside_a_chunk_are_not_fetched_again() {
        let (cache, fetches) = (Cache::new(2), AtomicUsize::new(0));
        assert_eq!(read(&cache, &fetches, 10, 20, 100).unwrap(), bytes(10, 20));
        assert_eq!(read(&cache, &fetches, 50, 100, 100).unwrap(), bytes(50, 100), "inside the readahead");
        assert_eq!(fetches.load(Ordering::Relaxed), 1);
        assert_eq!(read(&cache, &fetches, 90, 110, 110).unwrap(), bytes(90, 110), "past its end");
        assert_eq!(fetches.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn the_least_recently_used_chunk_goes_first() {
        let (cache, fetches) = (Cache::new(2), AtomicUsize::new(0));
        for start in [0, 100, 0, 200, 0] {
            read(&cache, &fetches, start, start + 10, start + 10).unwrap();
        }
        assert_eq!(fetches.load(Ordering::Relaxed), 3, "0 stayed, 100 went");
        read(&cache, &fetches, 100, 110, 110).unwrap();
        assert_eq!(fetches.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn a_failed_fetch_is_tried_again() {
        let (cache, fetches) = (Cache::new(2), AtomicUsize::new(0));
        let failed = cache.read(0, 10, 10, |_, _| Err(io::Error::other("down")), |_| Ok(()));
        assert_eq!(failed.unwrap_err().to_string(), "down");
        assert_eq!(read(&cache, &fetches, 0, 10, 10).unwrap(), bytes(0, 10));
    }
}
