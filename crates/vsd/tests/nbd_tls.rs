//! NBD over TLS against real peers: QEMU's client (qemu-img, qemu-io with
//! `tls-creds-x509` objects) and libnbd's (nbdinfo, nbdcopy with `nbds+unix`
//! URIs), with a CA and certificates each test makes with `openssl`; clients
//! without TLS, or with a certificate another CA signed (GnuTLS's clients
//! keep it; a rustls client sends it), are refused while the others are
//! served, and a client stalling in the TLS handshake is cut.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use common::{Daemon, Scratch, nbd, ok, pattern, run};
use serde_json::{Value, json};
use vsd_control::client::QmpClient;

const MIB: u64 = 1 << 20;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPT_EXPORT_NAME: u32 = 1;
const OPT_LIST: u32 = 3;
const OPT_STARTTLS: u32 = 5;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = std::process::Command::new("openssl").current_dir(dir).args(args).output().expect("openssl");
    assert!(out.status.success(), "openssl {args:?}: {}", text(&out));
}

/// A CA's key and self-signed certificate, `NAME-key.pem`, `NAME-cert.pem`.
fn make_ca(dir: &Path, name: &str) {
    let (key, cert) = (format!("{name}-key.pem"), format!("{name}-cert.pem"));
    openssl(dir, &["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", &key]);
    let subject = format!("/CN={name}");
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-new",
            "-key",
            &key,
            "-out",
            &cert,
            "-days",
            "2",
            "-subj",
            &subject,
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
}

/// A key and a certificate `ca` signed for `usage` (serverAuth or
/// clientAuth), as `NAME-key.pem` and `NAME-cert.pem`.
fn make_cert(dir: &Path, ca: &str, name: &str, usage: &str) {
    let (key, cert, csr, ext) =
        (format!("{name}-key.pem"), format!("{name}-cert.pem"), format!("{name}.csr"), format!("{name}.ext"));
    openssl(dir, &["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", &key]);
    openssl(dir, &["req", "-new", "-key", &key, "-out", &csr, "-subj", &format!("/CN={name}")]);
    let extensions = format!(
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage={usage}\n\
         subjectAltName=DNS:localhost,IP:127.0.0.1\n"
    );
    std::fs::write(dir.join(&ext), extensions).unwrap();
    let (ca_cert, ca_key) = (format!("{ca}-cert.pem"), format!("{ca}-key.pem"));
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca_cert,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &ext,
            "-out",
            &cert,
        ],
    );
}

/// Certificate directories with QEMU's and libnbd's file names.
struct Pki {
    /// ca-cert.pem, server-cert.pem, server-key.pem.
    server: PathBuf,
    /// ca-cert.pem, client-cert.pem, client-key.pem.
    client: PathBuf,
    /// A client whose certificate another CA signed (it trusts the right CA).
    rogue: PathBuf,
    /// A client with no certificate: ca-cert.pem alone.
    anonymous: PathBuf,
}

fn make_pki(dir: &Scratch) -> Pki {
    let work = dir.path("pki");
    std::fs::create_dir_all(&work).unwrap();
    make_ca(&work, "ca");
    make_ca(&work, "other-ca");
    make_cert(&work, "ca", "server", "serverAuth");
    make_cert(&work, "ca", "client", "clientAuth");
    make_cert(&work, "other-ca", "rogue", "clientAuth");
    let place = |name: &str, files: &[(&str, &str)]| {
        let to = dir.path(name);
        std::fs::create_dir_all(&to).unwrap();
        for (from, file) in files {
            std::fs::copy(work.join(from), to.join(file)).unwrap();
        }
        to
    };
    Pki {
        server: place(
            "server-pki",
            &[
                ("ca-cert.pem", "ca-cert.pem"),
                ("server-cert.pem", "server-cert.pem"),
                ("server-key.pem", "server-key.pem"),
            ],
        ),
        client: place(
            "client-pki",
            &[
                ("ca-cert.pem", "ca-cert.pem"),
                ("client-cert.pem", "client-cert.pem"),
                ("client-key.pem", "client-key.pem"),
            ],
        ),
        rogue: place(
            "rogue-pki",
            &[
                ("ca-cert.pem", "ca-cert.pem"),
                ("rogue-cert.pem", "client-cert.pem"),
                ("rogue-key.pem", "client-key.pem"),
            ],
        ),
        anonymous: place("anonymous-pki", &[("ca-cert.pem", "ca-cert.pem")]),
    }
}

