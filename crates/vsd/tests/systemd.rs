//! vsd under a service manager. No systemd runs this machine's services
//! (it is not PID 1: `systemd-run --user` finds no bus), so each part is
//! played by the real thing it talks to: a datagram socket where
//! `NOTIFY_SOCKET` points, as systemd's own is, hears READY=1, STATUS=
//! and STOPPING=1 while libblkio connects to the export; a pipe named by
//! `JOURNAL_STREAM` takes the log as journald would; a terminal from
//! script(1) shows the serving lines; `scripts/install.sh` installs into
//! scratch directories, and `systemd-analyze verify` and man(1) read what
//! it installed.

mod common;

use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Scratch, VSD};
use vsd_bench::{Client, ClientOptions};

const MIB: u64 = 1 << 20;
/// Longer than the daemon takes to refresh STATUS= (every 2 s).
const PATIENCE: Duration = Duration::from_secs(10);

/// The service manager's end of `NOTIFY_SOCKET`.
struct Manager {
    socket: UnixDatagram,
}

impl Manager {
    fn bind(path: &Path) -> Self {
        Self::timed(UnixDatagram::bind(path).unwrap())
    }

    fn bind_abstract(name: &str) -> Self {
        Self::timed(UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name).unwrap()).unwrap())
    }

    fn timed(socket: UnixDatagram) -> Self {
        socket.set_read_timeout(Some(PATIENCE)).unwrap();
        Self { socket }
    }

    /// The next message.
    fn next(&self) -> String {
        let mut buf = [0u8; 4096];
        let n = self.socket.recv(&mut buf).expect("a message from vsd in time");
        String::from_utf8(buf[..n].to_vec()).unwrap()
    }

    /// The first message that says `wanted`, with those before it.
    fn until(&self, wanted: &str) -> (String, Vec<String>) {
        let mut before = Vec::new();
        loop {
            let message = self.next();
            if message.contains(wanted) {
                return (message, before);
            }
            before.push(message);
        }
    }
}

/// The exported image and the daemon's arguments: one raw vhost-user-blk
/// export, exp0 of node disk0, sandboxed, with a pidfile.
fn export_args(dir: &Scratch) -> Vec<String> {
    let image = dir.image("disk.img", MIB);
    let mut args = common::sandboxed(&common::file_export(&image, &dir.path("vhost.sock"), "", ",writable=on"));
    args.extend(["--pidfile".into(), dir.path("vsd.pid").display().to_string()]);
    args
}

/// A child process, killed if a failed test leaves it running.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        if self.0.try_wait().unwrap().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn spawn(args: &[String], env: &[(&str, &str)], stderr: impl Into<Stdio>) -> Running {
    let mut command = Command::new(VSD);
    command.args(args).envs(env.iter().copied()).stdin(Stdio::null()).stderr(stderr);
    Running(command.spawn().unwrap())
}

fn terminate(pid: u32) {
    // SAFETY: kill() with the pid of a daemon this test started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGTERM) }, 0);
}

