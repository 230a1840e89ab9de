//! One suite, run on every engine: the same requests must give the same
//! bytes on disk whichever engine performs them.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::Arc;
use std::time::Duration;

use vsd_engine::{Completion, DIRECT_BATCH, IoOp, IoQueue, IoVecs, NullQueue, PoolQueue, ThreadPool, UringQueue};

const DEPTH: u16 = 8;

fn scratch_file(len: u64) -> Arc<File> {
    scratch_file_in(&std::env::temp_dir(), len)
}

fn scratch_file_in(dir: &std::path::Path, len: u64) -> Arc<File> {
    let path = dir.join(format!("vsd-engine-{}-{:?}", std::process::id(), std::thread::current().id()));
    let file = File::options().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    file.set_len(len).unwrap();
    Arc::new(file)
}

/// Runs one request to completion and returns its errno, as a queue
/// worker does: push, submit, reap, and sleep on the notify descriptor
/// only when nothing was reaped, which must then become readable (an
/// engine that left a completion unsignalled would hang a worker).
fn run(queue: &mut dyn IoQueue, op: IoOp) -> i32 {
    // SAFETY: the buffers named by `op` belong to the caller's frame and
    // outlive this function, which waits for the completion.
    unsafe { queue.push(3, op) };
    queue.submit().unwrap();
    let mut done: Vec<Completion> = Vec::new();
    for _ in 0..1000 {
        queue.reap(&mut done);
        if let Some(c) = done.first() {
            assert_eq!(c.tag, 3);
            return c.errno;
        }
        match queue.notify_fd() {
            Some(fd) => {
                let mut poll = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                // SAFETY: one pollfd, a live local.
                let ready = unsafe { libc::poll(&mut poll, 1, 10_000) };
                assert_eq!(ready, 1, "a request in flight and no completion signalled ({op:?})");
                queue.rearm();
            }
            None => queue.wait().unwrap(),
        }
    }
    panic!("request never completed");
}

fn iov(buf: &mut [u8]) -> (libc::iovec, u64) {
    (libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() }, buf.len() as u64)
}

fn read(queue: &mut dyn IoQueue, offset: u64, buf: &mut [u8]) -> i32 {
    let (v, len) = iov(buf);
    // SAFETY: `v` names `buf`, which outlives the request (run waits).
    let iov = unsafe { IoVecs::new(&v, 1) };
    run(queue, IoOp::Read { offset, len, iov })
}

fn write(queue: &mut dyn IoQueue, offset: u64, buf: &mut [u8], durable: bool) -> i32 {
    let (v, len) = iov(buf);
    // SAFETY: `v` names `buf`, which outlives the request (run waits).
    let iov = unsafe { IoVecs::new(&v, 1) };
    run(queue, IoOp::Write { offset, len, iov, durable })
}

/// A compressed write, which no engine stores.
fn write_compressed(queue: &mut dyn IoQueue, offset: u64, buf: &mut [u8]) -> i32 {
    let (v, len) = iov(buf);
    // SAFETY: `v` names `buf`, which outlives the request (run waits).
    run(queue, IoOp::WriteCompressed { offset, len, iov: unsafe { IoVecs::new(&v, 1) } })
}

