//! Throttle groups: I/O limits that the `throttle` nodes naming a group
//! share, with QEMU's names and QEMU's `docs/throttle.txt` semantics.
//!
//! Each limit is a leaky bucket: a request is admitted while the bucket
//! holds less than its size, adds its bytes (or one operation; more for
//! requests over `iops-size`) to it, and the bucket leaks at the limit's
//! rate. Without a burst rate (`-max`) a bucket holds a tenth of a second
//! of I/O; with one, `-max-length` seconds at the burst rate, and a second
//! bucket of a tenth of a second at the burst rate keeps bursts to it.
//! `total` limits count reads and writes, `read` and `write` ones their
//! direction only; a request waits until every bucket that counts it
//! admits it. Limits change live (`qom-set`); buckets keep their levels.
//!
//! Members (the queues of the group's nodes) take turns, as in QEMU: while
//! one waits for a direction, the others line up behind it, each admitted
//! one request per turn, and the group wakes the next in line
//! ([`Member`]) when a turn passes.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use crate::options::OptionMap;

/// QEMU's `THROTTLE_VALUE_MAX`.
pub const MAX_VALUE: u64 = 1_000_000_000_000_000;

/// Which way a request moves data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Reads.
    Read,
    /// Writes, write-zeroes and discards.
    Write,
}

/// One limit: a rate, an optional burst rate, and how long a burst lasts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit {
    /// Units (bytes or operations) per second; 0: no limit.
    pub avg: u64,
    /// The burst rate; 0: bursts of a tenth of a second at `avg`.
    pub max: u64,
    /// Seconds a burst at `max` may last (at least 1).
    pub max_length: u64,
}

impl Default for Limit {
    fn default() -> Self {
        Self { avg: 0, max: 0, max_length: 1 }
    }
}

/// The six limits, in the order of [`KINDS`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    /// `bps-total`, `bps-read`, `bps-write`, `iops-total`, `iops-read`, `iops-write`.
    pub limits: [Limit; 6],
    /// `iops-size`: a request counts one operation per this many bytes.
    pub iops_size: u64,
}

/// The limits' names, as QEMU's `ThrottleLimits` spells them.
pub const KINDS: [&str; 6] = ["bps-total", "bps-read", "bps-write", "iops-total", "iops-read", "iops-write"];

impl Limits {
    /// The limits given as options under `prefix` (`limits.` on the command
    /// line, as QMP's nested object; `x-` is QEMU's older spelling).
    pub fn from_options(opts: &mut OptionMap) -> Result<Self, String> {
        let mut value = Map::new();
        for prefix in ["limits.", "x-"] {
            for key in Self::keys() {
                if let Some(text) = opts.take_number(&format!("{prefix}{key}")).map_err(|e| e.to_string())? {
                    let number: i128 = text.parse().map_err(|_| format!("Parameter '{key}' expects an integer"))?;
                    value.insert(key, json!(number));
                }
            }
        }
        Self::from_json(&Value::Object(value))
    }

    /// The limits of a QMP `ThrottleLimits` object; members not given are 0
    /// (bursts of 1 s), as `qom-set` replaces them all.
    pub fn from_json(value: &Value) -> Result<Self, String> {
        let object = value.as_object().ok_or("Invalid parameter type for 'limits', expected: object")?;
        let mut limits = Limits::default();
        for (key, number) in object {
            let number = number.as_i64().map(i128::from).or_else(|| number.as_u64().map(i128::from));
            let number = number.ok_or_else(|| format!("Invalid parameter type for '{key}', expected: integer"))?;
            if !(0..=i128::from(MAX_VALUE)).contains(&number) {
                return Err(format!("bps/iops/max values must be within [0, {MAX_VALUE}]"));
            }
            *limits.field(key).ok_or_else(|| format!("Parameter '{key}' is unexpected"))? = number as u64;
        }
        limits.check()?;
        Ok(limits)
    }