/// The pid in `dir`'s pidfile, once the daemon wrote it.
fn await_pid(dir: &Scratch) -> u32 {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Some(pid) = std::fs::read_to_string(dir.path("vsd.pid")).ok().and_then(|t| t.trim().parse().ok()) {
            return pid;
        }
        assert!(Instant::now() < deadline, "no pidfile");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// What a daemon SIGTERM reached said on stderr (piped), once it exited 0.
fn stopped(mut child: Running) -> String {
    let mut stderr = String::new();
    child.0.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert!(child.0.wait().unwrap().success(), "{stderr}");
    stderr
}

fn connect(dir: &Scratch) -> Client {
    Client::connect(&dir.path("vhost.sock"), ClientOptions::default()).expect("the export serves")
}

#[test]
fn the_manager_hears_ready_once_serving_the_clients_coming_and_going_and_stopping() {
    let dir = Scratch::new("systemd-notify");
    let manager = Manager::bind(&dir.path("notify"));
    let notify = dir.path("notify").display().to_string();
    let child = spawn(&export_args(&dir), &[("NOTIFY_SOCKET", &notify)], Stdio::piped());

    let ready = manager.next();
    // Said once the export accepts: a front-end connects at once.
    let client = connect(&dir);
    assert_eq!(client.capacity().unwrap(), MIB);
    assert!(dir.path("vsd.pid").exists(), "READY=1 comes with the pidfile: {ready}");
    assert_eq!(ready, "READY=1\nSTATUS=1 export, 0 connected: exp0 (vhost-user-blk, no client)");

    let (connected, _) = manager.until("connected: exp0 (vhost-user-blk, connected)");
    assert_eq!(connected, "STATUS=1 export, 1 connected: exp0 (vhost-user-blk, connected)");
    drop(client);
    let (gone, _) = manager.until("STATUS=");
    assert_eq!(gone, "STATUS=1 export, 0 connected: exp0 (vhost-user-blk, no client)");

    terminate(child.0.id());
    let (stopping, before) = manager.until("STOPPING=1");
    assert_eq!(stopping, "STOPPING=1\nSTATUS=stopping");
    assert!(before.is_empty(), "nothing new meanwhile: {before:?}");
    assert_eq!(stopped(child), "", "stderr is a pipe: no serving line, as from QSD");
}

#[test]
fn a_daemon_names_its_pid_on_an_abstract_socket() {
    let dir = Scratch::new("systemd-abstract");
    let name = format!("vsd-test-notify-{}", std::process::id());
    let manager = Manager::bind_abstract(&name);
    let mut args = export_args(&dir);
    args.push("--daemonize".into());
    let status = spawn(&args, &[("NOTIFY_SOCKET", &format!("@{name}"))], Stdio::null()).0.wait().unwrap();
    assert!(status.success(), "--daemonize returns once it serves");

    let pid = await_pid(&dir);
    let ready = manager.next();
    assert_eq!(
        ready,
        format!("READY=1\nMAINPID={pid}\nSTATUS=1 export, 0 connected: exp0 (vhost-user-blk, no client)")
    );
    assert_eq!(connect(&dir).capacity().unwrap(), MIB);
    terminate(pid);
    manager.until("STOPPING=1");
    // Gone once its pidfile is.
    let deadline = Instant::now() + PATIENCE;
    while dir.path("vsd.pid").exists() {
        assert!(Instant::now() < deadline, "the daemon did not stop");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_notify_socket_that_cannot_be_reached_is_one_warning_and_the_daemon_serves() {
    let dir = Scratch::new("systemd-bad-notify");
    let file = dir.path("not-a-socket");
    std::fs::write(&file, "").unwrap();
    for (target, why) in [
        (dir.path("missing").display().to_string(), "No such file or directory"),
        (file.display().to_string(), "Connection refused"),
        ("relative/notify".into(), "neither an absolute path nor @NAME"),
    ] {
        let _ = std::fs::remove_file(dir.path("vsd.pid"));
        let child = spawn(&export_args(&dir), &[("NOTIFY_SOCKET", &target)], Stdio::piped());
        await_pid(&dir);
        assert_eq!(connect(&dir).capacity().unwrap(), MIB, "{target}: it serves");
        terminate(child.0.id());
        let stderr = stopped(child);
        assert_eq!(stderr.lines().count(), 1, "{target}: {stderr}");
        let said = format!("vsd: warning: NOTIFY_SOCKET='{target}': {why}");
        assert!(stderr.starts_with(&said) && stderr.contains("the service manager is not told"), "{stderr}");
    }
}

/// The device and inode of a pipe's write end, as `JOURNAL_STREAM` names
/// journald's stream.
fn device_and_inode(end: &std::io::PipeWriter) -> String {
    let meta = std::fs::File::from(OwnedFd::from(end.try_clone().unwrap())).metadata().unwrap();
    format!("{}:{}", meta.dev(), meta.ino())
}

/// Runs the export with `RUST_LOG=info`, stderr a pipe `JOURNAL_STREAM`
/// names (or not: `named` false names another inode), and returns what
/// it said from start to SIGTERM.
fn logged(dir: &Scratch, named: bool) -> String {
    let _ = std::fs::remove_file(dir.path("vsd.pid"));
    let (mut reader, writer) = std::io::pipe().unwrap();
    let stream = if named { device_and_inode(&writer) } else { "0:0".into() };
    let mut child = spawn(&export_args(dir), &[("JOURNAL_STREAM", &stream), ("RUST_LOG", "info")], writer);
    await_pid(dir);
    drop(connect(dir));
    terminate(child.0.id());
    let mut said = String::new();
    reader.read_to_string(&mut said).unwrap();
    assert!(child.0.wait().unwrap().success(), "{said}");
    said
}

#[test]
fn on_the_journal_stream_lines_carry_a_priority_and_no_timestamp() {
    let dir = Scratch::new("systemd-journal");
    let said = logged(&dir, true);
    let socket = dir.path("vhost.sock");
    for line in said.lines() {
        let priority = line.strip_prefix('<').and_then(|rest| rest.split_once('>')).map(|(n, _)| n);
        assert!(priority.is_some_and(|n| n.len() == 1 && n.as_bytes()[0].is_ascii_digit()), "{line}\n{said}");
        assert!(!line.contains(" INFO ") && !line.contains('['), "no timestamp nor level word: {line}");
    }
    for expected in [
        format!("<6>vsd: serving export exp0 (vhost-user-blk, node disk0) on '{}'", socket.display()),
        format!("<6>vsd::daemon: export 'exp0' listening on '{}'", socket.display()),
        "<6>vsd_export::acceptor: export 'exp0': front-end connected".into(),
        "<6>vsd: signal 15: shutting down".into(),
    ] {
        assert!(said.lines().any(|l| l == expected), "no {expected:?} in:\n{said}");
    }

    // Another stream (the service's stderr redirected): env_logger's own
    // lines, stamped, and no serving line.
    let said = logged(&dir, false);
    assert!(said.lines().all(|l| l.starts_with('[') && !l.contains("serving")), "{said}");
    assert!(said.contains(" INFO  vsd] signal 15: shutting down"), "{said}");
}

/// Runs `args` on a terminal of its own (script(1)) until SIGTERM; what
/// the terminal showed.
fn on_a_terminal(dir: &Scratch, args: &[String]) -> String {
    let command = std::iter::once(VSD.to_string()).chain(args.iter().cloned()).collect::<Vec<_>>().join(" ");
    let mut script = Command::new("script");
    script
        .args(["--quiet", "--return", "--command", &command, "/dev/null"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    let mut script = Running(script.spawn().expect("script(1)"));
    terminate(await_pid(dir));
    let mut shown = String::new();
    script.0.stdout.take().unwrap().read_to_string(&mut shown).unwrap();
    assert!(script.0.wait().unwrap().success(), "{shown}");
    shown.replace("\r\n", "\n")
}

#[test]
fn a_terminal_hears_one_line_per_export_server_and_monitor() {
    let dir = Scratch::new("systemd-serving");
    let (nbd, qmp) = (dir.path("nbd.sock"), dir.path("qmp.sock"));
    let mut args = export_args(&dir);
    args.extend(common::monitor(&qmp));
    args.extend([
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", nbd.display()),
        "--export".into(),
        "type=nbd,id=exp1,node-name=disk0,name=disk".into(),
    ]);
    let shown = on_a_terminal(&dir, &args);
    let expected = format!(
        "vsd: serving NBD on '{}'\n\
         vsd: serving export exp0 (vhost-user-blk, node disk0) on '{}'\n\
         vsd: serving export exp1 (nbd, node disk0) over NBD as 'disk'\n\
         vsd: serving QMP on unix:{}\n",
        nbd.display(),
        dir.path("vhost.sock").display(),
        qmp.display()
    );
    assert_eq!(shown, expected);
}

/// Runs scripts/install.sh with `env` (installing the vsd cargo built).
fn install(env: &[(&str, &Path)], uninstall: bool) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/install.sh");
    let mut command = Command::new(script);
    command.env_remove("DESTDIR").env("VSD_BIN", VSD).envs(env.iter().copied());
    if uninstall {
        command.arg("--uninstall");
    }
    let out = command.output().unwrap();
    assert!(out.status.success(), "install.sh: {}", String::from_utf8_lossy(&out.stderr));
}

/// Every file under `dir`, relative to it.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten() {
        let path = entry.unwrap().path();
        match path.is_dir() {
            true => found.extend(files_under(&path).into_iter().map(|p| Path::new(path.file_name().unwrap()).join(p))),
            false => found.push(PathBuf::from(path.file_name().unwrap())),
        }
    }
    found.sort();
    found
}

const INSTALLED: [&str; 7] = [
    "bin/vsd",
    "lib/systemd/system/vsd.service",
    "lib/systemd/system/vsd@.service",
    "lib/systemd/system/vsd@.socket",
    "share/doc/vsd/disk.conf",
    "share/man/man1/vsd.1",
    "share/vsd/installed",
];

#[test]
fn installed_units_verify_and_the_man_page_renders() {
    let dir = Scratch::new("systemd-install");
    let prefix = dir.path("prefix");
    install(&[("PREFIX", &prefix)], false);
    assert_eq!(files_under(&prefix), INSTALLED.map(PathBuf::from));
    let units = prefix.join("lib/systemd/system");
    let service = std::fs::read_to_string(units.join("vsd@.service")).unwrap();
    assert!(service.contains(&format!("ExecStart={}/bin/vsd --sandbox on", prefix.display())), "{service}");

    // As systemd would load them, the template as an instance; the man
    // page Documentation= names is looked up where it was installed.
    for unit in ["vsd.service", "vsd@disk0.service", "vsd@disk0.socket"] {
        let out = Command::new("systemd-analyze")
            .args(["verify", &units.join(unit).display().to_string()])
            .env("MANPATH", prefix.join("share/man"))
            .output()
            .expect("systemd-analyze (Debian's systemd)");
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && said.is_empty(), "{unit}: {said}");
    }

    let out = Command::new("man").arg("-l").arg(prefix.join("share/man/man1/vsd.1")).env("MANWIDTH", "200").output();
    let out = out.expect("man (Debian's man-db)");
    let page = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let help = common::ok(VSD, &["--help"]);
    for said in ["vsd - A storage daemon for virtual machines", "--blockdev <OPTIONS>", "--daemonize"] {
        assert!(page.contains(said) && help.contains(said.trim_start_matches("vsd - ")), "{said}:\n{page}");
    }

    install(&[("PREFIX", &prefix)], true);
    assert!(!prefix.exists(), "uninstall leaves nothing: {:?}", files_under(&prefix));
}

#[test]
fn destdir_stages_an_install_for_its_prefix_and_uninstall_empties_it() {
    let dir = Scratch::new("systemd-destdir");
    let destdir = dir.path("stage");
    std::fs::create_dir(&destdir).unwrap();
    let env = [("DESTDIR", destdir.as_path()), ("PREFIX", Path::new("/usr"))];
    install(&env, false);
    // Again, over the first: one install to remove.
    install(&env, false);
    assert_eq!(files_under(&destdir.join("usr")), INSTALLED.map(PathBuf::from));
    assert_eq!(files_under(&destdir).len(), INSTALLED.len(), "all under PREFIX");
    let unit = std::fs::read_to_string(destdir.join("usr/lib/systemd/system/vsd.service")).unwrap();
    assert!(unit.contains("ExecStart=/usr/bin/vsd "), "the unit names the binary where it will be: {unit}");
    let manifest = std::fs::read_to_string(destdir.join("usr/share/vsd/installed")).unwrap();
    assert!(manifest.lines().all(|l| l.contains(" /usr")), "paths without DESTDIR: {manifest}");
    // Something of another package beside it stays.
    std::fs::write(destdir.join("usr/bin/other"), "").unwrap();
    install(&env, true);
    assert_eq!(files_under(&destdir), [PathBuf::from("usr/bin/other")]);
}

/// The command `vsd@.service` runs for a disk configured as the example
/// `disk.conf`'s line `line` says (its first or its commented second), in
/// `dir` instead of /var/lib/vsd and /run/vsd, as `nobody` instead of the
/// `vsd` user the manual has one make.
fn example_command(dir: &Scratch, line: usize) -> Vec<String> {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/systemd");
    let unit = std::fs::read_to_string(examples.join("vsd@.service")).unwrap();
    let exec = unit.lines().find_map(|l| l.strip_prefix("ExecStart=/usr/local/bin/vsd ")).unwrap();
    let conf = std::fs::read_to_string(examples.join("disk.conf")).unwrap();
    let options =
        conf.lines().filter_map(|l| l.trim_start_matches('#').strip_prefix("VSD_OPTIONS=")).nth(line).unwrap();
    let here = dir.0.display().to_string();
    let command = exec.replace("$VSD_OPTIONS", options).replace("user=vsd", "user=nobody");
    let command = command.replace("/var/lib/vsd", &here).replace("/run/vsd", &here);
    let mut args: Vec<String> = command.split_whitespace().map(String::from).collect();
    args.extend(["--pidfile".into(), dir.path("vsd.pid").display().to_string()]);
    args
}

#[test]
fn the_example_disk_serves_on_its_own_socket_or_on_the_one_systemd_holds() {
    let dir = Scratch::new("systemd-example");
    dir.image("disk0.img", MIB);
    let socket = dir.path("disk0.sock");

    // Bound by vsd, for group kvm.
    let child = spawn(&example_command(&dir, 1), &[], Stdio::piped());
    await_pid(&dir);
    let meta = std::fs::metadata(&socket).unwrap();
    let kvm = common::ok("getent", &["group", "kvm"]);
    assert_eq!(meta.gid().to_string(), kvm.split(':').nth(2).unwrap(), "the socket is group kvm's");
    assert_eq!(meta.mode() & 0o777, 0o660);
    assert_eq!(Client::connect(&socket, ClientOptions::default()).unwrap().capacity().unwrap(), MIB);
    terminate(child.0.id());
    assert_eq!(stopped(child), "");

    // Passed as `vhost-user`, as vsd@disk0.socket passes it. (User nobody
    // could not remove the first daemon's files.)
    for left in [&socket, &dir.path("vsd.pid")] {
        let _ = std::fs::remove_file(left);
    }
    let mut activator = Command::new("systemd-socket-activate");
    activator.arg(format!("--listen={}", socket.display())).arg("--fdname=vhost-user").arg(VSD);
    activator.args(example_command(&dir, 0)).stdin(Stdio::null()).stderr(Stdio::piped());
    let child = Running(activator.spawn().expect("systemd-socket-activate (Debian's systemd)"));
    // The first client starts vsd, and waits in the backlog meanwhile
    // (refused only before the activator listens).
    let deadline = Instant::now() + PATIENCE;
    let client = loop {
        match Client::connect(&socket, ClientOptions::default()) {
            Ok(client) => break client,
            Err(e) => assert!(Instant::now() < deadline, "the activator did not listen: {e}"),
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(client.capacity().unwrap(), MIB);
    let pid = await_pid(&dir);
    assert_eq!(pid, child.0.id(), "vsd runs in the activator's process");
    terminate(pid);
    let stderr = stopped(child);
    assert!(stderr.lines().all(|l| !l.starts_with("vsd")), "{stderr}");
}
