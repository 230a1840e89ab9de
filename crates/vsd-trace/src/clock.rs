//! The clock the request path stamps with.
//!
//! A request is stamped up to six times, so the clock read must cost next to
//! nothing: `clock_gettime` through the vDSO is ~140 instructions with its
//! scaling, the time-stamp counter one. Where the kernel itself keeps time
//! with the TSC (its clocksource is `tsc`: invariant and synchronised across
//! CPUs), stamps are raw TSC ticks, and only a difference is scaled to
//! nanoseconds, with one multiplication. Elsewhere stamps are nanoseconds
//! of `CLOCK_MONOTONIC`.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long the TSC is measured against `CLOCK_MONOTONIC`, once per process.
const CALIBRATION: Duration = Duration::from_millis(20);

/// A calibrated clock: [`Clock::now`] gives ticks, [`Clock::ns`] turns a
/// difference of ticks into nanoseconds.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    /// Nanoseconds per tick, as a 32.32 fixed-point number.
    ns_per_tick: u64,
    tsc: bool,
}

impl Clock {
    /// A clock whose ticks are nanoseconds: what histograms fed with
    /// nanoseconds are read with.
    pub const NANOSECONDS: Clock = Clock { ns_per_tick: 1 << 32, tsc: false };

    /// The process's clock, calibrated by the first caller (which waits
    /// [`CALIBRATION`] if the TSC is used).
    pub fn get() -> Clock {
        static CLOCK: OnceLock<Clock> = OnceLock::new();
        *CLOCK.get_or_init(|| if kernel_trusts_tsc() { calibrate() } else { Clock::NANOSECONDS })
    }

    /// The current time in ticks.
    #[inline]
    pub fn now(self) -> u64 {
        if self.tsc { read_tsc() } else { crate::now_ns() }
    }

    /// Nanoseconds in `ticks` (a difference of two [`Clock::now`]).
    #[inline]
    pub fn ns(self, ticks: u64) -> u64 {
        ((u128::from(ticks) * u128::from(self.ns_per_tick)) >> 32) as u64
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn read_tsc() -> u64 {
    // SAFETY: RDTSC reads a register; every x86_64 CPU has it, and the
    // kernel allows it in user mode (it uses the TSC as its clock).
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(not(target_arch = "x86_64"))]
fn read_tsc() -> u64 {
    crate::now_ns()
}

/// A clock with whole ticks per nanosecond (faster than 1 GHz, as a TSC
/// is), for tests of scaling.
#[cfg(test)]
pub(crate) fn with_ticks_per_ns(ticks: u64) -> Clock {
    Clock { ns_per_tick: (1 << 32) / ticks, tsc: false }
}

/// A clock with whole nanoseconds per tick, for tests of scaling.
#[cfg(test)]
pub(crate) fn with_ns_per_tick(ns: u64) -> Clock {
    Clock { ns_per_tick: ns << 32, tsc: false }
}

fn kernel_trusts_tsc() -> bool {
    let path = "/sys/devices/system/clocksource/clocksource0/current_clocksource";
    cfg!(target_arch = "x86_64") && std::fs::read_to_string(path).is_ok_and(|s| s.trim() == "tsc")
}

fn calibrate() -> Clock {
    let (start, ticks0) = (Instant::now(), read_tsc());
    std::thread::sleep(CALIBRATION);
    let (elapsed, ticks) = (start.elapsed(), read_tsc().wrapping_sub(ticks0));
    let ns_per_tick = ((elapsed.as_nanos() << 32) / u128::from(ticks.max(1))) as u64;
    Clock { ns_per_tick, tsc: true }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_scale_to_the_monotonic_clock() {
        let clock = Clock::get();
        let (start, t0) = (Instant::now(), clock.now());
        std::thread::sleep(Duration::from_millis(50));
        let (wall, ticks) = (start.elapsed().as_nanos() as f64, clock.now() - t0);
        let measured = clock.ns(ticks) as f64;
        assert!((measured / wall - 1.0).abs() < 0.02, "{measured} ns by the clock vs {wall} ns");
    }
}