/// vsd serving `image` writable as `disk` on `socket`, TLS required with
/// the server credentials in `pki` (`creds_opts` adds to the object).
fn tls_daemon(dir: &Scratch, image: &Path, socket: &Path, pki: &Path, creds_opts: &str, server_opts: &str) -> Daemon {
    let args = vec![
        "--object".into(),
        format!("tls-creds-x509,id=tls0,dir={},endpoint=server{creds_opts}", pki.display()),
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}", image.display()),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={},tls-creds=tls0{server_opts}", socket.display()),
        "--export".into(),
        "type=nbd,id=e0,node-name=f0,name=disk,writable=on".into(),
    ];
    Daemon::vsd(dir, &args)
}

fn tls_uri(socket: &Path, certificates: &Path) -> String {
    format!("nbds+unix:///disk?socket={}&tls-certificates={}", socket.display(), certificates.display())
}

/// QEMU's client options for the export over TLS; a unix socket has no
/// host name to check the server's certificate against: QEMU wants one.
fn qemu_opts(socket: &Path) -> String {
    let path = socket.display();
    format!("driver=nbd,server.type=unix,server.path={path},export=disk,tls-creds=tls0,tls-hostname=localhost")
}

/// QEMU's client credentials (`extra` adds to them).
fn qemu_creds(pki: &Path, extra: &str) -> String {
    format!("tls-creds-x509,id=tls0,dir={},endpoint=client{extra}", pki.display())
}

#[test]
fn qemu_img_and_qemu_io_read_and_write_over_tls() {
    let dir = Scratch::new("nbd-tls-qemu");
    let pki = make_pki(&dir);
    let image = dir.image("disk.img", 16 * MIB);
    let source = dir.image("source.img", 16 * MIB);
    std::fs::write(&source, pattern(7, 16 * MIB as usize)).unwrap();
    let socket = dir.path("nbd.sock");
    let _daemon = tls_daemon(&dir, &image, &socket, &pki.server, "", "");
    let (creds, opts) = (qemu_creds(&pki.client, ""), qemu_opts(&socket));
    let source_arg = source.to_str().unwrap();
    ok("qemu-img", &["convert", "-n", "--object", &creds, "-f", "raw", source_arg, "--target-image-opts", &opts]);
    ok(
        "qemu-img",
        &["compare", "--object", &creds, "--image-opts", &format!("driver=raw,file.filename={source_arg}"), &opts],
    );
    let out = run(
        "qemu-io",
        &["--object", &creds, "--image-opts", &opts, "-c", "write -P 0x5a 1M 64k", "-c", "read -P 0x5a 1M 64k"],
    );
    assert!(out.status.success() && !text(&out).contains("verification failed"), "{}", text(&out));
    let bytes = std::fs::read(&image).unwrap();
    let mut expected = pattern(7, 16 * MIB as usize);
    expected[MIB as usize..(MIB + (64 << 10)) as usize].fill(0x5a);
    assert!(bytes == expected, "what QEMU wrote over TLS is in the image");
}

#[test]
fn nbdinfo_and_nbdcopy_work_over_tls() {
    let dir = Scratch::new("nbd-tls-libnbd");
    let pki = make_pki(&dir);
    let image = dir.image("disk.img", 16 * MIB);
    let source = dir.image("source.img", 16 * MIB);
    std::fs::write(&source, pattern(9, 16 * MIB as usize)).unwrap();
    let socket = dir.path("nbd.sock");
    let _daemon = tls_daemon(&dir, &image, &socket, &pki.server, "", "");
    let uri = tls_uri(&socket, &pki.client);
    assert_eq!(ok("nbdinfo", &["--size", &uri]).trim(), (16 * MIB).to_string());
    ok("nbdcopy", &[source.to_str().unwrap(), &uri]);
    let back = dir.path("back.img");
    ok("nbdcopy", &[&uri, back.to_str().unwrap()]);
    let sent = std::fs::read(&source).unwrap();
    assert!(std::fs::read(&image).unwrap() == sent, "what nbdcopy wrote is in the image");
    assert!(std::fs::read(&back).unwrap() == sent, "what nbdcopy read is the image");
}

