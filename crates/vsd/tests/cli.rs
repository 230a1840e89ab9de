//! The command line: QSD-style options, one clear error line and exit
//! status 1 for every mistake, and nothing left behind.

mod common;

use std::os::unix::net::UnixListener;

use common::{Daemon, Scratch, VSD, file_export, run};

/// Runs vsd expecting it to fail; returns its single stderr line.
fn fails(args: &[String]) -> String {
    let out = run(VSD, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(out.status.code(), Some(1), "vsd {args:?} must exit 1");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(stderr.lines().count(), 1, "one error line, got: {stderr}");
    assert!(stderr.starts_with("vsd: "), "{stderr}");
    stderr
}

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
        let line = fails(&args);
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
    let line = fails(&file_export(&image, &sock, "", ""));
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
    let line = fails(&file_export(&image, &not_socket, "", ""));
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
    fails(&args);
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