fn check_file_engine(queue: &mut dyn IoQueue, file: &File) {
    let mut pattern: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 1) as u8).collect();
    assert_eq!(write(queue, 4096, &mut pattern, false), 0);
    assert_eq!(write(queue, 65536, &mut pattern[..4096], true), 0);
    assert_eq!(run(queue, IoOp::Flush), 0);
    let mut on_disk = vec![0u8; 8192];
    file.read_exact_at(&mut on_disk, 4096).unwrap();
    assert_eq!(on_disk, pattern);

    let mut back = vec![0u8; 8192];
    assert_eq!(read(queue, 4096, &mut back), 0);
    assert_eq!(back, pattern);

    // Zeroing, with and without permission to unmap.
    for may_unmap in [false, true] {
        assert_eq!(run(queue, IoOp::WriteZeroes { offset: 4096, len: 4096, may_unmap, fast: false }), 0);
        assert_eq!(read(queue, 4096, &mut back), 0);
        assert!(back[..4096].iter().all(|&b| b == 0), "zeroed range reads zeroes");
        assert_eq!(back[4096..], pattern[4096..], "the rest is untouched");
        assert_eq!(write(queue, 4096, &mut pattern, false), 0);
    }
    assert_eq!(run(queue, IoOp::Discard { offset: 0, len: 4096 }), 0);
    assert_eq!(write_compressed(queue, 4096, &mut pattern), libc::ENOTSUP);
    file.read_exact_at(&mut on_disk, 4096).unwrap();
    assert_eq!(on_disk, pattern, "a refused compressed write writes nothing");

    // A read that crosses the end of the file gets zeroes for the tail.
    let size = file.metadata().unwrap().len();
    let mut tail = vec![0xffu8; 8192];
    assert_eq!(read(queue, size - 4096, &mut tail), 0);
    assert!(tail[4096..].iter().all(|&b| b == 0));
}

#[test]
fn uring_engine() {
    if let Err(e) = UringQueue::probe() {
        panic!("io_uring must work on the test machines: {e}");
    }
    // On a disk file system, and on tmpfs, where reads and writes complete
    // inline and write-zeroes takes two steps (no ZERO_RANGE).
    for dir in [std::env::temp_dir(), "/dev/shm".into()] {
        let file = scratch_file_in(&dir, 1 << 20);
        let mut queue = UringQueue::new(file.clone(), DEPTH).unwrap();
        check_file_engine(&mut queue, &file);
    }
}

/// On tmpfs, the io_uring engine reads and writes on the queue's thread,
/// within the submit, without entering the kernel through the ring.
#[test]
fn uring_engine_serves_tmpfs_inline() {
    let file = scratch_file_in("/dev/shm".as_ref(), 1 << 20);
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 29 + 3) as u8).collect();
    let mut queue = UringQueue::new(file.clone(), DEPTH).unwrap();
    let mut data = pattern.clone();
    let (v, len) = iov(&mut data);
    // SAFETY: `v` names `data`, which outlives the request.
    let op = IoOp::Write { offset: 4096, len, iov: unsafe { IoVecs::new(&v, 1) }, durable: false };
    assert_eq!(completed_within_submit(&mut queue, op, |q| q.kernel_entries()), Some(0));
    let mut back = vec![0u8; 4096];
    let (v, len) = iov(&mut back);
    // SAFETY: `v` names `back`, which outlives the request.
    let op = IoOp::Read { offset: 4096, len, iov: unsafe { IoVecs::new(&v, 1) } };
    assert_eq!(completed_within_submit(&mut queue, op, |q| q.kernel_entries()), Some(0));
    assert_eq!(back, pattern);
}

/// The io_uring engine asks for requests to an O_DIRECT file in short
/// groups (long bursts slowed the devices measured), and takes the others
/// in whole batches.
#[test]
fn uring_engine_submits_direct_requests_in_short_groups() {
    let buffered = scratch_file(1 << 20);
    let direct = File::options()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(format!("/proc/self/fd/{}", buffered.as_raw_fd()))
        .unwrap();
    let in_memory = scratch_file_in("/dev/shm".as_ref(), 1 << 20);
    let asks = |file: Arc<File>| UringQueue::new(file, DEPTH).unwrap().max_batch();
    assert_eq!(asks(Arc::new(direct)), DIRECT_BATCH, "O_DIRECT");
    assert_eq!(asks(buffered), usize::MAX, "buffered");
    assert_eq!(asks(in_memory), usize::MAX, "tmpfs");
    let pool = PoolQueue::new(ThreadPool::new(), scratch_file(1 << 20), DEPTH).unwrap();
    assert_eq!(pool.max_batch(), usize::MAX);
}

