//! Splits QMP input into JSON values.
//!
//! Clients do not delimit their messages: Python's `qemu.qmp` sends them back
//! to back, `socat` and humans one per line. Like QEMU's json-streamer, the
//! splitter follows just enough of the JSON syntax (brackets, strings and
//! their escapes) to see where each top-level value ends; serde_json then
//! parses the value.
//!
//! Like QEMU's lexer, it also knows the bytes that JSON text can never
//! contain: ASCII control characters other than whitespace (and any control
//! character inside a string), and bytes that never occur in UTF-8. One ends
//! the value in progress with an error at once. That is how the QMP spec
//! tells a client to bring the parser back to a known-good state (send an
//! ASCII control character other than whitespace, or 0xFF), and it keeps a
//! string left open by a broken line from swallowing the lines after it.

use serde_json::Value;

/// The longest value accepted. No vsd command comes close; the limit only
/// bounds what a client can make the monitor buffer.
pub(crate) const MAX_VALUE_LEN: usize = 1 << 20;

/// Finds the top-level JSON values in a byte stream.
pub(crate) struct JsonStreamer {
    /// `buf[start..pos]` is the value in progress, `buf[pos..]` is not
    /// scanned yet.
    buf: Vec<u8>,
    start: usize,
    pos: usize,
    /// Unclosed `{` and `[` in the value in progress.
    depth: usize,
    in_string: bool,
    /// The previous byte was a backslash inside a string.
    escaped: bool,
    /// An over-long value is being dropped up to the next newline.
    dropping_line: bool,
    /// A bad token (bytes that cannot start a value) is being dropped up to
    /// the next byte that can end it: one error per token, as QEMU's lexer
    /// gives, however the client's bytes are cut into reads.
    dropping_token: bool,
    /// The longest value accepted: [`MAX_VALUE_LEN`] but in tests and fuzzing.
    max_len: usize,
}

impl Default for JsonStreamer {
    fn default() -> Self {
        Self::with_max_len(MAX_VALUE_LEN)
    }
}

/// What a byte does to the value in progress.
enum Step {
    /// Whitespace between values.
    Blank,
    /// Part of a value that goes on.
    More,
    /// The last byte of a value.
    End,
    /// Cannot start a value.
    Stray,
    /// Cannot occur in JSON text at all.
    Invalid,
}

impl JsonStreamer {
    /// A streamer that rejects values longer than `max_len` bytes.
    pub(crate) fn with_max_len(max_len: usize) -> Self {
        Self {
            buf: Vec::new(),
            start: 0,
            pos: 0,
            depth: 0,
            in_string: false,
            escaped: false,
            dropping_line: false,
            dropping_token: false,
            max_len,
        }
    }

    /// Appends input read from the client.
    pub(crate) fn push(&mut self, input: &[u8]) {
        self.buf.drain(..self.start);
        self.pos -= self.start;
        self.start = 0;
        self.buf.extend_from_slice(input);
    }

    /// Bytes held for the value in progress (and input not scanned yet).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    /// The next value, or why the input is not one; `None` until more input
    /// arrives. After an error, the input resumes after the next newline if
    /// one was buffered already, so that line-oriented clients recover, or
    /// right after the bad value otherwise. A byte that JSON text cannot
    /// contain ends the value in progress the same way, at once; when that
    /// byte is a newline (inside a string), the input resumes right after it.
    pub(crate) fn next_value(&mut self) -> Option<Result<Value, String>> {
        if self.dropping_line && !self.skip_line() {
            // Still no newline: all that is buffered goes.
            self.start = self.buf.len();
            self.pos = self.start;
            return None;
        }
        self.dropping_line = false;
        if self.dropping_token && !self.skip_token() {
            return None;
        }
        self.dropping_token = false;
        while let Some(&byte) = self.buf.get(self.pos) {
            self.pos += 1;
            let in_string = self.in_string;
            match self.step(byte) {
                Step::Blank => self.start = self.pos,
                Step::More | Step::End if self.pos - self.start > self.max_len => {
                    self.abandon_value();
                    self.dropping_line = true;
                    return Some(Err(format!("JSON parse error, value longer than {} bytes", self.max_len)));
                }
                Step::More => {}
                Step::End => return Some(self.take_value()),
                Step::Stray if is_token_byte(byte) => {
                    // A run of them (a word, a number) is one bad token.
                    // Named by its first byte: how much of it has arrived
                    // depends on how the client's bytes were cut.
                    self.abandon_value();
                    self.dropping_token = true;
                    return Some(Err(format!("JSON parse error, stray '{}'", byte.escape_ascii())));
                }
                Step::Stray => {
                    return Some(Err(self.recover(format!("JSON parse error, stray '{}'", byte.escape_ascii()))));
                }
                Step::Invalid => {
                    let what = if in_string && byte < 0x20 { "control character in a string" } else { "invalid byte" };
                    self.abandon_value();
                    // A newline left in a string ends the broken line itself.
                    if byte != b'\n' {
                        self.skip_line();
                    }
                    return Some(Err(format!("JSON parse error, {what} '{}'", byte.escape_ascii())));
                }
            }
        }
        None
    }

