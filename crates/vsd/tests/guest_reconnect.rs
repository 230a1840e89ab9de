//! A back-end killed mid-I/O and restarted: QEMU's vhost-user-blk
//! front-end reconnects (`-chardev socket,reconnect-ms=`) and hands the new
//! vsd the inflight region (INFLIGHT_SHMFD) the old one kept its requests
//! in; the new one serves again what was in flight. The guest's fio, writing
//! with crc32c verification and then reading everything back, must not see
//! one error or one lost request across several SIGKILLs.

mod common;

use std::ffi::OsStr;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Scratch, VSD, file_export};

const MIB: u64 = 1 << 20;
const KILLS: usize = 8;
/// Whether a kill catches requests in flight is chance: while none has,
/// the kills go on, up to this many, as long as fio's write pass lasts.
const MAX_KILLS: usize = 16;

/// One vsd process, its log appended to `log`.
struct Vsd(Child);

impl Vsd {
    fn start(dir: &Scratch, args: &[String], log: &Path) -> Self {
        let pidfile = dir.path("vsd.pid");
        let _ = std::fs::remove_file(&pidfile);
        let stderr = File::options().create(true).append(true).open(log).unwrap();
        let mut child = Command::new(VSD)
            .args(common::sandboxed(args))
            .arg("--pidfile")
            .arg(&pidfile)
            .env("RUST_LOG", "vsd_export=info")
            .stdin(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !pidfile.exists() {
            assert!(child.try_wait().unwrap().is_none(), "vsd exited during startup");
            assert!(Instant::now() < deadline, "vsd did not become ready");
            std::thread::sleep(Duration::from_millis(10));
        }
        Self(child)
    }

    fn kill(mut self) {
        // SAFETY: kill() with the pid of a child we spawned and have not reaped.
        assert_eq!(unsafe { libc::kill(self.0.id() as i32, libc::SIGKILL) }, 0);
        let status = self.0.wait().unwrap();
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(libc::SIGKILL));
    }
}

impl Drop for Vsd {
    fn drop(&mut self) {
        if self.0.try_wait().unwrap().is_none() {
            // SAFETY: as in `kill`.
            unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
            let _ = self.0.wait();
        }
    }
}

/// Bytes of the image's file allocated on the host.
fn allocated(image: &Path) -> u64 {
    std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(image).unwrap()) * 512
}

fn console_has(console: &Path, fact: &str) -> bool {
    std::fs::read_to_string(console).is_ok_and(|text| text.contains(&format!("VSD-GUEST {fact}")))
}

