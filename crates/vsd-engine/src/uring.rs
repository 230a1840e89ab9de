//! The io_uring engine: one ring per queue, owned by the queue's thread.
//!
//! Reads and plain writes of in-memory files (tmpfs) complete on the
//! queue's thread instead ([`Inline`]): such files do not take io_uring's
//! non-blocking attempt, so the ring would hand each of them to a kernel
//! worker thread, which then competes with the queue's thread for the CPUs.
//!
//! Requests to a file opened with O_DIRECT go to the kernel in groups of
//! at most [`DIRECT_BATCH`], as the queue's owner pushes them
//! ([`IoQueue::max_batch`]), not in one `io_uring_enter` per batch. A batch
//! reaches the disk as one burst (the block layer plugs it), and the virtio
//! disks measured here served long bursts slower per request than requests
//! one by one; groups of three or four kept one by one's IOPS for less of
//! the daemon's CPU per request (fewer system calls and device
//! notifications). The figures are in BENCHMARKS.md. Buffered files keep
//! their batches: their reads mostly complete inside the call, where
//! batching saves the calls.
//!
//! A ring may only make the queue's four operations, each on its own
//! registered file ([`restrictions`]): whatever a bug let into a request,
//! the ring could not open, read or write anything else. (Code run inside
//! the daemon could still set up a ring of its own: the sandbox's seccomp
//! list cannot see io_uring's operations.)

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::Arc;

use io_uring::register::Restriction;
use io_uring::{IoUring, opcode, squeue, types};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};
use vsd_sys::falloc;

use crate::inline::Inline;
use crate::{Completion, IoOp, IoQueue};

/// The most requests per `io_uring_enter` to an O_DIRECT file: a burst
/// short enough for the device, long enough to save most of the calls
/// (see the module's comment).
pub const DIRECT_BATCH: usize = 4;

/// The file is registered as fixed file 0, which saves the kernel a file
/// table lookup and reference count per request.
const FILE: types::Fixed = types::Fixed(0);

/// What a ring may do once enabled: the queue's operations, each on the
/// registered file ([`FILE`]), and no further registration.
fn restrictions() -> [Restriction; 5] {
    [
        Restriction::sqe_op(opcode::Readv::CODE),
        Restriction::sqe_op(opcode::Writev::CODE),
        Restriction::sqe_op(opcode::Fsync::CODE),
        Restriction::sqe_op(opcode::Fallocate::CODE),
        Restriction::sqe_flags_required(squeue::Flags::FIXED_FILE.bits()),
    ]
}

/// Where a request is in its life; zeroing may take several steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Idle,
    Main,
    /// ZERO_RANGE was unsupported; the range is being punched.
    PunchHole,
    /// The punched range is being allocated again (unmapping not allowed).
    Reallocate,
}

#[derive(Clone, Copy, Debug)]
struct InFlight {
    op: IoOp,
    step: Step,
}

/// A queue on its own io_uring, with completions signalled on an eventfd.
pub struct UringQueue {
    ring: IoUring,
    file: Arc<File>,
    notify: EventFd,
    requests: Vec<InFlight>,
    in_flight: usize,
    queued: usize,
    /// `io_uring_enter` calls made so far.
    entries: u64,
    inline: Inline,
    /// Tags pushed to be completed inline at the next submit.
    deferred: Vec<u32>,
    /// Completed inline, not reaped yet.
    ready: Vec<Completion>,
    /// The file is opened with O_DIRECT: every request goes to the device.
    direct: bool,
}

impl UringQueue {
    /// A queue for at most `depth` requests in flight on `file`.
    ///
    /// Call it from the thread that will use the queue: the ring is set up
    /// for a single submitter.
    pub fn new(file: Arc<File>, depth: u16) -> io::Result<Self> {
        let entries = u32::from(depth.max(1)).next_power_of_two();
        // Set up disabled, so that its restrictions hold before it can run.
        let ring = IoUring::builder()
            .setup_single_issuer()
            .setup_coop_taskrun()
            .setup_submit_all()
            .setup_r_disabled()
            .build(entries)?;
        let submitter = ring.submitter();
        submitter.register_files(&[file.as_raw_fd()])?;
        let notify = EventFd::new(EFD_NONBLOCK)?;
        submitter.register_eventfd(notify.as_raw_fd())?;
        submitter.register_restrictions(&mut restrictions())?;
        submitter.register_enable_rings()?;
        let idle = InFlight { op: IoOp::Flush, step: Step::Idle };
        let depth = usize::from(depth.max(1));
        let place = vsd_sys::residence(&file)?;
        Ok(Self {
            ring,
            inline: Inline::for_ring(place),
            direct: place.direct,
            file,
            notify,
            requests: vec![idle; depth],
            in_flight: 0,
            queued: 0,
            entries: 0,
            deferred: Vec::with_capacity(depth),
            ready: Vec::with_capacity(depth),
        })
    }