    /// As QMP's `qom-get` shows them.
    pub fn to_json(&self) -> Value {
        let mut limits = *self;
        Value::Object(Self::keys().map(|key| (key.clone(), json!(limits.field(&key).map_or(0, |v| *v)))).collect())
    }

    /// The limits' keys: each kind, with `-max` and `-max-length`, and
    /// `iops-size`.
    pub fn keys() -> impl Iterator<Item = String> {
        let per_kind = KINDS.iter().flat_map(|k| [k.to_string(), format!("{k}-max"), format!("{k}-max-length")]);
        per_kind.chain(std::iter::once("iops-size".to_string()))
    }

    fn field(&mut self, key: &str) -> Option<&mut u64> {
        if key == "iops-size" {
            return Some(&mut self.iops_size);
        }
        let (kind, part) = KINDS.iter().enumerate().find_map(|(i, k)| Some((i, key.strip_prefix(k)?)))?;
        let limit = &mut self.limits[kind];
        match part {
            "" => Some(&mut limit.avg),
            "-max" => Some(&mut limit.max),
            "-max-length" => Some(&mut limit.max_length),
            _ => None,
        }
    }

    /// QEMU's checks (`throttle_is_valid`), in its words.
    fn check(&self) -> Result<(), String> {
        for group in [0, 3] {
            let [total, read, write] = [0, 1, 2].map(|i| self.limits[group + i]);
            let set = |l: Limit| l.avg != 0 || l.max != 0;
            if set(total) && (set(read) || set(write)) {
                return Err("bps/iops/max total values and read/write values cannot be used at the same time".into());
            }
        }
        for limit in self.limits {
            if limit.max != 0 && limit.avg == 0 {
                return Err("bps_max/iops_max require corresponding bps/iops values".into());
            }
            if limit.max != 0 && limit.max < limit.avg {
                return Err("bps_max/iops_max cannot be lower than bps/iops".into());
            }
            if limit.max_length == 0 {
                return Err("the burst length cannot be 0".into());
            }
            if limit.max_length > 1 && limit.max == 0 {
                return Err("burst length set without burst rate".into());
            }
        }
        Ok(())
    }

    fn any(&self) -> bool {
        self.limits.iter().any(|l| l.avg != 0)
    }
}

/// How full one limit's buckets are, in its units.
#[derive(Clone, Copy, Debug, Default)]
struct Bucket {
    level: f64,
    burst_level: f64,
}

impl Bucket {
    fn leak(&mut self, limit: &Limit, seconds: f64) {
        self.level = (self.level - limit.avg as f64 * seconds).max(0.0);
        if limit.max_length > 1 {
            self.burst_level = (self.burst_level - limit.max as f64 * seconds).max(0.0);
        }
    }

    /// How long until the bucket admits a request (zero: now).
    fn wait(&self, limit: &Limit) -> Duration {
        if limit.avg == 0 {
            return Duration::ZERO;
        }
        let (size, burst_size) = match limit.max {
            0 => (limit.avg as f64 / 10.0, 0.0),
            max => ((max * limit.max_length) as f64, max as f64 / 10.0),
        };
        let over = self.level - size;
        if over > 0.0 {
            return Duration::from_secs_f64(over / limit.avg as f64);
        }
        let burst_over = self.burst_level - burst_size;
        if limit.max_length > 1 && burst_over > 0.0 {
            return Duration::from_secs_f64(burst_over / limit.max as f64);
        }
        Duration::ZERO
    }

    fn fill(&mut self, limit: &Limit, units: f64) {
        self.level += units;
        if limit.max_length > 1 {
            self.burst_level += units;
        }
    }
}

struct State {
    limits: Limits,
    buckets: [Bucket; 6],
    leaked_at: Instant,
    /// The members waiting, per direction, the first one's turn next.
    turns: [VecDeque<Arc<Member>>; 2],
}

/// One of a group's members, as the group knows it: what it signals when
/// the member's turn comes.
pub struct Member {
    turn: EventFd,
}

impl Member {
    /// A member, readable when its turn comes.
    pub fn new() -> io::Result<Arc<Self>> {
        Ok(Arc::new(Self { turn: EventFd::new(EFD_NONBLOCK)? }))
    }

