//! qemu-storage-daemon's command lines on vsd: lines from QSD's manual and
//! of the shape libvirt generates start both daemons alike, each mistake is
//! refused by both in QEMU's words, and the common node options
//! (`detect-zeroes`, `force-share`, `auto-read-only`, `aio=native`) and the
//! process options (`--daemonize`, `-T`) do what QEMU's do.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Daemon, Scratch, VSD, ok, run};
use serde_json::Value;

/// The two daemons every line runs on.
const DAEMONS: [&str; 2] = [VSD, "qemu-storage-daemon"];

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// `line` with `{img}`, `{qcow2}` and `{dir}` filled in.
fn filled(line: &[&str], dir: &Scratch, img: &Path, qcow2: &Path) -> Vec<String> {
    line.iter()
        .map(|a| {
            a.replace("{img}", &img.display().to_string())
                .replace("{qcow2}", &qcow2.display().to_string())
                .replace("{dir}", &dir.0.display().to_string())
        })
        .collect()
}

fn start(program: &str, dir: &Scratch, args: &[String]) -> Daemon {
    if program == VSD { Daemon::vsd(dir, args) } else { Daemon::qsd(dir, args) }
}

/// Lines QSD's manual shows and libvirt writes, which both daemons serve.
const ACCEPTED: &[&[&str]] = &[
    // The manual's vhost-user-blk and NBD examples.
    &[
        "--blockdev",
        "driver=file,node-name=disk,filename={img}",
        "--export",
        "type=vhost-user-blk,id=export,addr.type=unix,addr.path={dir}/vhost-user-blk.sock,node-name=disk,writable=on",
    ],
    &[
        "--blockdev",
        "driver=file,node-name=file,filename={qcow2}",
        "--blockdev",
        "driver=qcow2,node-name=qcow2,file=file",
        "--nbd-server",
        "addr.type=unix,addr.path={dir}/nbd.sock",
        "--export",
        "type=nbd,id=export,node-name=qcow2,name=disk,writable=on",
        "--chardev",
        "socket,path={dir}/qmp.sock,server=on,wait=off,id=char1",
        "--monitor",
        "chardev=char1",
    ],
    // QEMU's iotests: implied keys (qsd-migrate, qsd-jobs).
    &[
        "--object",
        "iothread,id=io0",
        "--blockdev",
        "file,node-name=f,filename={img}",
        "--blockdev",
        "raw,node-name=r,file=f",
        "--nbd-server",
        "addr.type=unix,addr.path={dir}/nbd.sock",
        "--export",
        "nbd,id=e,node-name=r,writable=on",
    ],
    // libvirt's -blockdev JSON for a qcow2 disk on a file.
    &[
        "--blockdev",
        r#"{"driver":"file","filename":"{qcow2}","node-name":"libvirt-1-storage","auto-read-only":true,"discard":"unmap"}"#,
        "--blockdev",
        r#"{"node-name":"libvirt-1-format","read-only":false,"discard":"unmap","driver":"qcow2","file":"libvirt-1-storage"}"#,
        "--export",
        r#"{"type":"vhost-user-blk","id":"e","node-name":"libvirt-1-format","writable":true,"addr":{"type":"unix","path":"{dir}/v.sock"}}"#,
    ],
    // libvirt's io='native' (cache.direct=on), detect_zeroes, a read-only
    // disk shared with other processes.
    &[
        "--blockdev",
        "driver=file,node-name=f,filename={img},aio=native,cache.direct=on,detect-zeroes=unmap,discard=unmap",
        "--blockdev",
        "driver=file,node-name=ro,filename={qcow2},read-only=on,force-share=on,detect-zeroes=on",
        "--blockdev",
        "driver=null-aio,node-name=null,size=1048576",
        "--nbd-server",
        "addr.type=unix,addr.path={dir}/nbd.sock",
        "--export",
        "type=nbd,id=e,node-name=f,writable=on",
    ],
];

