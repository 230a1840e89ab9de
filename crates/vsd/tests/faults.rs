//! Faults of the host: injected I/O errors (`driver=blkdebug`), a full
//! file system and an image whose permissions change under the daemon.
//! Each must reach the client as a failed request (EIO), never as a hang,
//! a crash, wrong data or a corrupt image; and vsd must keep serving.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{Daemon, Scratch, VSD, json_count, pattern, qcow2_export, run};
use vsd_bench::{ClientOptions, Error, Queue};

const MIB: u64 = 1 << 20;
const SECTOR: u64 = 512;

/// Short enough that a hang fails the test quickly, long enough for a
/// loaded machine.
fn client_options() -> ClientOptions {
    ClientOptions { io_timeout: Duration::from_secs(15), ..Default::default() }
}

/// The errno of a request that must fail, failing the test if it did not
/// or if it failed other than as a request (a timeout, a broken queue).
fn request_errno(result: Result<(), Error>, what: &str) -> i32 {
    match result {
        Err(Error::Request { errno, .. }) => errno,
        Err(e) => panic!("{what}: failed, but not as a request: {e}"),
        Ok(()) => panic!("{what}: succeeded, but an error was injected"),
    }
}

/// Arguments serving `image` through a blkdebug node with `rules`, the
/// blkdebug node under `format` (raw: the blkdebug node is exported).
fn blkdebug_export(image: &Path, socket: &Path, format: &str, rules: &str) -> Vec<String> {
    let mut args = vec![
        "--blockdev".into(),
        format!("driver=file,node-name=file0,filename={}", image.display()),
        "--blockdev".into(),
        format!("driver=blkdebug,node-name=dbg0,image=file0{rules}"),
    ];
    let top = if format == "raw" {
        "dbg0"
    } else {
        args.extend(["--blockdev".into(), format!("driver={format},node-name=fmt0,file=dbg0")]);
        "fmt0"
    };
    args.extend([
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=exp0,node-name={top},addr.type=unix,addr.path={},writable=on",
            socket.display()
        ),
    ]);
    args
}

// ---------------------------------------------------------------- blkdebug

/// A real Linux guest whose writes fail (blkdebug under its disk) sees the
/// errors: its kernel logs I/O errors and fio fails with EIO; vsd stays up
/// and serves the next client.
#[test]
fn a_guest_sees_injected_write_errors() {
    let dir = Scratch::new("faults-guest");
    let image = dir.image("disk.img", 64 << 20);
    let socket = dir.path("vsd.sock");
    let daemon = Daemon::vsd(&dir, &blkdebug_export(&image, &socket, "raw", ",inject-error.0.iotype=write"));
    let args =
        ["--socket".as_ref(), socket.as_os_str(), "--queues".as_ref(), "1".as_ref(), "--size".as_ref(), "8M".as_ref()];
    let run = common::guest_job(&dir.path("console.log"), args);
    assert!(!run.passed, "the guest's fio passed although every write failed: {}", run.report);
    assert!(run.report.contains("VSD-GUEST done"), "the job ran to its end: {}", run.report);
    assert_ne!(run.facts["fio_write_status"], "0", "{}", run.report);
    assert_eq!(run.facts["fio_write_error"], "5", "fio saw EIO: {}", run.report);
    assert!(run.console.contains("I/O error"), "the guest kernel logged no I/O error");
    let mut client = daemon.connect(client_options());
    let mut q = client.take_queue(0).unwrap();
    let mut back = vec![0u8; 4096];
    q.read_at(0, &mut back).unwrap();
}