    /// Turns completion signals back on if requests are left in the kernel
    /// (more in flight than completions waiting to be reaped).
    fn signal_the_rest(&mut self) {
        let cq = self.ring.completion();
        if self.in_flight > cq.len() {
            cq.enable_eventfd();
        }
    }

    /// Completes the deferred requests inline, or queues them on the ring
    /// if they turn out to be the ring's to do.
    fn run_deferred(&mut self) {
        let mut deferred = std::mem::take(&mut self.deferred);
        for tag in deferred.drain(..) {
            match self.inline.complete(self.file.as_fd(), self.requests[tag as usize].op) {
                Some(errno) => {
                    self.requests[tag as usize].step = Step::Idle;
                    self.in_flight -= 1;
                    self.ready.push(Completion { tag, errno });
                }
                None => self.queue_sqe(tag, Step::Main),
            }
        }
        self.deferred = deferred;
    }

    /// Checks that io_uring can be used here, for a clear error at startup
    /// rather than at the first request.
    pub fn probe() -> io::Result<()> {
        IoUring::new(2).map(drop).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("io_uring is unavailable ({e}); is kernel.io_uring_disabled set? aio=threads works without it"),
            )
        })
    }

    fn sqe(op: IoOp, step: Step) -> squeue::Entry {
        match (op, step) {
            (IoOp::Read { offset, iov, .. }, _) => {
                let v = iov.as_slice();
                opcode::Readv::new(FILE, v.as_ptr(), v.len() as u32).offset(offset).build()
            }
            (IoOp::Write { offset, iov, durable, .. }, _) => {
                let v = iov.as_slice();
                let flags = if durable { libc::RWF_DSYNC } else { 0 };
                opcode::Writev::new(FILE, v.as_ptr(), v.len() as u32).offset(offset).rw_flags(flags).build()
            }
            (IoOp::Flush, _) => opcode::Fsync::new(FILE).flags(types::FsyncFlags::DATASYNC).build(),
            (IoOp::Discard { offset, len }, _) => fallocate(offset, len, falloc::PUNCH_HOLE),
            (IoOp::WriteZeroes { offset, len, .. }, Step::PunchHole) => fallocate(offset, len, falloc::PUNCH_HOLE),
            (IoOp::WriteZeroes { offset, len, .. }, Step::Reallocate) => fallocate(offset, len, falloc::ALLOCATE),
            (IoOp::WriteZeroes { offset, len, .. }, _) => fallocate(offset, len, falloc::ZERO_RANGE),
            // Answered ENOTSUP inline (see `Inline::complete`), and by
            // `complete` should it ever reach the ring.
            (IoOp::WriteCompressed { .. }, _) => opcode::Nop::new().build(),
        }
    }

    fn queue_sqe(&mut self, tag: u32, step: Step) {
        let req = &mut self.requests[tag as usize];
        req.step = step;
        let sqe = Self::sqe(req.op, step).user_data(u64::from(tag));
        // The ring has at least `depth` entries and at most `depth` requests
        // are in flight, but a multi-step request may queue its next step
        // while others wait: make room rather than fail.
        if self.ring.submission().is_full() {
            self.entries += 1;
            if let Err(e) = self.ring.submit() {
                log::warn!("io_uring submit failed: {e}");
            }
            self.queued = 0;
        }
        // SAFETY: the SQE points at the request's iovecs, which IoQueue's
        // contract keeps alive until this tag's completion is reaped, and
        // the ring has room (checked above).
        let pushed = unsafe { self.ring.submission().push(&sqe) };
        debug_assert!(pushed.is_ok(), "submission queue full after submit");
        self.queued += 1;
    }

    /// Turns one CQE into a completion, or into the request's next step.
    fn complete(&mut self, tag: u32, result: i32) -> Option<Completion> {
        let req = self.requests[tag as usize];
        let errno = if result < 0 { -result } else { 0 };
        let next = match (req.op, req.step) {
            (IoOp::WriteZeroes { .. }, Step::Main) if errno == libc::EOPNOTSUPP => Some(Step::PunchHole),
            (IoOp::WriteZeroes { may_unmap: false, .. }, Step::PunchHole) if errno == 0 => Some(Step::Reallocate),
            _ => None,
        };
        if let Some(step) = next {
            self.queue_sqe(tag, step);
            return None;
        }
        self.requests[tag as usize].step = Step::Idle;
        self.in_flight -= 1;
        let errno = match req.op {
            IoOp::Read { len, iov, .. } if result >= 0 && (result as u64) < len => {
                // A read past the end of the file returns zeroes, as QEMU's
                // file driver does.
                // SAFETY: IoQueue's contract keeps the buffers valid until
                // this completion is handed back, which happens next.
                unsafe { iov.zero_from(result as usize) };
                0
            }
            IoOp::Write { len, .. } if result >= 0 && (result as u64) < len => libc::ENOSPC,
            // Discarding is advisory, as in QEMU: a file system that cannot
            // punch holes keeps the data and the request succeeds.
            IoOp::Discard { .. } if errno == libc::EOPNOTSUPP => 0,
            IoOp::WriteCompressed { .. } => libc::ENOTSUP,
            _ => errno,
        };
        Some(Completion { tag, errno })
    }
}

