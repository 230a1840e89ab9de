//! Listening sockets a manager passes instead of paths (`addr.type=fd`):
//! by descriptor number, as QEMU takes them, or by the name systemd's
//! socket activation gives them (`systemd-socket-activate`, or the
//! variables set by hand). Real clients serve through them: qemu-img over
//! NBD, libblkio over vhost-user-blk; qemu-storage-daemon takes the same
//! command lines and is held to the same results and words.

mod common;

use std::net::TcpListener;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixDatagram, UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{Scratch, VSD, ok, pattern};
use serde_json::json;
use vsd_bench::{Client, ClientOptions};
use vsd_control::client::QmpClient;

const MIB: u64 = 1 << 20;
const QSD: &str = "qemu-storage-daemon";

/// A daemon started with sockets passed; killed on drop.
struct Passed {
    child: Child,
    pid: u32,
}

impl Passed {
    /// Runs `cmd` with `--pidfile` (in `dir`) and waits until the pidfile
    /// says everything listens.
    fn start(mut cmd: Command, dir: &Scratch) -> Self {
        let pidfile = dir.path("daemon.pid");
        let _ = std::fs::remove_file(&pidfile);
        let mut child = cmd.arg("--pidfile").arg(&pidfile).stdin(Stdio::null()).spawn().expect("spawn");
        let deadline = Instant::now() + Duration::from_secs(10);
        let pid = loop {
            if let Some(pid) = std::fs::read_to_string(&pidfile).ok().and_then(|t| t.trim().parse().ok()) {
                break pid;
            }
            if let Some(status) = child.try_wait().unwrap() {
                panic!("{cmd:?} exited during startup: {status}");
            }
            assert!(Instant::now() < deadline, "{cmd:?} did not become ready");
            std::thread::sleep(Duration::from_millis(10));
        };
        Self { child, pid }
    }

    /// Stops it with SIGTERM; true if it exited cleanly.
    fn stop(mut self) -> bool {
        // SAFETY: kill() with the pid of a child not yet reaped.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        self.child.wait().unwrap().success()
    }
}

impl Drop for Passed {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `program args`, with each `(descriptor, number)` of `fds` open in it
/// as `number` (no longer close-on-exec).
fn passing(program: &str, args: &[String], fds: &[(RawFd, RawFd)]) -> Command {
    let mut cmd = Command::new(program);
    cmd.args(args);
    assert!(fds.len() <= 8, "passing() moves at most 8 descriptors");
    let fds = fds.to_vec();
    // SAFETY: the closure only calls fcntl and dup2, which are
    // async-signal-safe, and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            // Out of the way first, so that no target overwrites a source.
            let mut high = [0; 8];
            for (slot, (fd, _)) in high.iter_mut().zip(&fds) {
                *slot = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, 100);
            }
            for (from, (_, to)) in high.iter().zip(&fds) {
                if libc::dup2(*from, *to) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        })
    };
    cmd
}

/// As [`passing`], with the socket activation variables for the fds
/// passed as 3, 4, ...: `LISTEN_PID` is the daemon's own (a shell sets it
/// and execs), unless `pid` gives one.
fn activating(args: &[String], fds: &[RawFd], names: Option<&str>, pid: Option<&str>) -> Command {
    let mut shell = vec!["-c".into(), "export LISTEN_PID=${LISTEN_PID:-$$}; exec \"$0\" \"$@\"".into(), VSD.into()];
    shell.extend_from_slice(args);
    let numbered: Vec<_> = fds.iter().zip(3..).map(|(&fd, to)| (fd, to)).collect();
    let mut cmd = passing("sh", &shell, &numbered);
    cmd.env("LISTEN_FDS", fds.len().to_string());
    if let Some(names) = names {
        cmd.env("LISTEN_FDNAMES", names);
    }
    match pid {
        Some(pid) => cmd.env("LISTEN_PID", pid),
        None => cmd.env_remove("LISTEN_PID"),
    };
    cmd
}

/// A raw image with a pattern in its first MiB.
fn patterned_image(dir: &Scratch) -> PathBuf {
    let image = dir.image("disk.img", 16 * MIB);
    std::fs::OpenOptions::new().write(true).open(&image).unwrap().write_all_at(&pattern(7, MIB as usize), 0).unwrap();
    image
}