#[test]
fn reads_over_tls_are_never_spliced() {
    // On tmpfs, every page cached: a plain socket would splice these reads.
    let dir = Scratch::new_in(Path::new("/dev/shm"), "nbd-tls-splice");
    let pki = make_pki(&dir);
    let image = dir.path("disk.img");
    let bytes = pattern(11, 8 * MIB as usize);
    std::fs::write(&image, &bytes).unwrap();
    let (socket, log) = (dir.path("nbd.sock"), dir.path("splice.log"));
    let args = vec![
        "--object".into(),
        format!("tls-creds-x509,id=tls0,dir={},endpoint=server", pki.server.display()),
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}", image.display()),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={},tls-creds=tls0", socket.display()),
        "--export".into(),
        "type=nbd,id=e0,node-name=f0,name=disk".into(),
    ];
    let daemon = Daemon::vsd_tracing_splices(&dir, &args, &log);
    let uri = tls_uri(&socket, &pki.client);
    for size in ["65536", "1048576"] {
        let back = dir.path("back.img");
        ok("nbdcopy", &[&format!("--request-size={size}"), &uri, back.to_str().unwrap()]);
        assert!(std::fs::read(&back).unwrap() == bytes, "what nbdcopy read over TLS in {size} is the image");
    }
    daemon.stop_traced();
    let calls = common::splices(&log);
    assert!(calls.is_empty(), "TLS writes records, never raw pages: {calls:?}");
}

#[test]
fn tls_over_tcp_with_the_server_s_name_checked() {
    let dir = Scratch::new("nbd-tls-tcp");
    let pki = make_pki(&dir);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let args = vec![
        "--object".into(),
        format!("tls-creds-x509,id=tls0,dir={},endpoint=server", pki.server.display()),
        "--blockdev".into(),
        "driver=null-co,node-name=n0,size=2097152,read-zeroes=on".into(),
        "--nbd-server".into(),
        format!("addr.type=inet,addr.host=127.0.0.1,addr.port={port},tls-creds=tls0"),
        "--export".into(),
        "type=nbd,id=e0,node-name=n0,name=disk".into(),
    ];
    let _daemon = Daemon::vsd(&dir, &args);
    // Over TCP libnbd checks the host name against the certificate's.
    let uri = format!("nbds://localhost:{port}/disk?tls-certificates={}", pki.client.display());
    assert_eq!(ok("nbdinfo", &["--size", &uri]).trim(), (2 * MIB).to_string());
    let creds = qemu_creds(&pki.client, "");
    let opts =
        format!("driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={port},export=disk,tls-creds=tls0");
    let out = run("qemu-io", &["--object", &creds, "--image-opts", &opts, "-r", "-c", "read -P 0 0 1M"]);
    assert!(out.status.success() && !text(&out).contains("verification failed"), "{}", text(&out));
}

/// A client of the test's own, in the clear: greeting, flags, options.
struct RawClient {
    s: UnixStream,
}

