//! A log-linear latency histogram with a single writer, and its snapshots.
//!
//! Values below 32 ns have a bucket each. Above, every power of two is split
//! into 32 equal sub-buckets, so a bucket is at most 1/32 of its values wide.
//! Values from 2^40 ns (about 18 minutes) up share the last bucket.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use crate::{Clock, Counter};

/// log2 of the number of sub-buckets per power of two.
const SUB_BITS: u32 = 5;
/// Values at or above `1 << MAX_BITS` are clamped into the last bucket.
const MAX_BITS: u32 = 40;
/// 64 buckets of width 1 below 64, then 32 per power of two up to 2^40: 1152.
const BUCKETS: usize = ((MAX_BITS - SUB_BITS + 1) << SUB_BITS) as usize;

/// The bucket holding `ns`.
#[inline]
fn bucket_index(ns: u64) -> usize {
    let v = ns.min((1 << MAX_BITS) - 1);
    // Drop all but the top SUB_BITS + 1 bits; below 64 that drops nothing.
    let shift = (v | 1).ilog2().saturating_sub(SUB_BITS);
    // `v >> shift` is in [32, 64) once shifting starts, so each shift owns 32 buckets.
    (((shift as u64) << SUB_BITS) + (v >> shift)) as usize
}

/// The largest value `bucket_index` maps to bucket `index`.
fn bucket_upper_bound(index: usize) -> u64 {
    let i = index as u64;
    let shift = (i >> SUB_BITS).saturating_sub(1) as u32;
    ((i - ((shift as u64) << SUB_BITS) + 1) << shift) - 1
}

/// Buckets per group: the values of one power of two.
const GROUP: usize = 1 << SUB_BITS;
const GROUPS: usize = BUCKETS / GROUP;

/// A group's buckets, allocated by the first value it counts.
type Group = OnceLock<Box<[Counter; GROUP]>>;

/// A latency histogram in nanoseconds, written by one thread and read by any.
///
/// As with [`Counter`], only one thread may record; [`snapshot`](Self::snapshot)
/// may be taken from any thread at any time.
pub struct Histogram {
    /// Allocated by the first record: an export's queues hold a dozen
    /// histograms each, and an idle export needs none of them. Each group
    /// comes with its first value: latencies cluster in a few powers of
    /// two, so a histogram that has served holds a few of its 36 groups
    /// (256 bytes each), and an export that has served costs a few KiB a
    /// queue instead of 9 KiB a histogram.
    groups: OnceLock<Box<[Group; GROUPS]>>,
    sum: Counter,
}

impl Histogram {
    /// An empty histogram.
    pub fn new() -> Self {
        Self { groups: OnceLock::new(), sum: Counter::new() }
    }

    /// Records one value. Single writer only.
    #[inline]
    pub fn record(&self, ns: u64) {
        self.record_n(ns, 1);
    }

    /// Records `n` occurrences of the same value. Single writer only.
    #[inline]
    pub fn record_n(&self, ns: u64, n: u64) {
        let index = bucket_index(ns);
        let groups = self.groups.get_or_init(|| Box::new(std::array::from_fn(|_| OnceLock::new())));
        let group = groups[index / GROUP].get_or_init(|| Box::new(std::array::from_fn(|_| Counter::new())));
        group[index % GROUP].add(n);
        self.sum.add(ns.wrapping_mul(n));
    }

    /// A copy of the current contents.
    ///
    /// The count is taken from the buckets, so it always agrees with them;
    /// only the sum may be off by the values recorded while copying.
    pub fn snapshot(&self) -> HistogramSnapshot {
        self.snapshot_in(Clock::NANOSECONDS)
    }

    /// A copy of the current contents, for values recorded in `clock`'s
    /// ticks: bucket bounds and sum are turned into nanoseconds here, once,
    /// rather than every value when it is recorded.
    pub fn snapshot_in(&self, clock: Clock) -> HistogramSnapshot {
        let Some(groups) = self.groups.get() else { return HistogramSnapshot::default() };
        let counted = groups.iter().enumerate().filter_map(|(g, group)| Some((g * GROUP, group.get()?)));
        let buckets = counted
            .flat_map(|(first, group)| group.iter().enumerate().map(move |(i, c)| (first + i, c.get())))
            .filter(|&(_, n)| n != 0)
            .map(|(i, n)| (clock.ns(bucket_upper_bound(i)), n))
            .collect::<Vec<_>>();
        // A clock faster than 1 GHz maps neighbouring buckets of small
        // values to the same bound in nanoseconds: one bucket each.
        let buckets = combine(&buckets, &[], u64::wrapping_add);
        HistogramSnapshot::from_buckets(buckets, clock.ns(self.sum.get()))
    }
}

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Histogram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.snapshot();
        f.debug_struct("Histogram").field("count", &s.count).field("sum_ns", &s.sum_ns).finish()
    }
}

