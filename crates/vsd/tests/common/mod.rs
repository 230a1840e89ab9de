//! Test harness: a scratch directory, and the real `vsd` binary run as a
//! child process the way users run it.

#![allow(dead_code)] // each test binary uses part of the harness

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use vsd_bench::{Client, ClientOptions};

pub mod frontend;
pub mod images;
pub mod nbd;
pub mod qmp;
pub mod script;

pub const VSD: &str = env!("CARGO_BIN_EXE_vsd");

/// `args` with `--sandbox on` added, unless they say `--sandbox` already.
pub fn sandboxed(args: &[String]) -> Vec<String> {
    let mut args = args.to_vec();
    if !args.iter().any(|a| a == "--sandbox") {
        args.extend(["--sandbox".into(), "on".into()]);
    }
    args
}

/// A directory removed when the test ends.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Self {
        Self::new_in(&std::env::temp_dir(), name)
    }

    /// A scratch directory under `parent` (e.g. /dev/shm, for tmpfs).
    pub fn new_in(parent: &Path, name: &str) -> Self {
        let dir = parent.join(format!("vsd-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// A raw image of `size` bytes, all zero.
    pub fn image(&self, name: &str, size: u64) -> PathBuf {
        let path = self.path(name);
        std::fs::File::create(&path).unwrap().set_len(size).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running daemon (vsd or qemu-storage-daemon), stopped on drop.
pub struct Daemon {
    child: Child,
    pub socket: PathBuf,
    /// The pidfile of vsd running under `strace` (the child).
    traced: Option<PathBuf>,
}

impl Daemon {
    /// Starts vsd with these arguments and waits until its pidfile says the
    /// exports accept connections. It runs sandboxed unless the test says
    /// `--sandbox` itself: the suite is what shows the sandbox's list of
    /// system calls covers what the daemon does. With `VSD_TEST_IOTHREAD`
    /// set in the environment, every vhost-user-blk export that does not
    /// choose its own threads or polling runs on one shared `--object
    /// iothread`.
    pub fn vsd(dir: &Scratch, args: &[String]) -> Self {
        let sandboxed = sandboxed(args);
        let args = &sandboxed;
        if std::env::var_os("VSD_TEST_IOTHREAD").is_none() {
            return Self::start(VSD, dir, args);
        }
        let own_threads =
            |a: &str| ["num-threads=", "cpu-affinity=", "poll-us=", "iothread="].iter().any(|key| a.contains(key));
        let mut shared: Vec<String> = vec!["--object".into(), "iothread,id=vsd-test-io".into()];
        shared.extend(args.iter().map(|a| match a.starts_with("type=vhost-user-blk") && !own_threads(a) {
            true => format!("{a},iothread=vsd-test-io"),
            false => a.clone(),
        }));
        Self::start(VSD, dir, &shared)
    }

    /// Starts vsd as [`Daemon::vsd`] does (sandboxed), under `strace -f`,
    /// which logs its `splice` calls, with the files they name, to `log`
    /// (read it with [`splices`] once [`Daemon::stop_traced`] returned).
    pub fn vsd_tracing_splices(dir: &Scratch, args: &[String], log: &Path) -> Self {
        let mut traced: Vec<String> =
            ["-f", "-qq", "--seccomp-bpf", "-y", "-e", "trace=splice", "-o"].map(String::from).into();
        traced.push(log.display().to_string());
        traced.push(VSD.into());
        traced.extend(sandboxed(args));
        let mut daemon = Self::start("strace", dir, &traced);
        daemon.traced = Some(dir.path("strace.pid"));
        daemon
    }

    /// Stops a daemon started by [`Daemon::vsd_tracing_splices`]: SIGTERM to
    /// vsd itself, then strace ends with it, its log complete.
    pub fn stop_traced(mut self) {
        self.terminate_traced();
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.is_running() {
            assert!(Instant::now() < deadline, "vsd did not stop under strace");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Starts qemu-storage-daemon the same way.
    pub fn qsd(dir: &Scratch, args: &[String]) -> Self {
        Self::start("qemu-storage-daemon", dir, args)
    }

    fn start(program: &str, dir: &Scratch, args: &[String]) -> Self {
        let pidfile = dir.path(&format!("{}.pid", Path::new(program).file_name().unwrap().to_string_lossy()));
        let _ = std::fs::remove_file(&pidfile);
        let socket = args
            .iter()
            .find_map(|a| a.split(',').find_map(|kv| kv.strip_prefix("addr.path=")))
            .map(PathBuf::from)
            // A daemon serving only TCP (an NBD server on inet) has none.
            .unwrap_or_default();
        let mut child = Command::new(program)
            .args(args)
            .arg("--pidfile")
            .arg(&pidfile)
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !pidfile.exists() {
            if let Some(status) = child.try_wait().unwrap() {
                panic!("{program} exited during startup: {status}");
            }
            assert!(Instant::now() < deadline, "{program} did not become ready");
            std::thread::sleep(Duration::from_millis(10));
        }
        Self { child, socket, traced: None }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    pub fn connect(&self, opts: ClientOptions) -> Client {
        Client::connect(&self.socket, opts).unwrap_or_else(|e| panic!("connect to {}: {e}", self.socket.display()))
    }

    /// Kills the daemon with SIGKILL, as a crash would, and reaps it.
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Stops the daemon with SIGTERM and returns its exit status.
    pub fn stop(mut self) -> std::process::ExitStatus {
        self.terminate()
    }

    /// SIGTERM to vsd under strace: strace, told, would leave it running.
    fn terminate_traced(&mut self) {
        let Some(pidfile) = self.traced.take() else { return };
        let Some(pid) = std::fs::read_to_string(pidfile).ok().and_then(|pid| pid.trim().parse::<i32>().ok()) else {
            return;
        };
        if self.is_running() {
            // SAFETY: kill() with the pid vsd wrote, while it still runs
            // (its tracer, our child, has not been reaped).
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
    }

    fn terminate(&mut self) -> std::process::ExitStatus {
        self.terminate_traced();
        // SAFETY: kill() with a pid we spawned and have not reaped.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                return self.child.wait().unwrap();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.is_running() {
            self.terminate();
        }
    }
}

/// One `splice(2)` call in a log of [`Daemon::vsd_tracing_splices`].
#[derive(Debug)]
pub struct Splice {
    /// What the input descriptor names: a file's path, `pipe:[inode]`.
    pub from: String,
    /// The input's offset, for a file.
    pub offset: Option<u64>,
    /// The length asked for.
    pub len: u64,
    /// The bytes moved, or the error (`EAGAIN`...).
    pub result: Result<u64, String>,
}

impl Splice {
    /// Whether it moved bytes of `file` into a pipe.
    pub fn reads(&self, file: &Path) -> bool {
        self.offset.is_some() && Path::new(&self.from) == file
    }

    /// Whether it moved bytes from a pipe (to a socket).
    pub fn drains_pipe(&self) -> bool {
        self.from.starts_with("pipe:")
    }
}

/// The splice calls strace logged (`-f -y`): a call another thread
/// interrupted comes in two lines, put back together.
pub fn splices(log: &Path) -> Vec<Splice> {
    let text = std::fs::read_to_string(log).unwrap();
    let mut unfinished: HashMap<&str, &str> = HashMap::new();
    let mut calls = Vec::new();
    for line in text.lines() {
        let (pid, rest) = line.split_once(' ').unwrap_or(("", line));
        let rest = rest.trim_start();
        let whole = if let Some(start) = rest.strip_suffix(" <unfinished ...>") {
            unfinished.insert(pid, start);
            continue;
        } else if let Some(end) = rest.strip_prefix("<... splice resumed>") {
            format!("{}{end}", unfinished.remove(pid).unwrap_or_default())
        } else {
            rest.to_string()
        };
        let Some(call) = whole.strip_prefix("splice(") else { continue };
        let (args, result) = call.rsplit_once(") = ").unwrap_or_else(|| panic!("strace's line: {line}"));
        let args: Vec<&str> = args.split(", ").collect();
        let named =
            |arg: &str| arg.split_once('<').map_or(String::new(), |(_, name)| name.trim_end_matches('>').into());
        let offset = args[1].strip_prefix('[').and_then(|o| o.strip_suffix(']')).map(|o| o.parse().unwrap());
        let result = match result.split_whitespace().collect::<Vec<_>>()[..] {
            [n] => Ok(n.parse().unwrap()),
            [_, errno, ..] => Err(errno.to_string()),
            _ => panic!("strace's line: {line}"),
        };
        calls.push(Splice { from: named(args[0]), offset, len: args[4].parse().unwrap(), result });
    }
    calls
}

/// Waits until no other open of `image` holds one of QEMU's lock bytes. A
/// daemon killed with SIGKILL keeps its image locks until the kernel has
/// torn its io_uring rings down (their registered files keep the image
/// open): that is what fences its last writes, and what a test restarting
/// it at once must wait out.
/// Whether process `pid` has `file` open for writing, as `/proc`'s fdinfo
/// flags say of its descriptors on it (any of them); `None` if it has none.
pub fn open_for_writing(pid: u32, file: &Path) -> Option<bool> {
    let mut found = None;
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
        let entry = entry.unwrap();
        if std::fs::read_link(entry.path()).ok().as_deref() != Some(file) {
            continue;
        }
        let fd = entry.file_name().to_string_lossy().into_owned();
        // A descriptor closed meanwhile says nothing.
        let Ok(info) = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")) else { continue };
        let flags = info.lines().find_map(|l| l.strip_prefix("flags:")).map(str::trim).unwrap();
        let writes = i32::from_str_radix(flags, 8).unwrap() & libc::O_ACCMODE != libc::O_RDONLY;
        found = Some(found.unwrap_or(false) || writes);
    }
    found
}

/// Waits (up to 10 s) until `pid` has `file` open for writing, or not.
pub fn await_open_for_writing(pid: u32, file: &Path, writing: bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while open_for_writing(pid, file) != Some(writing) {
        assert!(Instant::now() < deadline, "{pid}: '{}' open for writing is not {writing}", file.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn wait_until_unlocked(image: &Path) {
    use std::os::fd::AsFd;
    let file = std::fs::File::options().read(true).write(true).open(image).unwrap();
    let locked =
        || (100..104).chain(200..204).any(|at| vsd_sys::lock::byte_locked_elsewhere(file.as_fd(), at).unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    while locked() {
        assert!(Instant::now() < deadline, "{} stayed locked", image.display());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `--blockdev` + `--export` arguments serving `image` as raw on `socket`.
pub fn file_export(image: &Path, socket: &Path, file_opts: &str, export_opts: &str) -> Vec<String> {
    vec![
        "--blockdev".into(),
        format!("driver=file,node-name=file0,filename={}{file_opts}", image.display()),
        "--blockdev".into(),
        "driver=raw,node-name=disk0,file=file0".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,addr.path={}{export_opts}",
            socket.display()
        ),
    ]
}

/// `--blockdev` + `--export` arguments serving the qcow2 `image` on
/// `socket`; `export_opts` are appended to the export (",writable=on").
pub fn qcow2_export(image: &Path, socket: &Path, export_opts: &str) -> Vec<String> {
    vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}", image.display()),
        "--blockdev".into(),
        "driver=qcow2,node-name=q0,file=f0".into(),
        "--export".into(),
        format!("type=vhost-user-blk,id=e0,node-name=q0,addr.type=unix,addr.path={}{export_opts}", socket.display()),
    ]
}

/// The number after `"key":` in `qemu-img --output=json` text, or 0 if
/// the key is absent (qemu-img leaves out counts that are zero).
pub fn json_count(text: &str, key: &str) -> u64 {
    let Some(at) = text.find(&format!("\"{key}\":")) else { return 0 };
    let digits: String = text[at + key.len() + 3..].trim_start().chars().take_while(char::is_ascii_digit).collect();
    digits.parse().unwrap_or(0)
}

/// Runs vsd expecting it to refuse to start: exit status 1 and a single
/// `vsd: ...` line on stderr, which is returned.
pub fn vsd_fails<S: AsRef<OsStr>>(args: &[S]) -> String {
    let out = Command::new(VSD).args(args).stdin(Stdio::null()).output().expect("run vsd");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "vsd must exit 1: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "one error line, got: {stderr}");
    assert!(stderr.starts_with("vsd: "), "{stderr}");
    stderr
}

/// A deterministic pattern, different for each `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A raw node `disk` over file node `f0` on `image`, served writable over
/// vhost-user (`vhost.sock` in `dir`) and NBD (export `rw` on `nbd.sock`).
pub fn disk_over_vhost_and_nbd(dir: &Scratch, image: &Path) -> Vec<String> {
    vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}", image.display()),
        "--blockdev".into(),
        "driver=raw,node-name=disk,file=f0".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=v0,node-name=disk,addr.type=unix,addr.path={},writable=on",
            dir.path("vhost.sock").display()
        ),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", dir.path("nbd.sock").display()),
        "--export".into(),
        "type=nbd,id=n0,node-name=disk,name=rw,writable=on".into(),
    ]
}

/// A qcow2 node `disk` over file node `f0` on `image`, served writable
/// over NBD (export `rw` on `nbd.sock` in `dir`).
pub fn qcow2_over_nbd(dir: &Scratch, image: &Path) -> Vec<String> {
    vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}", image.display()),
        "--blockdev".into(),
        "driver=qcow2,node-name=disk,file=f0".into(),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", dir.path("nbd.sock").display()),
        "--export".into(),
        "type=nbd,id=n0,node-name=disk,name=rw,writable=on".into(),
    ]
}

/// `--blockdev`s of qcow2 node `name` on `image`, over file node `name-file`.
pub fn qcow2_node(name: &str, image: &Path) -> Vec<String> {
    vec![
        "--blockdev".into(),
        format!("driver=file,node-name={name}-file,filename={}", image.display()),
        "--blockdev".into(),
        format!("driver=qcow2,node-name={name},file={name}-file"),
    ]
}

/// A QMP monitor on `socket`, as `--chardev` and `--monitor` arguments.
pub fn monitor(socket: &Path) -> Vec<String> {
    vec![
        "--chardev".into(),
        format!("socket,id=m,path={},server=on,wait=off", socket.display()),
        "--monitor".into(),
        "chardev=m".into(),
    ]
}

/// Runs a command that must succeed; returns what it printed on stdout.
pub fn ok(program: &str, args: &[&str]) -> String {
    let out = run(program, args);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{program} {args:?}: {stdout}{stderr}");
    stdout.into_owned()
}

/// Runs a command to completion: whether it succeeded, and what it
/// printed on stdout and stderr.
pub fn outcome(program: &str, args: &[&str]) -> (bool, String) {
    let out = run(program, args);
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// Runs a command to completion, failing the test if it cannot start.
pub fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program).args(args).output().unwrap_or_else(|e| panic!("cannot run {program}: {e}"))
}

/// What a guest job said: whether `run-guest.sh` passed it, its
/// `VSD-GUEST key=value` facts, and the console.
pub struct GuestRun {
    pub passed: bool,
    pub facts: HashMap<String, String>,
    pub console: String,
    /// The script's exit status, stdout and stderr, for messages.
    pub report: String,
}

/// Boots the test guest with `scripts/guest/run-guest.sh ARGS`, its console
/// kept in `log`. A generous `--timeout` comes first, so that a slow
/// machine fails on the test's own assertions; `args` may override it.
pub fn guest_job<I, S>(log: &Path, args: I) -> GuestRun
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/guest/run-guest.sh");
    let out = Command::new(&script)
        .args(["--timeout", "400"])
        .arg("--log")
        .arg(log)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let facts = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("VSD-GUEST "))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    GuestRun {
        passed: out.status.success(),
        facts,
        console: std::fs::read_to_string(log).unwrap_or_default(),
        report: format!("{}:\n{stdout}\n{}", out.status, String::from_utf8_lossy(&out.stderr)),
    }
}

/// [`guest_job`], failing the test, with the console's tail, unless the
/// job ran and passed its checks; returns the guest's facts.
pub fn run_guest<I, S>(log: &Path, args: I) -> HashMap<String, String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let run = guest_job(log, args);
    let tail: Vec<&str> = run.console.lines().rev().take(40).collect();
    assert!(
        run.passed,
        "guest job failed ({})\n--- console tail ---\n{}",
        run.report,
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    );
    run.facts
}