#[test]
fn blkdebug_fails_exactly_the_matching_requests() {
    let dir = Scratch::new("faults-blkdebug");
    let image = dir.image("disk.img", 8 * MIB);
    let rules = [
        // Reads of sector 2048 (1 MiB), always.
        ",inject-error.0.iotype=read,inject-error.0.sector=2048",
        // Writes of sector 4096 (2 MiB), always.
        ",inject-error.1.iotype=write,inject-error.1.sector=4096",
        // One write of sector 6144 (3 MiB), with ENOSPC (still EIO to the guest).
        ",inject-error.2.iotype=write,inject-error.2.sector=6144,inject-error.2.once=on,inject-error.2.errno=28",
        // One flush.
        ",inject-error.3.iotype=flush,inject-error.3.once=on",
    ]
    .concat();
    let mut daemon = Daemon::vsd(&dir, &blkdebug_export(&image, &dir.path("s.sock"), "raw", &rules));
    let mut client = daemon.connect(client_options());
    let mut q = client.take_queue(0).unwrap();
    let data = pattern(1, 64 * 1024);

    // Writes and other requests at 1 MiB pass: only its reads fail.
    q.write_at(MIB, &data).unwrap();
    q.write_zeroes(MIB + 4096, 4096, true).unwrap();
    q.discard(MIB + 8192, 4096).unwrap();
    q.write_at(MIB, &data).unwrap();
    assert_failed_read_leaves_buffer(&mut q, MIB, 4096);
    assert_failed_read_leaves_buffer(&mut q, MIB - 4096, 8192);
    assert_failed_read_leaves_buffer(&mut q, MIB - 3584, 4096);
    let mut back = vec![0u8; 64 * 1024 - 512];
    q.read_at(MIB + SECTOR, &mut back).unwrap();
    assert_eq!(back, data[512..], "the rest of the range reads back");
    q.read_at(MIB - 4096, &mut back[..4096]).unwrap();

    // Writes at 2 MiB fail every time and never reach the file.
    for attempt in 0..3 {
        assert_eq!(request_errno(q.write_at(2 * MIB, &data), "write at 2 MiB"), libc::EIO, "attempt {attempt}");
    }
    q.write_at(2 * MIB + SECTOR, &data[..4096]).unwrap();
    q.read_at(2 * MIB, &mut back[..4096]).unwrap();
    assert!(back[..512].iter().all(|&b| b == 0), "the failed writes left sector 4096 alone");

    // The once-rule fails one write (its ENOSPC is an IOERR for virtio-blk).
    assert_eq!(request_errno(q.write_at(3 * MIB, &data), "first write at 3 MiB"), libc::EIO);
    q.write_at(3 * MIB, &data).unwrap();
    q.read_at(3 * MIB, &mut back).unwrap();
    assert_eq!(back, data[..back.len()]);

    // One flush fails, the next succeeds.
    assert_eq!(request_errno(q.flush(), "first flush"), libc::EIO);
    q.flush().unwrap();

    assert!(daemon.is_running());
    drop(q);
    drop(client);
    // A new client is served too.
    let mut client = daemon.connect(client_options());
    let mut q = client.take_queue(0).unwrap();
    q.read_at(3 * MIB, &mut back).unwrap();
    assert_eq!(back, data[..back.len()]);
    assert_eq!(daemon.stop().code(), Some(0));
}

/// A read that hits a rule fails, and the client's buffer keeps what it
/// held: no stale or partial data is delivered.
fn assert_failed_read_leaves_buffer(q: &mut Queue, offset: u64, len: usize) {
    let mut buf = q.alloc_buffer(len).unwrap();
    buf.fill(0xa5);
    let errno = request_errno(q.read_buf(offset, &mut buf), &format!("read of {len} bytes at {offset}"));
    assert_eq!(errno, libc::EIO);
    assert!(buf.iter().all(|&b| b == 0xa5), "a failed read at {offset} wrote into the buffer");
}

/// The byte offsets of a fresh qcow2 image's L1 table and first refcount
/// block, from its header and refcount table.
fn qcow2_metadata_offsets(image: &Path) -> (u64, u64) {
    let bytes = std::fs::read(image).unwrap();
    let be64 = |at: usize| u64::from_be_bytes(bytes[at..at + 8].try_into().unwrap());
    let l1 = be64(40);
    let refcount_table = be64(48) as usize;
    (l1, be64(refcount_table))
}

fn create_qcow2(path: &Path, size: &str) {
    let out = run("qemu-img", &["create", "-q", "-f", "qcow2", path.to_str().unwrap(), size]);
    assert!(out.status.success(), "qemu-img create: {out:?}");
}

/// `qemu-img check` of `image`: fails the test on any corruption and
/// returns the number of leaked clusters (harmless: space, not data).
fn assert_no_corruption(image: &Path) -> u64 {
    let out = run("qemu-img", &["check", "--output=json", image.to_str().unwrap()]);
    let report = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(report.contains("\"image-end-offset\""), "qemu-img check did not finish: {report}");
    assert_eq!(json_count(&report, "corruptions"), 0, "{}: {report}", image.display());
    assert_eq!(json_count(&report, "check-errors"), 0, "{}: {report}", image.display());
    json_count(&report, "leaks")
}