impl RawClient {
    fn greeted(socket: &Path) -> Self {
        let mut s = UnixStream::connect(socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut greeting = [0u8; 18];
        s.read_exact(&mut greeting).unwrap();
        assert_eq!(&greeting[..8], b"NBDMAGIC");
        s.write_all(&3u32.to_be_bytes()).unwrap();
        Self { s }
    }

    fn send_option(&mut self, code: u32, data: &[u8]) {
        let header = [&IHAVEOPT.to_be_bytes()[..], &code.to_be_bytes(), &(data.len() as u32).to_be_bytes()].concat();
        self.s.write_all(&[&header[..], data].concat()).unwrap();
    }

    /// One option reply: (type, data).
    fn reply(&mut self) -> (u32, Vec<u8>) {
        let mut head = [0u8; 20];
        self.s.read_exact(&mut head).unwrap();
        let kind = u32::from_be_bytes(head[12..16].try_into().unwrap());
        let mut body = vec![0; u32::from_be_bytes(head[16..20].try_into().unwrap()) as usize];
        self.s.read_exact(&mut body).unwrap();
        (kind, body)
    }

    /// Whether the server closes the connection within `limit`.
    fn closed_within(&mut self, limit: Duration) -> bool {
        self.s.set_read_timeout(Some(limit)).unwrap();
        match self.s.read_to_end(&mut Vec::new()) {
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
}

#[test]
fn clients_without_tls_or_a_trusted_certificate_are_refused_and_others_served() {
    let dir = Scratch::new("nbd-tls-refused");
    let pki = make_pki(&dir);
    let image = dir.image("disk.img", 16 * MIB);
    let socket = dir.path("nbd.sock");
    let _daemon = tls_daemon(&dir, &image, &socket, &pki.server, "", "");

    let plain = run("nbdinfo", &["--size", &format!("nbd+unix:///disk?socket={}", socket.display())]);
    assert!(!plain.status.success(), "{}", text(&plain));
    assert!(text(&plain).contains("TLS"), "nbdinfo says TLS is required: {}", text(&plain));

    // Every option but STARTTLS and ABORT gets NBD_REP_ERR_TLS_REQD; the
    // client may go on, as QEMU lets it.
    let mut raw = RawClient::greeted(&socket);
    let go = [&4u32.to_be_bytes()[..], b"disk", &0u16.to_be_bytes()].concat();
    for (code, data) in [(OPT_GO, &go[..]), (OPT_LIST, &[][..])] {
        raw.send_option(code, data);
        let (kind, message) = raw.reply();
        assert_eq!(kind, REP_ERR_TLS_REQD, "option {code}");
        assert_eq!(String::from_utf8_lossy(&message), format!("Option {code:#x} not permitted before TLS"));
    }
    // EXPORT_NAME has no error reply: the connection is closed.
    raw.send_option(OPT_EXPORT_NAME, b"disk");
    assert!(raw.closed_within(Duration::from_secs(5)), "closed on EXPORT_NAME before TLS");

    for (who, certificates) in [("another CA's certificate", &pki.rogue), ("no certificate", &pki.anonymous)] {
        let out = run("nbdinfo", &["--size", &tls_uri(&socket, certificates)]);
        assert!(!out.status.success(), "a client with {who} is refused: {}", text(&out));
    }
    assert_eq!(ok("nbdinfo", &["--size", &tls_uri(&socket, &pki.client)]).trim(), (16 * MIB).to_string());
    // QEMU checks its own certificate against the CA unless told not to:
    // without that, the refusal is the server's.
    let rogue = qemu_creds(&pki.rogue, ",sanity-check=off");
    let out = run("qemu-io", &["--object", &rogue, "--image-opts", &qemu_opts(&socket), "-c", "read 0 4k"]);
    assert!(!out.status.success(), "QEMU with another CA's certificate is refused: {}", text(&out));

    // verify-peer=off: any client that trusts the server gets in.
    let open = Scratch::new("nbd-tls-open");
    let open_socket = open.path("nbd.sock");
    let _open = tls_daemon(&open, &open.image("disk.img", MIB), &open_socket, &pki.server, ",verify-peer=off", "");
    assert_eq!(ok("nbdinfo", &["--size", &tls_uri(&open_socket, &pki.anonymous)]).trim(), MIB.to_string());
}

/// Starts TLS as a rustls client with `client`'s certificate, trusting
/// `ca`'s CA, sends LIST and returns its first reply's header.
/// A rustls client session trusting `ca`'s CA, with `client`'s certificate.
fn rustls_client(ca: &Path, client: &Path) -> rustls::ClientConnection {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_file(ca.join("ca-cert.pem")).unwrap()).unwrap();
    let chain = vec![CertificateDer::from_pem_file(client.join("client-cert.pem")).unwrap()];
    let key = PrivateKeyDer::from_pem_file(client.join("client-key.pem")).unwrap();
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
    let name = "localhost".try_into().unwrap();
    rustls::ClientConnection::new(std::sync::Arc::new(config), name).unwrap()
}

fn rustls_client_listing(socket: &Path, ca: &Path, client: &Path) -> std::io::Result<Vec<u8>> {
    let mut tls = rustls_client(ca, client);
    let mut raw = RawClient::greeted(socket);
    raw.send_option(OPT_STARTTLS, &[]);
    assert_eq!(raw.reply().0, REP_ACK);
    let list = [&IHAVEOPT.to_be_bytes()[..], &OPT_LIST.to_be_bytes(), &0u32.to_be_bytes()].concat();
    let exchange = |stream: &mut rustls::Stream<rustls::ClientConnection, UnixStream>| -> std::io::Result<Vec<u8>> {
        stream.write_all(&list)?;
        let mut reply = vec![0; 20];
        stream.read_exact(&mut reply)?;
        Ok(reply)
    };
    let result = exchange(&mut rustls::Stream::new(&mut tls, &mut raw.s));
    if let Err(e) = &result
        && e.kind() != std::io::ErrorKind::InvalidData
    {
        // A server that refused the certificate may be gone before the
        // request went out, its alert not read yet: a write, or the write
        // rustls retries before reading, fails with Broken pipe. Read it.
        while tls.read_tls(&mut raw.s).is_ok_and(|n| n > 0) {
            if let Err(alert) = tls.process_new_packets() {
                return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, alert));
            }
        }
    }
    result
}

