//! NBD handshakes no client can stall, over unix and TCP sockets (TLS:
//! nbd_tls.rs): an option announced longer than its type allows is
//! answered at once and the connection closed; hundreds of idle
//! connections, more than `max-connections` (its default), neither keep a
//! real client (qemu-img) out nor get a connection past its handshake
//! dropped.

mod common;

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use common::nbd::{flood_then_connect, go, greet, reads, reply, send_option};
use common::{Daemon, Scratch};

const MIB: u64 = 1 << 20;
const REP_ERR_INVALID: u32 = (1 << 31) + 3;
const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

/// vsd serving a 16 MiB file as `disk` on `--nbd-server ADDR` (defaults
/// otherwise).
fn server(dir: &Scratch, addr: &str) -> Daemon {
    let image = dir.image("disk.img", 16 * MIB);
    let args = vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={}", image.display()),
        "--nbd-server".into(),
        addr.into(),
        "--export".into(),
        "type=nbd,id=e0,node-name=f0,name=disk".into(),
    ];
    Daemon::vsd(dir, &args)
}

fn unix_server(dir: &Scratch, socket: &Path) -> Daemon {
    server(dir, &format!("addr.type=unix,addr.path={}", socket.display()))
}

/// Whether the server has closed `s` (it reads the end, or a reset).
fn closed(s: &mut UnixStream) -> bool {
    match s.read_to_end(&mut Vec::new()) {
        Ok(_) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

#[test]
fn an_option_longer_than_its_type_allows_is_answered_and_closed_at_once() {
    let dir = Scratch::new("nbd-flood-long");
    let socket = dir.path("nbd.sock");
    let _daemon = unix_server(&dir, &socket);
    // (option, length announced, the reply): LIST takes no data, GO's
    // name and information requests fit 135172 bytes, SET_META_CONTEXT's
    // name and queries 69704, an unknown option's 64 KiB; EXPORT_NAME has
    // no error reply.
    for (code, len, answer) in [
        (3, 1 << 31, Some(REP_ERR_INVALID)),
        (3, 1, Some(REP_ERR_INVALID)),
        (7, (1 << 31) - 1, Some(REP_ERR_TOO_BIG)),
        (7, 135_173, Some(REP_ERR_TOO_BIG)),
        (10, 1 << 20, Some(REP_ERR_TOO_BIG)),
        (0x4242, 1 << 30, Some(REP_ERR_TOO_BIG)),
        (1, 4097, None),
    ] {
        let mut s = UnixStream::connect(&socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        greet(&mut s);
        let started = Instant::now();
        send_option(&mut s, code, len, b"abc");
        if let Some(kind) = answer {
            let (got, message) = reply(&mut s);
            let message = String::from_utf8_lossy(&message);
            assert_eq!(got, kind, "option {code:#x} of {len} bytes: {message}");
            assert!(message.contains(&format!("len ({len}) is larger than max len")), "{message}");
        }
        assert!(closed(&mut s), "option {code:#x} of {len} bytes: closed");
        let took = started.elapsed();
        assert!(took < Duration::from_secs(1), "option {code:#x} of {len} bytes: answered after {took:?}");
    }
}

/// A client past its handshake, reading: it must outlive any flood.
fn established<S: common::nbd::ReadWrite>(mut s: S) -> S {
    greet(&mut s);
    go(&mut s, "disk");
    assert!(reads(&mut s, 1), "served before the flood");
    s
}

#[test]
fn idle_unix_connections_neither_keep_a_real_client_out_nor_drop_an_established_one() {
    let dir = Scratch::new("nbd-flood-unix");
    let socket = dir.path("nbd.sock");
    let mut daemon = unix_server(&dir, &socket);
    let mut served = established(UnixStream::connect(&socket).unwrap());
    let uri = format!("nbd+unix:///disk?socket={}", socket.display());
    let idle = flood_then_connect(300, || UnixStream::connect(&socket).unwrap(), &["qemu-img", "info", &uri], 3);
    assert!(reads(&mut served, 2), "the established connection is still served");
    drop(idle);
    assert!(daemon.is_running());
}

#[test]
fn idle_tcp_connections_neither_keep_a_real_client_out_nor_drop_an_established_one() {
    let dir = Scratch::new("nbd-flood-tcp");
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let _daemon = server(&dir, &format!("addr.type=inet,addr.host=127.0.0.1,addr.port={port}"));
    let mut served = established(TcpStream::connect(("127.0.0.1", port)).unwrap());
    let uri = format!("nbd://127.0.0.1:{port}/disk");
    let open = || TcpStream::connect(("127.0.0.1", port)).unwrap();
    let _idle = flood_then_connect(300, open, &["qemu-img", "info", &uri], 3);
    assert!(reads(&mut served, 2), "the established connection is still served");
}