fn fallocate(offset: u64, len: u64, mode: i32) -> squeue::Entry {
    opcode::Fallocate::new(FILE, len).offset(offset).mode(mode).build()
}

impl IoQueue for UringQueue {
    unsafe fn push(&mut self, tag: u32, op: IoOp) {
        assert!(self.in_flight < self.requests.len(), "more requests than the queue depth");
        self.requests[tag as usize] = InFlight { op, step: Step::Main };
        self.in_flight += 1;
        if self.inline.may_take(&op) {
            // Done at submit, not here: the time is the I/O's, not the push's.
            self.deferred.push(tag);
        } else {
            self.queue_sqe(tag, Step::Main);
        }
    }

    fn submit(&mut self) -> io::Result<()> {
        if !self.deferred.is_empty() {
            self.run_deferred();
        }
        if self.queued == 0 {
            return Ok(());
        }
        self.queued = 0;
        self.entries += 1;
        // What completes inside the call (io_uring reads cached data of a
        // buffered file there) is reaped right after it, as IoQueue's
        // contract asks: signalling it would only wake the owner once more.
        self.ring.completion().disable_eventfd();
        let submitted = self.ring.submit().map(drop);
        self.signal_the_rest();
        submitted
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        out.append(&mut self.ready);
        loop {
            let cqe = {
                let mut cq = self.ring.completion();
                cq.sync();
                cq.next()
            };
            if let Some(cqe) = cqe {
                if let Some(done) = self.complete(cqe.user_data() as u32, cqe.result()) {
                    out.push(done);
                }
                continue;
            }
            if self.queued == 0 {
                break;
            }
            // A zeroing request's next step was queued: it must reach the
            // kernel now, as the owner may sleep until this request
            // completes; and what that submit completed is reaped here.
            if let Err(e) = self.submit() {
                log::warn!("io_uring submit failed: {e}");
                break;
            }
        }
    }

    fn wait(&mut self) -> io::Result<()> {
        if !self.deferred.is_empty() {
            self.run_deferred();
        }
        if !self.ready.is_empty() || self.in_flight == 0 {
            // Something to reap already: hand the ring what is queued
            // without waiting for it.
            return self.submit();
        }
        self.queued = 0;
        self.entries += 1;
        // Whatever this leaves in flight signals the owner.
        self.ring.completion().enable_eventfd();
        self.ring.submit_and_wait(1).map(drop)
    }

    fn max_batch(&self) -> usize {
        if self.direct { DIRECT_BATCH } else { usize::MAX }
    }

    fn kernel_entries(&self) -> u64 {
        self.entries
    }

    fn notify_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(crate::borrow_fd(&self.notify))
    }
}

impl Drop for UringQueue {
    fn drop(&mut self) {
        crate::drain(self, |queue| queue.in_flight);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The result the ring gives `sqe`, pushed straight into it.
    fn result_of(queue: &mut UringQueue, sqe: squeue::Entry) -> i32 {
        // SAFETY: whatever `sqe` points to outlives the wait for its completion.
        unsafe { queue.ring.submission().push(&sqe.user_data(7)).unwrap() };
        queue.ring.submit_and_wait(1).unwrap();
        let cqe = queue.ring.completion().next().unwrap();
        assert_eq!(cqe.user_data(), 7);
        cqe.result()
    }

    #[test]
    fn a_ring_does_only_what_its_queue_does() {
        let path = std::env::temp_dir().join(format!("vsd-uring-restrictions-{}", std::process::id()));
        std::fs::write(&path, b"data").unwrap();
        let file = Arc::new(File::options().read(true).write(true).open(&path).unwrap());
        std::fs::remove_file(&path).unwrap();
        let mut queue = UringQueue::new(file.clone(), 4).unwrap();
        let mut buf = [0u8; 4];
        let iov = [libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() }];

        // Its own operation on its registered file goes through.
        assert_eq!(result_of(&mut queue, opcode::Readv::new(FILE, iov.as_ptr(), 1).build()), 4);
        assert_eq!(&buf, b"data");
        // The same read of the same file by its descriptor, not the
        // registered slot, is refused, as is any other operation.
        let by_fd = opcode::Readv::new(types::Fd(file.as_raw_fd()), iov.as_ptr(), 1).build();
        assert_eq!(result_of(&mut queue, by_fd), -libc::EACCES);
        let open = opcode::OpenAt::new(types::Fd(libc::AT_FDCWD), c"/etc/hostname".as_ptr()).build();
        assert_eq!(result_of(&mut queue, open), -libc::EACCES);
        // No registration once enabled.
        assert!(queue.ring.submitter().register_files_update(0, &[file.as_raw_fd()]).is_err());
    }
}