#[test]
fn the_server_checks_a_client_certificate_it_is_sent() {
    let dir = Scratch::new("nbd-tls-verify");
    let pki = make_pki(&dir);
    let socket = dir.path("nbd.sock");
    let _daemon = tls_daemon(&dir, &dir.image("disk.img", MIB), &socket, &pki.server, "", "");
    // The server names the CA it trusts; GnuTLS's clients then keep a
    // certificate another CA signed. rustls's send it anyway.
    let refused = rustls_client_listing(&socket, &pki.client, &pki.rogue);
    let error = refused.expect_err("a certificate another CA signed is refused").to_string();
    assert!(error.contains("UnknownCA"), "the server's alert: {error}");
    let reply = rustls_client_listing(&socket, &pki.client, &pki.client).expect("the CA's client is served");
    assert_eq!(u32::from_be_bytes(reply[12..16].try_into().unwrap()), 2, "NBD_REP_SERVER over TLS");
}

#[test]
fn a_client_stalling_in_the_tls_handshake_is_cut_by_the_handshake_timeout() {
    let dir = Scratch::new("nbd-tls-stall");
    let pki = make_pki(&dir);
    let image = dir.image("disk.img", 16 * MIB);
    let socket = dir.path("nbd.sock");
    let _daemon = tls_daemon(&dir, &image, &socket, &pki.server, "", ",max-connections=2,handshake-max-seconds=2");
    // Both slots taken by clients that start TLS and send half a ClientHello.
    let mut stalled: Vec<RawClient> = (0..2)
        .map(|_| {
            let mut client = RawClient::greeted(&socket);
            client.send_option(OPT_STARTTLS, &[]);
            assert_eq!(client.reply().0, REP_ACK);
            client.s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01]).unwrap();
            client
        })
        .collect();
    let started = Instant::now();
    let out = run("timeout", &["30", "nbdinfo", "--size", &tls_uri(&socket, &pki.client)]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), (16 * MIB).to_string(), "{}", text(&out));
    assert!(started.elapsed() < Duration::from_secs(12), "a real client got through after {:?}", started.elapsed());
    for client in &mut stalled {
        assert!(client.closed_within(Duration::from_secs(10)), "the stalled client was cut");
    }
}

/// A client that starts TLS and stops half-way through its ClientHello.
fn stalled_in_tls(socket: &Path) -> RawClient {
    let mut client = RawClient::greeted(socket);
    client.send_option(OPT_STARTTLS, &[]);
    assert_eq!(client.reply().0, REP_ACK);
    client.s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01]).unwrap();
    client
}