/// `qemu-io` confirms that `len` bytes at `offset` of the qcow2 `image`
/// read as `byte`, as QEMU sees them.
fn assert_qemu_reads(image: &Path, offset: u64, len: u64, byte: u8) {
    let cmd = format!("read -P {byte:#x} {offset} {len}");
    let out = run("qemu-io", &["-f", "qcow2", "-c", &cmd, image.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !text.contains("Pattern verification failed"), "{cmd}: {text}");
}

/// Writes `CHUNK` bytes of `FILL` at each offset of `at`, each followed by
/// a flush, and returns the offsets whose write and flush both succeeded
/// and the errnos of the failed requests. Stops at the first failure once
/// `stop_at_failure`.
fn write_and_flush(q: &mut Queue, at: impl IntoIterator<Item = u64>, stop_at_failure: bool) -> (Vec<u64>, Vec<i32>) {
    let (mut durable, mut errors) = (Vec::new(), Vec::new());
    let data = vec![FILL; CHUNK as usize];
    for offset in at {
        match q.write_at(offset, &data).and_then(|()| q.flush()) {
            Ok(()) => durable.push(offset),
            Err(e) => {
                errors.push(request_errno(Err(e), &format!("write + flush at {offset}")));
                if stop_at_failure {
                    break;
                }
            }
        }
    }
    (durable, errors)
}

const CHUNK: u64 = 256 * 1024;
const FILL: u8 = 0x5a;

/// An injected write error in each step of a qcow2 allocation: the data
/// cluster, the refcount block and the L1 table (each written for the first
/// time by this workload), and the flush between them. The guest sees EIO,
/// the daemon goes on, later allocations succeed, and the image is
/// consistent with every acknowledged flush intact.
#[test]
fn blkdebug_under_qcow2_allocation_errors_leave_a_consistent_image() {
    let dir = Scratch::new("faults-qcow2-blkdebug");
    let probe = dir.path("probe.qcow2");
    create_qcow2(&probe, "16M");
    let (l1, refcount_block) = qcow2_metadata_offsets(&probe);
    let cases = [
        ("the first write (data)", ",inject-error.0.iotype=write,inject-error.0.once=on".to_string()),
        ("the refcount block", sector_rule("write", refcount_block)),
        ("the L1 table", sector_rule("write", l1)),
        ("a flush", ",inject-error.0.iotype=flush,inject-error.0.once=on".to_string()),
    ];
    for (case, rules) in cases {
        let image = dir.path("disk.qcow2");
        create_qcow2(&image, "16M");
        let mut daemon = Daemon::vsd(&dir, &blkdebug_export(&image, &dir.path("s.sock"), "qcow2", &rules));
        let mut client = daemon.connect(client_options());
        let mut q = client.take_queue(0).unwrap();
        let (durable, errors) = write_and_flush(&mut q, (0..8).map(|i| i * 2 * MIB), false);
        assert_eq!(errors, [libc::EIO], "{case}: exactly one request fails, with EIO");
        assert!(daemon.is_running(), "{case}");
        for &offset in &durable {
            let mut back = vec![0u8; CHUNK as usize];
            q.read_at(offset, &mut back).unwrap();
            assert!(back.iter().all(|&b| b == FILL), "{case}: vsd reads back {offset}");
        }
        drop(q);
        drop(client);
        assert_eq!(daemon.stop().code(), Some(0), "{case}");
        let leaks = assert_no_corruption(&image);
        eprintln!("{case}: {} of 8 writes durable, {leaks} leaked clusters", durable.len());
        for &offset in &durable {
            assert_qemu_reads(&image, offset, CHUNK, FILL);
        }
    }
}

/// An overlay's write into part of a cluster copies the rest up from the
/// backing file; a read error there fails the write with EIO and gives
/// the new cluster back: the cluster still reads as the backing file's,
/// the same write succeeds once the error is gone, and QEMU finds the
/// image consistent with no cluster leaked.
#[test]
fn a_failed_copy_up_read_fails_the_write_and_leaks_nothing() {
    let dir = Scratch::new("faults-copy-up");
    let (base, overlay) = (dir.path("base.raw"), dir.path("overlay.qcow2"));
    std::fs::write(&base, vec![0x11u8; 4 * MIB as usize]).unwrap();
    let (base_name, overlay_name) = (base.to_str().unwrap(), overlay.to_str().unwrap());
    let out = run("qemu-img", &["create", "-q", "-f", "qcow2", "-F", "raw", "-b", base_name, overlay_name]);
    assert!(out.status.success(), "qemu-img create: {out:?}");
    let cluster = MIB;
    let args = [
        format!("driver=file,node-name=base-file,filename={},read-only=on", base.display()),
        format!("driver=blkdebug,node-name=base,image=base-file,read-only=on{}", sector_rule("read", cluster)),
        format!("driver=file,node-name=overlay-file,filename={}", overlay.display()),
        "driver=qcow2,node-name=overlay,file=overlay-file,backing=base".to_string(),
    ];
    let mut argv: Vec<String> = args.into_iter().flat_map(|a| ["--blockdev".to_string(), a]).collect();
    argv.extend([
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=exp0,node-name=overlay,addr.type=unix,addr.path={},writable=on",
            dir.path("s.sock").display()
        ),
    ]);
    let daemon = Daemon::vsd(&dir, &argv);
    let mut client = daemon.connect(client_options());
    let mut q = client.take_queue(0).unwrap();
    let data = vec![FILL; 4096];
    let at = cluster + 8192;
    let errno = request_errno(q.write_at(at, &data), "a write whose copy-up read fails");
    assert_eq!(errno, libc::EIO);
    let mut back = vec![0u8; 64 * 1024];
    q.read_at(cluster, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0x11), "the cluster still reads as the backing file's");
    q.write_at(at, &data).unwrap();
    q.flush().unwrap();
    q.read_at(cluster, &mut back).unwrap();
    assert!(
        back[8192..12288].iter().all(|&b| b == FILL) && back[..8192].iter().chain(&back[12288..]).all(|&b| b == 0x11)
    );
    drop(q);
    drop(client);
    assert_eq!(daemon.stop().code(), Some(0));
    assert_eq!(assert_no_corruption(&overlay), 0, "the cluster given back is not leaked");
    assert_qemu_reads(&overlay, at, 4096, FILL);
    assert_qemu_reads(&overlay, cluster, 8192, 0x11);
}

