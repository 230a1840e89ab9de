//! Runs of equal values, recorded once per run.
//!
//! A worker stamps a batch of requests once, not each request: every
//! request of the batch then has the same stamps, hence the same stage
//! times, and one [`Histogram::record_n`](crate::Histogram::record_n) per
//! run costs what one record did, however long the batch.

/// Values in arrival order, with consecutive equal ones counted together.
///
/// Allocation-free once [`Runs::with_capacity`] covers the longest series
/// between drains (at most one run per value).
#[derive(Debug)]
pub struct Runs<K> {
    runs: Vec<(K, u64)>,
}

impl<K: Copy + PartialEq> Runs<K> {
    /// No runs, with room for `capacity` of them.
    pub fn with_capacity(capacity: usize) -> Self {
        Self { runs: Vec::with_capacity(capacity) }
    }

    /// Adds one occurrence of `value`: to the last run if equal, as a new run otherwise.
    #[inline]
    pub fn push(&mut self, value: K) {
        match self.runs.last_mut() {
            Some((last, n)) if *last == value => *n += 1,
            _ => self.runs.push((value, 1)),
        }
    }

    /// Whether no value was pushed since the last drain.
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// Each run as (value, occurrences), oldest first, leaving none.
    pub fn drain(&mut self) -> impl Iterator<Item = (K, u64)> + '_ {
        self.runs.drain(..)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_neighbours_share_a_run() {
        let mut runs = Runs::with_capacity(4);
        assert!(runs.is_empty());
        for v in [7, 7, 7, 3, 7, 7] {
            runs.push(v);
        }
        assert_eq!(runs.drain().collect::<Vec<_>>(), [(7, 3), (3, 1), (7, 2)]);
        assert!(runs.is_empty());
        runs.push(1);
        assert_eq!(runs.drain().collect::<Vec<_>>(), [(1, 1)]);
    }
}