#[test]
fn stalled_tls_handshakes_neither_keep_a_real_client_out_nor_drop_an_established_one() {
    let dir = Scratch::new("nbd-tls-flood");
    let pki = make_pki(&dir);
    let image = dir.image("disk.img", 16 * MIB);
    let socket = dir.path("nbd.sock");
    let _daemon = tls_daemon(&dir, &image, &socket, &pki.server, "", "");
    let mut raw = RawClient::greeted(&socket);
    raw.send_option(OPT_STARTTLS, &[]);
    assert_eq!(raw.reply().0, REP_ACK);
    let mut served = rustls::StreamOwned::new(rustls_client(&pki.client, &pki.client), raw.s);
    nbd::go(&mut served, "disk");
    assert!(nbd::reads(&mut served, 1), "served over TLS before the flood");
    // More than max-connections (100), each inside its TLS handshake.
    let (creds, opts) = (qemu_creds(&pki.client, ""), qemu_opts(&socket));
    let client = ["qemu-img", "info", "--object", &creds, "--image-opts", &opts];
    let _stalled = nbd::flood_then_connect(300, || stalled_in_tls(&socket), &client, 3);
    assert!(nbd::reads(&mut served, 2), "the established TLS connection is still served");
}

#[test]
fn qmp_adds_credentials_starts_the_server_with_them_and_keeps_them_while_used() {
    let dir = Scratch::new("nbd-tls-qmp");
    let pki = make_pki(&dir);
    let image = dir.image("disk.img", 4 * MIB);
    let (qmp_socket, nbd_socket) = (dir.path("qmp.sock"), dir.path("nbd.sock"));
    let args = vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}", image.display()),
        "--chardev".into(),
        format!("socket,id=m,path={},server=on,wait=off", qmp_socket.display()),
        "--monitor".into(),
        "chardev=m".into(),
    ];
    let _daemon = Daemon::vsd(&dir, &args);
    let mut qmp = QmpClient::connect(&qmp_socket).unwrap();
    let mut refused = |args: Value| qmp.execute("object-add", args).unwrap_err().to_string();
    let missing = dir.path("nowhere");
    let error = refused(json!({"qom-type": "tls-creds-x509", "id": "t", "dir": missing, "endpoint": "server"}));
    assert!(error.contains(&format!("Unable to access credentials {}/ca-cert.pem", missing.display())), "{error}");
    let error = refused(json!({"qom-type": "tls-creds-x509", "id": "t", "endpoint": "server"}));
    assert!(error.contains("Missing 'dir' property value"), "{error}");
    let error = refused(json!({"qom-type": "tls-creds-x509", "id": "t", "dir": pki.client, "endpoint": "server"}));
    assert!(error.contains("server-cert.pem"), "a client's directory has no server certificate: {error}");

    let creds = json!({"qom-type": "tls-creds-x509", "id": "tls0", "dir": pki.server, "endpoint": "server"});
    qmp.execute("object-add", creds).unwrap();
    let addr = json!({"type": "unix", "data": {"path": nbd_socket}});
    let error = qmp.execute("nbd-server-start", json!({"addr": addr, "tls-creds": "nope"})).unwrap_err().to_string();
    assert!(error.contains("No TLS credentials with id 'nope'"), "{error}");
    let client = json!({"qom-type": "tls-creds-x509", "id": "c0", "dir": pki.client, "endpoint": "client"});
    qmp.execute("object-add", client).unwrap();
    let error = qmp.execute("nbd-server-start", json!({"addr": addr, "tls-creds": "c0"})).unwrap_err().to_string();
    assert!(error.contains("Expecting TLS credentials with a server endpoint"), "{error}");
    qmp.execute("nbd-server-start", json!({"addr": addr, "tls-creds": "tls0"})).unwrap();
    qmp.execute("block-export-add", json!({"type": "nbd", "id": "e0", "node-name": "f0", "name": "disk"})).unwrap();
    assert_eq!(ok("nbdinfo", &["--size", &tls_uri(&nbd_socket, &pki.client)]).trim(), (4 * MIB).to_string());
    let plain = run("nbdinfo", &["--size", &format!("nbd+unix:///disk?socket={}", nbd_socket.display())]);
    assert!(!plain.status.success(), "{}", text(&plain));

    let busy = qmp.execute("object-del", json!({"id": "tls0"})).unwrap_err().to_string();
    assert!(busy.contains("object 'tls0' is in use, can not be deleted"), "{busy}");
    qmp.execute("nbd-server-stop", Value::Null).unwrap();
    qmp.execute("object-del", json!({"id": "tls0"})).unwrap();
}