fn node(image: &Path) -> Vec<String> {
    vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}", image.display()),
        "--blockdev".into(),
        "driver=raw,node-name=r0,file=f0".into(),
    ]
}

/// `node` over NBD as `disk`, the server on `addr.type=fd,addr.str=STR`.
fn nbd_on_fd(image: &Path, str: &str) -> Vec<String> {
    let mut args = node(image);
    args.extend([
        "--nbd-server".into(),
        format!("addr.type=fd,addr.str={str}"),
        "--export".into(),
        "type=nbd,id=n0,node-name=r0,name=disk".into(),
    ]);
    args
}

/// `node` writable over vhost-user-blk, on `addr.type=fd,addr.str=STR`.
fn vhost_on_fd(image: &Path, str: &str) -> Vec<String> {
    let mut args = node(image);
    args.extend([
        "--export".into(),
        format!("type=vhost-user-blk,id=v0,node-name=r0,addr.type=fd,addr.str={str},writable=on"),
    ]);
    args
}

/// vsd, sandboxed (the sandbox must allow what taking a socket over
/// takes), or qemu-storage-daemon.
fn daemon_args(program: &str, args: &[String]) -> Vec<String> {
    match program {
        VSD => common::sandboxed(args),
        _ => args.to_vec(),
    }
}

/// qemu-img finds the image's bytes at the NBD export `uri`.
fn assert_serves(image: &Path, uri: &str) {
    ok("qemu-img", &["compare", "-f", "raw", "-F", "raw", &image.display().to_string(), uri]);
}

#[test]
fn nbd_server_serves_unix_and_tcp_sockets_passed_by_number() {
    let dir = Scratch::new("fd-nbd");
    let image = patterned_image(&dir);
    for program in [VSD, QSD] {
        let path = dir.path("nbd.sock");
        let _ = std::fs::remove_file(&path);
        let unix = UnixListener::bind(&path).unwrap();
        let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = tcp.local_addr().unwrap().port();
        for (fd, uri) in [
            (unix.as_raw_fd(), format!("nbd+unix:///disk?socket={}", path.display())),
            (tcp.as_raw_fd(), format!("nbd://127.0.0.1:{port}/disk")),
        ] {
            let args = daemon_args(program, &nbd_on_fd(&image, &fd.to_string()));
            let daemon = Passed::start(passing(program, &args, &[(fd, fd)]), &dir);
            assert_serves(&image, &uri);
            assert!(daemon.stop(), "{program} stops cleanly");
        }
        assert!(path.exists(), "{program} left the passed socket's file alone");
    }
}

#[test]
fn vhost_user_blk_export_keeps_a_passed_socket_across_reconnects() {
    let dir = Scratch::new("fd-vhost");
    for program in [VSD, QSD] {
        let image = patterned_image(&dir);
        let path = dir.path("vhost.sock");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let fd = listener.as_raw_fd();
        let args = daemon_args(program, &vhost_on_fd(&image, &fd.to_string()));
        let daemon = Passed::start(passing(program, &args, &[(fd, fd)]), &dir);
        let data = pattern(8, 64 << 10);
        {
            let mut client = Client::connect(&path, ClientOptions::default()).unwrap();
            assert_eq!(client.capacity().unwrap(), 16 * MIB);
            let mut queue = client.take_queue(0).unwrap();
            queue.write_at(MIB, &data).unwrap();
            queue.flush().unwrap();
        }
        // The front-end reconnects to the same socket.
        let mut client = Client::connect(&path, ClientOptions::default()).unwrap();
        let mut queue = client.take_queue(0).unwrap();
        let mut back = vec![0; data.len()];
        queue.read_at(MIB, &mut back).unwrap();
        assert!(back == data, "{program}: the second connection reads what the first wrote");
        drop((queue, client));
        assert!(daemon.stop(), "{program} stops cleanly");
        // QEMU unlinks the file of a passed unix socket when its export
        // stops; vsd leaves it to its owner, whose socket still listens.
        if program == VSD {
            drop(UnixStream::connect(&path).expect("the passed socket's file is there and listens"));
        }
    }
}

