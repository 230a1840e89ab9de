//! The command line: QSD-style options, one clear error line and exit
//! status 1 for every mistake, and nothing left behind.

mod common;

use std::os::unix::net::UnixListener;

use common::{Daemon, Scratch, VSD, file_export, run, vsd_fails};

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

#[test]
fn help_and_version() {
    let out = run(VSD, &["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("--blockdev") && help.contains("--export") && help.contains("--pidfile"));
    let out = run(VSD, &["--version"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("vsd "));
}

#[test]
fn mistakes_name_their_culprit() {
    let dir = Scratch::new("cli");
    let sock = dir.path("s.sock");
    let image = dir.image("disk.img", 1 << 20);
    let missing = dir.path("missing.img");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (strings(&["--frobnicate"]), "--frobnicate"),
        (file_export(&missing, &sock, "", ""), "missing.img"),
        (file_export(&image, &sock, ",cache.direct=maybe", ""), "cache.direct"),
        (file_export(&image, &sock, ",colour=blue", ""), "colour"),
        (file_export(&image, &sock, "", ",num-queues=0"), "num-queues"),
        (file_export(&image, &sock, "", ",logical-block-size=1000"), "logical-block-size"),
        (file_export(&image, &sock, "", ",cpu-affinity=4096"), "cpu-affinity"),
        (file_export(&image, &sock, "", ",cpu-affinity=2-1"), "cpu-affinity"),
        (file_export(&image, &sock, "", ",poll-us=99999999"), "poll-us"),
        (file_export(&image, &sock, "", ",socket-mode=999"), "socket-mode"),
        (strings(&["--blockdev", "driver=qcow9,node-name=x"]), "qcow9"),
        (strings(&["--blockdev", "driver=raw,node-name=r,file=nope"]), "nope"),
        (
            strings(&[
                "--blockdev",
                "driver=null-co,node-name=n",
                "--export",
                "type=vhost-user-blk,id=e,node-name=m,addr.type=unix,addr.path=/tmp/x",
            ]),
            "'m'",
        ),
        (strings(&["--blockdev", "driver=null-co,node-name=n", "--blockdev", "driver=null-co,node-name=n"]), "'n'"),
        (
            strings(&[
                "--blockdev",
                "driver=null-co,node-name=n,size=1M",
                "--blockdev",
                "driver=raw,node-name=r,file=n,offset=2M",
            ]),
            "offset",
        ),
        (strings(&["--blockdev", "driver=null-co,node-name=n"]), "--export"),
    ];
    for (args, culprit) in cases {
        let line = vsd_fails(&args);
        assert!(line.contains(culprit), "error for {args:?} should name {culprit}: {line}");
        assert!(!sock.exists(), "no socket left behind by {args:?}");
    }
}

#[test]
fn a_socket_in_use_is_refused_and_the_first_daemon_keeps_serving() {
    let dir = Scratch::new("inuse");
    let image = dir.image("disk.img", 1 << 20);
    let sock = dir.path("s.sock");
    let mut first = Daemon::vsd(&dir, &file_export(&image, &sock, "", ""));
    let line = vsd_fails(&file_export(&image, &sock, "", ""));
    assert!(line.contains("in use"), "{line}");
    assert!(first.is_running());
    assert!(sock.exists(), "the running daemon's socket is not removed");
    let _client = first.connect(vsd_bench::ClientOptions { read_only: true, ..Default::default() });
}

#[test]
fn only_stale_sockets_are_replaced() {
    let dir = Scratch::new("stale");
    let image = dir.image("disk.img", 1 << 20);
    // A regular file where the socket should go is never replaced.
    let not_socket = dir.path("file.sock");
    std::fs::write(&not_socket, "precious").unwrap();
    let line = vsd_fails(&file_export(&image, &not_socket, "", ""));
    assert!(line.contains("not a socket"), "{line}");
    assert_eq!(std::fs::read(&not_socket).unwrap(), b"precious");
    // A socket nobody listens on is stale and is replaced.
    let stale = dir.path("stale.sock");
    drop(UnixListener::bind(&stale).unwrap());
    let daemon = Daemon::vsd(&dir, &file_export(&image, &stale, "", ""));
    let _client = daemon.connect(vsd_bench::ClientOptions { read_only: true, ..Default::default() });
}

#[test]
fn sockets_are_for_the_daemons_user_unless_socket_mode_says_otherwise() {
    use std::os::unix::fs::PermissionsExt;
    let dir = Scratch::new("modes");
    let image = dir.image("disk.img", 1 << 20);
    let (private, shared, qmp) = (dir.path("private.sock"), dir.path("shared.sock"), dir.path("qmp.sock"));
    let mut args = file_export(&image, &private, "", "");
    args.extend([
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=exp1,node-name=disk0,addr.type=unix,addr.path={},socket-mode=0660",
            shared.display()
        ),
        "--chardev".into(),
        format!("socket,id=m,path={},server=on,wait=off", qmp.display()),
        "--monitor".into(),
        "chardev=m".into(),
    ]);
    let _daemon = Daemon::vsd(&dir, &args);
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&private), 0o600);
    assert_eq!(mode(&shared), 0o660);
    assert_eq!(mode(&qmp), 0o600, "the QMP socket too");
    let leftovers: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            name.starts_with(".vsd-").then_some(name)
        })
        .collect();
    assert!(leftovers.is_empty(), "no staging directory left: {leftovers:?}");
}