    fn step(&mut self, byte: u8) -> Step {
        if never_in_json(byte, self.in_string) {
            return Step::Invalid;
        }
        match byte {
            _ if self.in_string => self.step_in_string(byte),
            b'"' => self.in_string = true,
            b'{' | b'[' => self.depth += 1,
            b'}' | b']' if self.depth > 0 => self.depth -= 1,
            b' ' | b'\t' | b'\r' | b'\n' if self.depth == 0 => return Step::Blank,
            // Only objects, arrays and strings are delimited: a top-level
            // number or keyword could not be told from its continuation.
            _ if self.depth == 0 => return Step::Stray,
            _ => {}
        }
        if self.depth == 0 && !self.in_string { Step::End } else { Step::More }
    }

    fn step_in_string(&mut self, byte: u8) {
        match byte {
            _ if self.escaped => self.escaped = false,
            b'\\' => self.escaped = true,
            b'"' => self.in_string = false,
            _ => {}
        }
    }

    fn take_value(&mut self) -> Result<Value, String> {
        let value = serde_json::from_slice(&self.buf[self.start..self.pos]);
        self.start = self.pos;
        value.map_err(|e| self.recover(format!("JSON parse error, {e}")))
    }

    /// Drops the bad value and the rest of its line, if buffered.
    fn recover(&mut self, error: String) -> String {
        self.abandon_value();
        self.skip_line();
        error
    }

    fn abandon_value(&mut self) {
        self.start = self.pos;
        self.depth = 0;
        self.in_string = false;
        self.escaped = false;
    }

    /// Drops the rest of a bad token; false, having dropped all that is
    /// buffered, while it goes on.
    fn skip_token(&mut self) -> bool {
        let len = self.buf[self.pos..].iter().take_while(|&&b| is_token_byte(b)).count();
        self.pos += len;
        self.start = self.pos;
        self.pos < self.buf.len()
    }

    /// Drops buffered input up to and including the next newline; false,
    /// dropping nothing, when there is none.
    fn skip_line(&mut self) -> bool {
        let Some(len) = self.buf[self.pos..].iter().position(|&b| b == b'\n') else {
            return false;
        };
        self.pos += len + 1;
        self.start = self.pos;
        true
    }
}

/// Whether `byte` belongs to a word or number (the bytes QEMU's lexer runs
/// together into one token): not whitespace, not structure, not a quote,
/// and possible in JSON text.
fn is_token_byte(byte: u8) -> bool {
    !matches!(byte, b' ' | b'\t' | b'\r' | b'\n' | b'{' | b'}' | b'[' | b']' | b'"' | b',' | b':')
        && !never_in_json(byte, false)
}