#[test]
fn pool_engine() {
    let file = scratch_file(1 << 20);
    let mut queue = PoolQueue::new(ThreadPool::new(), file.clone(), DEPTH).unwrap();
    check_file_engine(&mut queue, &file);
}

/// Pushes `op`, submits it and waits for it: its errno if it completed on
/// the caller's thread within the submit, `None` if it was handed off, as
/// `handed_off` counts (the ring's kernel entries, the pool's hand-offs).
/// Timing would not tell: a fast pool thread may finish before the caller
/// reaps.
fn completed_within_submit<Q: IoQueue>(queue: &mut Q, op: IoOp, handed_off: impl Fn(&Q) -> u64) -> Option<i32> {
    let before = handed_off(queue);
    // SAFETY: the caller's buffers outlive the request: it is reaped below.
    unsafe { queue.push(5, op) };
    queue.submit().unwrap();
    let mut done = Vec::new();
    queue.reap(&mut done);
    while done.is_empty() {
        queue.wait().unwrap();
        queue.reap(&mut done);
    }
    assert_eq!(done.len(), 1);
    (handed_off(queue) == before).then_some(done[0].errno)
}

/// On a buffered file, on a disk or in memory (tmpfs), a read of cached
/// data completes on the queue's own thread, within the submit (no hand-off
/// to a pool thread); the pool still does what would block.
#[test]
fn pool_engine_reads_cached_data_without_a_hand_off() {
    for dir in [std::env::temp_dir(), "/dev/shm".into()] {
        pool_reads_inline(scratch_file_in(&dir, 1 << 20));
    }
}

fn pool_reads_inline(file: Arc<File>) {
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 13 + 5) as u8).collect();
    file.write_all_at(&pattern, 8192).unwrap();
    let mut queue = PoolQueue::new(ThreadPool::new(), file.clone(), DEPTH).unwrap();
    for _ in 0..20 {
        let mut buf = vec![0u8; 4096];
        let (v, len) = iov(&mut buf);
        // SAFETY: `v` names `buf`, which outlives the request.
        let op = IoOp::Read { offset: 8192, len, iov: unsafe { IoVecs::new(&v, 1) } };
        assert_eq!(
            completed_within_submit(&mut queue, op, PoolQueue::handed_off),
            Some(0),
            "a cached read went to the pool"
        );
        assert_eq!(buf, pattern);
    }
    // A durable write blocks: it goes to the pool, and completes there.
    let mut data = pattern.clone();
    let (v, len) = iov(&mut data);
    // SAFETY: `v` names `data`, which outlives the request.
    let op = IoOp::Write { offset: 0, len, iov: unsafe { IoVecs::new(&v, 1) }, durable: true };
    assert_eq!(completed_within_submit(&mut queue, op, PoolQueue::handed_off), None);
    let mut back = vec![0u8; 4096];
    file.read_exact_at(&mut back, 0).unwrap();
    assert_eq!(back, pattern);
}

#[test]
fn null_engine_zeroes_reads_and_honours_latency() {
    let mut queue = NullQueue::new(DEPTH, true, Duration::from_millis(20)).unwrap();
    let mut buf = vec![0xaau8; 4096];
    let start = std::time::Instant::now();
    assert_eq!(read(&mut queue, 0, &mut buf), 0);
    assert!(start.elapsed() >= Duration::from_millis(20));
    assert!(buf.iter().all(|&b| b == 0));

    let mut queue = NullQueue::new(DEPTH, false, Duration::ZERO).unwrap();
    let mut buf = vec![0xaau8; 4096];
    assert_eq!(read(&mut queue, 0, &mut buf), 0);
    assert!(buf.iter().all(|&b| b == 0xaa), "read-zeroes=off leaves the buffer");
    assert_eq!(write_compressed(&mut queue, 0, &mut buf), libc::ENOTSUP, "as QEMU's null-co");
}