#[test]
fn a_failing_second_export_removes_the_first_socket() {
    let dir = Scratch::new("partial");
    let image = dir.image("disk.img", 1 << 20);
    let (a, b) = (dir.path("a.sock"), dir.path("b.sock"));
    let mut args = file_export(&image, &a, "", "");
    args.push("--export".into());
    args.push(format!("type=vhost-user-blk,id=exp1,node-name=nowhere,addr.type=unix,addr.path={}", b.display()));
    vsd_fails(&args);
    assert!(!a.exists() && !b.exists());
}

#[test]
fn sigterm_removes_socket_and_pidfile() {
    let dir = Scratch::new("term");
    let image = dir.image("disk.img", 1 << 20);
    let sock = dir.path("s.sock");
    let daemon = Daemon::vsd(&dir, &file_export(&image, &sock, "", ""));
    let pidfile = dir.path("vsd.pid");
    let pid: u32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    assert_eq!(pid, daemon.pid(), "the pidfile holds the daemon's pid");
    assert!(sock.exists());
    let status = daemon.stop();
    assert!(status.success(), "{status}");
    assert!(!sock.exists() && !pidfile.exists());
}

/// Tests that give files away or change users need root; they are skipped
/// (with a note) otherwise.
fn is_root() -> bool {
    // SAFETY: geteuid cannot fail and touches no memory.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        eprintln!("skipped: needs root");
    }
    root
}

/// The uid and gid of user nobody (Debian: 65534, group nogroup).
fn nobody() -> (u32, u32) {
    let ids = vsd_sys::user_by_name("nobody").unwrap().expect("user nobody exists");
    (ids.uid, ids.gid)
}

#[test]
fn sockets_get_the_owner_and_group_they_are_given() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if !is_root() {
        return;
    }
    let (uid, gid) = nobody();
    let dir = Scratch::new("owners");
    let image = dir.image("disk.img", 1 << 20);
    let (named, numbered) = (dir.path("named.sock"), dir.path("numbered.sock"));
    let mut args = file_export(&image, &named, "", ",socket-owner=nobody,socket-group=nogroup,socket-mode=0660");
    args.extend([
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=exp1,node-name=disk0,addr.type=unix,addr.path={},socket-group={gid}",
            numbered.display()
        ),
    ]);
    let owned_as_asked = || {
        let meta = std::fs::symlink_metadata(&named).unwrap();
        assert_eq!((meta.uid(), meta.gid(), meta.permissions().mode() & 0o777), (uid, gid, 0o660));
    };

    // Sandboxed without --run-with, root starts without its capabilities:
    // it cannot give a socket away, and says what would let it.
    let out = run(VSD, &common::sandboxed(&args).iter().map(String::as_str).collect::<Vec<_>>());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("Operation not permitted") && stderr.contains("--run-with"), "{stderr}");
    // With --run-with, the capabilities last until the drop to the user.
    let mut as_nobody = args.clone();
    as_nobody.extend(strings(&["--run-with", "user=nobody"]));
    drop(Daemon::vsd(&dir, &as_nobody));
    owned_as_asked();

    // Without the sandbox, root keeps them; the sockets it leaves behind
    // (nobody could not remove them) are replaced.
    args.extend(strings(&["--sandbox", "off"]));
    let daemon = Daemon::vsd(&dir, &args);
    owned_as_asked();
    let meta = std::fs::symlink_metadata(&numbered).unwrap();
    assert_eq!((meta.uid(), meta.gid(), meta.permissions().mode() & 0o777), (0, gid, 0o600), "only the group given");
    let _client = daemon.connect(vsd_bench::ClientOptions { read_only: true, ..Default::default() });
    drop(daemon);
    // The socket a crashed run left belongs to nobody now; a run with the
    // same options replaces it.
    drop(UnixListener::bind(&named).unwrap());
    std::os::unix::fs::chown(&named, Some(uid), Some(gid)).unwrap();
    let _again = Daemon::vsd(&dir, &args);
}