    /// Readable when the member's turn has come.
    pub fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the eventfd lives as long as the member, and the borrow
        // cannot outlive it.
        unsafe { BorrowedFd::borrow_raw(self.turn.as_raw_fd()) }
    }

    /// Takes the signal, once it woke the member's owner.
    pub fn consume(&self) {
        let _ = self.turn.read(); // EAGAIN: it was not signalled
    }

    fn signal(&self) {
        if let Err(e) = self.turn.write(1) {
            log::error!("throttle: cannot wake the next member: {e}");
        }
    }
}

/// Why a request waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// For the buckets: this long.
    Wait(Duration),
    /// For its member's turn: until the group signals it.
    Turn,
}

/// A `throttle-group` object: limits and the buckets its members share.
pub struct ThrottleGroup {
    /// Its id.
    name: String,
    /// Whether any limit is set: members of a group without one skip it.
    limited: AtomicBool,
    state: Mutex<State>,
    /// Per direction (read, write): what it admitted and what waited.
    counters: [Counters; 2],
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    bytes: AtomicU64,
    delayed: AtomicU64,
    wait_ns: AtomicU64,
}

/// What a group admitted in one direction since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupStats {
    /// Requests admitted.
    pub requests: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Of those, requests that waited for the group.
    pub delayed: u64,
    /// How long they waited in all, in nanoseconds.
    pub wait_ns: u64,
}

impl State {
    /// Leaks the buckets to `now`; how long until those counting a request
    /// in `direction` admit it.
    fn wait(&mut self, direction: Direction, now: Instant) -> Duration {
        let seconds = now.saturating_duration_since(self.leaked_at).as_secs_f64();
        self.leaked_at = self.leaked_at.max(now);
        for (bucket, limit) in self.buckets.iter_mut().zip(&self.limits.limits) {
            bucket.leak(limit, seconds);
        }
        let counting = ThrottleGroup::counting(direction);
        counting.iter().map(|&i| self.buckets[i].wait(&self.limits.limits[i])).max().unwrap_or_default()
    }

    /// Counts a request of `bytes` in `direction`.
    fn fill(&mut self, direction: Direction, bytes: u64) {
        let ops = match self.limits.iops_size {
            0 => 1.0,
            size => (bytes as f64 / size as f64).max(1.0),
        };
        for i in ThrottleGroup::counting(direction) {
            self.buckets[i].fill(&self.limits.limits[i], if i < 3 { bytes as f64 } else { ops });
        }
    }
}

impl ThrottleGroup {
    /// Group `name` with `limits`.
    pub fn new(name: &str, limits: Limits) -> Self {
        let state = State { limits, buckets: Default::default(), leaked_at: Instant::now(), turns: Default::default() };
        Self {
            name: name.into(),
            limited: AtomicBool::new(limits.any()),
            state: Mutex::new(state),
            counters: Default::default(),
        }
    }

    /// Its id.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Counts a request of `bytes` in `direction` that went through, after
    /// waiting `waited` for the group (zero: it did not wait).
    pub fn count(&self, direction: Direction, bytes: u64, waited: Duration) {
        let counters = &self.counters[direction as usize];
        counters.requests.fetch_add(1, Ordering::Relaxed);
        counters.bytes.fetch_add(bytes, Ordering::Relaxed);
        if !waited.is_zero() {
            counters.delayed.fetch_add(1, Ordering::Relaxed);
            counters.wait_ns.fetch_add(waited.as_nanos() as u64, Ordering::Relaxed);
        }
    }

