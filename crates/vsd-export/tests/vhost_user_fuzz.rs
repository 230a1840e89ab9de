//! The vhost-user message sequences of the fuzz target
//! `vhost_user_messages`, replayed through the same decoder
//! (`vsd_export::fuzzing::run`): that its inputs reach what they are meant
//! to (running queue workers, the checks on what a front-end claims), and
//! the inputs the fuzzer found.

use vsd_export::fuzzing::{self, GUEST_SIZE, Outcome, USER_BASE};

// Request codes.
const GET_FEATURES: u8 = 1;
const SET_FEATURES: u8 = 2;
const SET_OWNER: u8 = 3;
const SET_MEM_TABLE: u8 = 5;
const SET_VRING_NUM: u8 = 8;
const GET_VRING_BASE: u8 = 11;
const GET_PROTOCOL_FEATURES: u8 = 15;
const SET_PROTOCOL_FEATURES: u8 = 16;
const GET_CONFIG: u8 = 24;
const ADD_MEM_REG: u8 = 37;

/// A message operation in the decoder's format: true size, flags version 1.
fn message(code: u8, fds: &[Vec<u8>], body: &[u8]) -> Vec<u8> {
    let mut op = vec![0, code, (fds.len() as u8) << 5];
    for fd in fds {
        op.extend_from_slice(fd);
    }
    op.extend_from_slice(&(body.len() as u16).to_le_bytes());
    op.extend_from_slice(body);
    op
}

/// The same with a size field that says `size`.
fn message_sized(code: u8, size: u32, body: &[u8]) -> Vec<u8> {
    let mut op = vec![0, code, 2 << 3];
    op.extend_from_slice(&size.to_le_bytes());
    op.extend_from_slice(&(body.len() as u16).to_le_bytes());
    op.extend_from_slice(body);
    op
}

fn memfd(size: u32) -> Vec<u8> {
    let mut spec = vec![0];
    spec.extend_from_slice(&size.to_le_bytes());
    spec.extend_from_slice(&0u16.to_le_bytes());
    spec
}