/// A test Ceph cluster (scripts/ceph.sh): one monitor and one OSD on
/// 127.0.0.1 with a pool named `rbd`. It is started by the first test that
/// needs it and left running for the next test binaries; scripts/test.sh
/// stops it.
pub struct Cluster {
    pub conf: PathBuf,
}

impl Cluster {
    /// The cluster most tests share: auth none, objects in memory.
    pub fn shared() -> &'static Cluster {
        static CLUSTER: std::sync::OnceLock<Cluster> = std::sync::OnceLock::new();
        CLUSTER.get_or_init(|| Self::start("/tmp/vsd-ceph", 3300, &[]))
    }

    /// A cluster that requires cephx keys, its OSD on bluestore in a file
    /// so that objects survive the OSD's restart.
    pub fn cephx() -> &'static Cluster {
        static CLUSTER: std::sync::OnceLock<Cluster> = std::sync::OnceLock::new();
        CLUSTER.get_or_init(|| Self::start("/tmp/vsd-ceph-cephx", 3301, &["--cephx", "--bluestore"]))
    }

    fn start(dir: &str, port: u16, flags: &[&str]) -> Cluster {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph.sh");
        let out = Command::new("bash")
            .arg(script)
            .arg("start")
            .args(flags)
            .env("VSD_CEPH_DIR", dir)
            .env("VSD_CEPH_PORT", port.to_string())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "scripts/ceph.sh start failed (scripts/setup.sh installs Ceph): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Cluster { conf: PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()) }
    }

    /// The file of the cluster's directory named `name`.
    pub fn file(&self, name: &str) -> PathBuf {
        self.conf.with_file_name(name)
    }

    /// Runs `tool` (`rbd`, `ceph`, `rados`) on this cluster.
    pub fn tool(&self, tool: &str, args: &[&str]) -> Output {
        run(tool, &[&["-c", self.conf.to_str().unwrap()], args].concat())
    }

    /// Runs the `rbd` tool, which must succeed; its standard output.
    pub fn rbd(&self, args: &[&str]) -> String {
        let out = self.tool("rbd", args);
        assert!(out.status.success(), "rbd {args:?}: {}{}", String::from_utf8_lossy(&out.stderr), self.report());
        String::from_utf8(out.stdout).unwrap()
    }

    /// Whether each daemon runs, and the end of its log: for the message
    /// of a test that the cluster failed.
    pub fn report(&self) -> String {
        let mut report = String::new();
        for daemon in ["mon.a", "osd.0"] {
            let pid = std::fs::read_to_string(self.file(&format!("run/{daemon}.pid"))).unwrap_or_default();
            // SAFETY: signal 0 only asks whether the process is there.
            let alive = pid.trim().parse().is_ok_and(|pid: i32| unsafe { libc::kill(pid, 0) } == 0);
            let log = std::fs::read_to_string(self.file(&format!("log/{daemon}.log"))).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            report += &format!("\n--- {daemon} (running: {alive}), its log's end ---\n");
            report += &tail.into_iter().rev().collect::<Vec<_>>().join("\n");
        }
        report
    }

    /// A new image of `size` bytes in pool `rbd`.
    pub fn image(&'static self, name: &str, size: u64) -> RbdImage {
        let image = self.image_named(name);
        self.rbd(&["create", "--size", &format!("{}B", size), &image.name]);
        image
    }

    /// An image's name, with no image behind it yet (for a tool that
    /// creates it).
    pub fn image_named(&'static self, name: &str) -> RbdImage {
        let image = RbdImage { name: format!("{name}-{}", std::process::id()), cluster: self };
        let _ = self.tool("rbd", &["rm", "--no-progress", &image.name]);
        image
    }

    /// The OSD's process.
    pub fn osd_pid(&self) -> i32 {
        std::fs::read_to_string(self.file("run/osd.0.pid")).unwrap().trim().parse().unwrap()
    }
}