    /// What it admitted, reads then writes.
    pub fn stats(&self) -> [GroupStats; 2] {
        self.counters.each_ref().map(|c| GroupStats {
            requests: c.requests.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            delayed: c.delayed.load(Ordering::Relaxed),
            wait_ns: c.wait_ns.load(Ordering::Relaxed),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // The buckets are numbers: whatever panicked left them usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether any limit is set.
    pub fn limited(&self) -> bool {
        self.limited.load(Ordering::Relaxed)
    }

    /// The limits.
    pub fn limits(&self) -> Limits {
        self.state().limits
    }

    /// Replaces the limits; the buckets keep their levels.
    pub fn set_limits(&self, limits: Limits) {
        self.state().limits = limits;
        self.limited.store(limits.any(), Ordering::Relaxed);
    }

    /// Admits a request of `member` of `bytes` in `direction` at `now`,
    /// counting it, or says what it waits for.
    pub fn admit(&self, member: &Arc<Member>, direction: Direction, bytes: u64, now: Instant) -> Result<(), Refusal> {
        let mut state = self.state();
        let line = &mut state.turns[direction as usize];
        let first = line.front().is_none_or(|m| Arc::ptr_eq(m, member));
        if !first {
            if !line.iter().any(|m| Arc::ptr_eq(m, member)) {
                line.push_back(member.clone());
            }
            return Err(Refusal::Turn);
        }
        let wait = state.wait(direction, now);
        let line = &mut state.turns[direction as usize];
        if !wait.is_zero() {
            if line.is_empty() {
                line.push_back(member.clone());
            }
            return Err(Refusal::Wait(wait));
        }
        // Its turn is taken: the next in line goes next.
        if line.pop_front().is_some()
            && let Some(next) = line.front()
        {
            next.signal();
        }
        state.fill(direction, bytes);
        Ok(())
    }

    /// Takes `member` out of every line (its queue is closing), passing its
    /// turn on.
    pub fn leave(&self, member: &Arc<Member>) {
        let mut state = self.state();
        for line in &mut state.turns {
            let was_first = line.front().is_some_and(|m| Arc::ptr_eq(m, member));
            line.retain(|m| !Arc::ptr_eq(m, member));
            if let Some(next) = line.front().filter(|_| was_first) {
                next.signal();
            }
        }
    }

    /// The buckets that count a request in `direction`: bytes and operations,
    /// total and of its direction.
    fn counting(direction: Direction) -> [usize; 4] {
        match direction {
            Direction::Read => [0, 1, 3, 4],
            Direction::Write => [0, 2, 3, 5],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(text: &str) -> Result<Limits, String> {
        Limits::from_options(&mut OptionMap::parse("--object", text).unwrap())
    }

    /// How many `bytes` requests the group admits in `seconds`, asked as
    /// soon as it allows.
    fn admitted(group: &ThrottleGroup, direction: Direction, bytes: u64, seconds: f64) -> u64 {
        let member = Member::new().unwrap();
        let start = Instant::now();
        let (mut now, mut count) = (start, 0);
        while now.duration_since(start).as_secs_f64() < seconds {
            match group.admit(&member, direction, bytes, now) {
                Ok(()) => count += 1,
                Err(Refusal::Wait(wait)) => now += wait,
                Err(Refusal::Turn) => unreachable!("a lone member never waits for its turn"),
            }
        }
        count
    }

    #[test]
    fn rates_hold_over_time_and_total_counts_both_ways() {
        let group = ThrottleGroup::new("tg", limits("limits.iops-total=100").unwrap());
        let n = admitted(&group, Direction::Read, 4096, 10.0);
        assert!((1000..=1012).contains(&n), "100 iops for 10 s, plus a tenth of a second: {n}");
        let bytes = ThrottleGroup::new("tg", limits("limits.bps-write=1048576").unwrap());
        let n = admitted(&bytes, Direction::Write, 65536, 10.0);
        assert!((160..=163).contains(&n), "1 MiB/s of 64 KiB writes: {n}");
        let member = Member::new().unwrap();
        assert_eq!(bytes.admit(&member, Direction::Read, 1 << 30, Instant::now()), Ok(()), "reads are not limited");
    }

    #[test]
    fn bursts_run_at_the_burst_rate_until_the_bucket_is_full() {
        let burst = "limits.iops-total=100,limits.iops-total-max=1000,limits.iops-total-max-length=2";
        let group = ThrottleGroup::new("tg", limits(burst).unwrap());
        let first = admitted(&group, Direction::Write, 512, 1.0);
        assert!((1000..=1101).contains(&first), "1000 iops, plus a tenth of a second of them: {first}");
        let group = ThrottleGroup::new("tg", limits(burst).unwrap());
        let total = admitted(&group, Direction::Write, 512, 7.0);
        assert!((2650..=2760).contains(&total), "a bucket of 2 s at 1000 iops, then 100 iops: {total}");
    }

    #[test]
    fn iops_size_counts_large_requests_as_several() {
        let group = ThrottleGroup::new("tg", limits("limits.iops-total=100,limits.iops-size=4096").unwrap());
        let n = admitted(&group, Direction::Read, 16384, 10.0);
        assert!((250..=253).contains(&n), "each 16 KiB read is 4 operations: {n}");
    }

    #[test]
    fn members_take_turns_and_a_leaving_member_passes_its_turn() {
        let group = ThrottleGroup::new("tg", limits("limits.iops-total=100").unwrap());
        let [a, b, c] = [0, 1, 2].map(|_| Member::new().unwrap());
        let now = Instant::now();
        assert_eq!(group.admit(&a, Direction::Read, 512, now), Ok(()), "a first request goes");
        (0..10).for_each(|_| group.admit(&a, Direction::Read, 512, now).unwrap()); // the first tenth of a second
        assert!(matches!(group.admit(&a, Direction::Read, 512, now), Err(Refusal::Wait(_))), "a waits first");
        assert_eq!(group.admit(&b, Direction::Read, 512, now), Err(Refusal::Turn));
        assert_eq!(group.admit(&c, Direction::Read, 512, now), Err(Refusal::Turn));
        let later = now + Duration::from_millis(15);
        assert_eq!(group.admit(&b, Direction::Read, 512, later), Err(Refusal::Turn), "not b's turn yet");
        assert_eq!(group.admit(&a, Direction::Read, 512, later), Ok(()));
        assert_eq!(b.turn.read().unwrap(), 1, "b is told its turn came");
        assert_eq!(group.admit(&a, Direction::Read, 512, later), Err(Refusal::Turn), "a lines up behind c");
        assert!(
            matches!(group.admit(&b, Direction::Read, 512, later), Err(Refusal::Wait(_))),
            "b waits for the bucket"
        );
        group.leave(&b);
        assert_eq!(c.turn.read().unwrap(), 1, "b's turn passes to c as it leaves");
        assert!(matches!(group.admit(&c, Direction::Read, 512, later), Err(Refusal::Wait(_))));
    }

    #[test]
    fn limits_are_checked_and_shown_as_qemu_does() {
        for (text, error) in [
            ("limits.iops-total=1,limits.iops-read=1", "cannot be used at the same time"),
            ("limits.bps-total-max=5", "require corresponding"),
            ("limits.bps-total=10,limits.bps-total-max=5", "cannot be lower than"),
            ("limits.iops-total=-1", "must be within [0, 1000000000000000]"),
            ("limits.iops-total=1000000000000001", "must be within"),
            ("limits.iops-read=1,limits.iops-read-max=2,limits.iops-read-max-length=0", "cannot be 0"),
            ("limits.iops-write-max-length=5", "burst length set without burst rate"),
            ("limits.iops-total=x", "expects an integer"),
        ] {
            let refused = limits(text).unwrap_err();
            assert!(refused.contains(error), "{text}: {refused}");
        }
        let old = limits("x-iops-total=100").unwrap();
        assert_eq!(old.limits[3].avg, 100, "QEMU's older x- spelling");
        let shown = old.to_json();
        assert_eq!((shown["iops-total"].clone(), shown["bps-read-max-length"].clone()), (json!(100), json!(1)));
        assert_eq!(shown.as_object().unwrap().len(), 19);
        assert_eq!(Limits::from_json(&shown).unwrap(), old);
        assert!(Limits::from_json(&json!({"iops-totl": 1})).unwrap_err().contains("unexpected"));
    }
}
