//! `driver=http` and `driver=https` against a real web server: nginx,
//! started on 127.0.0.1 with a config and a test CA (made by `openssl`)
//! written into the scratch directory, serving a raw and a qcow2 image
//! that vsd and qemu-storage-daemon read back over NBD exactly as the
//! files. A tiny Python server plays the servers that go wrong: one that
//! ignores ranges, one that cuts bodies short, one that gives no size.

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Daemon, Scratch, VSD, ok, pattern, run, sandboxed};

const MIB: usize = 1 << 20;

/// A port free on 127.0.0.1 a moment ago.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn wait_for_port(port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "{what} did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A child process killed when the test ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// nginx serving `dir/www` over http and https (a certificate for
/// 127.0.0.1 that `dir/ca.pem` signed), with a redirect, basic auth and
/// a cookie check.
struct Nginx {
    _server: Server,
    http: u16,
    https: u16,
}

impl Nginx {
    fn start(dir: &Scratch) -> Self {
        make_certificates(dir);
        std::fs::create_dir_all(dir.path("www/auth")).unwrap();
        std::fs::create_dir_all(dir.path("www/cookie")).unwrap();
        std::fs::create_dir_all(dir.path("nginx-tmp")).unwrap();
        let hash = ok("openssl", &["passwd", "-apr1", "sesame"]);
        std::fs::write(dir.path("htpasswd"), format!("ali:{}", hash.trim())).unwrap();
        let (http, https) = (free_port(), free_port());
        let d = dir.0.display();
        let config = format!(
            "daemon off; master_process off; worker_processes 1; pid {d}/nginx.pid; error_log {d}/nginx-error.log;
events {{ worker_connections 256; }}
http {{
  access_log {d}/access.log; client_body_temp_path {d}/nginx-tmp; proxy_temp_path {d}/nginx-tmp;
  fastcgi_temp_path {d}/nginx-tmp; uwsgi_temp_path {d}/nginx-tmp; scgi_temp_path {d}/nginx-tmp;
  server {{
    listen 127.0.0.1:{http}; listen 127.0.0.1:{https} ssl;
    ssl_certificate {d}/server.pem; ssl_certificate_key {d}/server-key.pem;
    root {d}/www;
    location /moved/ {{ rewrite ^/moved/(.*)$ /$1 redirect; }}
    location /auth/ {{ auth_basic on; auth_basic_user_file {d}/htpasswd; }}
    location /cookie/ {{ if ($cookie_k != v) {{ return 403; }} }}
  }}
}}
"
        );
        std::fs::write(dir.path("nginx.conf"), config).unwrap();
        let child = Command::new("nginx")
            .args(["-c", &dir.path("nginx.conf").display().to_string(), "-e", &format!("{d}/nginx-error.log")])
            .stdin(Stdio::null())
            .spawn()
            .expect("nginx");
        let server = Server(child);
        wait_for_port(http, "nginx");
        wait_for_port(https, "nginx");
        Self { _server: server, http, https }
    }

    fn url(&self, scheme: &str, path: &str) -> String {
        let port = if scheme == "https" { self.https } else { self.http };
        format!("{scheme}://127.0.0.1:{port}/{path}")
    }
}

/// A CA (`ca.pem`) and a server certificate for 127.0.0.1 it signed
/// (`server.pem`, `server-key.pem`).
fn make_certificates(dir: &Scratch) {
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl").current_dir(&dir.0).args(args).output().expect("openssl");
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2"];
    openssl(
        &[&["req", "-x509"], &ec[..], &["-keyout", "ca-key.pem", "-out", "ca.pem", "-subj", "/CN=vsd test CA"]]
            .concat(),
    );
    openssl(
        &[
            &["req", "-x509"],
            &ec[..],
            &["-CA", "ca.pem", "-CAkey", "ca-key.pem", "-keyout", "server-key.pem", "-out", "server.pem"],
            &[
                "-subj",
                "/CN=127.0.0.1",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
                "-addext",
                "basicConstraints=CA:FALSE",
            ],
        ]
        .concat(),
    );
}