/// A point-in-time copy of a [`Histogram`].
///
/// Serialized compactly as `count`, `sum_ns` and `buckets`, the non-empty
/// buckets only, as `[upper_bound_ns_inclusive, count]` pairs sorted by bound.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HistogramSnapshot {
    count: u64,
    sum_ns: u64,
    buckets: Vec<(u64, u64)>,
}

impl HistogramSnapshot {
    fn from_buckets(buckets: Vec<(u64, u64)>, sum_ns: u64) -> Self {
        Self { count: buckets.iter().map(|&(_, n)| n).sum(), sum_ns, buckets }
    }

    /// Number of values recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of the values recorded, in nanoseconds.
    pub fn sum_ns(&self) -> u64 {
        self.sum_ns
    }

    /// Mean value in nanoseconds; 0 when empty.
    pub fn mean_ns(&self) -> f64 {
        if self.count == 0 { 0.0 } else { self.sum_ns as f64 / self.count as f64 }
    }

    /// Adds `other`'s values to these.
    pub fn merge(&mut self, other: &HistogramSnapshot) {
        let buckets = combine(&self.buckets, &other.buckets, u64::wrapping_add);
        *self = Self::from_buckets(buckets, self.sum_ns.wrapping_add(other.sum_ns));
    }

    /// The values recorded since `baseline` was taken: `self - baseline`,
    /// saturating at zero.
    pub fn since(&self, baseline: &HistogramSnapshot) -> HistogramSnapshot {
        Self::from_buckets(
            combine(&self.buckets, &baseline.buckets, u64::saturating_sub),
            self.sum_ns.saturating_sub(baseline.sum_ns),
        )
    }

    /// The value at quantile `q` in [0, 1]: the upper bound of the bucket
    /// holding it, so at most 1/32 above the true value. 0 when empty.
    pub fn quantile_ns(&self, q: f64) -> u64 {
        // 1-based rank of the value sought: q = 0 is the smallest value, q = 1 the largest.
        let rank = ((q * self.count as f64).ceil() as u64).clamp(1, self.count.max(1));
        let mut seen = 0;
        self.buckets
            .iter()
            .find(|&&(_, n)| {
                seen += n;
                seen >= rank
            })
            .map_or(0, |&(bound, _)| bound)
    }

    /// Number of values `<= bound_ns`.
    ///
    /// A bucket counts as a whole, and only if its upper bound is
    /// `<= bound_ns`: values in a bucket that straddles `bound_ns` count as
    /// above it. The result is exact when `bound_ns` is a bucket's upper bound.
    pub fn count_le(&self, bound_ns: u64) -> u64 {
        self.buckets.iter().filter(|&&(bound, _)| bound <= bound_ns).map(|&(_, n)| n).sum()
    }

    /// QEMU's block-latency-histogram bins: for increasing `boundaries_ns`
    /// `[b0, ..., bn-1]`, the counts in `[0, b0)`, `[b0, b1)`, ...,
    /// `[bn-1, inf)`.
    ///
    /// A bucket falls below `b` as in [`count_le`](Self::count_le) at `b - 1`:
    /// iff its upper bound is below `b`. The bins always sum to
    /// [`count`](Self::count), and are exact when every boundary is the lower
    /// bound of a bucket.
    pub fn bins(&self, boundaries_ns: &[u64]) -> Vec<u64> {
        let mut bins = vec![0; boundaries_ns.len() + 1];
        for &(bound, n) in &self.buckets {
            bins[boundaries_ns.partition_point(|&b| b <= bound)] += n;
        }
        bins
    }
}

