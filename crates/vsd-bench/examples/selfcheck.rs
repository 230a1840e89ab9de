//! Functional self-check of a vhost-user-blk back-end through the
//! `vsd_bench` client library.
//!
//! ```text
//! cargo run -p vsd-bench --example selfcheck -- --socket /tmp/b.sock
//! cargo run -p vsd-bench --example selfcheck -- --socket /tmp/ro.sock --read-only
//! ```
//!
//! Writable exports (the default): pattern write/read-back at several
//! offsets, FUA write and flush, write-zeroes and discard (if offered), reads
//! and writes past the end and unaligned requests must fail (not hang),
//! every queue hammered concurrently from its own thread, and the same
//! write/read-back on poll queues. **Overwrites the device.** Use
//! `--skip-data` for back-ends that do not store data (null-co).
//!
//! Read-only exports (`--read-only`): connecting without `read_only` must
//! fail with `DeviceReadOnly` (the export offers `VIRTIO_BLK_F_RO`), reads
//! work, writes, write-zeroes and discards fail.
//!
//! Exits non-zero on the first failed check.

use std::path::{Path, PathBuf};
use std::thread;

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use vsd_bench::{Client, ClientOptions, Error, Queue};

#[derive(Parser)]
struct Args {
    /// vhost-user socket of the back-end.
    #[arg(long)]
    socket: PathBuf,
    /// The export is read-only: run the read-only checks.
    #[arg(long)]
    read_only: bool,
    /// Do not compare data read back (for back-ends that discard writes).
    #[arg(long)]
    skip_data: bool,
    /// Queues to hammer concurrently (capped at the device's maximum).
    #[arg(long, default_value_t = 4)]
    queues: usize,
    /// Write/read-back rounds per queue in the concurrency check.
    #[arg(long, default_value_t = 200)]
    rounds: u64,
}

const BLOCK: usize = 4096;

fn main() -> Result<()> {
    let args = Args::parse();
    if args.read_only {
        check_read_only_export(&args.socket)?;
    } else {
        check_writable_export(&args)?;
    }
    println!("selfcheck: all checks passed");
    Ok(())
}

fn ok(what: &str) {
    println!("ok   {what}");
}

/// A block of data that differs per offset and per `seed`.
fn pattern(offset: u64, seed: u64, len: usize) -> Vec<u8> {
    let mut state = offset ^ seed.rotate_left(32) ^ 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 56) as u8
        })
        .collect()
}

fn connect(socket: &Path, num_queues: usize, poll: bool, read_only: bool) -> Result<Client> {
    let opts = ClientOptions { num_queues, poll_queues: poll, read_only, ..ClientOptions::default() };
    Client::connect(socket, opts).with_context(|| format!("connecting to {}", socket.display()))
}

fn check_writable_export(args: &Args) -> Result<()> {
    let probe = connect(&args.socket, 1, false, false)?;
    let info = probe.info().clone();
    println!("device: {info:#?}");
    ensure!(info.capacity >= 4 * BLOCK as u64, "capacity {} is too small", info.capacity);
    check_properties(&probe)?;
    drop(probe);

    let num_queues = args.queues.clamp(1, info.max_queues.max(1) as usize);
    let mut client = connect(&args.socket, num_queues, false, false)?;
    let mut queue = client.take_queue(0)?;
    check_read_back(&mut queue, info.capacity, args.skip_data)?;
    check_flush_and_fua(&mut queue, args.skip_data)?;
    check_zeroes_and_discard(&mut queue, &info, args.skip_data)?;
    check_out_of_range(&mut queue, info.capacity)?;
    check_unaligned(&mut queue)?;
    let mut queues = vec![queue];
    queues.extend(client.take_queues());
    check_concurrent_queues(queues, args.rounds, args.skip_data)?;
    drop(client);

    let mut poll_client = connect(&args.socket, 1, true, false)?;
    let mut poll_queue = poll_client.take_queue(0)?;
    ensure!(poll_queue.is_poll(), "queue is not a poll queue");
    check_read_back(&mut poll_queue, info.capacity, args.skip_data)?;
    ok("write/read-back on a poll queue");
    Ok(())
}