fn le(values: &[u64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Features and protocol features agreed (all the back-end offers).
fn negotiated() -> Vec<u8> {
    let protocol: u64 = (1 << 0) | (1 << 3) | (1 << 5) | (1 << 9) | (1 << 12) | (1 << 15);
    let features: u64 = (1 << 32) | (1 << 29) | (1 << 28) | (1 << 30) | (1 << 9) | (1 << 1) | (1 << 2);
    let mut input = vec![0, 0];
    input.extend(message(GET_FEATURES, &[], &[]));
    input.extend(message(GET_PROTOCOL_FEATURES, &[], &[]));
    input.extend(message(SET_PROTOCOL_FEATURES, &[], &le(&[protocol])));
    input.extend(message(SET_OWNER, &[], &[]));
    input.extend(message(SET_FEATURES, &[], &le(&[features])));
    input
}

fn run(input: &[u8]) -> Outcome {
    let outcome = fuzzing::run(input);
    eprintln!("{outcome:?}");
    outcome
}

#[test]
fn the_prefix_starts_every_ring_and_its_requests_are_served() {
    // Prefix 4, two queues of 16 with four requests each.
    let outcome = run(&[0x80 | 1, 0x80 | 3]);
    assert_eq!(outcome.sent, outcome.handled, "{outcome:?}");
    assert_eq!(outcome.requests, 8);
    // Again with the inflight region, then without PROTOCOL_FEATURES, then
    // with a reply asked for every message.
    for prefix in [5u8, 6, 7] {
        let outcome = run(&[prefix << 5, 0x80 | 3]);
        assert_eq!(outcome.sent, outcome.handled, "prefix {prefix}: {outcome:?}");
        assert_eq!(outcome.requests, 4, "prefix {prefix}");
    }
    assert_eq!(run(&[5 << 5, 3]).fds_received, 1, "GET_INFLIGHT_FD hands a region over");
}

#[test]
fn stopping_a_ring_returns_where_its_worker_got_to() {
    let mut input = vec![0x80, 0x80 | 3];
    input.extend(message(GET_VRING_BASE, &[], &[0; 8]));
    // And a ring that does not exist.
    input.extend(message(GET_VRING_BASE, &[], &[9, 0, 0, 0, 0, 0, 0, 0]));
    let outcome = run(&input);
    assert_eq!(outcome.codes.last(), Some(&u32::from(GET_VRING_BASE)));
    assert_eq!(outcome.requests, 4);
    assert!(outcome.error.is_some_and(|e| e.contains("invalid parameters")));
}

#[test]
fn a_memory_region_larger_than_its_file_is_refused() {
    // 4 KiB of memfd for a 1 MiB region: touching the rest would be SIGBUS.
    let mut input = negotiated();
    let mut table = vec![1, 0, 0, 0, 0, 0, 0, 0];
    table.extend(le(&[0, 1 << 20, USER_BASE, 0]));
    input.extend(message(SET_MEM_TABLE, &[memfd(4096)], &table));
    let outcome = run(&input);
    assert!(outcome.error.is_some_and(|e| e.contains("runs past its file")));

    // The same with ADD_MEM_REG, after a table that fits; and at an offset.
    for (offset, size) in [(0, GUEST_SIZE + 4096), (4096, GUEST_SIZE)] {
        let mut input = negotiated();
        let mut table = vec![1, 0, 0, 0, 0, 0, 0, 0];
        table.extend(le(&[0, GUEST_SIZE, USER_BASE, 0]));
        input.extend(message(SET_MEM_TABLE, &[memfd(GUEST_SIZE as u32)], &table));
        let region = le(&[0, 1 << 30, size, USER_BASE + (1 << 30), offset]);
        input.extend(message(ADD_MEM_REG, &[memfd(GUEST_SIZE as u32)], &region));
        let outcome = run(&input);
        assert_eq!(outcome.codes.last(), Some(&u32::from(SET_MEM_TABLE)), "{outcome:?}");
        assert!(outcome.error.is_some_and(|e| e.contains("runs past its file")));
    }
}

#[test]
fn sizes_that_lie_end_the_connection() {
    // Claims 16 bytes for an 8-byte body: the next message's header is
    // read as the rest of it.
    let mut input = negotiated();
    input.extend(message_sized(SET_VRING_NUM, 16, &[0, 0, 0, 0, 8, 0, 0, 0]));
    input.extend(message(GET_CONFIG, &[], &[0; 12]));
    let outcome = run(&input);
    assert_eq!(outcome.handled, 5);
    assert!(outcome.error.is_some());

    // Claims more than vhost-user allows; and more than is ever sent.
    for size in [u32::MAX, 4096] {
        let mut input = negotiated();
        input.extend(message_sized(SET_VRING_NUM, size, &[0, 0, 0, 0, 8, 0, 0, 0]));
        let outcome = run(&input);
        assert_eq!(outcome.handled, 5);
        assert!(outcome.error.is_some());
    }
}

#[test]
fn the_seeds_replay() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/vhost_user_messages");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).expect("seeds") {
        let path = entry.expect("seed").path();
        eprintln!("{}", path.display());
        run(&std::fs::read(&path).expect("seed"));
        seen += 1;
    }
    assert!(seen > 0);
}

/// Runs `input` on a thread of its own; `None` if it has not ended after
/// `seconds` (the thread is left behind).
fn run_within(input: Vec<u8>, seconds: u64) -> Option<Outcome> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(fuzzing::run(&input));
    });
    rx.recv_timeout(std::time::Duration::from_secs(seconds)).ok()
}

#[test]
fn a_front_end_that_blocks_its_call_eventfd_cannot_hang_the_connection() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/vhost_user_messages/blocked-call.bin");
    let outcome = run_within(std::fs::read(path).expect("seed"), 8).expect("the connection hangs");
    eprintln!("{outcome:?}");
}