/// Combines the counts of two bucket lists bound by bound, missing buckets
/// counting 0, and keeps the non-empty results in order.
fn combine(a: &[(u64, u64)], b: &[(u64, u64)], op: fn(u64, u64) -> u64) -> Vec<(u64, u64)> {
    let mut counts = BTreeMap::<u64, [u64; 2]>::new();
    for (side, list) in [a, b].into_iter().enumerate() {
        for &(bound, n) in list {
            counts.entry(bound).or_default()[side] += n;
        }
    }
    counts.into_iter().map(|(bound, [x, y])| (bound, op(x, y))).filter(|&(_, n)| n != 0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lower_bound(index: usize) -> u64 {
        if index == 0 { 0 } else { bucket_upper_bound(index - 1) + 1 }
    }

    /// Values around every bucket edge, plus a spread in between.
    fn probe_values() -> impl Iterator<Item = u64> {
        let edges = (0..BUCKETS).flat_map(|i| {
            let (lo, hi) = (lower_bound(i), bucket_upper_bound(i));
            [lo, hi, lo + (hi - lo) / 2]
        });
        edges.chain((0..10_000u64).map(|i| i * i * 7919))
    }

    /// With a TSC (2.5 ticks per ns here), ticks 0..8 fall in eight buckets
    /// whose bounds scale to two or three nanosecond values: no count may
    /// be lost when snapshots are merged or subtracted (a stage table once
    /// showed kick -> pop with fewer requests than the other stages).
    #[test]
    fn buckets_that_scale_to_one_bound_keep_their_counts() {
        let h = Histogram::new();
        for ticks in 0..8 {
            h.record(ticks);
        }
        let clock = crate::clock::with_ticks_per_ns(4);
        let snap = h.snapshot_in(clock);
        assert_eq!(snap.count(), 8);
        assert!(snap.buckets.windows(2).all(|w| w[0].0 < w[1].0), "one bucket per bound: {:?}", snap.buckets);
        let empty = Histogram::new().snapshot_in(clock);
        assert_eq!(snap.since(&empty).count(), 8);
        let mut merged = empty.clone();
        merged.merge(&snap);
        merged.merge(&snap);
        assert_eq!(merged.count(), 16);
    }

    #[test]
    fn buckets_are_allocated_by_the_first_record() {
        let h = Histogram::new();
        assert_eq!(h.snapshot(), HistogramSnapshot::default());
        assert!(h.groups.get().is_none(), "an idle histogram holds no buckets");
        h.record(1000);
        h.record(1010);
        h.record(3_000_000);
        let groups = h.groups.get().expect("the first record allocates the groups' table");
        let held: Vec<usize> = (0..GROUPS).filter(|&g| groups[g].get().is_some()).collect();
        assert_eq!(held, [bucket_index(1000) / GROUP, bucket_index(3_000_000) / GROUP], "only the groups counted in");
        assert_eq!(h.snapshot().count, 3);
    }

    #[test]
    fn buckets_tile_the_range() {
        assert_eq!(lower_bound(0), 0);
        assert_eq!(bucket_upper_bound(BUCKETS - 1), (1 << MAX_BITS) - 1);
        for i in 1..BUCKETS {
            assert!(bucket_upper_bound(i) > bucket_upper_bound(i - 1), "bucket {i}");
        }
    }

    #[test]
    fn every_value_lands_in_its_bucket() {
        let mut values: Vec<u64> = probe_values().filter(|&v| v < 1 << MAX_BITS).collect();
        values.sort_unstable();
        let mut last = 0;
        for v in values {
            let i = bucket_index(v);
            assert!(i < BUCKETS);
            assert!((lower_bound(i)..=bucket_upper_bound(i)).contains(&v), "{v} in bucket {i}");
            let error = (bucket_upper_bound(i) - v) as f64;
            assert!(error <= v as f64 / 32.0, "{v}: bound {}", bucket_upper_bound(i));
            assert!(i >= last, "index not monotonic at {v}");
            last = i;
        }
    }

    #[test]
    fn values_below_32_are_exact() {
        for v in 0..64 {
            assert_eq!(bucket_upper_bound(bucket_index(v)), v);
        }
    }

    #[test]
    fn huge_values_are_clamped() {
        for v in [1 << MAX_BITS, (1 << MAX_BITS) + 12345, u64::MAX] {
            assert_eq!(bucket_index(v), BUCKETS - 1);
        }
        let h = Histogram::new();
        h.record(u64::MAX / 2);
        assert_eq!(h.snapshot().quantile_ns(1.0), (1 << MAX_BITS) - 1);
        assert_eq!(h.snapshot().sum_ns(), u64::MAX / 2);
    }

    fn uniform(lo: u64, hi: u64) -> Histogram {
        let h = Histogram::new();
        (lo..=hi).for_each(|v| h.record(v));
        h
    }

    #[test]
    fn quantiles_and_mean_of_uniform_values() {
        let s = uniform(1, 100_000).snapshot();
        assert_eq!(s.count(), 100_000);
        assert_eq!(s.sum_ns(), 100_000 * 100_001 / 2);
        assert_eq!(s.mean_ns(), 50_000.5);
        for (q, exact) in [(0.0, 1.0), (0.5, 50_000.0), (0.9, 90_000.0), (0.99, 99_000.0), (1.0, 100_000.0)] {
            let got = s.quantile_ns(q) as f64;
            assert!(got >= exact && got <= exact * (1.0 + 1.0 / 32.0), "q{q}: {got} vs {exact}");
        }
    }

    #[test]
    fn quantiles_of_two_spikes() {
        let h = Histogram::new();
        h.record_n(10, 90);
        h.record_n(1_000_000, 10);
        let s = h.snapshot();
        assert_eq!(s.quantile_ns(0.5), 10);
        assert_eq!(s.quantile_ns(0.9), 10);
        assert!((1_000_000..=1_000_000 + 1_000_000 / 32).contains(&s.quantile_ns(0.91)));
        assert_eq!(s.mean_ns(), (900 + 10_000_000) as f64 / 100.0);
    }

    #[test]
    fn empty_snapshot() {
        let s = Histogram::new().snapshot();
        assert_eq!((s.count(), s.sum_ns(), s.mean_ns(), s.quantile_ns(0.5)), (0, 0, 0.0, 0));
        assert_eq!(s.bins(&[10, 20]), [0, 0, 0]);
        assert_eq!(s, HistogramSnapshot::default());
    }

    #[test]
    fn merge_and_since() {
        let (a, b) = (uniform(1, 1000), uniform(500, 5000));
        let mut merged = a.snapshot();
        merged.merge(&b.snapshot());
        let both = uniform(1, 1000);
        (500..=5000).for_each(|v| both.record(v));
        assert_eq!(merged, both.snapshot());
        assert_eq!(merged.since(&a.snapshot()), b.snapshot());
        assert_eq!(a.snapshot().since(&merged), HistogramSnapshot::default());
    }

    #[test]
    fn since_a_baseline_of_the_same_histogram() {
        let h = uniform(1, 1000);
        let baseline = h.snapshot();
        h.record_n(77, 3);
        let delta = h.snapshot().since(&baseline);
        assert_eq!((delta.count(), delta.sum_ns(), delta.quantile_ns(0.0)), (3, 231, 77));
    }

    #[test]
    fn count_le_counts_whole_buckets() {
        let h = Histogram::new();
        h.record_n(1000, 2); // bucket [992, 1007]
        h.record(10);
        let s = h.snapshot();
        assert_eq!(s.count_le(9), 0);
        assert_eq!(s.count_le(10), 1);
        assert_eq!(s.count_le(1000), 1);
        assert_eq!(s.count_le(1007), 3);
        assert_eq!(s.count_le(u64::MAX), 3);
    }

    #[test]
    fn bins_match_brute_force_on_bucket_edges() {
        let values: Vec<u64> = probe_values().collect();
        let h = Histogram::new();
        values.iter().for_each(|&v| h.record(v));
        let s = h.snapshot();
        let boundaries: Vec<u64> =
            [5, 40, 100, 300, 700, 2000, 90_000, 1 << 30].map(bucket_index).map(lower_bound).into();
        let bins = s.bins(&boundaries);
        assert_eq!(bins.iter().sum::<u64>(), s.count());
        for (i, &got) in bins.iter().enumerate() {
            let lo = if i == 0 { 0 } else { boundaries[i - 1] };
            let hi = boundaries.get(i).copied().unwrap_or(u64::MAX);
            let expected = values.iter().filter(|&&v| (lo..hi).contains(&v)).count() as u64;
            assert_eq!(got, expected, "bin {i}: [{lo}, {hi})");
        }
        // Off-edge boundaries still account for every value.
        assert_eq!(s.bins(&[1, 1001, 123_457]).iter().sum::<u64>(), s.count());
    }

    #[test]
    fn json_round_trip_is_compact() {
        let h = Histogram::new();
        h.record_n(5, 2);
        h.record(1000);
        let s = h.snapshot();
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(json, r#"{"count":3,"sum_ns":1010,"buckets":[[5,2],[1007,1]]}"#);
        assert_eq!(serde_json::from_str::<HistogramSnapshot>(&json).unwrap(), s);
    }

    #[test]
    fn concurrent_reader_sees_counts_grow() {
        const N: u64 = 1_000_000;
        let h = Histogram::new();
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                (0..N).for_each(|i| h.record(i % 5000));
                done.store(true, std::sync::atomic::Ordering::Release);
            });
            let mut last = 0;
            while !done.load(std::sync::atomic::Ordering::Acquire) {
                let count = h.snapshot().count();
                assert!(count >= last, "count went back from {last} to {count}");
                last = count;
            }
        });
        assert_eq!(h.snapshot().count(), N);
    }
}
