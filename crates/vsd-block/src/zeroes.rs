//! `detect-zeroes`, an option of every node as in QEMU: a write whose
//! buffers hold only zeroes goes down as a write-zeroes, which formats
//! store as zero clusters and files as holes or unwritten extents. With
//! `unmap` (which needs `discard=unmap` on the node, as QEMU's rule) it may
//! deallocate the range.
//!
//! A node without it has no queue of this kind in its path, so the normal
//! write path pays nothing; with it, a write of data costs a look at its
//! first bytes, which are nonzero almost always. A durable write of zeroes
//! (FUA, writethrough) becomes a write-zeroes and then a flush.

use std::io;

use vsd_engine::{Completion, IoOp, IoQueue, IoVecs};

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

    /// `queue` (opened `depth` deep), with zero writes turned into
    /// write-zeroes if the node detects them.
    pub(crate) fn wrap(self, queue: Box<dyn IoQueue>, depth: u16) -> Box<dyn IoQueue> {
        match self {
            Self::Off => queue,
            Self::On | Self::Unmap => Box::new(ZeroDetectingQueue {
                inner: queue,
                may_unmap: self == Self::Unmap,
                flush_after: vec![false; usize::from(depth)],
                durable_zeroes: 0,
                flushes: Vec::new(),
            }),
        }
    }
}

struct ZeroDetectingQueue {
    inner: Box<dyn IoQueue>,
    may_unmap: bool,
    /// By tag: a durable write turned into write-zeroes, which has no such
    /// flag, is followed by a flush under the same tag before it completes.
    flush_after: Vec<bool>,
    /// How many of `flush_after` are set: while none is, completions pass
    /// without a look.
    durable_zeroes: usize,
    /// Tags whose flush is to be pushed.
    flushes: Vec<u32>,
}

impl IoQueue for ZeroDetectingQueue {
    unsafe fn push(&mut self, tag: u32, op: IoOp) {
        let op = match op {
            // SAFETY: the caller's guarantee: the buffers are live and
            // not written while the request is in flight.
            IoOp::Write { offset, len, iov, durable } if unsafe { only_zeroes(&iov) } => {
                match self.flush_after.get_mut(tag as usize) {
                    Some(flush) => {
                        *flush = durable;
                        self.durable_zeroes += usize::from(durable);
                        IoOp::WriteZeroes { offset, len, may_unmap: self.may_unmap, fast: false }
                    }
                    None => IoOp::Write { offset, len, iov, durable },
                }
            }
            op => op,
        };
        // SAFETY: the caller's guarantee covers the request passed on, which
        // names the same buffers or none.
        unsafe { self.inner.push(tag, op) }
    }

    fn submit(&mut self) -> io::Result<()> {
        self.inner.submit()
    }

    /// A durable zero write that completed its write-zeroes goes on to its
    /// flush, and completes with it. The flushes are submitted here (no
    /// other push may come to carry them), and what completed meanwhile
    /// is reaped again.
    fn reap(&mut self, out: &mut Vec<Completion>) {
        loop {
            let start = out.len();
            self.inner.reap(out);
            if self.durable_zeroes > 0 {
                self.hold_back_for_flush(out, start);
            }
            if self.flushes.is_empty() {
                return;
            }
            for tag in self.flushes.drain(..) {
                // SAFETY: a flush names no buffers.
                unsafe { self.inner.push(tag, IoOp::Flush) };
            }
            if let Err(e) = self.inner.submit() {
                log::error!("detect-zeroes: cannot submit the flush of a durable write of zeroes: {e}");
            }
        }
    }

    vsd_engine::forward_to_inner!(inner: wait, notify_fd, rearm, max_batch, held, kernel_entries);
}

impl ZeroDetectingQueue {
    /// Takes out of `out[start..]` the durable write-zeroes that succeeded,
    /// whose flush comes next.
    fn hold_back_for_flush(&mut self, out: &mut Vec<Completion>, start: usize) {
        let mut at = 0;
        out.retain(|done| {
            at += 1;
            at <= start || !self.flush_next(*done)
        });
    }

    /// Whether `done` is the write-zeroes of a durable zero write that
    /// succeeded: its flush is queued.
    fn flush_next(&mut self, done: Completion) -> bool {
        let Some(flush) = self.flush_after.get_mut(done.tag as usize).filter(|flush| **flush) else { return false };
        *flush = false;
        self.durable_zeroes -= 1;
        if done.errno == 0 {
            self.flushes.push(done.tag);
        }
        done.errno == 0
    }
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

    /// An engine that completes at once, recording what reached it.
    #[derive(Default)]
    struct Recorder {
        seen: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
        done: Vec<Completion>,
    }

    impl IoQueue for Recorder {
        unsafe fn push(&mut self, tag: u32, op: IoOp) {
            let kind = match op {
                IoOp::Write { durable, .. } => format!("write durable={durable}"),
                IoOp::WriteZeroes { may_unmap, .. } => format!("write-zeroes unmap={may_unmap}"),
                IoOp::Flush => "flush".into(),
                _ => "other".into(),
            };
            self.seen.lock().unwrap().push(format!("{tag}: {kind}"));
            self.done.push(Completion { tag, errno: 0 });
        }
        fn submit(&mut self) -> io::Result<()> {
            Ok(())
        }
        fn reap(&mut self, out: &mut Vec<Completion>) {
            out.append(&mut self.done);
        }
        fn wait(&mut self) -> io::Result<()> {
            Ok(())
        }
        fn notify_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
            None
        }
    }

    #[test]
    fn zero_writes_become_write_zeroes_and_durable_ones_a_flush_too() {
        let recorder = Recorder::default();
        let seen = recorder.seen.clone();
        let mut queue = DetectZeroes::Unmap.wrap(Box::new(recorder), 8);
        let (zeroes, data) = ([0u8; 4096], [7u8; 4096]);
        let iovec = |buf: &[u8; 4096]| libc::iovec { iov_base: buf.as_ptr() as *mut _, iov_len: buf.len() };
        let (zero_iov, data_iov) = ([iovec(&zeroes)], [iovec(&data)]);
        for (tag, iov, durable) in
            [(0, &zero_iov, false), (1, &zero_iov, true), (2, &data_iov, true), (3, &data_iov, false)]
        {
            // SAFETY: the buffers outlive the requests, which the recorder
            // completes without touching them.
            unsafe {
                queue.push(tag, IoOp::Write { offset: 0, len: 4096, iov: IoVecs::new(iov.as_ptr(), 1), durable })
            };
        }
        queue.submit().unwrap();
        let mut out = Vec::new();
        queue.reap(&mut out);
        let mut tags: Vec<u32> = out.iter().map(|c| c.tag).collect();
        tags.sort();
        assert_eq!(tags, [0, 1, 2, 3], "each completes once, the durable zero write after its flush");
        let seen = seen.lock().unwrap().clone();
        assert_eq!(
            seen,
            [
                "0: write-zeroes unmap=true",
                "1: write-zeroes unmap=true",
                "2: write durable=true",
                "3: write durable=false",
                "1: flush"
            ]
        );
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
