//! How a monitor writes JSON: one line per message, or pretty-printed the
//! way QEMU's `--monitor pretty=on` lays it out.

use std::io::{self, Write};

use serde::Serialize;
use serde_json::Value;
use serde_json::ser::{Formatter, Serializer};

/// A message as the client reads it, newline included: `pretty` lays it
/// out as QEMU does.
pub(crate) fn render(message: &Value, pretty: bool) -> String {
    let mut text = match pretty {
        true => {
            let mut out = Vec::new();
            let mut serializer = Serializer::with_formatter(&mut out, QemuPretty::default());
            // Writing a Value into memory cannot fail, and its strings are UTF-8.
            message.serialize(&mut serializer).expect("a JSON value serializes");
            String::from_utf8(out).expect("JSON is UTF-8")
        }
        false => message.to_string(),
    };
    text.push('\n');
    text
}

/// QEMU's layout: four spaces a level, every member and element on a line
/// of its own, and a closing bracket on a line of its own even for an empty
/// object or array (`{` newline `}`), where serde_json's own pretty printer
/// writes `{}`.
#[derive(Default)]
struct QemuPretty {
    depth: usize,
}

impl QemuPretty {
    fn open<W: ?Sized + Write>(&mut self, writer: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.depth += 1;
        writer.write_all(bracket)
    }

    fn item<W: ?Sized + Write>(&mut self, writer: &mut W, first: bool) -> io::Result<()> {
        if !first {
            writer.write_all(b",")?;
        }
        self.new_line(writer)
    }

    fn close<W: ?Sized + Write>(&mut self, writer: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.depth -= 1;
        self.new_line(writer)?;
        writer.write_all(bracket)
    }

    fn new_line<W: ?Sized + Write>(&self, writer: &mut W) -> io::Result<()> {
        writer.write_all(b"\n")?;
        (0..self.depth).try_for_each(|_| writer.write_all(b"    "))
    }
}

impl Formatter for QemuPretty {
    fn begin_array<W: ?Sized + Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.open(writer, b"[")
    }

    fn end_array<W: ?Sized + Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.close(writer, b"]")
    }

    fn begin_array_value<W: ?Sized + Write>(&mut self, writer: &mut W, first: bool) -> io::Result<()> {
        self.item(writer, first)
    }

    fn begin_object<W: ?Sized + Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.open(writer, b"{")
    }

    fn end_object<W: ?Sized + Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.close(writer, b"}")
    }

    fn begin_object_key<W: ?Sized + Write>(&mut self, writer: &mut W, first: bool) -> io::Result<()> {
        self.item(writer, first)
    }

    fn begin_object_value<W: ?Sized + Write>(&mut self, writer: &mut W) -> io::Result<()> {
        writer.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn compact_is_one_line() {
        assert_eq!(render(&json!({"return": {}}), false), "{\"return\":{}}\n");
    }

    #[test]
    fn pretty_is_laid_out_as_qemu_does() {
        let message = json!({"return": {"a": [1, {"b": "x"}], "e": {}, "l": []}, "id": 7});
        let expected = [
            "{",
            "    \"id\": 7,",
            "    \"return\": {",
            "        \"a\": [",
            "            1,",
            "            {",
            "                \"b\": \"x\"",
            "            }",
            "        ],",
            "        \"e\": {",
            "        },",
            "        \"l\": [",
            "        ]",
            "    }",
            "}\n",
        ];
        assert_eq!(render(&message, true), expected.join("\n"));
    }
}
