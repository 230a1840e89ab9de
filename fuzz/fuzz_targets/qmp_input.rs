//! A QMP client's bytes, read by the monitor in chunks of any size: the
//! JSON streamer, capabilities negotiation, command checks and dispatch,
//! as a connection runs them (`vsd_control::qmp::fuzzing::Connection`).
//!
//! The first byte picks one of two modes:
//!
//! - raw: the rest of the input is what the client sends. The monitor must
//!   not panic, must hold at most one message's worth of input (the limit
//!   is made small at times so that short inputs reach it), must answer
//!   with well-formed replies, and must split the input the same way
//!   however it is chunked, up to the first error (after an error, how
//!   much is skipped depends on what was buffered, by design);
//! - commands: the input describes a session, well-formed commands (each
//!   with an id of its own) mixed with garbage lines, each ended by a
//!   control character and a newline, which the QMP spec promises brings
//!   the parser back to a known-good state. Every command must get exactly
//!   one reply, in order, with its id, and the reply QEMU would give.
//!
//! In both, the dispatcher must run only after negotiation, and hear of
//! every successful reply once.

#![no_main]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use libfuzzer_sys::arbitrary::{Result as ArbResult, Unstructured};
use libfuzzer_sys::fuzz_target;
use serde_json::{Map, Number, Value, json};
use vsd_control::qmp::fuzzing::{Connection, MAX_VALUE_LEN, READ_SIZE};
use vsd_control::qmp::{Dispatch, ErrorClass, QmpError};

/// `VSD_FUZZ_DEBUG=1` prints every reply (to check seeds).
static DEBUG: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Answers a few commands and counts what it is asked.
#[derive(Default)]
struct Dispatcher {
    executed: AtomicUsize,
    succeeded: AtomicUsize,
    after_reply: AtomicUsize,
}