fn check_properties(client: &Client) -> Result<()> {
    let capacity: u64 = client.property("capacity")?.parse()?;
    ensure!(capacity == client.capacity()?, "capacity property mismatch");
    ensure!(client.property("read-only")? == "false", "read-only property should be false");
    let alignment = client.property("request-alignment")?;
    let max_transfer = client.property("max-transfer")?;
    ok(&format!("properties: capacity {capacity}, request-alignment {alignment}, max-transfer {max_transfer}"));
    Ok(())
}

fn check_read_back(queue: &mut Queue, capacity: u64, skip_data: bool) -> Result<()> {
    let last = capacity / BLOCK as u64 * BLOCK as u64 - BLOCK as u64;
    for offset in [0, BLOCK as u64, capacity / 2 / BLOCK as u64 * BLOCK as u64, last] {
        let data = pattern(offset, 1, BLOCK);
        queue.write_at(offset, &data)?;
        let mut back = vec![0; BLOCK];
        queue.read_at(offset, &mut back)?;
        ensure!(skip_data || back == data, "data read back at {offset} differs");
    }
    let big = pattern(0, 2, 256 * 1024);
    queue.write_at(8 * BLOCK as u64, &big)?;
    let mut back = queue.alloc_buffer(big.len())?;
    queue.read_buf(8 * BLOCK as u64, &mut back)?;
    ensure!(skip_data || back[..] == big[..], "256 KiB read back differs");
    ok("write/read-back at start, middle and last block, 256 KiB zero-copy read");
    Ok(())
}

fn check_flush_and_fua(queue: &mut Queue, skip_data: bool) -> Result<()> {
    let data = pattern(0, 3, BLOCK);
    queue.write_at_fua(2 * BLOCK as u64, &data)?;
    queue.flush()?;
    let mut back = vec![0; BLOCK];
    queue.read_at(2 * BLOCK as u64, &mut back)?;
    ensure!(skip_data || back == data, "FUA write read back differs");
    ok("FUA write and flush");
    Ok(())
}

fn check_zeroes_and_discard(queue: &mut Queue, info: &vsd_bench::DeviceInfo, skip_data: bool) -> Result<()> {
    let offset = 4 * BLOCK as u64;
    if info.max_write_zeroes_len > 0 {
        for no_unmap in [false, true] {
            queue.write_at(offset, &pattern(offset, 4, 2 * BLOCK))?;
            queue.write_zeroes(offset, 2 * BLOCK as u64, no_unmap)?;
            let mut back = vec![0xff; 2 * BLOCK];
            queue.read_at(offset, &mut back)?;
            ensure!(skip_data || back.iter().all(|&b| b == 0), "write-zeroes left data");
        }
        ok("write-zeroes (unmap and no-unmap) reads back zeroes");
    } else {
        expect_errno(queue.write_zeroes(offset, BLOCK as u64, false), libc::ENOTSUP, "write-zeroes")?;
        ok("write-zeroes not offered: ENOTSUP");
    }
    if info.max_discard_len > 0 {
        queue.discard(offset, 2 * BLOCK as u64)?;
        ok("discard");
    } else {
        expect_errno(queue.discard(offset, BLOCK as u64), libc::ENOTSUP, "discard")?;
        ok("discard not offered: ENOTSUP");
    }
    Ok(())
}