/// A once-rule failing requests of `iotype` that touch the sector at byte
/// `offset`.
fn sector_rule(iotype: &str, offset: u64) -> String {
    format!(",inject-error.0.iotype={iotype},inject-error.0.sector={},inject-error.0.once=on", offset / SECTOR)
}

// --------------------------------------------------------------- full disk

/// A tmpfs mounted on a directory of a [`Scratch`], unmounted on drop.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Scratch, size: &str) -> Self {
        let path = dir.path("tmpfs");
        std::fs::create_dir_all(&path).unwrap();
        let out = run("mount", &["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs", path.to_str().unwrap()]);
        assert!(out.status.success(), "mount tmpfs (the test needs root): {out:?}");
        Self(path)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// A file of `len` bytes that really occupies the space.
    fn fill(&self, name: &str, len: u64) -> PathBuf {
        let path = self.path(name);
        std::fs::write(&path, vec![0xffu8; len as usize]).unwrap();
        path
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Lazily: a daemon that failed the test may still hold a file.
        let _ = run("umount", &["-l", self.0.to_str().unwrap()]);
    }
}

/// A raw image larger than its file system: writes fail with EIO once the
/// space runs out, what was written reads back, and writing works again
/// once space is freed. On both engines.
#[test]
fn full_disk_fails_raw_writes_with_eio_and_recovers() {
    for engine in ["io_uring", "threads"] {
        let dir = Scratch::new(&format!("faults-full-raw-{engine}"));
        let fs = Tmpfs::mount(&dir, "8M");
        let filler = fs.fill("filler", 2 * MIB);
        let image = fs.path("disk.img");
        std::fs::File::create(&image).unwrap().set_len(64 * MIB).unwrap();
        let args = common::file_export(&image, &dir.path("s.sock"), &format!(",aio={engine}"), ",writable=on");
        let mut daemon = Daemon::vsd(&dir, &args);
        let mut client = daemon.connect(client_options());
        let mut q = client.take_queue(0).unwrap();

        let chunk = |i: u64| pattern(i, MIB as usize);
        let full = (0..16u64)
            .find_map(|i| q.write_at(i * MIB, &chunk(i)).err().map(|e| (i, e)))
            .map(|(i, e)| (i, request_errno(Err(e), &format!("write {i}"))));
        let Some((failed, errno)) = full else { panic!("{engine}: 16 MiB fitted into an 8 MiB file system") };
        assert_eq!(errno, libc::EIO, "{engine}: a full file system is an I/O error to the guest");
        assert!(failed > 0, "{engine}: nothing could be written");
        assert!(daemon.is_running(), "{engine}");

        let mut back = vec![0u8; MIB as usize];
        for i in 0..failed {
            q.read_at(i * MIB, &mut back).unwrap();
            assert!(back == chunk(i), "{engine}: MiB {i} reads back");
        }
        std::fs::remove_file(filler).unwrap();
        q.write_at(failed * MIB, &chunk(failed)).unwrap();
        q.flush().unwrap();
        q.read_at(failed * MIB, &mut back).unwrap();
        assert!(back == chunk(failed), "{engine}: the write after freeing space reads back");
        drop(q);
        drop(client);
        assert_eq!(daemon.stop().code(), Some(0), "{engine}");
    }
}