/// systemd's own tool: it listens, waits for a first client, then execs
/// vsd (keeping its pid) with the sockets from descriptor 3 on, named by
/// `--fdname`.
#[test]
fn systemd_socket_activate_hands_over_named_sockets() {
    let dir = Scratch::new("fd-activate");
    let image = patterned_image(&dir);
    let (nbd, vhost) = (dir.path("nbd.sock"), dir.path("vhost.sock"));
    let mut served = nbd_on_fd(&image, "nbd");
    served.extend([
        "--export".into(),
        "type=vhost-user-blk,id=v0,node-name=r0,addr.type=fd,addr.str=v0,writable=on".into(),
    ]);
    let mut cmd = Command::new("systemd-socket-activate");
    cmd.arg(format!("--listen={}", nbd.display()))
        .arg(format!("--listen={}", vhost.display()))
        .arg("--fdname=nbd:v0")
        .arg(VSD)
        .args(common::sandboxed(&served))
        .stderr(Stdio::null());
    // The first client wakes it, and waits in the backlog until vsd takes it.
    let knocking = nbd.clone();
    let waker = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(stream) = UnixStream::connect(&knocking) {
                return stream;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("systemd-socket-activate did not listen");
    });
    let daemon = Passed::start(cmd, &dir);
    drop(waker.join().unwrap());
    assert_eq!(daemon.pid, daemon.child.id(), "vsd runs in the activator's process");
    assert_serves(&image, &format!("nbd+unix:///disk?socket={}", nbd.display()));
    let client = Client::connect(&vhost, ClientOptions::default()).unwrap();
    assert_eq!(client.capacity().unwrap(), 16 * MIB);
    drop(client);
    for fd in [3, 4] {
        let info = std::fs::read_to_string(format!("/proc/{}/fdinfo/{fd}", daemon.pid)).unwrap();
        let flags = info.lines().find_map(|l| l.strip_prefix("flags:")).unwrap().trim();
        let flags = u32::from_str_radix(flags, 8).unwrap();
        assert_ne!(flags & libc::O_CLOEXEC as u32, 0, "descriptor {fd} is close-on-exec: {info}");
    }
    assert!(daemon.stop());
}

/// Runs `cmd`, which must refuse to start: exit status 1, one line on
/// stderr, returned.
fn refused(mut cmd: Command) -> String {
    let out: Output = cmd.stdin(Stdio::null()).output().expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{cmd:?} must exit 1: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "one error line, got: {stderr}");
    stderr
}

/// What QEMU refuses, vsd refuses in the same words; what QEMU lets
/// through but cannot serve, vsd refuses too.
#[test]
fn bad_passed_sockets_are_refused_in_qemus_words() {
    let dir = Scratch::new("fd-bad");
    let image = dir.image("disk.img", MIB);
    let null = std::fs::File::open("/dev/null").unwrap();
    // SAFETY: socket(2) touches no memory; the descriptor is owned here.
    let unbound = unsafe { std::os::fd::OwnedFd::from_raw_fd(libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0)) };
    let cases = [
        (null.as_raw_fd(), "200".to_string(), "File descriptor '200' is not a socket"),
        (null.as_raw_fd(), null.as_raw_fd().to_string(), "is not a socket"),
        (null.as_raw_fd(), "abc".into(), "Unable to parse FD number abc"),
        (unbound.as_raw_fd(), unbound.as_raw_fd().to_string(), "Failed to listen on fd socket: Invalid argument"),
    ];
    for (fd, str, expected) in cases {
        for program in [VSD, QSD] {
            let err = refused(passing(program, &nbd_on_fd(&image, &str), &[(fd, fd)]));
            assert!(err.contains(expected), "{program} with addr.str={str}: {err}");
            assert!(err.contains(&format!("addr.str={str}")) || err.contains(&format!("fd '{str}'")), "{err}");
        }
    }
    // QEMU takes these, and fails later or serves nothing.
    let datagram = UnixDatagram::unbound().unwrap();
    let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
    let unix = UnixListener::bind(dir.path("s")).unwrap();
    let (d, t, u) = (datagram.as_raw_fd(), tcp.as_raw_fd(), unix.as_raw_fd());
    let err = refused(passing(VSD, &nbd_on_fd(&image, &d.to_string()), &[(d, d)]));
    assert!(err.contains(&format!("File descriptor '{d}' is not a stream socket")), "{err}");
    let err = refused(passing(VSD, &vhost_on_fd(&image, &t.to_string()), &[(t, t)]));
    assert!(
        err.contains(&format!("export 'v0': cannot listen on fd '{t}': File descriptor '{t}' is not a unix socket"))
    );
    let mut twice = nbd_on_fd(&image, &u.to_string());
    twice.extend(["--export".into(), format!("type=vhost-user-blk,id=v1,node-name=r0,addr.type=fd,addr.str={u}")]);
    let err = refused(passing(VSD, &twice, &[(u, u)]));
    assert!(err.contains(&format!("File descriptor '{u}' was taken already")), "{err}");
    let err = refused(passing(VSD, &vhost_on_fd(&image, &format!("{u},socket-mode=0660")), &[(u, u)]));
    assert!(err.contains("socket-mode cannot be set with addr.type=fd"), "{err}");
    assert!(dir.path("s").exists(), "a refused socket's file stays");
}