#[test]
fn unknown_users_and_groups_are_one_line_errors() {
    let dir = Scratch::new("nouser");
    let image = dir.image("disk.img", 1 << 20);
    let sock = dir.path("s.sock");
    let run_with = |user: &str| {
        let mut args = file_export(&image, &sock, "", "");
        args.extend(["--run-with".into(), format!("user={user}")]);
        args
    };
    let cases: Vec<(Vec<String>, &str)> = vec![
        (file_export(&image, &sock, "", ",socket-owner=no-such-user-vsd"), "socket-owner"),
        (file_export(&image, &sock, "", ",socket-group=no-such-group-vsd"), "socket-group"),
        (run_with("no-such-user-vsd"), "--run-with user=no-such-user-vsd"),
        (run_with("root"), "--run-with user=root"),
        (run_with("0:0"), "--run-with user=0:0"),
        (strings(&["--blockdev", "driver=null-co,node-name=n", "--run-with", "chroot=/"]), "chroot"),
    ];
    for (args, culprit) in cases {
        let line = vsd_fails(&args);
        assert!(line.contains(culprit), "error for {args:?} should name {culprit}: {line}");
        assert!(!sock.exists(), "no socket left behind by {args:?}");
    }
}

/// The ids one thread of a process runs with, from /proc/PID/task/TID/status.
#[derive(Debug)]
struct ThreadIds {
    name: String,
    /// Real, effective, saved, filesystem.
    uids: Vec<u32>,
    gids: Vec<u32>,
    groups: Vec<u32>,
}

impl ThreadIds {
    fn are(&self, uid: u32, gid: u32) -> bool {
        self.uids.iter().all(|&id| id == uid) && self.gids.iter().all(|&id| id == gid) && self.groups == [gid]
    }
}

fn thread_ids(pid: u32) -> Vec<ThreadIds> {
    let numbers = |status: &str, key: &str| -> Vec<u32> {
        let line = status.lines().find_map(|l| l.strip_prefix(key)).unwrap_or_default();
        line.split_whitespace().map(|n| n.parse().unwrap()).collect()
    };
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.unwrap().path().join("status")).ok())
        .map(|status| ThreadIds {
            name: status.lines().find_map(|l| l.strip_prefix("Name:")).unwrap_or_default().trim().to_string(),
            uids: numbers(&status, "Uid:"),
            gids: numbers(&status, "Gid:"),
            groups: numbers(&status, "Groups:"),
        })
        .collect()
}

#[test]
fn run_with_drops_privileges_once_the_images_are_open() {
    use std::os::unix::fs::{FileExt, PermissionsExt};
    use std::time::{Duration, Instant};
    if !is_root() {
        return;
    }
    let (uid, gid) = nobody();
    let dir = Scratch::new("runwith");
    // Both only root may open: the image is opened before the drop, the
    // other one is asked for after it.
    let image = dir.image("disk.img", 16 << 20);
    let secret = dir.image("secret.img", 1 << 20);
    for path in [&image, &secret] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let qmp_sock = dir.path("qmp.sock");
    let mut args = file_export(&image, &dir.path("s.sock"), "", ",writable=on");
    args.extend(["--chardev".into(), format!("socket,id=m,path={},server=on,wait=off", qmp_sock.display())]);
    args.extend(strings(&["--monitor", "chardev=m", "--run-with", "user=nobody"]));
    let mut daemon = Daemon::vsd(&dir, &args);

    // The drop follows the pidfile at once.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !thread_ids(daemon.pid()).iter().all(|t| t.are(uid, gid)) {
        assert!(Instant::now() < deadline, "still privileged: {:?}", thread_ids(daemon.pid()));
        std::thread::sleep(Duration::from_millis(10));
    }

    let mut client = daemon.connect(vsd_bench::ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    let data = common::pattern(6, 64 * 1024);
    queue.write_at(1 << 20, &data).unwrap();
    queue.flush().unwrap();
    let mut back = vec![0u8; data.len()];
    queue.read_at(1 << 20, &mut back).unwrap();
    assert!(back == data, "the image opened before the drop serves reads and writes");
    std::fs::File::open(&image).unwrap().read_exact_at(&mut back, 1 << 20).unwrap();
    assert!(back == data, "the write reached the image");

    // Threads started since (the queue's worker, io_uring's) are nobody's
    // too, as are those that were running at the drop (QMP, the export's).
    let threads = thread_ids(daemon.pid());
    assert!(threads.len() > 2, "{threads:?}");
    for thread in &threads {
        assert!(thread.are(uid, gid), "thread {} runs as uid {:?} gid {:?}", thread.name, thread.uids, thread.gids);
    }

    let mut qmp = vsd_control::client::QmpClient::connect(&qmp_sock).unwrap();
    let add = serde_json::json!({"driver": "file", "node-name": "secret", "filename": secret});
    let err = qmp.execute("blockdev-add", add).unwrap_err().to_string();
    assert!(err.contains("Permission denied"), "a root-only file is out of reach: {err}");
    assert!(daemon.is_running());
    queue.read_at(1 << 20, &mut back).unwrap();
    qmp.execute("query-block-exports", serde_json::Value::Null).unwrap();
    drop((queue, client));
    assert!(daemon.stop().success(), "a clean exit, though the pidfile's directory is root's");
}