#[test]
fn command_line_tls_mistakes_are_one_line_errors_and_leave_no_socket() {
    let dir = Scratch::new("nbd-tls-cli");
    let pki = make_pki(&dir);
    let socket = dir.path("nbd.sock");
    let no_key = dir.path("no-key");
    std::fs::create_dir_all(&no_key).unwrap();
    for file in ["ca-cert.pem", "server-cert.pem"] {
        std::fs::copy(pki.server.join(file), no_key.join(file)).unwrap();
    }
    let server = format!("addr.type=unix,addr.path={},tls-creds=tls0", socket.display());
    let creds =
        |dir: &Path, extra: &str| format!("tls-creds-x509,id=tls0,dir={},endpoint=server{extra}", dir.display());
    let key_path = format!("Unable to access credentials {}/server-key.pem", no_key.display());
    let cases: Vec<(String, String, &str)> = vec![
        (creds(&dir.path("nowhere"), ""), server.clone(), "Unable to access credentials"),
        (creds(&no_key, ""), server.clone(), &key_path),
        (creds(&pki.server, ",priority=NORMAL"), server.clone(), "'priority' is not supported"),
        (creds(&pki.server, ",passwordid=s0"), server.clone(), "'passwordid' is not supported"),
        (creds(&pki.server, ",sanity-check=on"), server.clone(), "sanity-check=on is not supported"),
        (creds(&pki.server, ""), format!("{server},tls-authz=authz0"), "tls-authz"),
        ("secret,id=tls0,data=x".into(), server.clone(), "Object with id 'tls0' is not TLS credentials"),
    ];
    for (object, nbd_server, culprit) in &cases {
        let args = ["--object", object, "--blockdev", "driver=null-co,node-name=n0", "--nbd-server", nbd_server];
        let stderr = common::vsd_fails(&args);
        assert!(stderr.contains(culprit), "{args:?}: expected '{culprit}' in {stderr}");
        assert!(!socket.exists(), "{args:?} left its socket behind");
    }
}

