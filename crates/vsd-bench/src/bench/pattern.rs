//! Per-job choice of request kind and offset, without allocation.

use super::RwMode;

/// xorshift64* generator: fast, allocation-free, good enough to spread
/// offsets; not for anything security-related.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        // Mix the seed so that consecutive job numbers diverge; never zero.
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..bound` (Lemire's multiply-shift; `bound > 0`).
    pub(crate) fn below(&mut self, bound: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(bound)) >> 64) as u64
    }
}

/// Generates the kind and offset of each request of one job.
#[derive(Clone, Debug)]
pub(crate) struct IoPattern {
    rng: Rng,
    random: bool,
    read_percent: u8,
    bs: u64,
    blocks: u64,
    next_block: u64,
}

/// One request to submit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NextIo {
    pub(crate) is_read: bool,
    pub(crate) offset: u64,
}

impl IoPattern {
    /// `size` bytes starting at offset 0 are split into `bs`-sized blocks;
    /// sequential jobs start at their share `job / jobs` of the region.
    pub(crate) fn new(rw: RwMode, read_percent: u8, bs: u64, size: u64, job: u32, jobs: u32) -> IoPattern {
        let blocks = (size / bs).max(1);
        IoPattern {
            rng: Rng::new(u64::from(job) + 1),
            random: rw.is_random(),
            read_percent,
            bs,
            blocks,
            next_block: blocks / u64::from(jobs.max(1)) * u64::from(job),
        }
    }

    pub(crate) fn next_io(&mut self) -> NextIo {
        let is_read = match self.read_percent {
            100 => true,
            0 => false,
            pct => self.rng.below(100) < u64::from(pct),
        };
        let block = if self.random { self.rng.below(self.blocks) } else { self.next_sequential_block() };
        NextIo { is_read, offset: block * self.bs }
    }

    fn next_sequential_block(&mut self) -> u64 {
        let block = self.next_block % self.blocks;
        self.next_block = block + 1;
        block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_offsets_stay_in_region_and_aligned() {
        let mut p = IoPattern::new(RwMode::RandRead, 100, 4096, 1 << 20, 0, 1);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..10_000 {
            let io = p.next_io();
            assert!(io.is_read);
            assert!(io.offset + 4096 <= 1 << 20);
            assert_eq!(io.offset % 4096, 0);
            seen.insert(io.offset);
        }
        assert_eq!(seen.len(), 256, "all 256 blocks are hit");
    }

    #[test]
    fn sequential_wraps_and_jobs_start_apart() {
        let mut p = IoPattern::new(RwMode::Write, 0, 512, 2048, 1, 2);
        let offsets: Vec<_> = (0..5).map(|_| p.next_io().offset).collect();
        assert_eq!(offsets, vec![1024, 1536, 0, 512, 1024]);
        assert!(!p.next_io().is_read);
    }

    #[test]
    fn mix_is_roughly_respected() {
        let mut p = IoPattern::new(RwMode::RandRw, 70, 4096, 1 << 30, 3, 4);
        let reads = (0..100_000).filter(|_| p.next_io().is_read).count();
        assert!((68_000..72_000).contains(&reads), "{reads} reads");
    }
}
