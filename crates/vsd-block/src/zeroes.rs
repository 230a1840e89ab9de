//! `detect-zeroes`, an option of every node as in QEMU: a write whose
//! buffers hold only zeroes goes down as a write-zeroes, which formats
//! store as zero clusters and files as holes or unwritten extents. With
//! `unmap` (which needs `discard=unmap` on the node, as QEMU's rule) it may
//! deallocate the range.
//!
//! A node without it has no queue of this kind in its path, so the normal
//! write path pays nothing; with it, a write of data costs a look at its
//! first bytes, which are nonzero almost always.

use vsd_engine::{IoOp, IoQueue, IoVecs};

use crate::options::{OptionError, OptionMap};

/// What a node does with writes of zeroes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DetectZeroes {
    /// Writes go down as they are.
    #[default]
    Off,
    /// As write-zeroes that keep the range allocated.
    On,
    /// As write-zeroes that may deallocate the range.
    Unmap,
}

impl DetectZeroes {
    /// Reads `detect-zeroes`; `unmap` is refused unless the node's
    /// `discard` is `unmap` (or `on`), in QEMU's words.
    pub(crate) fn take(opts: &mut OptionMap) -> Result<Self, OptionError> {
        let mode = match opts.take_choice("detect-zeroes", &["off", "on", "unmap"])? {
            Some("on") => Self::On,
            Some("unmap") => Self::Unmap,
            _ => Self::Off,
        };
        if mode == Self::Unmap && !matches!(opts.get("discard"), Some("unmap" | "on")) {
            return Err(opts
                .rejected("setting detect-zeroes to unmap is not allowed without setting discard operation to unmap"));
        }
        Ok(mode)
    }

    /// `queue`, with zero writes turned into write-zeroes if the node
    /// detects them.
    pub(crate) fn wrap(self, queue: Box<dyn IoQueue>) -> Box<dyn IoQueue> {
        match self {
            Self::Off => queue,
            Self::On | Self::Unmap => Box::new(ZeroDetectingQueue { inner: queue, may_unmap: self == Self::Unmap }),
        }
    }
}

struct ZeroDetectingQueue {
    inner: Box<dyn IoQueue>,
    may_unmap: bool,
}

impl IoQueue for ZeroDetectingQueue {
    unsafe fn push(&mut self, tag: u32, op: IoOp) {
        let op = match op {
            // A write that must be durable keeps its way down: write-zeroes
            // has no such flag.
            // SAFETY: the caller's guarantee: the buffers are live and
            // not written while the request is in flight.
            IoOp::Write { offset, len, iov, durable: false } if unsafe { only_zeroes(&iov) } => {
                IoOp::WriteZeroes { offset, len, may_unmap: self.may_unmap, fast: false }
            }
            op => op,
        };
        // SAFETY: the caller's guarantee covers the request passed on, which
        // names the same buffers or none.
        unsafe { self.inner.push(tag, op) }
    }

    vsd_engine::forward_to_inner!(inner: submit, reap, wait, notify_fd, rearm, max_batch, held, kernel_entries);
}

/// Whether every byte of the buffers is zero.
///
/// # Safety
/// The buffers `iov` names must be live and readable.
unsafe fn only_zeroes(iov: &IoVecs) -> bool {
    iov.as_slice().iter().all(|v| {
        // SAFETY: the caller's guarantee for each buffer.
        let bytes = unsafe { std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len) };
        is_zero(bytes)
    })
}

/// Whether `bytes` are all zero: the first 16 first, where data almost
/// always shows, then the rest a word at a time.
fn is_zero(bytes: &[u8]) -> bool {
    let (head, rest) = bytes.split_at(bytes.len().min(16));
    if head.iter().any(|&b| b != 0) {
        return false;
    }
    let (start, words, end) = {
        // SAFETY: every bit pattern is a valid u64.
        unsafe { rest.align_to::<u64>() }
    };
    start.iter().chain(end).all(|&b| b == 0) && words.iter().all(|&w| w == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_buffers_are_found_whatever_their_alignment() {
        let mut buf = vec![0u8; 4096 + 3];
        assert!(is_zero(&buf[1..]) && is_zero(&buf[..0]) && is_zero(&buf[..5]));
        for at in [0, 15, 16, 17, 4000, 4098] {
            buf[at] = 1;
            assert!(!is_zero(&buf), "a one at {at}");
            assert!(!is_zero(&buf[..=at]), "a one at the end, {at}");
            buf[at] = 0;
        }
    }

    #[test]
    fn unmap_needs_discard_unmap() {
        let take = |text: &str| DetectZeroes::take(&mut OptionMap::parse("--blockdev", text).unwrap());
        assert_eq!(take("detect-zeroes=on").unwrap(), DetectZeroes::On);
        assert_eq!(take("detect-zeroes=unmap,discard=unmap").unwrap(), DetectZeroes::Unmap);
        assert_eq!(take("").unwrap(), DetectZeroes::Off);
        let err = take("node-name=n,detect-zeroes=unmap").unwrap_err().to_string();
        assert_eq!(
            err,
            "--blockdev node-name=n: setting detect-zeroes to unmap is not allowed without setting discard operation to unmap"
        );
        assert!(take("detect-zeroes=unmap,discard=ignore").is_err());
        assert!(take("detect-zeroes=maybe").unwrap_err().to_string().contains("does not accept value 'maybe'"));
    }
}