#[test]
fn guest_fio_verify_survives_back_end_kills_mid_io() {
    let dir = Scratch::new("guest-reconnect");
    let image = dir.image("disk.img", 256 * MIB);
    let socket = dir.path("vsd.sock");
    // O_DIRECT: requests stay in flight on the host long enough for kills
    // to catch some.
    let args = file_export(&image, &socket, ",cache.direct=on", ",writable=on,num-queues=2");
    let vsd_log = dir.path("vsd.log");
    let console: PathBuf = dir.path("console.log");
    let mut vsd = Vsd::start(&dir, &args, &vsd_log);

    let guest = {
        let (console, socket) = (console.clone(), socket.clone());
        std::thread::spawn(move || {
            let args = [
                OsStr::new("--socket"),
                socket.as_os_str(),
                OsStr::new("--reconnect-ms"),
                OsStr::new("500"),
                OsStr::new("--queues"),
                OsStr::new("2"),
                OsStr::new("--size"),
                OsStr::new("128M"),
                OsStr::new("--bs"),
                OsStr::new("4k"),
                OsStr::new("--iodepth"),
                OsStr::new("32"),
                OsStr::new("--timeout"),
                OsStr::new("1200"),
            ];
            common::run_guest(&console, args)
        })
    };

    // Wait for fio to start, then kill vsd and start a new one, several
    // times, only while fio runs (before the read-back pass reports).
    let deadline = Instant::now() + Duration::from_secs(900);
    while !console_has(&console, "fio_expected_bytes=") {
        assert!(!guest.is_finished(), "the guest ended before fio started");
        assert!(Instant::now() < deadline, "fio did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut kills = Vec::new();
    let mut written = allocated(&image);
    'kills: for n in 0..MAX_KILLS {
        let caught =
            || std::fs::read_to_string(&vsd_log).unwrap_or_default().lines().filter_map(takeover).any(|t| t[0] > 0);
        if n >= KILLS && caught() {
            break;
        }
        // Let the new back-end reconnect (QEMU retries every 500 ms) and
        // serve a while: fio's writes allocate the sparse image's blocks.
        // Kills come often enough for several to land in the write pass:
        // whether one catches requests in flight is chance, per kill.
        std::thread::sleep(Duration::from_millis(800 + 200 * n.min(4) as u64));
        while allocated(&image) == written {
            if console_has(&console, "fio_verify_status=") || guest.is_finished() {
                break 'kills;
            }
            assert!(Instant::now() < deadline, "no progress after {} kills", kills.len());
            std::thread::sleep(Duration::from_millis(50));
        }
        written = allocated(&image);
        if console_has(&console, "fio_verify_status=") || guest.is_finished() {
            break;
        }
        let pass = if console_has(&console, "fio_write_status=") { "read-back" } else { "write" };
        vsd.kill();
        kills.push(pass);
        std::thread::sleep(Duration::from_millis(100 * n as u64));
        vsd = Vsd::start(&dir, &args, &vsd_log);
    }
    let facts = guest.join().expect("the guest's job passed");
    drop(vsd);

    let log = std::fs::read_to_string(&vsd_log).unwrap();
    // Each new vsd logs, per queue, what it took over: requests in flight,
    // where it resumed the available ring and the base QEMU sent.
    let takeovers: Vec<[u16; 3]> = log.lines().filter_map(takeover).collect();
    let connections = log.lines().filter(|l| l.contains("front-end connected")).count();
    eprintln!(
        "{} kills during fio ({kills:?}); per restarted queue [in flight, next_avail, QEMU's base]: {takeovers:?}; \
         {connections} connections",
        kills.len()
    );
    assert!(kills.len() >= 3, "vsd was killed only {} times while fio ran: {kills:?}", kills.len());
    assert!(connections > kills.len(), "QEMU reconnected after every kill:\n{log}");
    assert_eq!(takeovers.len(), 2 * kills.len(), "both queues of every new vsd took over:\n{log}");
    assert!(takeovers.iter().any(|t| t[0] > 0), "some kill hit requests in flight:\n{log}");
    for [in_flight, next_avail, base] in &takeovers {
        // QEMU, having lost the back-end, resets its ring base to the used
        // index: the requests in flight are past it.
        assert_eq!(next_avail.wrapping_sub(*base), *in_flight, "{takeovers:?}");
    }
    // run_guest checked that both fio passes exited 0 and moved every byte.
    assert_eq!(facts["fio_write_status"], "0");
    assert_eq!(facts["fio_verify_status"], "0");
    assert_eq!(facts["fio_write_write_bytes"], facts["fio_expected_bytes"]);
    assert_eq!(facts["fio_verify_read_bytes"], facts["fio_expected_bytes"]);
    assert_eq!(facts["fio_expected_bytes"], (128 * MIB).to_string());
    assert_eq!(facts["fio_write_error"], "0");
    assert_eq!(facts["fio_verify_error"], "0");
}

/// `[in flight, next_avail, base]` from a "taking over" log line.
fn takeover(line: &str) -> Option<[u16; 3]> {
    let rest = line.split_once("taking over from a previous back-end: ")?.1;
    let numbers: Vec<u16> =
        rest.split(|c: char| !c.is_ascii_digit()).filter(|w| !w.is_empty()).filter_map(|w| w.parse().ok()).collect();
    numbers.try_into().ok()
}