#[test]
fn qsd_manual_and_libvirt_lines_start_both_daemons() {
    for (i, line) in ACCEPTED.iter().enumerate() {
        for program in DAEMONS {
            let dir = Scratch::new(&format!("grammar-ok-{i}-{}", program.len()));
            let img = dir.image("disk.img", 1 << 20);
            let qcow2 = dir.path("disk.qcow2");
            ok("qemu-img", &["create", "-q", "-f", "qcow2", &qcow2.display().to_string(), "1M"]);
            let mut daemon = start(program, &dir, &filled(line, &dir, &img, &qcow2));
            assert!(daemon.is_running(), "{program} {line:?}");
            assert!(daemon.stop().success(), "{program} stops cleanly after {line:?}");
        }
    }
}

/// Mistakes, and the words both daemons refuse them with.
const REFUSED: &[(&[&str], &str)] = &[
    (
        &["--blockdev", r#"{"driver":"file","node-name":"f","filename":"{img}","read-only":"yes"}"#],
        "Invalid parameter type for 'read-only', expected: boolean",
    ),
    (
        &["--blockdev", r#"{"driver":"null-co","node-name":"n","size":"1M"}"#],
        "Invalid parameter type for 'size', expected: integer",
    ),
    (
        &["--blockdev", r#"{"driver":"null-co","node-name":"n","read-zeroes":1}"#],
        "Invalid parameter type for 'read-zeroes', expected: boolean",
    ),
    (&["--blockdev", "qcow9,node-name=a"], "Parameter 'driver' does not accept value 'qcow9'"),
    (
        &["--blockdev", "null-co,node-name=n", "--export", "fuse9,id=e,node-name=n"],
        "Parameter 'type' does not accept value 'fuse9'",
    ),
    (&["--blockdev", "file,node-name=f,filename={img},aio=posix"], "Parameter 'aio' does not accept value 'posix'"),
    (
        &["--blockdev", "file,node-name=f,filename={img},detect-zeroes=always"],
        "Parameter 'detect-zeroes' does not accept value 'always'",
    ),
    (
        &["--blockdev", "file,node-name=f,filename={img},detect-zeroes=unmap"],
        "setting detect-zeroes to unmap is not allowed without setting discard operation to unmap",
    ),
    (
        &["--blockdev", "file,node-name=f,filename={img},force-share=on"],
        "force-share=on can only be used with read-only images",
    ),
    (
        &["--blockdev", "file,node-name=f,filename={img},aio=native"],
        "aio=native was specified, but it requires cache.direct=on, which was not specified.",
    ),
    (&["-T", "events={dir}/no-such-events", "--blockdev", "null-co,node-name=n"], "No such file or directory"),
];

#[test]
fn mistakes_are_refused_by_both_in_qemus_words() {
    let dir = Scratch::new("grammar-refused");
    let img = dir.image("disk.img", 1 << 20);
    for (line, words) in REFUSED {
        let args = filled(line, &dir, &img, &img);
        for program in DAEMONS {
            let out = Command::new(program).args(&args).stdin(Stdio::null()).output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{program} {args:?}: {stderr}");
            assert!(stderr.contains(words), "{program} {args:?} should say {words:?}: {stderr}");
        }
    }
}

#[test]
fn help_lists_what_there_is() {
    let objects = ok(VSD, &["--object", "help"]);
    for object in ["iothread", "secret", "throttle-group", "tls-creds-x509"] {
        assert!(objects.lines().any(|l| l.trim() == object), "{object}: {objects}");
        // Every type vsd lists, QSD creates too.
        assert!(ok("qemu-storage-daemon", &["--object", "help"]).contains(object));
    }
    // A type's properties: what vsd takes, by QSD's names and types.
    for object in ["iothread", "secret", "throttle-group", "tls-creds-x509"] {
        let ours = ok(VSD, &["--object", &format!("{object},help")]);
        let qsd = ok("qemu-storage-daemon", &["--object", &format!("{object},help")]);
        assert_eq!(ours.lines().next(), Some(format!("{object} options:").as_str()));
        for property in ours.lines().skip(1).filter(|p| !p.contains("cpu-affinity")) {
            assert!(qsd.lines().any(|q| q == property), "{object}: {property} is not QSD's: {qsd}");
        }
    }
    assert_eq!(ok(VSD, &["--object", "secret,help"]), ok("qemu-storage-daemon", &["--object", "secret,help"]));
    let drivers = ok(VSD, &["--blockdev", "help"]);
    for driver in ["file", "host_device", "raw", "qcow2", "nbd", "rbd", "null-co", "null-aio", "throttle"] {
        assert!(drivers.lines().any(|l| l.trim() == driver), "{driver}: {drivers}");
    }
    let exports = ok(VSD, &["--export", "help"]);
    assert!(exports.contains("vhost-user-blk") && exports.contains("nbd"), "{exports}");
    assert!(ok(VSD, &["-T", "help"]).contains("nbd_*"));
}

/// What `qemu-img map` says of `image`: (length, data, zero) of each
/// extent.
fn map(image: &Path) -> Vec<(u64, bool, bool)> {
    let out = ok("qemu-img", &["map", "--output=json", "-f", "qcow2", &image.display().to_string()]);
    let extents: Vec<Value> = serde_json::from_str(&out).unwrap();
    extents
        .iter()
        .map(|e| (e["length"].as_u64().unwrap(), e["data"].as_bool().unwrap(), e["zero"].as_bool().unwrap()))
        .collect()
}

/// Writes 1 MiB of zeroes then 1 MiB of data through an NBD export of a
/// qcow2 image with `detect` (its `detect-zeroes` options), and returns
/// the image's map.
fn written_with(program: &str, detect: &str) -> Vec<(u64, bool, bool)> {
    // qemu-io writes through (FUA): durable writes of zeroes are detected too.
    served_with(program, detect, &["write -q -P 0 0 1M", "write -q -P 7 1M 1M"])
}

/// Runs qemu-io's `commands` on an NBD export of a fresh 4 MiB qcow2 image
/// whose node has `options`, and returns the image's map.
fn served_with(program: &str, options: &str, commands: &[&str]) -> Vec<(u64, bool, bool)> {
    served_under(program, options, None, commands)
}

/// As [`served_with`], the export on `filter` (`DRIVER,OPTIONS`) over the
/// qcow2 node when there is one.
fn served_under(program: &str, options: &str, filter: Option<&str>, commands: &[&str]) -> Vec<(u64, bool, bool)> {
    let tag = format!("{}-{}-{}", options.len(), filter.map_or(0, str::len), commands.len());
    let dir = Scratch::new(&format!("grammar-zeroes-{}-{tag}", program.len()));
    let image = dir.path("z.qcow2");
    ok("qemu-img", &["create", "-q", "-f", "qcow2", &image.display().to_string(), "4M"]);
    let socket = dir.path("nbd.sock");
    let args = strings(&[
        "--blockdev",
        &format!("file,node-name=f,filename={}", image.display()),
        "--blockdev",
        &format!("qcow2,node-name=q,file=f{options}"),
        "--nbd-server",
        &format!("addr.type=unix,addr.path={}", socket.display()),
    ]);
    let mut args = args;
    if let Some(filter) = filter {
        args.extend(["--blockdev".to_string(), format!("{filter},node-name=top,file=q")]);
    }
    args.extend([
        "--export".to_string(),
        format!("nbd,id=e,node-name={},name=q,writable=on", ["q", "top"][usize::from(filter.is_some())]),
    ]);
    let daemon = start(program, &dir, &args);
    let uri = format!("nbd+unix:///q?socket={}", socket.display());
    for command in commands {
        ok("qemu-io", &["-f", "raw", "-c", command, &uri]);
    }
    assert!(daemon.stop().success());
    map(&image)
}

#[test]
fn detect_zeroes_leaves_zero_writes_unallocated_as_qemu_does() {
    for program in DAEMONS {
        let off = written_with(program, "");
        assert_eq!(off[0], (2 << 20, true, false), "{program}: without detection zeroes are data: {off:?}");
        let unmap = written_with(program, ",detect-zeroes=unmap,discard=unmap");
        assert_eq!(unmap[0], (1 << 20, false, true), "{program}: unmap leaves a hole: {unmap:?}");
        assert_eq!(unmap[1], (1 << 20, true, false), "{program}: the data is data: {unmap:?}");
        let on = written_with(program, ",detect-zeroes=on");
        assert!(on[0].2 && on[0].0 == 1 << 20, "{program}: on stores zeroes as zeroes: {on:?}");
    }
}

/// A node acts on discards only with `discard=unmap` (QEMU's default is
/// `ignore`): a discard through a qcow2 node without it leaves the data.
#[test]
fn discards_reach_the_image_only_with_discard_unmap_as_qemu_does() {
    let commands = ["write -q -P 7 0 2M", "discard -q 0 1M"];
    for program in DAEMONS {
        let ignored = served_with(program, "", &commands);
        assert_eq!(ignored[0], (2 << 20, true, false), "{program}: the discard is ignored: {ignored:?}");
        let unmapped = served_with(program, ",discard=unmap", &commands);
        assert_eq!(unmapped[0].0, 1 << 20, "{program}: the first MiB is discarded: {unmapped:?}");
        assert!(!unmapped[0].1, "{program}: discarded, not data: {unmapped:?}");
        assert_eq!(unmapped[1], (1 << 20, true, false), "{program}: the rest is data: {unmapped:?}");
        // A filter answers for itself too: without discard=unmap, it drops
        // the discards before the qcow2 node, which would act on them.
        let under = |filter: &str| served_under(program, ",discard=unmap", Some(filter), &commands);
        let dropped = under("copy-on-read");
        assert_eq!(dropped[0], (2 << 20, true, false), "{program}: the filter ignores it: {dropped:?}");
        let passed = under("copy-on-read,discard=unmap");
        assert_eq!(passed[0].0, 1 << 20, "{program}: the filter passes it on: {passed:?}");
        assert!(!passed[0].1, "{program}: discarded, not data: {passed:?}");
    }
}

#[test]
fn force_share_opens_an_image_another_daemon_writes() {
    let dir = Scratch::new("grammar-share");
    let image = dir.path("shared.qcow2");
    ok("qemu-img", &["create", "-q", "-f", "qcow2", &image.display().to_string(), "1M"]);
    let writer = Daemon::vsd(&dir, &common::qcow2_export(&image, &dir.path("w.sock"), ",writable=on"));
    for program in DAEMONS {
        let reader = |extra: &str, socket: &str| {
            strings(&[
                "--blockdev",
                &format!("file,node-name=f,filename={},read-only=on{extra}", image.display()),
                "--blockdev",
                &format!("qcow2,node-name=q,file=f,read-only=on{extra}"),
                "--nbd-server",
                &format!("addr.type=unix,addr.path={}", dir.path(socket).display()),
                "--export",
                "nbd,id=e,node-name=q",
            ])
        };
        let out = Command::new(program).args(reader("", "r.sock")).stdin(Stdio::null()).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{program}: the image is in use: {stderr}");
        assert!(stderr.contains("Failed to get shared \"write\" lock"), "{program}: {stderr}");
        let mut shared = start(program, &dir, &reader(",force-share=on", "s.sock"));
        assert!(shared.is_running());
        let uri = format!("nbd+unix:///q?socket={}", dir.path("s.sock").display());
        ok("qemu-io", &["-r", "-f", "raw", "-c", "read -q 0 64k", &uri]);
        assert!(shared.stop().success());
    }
    drop(writer);
}

/// Makes `file` refuse writers (even root) while the value lives.
struct Immutable<'a>(&'a Path);

impl<'a> Immutable<'a> {
    fn new(file: &'a Path) -> Option<Self> {
        run("chattr", &["+i", &file.display().to_string()]).status.success().then_some(Self(file))
    }
}

impl Drop for Immutable<'_> {
    fn drop(&mut self) {
        run("chattr", &["-i", &self.0.display().to_string()]);
    }
}

#[test]
fn auto_read_only_opens_writable_only_while_a_writer_needs_it() {
    let dir = Scratch::new("grammar-auto-ro");
    let image = dir.image("base.img", 1 << 20);
    let Some(immutable) = Immutable::new(&image) else {
        panic!("chattr +i must work on the test's scratch directory (ext4 as root)");
    };
    let qmp = dir.path("qmp.sock");
    let mut args =
        strings(&["--blockdev", &format!("file,node-name=f,filename={},auto-read-only=on", image.display())]);
    args.extend(common::monitor(&qmp));
    // Without auto-read-only the file cannot be opened at all.
    let line = common::vsd_fails(&[&args[..1], &[args[1].replace(",auto-read-only=on", "")], &args[2..]].concat());
    assert!(line.contains("Operation not permitted"), "{line}");
    let daemon = Daemon::vsd(&dir, &args);
    assert_eq!(common::open_for_writing(daemon.pid(), &image), Some(false), "the file refuses writers");
    let mut qmp = common::qmp::Qmp::connect(&qmp);
    let export = |id: &str| serde_json::json!({"type": "nbd", "id": id, "node-name": "f", "writable": true});
    qmp.ok("nbd-server-start", serde_json::json!({"addr": {"type": "unix", "data": {"path": dir.path("n.sock")}}}));
    let refused = qmp.answer("block-export-add", export("e"));
    assert!(refused.to_string().contains("Operation not permitted"), "a writer cannot have it yet: {refused}");
    drop(immutable);
    qmp.ok("block-export-add", export("e"));
    assert_eq!(common::open_for_writing(daemon.pid(), &image), Some(true), "a writer came");
    qmp.ok("block-export-del", serde_json::json!({"id": "e"}));
    common::await_open_for_writing(daemon.pid(), &image, false);
}

#[test]
fn daemonize_returns_once_serving_or_with_the_error() {
    for program in DAEMONS {
        let dir = Scratch::new(&format!("grammar-daemon-{}", program.len()));
        let image = dir.image("disk.img", 1 << 20);
        let (socket, pidfile) = (dir.path("v.sock"), dir.path("d.pid"));
        let mut args = common::file_export(&image, &socket, "", "");
        // Relative: the daemon leaves its working directory, and removes
        // the pidfile all the same when it stops.
        args.extend(strings(&["--daemonize", "--pidfile", "d.pid"]));
        let out = Command::new(program).args(&args).current_dir(&dir.0).stdin(Stdio::null()).output().unwrap();
        assert!(out.status.success(), "{program}: {}", String::from_utf8_lossy(&out.stderr));
        // Once the command returned, the export serves.
        assert!(socket.exists() && pidfile.exists(), "{program}: not serving when it returned");
        let pid: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
        assert!(Path::new(&format!("/proc/{pid}")).exists(), "{program}: the daemon runs");
        drop(std::os::unix::net::UnixStream::connect(&socket).unwrap());
        // SAFETY: kill() with the daemon's pid, read from its pidfile.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Path::new(&format!("/proc/{pid}")).exists() {
            assert!(Instant::now() < deadline, "{program}: the daemon did not stop");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!pidfile.exists(), "{program}: the pidfile is removed");

        let missing = common::file_export(&dir.path("missing.img"), &socket, "", "");
        let out = Command::new(program).args(&missing).arg("--daemonize").stdin(Stdio::null()).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{program}: the daemon failed: {stderr}");
        assert!(stderr.contains("missing.img"), "{program}: the error reaches the caller: {stderr}");
    }
}

#[test]
fn trace_patterns_show_the_layers_log_and_unknown_ones_warn() {
    let dir = Scratch::new("grammar-trace");
    let (socket, log) = (dir.path("nbd.sock"), dir.path("trace.log"));
    let args = strings(&[
        "-T",
        &format!("nbd_*,file={}", log.display()),
        "-T",
        "no_such_event_*",
        "--blockdev",
        "null-co,node-name=n",
        "--nbd-server",
        &format!("addr.type=unix,addr.path={}", socket.display()),
    ]);
    let mut child = Command::new(VSD).args(&args).stderr(Stdio::piped()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        assert!(Instant::now() < deadline, "vsd did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    // A client that leaves during the handshake: the NBD server says so.
    drop(std::os::unix::net::UnixStream::connect(&socket).unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(&log).unwrap_or_default().contains("handshake failed") {
        assert!(Instant::now() < deadline, "no NBD line in the trace: {:?}", std::fs::read_to_string(&log));
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no trace in vsd for 'no_such_event_*'"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "one warning line, and the log went to the file: {stderr}");
}