/// The images the servers serve: `www/disk.raw` (a pattern, a hole, a
/// tail) and `www/disk.qcow2` with the same contents.
fn make_images(dir: &Scratch) -> (PathBuf, PathBuf) {
    let raw = dir.path("www/disk.raw");
    let mut bytes = pattern(7, 6 * MIB);
    bytes[2 * MIB..3 * MIB].fill(0);
    bytes.extend_from_slice(&pattern(8, 25 * 512));
    std::fs::create_dir_all(dir.path("www")).unwrap();
    std::fs::write(&raw, bytes).unwrap();
    let qcow2 = dir.path("www/disk.qcow2");
    ok("qemu-img", &["convert", "-q", "-f", "raw", "-O", "qcow2", path(&raw), path(&qcow2)]);
    (raw, qcow2)
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The arguments that serve `node` (its name `h`), under `format` when
/// it is not `None`, as NBD export `x` on `socket`.
fn serving(node: &str, format: Option<&str>, socket: &Path) -> Vec<String> {
    let mut args = vec!["--blockdev".into(), node.to_string()];
    let top = match format {
        Some(format) => {
            args.extend(["--blockdev".into(), format!("driver={format},node-name=top,file=h,read-only=on")]);
            "top"
        }
        None => "h",
    };
    args.extend([
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", socket.display()),
        "--export".into(),
        format!("type=nbd,id=e0,node-name={top},name=x"),
    ]);
    args
}

fn export(socket: &Path) -> String {
    format!("nbd+unix:///x?socket={}", socket.display())
}

/// vsd, sandboxed as the harness runs it, with `SSL_CERT_FILE` naming `cas`.
struct VsdWithCas {
    _server: Server,
}

impl VsdWithCas {
    fn start(dir: &Scratch, args: &[String], cas: &Path) -> Self {
        let pidfile = dir.path("vsd-cas.pid");
        let _ = std::fs::remove_file(&pidfile);
        let child = Command::new(VSD)
            .args(sandboxed(args))
            .arg("--pidfile")
            .arg(&pidfile)
            .env("SSL_CERT_FILE", cas)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let mut server = Server(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !pidfile.exists() {
            assert!(server.0.try_wait().unwrap().is_none(), "vsd exited during startup");
            assert!(Instant::now() < deadline, "vsd did not become ready");
            std::thread::sleep(Duration::from_millis(10));
        }
        Self { _server: server }
    }
}

/// What a daemon that must refuse to start said on stderr.
fn refused(program: &str, args: &[&str]) -> String {
    let out = Command::new(program).args(args).stdin(Stdio::null()).output().unwrap();
    assert!(!out.status.success(), "{program} {args:?} started");
    String::from_utf8_lossy(&out.stderr).trim().to_string()
}

/// The error after the program's and the option string's names, which
/// vsd and QEMU spell differently.
fn reason(message: &str) -> &str {
    message.splitn(3, ": ").nth(2).unwrap_or(message)
}

/// Every byte vsd reads through an http and an https node, raw and under
/// qcow2, and through a redirect, is the file's; the https node trusts the
/// test CA through `SSL_CERT_FILE`, or checks nothing with `sslverify=off`.
#[test]
fn vsd_reads_images_on_a_web_server_as_the_files() {
    let dir = Scratch::new("http-read");
    let (raw, qcow2) = make_images(&dir);
    let nginx = Nginx::start(&dir);
    let socket = dir.path("nbd.sock");
    for (scheme, file, format, extra) in [
        ("http", "disk.raw", None, ""),
        ("http", "moved/disk.raw", None, ",readahead=0"),
        ("https", "disk.raw", None, ",readahead=1M"),
        ("https", "disk.qcow2", Some("qcow2"), ""),
        ("http", "disk.qcow2", Some("raw"), ""),
    ] {
        let node = format!("driver={scheme},node-name=h,read-only=on,url={}{extra}", nginx.url(scheme, file));
        let _vsd = VsdWithCas::start(&dir, &serving(&node, format, &socket), &dir.path("ca.pem"));
        let (original, as_format) = if format == Some("qcow2") {
            (&qcow2, "qcow2")
        } else if file.ends_with("qcow2") {
            (&qcow2, "raw")
        } else {
            (&raw, "raw")
        };
        ok("qemu-img", &["compare", "-f", "raw", "-F", as_format, &export(&socket), path(original)]);
    }
    let node =
        format!("driver=https,node-name=h,auto-read-only=on,sslverify=off,url={}", nginx.url("https", "disk.raw"));
    let _vsd = Daemon::vsd(&dir, &serving(&node, None, &socket));
    ok("qemu-img", &["compare", "-f", "raw", "-F", "raw", &export(&socket), path(&raw)]);
}

/// qemu-storage-daemon's curl driver reads the same bytes as vsd's, raw
/// and under qcow2.
#[test]
fn qemu_storage_daemon_reads_the_same() {
    let dir = Scratch::new("http-qsd");
    let (raw, qcow2) = make_images(&dir);
    let nginx = Nginx::start(&dir);
    let (vsd_socket, qsd_socket) = (dir.path("vsd.sock"), dir.path("qsd.sock"));
    for (file, format, original) in [("disk.raw", None, &raw), ("disk.qcow2", Some("qcow2"), &qcow2)] {
        // GnuTLS's libcurl takes no CA file from the environment.
        let node = format!("driver=https,node-name=h,read-only=on,sslverify=off,url={}", nginx.url("https", file));
        let _vsd = Daemon::vsd(&dir, &serving(&node, format, &vsd_socket));
        let _qsd = Daemon::qsd(&dir, &serving(&node, format, &qsd_socket));
        ok("qemu-img", &["compare", "-f", "raw", "-F", "raw", &export(&vsd_socket), &export(&qsd_socket)]);
        let as_format = format.unwrap_or("raw");
        ok("qemu-img", &["compare", "-f", "raw", "-F", as_format, &export(&qsd_socket), path(original)]);
    }
}

/// Options and servers vsd refuses at open, in the words
/// qemu-storage-daemon uses.
#[test]
fn refusals_are_qemu_s() {
    let dir = Scratch::new("http-refusals");
    let _images = make_images(&dir);
    let nginx = Nginx::start(&dir);
    let bad = Python::start(&dir);
    let closed = free_port();
    let good = nginx.url("http", "disk.raw");
    let cases = [
        format!("driver=http,node-name=h,url={good}"),
        format!("driver=http,node-name=h,read-only=on,url={}", nginx.url("http", "nothing.raw")),
        format!("driver=http,node-name=h,read-only=on,url={}", bad.url("no-ranges")),
        format!("driver=http,node-name=h,read-only=on,url={}", bad.url("no-size")),
        format!("driver=https,node-name=h,read-only=on,url={good}"),
        format!("driver=http,node-name=h,read-only=on,url={good},readahead=1000"),
        format!("driver=http,node-name=h,read-only=on,url={good},timeout=10001"),
        format!("driver=http,node-name=h,read-only=on,url={good},cookie=a,cookie-secret=s"),
        format!("driver=http,node-name=h,read-only=on,url={good},password-secret=nothing"),
        format!("driver=http,node-name=h,read-only=on,url={}", nginx.url("http", "auth/disk.raw")),
    ];
    for case in &cases {
        let (vsd, qsd) = (refused(VSD, &["--blockdev", case]), refused("qemu-storage-daemon", &["--blockdev", case]));
        assert_eq!(vsd.lines().count(), 1, "{vsd}");
        assert_eq!(reason(&vsd), reason(&qsd), "{case}:\n vsd: {vsd}\n qsd: {qsd}");
    }
    let unreachable = format!("driver=http,node-name=h,read-only=on,url=http://127.0.0.1:{closed}/disk.raw");
    let vsd = refused(VSD, &["--blockdev", &unreachable]);
    assert!(vsd.contains(&format!("CURL: Error opening file: Failed to connect to 127.0.0.1 port {closed}")), "{vsd}");
    // The test CA is none of the system's.
    let untrusted = format!("driver=https,node-name=h,read-only=on,url={}", nginx.url("https", "disk.raw"));
    let (vsd, qsd) =
        (refused(VSD, &["--blockdev", &untrusted]), refused("qemu-storage-daemon", &["--blockdev", &untrusted]));
    assert!(vsd.contains("CURL: Error opening file: ") && vsd.contains("UnknownIssuer"), "{vsd}");
    assert!(qsd.contains("CURL: Error opening file: "), "{qsd}");
}

/// The cookie and the basic-auth password come from `--object secret`s.
#[test]
fn cookie_and_password_secrets_are_sent() {
    let dir = Scratch::new("http-secrets");
    let (raw, _) = make_images(&dir);
    for place in ["auth", "cookie"] {
        std::fs::create_dir_all(dir.path(&format!("www/{place}"))).unwrap();
        std::fs::copy(&raw, dir.path(&format!("www/{place}/disk.raw"))).unwrap();
    }
    let nginx = Nginx::start(&dir);
    let socket = dir.path("nbd.sock");
    let no_cookie = format!("driver=http,node-name=h,read-only=on,url={}", nginx.url("http", "cookie/disk.raw"));
    assert!(refused(VSD, &["--blockdev", &no_cookie]).ends_with("The requested URL returned error: 403"));
    for node in [
        format!("{no_cookie},cookie=k=v"),
        format!("{no_cookie},cookie-secret=c"),
        format!(
            "driver=http,node-name=h,read-only=on,url={},username=ali,password-secret=p",
            nginx.url("http", "auth/disk.raw")
        ),
    ] {
        let mut args: Vec<String> =
            ["--object", "secret,id=c,data=k=v", "--object", "secret,id=p,data=sesame"].map(String::from).into();
        args.extend(serving(&node, None, &socket));
        let _vsd = Daemon::vsd(&dir, &args);
        ok("qemu-img", &["compare", "-f", "raw", "-F", "raw", &export(&socket), path(&raw)]);
    }
}

/// A server that answers a range with the whole image (status 200), or
/// cuts a range's body short, fails the read with EIO: no byte of it is
/// taken for the image's.
#[test]
fn a_server_that_answers_ranges_wrongly_fails_the_reads() {
    let dir = Scratch::new("http-wrong");
    let bad = Python::start(&dir);
    let socket = dir.path("nbd.sock");
    for (what, offset) in [("ignores-ranges", "0"), ("ignores-ranges", "64k"), ("short", "0"), ("short", "1M")] {
        let node = format!("driver=http,node-name=h,read-only=on,url={}", bad.url(what));
        let _vsd = Daemon::vsd(&dir, &serving(&node, None, &socket));
        let out = run("qemu-io", &["-r", "-f", "raw", "-c", &format!("read {offset} 4k"), &export(&socket)]);
        let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        assert!(text.contains("Input/output error"), "{what} at {offset}: {text}");
    }
}

/// A Python server for the servers that go wrong, by path: `no-ranges`
/// (no Accept-Ranges, a 200 for a range), `no-size` (no length, `*` for
/// the total), `ignores-ranges` (says it takes ranges, answers 200 with
/// the whole body), `short` (a 206 whose body stops half way).
struct Python {
    _server: Server,
    port: u16,
}

const PYTHON_SERVER: &str = r#"
import http.server, sys
SIZE = 2 << 20
BODY = bytes(i * 7 % 251 for i in range(SIZE))
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args): pass
    def do_HEAD(self): self.answer(False)
    def do_GET(self): self.answer(True)
    def answer(self, body):
        kind = self.path.strip("/")
        ranged = self.headers.get("Range", "").startswith("bytes=") and kind in ("short", "no-size")
        if ranged:
            first, last = (int(x) for x in self.headers["Range"][6:].split("-"))
            self.send_response(206)
            total = "*" if kind == "no-size" else str(SIZE)
            self.send_header("Content-Range", f"bytes {first}-{last}/{total}")
            data = BODY[first:last + 1]
        else:
            self.send_response(200)
            data = BODY
        if kind != "no-size" or ranged:
            self.send_header("Content-Length", str(len(data)))
        if kind != "no-ranges":
            self.send_header("Accept-Ranges", "bytes")
        if kind == "short" or kind == "no-size" and not ranged:
            self.send_header("Connection", "close")
        self.end_headers()
        if body:
            self.wfile.write(data[: len(data) // 2] if kind == "short" and ranged else data)
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"#;

impl Python {
    fn start(dir: &Scratch) -> Self {
        let port = free_port();
        std::fs::write(dir.path("server.py"), PYTHON_SERVER).unwrap();
        let child = Command::new("python3")
            .arg(dir.path("server.py"))
            .arg(port.to_string())
            .stdin(Stdio::null())
            // Its tracebacks for the connections vsd drops are no news.
            .stderr(Stdio::null())
            .spawn()
            .expect("python3");
        let server = Server(child);
        wait_for_port(port, "the Python server");
        Self { _server: server, port }
    }

    fn url(&self, what: &str) -> String {
        format!("http://127.0.0.1:{}/{what}", self.port)
    }
}

/// The golden-image flow: a disk served at once from a qcow2 overlay whose
/// backing image is on a web server, `copy-on-read` above it so that what
/// the guest reads stays local, `block-stream` pulling in the rest while
/// the guest writes, then the web server dropped: the disk reads as the
/// golden image with the guest's writes, and the overlay stands alone.
#[test]
fn a_golden_image_on_a_web_server_is_pulled_in_while_served_then_the_server_goes() {
    let dir = Scratch::new("http-golden");
    let (golden, _) = make_images(&dir);
    let size = std::fs::metadata(&golden).unwrap().len();
    let nginx = Nginx::start(&dir);
    let (overlay, socket, qmp) = (dir.path("vm.qcow2"), dir.path("nbd.sock"), dir.path("qmp.sock"));
    ok("qemu-img", &["create", "-q", "-f", "qcow2", path(&overlay), &size.to_string()]);
    let url = nginx.url("https", "disk.raw");
    let mut args: Vec<String> = [
        "--blockdev",
        &format!("https,node-name=golden,read-only=on,url={url}"),
        "--blockdev",
        &format!("file,node-name=vm-file,filename={}", path(&overlay)),
        "--blockdev",
        "qcow2,node-name=vm,file=vm-file,backing=golden",
        "--blockdev",
        "copy-on-read,node-name=disk,file=vm",
        "--nbd-server",
        &format!("addr.type=unix,addr.path={}", socket.display()),
        "--export",
        "nbd,id=e0,node-name=disk,name=x,writable=on",
    ]
    .map(String::from)
    .into();
    args.extend(common::monitor(&qmp));
    let vsd = VsdWithCas::start(&dir, &args, &dir.path("ca.pem"));
    // The guest: a read (copied into the overlay) and a write.
    ok("qemu-io", &["-f", "raw", "-c", "read -q 1M 256k", "-c", "write -q -P 9 4M 64k", &export(&socket)]);
    let mut expected = std::fs::read(&golden).unwrap();
    expected[4 * MIB..4 * MIB + (64 << 10)].fill(9);
    std::fs::write(dir.path("expected.raw"), &expected).unwrap();

    let mut qmp = common::qmp::Qmp::connect(&qmp);
    qmp.ok("block-stream", serde_json::json!({"job-id": "pull", "device": "vm"}));
    qmp.await_event("BLOCK_JOB_COMPLETED", serde_json::json!({"device": "pull"}));
    qmp.ok("blockdev-del", serde_json::json!({"node-name": "golden"}));
    drop(nginx);
    ok("qemu-img", &["compare", "-f", "raw", "-F", "raw", &export(&socket), path(&dir.path("expected.raw"))]);
    drop(qmp);
    drop(vsd);
    // A killed daemon's io_uring lets the file go a moment later.
    common::wait_until_unlocked(&overlay);

    let info = ok("qemu-img", &["info", "--output=json", path(&overlay)]);
    assert!(!info.contains("backing-filename"), "the overlay stands alone: {info}");
    ok("qemu-img", &["check", "-q", path(&overlay)]);
    ok("qemu-img", &["compare", "-q", "-F", "raw", path(&overlay), path(&dir.path("expected.raw"))]);
}

/// The golden-image flow with a booted guest: a Linux guest (QEMU under
/// TCG) boots on a vhost-user-blk disk served from a qcow2 overlay whose
/// backing image is on the web server, and runs fio's write-and-verify
/// on the disk's first 4 MiB while `block-stream` pulls the rest in; the
/// server goes once the stream is done. The guest sees every block it
/// wrote, and the overlay stands alone with the golden image past them.
#[test]
fn a_guest_boots_on_a_golden_image_on_a_web_server_while_it_is_pulled_in() {
    const WRITTEN: usize = 4 * MIB;
    let dir = Scratch::new("http-golden-guest");
    let (golden, _) = make_images(&dir);
    let size = std::fs::metadata(&golden).unwrap().len();
    let nginx = Nginx::start(&dir);
    let (overlay, socket, qmp) = (dir.path("vm.qcow2"), dir.path("vm.sock"), dir.path("qmp.sock"));
    ok("qemu-img", &["create", "-q", "-f", "qcow2", path(&overlay), &size.to_string()]);
    let url = nginx.url("https", "disk.raw");
    let mut args: Vec<String> = [
        "--blockdev",
        &format!("https,node-name=golden,read-only=on,url={url}"),
        "--blockdev",
        &format!("file,node-name=vm-file,filename={}", path(&overlay)),
        "--blockdev",
        "qcow2,node-name=vm,file=vm-file,backing=golden",
        "--blockdev",
        "copy-on-read,node-name=disk,file=vm",
        "--export",
        &format!("vhost-user-blk,id=e0,node-name=disk,writable=on,addr.type=unix,addr.path={}", socket.display()),
    ]
    .map(String::from)
    .into();
    args.extend(common::monitor(&qmp));
    let vsd = VsdWithCas::start(&dir, &args, &dir.path("ca.pem"));
    let console = dir.path("console.log");
    let guest_args = ["--socket", path(&socket), "--queues", "1", "--size", "4M", "--bs", "4k"];
    let guest = std::thread::scope(|scope| {
        let guest = scope.spawn(|| common::guest_job(&console, guest_args));
        // The stream starts while the guest boots, and runs at 1 MiB/s
        // under it (about as long as the guest's job).
        let mut qmp = common::qmp::Qmp::connect(&qmp);
        let stream = serde_json::json!({"job-id": "pull", "device": "vm", "speed": 1 << 20});
        qmp.ok("block-stream", stream);
        assert!(!guest.is_finished(), "the guest runs while the image is pulled in");
        qmp.await_event("BLOCK_JOB_COMPLETED", serde_json::json!({"device": "pull"}));
        qmp.ok("blockdev-del", serde_json::json!({"node-name": "golden"}));
        drop(nginx);
        guest.join().unwrap()
    });
    assert!(guest.passed, "the guest's job: {}", guest.report);
    assert_eq!(guest.facts["fio_write_status"], "0");
    assert_eq!(guest.facts["fio_verify_status"], "0", "the guest read back every block it wrote");
    drop(vsd);
    common::wait_until_unlocked(&overlay);

    let info = ok("qemu-img", &["info", "--output=json", path(&overlay)]);
    assert!(!info.contains("backing-filename"), "the overlay stands alone: {info}");
    ok("qemu-img", &["check", "-q", path(&overlay)]);
    let flat = dir.path("vm.raw");
    ok("qemu-img", &["convert", "-q", "-O", "raw", path(&overlay), path(&flat)]);
    let (disk, golden) = (std::fs::read(&flat).unwrap(), std::fs::read(&golden).unwrap());
    assert!(disk[WRITTEN..] == golden[WRITTEN..], "past the guest's writes, the disk is the golden image");
}