/// Whether `byte` can never occur in JSON text (inside a string or not):
/// control characters must be escaped in strings and are whitespace only
/// as tab, carriage return and newline outside them; 0xC0, 0xC1 and
/// 0xF5..=0xFF are not UTF-8.
fn never_in_json(byte: u8, in_string: bool) -> bool {
    match byte {
        b'\t' | b'\r' | b'\n' => in_string,
        0x00..=0x1f | 0xc0 | 0xc1 | 0xf5..=0xff => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// Feeds `chunks` one by one, collecting what comes out.
    fn split(chunks: &[&[u8]]) -> Vec<Result<Value, String>> {
        let mut streamer = JsonStreamer::default();
        let mut out = Vec::new();
        for chunk in chunks {
            streamer.push(chunk);
            out.extend(std::iter::from_fn(|| streamer.next_value()));
        }
        out
    }

    fn values(chunks: &[&[u8]]) -> Vec<Value> {
        split(chunks).into_iter().map(|v| v.expect("a value")).collect()
    }

    fn is_error(item: &Result<Value, String>) -> bool {
        item.as_ref().is_err_and(|e| e.starts_with("JSON parse error, "))
    }

    #[test]
    fn value_split_across_reads() {
        assert_eq!(
            values(&[b"{\"exe", b"cute\": \"a\", \"argu", b"ments\": {}", b"}"]),
            [json!({"execute": "a", "arguments": {}})]
        );
    }

    #[test]
    fn split_inside_an_escape() {
        assert_eq!(values(&[b"{\"a\": \"x\\", b"\"}\"}"]), [json!({"a": "x\"}"})]);
    }

    #[test]
    fn several_values_in_one_read_without_newlines() {
        assert_eq!(
            values(&[b"{\"a\":1}{\"b\":2}  \r\n\t[3]\"s\""]),
            [json!({"a": 1}), json!({"b": 2}), json!([3]), json!("s")]
        );
    }

    #[test]
    fn incomplete_value_waits_for_more() {
        assert!(split(&[b"{\"a\": [1, {\"b\": ", b"2}"]).is_empty());
    }

    #[test]
    fn brackets_and_quotes_inside_strings() {
        let input = br#"{"a": "}]{[", "b": "say \"}\"", "c": "\\", "d": ["x", ["\\\""]]}"#;
        assert_eq!(values(&[input]), [json!({"a": "}]{[", "b": "say \"}\"", "c": "\\", "d": ["x", ["\\\""]]})]);
    }

    #[test]
    fn nested_arrays() {
        assert_eq!(values(&[b"[[1, [2, [3]]], []]", b"{}"]), [json!([[1, [2, [3]]], []]), json!({})]);
    }

    #[test]
    fn a_bad_token_is_one_error_and_what_follows_it_is_served() {
        // As QEMU's lexer: one error for the word, then the values after it.
        let out = split(&[b"garbage {\"a\":1}\n{\"b\":2}\n"]);
        assert_eq!(out, [Err("JSON parse error, stray 'g'".into()), Ok(json!({"a": 1})), Ok(json!({"b": 2}))]);
        // However the token is cut into reads, and however long it is.
        let long = vec![b'x'; 200_000];
        let pieces: Vec<&[u8]> = long.chunks(16 * 1024).chain([&b"\n{\"b\":2}"[..]]).collect();
        let out = split(&pieces);
        assert_eq!(out.len(), 2, "{:?}", &out[..out.len().min(3)]);
        assert!(is_error(&out[0]) && out[1] == Ok(json!({"b": 2})));
    }

    #[test]
    fn stray_closing_bracket() {
        let out = split(&[b"}\n", b"{\"b\":2}"]);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0], Err("JSON parse error, stray '}'".to_owned()));
        assert_eq!(out[1], Ok(json!({"b": 2})));
    }

    #[test]
    fn without_newline_recovery_resumes_after_the_bad_value() {
        let out = split(&[b"{\"a\": x}{\"b\":2}"]);
        assert_eq!(out.len(), 2);
        assert!(is_error(&out[0]), "{out:?}");
        assert_eq!(out[1], Ok(json!({"b": 2})));
    }

    #[test]
    fn invalid_json_in_a_balanced_value() {
        let out = split(&[b"{\"a\": tru}{\"c\": 1}\n{\"b\": 2}"]);
        assert_eq!(out.len(), 2);
        assert!(is_error(&out[0]), "{out:?}");
        assert_eq!(out[1], Ok(json!({"b": 2})));
    }

    #[test]
    fn invalid_utf8_in_a_string() {
        let out = split(&[b"{\"a\": \"\xff\xfe\"}\n", b"{}"]);
        assert_eq!(out.len(), 2);
        assert!(is_error(&out[0]), "{out:?}");
        assert_eq!(out[1], Ok(json!({})));
    }

    #[test]
    fn control_character_resets_an_unfinished_value() {
        // The QMP spec's way back to a known-good state: a lexical error.
        for reset in [b'\x04', b'\x00', b'\x1b', b'\xff'] {
            let out = split(&[b"{\"execute\": [1, {\"a\": \"x", &[reset], b"\n", b"{\"b\":2}"]);
            assert_eq!(out.len(), 2, "{out:?}");
            assert!(is_error(&out[0]), "{out:?}");
            assert_eq!(out[1], Ok(json!({"b": 2})));
            // Between values too.
            let out = split(&[&[reset], b"\n{\"b\":2}"]);
            assert_eq!(out.len(), 2, "{out:?}");
            assert!(is_error(&out[0]), "{out:?}");
        }
    }

    #[test]
    fn unterminated_string_ends_with_its_line() {
        // A raw newline cannot be in a string: the broken line is dropped,
        // not everything up to the next quote.
        let out = split(&[b"{\"execute\": \"x\n{\"b\":2}\n"]);
        assert_eq!(out.len(), 2, "{out:?}");
        assert_eq!(out[0], Err("JSON parse error, control character in a string '\\n'".to_owned()));
        assert_eq!(out[1], Ok(json!({"b": 2})));
        // Nor a tab, unescaped: the rest of the line goes with it.
        let out = split(&[b"[\"a\tb\"] {}\n[]"]);
        assert_eq!(out.len(), 2, "{out:?}");
        assert!(is_error(&out[0]), "{out:?}");
        assert_eq!(out[1], Ok(json!([])));
        // Escaped, they are fine.
        assert_eq!(values(&[br#"["a\n\tb"]"#]), [json!(["a\n\tb"])]);
    }

    #[test]
    fn newlines_between_members_are_whitespace() {
        assert_eq!(values(&[b"{\n  \"a\": [\r\n1,\t2\n]\n}"]), [json!({"a": [1, 2]})]);
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_stack_overflow() {
        // serde_json stops at 128 levels; the splitter only counts.
        let deep = format!("{}{}\n[[1]]", "[".repeat(100_000), "]".repeat(100_000));
        let out = split(&[deep.as_bytes()]);
        assert_eq!(out.len(), 2, "{out:?}");
        assert!(out[0].as_ref().is_err_and(|e| e.contains("recursion limit")), "{out:?}");
        assert_eq!(out[1], Ok(json!([[1]])));
    }

    #[test]
    fn smaller_limit() {
        let mut streamer = JsonStreamer::with_max_len(8);
        streamer.push(b"[1,2,3,4]\n[1,2,3]");
        assert!(streamer.next_value().is_some_and(|v| v.is_err()));
        assert_eq!(streamer.next_value(), Some(Ok(json!([1, 2, 3]))));
        assert_eq!(streamer.buffered(), 0);
    }

    #[test]
    fn non_ascii_stray_byte_is_escaped() {
        assert_eq!(split(&[b"\xc3\n"]), [Err("JSON parse error, stray '\\xc3'".to_owned())]);
    }

    #[test]
    fn over_long_value_is_dropped_to_the_next_newline() {
        let long = format!("{{\"a\": \"{}\"}}", "x".repeat(MAX_VALUE_LEN));
        let chunks: Vec<&[u8]> = long.as_bytes().chunks(4096).chain([&b"}}]\n{\"b\":2}"[..]]).collect();
        let out = split(&chunks);
        assert_eq!(out.len(), 2, "{out:?}");
        assert!(is_error(&out[0]), "{out:?}");
        assert_eq!(out[1], Ok(json!({"b": 2})));
    }

    #[test]
    fn value_of_the_maximum_length_is_accepted() {
        let value = format!("\"{}\"", "x".repeat(MAX_VALUE_LEN - 2));
        assert_eq!(values(&[value.as_bytes()]), [Value::String("x".repeat(MAX_VALUE_LEN - 2))]);
    }

    #[test]
    fn buffer_does_not_grow_while_dropping() {
        let mut streamer = JsonStreamer::default();
        streamer.push(&[b'['; MAX_VALUE_LEN + 1]);
        assert!(streamer.next_value().is_some_and(|v| v.is_err()));
        for _ in 0..10 {
            streamer.push(&[b'['; 65536]);
            assert!(streamer.next_value().is_none());
        }
        assert!(streamer.buf.len() <= 65536);
    }
}
