//! `driver=nbd`: vsd reading and writing exports of real NBD servers
//! (qemu-storage-daemon, nbdkit, vsd itself), served on over vhost-user-blk
//! to libblkio's client and over NBD to libnbd's and QEMU's tools.

mod common;

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Daemon, Scratch, ok, pattern, run, vsd_fails};
use vsd_bench::{BatchOp, ClientOptions};

const MIB: u64 = 1 << 20;

/// qemu-storage-daemon exporting `image` (raw) as `disk` on `socket`.
fn qsd_serving(dir: &Scratch, image: &Path, socket: &Path) -> Daemon {
    Daemon::qsd(
        dir,
        &[
            "--blockdev".into(),
            format!("driver=file,node-name=f0,filename={}", image.display()),
            "--nbd-server".into(),
            format!("addr.type=unix,addr.path={}", socket.display()),
            "--export".into(),
            "type=nbd,id=e0,node-name=f0,name=disk,writable=on".into(),
        ],
    )
}

/// nbdkit on `socket`: a plugin behind `filters` ("NAME PARAMS", or a flag
/// such as `-r`).
struct Nbdkit(Child);

impl Nbdkit {
    /// The memory plugin, `size` bytes.
    fn start(socket: &Path, filters: &[&str], size: u64) -> Self {
        Self::serving(socket, filters, &["memory", &size.to_string()])
    }