fn check_out_of_range(queue: &mut Queue, capacity: u64) -> Result<()> {
    let mut buf = vec![0; BLOCK];
    expect_request_error(queue.read_at(capacity, &mut buf), "read at capacity")?;
    expect_request_error(queue.read_at(capacity - 512, &mut buf), "read straddling the end")?;
    expect_request_error(queue.write_at(capacity, &buf), "write at capacity")?;
    expect_request_error(queue.read_at(u64::MAX / 1024 * 512, &mut buf), "read far past the end")?;
    ensure!(!queue.is_broken(), "queue broke on out-of-range requests");
    queue.read_at(0, &mut buf)?;
    ok("reads/writes past the end fail with an error and the queue stays usable");
    Ok(())
}

fn check_unaligned(queue: &mut Queue) -> Result<()> {
    let mut buf = vec![0; BLOCK];
    expect_errno(queue.read_at(100, &mut buf), libc::EINVAL, "unaligned read")?;
    ok("unaligned offset fails with EINVAL (libblkio)");
    Ok(())
}

/// Each queue gets its own thread and its own region of 64 blocks.
fn check_concurrent_queues(queues: Vec<Queue>, rounds: u64, skip_data: bool) -> Result<()> {
    let count = queues.len();
    let handles: Vec<_> =
        queues.into_iter().map(|queue| thread::spawn(move || hammer(queue, rounds, skip_data))).collect();
    for handle in handles {
        match handle.join() {
            Ok(result) => result?,
            Err(_) => bail!("a queue thread panicked"),
        }
    }
    ok(&format!("{count} queues x {rounds} rounds of write/read-back concurrently"));
    Ok(())
}

fn hammer(mut queue: Queue, rounds: u64, skip_data: bool) -> Result<()> {
    let region = 64 * BLOCK as u64 * (queue.index() as u64 + 1);
    let mut back = vec![0; BLOCK];
    for round in 0..rounds {
        let offset = region + (round % 64) * BLOCK as u64;
        let data = pattern(offset, round, BLOCK);
        queue.write_at(offset, &data)?;
        queue.read_at(offset, &mut back)?;
        ensure!(skip_data || back == data, "queue {}: data at {offset} differs in round {round}", queue.index());
    }
    Ok(())
}

fn check_read_only_export(socket: &Path) -> Result<()> {
    match connect(socket, 1, false, false) {
        Err(e) if matches!(e.downcast_ref::<Error>(), Some(Error::DeviceReadOnly)) => {
            ok("read-write connect refused: device offers VIRTIO_BLK_F_RO")
        }
        Err(e) => return Err(e.context("expected DeviceReadOnly")),
        Ok(_) => bail!("read-write connect to a read-only export succeeded"),
    }
    let mut client = connect(socket, 1, false, true)?;
    ensure!(client.property("read-only")? == "true", "read-only property should be true");
    let mut queue = client.take_queue(0)?;
    let mut buf = vec![0; BLOCK];
    queue.read_at(0, &mut buf)?;
    ok("read on a read-only export");
    expect_errno(queue.write_at(0, &buf), libc::EBADF, "write")?;
    expect_errno(queue.write_zeroes(0, BLOCK as u64, false), libc::EBADF, "write-zeroes")?;
    expect_errno(queue.discard(0, BLOCK as u64), libc::EBADF, "discard")?;
    queue.flush()?;
    ok("write, write-zeroes and discard fail with EBADF; flush succeeds");
    Ok(())
}

fn expect_request_error(result: vsd_bench::Result<()>, what: &str) -> Result<()> {
    match result {
        Err(e @ Error::Request { .. }) => {
            println!("     {what}: {e}");
            Ok(())
        }
        Err(e) => Err(anyhow::Error::new(e).context(format!("{what}: expected a request error"))),
        Ok(()) => bail!("{what} succeeded but should fail"),
    }
}

fn expect_errno(result: vsd_bench::Result<()>, errno: i32, what: &str) -> Result<()> {
    match result {
        Err(e) if e.errno() == errno => Ok(()),
        Err(e) => Err(anyhow::Error::new(e).context(format!("{what}: expected errno {errno}"))),
        Ok(()) => bail!("{what} succeeded but should fail with errno {errno}"),
    }
}