impl Dispatch for Dispatcher {
    fn execute(&self, command: &str, arguments: Map<String, Value>) -> Result<Value, QmpError> {
        self.executed.fetch_add(1, Ordering::Relaxed);
        let result = match command {
            "echo" => Ok(Value::Object(arguments)),
            "nothing" => Ok(Value::Null),
            "query-version" => Ok(json!({"qemu": {"major": 0, "minor": 1, "micro": 0}, "package": "fuzz"})),
            "fail" => Err(QmpError::new(ErrorClass::DeviceNotFound, "Device 'nope' not found")),
            _ => Err(QmpError::new(ErrorClass::CommandNotFound, format!("The command {command} has not been found"))),
        };
        if result.is_ok() {
            self.succeeded.fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    fn after_reply(&self, _command: &str) {
        self.after_reply.fetch_add(1, Ordering::Relaxed);
    }
}

/// Command names the sessions use: the dispatcher's, one it does not
/// know, and the monitor's own.
const NAMES: [&str; 6] = ["qmp_capabilities", "echo", "nothing", "query-version", "fail", "no-such-command"];

/// Bytes a client may send to bring the parser back to a known-good state.
const RESYNC: [u8; 4] = [0x04, 0x00, 0x1b, 0xff];

/// A small deterministic generator for chunk sizes, so that chunking is
/// independent of the bytes sent.
struct Chunks(u64);

impl Chunks {
    fn next_len(&mut self, rest: usize) -> usize {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        let len = match r % 8 {
            0..=3 => 1 + (r >> 8) % 8,
            4..=6 => 1 + (r >> 8) % 256,
            _ => 1 + (r >> 8) % READ_SIZE as u64,
        };
        (len as usize).min(rest)
    }
}

/// One reply with the session's negotiation state after it.
type Reply = (Value, bool);

/// Feeds `input` in chunks (all at once with `chunks` None), checking the
/// buffer bound after every read.
fn run(input: &[u8], max_len: usize, chunks: Option<&mut Chunks>) -> (Vec<Reply>, Arc<Dispatcher>) {
    let dispatcher = Arc::new(Dispatcher::default());
    let mut connection = Connection::with_max_value_len(dispatcher.clone(), max_len);
    let mut replies = Vec::new();
    let debug = *DEBUG.get_or_init(|| std::env::var_os("VSD_FUZZ_DEBUG").is_some());
    let mut send = |reply: &Value, negotiated: bool| {
        if debug {
            eprintln!("reply {reply} negotiated {negotiated}");
        }
        replies.push((reply.clone(), negotiated));
        Ok(())
    };
    match chunks {
        None => connection.receive(input, &mut send).expect("sending never fails here"),
        Some(chunks) => {
            let mut at = 0;
            while at < input.len() {
                let len = chunks.next_len(input.len() - at);
                connection.receive(&input[at..at + len], &mut send).expect("sending never fails here");
                at += len;
                // At most one message is held, never input for later.
                assert!(connection.buffered() <= max_len, "{} bytes held, limit {max_len}", connection.buffered());
            }
        }
    }
    assert!(connection.buffered() <= max_len, "{} bytes held, limit {max_len}", connection.buffered());
    check_replies(&replies, &dispatcher);
    (replies, dispatcher)
}

/// What must hold of any session's replies.
fn check_replies(replies: &[Reply], dispatcher: &Dispatcher) {
    let mut negotiated = false;
    for (reply, now_negotiated) in replies {
        let Value::Object(members) = reply else { panic!("reply is not an object: {reply}") };
        let kinds = members.keys().filter(|k| *k == "return" || *k == "error").count();
        assert_eq!(kinds, 1, "reply needs one of return and error: {reply}");
        assert!(members.keys().all(|k| ["return", "error", "id"].contains(&k.as_str())), "stray member: {reply}");
        if let Some(error) = members.get("error") {
            assert!(error["class"].is_string() && error["desc"].is_string(), "bad error: {reply}");
            assert_eq!(error.as_object().map(Map::len), Some(2), "bad error: {reply}");
        }
        // One line on the wire, whatever the input held.
        let line = reply.to_string();
        assert!(!line.contains('\n'), "reply spans lines: {line}");
        assert!(serde_json::from_str::<Value>(&line).is_ok_and(|v| v.is_object()), "reply does not read back: {line}");
        // Negotiation only ever completes, with an empty return.
        assert!(!negotiated || *now_negotiated, "negotiation undone by {reply}");
        if !negotiated && *now_negotiated {
            assert_eq!(members.get("return"), Some(&json!({})), "negotiated by {reply}");
        }
        negotiated = *now_negotiated;
    }
    let executed = dispatcher.executed.load(Ordering::Relaxed);
    let after_negotiation = replies.iter().filter(|(_, negotiated)| *negotiated).count();
    assert!(executed <= after_negotiation, "{executed} commands ran, {after_negotiation} replies after negotiation");
    assert_eq!(
        dispatcher.after_reply.load(Ordering::Relaxed),
        dispatcher.succeeded.load(Ordering::Relaxed),
        "after_reply must follow every successful reply, once"
    );
}

fn is_parse_error(reply: &Reply) -> bool {
    reply.0["error"]["desc"].as_str().is_some_and(|d| d.starts_with("JSON parse error"))
}

/// Raw bytes: chunking must not change how the input splits into
/// messages, up to the first error.
fn raw(header: &[u8; 9], input: &[u8]) {
    let max_len = match header[0] % 4 {
        0 => MAX_VALUE_LEN,
        1 => 1024,
        2 => 64,
        _ => 8,
    };
    let (whole, _) = run(input, max_len, None);
    let seed = u64::from_le_bytes(header[1..9].try_into().unwrap_or_default()) | 1;
    let (chunked, _) = run(input, max_len, Some(&mut Chunks(seed)));
    let first_error = |replies: &[Reply]| replies.iter().position(is_parse_error);
    let upto = |replies: &[Reply]| first_error(replies).map_or(replies.len(), |i| i + 1);
    assert_eq!(first_error(&whole), first_error(&chunked), "chunking moved the first error");
    assert_eq!(whole[..upto(&whole)], chunked[..upto(&chunked)], "chunking changed the messages");
    if first_error(&whole).is_none() {
        assert_eq!(whole.len(), chunked.len(), "chunking changed the messages");
    }
}

/// An arbitrary JSON value, nested at most `depth` deep.
fn value(u: &mut Unstructured, depth: u32) -> ArbResult<Value> {
    Ok(match u.int_in_range(0..=if depth == 0 { 4 } else { 6 })? {
        0 => Value::Null,
        1 => Value::Bool(u.arbitrary()?),
        2 => Value::from(u.arbitrary::<i64>()?),
        // Floats that read back exactly: serde_json's parser is only
        // best-effort for others, which is not what is tested here.
        3 => Number::from_f64(f64::from(u.arbitrary::<i16>()?) / 1024.0).map_or(Value::Null, Value::Number),
        4 => Value::String(u.arbitrary()?),
        5 => Value::Array((0..u.int_in_range(0..=4)?).map(|_| value(u, depth - 1)).collect::<ArbResult<_>>()?),
        _ => Value::Object(object(u, depth - 1)?),
    })
}

fn object(u: &mut Unstructured, depth: u32) -> ArbResult<Map<String, Value>> {
    (0..u.int_in_range(0..=4)?).map(|_| Ok((u.arbitrary()?, value(u, depth)?))).collect()
}

/// A reply as QEMU would give it to `name` with `arguments`, given the
/// negotiation state before it: Ok(return value) or Err(error class).
fn expected(name: &str, arguments: &Map<String, Value>, negotiated: bool) -> Result<Value, &'static str> {
    let capabilities_ok = arguments.iter().all(|(k, v)| k == "enable" && v == &json!([]));
    match (negotiated, name) {
        (false, "qmp_capabilities") if capabilities_ok => Ok(json!({})),
        (false, "qmp_capabilities") => Err("GenericError"),
        (false, _) | (true, "qmp_capabilities") => Err("CommandNotFound"),
        (true, "echo") => Ok(Value::Object(arguments.clone())),
        (true, "nothing") => Ok(json!({})),
        (true, "query-version") => Ok(json!({"qemu": {"major": 0, "minor": 1, "micro": 0}, "package": "fuzz"})),
        (true, "fail") => Err("DeviceNotFound"),
        (true, _) => Err("CommandNotFound"),
    }
}

/// A session of commands and garbage lines.
fn commands(data: &[u8]) -> ArbResult<()> {
    // Ids carry a digest of the input, which garbage cannot know.
    let nonce = data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let mut u = Unstructured::new(data);
    let seed: u64 = u.arbitrary()?;
    let mut input = Vec::new();
    let mut sent = Vec::new();
    while !u.is_empty() {
        if u.ratio(1, 4)? {
            // Garbage, then a control character and a newline.
            let garbage: Vec<u8> = u.arbitrary()?;
            input.extend(garbage.iter().filter(|&&b| b != b'\n'));
            input.push(*u.choose(&RESYNC)?);
            input.push(b'\n');
            continue;
        }
        let name = *u.choose(&NAMES)?;
        let arguments = if u.ratio(1, 8)? && name == "qmp_capabilities" {
            let mut enable = Map::new();
            enable.insert("enable".to_owned(), json!([]));
            enable
        } else {
            object(&mut u, 3)?
        };
        let id = json!({"seq": sent.len(), "nonce": nonce});
        let mut command = json!({"execute": name, "id": id});
        if !arguments.is_empty() || u.arbitrary()? {
            command["arguments"] = Value::Object(arguments.clone());
        }
        let text =
            if u.ratio(1, 4)? { serde_json::to_string_pretty(&command) } else { serde_json::to_string(&command) };
        input.extend(text.expect("a value serializes").as_bytes());
        input.extend_from_slice(u.choose(&[&b""[..], b" ", b"\n", b"\r\n", b"\t"])?);
        sent.push((name, arguments, id));
    }
    let (replies, _) = run(&input, MAX_VALUE_LEN, Some(&mut Chunks(seed | 1)));
    let ours: Vec<usize> = replies
        .iter()
        .enumerate()
        .filter(|(_, (reply, _))| reply["id"]["nonce"] == json!(nonce))
        .map(|(i, _)| i)
        .collect();
    let shown = String::from_utf8_lossy(&input);
    assert_eq!(ours.len(), sent.len(), "every command gets one reply; input {shown:?}, replies {replies:?}");
    for (&at, (name, arguments, id)) in ours.iter().zip(&sent) {
        let (reply, _) = &replies[at];
        assert_eq!(&reply["id"], id, "replies out of order; input {shown:?}");
        let negotiated = at > 0 && replies[at - 1].1;
        match expected(name, arguments, negotiated) {
            Ok(value) => assert_eq!(reply.get("return"), Some(&value), "{name} {arguments:?}: {reply}"),
            Err(class) => assert_eq!(reply["error"]["class"], json!(class), "{name} {arguments:?}: {reply}"),
        }
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    if mode & 1 == 0 {
        let Some((header, input)) = rest.split_first_chunk::<9>() else { return };
        raw(header, input);
    } else {
        let _ = commands(rest);
    }
});
