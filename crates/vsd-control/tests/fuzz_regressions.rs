//! Input the fuzzer (`fuzz/`, target `qmp_input`) found that broke the QMP
//! monitor, replayed through a connection's input side as the target runs
//! it, and once over a real socket.

mod common;

use std::sync::Arc;

use common::{FakeDispatch, RawClient, error_of, server};
use serde_json::{Value, json};
use vsd_control::qmp::fuzzing::Connection;

/// The replies to `chunks`, sent one after the other.
fn replies(chunks: &[&[u8]]) -> Vec<Value> {
    let mut connection = Connection::new(Arc::new(FakeDispatch));
    let mut out = Vec::new();
    for chunk in chunks {
        connection
            .receive(chunk, |reply, _| {
                out.push(reply.clone());
                Ok(())
            })
            .unwrap();
    }
    out
}

/// The replies that carry an id, as (id, reply).
fn with_ids(replies: &[Value]) -> Vec<(Value, Value)> {
    replies.iter().filter_map(|r| r.get("id").map(|id| (id.clone(), r.clone()))).collect()
}

/// As found: garbage lines, each ended by a control character (or 0xFF)
/// and a newline, which the QMP spec gives clients to bring the parser back
/// to a known-good state. The last one opened a string; the monitor went on
/// looking for its closing quote, found it in the next command and turned
/// the rest of the session into errors: the first command got no reply at
/// all. Now a byte that JSON text cannot contain ends the value in progress.
#[test]
fn resync_byte_ends_an_unterminated_string() {
    let mut input = b"\x04\n".repeat(6);
    input.extend_from_slice(b"\"xct\xff\n");
    input.extend_from_slice(
        br#"{
  "arguments": {
    "c\u001b\u001e!$'*-0369<?BEHKNQT": 23.337890625
  },
  "execute": "no-such-command",
  "id": {
    "nonce": 15610225313878002276,
    "seq": 0
  }
}	{"arguments":{"r":[]},"execute":"query-version","id":{"nonce":15610225313878002276,"seq":1}} {
  "arguments": {
    "": null
  },
  "execute": "qmp_capabilities",
  "id": {
    "nonce": 15610225313878002276,
    "seq": 2
  }
}"#,
    );
    // Whole, and byte by byte: the same replies.
    let bytes: Vec<&[u8]> = input.chunks(1).collect();
    for out in [replies(&[&input]), replies(&bytes)] {
        let ours = with_ids(&out);
        let seqs: Vec<&Value> = ours.iter().map(|(id, _)| &id["seq"]).collect();
        assert_eq!(seqs, [&json!(0), &json!(1), &json!(2)], "{out:?}");
        assert_eq!(error_of(&ours[0].1).0, "CommandNotFound", "not negotiated yet");
        assert_eq!(error_of(&ours[1].1).0, "CommandNotFound", "not negotiated yet");
        assert_eq!(error_of(&ours[2].1), ("GenericError", "Parameter '' is unexpected"));
        // One error per garbage line, none for the commands.
        assert_eq!(out.len(), 7 + 3, "{out:?}");
    }
}

/// The smallest form: a string left open on a broken line.
#[test]
fn unterminated_string_does_not_swallow_the_next_line() {
    let out =
        replies(&[b"{\"execute\": \"qmp_capabilities\", \"id\": \"oops\n", b"{\"execute\": \"echo\", \"id\": 2}\n"]);
    assert_eq!(out.len(), 2, "{out:?}");
    assert_eq!(error_of(&out[0]), ("GenericError", "JSON parse error, control character in a string '\\n'"));
    assert_eq!(error_of(&out[1]).0, "CommandNotFound", "not negotiated yet: {:?}", out[1]);
    assert_eq!(out[1]["id"], json!(2));
}

/// The same over a socket, with the bytes a client sends to resynchronize.
#[test]
fn control_character_or_0xff_resynchronizes_a_connection() {
    let (server, _) = server("fuzz-resync");
    let mut client = RawClient::negotiated(&server);
    for resync in [&b"\x04"[..], b"\xff"] {
        client.send(b"{\"execute\": \"echo\", \"arguments\": {\"a\": [1, {\"b\": \"unfinished");
        client.send(resync);
        assert!(error_of(&client.receive()).1.starts_with("JSON parse error"));
        let reply = client.command(r#"{"execute": "echo", "arguments": {"ok": true}}"#);
        assert_eq!(reply, json!({"return": {"ok": true}}));
    }
}