/// An RBD image named after the test and this process, removed when
/// dropped.
pub struct RbdImage {
    pub name: String,
    cluster: &'static Cluster,
}

impl RbdImage {
    /// `--blockdev` options of an rbd node on this image.
    pub fn node(&self, name: &str) -> String {
        format!("driver=rbd,node-name={name},pool=rbd,image={},conf={}", self.name, self.cluster.conf.display())
    }

    /// The image's bytes, through `rbd export`.
    pub fn export(&self) -> Vec<u8> {
        let out = self.cluster.tool("rbd", &["export", "--no-progress", &self.name, "-"]);
        assert!(out.status.success(), "rbd export: {}{}", String::from_utf8_lossy(&out.stderr), self.cluster.report());
        out.stdout
    }
}

impl Drop for RbdImage {
    fn drop(&mut self) {
        let _ = self.cluster.tool("rbd", &["rm", "--no-progress", &self.name]);
    }
}

/// The dirty extents of `bitmap` on NBD export `name`, as nbdinfo maps them.
pub fn dirty_map(socket: &Path, name: &str, bitmap: &str) -> Vec<(u64, u64)> {
    let uri = format!("nbd+unix:///{name}?socket={}", socket.display());
    let out = run("nbdinfo", &[&format!("--map=qemu:dirty-bitmap:{bitmap}"), "--json", &uri]);
    assert!(out.status.success(), "nbdinfo: {}", String::from_utf8_lossy(&out.stderr));
    let map: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let extents = map.as_array().unwrap().iter();
    let dirty = extents.filter(|e| e["type"].as_u64().unwrap() & 1 != 0);
    dirty.map(|e| (e["offset"].as_u64().unwrap(), e["length"].as_u64().unwrap())).collect()
}
