//! A counter with a single writer.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// A 64-bit counter or gauge written by one thread and read by any.
///
/// Only one thread may call [`add`](Self::add) or [`set`](Self::set): an
/// update is a relaxed load then a relaxed store, not an atomic
/// read-modify-write, so concurrent writers would lose updates. In exchange it
/// costs what a plain `u64` increment does. [`get`](Self::get) may be called
/// from any thread at any time.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// A counter at zero.
    pub const fn new() -> Self {
        Self(AtomicU64::new(0))
    }

    /// Adds `n`, wrapping on overflow. Single writer only.
    #[inline]
    pub fn add(&self, n: u64) {
        self.set(self.get().wrapping_add(n));
    }

    /// Sets the value, for gauges. Single writer only.
    #[inline]
    pub fn set(&self, v: u64) {
        self.0.store(v, Relaxed);
    }

    /// The current value.
    #[inline]
    pub fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_set_get() {
        let c = Counter::new();
        c.add(3);
        c.add(4);
        assert_eq!(c.get(), 7);
        c.set(2);
        assert_eq!(c.get(), 2);
        c.set(u64::MAX);
        c.add(2);
        assert_eq!(c.get(), 1);
    }
}