/// A qcow2 image whose allocations run out of space: EIO, the daemon
/// stays up, and after it exits (still full) the image has no corruption
/// and every flushed write is intact; once space is freed, a new daemon
/// allocates again.
#[test]
fn full_disk_fails_qcow2_allocation_with_eio_without_corruption() {
    let dir = Scratch::new("faults-full-qcow2");
    let fs = Tmpfs::mount(&dir, "8M");
    let image = fs.path("disk.qcow2");
    create_qcow2(&image, "64M");
    let filler = fs.fill("filler", 5 * MIB);
    let socket = dir.path("s.sock");

    let mut daemon = Daemon::vsd(&dir, &qcow2_export(&image, &socket, ",writable=on"));
    let mut client = daemon.connect(client_options());
    let mut q = client.take_queue(0).unwrap();
    let (durable, errors) = write_and_flush(&mut q, (0..32).map(|i| i * MIB), true);
    assert_eq!(errors, [libc::EIO], "allocation on a full file system fails with EIO");
    assert!(!durable.is_empty(), "nothing could be allocated");
    assert!(daemon.is_running());
    let mut back = vec![0u8; CHUNK as usize];
    for &offset in &durable {
        q.read_at(offset, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == FILL), "vsd reads back {offset}");
    }
    drop(q);
    drop(client);
    let status = daemon.stop();
    let leaks = assert_no_corruption(&image);
    eprintln!("full qcow2: {} writes durable, vsd exited with {status}, {leaks} leaked clusters", durable.len());
    for &offset in &durable {
        assert_qemu_reads(&image, offset, CHUNK, FILL);
    }

    std::fs::remove_file(filler).unwrap();
    let daemon = Daemon::vsd(&dir, &qcow2_export(&image, &socket, ",writable=on"));
    let mut client = daemon.connect(client_options());
    let mut q = client.take_queue(0).unwrap();
    let next = durable.len() as u64 + 1;
    let (more, errors) = write_and_flush(&mut q, [next * MIB], true);
    assert!(errors.is_empty(), "allocating after space was freed: {errors:?}");
    drop(q);
    drop(client);
    assert_eq!(daemon.stop().code(), Some(0));
    assert_no_corruption(&image);
    assert_qemu_reads(&image, more[0], CHUNK, FILL);
}

// ------------------------------------------------------------- permissions

/// An image made unreadable while served: the open descriptor keeps
/// working; a new daemon, as a user the mode applies to, is refused with
/// an error naming the file.
#[test]
fn image_made_unreadable_keeps_serving_and_is_refused_on_reopen() {
    let dir = Scratch::new("faults-perms");
    let image = dir.image("disk.img", 4 * MIB);
    let daemon_args = common::file_export(&image, &dir.path("s.sock"), "", ",writable=on");
    let mut daemon = Daemon::vsd(&dir, &daemon_args);
    let mut client = daemon.connect(client_options());
    let mut q = client.take_queue(0).unwrap();
    let data = pattern(3, 64 * 1024);
    q.write_at(0, &data).unwrap();

    std::fs::set_permissions(&image, std::fs::Permissions::from_mode(0o000)).unwrap();
    q.write_at(MIB, &data).unwrap();
    q.flush().unwrap();
    let mut back = vec![0u8; data.len()];
    for offset in [0, MIB] {
        q.read_at(offset, &mut back).unwrap();
        assert_eq!(back, data, "read at {offset} after chmod 000");
    }
    assert!(daemon.is_running());

    // Root ignores file modes, so the second daemon runs as nobody; the
    // scratch directory must let it reach the image for the mode to be
    // what refuses it.
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let args = common::file_export(&image, &dir.path("other.sock"), "", ",writable=on");
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", VSD])
        .args(&args)
        .output()
        .expect("run setpriv");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "a second daemon as nobody: {stderr}");
    assert!(stderr.contains(image.to_str().unwrap()), "the error names the image: {stderr}");
    assert!(stderr.contains("Permission denied"), "the error says why: {stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "one error line: {stderr}");

    // The first daemon never noticed.
    q.read_at(MIB, &mut back).unwrap();
    assert_eq!(back, data);
    drop(q);
    drop(client);
    assert_eq!(daemon.stop().code(), Some(0));
}