    /// `plugin`: its name and parameters.
    fn serving(socket: &Path, filters: &[&str], plugin: &[&str]) -> Self {
        let _ = std::fs::remove_file(socket);
        let mut command = Command::new("nbdkit");
        command.args(["-f", "-U"]).arg(socket);
        let mut params = Vec::new();
        for filter in filters {
            if filter.starts_with('-') {
                command.arg(filter);
                continue;
            }
            let (name, rest) = filter.split_once(' ').unwrap_or((filter, ""));
            command.arg(format!("--filter={name}"));
            params.extend(rest.split_whitespace());
        }
        // Filters' parameters follow the plugin's.
        let child = command.args(plugin).args(params).stdin(Stdio::null()).spawn().expect("nbdkit");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !socket.exists() {
            assert!(Instant::now() < deadline, "nbdkit did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        Self(child)
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A `driver=nbd` node `n0` on export `export` of `socket`, with `extra` options.
fn nbd_node(socket: &Path, export: &str, extra: &str) -> String {
    format!("driver=nbd,node-name=n0,server.type=unix,server.path={},export={export}{extra}", socket.display())
}

/// vsd serving `node` (named `n0`) as raw over vhost-user-blk (`vhost.sock`,
/// `export_opts`) and NBD (`vsd-nbd.sock`, export `x`).
fn vsd_over(dir: &Scratch, node: String, export_opts: &str) -> Daemon {
    let args = vec![
        "--blockdev".into(),
        node,
        "--blockdev".into(),
        "driver=raw,node-name=d0,file=n0".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=v0,node-name=d0,addr.type=unix,addr.path={},writable=on{export_opts}",
            dir.path("vhost.sock").display()
        ),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", dir.path("vsd-nbd.sock").display()),
        "--export".into(),
        "type=nbd,id=x0,node-name=d0,name=x,writable=on".into(),
    ];
    Daemon::vsd(dir, &args)
}

fn uri(socket: &Path, name: &str) -> String {
    format!("nbd+unix:///{name}?socket={}", socket.display())
}

/// Two queues of a guest-like client write their patterns concurrently
/// through vsd into qemu-storage-daemon's export, read them back, and
/// flush, discard and zero; the image behind qemu-storage-daemon then
/// holds exactly that, and what was there before reads back unchanged.
#[test]
fn qemu_storage_daemon_s_export_serves_a_vhost_user_disk() {
    let dir = Scratch::new("nbdc-qsd");
    let image = dir.path("remote.img");
    let before = pattern(1, 32 * MIB as usize);
    std::fs::write(&image, &before).unwrap();
    let _qsd = qsd_serving(&dir, &image, &dir.path("qsd.sock"));
    let vsd = vsd_over(&dir, nbd_node(&dir.path("qsd.sock"), "disk", ""), ",num-queues=2");
    let mut client = vsd.connect(ClientOptions { num_queues: 2, ..Default::default() });
    assert_eq!(client.capacity().unwrap(), 32 * MIB);
    let writes =
        |q: u64| (0..24u64).map(move |i| (q * 16 * MIB + i * 320 * 1024, pattern(q * 100 + i, 4096 << (i % 6))));
    let threads: Vec<_> = client
        .take_queues()
        .into_iter()
        .enumerate()
        .map(|(q, mut queue)| {
            std::thread::spawn(move || {
                let mut old = vec![0; 4096];
                queue.read_at(q as u64 * 16 * MIB + 300 * 1024, &mut old).unwrap();
                for (offset, data) in writes(q as u64) {
                    queue.write_at(offset, &data).unwrap();
                    let mut back = vec![0; data.len()];
                    queue.read_at(offset, &mut back).unwrap();
                    assert_eq!(back, data, "queue {q} at {offset}");
                }
                queue.flush().unwrap();
                old
            })
        })
        .collect();
    let olds: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let mut expected = before.clone();
    for (offset, data) in (0..2).flat_map(writes) {
        expected[offset as usize..offset as usize + data.len()].copy_from_slice(&data);
    }
    for (q, old) in olds.iter().enumerate() {
        let at = q * 16 * MIB as usize + 300 * 1024;
        assert_eq!(old[..], before[at..at + 4096], "queue {q} read what qemu-storage-daemon serves");
    }
    drop(client);
    let mut client = vsd.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    queue.write_zeroes(8 * MIB, 2 * MIB, true).unwrap();
    expected[8 * MIB as usize..10 * MIB as usize].fill(0);
    queue.flush().unwrap();
    drop((queue, client));
    assert!(std::fs::read(&image).unwrap() == expected, "the remote image holds what vsd acknowledged");
}

/// nbdkit's memory plugin without WRITE_ZEROES and with 64 KiB blocks at
/// most: vsd writes zeroes as data and splits 1 MiB requests; nbdcopy and
/// qemu-img see through vsd's own NBD export what went in.
#[test]
fn nbdkit_without_zeroes_and_with_small_blocks() {
    let dir = Scratch::new("nbdc-kit");
    let filters = ["nozero zeromode=none", "blocksize-policy blocksize-maximum=65536"];
    let _kit = Nbdkit::start(&dir.path("kit.sock"), &filters, 16 * MIB);
    let vsd = vsd_over(&dir, nbd_node(&dir.path("kit.sock"), "", ""), "");
    let source = dir.path("source.img");
    let content = pattern(5, 16 * MIB as usize);
    std::fs::write(&source, &content).unwrap();
    let x = uri(&dir.path("vsd-nbd.sock"), "x");
    ok("nbdcopy", &[source.to_str().unwrap(), &x]);
    ok("qemu-img", &["compare", "-f", "raw", "-F", "raw", source.to_str().unwrap(), &x]);

    let mut client = vsd.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    let big = pattern(6, MIB as usize);
    queue.write_at_fua(3 * MIB, &big).unwrap();
    queue.write_zeroes(5 * MIB, 3 * MIB, true).unwrap();
    let mut back = vec![0; MIB as usize];
    queue.read_at(3 * MIB, &mut back).unwrap();
    assert!(back == big, "a 1 MiB write split in 64 KiB commands reads back");
    drop((queue, client));
    let copy = dir.path("copy.img");
    ok("nbdcopy", &[&x, copy.to_str().unwrap()]);
    let mut expected = content;
    expected[3 * MIB as usize..4 * MIB as usize].copy_from_slice(&big);
    expected[5 * MIB as usize..8 * MIB as usize].fill(0);
    assert!(std::fs::read(&copy).unwrap() == expected, "nbdkit holds what vsd acknowledged");
}

/// A qcow2 image whose bytes live on another vsd's NBD export: vsd opens
/// it with `file.driver=nbd`, a guest-like client writes through it, and
/// qemu-img finds the image consistent and holding those writes.
#[test]
fn a_qcow2_image_on_another_vsd_s_nbd_export() {
    let dir = Scratch::new("nbdc-qcow2");
    let image = dir.path("disk.qcow2");
    ok("qemu-img", &["create", "-q", "-f", "qcow2", "-o", "preallocation=metadata", image.to_str().unwrap(), "16M"]);
    let far = Scratch::new("nbdc-qcow2-far");
    let remote = Daemon::vsd(
        &far,
        &[
            "--blockdev".into(),
            format!("driver=file,node-name=f0,filename={}", image.display()),
            "--nbd-server".into(),
            format!("addr.type=unix,addr.path={}", far.path("nbd.sock").display()),
            "--export".into(),
            "type=nbd,id=e0,node-name=f0,name=bytes,writable=on".into(),
        ],
    );
    let node = format!(
        "driver=qcow2,node-name=d0,file.driver=nbd,file.server.type=unix,file.server.path={},file.export=bytes",
        far.path("nbd.sock").display()
    );
    let vhost = dir.path("vhost.sock");
    let export =
        format!("type=vhost-user-blk,id=v0,node-name=d0,addr.type=unix,addr.path={},writable=on", vhost.display());
    let vsd = Daemon::vsd(&dir, &["--blockdev".into(), node, "--export".into(), export]);
    let mut client = vsd.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    let data = pattern(9, 256 << 10);
    queue.write_at(5 * MIB, &data).unwrap();
    queue.flush().unwrap();
    drop((queue, client));
    assert!(vsd.stop().success());
    assert!(remote.stop().success());
    ok("qemu-img", &["check", "-q", image.to_str().unwrap()]);
    let raw = dir.path("disk.raw");
    ok("qemu-img", &["convert", "-O", "raw", image.to_str().unwrap(), raw.to_str().unwrap()]);
    let bytes = std::fs::read(&raw).unwrap();
    assert!(bytes[5 * MIB as usize..][..data.len()] == data[..], "the write is in the qcow2 image");
    assert!(bytes[..5 * MIB as usize].iter().all(|&b| b == 0));
}

/// vsd serving a qcow2 image (1 MiB of 0x5a written at 0) whose file is on
/// nbdkit, where every write takes a second (its delay filter); the
/// export's options end with `export_opts`.
fn qcow2_with_slow_writes(dir: &Scratch, export_opts: &str) -> (Nbdkit, Daemon) {
    let image = dir.path("disk.qcow2");
    let path = image.to_str().unwrap();
    ok("qemu-img", &["create", "-q", "-f", "qcow2", path, "16M"]);
    ok("qemu-io", &["-f", "qcow2", "-c", "write -P 0x5a 0 1M", path]);
    // Room to allocate in: nbdkit's file plugin does not grow the file.
    std::fs::OpenOptions::new().write(true).open(&image).unwrap().set_len(32 * MIB).unwrap();
    let socket = dir.path("kit.sock");
    let kit = Nbdkit::serving(&socket, &["delay delay-write=1"], &["file", &format!("file={path}")]);
    let node = format!(
        "driver=qcow2,node-name=d0,file.driver=nbd,file.server.type=unix,file.server.path={},file.export=",
        socket.display()
    );
    let vhost = dir.path("vhost.sock");
    let export = format!(
        "type=vhost-user-blk,id=v0,node-name=d0,addr.type=unix,addr.path={},writable=on{export_opts}",
        vhost.display()
    );
    (kit, Daemon::vsd(dir, &["--blockdev".into(), node, "--export".into(), export]))
}

/// Submits `op` with eight reads of the data at once, first or `last`;
/// returns the order they completed in, `op` numbered 8.
fn beside_reads(queue: &mut vsd_bench::Queue, op: BatchOp<'_>, last: bool) -> Vec<usize> {
    let mut batch: Vec<_> = (0..8).map(|i| BatchOp::Read(i * 64 * 1024, 4096)).collect();
    batch.insert(if last { 8 } else { 0 }, op);
    let order = queue.run_batch(&batch).unwrap();
    let number = |i: usize| if last { i } else { (i + 8) % 9 };
    order.into_iter().map(number).collect()
}

/// Stops vsd and checks the image: consistent, the first MiB intact.
fn stop_and_check(dir: &Scratch, vsd: Daemon) {
    assert!(vsd.stop().success());
    let image = dir.path("disk.qcow2");
    ok("qemu-img", &["check", "-q", image.to_str().unwrap()]);
    ok("qemu-io", &["-f", "qcow2", "-c", "read -P 0x5a 0 1M", image.to_str().unwrap()]);
}

/// A guest flush with qcow2 metadata to write goes on beside the queue's
/// other requests: reads sent after it complete before it, while it writes
/// the tables a second at a time.
#[test]
fn a_qcow2_flush_does_not_hold_up_the_queue_s_other_requests() {
    let dir = Scratch::new("nbdc-qcow2-flush");
    let (_kit, vsd) = qcow2_with_slow_writes(&dir, "");
    let mut client = vsd.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    queue.write_at(8 * MIB, &pattern(3, 4096)).unwrap();
    // The flush writes a refcount block and an L2 table: two slow writes.
    let order = beside_reads(&mut queue, BatchOp::Flush, false);
    assert_eq!(order.last(), Some(&8), "the reads complete while the flush writes the metadata: {order:?}");
    drop((queue, client));
    stop_and_check(&dir, vsd);
}

/// With `writethrough=on`, an allocating write among other requests is
/// written, linked and flushed beside them, and answered once durable.
#[test]
fn a_writethrough_allocation_does_not_hold_up_the_queue_s_other_requests() {
    let dir = Scratch::new("nbdc-qcow2-writethrough");
    let (_kit, vsd) = qcow2_with_slow_writes(&dir, ",writethrough=on");
    let mut client = vsd.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    let data = pattern(4, 4096);
    let order = beside_reads(&mut queue, BatchOp::Write(8 * MIB, &data), true);
    assert_eq!(order.last(), Some(&8), "the reads complete while the write allocates and flushes: {order:?}");
    drop((queue, client));
    stop_and_check(&dir, vsd);
    let image = dir.path("disk.qcow2");
    let raw = dir.path("disk.raw");
    ok("qemu-img", &["convert", "-O", "raw", image.to_str().unwrap(), raw.to_str().unwrap()]);
    assert!(std::fs::read(&raw).unwrap()[8 * MIB as usize..][..4096] == data[..], "the write is in the image");
}

/// An overlay's write into part of a cluster copies the rest up from its
/// backing file, here on nbdkit with its requests paused: reads sent
/// after the write complete while the copy-up waits, and the write once
/// the backing file answers again.
#[test]
fn a_copy_up_waiting_for_its_backing_file_does_not_hold_up_the_queue_s_other_requests() {
    let dir = Scratch::new("nbdc-copy-up");
    let (base, overlay) = (dir.path("base.raw"), dir.path("overlay.qcow2"));
    std::fs::write(&base, vec![0x11u8; 16 * MIB as usize]).unwrap();
    let overlay_name = overlay.to_str().unwrap();
    ok("qemu-img", &["create", "-q", "-f", "qcow2", "-F", "raw", "-b", base.to_str().unwrap(), overlay_name]);
    ok("qemu-io", &["-f", "qcow2", "-c", "write -P 0x5a 0 1M", overlay_name]);
    let (socket, control) = (dir.path("kit.sock"), dir.path("pause.sock"));
    let pause = format!("pause pause-control={}", control.display());
    let _kit = Nbdkit::serving(&socket, &[&pause], &["file", &format!("file={}", base.display())]);
    let backing = format!("driver=nbd,node-name=b0,server.type=unix,server.path={},export=", socket.display());
    let node = format!("driver=qcow2,node-name=d0,file.driver=file,file.filename={overlay_name},backing=b0");
    let vhost = dir.path("vhost.sock");
    let export =
        format!("type=vhost-user-blk,id=v0,node-name=d0,addr.type=unix,addr.path={},writable=on", vhost.display());
    let args = ["--blockdev".into(), backing, "--blockdev".into(), node, "--export".into(), export];
    let vsd = Daemon::vsd(&dir, &args);
    let mut client = vsd.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();

    // The filter answers each command with its capital once in effect.
    let mut control = std::os::unix::net::UnixStream::connect(&control).unwrap();
    let mut command = |c: u8| {
        control.write_all(&[c]).unwrap();
        let mut answer = [0];
        control.read_exact(&mut answer).unwrap();
        assert_eq!(answer[0], c.to_ascii_uppercase());
    };
    command(b'p');
    let data = pattern(5, 4096);
    let batch = std::thread::spawn(move || {
        let order = beside_reads(&mut queue, BatchOp::Write(8 * MIB + 8192, &data), false);
        (order, queue)
    });
    // Long enough for the reads of the local file to be back; not a
    // deadline: with the copy-up blocking the queue they never would be.
    std::thread::sleep(Duration::from_secs(1));
    command(b'r');
    let (order, mut queue) = batch.join().unwrap();
    assert_eq!(order.last(), Some(&8), "the reads complete while the copy-up waits: {order:?}");
    queue.flush().unwrap();
    drop((queue, client));
    assert!(vsd.stop().success());
    ok("qemu-img", &["check", "-q", overlay_name]);
    let qemu_io = ["read -P 0x11 8M 8k", "read -P 0x11 8204k 52k", "read -P 0x5a 0 1M"];
    for cmd in qemu_io {
        let out = run("qemu-io", &["-f", "qcow2", "-c", cmd, overlay_name]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && !text.contains("verification failed"), "{cmd}: {text}");
    }
    let raw = dir.path("overlay.raw");
    ok("qemu-img", &["convert", "-O", "raw", overlay_name, raw.to_str().unwrap()]);
    assert!(std::fs::read(&raw).unwrap()[8 * MIB as usize + 8192..][..4096] == pattern(5, 4096)[..]);
}

/// With `reconnect-delay`, a request sent while the server is down waits
/// and completes once a server is back on the socket; without it, requests
/// fail at once with an I/O error, vsd keeps running, and once the server
/// is back requests succeed again.
#[test]
fn requests_wait_for_a_server_that_comes_back_within_reconnect_delay() {
    let dir = Scratch::new("nbdc-reconnect");
    let image = dir.path("remote.img");
    std::fs::write(&image, vec![0; 8 * MIB as usize]).unwrap();
    let socket = dir.path("qsd.sock");
    let qsd = qsd_serving(&dir, &image, &socket);
    let mut vsd = vsd_over(&dir, nbd_node(&socket, "disk", ",reconnect-delay=10"), "");
    let mut client = vsd.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    queue.write_at(0, &pattern(1, 4096)).unwrap();
    qsd.kill();
    let writer = std::thread::spawn(move || {
        let result = queue.write_at(MIB, &pattern(2, 65536)).and_then(|()| queue.flush());
        (result, queue)
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(!writer.is_finished(), "the write waits for the server");
    let qsd = qsd_serving(&dir, &image, &socket);
    let (result, queue) = writer.join().unwrap();
    result.expect("the write completes once the server is back");
    let bytes = std::fs::read(&image).unwrap();
    assert_eq!(bytes[MIB as usize..][..65536], pattern(2, 65536)[..]);
    assert_eq!(bytes[..4096], pattern(1, 4096)[..]);
    drop((queue, client, qsd));
    assert!(vsd.is_running());
    drop(vsd);

    let qsd = qsd_serving(&dir, &image, &socket);
    let vsd = vsd_over(&dir, nbd_node(&socket, "disk", ""), "");
    let mut client = vsd.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    qsd.kill();
    let started = Instant::now();
    assert!(queue.write_at(0, &pattern(3, 4096)).is_err(), "without reconnect-delay the write fails");
    assert!(started.elapsed() < Duration::from_secs(5), "and fails at once");
    let _qsd = qsd_serving(&dir, &image, &socket);
    let deadline = Instant::now() + Duration::from_secs(10);
    while queue.write_at(0, &pattern(4, 4096)).is_err() {
        assert!(Instant::now() < deadline, "vsd dials the server again");
        std::thread::sleep(Duration::from_millis(100));
    }
    queue.flush().unwrap();
    assert_eq!(std::fs::read(&image).unwrap()[..4096], pattern(4, 4096)[..]);
}

/// A server that is not there, an export it does not have, a read-only
/// export opened writable, options vsd's client does not take: one line,
/// in QEMU's words where QEMU has them.
#[test]
fn mistakes_are_one_line_errors() {
    let dir = Scratch::new("nbdc-mistakes");
    let missing = dir.path("missing.sock");
    let refused = vsd_fails(&["--blockdev", &nbd_node(&missing, "disk", "")]);
    assert!(refused.contains(&format!("Failed to connect to '{}'", missing.display())), "{refused}");
    let image = dir.image("remote.img", MIB);
    let socket = dir.path("qsd.sock");
    let _qsd = qsd_serving(&dir, &image, &socket);
    let refused = vsd_fails(&["--blockdev", &nbd_node(&socket, "nothing", "")]);
    assert!(refused.contains("Requested export not available"), "{refused}");
    let refused = vsd_fails(&["--blockdev", &nbd_node(&socket, "disk", ",tls-creds=t0")]);
    assert!(refused.contains("No TLS credentials with id 't0'"), "{refused}");
    let refused = vsd_fails(&["--blockdev", "driver=nbd,node-name=n0,server.type=vsock,server.cid=3"]);
    assert!(refused.contains("server.type"), "{refused}");

    let _read_only = Nbdkit::start(&dir.path("ro.sock"), &["-r"], MIB);
    let refused = vsd_fails(&["--blockdev", &nbd_node(&dir.path("ro.sock"), "", "")]);
    assert!(refused.contains("NBD export is read-only"), "{refused}");
}

/// A request the server fails (nbdkit's protect filter refuses writes to
/// the first 64 KiB with EPERM) fails for the client; the others succeed.
#[test]
fn the_server_s_errors_are_the_request_s() {
    let dir = Scratch::new("nbdc-errors");
    let _kit = Nbdkit::start(&dir.path("kit.sock"), &["protect protect=0-65535"], 4 * MIB);
    let vsd = vsd_over(&dir, nbd_node(&dir.path("kit.sock"), "", ""), "");
    let mut client = vsd.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    assert!(queue.write_at(4096, &pattern(1, 4096)).is_err(), "a write the server refuses fails");
    queue.write_at(MIB, &pattern(2, 4096)).unwrap();
    let mut back = vec![0; 4096];
    queue.read_at(MIB, &mut back).unwrap();
    assert_eq!(back, pattern(2, 4096));
    queue.read_at(4096, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0), "the refused write left nothing");
}

/// A server without FUA (nbdkit's sh plugin, logging what it is asked):
/// a durable write (a writethrough export) is a write and then a flush,
/// in that order; with write-back, writes go without flushes.
#[test]
fn durable_writes_to_a_server_without_fua_are_followed_by_a_flush() {
    let dir = Scratch::new("nbdc-nofua");
    let (image, log) = (dir.image("remote.img", MIB), dir.path("calls.log"));
    let script = dir.path("server.sh");
    let body = format!(
        "#!/bin/bash\ncase \"$1\" in\n  get_size) echo {MIB} ;;\n  can_write|can_flush) exit 0 ;;\n  can_fua) echo none ;;\n  \
         pread) dd if={img} skip=$4 count=$3 iflag=skip_bytes,count_bytes status=none ;;\n  \
         pwrite) echo \"pwrite $3 $4\" >> {log}; dd of={img} seek=$4 conv=notrunc oflag=seek_bytes status=none ;;\n  \
         flush) echo flush >> {log} ;;\n  *) exit 2 ;;\nesac\n",
        img = image.display(),
        log = log.display()
    );
    std::fs::write(&script, body).unwrap();
    run("chmod", &["+x", script.to_str().unwrap()]);
    let socket = dir.path("kit.sock");
    let mut kit = Command::new("nbdkit").args(["-f", "-U"]).arg(&socket).arg("sh").arg(&script).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        assert!(Instant::now() < deadline, "nbdkit did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    let calls = |writethrough: &str| {
        let _ = std::fs::remove_file(&log);
        let vsd = vsd_over(&dir, nbd_node(&socket, "", ""), writethrough);
        let mut client = vsd.connect(ClientOptions::default());
        let mut queue = client.take_queue(0).unwrap();
        for i in 0..3u64 {
            queue.write_at(i * 65536, &pattern(i, 4096)).unwrap();
        }
        drop((queue, client, vsd));
        std::fs::read_to_string(&log).unwrap_or_default().lines().map(String::from).collect::<Vec<_>>()
    };
    let durable = calls(",writethrough=on");
    let expected: Vec<String> = (0..3).flat_map(|i| [format!("pwrite 4096 {}", i * 65536), "flush".into()]).collect();
    assert_eq!(durable[..6], expected[..], "{durable:?}");
    let write_back = calls("");
    assert_eq!(write_back[..3], ["pwrite 4096 0", "pwrite 4096 65536", "pwrite 4096 131072"], "{write_back:?}");
    assert_eq!(std::fs::read(&image).unwrap()[65536..][..4096], pattern(1, 4096)[..]);
    let _ = kit.kill();
    let _ = kit.wait();
}

/// How the test's hostile server answers the first request of a connection.
#[derive(Clone, Copy, Debug)]
enum Hostile {
    /// Sixteen bytes that are no reply.
    BadMagic,
    /// A reply to a request never sent.
    UnknownCookie,
    /// Half a read's data, then the connection closes.
    ShortRead,
    /// Structured replies: a read's data chunk past the request's end.
    ChunkOutside,
    /// Structured replies: a chunk of a type NBD does not have.
    UnknownChunk,
    /// Structured replies: a block status for a context never given.
    WrongContext,
}

impl Hostile {
    fn structured(self) -> bool {
        matches!(self, Hostile::ChunkOutside | Hostile::UnknownChunk | Hostile::WrongContext)
    }
}

/// A server that negotiates properly (1 MiB, flush; structured replies and
/// `base:allocation` with id 1 if `how` is structured, else neither) and
/// then answers every connection's first request as `how` says.
fn hostile_server(socket: &Path, how: Hostile) -> std::thread::JoinHandle<()> {
    use std::io::{Read, Write};
    let listener = std::os::unix::net::UnixListener::bind(socket).unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { return };
            let mut greeting = b"NBDMAGICIHAVEOPT".to_vec();
            greeting.extend_from_slice(&3u16.to_be_bytes());
            let mut flags = [0u8; 4];
            if s.write_all(&greeting).and_then(|()| s.read_exact(&mut flags)).is_err() {
                continue;
            }
            let reply = |option: u32, kind: u32, body: &[u8]| {
                let mut out = 0x0003_e889_0455_65a9u64.to_be_bytes().to_vec();
                out.extend_from_slice(&option.to_be_bytes());
                out.extend_from_slice(&kind.to_be_bytes());
                out.extend_from_slice(&(body.len() as u32).to_be_bytes());
                out.extend_from_slice(body);
                out
            };
            // Options until GO: STRUCTURED_REPLY and SET_META_CONTEXT
            // granted or refused as `how` says, any other refused.
            let negotiated = loop {
                let mut header = [0u8; 16];
                if s.read_exact(&mut header).is_err() {
                    break false;
                }
                let option = u32::from_be_bytes(header[8..12].try_into().unwrap());
                let mut data = vec![0; u32::from_be_bytes(header[12..16].try_into().unwrap()) as usize];
                let _ = s.read_exact(&mut data);
                let answer = match option {
                    7 => {
                        let mut info = 0u16.to_be_bytes().to_vec();
                        info.extend_from_slice(&MIB.to_be_bytes());
                        info.extend_from_slice(&(1u16 | 4).to_be_bytes());
                        [reply(7, 3, &info), reply(7, 1, &[])].concat()
                    }
                    8 if how.structured() => reply(8, 1, &[]),
                    10 if how.structured() => {
                        let context = [&1u32.to_be_bytes()[..], b"base:allocation"].concat();
                        [reply(10, 4, &context), reply(10, 1, &[])].concat()
                    }
                    _ => reply(option, 0x8000_0001, &[]),
                };
                if s.write_all(&answer).is_err() {
                    break false;
                }
                if option == 7 {
                    break true;
                }
            };
            if !negotiated {
                continue;
            }
            let mut request = [0u8; 28];
            if s.read_exact(&mut request).is_err() {
                continue;
            }
            let cookie = u64::from_be_bytes(request[8..16].try_into().unwrap());
            let len = u32::from_be_bytes(request[24..28].try_into().unwrap()) as usize;
            let mut simple = 0x6744_6698u32.to_be_bytes().to_vec();
            simple.extend_from_slice(&0u32.to_be_bytes());
            let offset = u64::from_be_bytes(request[16..24].try_into().unwrap());
            let chunk = |kind: u16, body: &[u8]| {
                let mut out = 0x668e_33efu32.to_be_bytes().to_vec();
                out.extend_from_slice(&1u16.to_be_bytes()); // DONE
                out.extend_from_slice(&kind.to_be_bytes());
                out.extend_from_slice(&cookie.to_be_bytes());
                out.extend_from_slice(&(body.len() as u32).to_be_bytes());
                out.extend_from_slice(body);
                out
            };
            let answer = match how {
                Hostile::ChunkOutside => {
                    chunk(1, &[&(offset + len as u64 - 4096).to_be_bytes()[..], &vec![0x5a; 8192]].concat())
                }
                Hostile::UnknownChunk => chunk(77, &[0x5a; 12]),
                Hostile::WrongContext => {
                    chunk(5, &[&99u32.to_be_bytes()[..], &(len as u32).to_be_bytes(), &3u32.to_be_bytes()].concat())
                }
                Hostile::BadMagic => vec![0xee; 16],
                Hostile::UnknownCookie => [simple, (cookie + 12345).to_be_bytes().to_vec()].concat(),
                Hostile::ShortRead => [simple, cookie.to_be_bytes().to_vec(), vec![0x5a; len / 2]].concat(),
            };
            let _ = s.write_all(&answer);
        }
    })
}

/// A server that breaks the protocol fails the request with an I/O
/// error, and only it: vsd keeps running and keeps asking the server.
/// With structured replies, a data chunk outside the request and a chunk
/// of an unknown type fail the read.
#[test]
fn a_server_that_breaks_the_protocol_fails_requests_not_vsd() {
    let all =
        [Hostile::BadMagic, Hostile::UnknownCookie, Hostile::ShortRead, Hostile::ChunkOutside, Hostile::UnknownChunk];
    for how in all {
        let dir = Scratch::new("nbdc-hostile");
        let socket = dir.path("evil.sock");
        let _server = hostile_server(&socket, how);
        let mut vsd = vsd_over(&dir, nbd_node(&socket, "", ""), "");
        let mut client = vsd.connect(ClientOptions::default());
        let mut queue = client.take_queue(0).unwrap();
        let mut buf = vec![0; 65536];
        // The connection is dialled again: each request meets the same server,
        // and fails at once (no reconnect-delay), not when the client gives up.
        for _ in 0..3 {
            let started = Instant::now();
            assert!(queue.read_at(0, &mut buf).is_err(), "{how:?}: the read fails");
            assert!(started.elapsed() < Duration::from_secs(2), "{how:?}: at once");
        }
        drop((queue, client));
        assert!(vsd.is_running(), "{how:?}: vsd runs on");
        assert!(vsd.stop().success(), "{how:?}: vsd stops cleanly");
    }
}

/// A zeroing that must be fast (qemu-io's `write -z -n`, NBD's FAST_ZERO
/// through vsd's export) reaches a server that can zero fast, and is
/// refused with ENOTSUP by one that cannot (nbdkit without zeroing),
/// where a plain zeroing is written as data.
#[test]
fn fast_zeroing_goes_through_or_is_refused_as_the_server_can() {
    let dir = Scratch::new("nbdc-fast-zero");
    let io = |command: &str| {
        let x = uri(&dir.path("vsd-nbd.sock"), "x");
        run("qemu-io", &["-f", "raw", "-c", command, &x])
    };
    for (filters, fast) in [(&[][..], true), (&["nozero zeromode=none"][..], false)] {
        let _kit = Nbdkit::start(&dir.path("kit.sock"), filters, 4 * MIB);
        let _vsd = vsd_over(&dir, nbd_node(&dir.path("kit.sock"), "", ""), "");
        assert!(io("write -P 0x5a 0 1M").status.success());
        let out = io("write -z -n 0 64k");
        let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        assert_eq!(!text.contains("Operation not supported"), fast, "{filters:?}: {text}");
        assert!(io("write -z 512k 64k").status.success(), "{filters:?}: a plain zeroing works either way");
        let read = io("read -P 0 512k 64k");
        assert!(!String::from_utf8_lossy(&read.stdout).contains("verification failed"), "{filters:?}");
        let read = io("read -P 0 0 64k");
        let zeroed = !String::from_utf8_lossy(&read.stdout).contains("verification failed");
        assert_eq!(zeroed, fast, "{filters:?}: the refused fast zeroing changed nothing");
    }
}

/// A block status for a metadata context the server never gave fails the
/// request (here, NBD's block status through vsd's export), and only it.
#[test]
fn a_block_status_in_a_context_never_given_fails_the_request_not_vsd() {
    let dir = Scratch::new("nbdc-hostile-context");
    let socket = dir.path("evil.sock");
    let _server = hostile_server(&socket, Hostile::WrongContext);
    let mut vsd = vsd_over(&dir, nbd_node(&socket, "", ""), "");
    let out = run("nbdinfo", &["--map", &uri(&dir.path("vsd-nbd.sock"), "x")]);
    assert!(!out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(vsd.is_running(), "vsd runs on");
    assert!(vsd.stop().success(), "vsd stops cleanly");
}

/// `nbdinfo --map` of `uri`, adjacent extents of one type merged:
/// (offset, length, type: 0 data, 3 hole and zeroes).
fn map(uri: &str) -> Vec<(u64, u64, u32)> {
    let out = ok("nbdinfo", &["--map", uri]);
    let mut extents: Vec<(u64, u64, u32)> = Vec::new();
    for line in out.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [offset, len, kind, ..] = fields[..] else { continue };
        let (offset, len, kind) = (offset.parse().unwrap(), len.parse().unwrap(), kind.parse().unwrap());
        match extents.last_mut() {
            Some(last) if last.2 == kind && last.0 + last.1 == offset => last.1 += len,
            _ => extents.push((offset, len, kind)),
        }
    }
    extents
}

/// The bytes of NBD export `uri`, every one read (no block status).
fn read_all(dir: &Scratch, uri: &str, name: &str) -> Vec<u8> {
    let out = dir.path(name);
    ok("nbdcopy", &["--no-extents", uri, out.to_str().unwrap()]);
    std::fs::read(&out).unwrap()
}

/// A sparse 8 MiB qcow2 image written by qemu-io (0x11 at 0 for 192 KiB,
/// zero clusters at 1 MiB for 512 KiB, 0x22 at 3 MiB for 64 KiB, 0x33 at
/// 5 MiB for 1 MiB whose first 128 KiB are zeroed again), exported as
/// `disk` by qemu-storage-daemon on `qsd.sock`; and its bytes.
fn sparse_qcow2_on_qsd(dir: &Scratch) -> (Daemon, Vec<u8>) {
    let image = dir.path("sparse.qcow2");
    let img = image.to_str().unwrap();
    ok("qemu-img", &["create", "-q", "-f", "qcow2", img, "8M"]);
    let writes = ["write -P 0x11 0 192k", "write -z 1M 512k", "write -P 0x22 3M 64k", "write -P 0x33 5M 1M"];
    let mut args = vec!["-f", "qcow2"];
    for w in writes.iter().chain(&["write -z 5M 128k"]) {
        args.extend(["-c", w]);
    }
    args.push(img);
    ok("qemu-io", &args);
    let raw = dir.path("sparse.raw");
    ok("qemu-img", &["convert", "-O", "raw", img, raw.to_str().unwrap()]);
    let bytes = std::fs::read(&raw).unwrap();
    let qsd = Daemon::qsd(
        dir,
        &[
            "--blockdev".into(),
            format!("driver=file,node-name=f0,filename={img}"),
            "--blockdev".into(),
            "driver=qcow2,node-name=q0,file=f0".into(),
            "--nbd-server".into(),
            format!("addr.type=unix,addr.path={}", dir.path("qsd.sock").display()),
            "--export".into(),
            "type=nbd,id=e0,node-name=q0,name=disk,writable=on".into(),
        ],
    );
    (qsd, bytes)
}

/// The sparse qcow2 image exported by qemu-storage-daemon: vsd's
/// `driver=nbd` asks it for block status, so vsd's own export maps as
/// qemu-storage-daemon's does, and reads over structured replies (data
/// and hole chunks) return exactly what qemu-io wrote.
#[test]
fn block_status_and_sparse_reads_of_a_qemu_storage_daemon_export() {
    let dir = Scratch::new("nbdc-status-qsd");
    let (_qsd, bytes) = sparse_qcow2_on_qsd(&dir);
    let qsd_sock = dir.path("qsd.sock");
    let vsd = vsd_over(&dir, nbd_node(&qsd_sock, "disk", ""), "");
    let (theirs, ours) = (uri(&qsd_sock, "disk"), uri(&dir.path("vsd-nbd.sock"), "x"));

    let expected = map(&theirs);
    assert_eq!(expected[0], (0, 192 << 10, 0), "qemu-storage-daemon maps the data: {expected:?}");
    assert!(expected.iter().any(|&(o, l, k)| o <= MIB && MIB + (512 << 10) <= o + l && k == 3), "{expected:?}");
    assert!(expected.iter().any(|&(o, l, k)| o <= 5 * MIB && 5 * MIB + (128 << 10) <= o + l && k == 3));
    assert_eq!(map(&ours), expected, "vsd's export maps as qemu-storage-daemon's");

    assert!(read_all(&dir, &ours, "ours.raw") == bytes, "vsd reads what qemu-io wrote");
    // Pattern reads, data and holes alternating through the same buffers.
    let reads = [
        "read -P 0x11 0 192k",
        "read -P 0 192k 832k",
        "read -P 0x22 3M 64k",
        "read -P 0 1M 512k",
        "read -P 0x33 5248k 896k",
        "read -P 0 5M 128k",
        "read -P 0 6M 2M",
    ];
    let mut args = vec!["-r", "-f", "raw"];
    for r in &reads {
        args.extend(["-c", r]);
    }
    args.push(&ours);
    let out = ok("qemu-io", &args);
    assert!(!out.contains("Pattern verification failed"), "{out}");
    drop(vsd);
}

/// nbdkit's sparse-random plugin answers block status: vsd's export maps
/// as nbdkit does and reads the same bytes, also when nbdkit refuses
/// requests not in whole 4 KiB blocks. With `--no-sr` (no structured
/// replies, so no block status) vsd reads the same and calls it all data.
#[test]
fn block_status_of_nbdkit_with_and_without_structured_replies() {
    let strict = "blocksize-policy blocksize-minimum=4096 blocksize-error-policy=error";
    for filters in [&[][..], &[strict], &["--no-sr"]] {
        let no_sr = filters == ["--no-sr"];
        let dir = Scratch::new("nbdc-status-kit");
        let kit_sock = dir.path("kit.sock");
        let _kit =
            Nbdkit::serving(&kit_sock, filters, &["sparse-random", "32M", "seed=7", "percent=30", "runlength=65536"]);
        let vsd = vsd_over(&dir, nbd_node(&kit_sock, "", ""), "");
        let (theirs, ours) = (uri(&kit_sock, ""), uri(&dir.path("vsd-nbd.sock"), "x"));
        if no_sr {
            assert_eq!(map(&ours), [(0, 32 * MIB, 0)], "all data");
        } else {
            let kit_map = map(&theirs);
            assert!(kit_map.iter().filter(|e| e.2 == 3).count() > 3, "nbdkit has holes: {kit_map:?}");
            assert_eq!(map(&ours), kit_map, "vsd's export maps as nbdkit's");
        }
        let want = read_all(&dir, &theirs, "theirs.raw");
        assert!(read_all(&dir, &ours, "ours.raw") == want, "{filters:?}: vsd reads what nbdkit serves");
        drop(vsd);
    }
}

/// A full backup whose source is the sparse image on qemu-storage-daemon,
/// through `driver=nbd`, skips its holes: the qcow2 target holds data
/// clusters only where the source has data, and the source's bytes.
#[test]
fn a_backup_from_an_nbd_source_skips_its_holes() {
    let dir = Scratch::new("nbdc-status-backup");
    let (_qsd, bytes) = sparse_qcow2_on_qsd(&dir);
    let target = dir.path("target.qcow2");
    ok("qemu-img", &["create", "-q", "-f", "qcow2", target.to_str().unwrap(), "8M"]);
    let qmp_socket = dir.path("qmp.sock");
    let mut args = vec![
        "--blockdev".into(),
        nbd_node(&dir.path("qsd.sock"), "disk", ""),
        "--blockdev".into(),
        format!("driver=file,node-name=tf,filename={}", target.display()),
        "--blockdev".into(),
        "driver=qcow2,node-name=t0,file=tf".into(),
    ];
    args.extend(common::monitor(&qmp_socket));
    let vsd = Daemon::vsd(&dir, &args);
    let mut qmp = common::qmp::Qmp::connect(&qmp_socket);
    let backup = serde_json::json!({"job-id": "b", "device": "n0", "target": "t0", "sync": "full"});
    qmp.ok("blockdev-backup", backup);
    let done = qmp.await_event("BLOCK_JOB_COMPLETED", serde_json::json!({"device": "b"}));
    assert!(done.get("error").is_none(), "{done}");
    drop(qmp);
    assert!(vsd.stop().success());
    let map: serde_json::Value =
        serde_json::from_str(&ok("qemu-img", &["map", "--output=json", target.to_str().unwrap()])).unwrap();
    let data: u64 =
        map.as_array().unwrap().iter().filter(|e| e["data"] == true).map(|e| e["length"].as_u64().unwrap()).sum();
    assert_eq!(data, (192 + 64 + 896) << 10, "data clusters only where the source has data: {map}");
    let copy = dir.path("target.raw");
    ok("qemu-img", &["convert", "-O", "raw", target.to_str().unwrap(), copy.to_str().unwrap()]);
    assert!(std::fs::read(&copy).unwrap() == bytes, "the target holds the source's bytes");
}
