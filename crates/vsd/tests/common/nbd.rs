//! A minimal NBD client of the tests' own over any stream (a unix or TCP
//! socket, TLS over one), and the flood the handshake limits are proven
//! with: idle connections, then a real client that must get through.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;

/// Reads the server's greeting and answers with fixed newstyle, no zeroes.
pub fn greet(s: &mut impl ReadWrite) {
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).unwrap();
    assert_eq!(&greeting[..8], b"NBDMAGIC");
    s.write_all(&3u32.to_be_bytes()).unwrap();
}

/// Sends an option header announcing `len` bytes, and `data`.
pub fn send_option(s: &mut impl ReadWrite, code: u32, len: u32, data: &[u8]) {
    let header = [&IHAVEOPT.to_be_bytes()[..], &code.to_be_bytes(), &len.to_be_bytes()].concat();
    s.write_all(&[&header[..], data].concat()).unwrap();
}

/// One option reply: (type, data).
pub fn reply(s: &mut impl ReadWrite) -> (u32, Vec<u8>) {
    let mut head = [0u8; 20];
    s.read_exact(&mut head).unwrap();
    let kind = u32::from_be_bytes(head[12..16].try_into().unwrap());
    let mut body = vec![0; u32::from_be_bytes(head[16..20].try_into().unwrap()) as usize];
    s.read_exact(&mut body).unwrap();
    (kind, body)
}

/// NBD_OPT_GO for `export`, up to its ACK: the transmission phase, simple
/// replies.
pub fn go(s: &mut impl ReadWrite, export: &str) {
    let data = [&(export.len() as u32).to_be_bytes()[..], export.as_bytes(), &0u16.to_be_bytes()].concat();
    send_option(s, OPT_GO, data.len() as u32, &data);
    // NBD_REP_INFO replies come before the ACK.
    let last = std::iter::repeat_with(|| reply(s).0).find(|&kind| kind != 3);
    assert_eq!(last, Some(REP_ACK), "GO acknowledged");
}

/// Reads 4 KiB at 0 in the transmission phase: whether it succeeded.
pub fn reads(s: &mut impl ReadWrite, cookie: u64) -> bool {
    let request = [
        &0x2560_9513u32.to_be_bytes()[..],
        &0u16.to_be_bytes(),
        &0u16.to_be_bytes(),
        &cookie.to_be_bytes(),
        &0u64.to_be_bytes(),
        &4096u32.to_be_bytes(),
    ]
    .concat();
    let mut reply = [0u8; 16 + 4096];
    s.write_all(&request).is_ok()
        && s.read_exact(&mut reply).is_ok()
        && reply[4..8] == [0; 4]
        && reply[8..16] == cookie.to_be_bytes()
}

/// Opens `count` connections with `open` (each left idle wherever `open`
/// stops), then runs the real client `client` `rounds` times: each must
/// succeed within `limit`. Returns the idle connections.
pub fn flood_then_connect<S>(count: usize, open: impl Fn() -> S, client: &[&str], rounds: usize) -> Vec<S> {
    let idle: Vec<S> = (0..count).map(|_| open()).collect();
    for round in 0..rounds {
        let started = Instant::now();
        let out = super::run("timeout", &[&["30"], client].concat());
        let took = started.elapsed();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "round {round}: {client:?} failed after {took:?}: {text}");
        assert!(took < Duration::from_secs(5), "round {round}: {client:?} took {took:?} behind {count} idle clients");
    }
    idle
}

/// A stream the client speaks over.
pub trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}