#[test]
fn activation_names_sockets_and_variables_that_do_not_add_up_are_refused() {
    let dir = Scratch::new("fd-names");
    let image = patterned_image(&dir);
    let path = dir.path("nbd.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let other = UnixListener::bind(dir.path("other.sock")).unwrap();
    let fds = [other.as_raw_fd(), listener.as_raw_fd()];
    // The second socket passed, by its name.
    let daemon =
        Passed::start(activating(&common::sandboxed(&nbd_on_fd(&image, "disk")), &fds, Some("x:disk"), None), &dir);
    assert_serves(&image, &format!("nbd+unix:///disk?socket={}", path.display()));
    assert!(daemon.stop());
    let cases = [
        (Some("x:disk"), Some("1"), "LISTEN_PID is '1', not vsd's pid"),
        (Some("disk"), None, "LISTEN_FDNAMES names 1 sockets, LISTEN_FDS says 2"),
        (Some("a:b"), None, "no socket named 'disk' was passed (LISTEN_FDNAMES: a, b)"),
        (Some("disk:disk"), None, "several sockets passed are named 'disk'"),
        (None, None, "no socket named 'disk' was passed (LISTEN_FDNAMES: unknown, unknown)"),
    ];
    for (names, pid, expected) in cases {
        let err = refused(activating(&nbd_on_fd(&image, "disk"), &fds, names, pid));
        assert!(err.contains("cannot listen on fd 'disk'") && err.contains(expected), "{names:?} {pid:?}: {err}");
    }
}

/// `nbd-server-start` takes the same addresses (QEMU's storage daemon
/// refuses them: it has no descriptors passed over QMP); a passed socket
/// is taken once, and closed with its server.
#[test]
fn qmp_nbd_server_start_takes_a_passed_socket() {
    let dir = Scratch::new("fd-qmp");
    let image = patterned_image(&dir);
    let path = dir.path("nbd.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let fd = listener.as_raw_fd();
    let qmp_socket = dir.path("qmp.sock");
    let mut args = node(&image);
    args.extend(common::monitor(&qmp_socket));
    let daemon = Passed::start(passing(VSD, &common::sandboxed(&args), &[(fd, fd)]), &dir);
    let mut qmp = QmpClient::connect(&qmp_socket).unwrap();
    let addr = json!({"addr": {"type": "fd", "data": {"str": fd.to_string()}}});
    qmp.execute("nbd-server-start", addr.clone()).unwrap();
    qmp.execute("block-export-add", json!({"type": "nbd", "id": "n0", "node-name": "r0", "name": "disk"})).unwrap();
    assert_serves(&image, &format!("nbd+unix:///disk?socket={}", path.display()));
    qmp.execute("nbd-server-stop", json!({})).unwrap();
    let again = qmp.execute("nbd-server-start", addr).unwrap_err().to_string();
    assert!(again.contains(&format!("File descriptor '{fd}' was taken already")), "{again}");
    let flat = json!({"addr": {"type": "fd"}});
    let missing = qmp.execute("nbd-server-start", flat).unwrap_err().to_string();
    assert!(missing.contains("'addr.str' is missing"), "{missing}");
    assert!(daemon.stop());
}