/// vsd's client (`driver=nbd,tls-creds=...`) over TLS: to
/// qemu-storage-daemon's server on a unix socket (no name to check, as
/// QEMU's client does without `tls-hostname`), and to vsd's server over
/// TCP with the name checked; a libblkio client's writes through it land
/// in the remote image.
#[test]
fn vsd_s_client_speaks_tls_to_qemu_storage_daemon_and_to_vsd() {
    let dir = Scratch::new("nbd-tls-client");
    let pki = make_pki(&dir);
    let image = dir.image("remote.img", 8 * MIB);
    let qsd_socket = dir.path("qsd.sock");
    let _qsd = Daemon::qsd(
        &dir,
        &[
            "--object".into(),
            format!("tls-creds-x509,id=tls0,dir={},endpoint=server", pki.server.display()),
            "--blockdev".into(),
            format!("driver=file,node-name=f0,filename={}", image.display()),
            "--nbd-server".into(),
            format!("addr.type=unix,addr.path={},tls-creds=tls0", qsd_socket.display()),
            "--export".into(),
            "type=nbd,id=e0,node-name=f0,name=disk,writable=on".into(),
        ],
    );
    let through = |dir: &Scratch, node: String| {
        let vhost = dir.path("vhost.sock");
        let export =
            format!("type=vhost-user-blk,id=v0,node-name=d0,addr.type=unix,addr.path={},writable=on", vhost.display());
        let args = [
            "--object".into(),
            format!("tls-creds-x509,id=c0,dir={},endpoint=client", pki.client.display()),
            "--blockdev".into(),
            node,
            "--blockdev".into(),
            "driver=raw,node-name=d0,file=n0".into(),
            "--export".into(),
            export,
        ];
        Daemon::vsd(dir, &args)
    };
    let node = format!(
        "driver=nbd,node-name=n0,server.type=unix,server.path={},export=disk,tls-creds=c0",
        qsd_socket.display()
    );
    let here = Scratch::new("nbd-tls-client-a");
    let vsd = through(&here, node);
    let mut client = vsd.connect(vsd_bench::ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    queue.write_at(MIB, &pattern(3, 65536)).unwrap();
    queue.flush().unwrap();
    drop((queue, client, vsd));
    assert_eq!(std::fs::read(&image).unwrap()[MIB as usize..][..65536], pattern(3, 65536)[..]);

    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let far = Scratch::new("nbd-tls-client-far");
    let far_image = far.image("far.img", 4 * MIB);
    let _server = Daemon::vsd(
        &far,
        &[
            "--object".into(),
            format!("tls-creds-x509,id=tls0,dir={},endpoint=server", pki.server.display()),
            "--blockdev".into(),
            format!("driver=file,node-name=f0,filename={}", far_image.display()),
            "--nbd-server".into(),
            format!("addr.type=inet,addr.host=127.0.0.1,addr.port={port},tls-creds=tls0"),
            "--export".into(),
            "type=nbd,id=e0,node-name=f0,name=disk,writable=on".into(),
        ],
    );
    let node = format!(
        "driver=nbd,node-name=n0,server.type=inet,server.host=127.0.0.1,server.port={port},export=disk,tls-creds=c0"
    );
    let here = Scratch::new("nbd-tls-client-b");
    let vsd = through(&here, node);
    let mut client = vsd.connect(vsd_bench::ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    queue.write_at(2 * MIB, &pattern(4, 4096)).unwrap();
    let mut back = vec![0; 4096];
    queue.read_at(2 * MIB, &mut back).unwrap();
    assert_eq!(back, pattern(4, 4096));
    queue.flush().unwrap();
    drop((queue, client, vsd));
    assert_eq!(std::fs::read(&far_image).unwrap()[2 * MIB as usize..][..4096], pattern(4, 4096)[..]);
}

/// What vsd's client refuses: a TLS server without `tls-creds`, a server
/// whose certificate another CA signed, a name the certificate does not
/// hold, no client certificate for a server that wants one, and server
/// credentials given to a client: one line each.
#[test]
fn vsd_s_client_refuses_what_tls_does_not_allow() {
    let dir = Scratch::new("nbd-tls-client-refusals");
    let pki = make_pki(&dir);
    let image = dir.image("remote.img", MIB);
    let socket = dir.path("nbd.sock");
    let _server = tls_daemon(&dir, &image, &socket, &pki.server, "", "");
    let wrong_ca = dir.path("wrong-ca-pki");
    std::fs::create_dir_all(&wrong_ca).unwrap();
    std::fs::copy(dir.path("pki").join("other-ca-cert.pem"), wrong_ca.join("ca-cert.pem")).unwrap();
    let node = |extra: &str| {
        format!("driver=nbd,node-name=n0,server.type=unix,server.path={},export=disk{extra}", socket.display())
    };
    let with = |creds: &Path, endpoint: &str, extra: &str| {
        common::vsd_fails(&[
            "--object".into(),
            format!("tls-creds-x509,id=c0,dir={},endpoint={endpoint}", creds.display()),
            "--blockdev".into(),
            node(&format!(",tls-creds=c0{extra}")),
        ])
    };
    let refused = common::vsd_fails(&["--blockdev", &node("")]);
    assert!(refused.contains("Server requires TLS"), "{refused}");
    let refused = with(&wrong_ca, "client", "");
    assert!(refused.contains("TLS with the server failed") && refused.contains("UnknownIssuer"), "{refused}");
    let refused = with(&pki.client, "client", ",tls-hostname=elsewhere.example");
    assert!(refused.contains("TLS with the server failed") && refused.contains("not valid for name"), "{refused}");
    let refused = with(&pki.anonymous, "client", "");
    assert!(refused.contains("TLS with the server failed"), "no client certificate: {refused}");
    let refused = with(&pki.server, "server", "");
    assert!(refused.contains("Expecting TLS credentials with a client endpoint"), "{refused}");
    // The right credentials get through.
    let args = [
        "--object".into(),
        format!("tls-creds-x509,id=c0,dir={},endpoint=client", pki.client.display()),
        "--blockdev".into(),
        node(",tls-creds=c0,tls-hostname=localhost"),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", dir.path("again.sock").display()),
        "--export".into(),
        "type=nbd,id=x0,node-name=n0,name=again".into(),
    ];
    let _vsd = Daemon::vsd(&dir, &args);
    let uri = format!("nbd+unix:///again?socket={}", dir.path("again.sock").display());
    assert_eq!(ok("nbdinfo", &["--size", &uri]).trim(), MIB.to_string());
}
