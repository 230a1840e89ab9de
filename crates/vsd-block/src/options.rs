//! QEMU-style option strings: `key=value,key=value` (a doubled comma is a
//! literal comma) or a JSON object, as `--blockdev` and `--export` take them.

use std::fmt;

use vsd_sys::size::parse_size;

/// A mistake in an option string; each names the option at fault.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum OptionError {
    /// The text is neither `key=value,...` nor a JSON object.
    #[error("{context}: {reason}")]
    Syntax {
        /// Which option string.
        context: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A required key is absent.
    #[error("{context}: parameter '{key}' is missing")]
    Missing {
        /// Which option string.
        context: String,
        /// The key.
        key: String,
    },
    /// A value does not parse.
    #[error("{context}: parameter '{key}' expects {expected}, not '{value}'")]
    Invalid {
        /// Which option string.
        context: String,
        /// The key.
        key: String,
        /// The value given.
        value: String,
        /// What was expected.
        expected: String,
    },
    /// Values that each parse but do not go together (QEMU's wording).
    #[error("{context}: {reason}")]
    Rejected {
        /// Which option string.
        context: String,
        /// Why.
        reason: String,
    },
    /// A JSON value of the wrong type (QEMU's words).
    #[error("{context}: Invalid parameter type for '{key}', expected: {expected}")]
    Type {
        /// Which option string.
        context: String,
        /// The key.
        key: String,
        /// QAPI's name of the type wanted.
        expected: String,
    },
    /// A value that is none of an enum's (QEMU's words, then the choices).
    #[error("{context}: Parameter '{key}' does not accept value '{value}' (one of {choices})")]
    Value {
        /// Which option string.
        context: String,
        /// The key.
        key: String,
        /// The value given.
        value: String,
        /// The values it accepts.
        choices: String,
    },
    /// A key nobody asked for.
    #[error("{context}: unknown parameter '{key}'")]
    Unknown {
        /// Which option string.
        context: String,
        /// The key.
        key: String,
    },
}

/// The parsed keys of one option string, consumed key by key.
///
/// Every `take_*` removes its key; [`OptionMap::finish`] then rejects any
/// key left over, so a typo is an error rather than silently ignored.
#[derive(Debug, Clone)]
pub struct OptionMap {
    context: String,
    entries: Vec<Entry>,
    /// A JSON value of the wrong type that [`OptionMap::take`] let
    /// through, refused by [`OptionMap::finish`].
    mistyped: Option<OptionError>,
}

/// One key, its value as text, and what JSON type it had.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    key: String,
    value: String,
    kind: Kind,
}

/// What a value was written as. `key=value` text takes any type, as
/// QEMU's command line does; JSON (`--blockdev {...}`, QMP) is typed as
/// QAPI types it, so `"read-only": "yes"` is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Text,
    String,
    Bool,
    Number,
    Null,
}

impl Kind {
    /// Whether a value of this kind can be read as `wanted`.
    fn fits(self, wanted: Kind) -> bool {
        self == Kind::Text || self == wanted
    }
}

impl Entry {
    fn text(key: impl Into<String>, value: impl Into<String>) -> Self {
        Self { key: key.into(), value: value.into(), kind: Kind::Text }
    }
}

impl OptionMap {
    /// Parses `text`; `flag` (e.g. `--blockdev`) names it in errors.
    pub fn parse(flag: &str, text: &str) -> Result<Self, OptionError> {
        let syntax = |reason: String| OptionError::Syntax { context: format!("{flag} {text}"), reason };
        let entries = if text.trim_start().starts_with('{') {
            let value: serde_json::Value = serde_json::from_str(text).map_err(|e| syntax(e.to_string()))?;
            let mut entries = Vec::new();
            flatten_json("", &value, &mut entries).map_err(syntax)?;
            entries
        } else {
            split_key_values(text).map_err(syntax)?
        };
        for (i, Entry { key, .. }) in entries.iter().enumerate() {
            if entries[..i].iter().any(|e| e.key == *key) {
                return Err(syntax(format!("parameter '{key}' appears twice")));
            }
        }
        let context = match entries.iter().find(|e| e.key == "node-name" || e.key == "id") {
            Some(e) => format!("{flag} {}={}", e.key, e.value),
            None => flag.to_string(),
        };
        Ok(Self { context, entries, mistyped: None })
    }

    /// Parses `text` whose first item may be a bare value for `implied`, as
    /// QEMU writes `--object secret,id=...` (`qom-type=secret`),
    /// `--blockdev file,...` (`driver=file`), `--export nbd,...`
    /// (`type=nbd`) and `--chardev socket,id=...` (`backend=socket`).
    pub fn parse_implied(flag: &str, text: &str, implied: &str) -> Result<Self, OptionError> {
        match text.split(',').next() {
            Some(first) if !text.trim_start().starts_with('{') && !first.contains('=') => {
                Self::parse(flag, &format!("{implied}={text}"))
            }
            _ => Self::parse(flag, text),
        }
    }

    /// How errors name this option string, e.g. `--blockdev node-name=disk`.
    pub fn context(&self) -> &str {
        &self.context
    }

    /// Removes `key`'s entry, which must be of kind `wanted` if it came
    /// from JSON (QAPI's `type` names it in the error).
    fn take_kind(&mut self, key: &str, wanted: Kind, type_name: &str) -> Result<Option<String>, OptionError> {
        let Some(at) = self.entries.iter().position(|e| e.key == key) else { return Ok(None) };
        if !self.entries[at].kind.fits(wanted) {
            return Err(self.type_error(key, type_name));
        }
        Ok(Some(self.entries.remove(at).value))
    }

    /// Removes and returns `key`'s value. A JSON value that is not a
    /// string is refused, by [`OptionMap::finish`]; a JSON `null` reads as
    /// `"null"` (`"backing": null`).
    pub fn take(&mut self, key: &str) -> Option<String> {
        let kind = self.entries.iter().find(|e| e.key == key)?.kind;
        if !matches!(kind, Kind::Text | Kind::String | Kind::Null) && self.mistyped.is_none() {
            self.mistyped = Some(self.type_error(key, "string"));
        }
        self.take_any(key)
    }

    /// Removes and returns `key`'s value, which must be a string in JSON.
    fn try_take(&mut self, key: &str) -> Result<Option<String>, OptionError> {
        self.take_kind(key, Kind::String, "string")
    }

    /// Removes and returns `key`'s value, which must be present.
    pub fn require(&mut self, key: &str) -> Result<String, OptionError> {
        self.try_take(key)?.ok_or_else(|| OptionError::Missing { context: self.context.clone(), key: key.into() })
    }

    /// A boolean: on/off, true/false, yes/no; in JSON, `true` or `false`.
    pub fn take_bool(&mut self, key: &str) -> Result<Option<bool>, OptionError> {
        self.take_typed(key, Kind::Bool, "boolean", "on or off", |v| match v {
            "on" | "true" | "yes" => Some(true),
            "off" | "false" | "no" => Some(false),
            _ => None,
        })
    }

    /// A byte count, with an optional k/M/G/T suffix (powers of 1024); in
    /// JSON, a number of bytes.
    pub fn take_size(&mut self, key: &str) -> Result<Option<u64>, OptionError> {
        self.take_typed(key, Kind::Number, "integer", "a size in bytes (suffixes k, M, G, T allowed)", |v| {
            parse_size(v).ok()
        })
    }

    /// A plain unsigned integer; in JSON, a number.
    pub fn take_u64(&mut self, key: &str) -> Result<Option<u64>, OptionError> {
        self.take_typed(key, Kind::Number, "integer", "an unsigned integer", |v| v.parse().ok())
    }

    /// A socket as QEMU's `SocketAddress` spells it: `PREFIX.type=unix` and
    /// `PREFIX.path`, `PREFIX.type=inet`, `PREFIX.host` and `PREFIX.port`, or
    /// `PREFIX.type=fd` and `PREFIX.str` (a descriptor number or name).
    pub fn take_address(&mut self, prefix: &str) -> Result<vsd_nbd_client::Address, OptionError> {
        use vsd_nbd_client::Address;
        let key = |name: &str| format!("{prefix}.{name}");
        Ok(match self.require(&key("type"))?.as_str() {
            "unix" => Address::Unix(self.require(&key("path"))?.into()),
            "inet" => {
                let host = self.require(&key("host"))?;
                let text = self.require(&key("port"))?;
                let port = text.parse().map_err(|_| self.invalid(&key("port"), &text, "a port number"))?;
                Address::Inet { host, port }
            }
            "fd" => Address::Fd(self.require(&key("str"))?),
            other => return Err(self.invalid(&key("type"), other, "unix, inet or fd")),
        })
    }

    /// `key`'s value as written, which must be a number in JSON, for a
    /// caller that reads numbers of its own kind (signed, bounded).
    pub fn take_number(&mut self, key: &str) -> Result<Option<String>, OptionError> {
        self.take_kind(key, Kind::Number, "integer")
    }

    /// One of `choices` (a QAPI enum); anything else is refused in QEMU's
    /// words, with the choices listed.
    pub fn take_choice(&mut self, key: &str, choices: &[&'static str]) -> Result<Option<&'static str>, OptionError> {
        let Some(value) = self.try_take(key)? else { return Ok(None) };
        match choices.iter().copied().find(|c| *c == value) {
            Some(choice) => Ok(Some(choice)),
            None => Err(OptionError::Value {
                context: self.context.clone(),
                key: key.into(),
                value,
                choices: choices.join(", "),
            }),
        }
    }

    /// One of `choices`, which must be given.
    pub fn require_choice(&mut self, key: &str, choices: &[&'static str]) -> Result<&'static str, OptionError> {
        self.take_choice(key, choices)?
            .ok_or_else(|| OptionError::Missing { context: self.context.clone(), key: key.into() })
    }

    /// `key`'s value of QAPI type `type_name` (`kind` in JSON), parsed.
    fn take_typed<T>(
        &mut self,
        key: &str,
        kind: Kind,
        type_name: &str,
        expected: &str,
        parse: impl FnOnce(&str) -> Option<T>,
    ) -> Result<Option<T>, OptionError> {
        let Some(value) = self.take_kind(key, kind, type_name)? else { return Ok(None) };
        match parse(&value) {
            Some(parsed) => Ok(Some(parsed)),
            None => Err(self.invalid(key, &value, expected)),
        }
    }

    /// QEMU's error for a JSON value of the wrong type.
    fn type_error(&self, key: &str, expected: &str) -> OptionError {
        OptionError::Type { context: self.context.clone(), key: key.into(), expected: expected.into() }
    }

    /// An error for a value that parsed but is not acceptable.
    pub fn invalid(&self, key: &str, value: impl fmt::Display, expected: &str) -> OptionError {
        OptionError::Invalid {
            context: self.context.clone(),
            key: key.into(),
            value: value.to_string(),
            expected: expected.into(),
        }
    }

    /// The options, as a whole, are refused for `reason`.
    pub fn rejected(&self, reason: impl Into<String>) -> OptionError {
        OptionError::Rejected { context: self.context.clone(), reason: reason.into() }
    }

    /// Removes every `prefix.key` entry and returns them as an option map
    /// of their own (keys without the prefix), if there were any: a child
    /// node defined inline, as `file.driver=file,file.filename=...` or
    /// `{"file": {"driver": "file", ...}}`.
    pub fn take_group(&mut self, prefix: &str) -> Option<OptionMap> {
        let (inner, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.entries)
            .into_iter()
            .partition(|e| e.key.starts_with(prefix) && e.key[prefix.len()..].starts_with('.'));
        self.entries = rest;
        if inner.is_empty() {
            return None;
        }
        let entries: Vec<_> =
            inner.into_iter().map(|e| Entry { key: e.key[prefix.len() + 1..].to_string(), ..e }).collect();
        Some(OptionMap { context: format!("{} {prefix}", self.context), entries, mistyped: None })
    }

    /// Removes the items of list `key`, written `key.0=...,key.1=...` (QEMU's
    /// dotted form of a JSON array of plain values), of any JSON type: the
    /// caller reads each as the list's type (`"vqs": [0, 3]`).
    pub fn take_values(&mut self, key: &str) -> Vec<String> {
        (0..).map_while(|i| self.take_any(&format!("{key}.{i}"))).collect()
    }

    fn take_any(&mut self, key: &str) -> Option<String> {
        let at = self.entries.iter().position(|e| e.key == key)?;
        Some(self.entries.remove(at).value)
    }

    /// Drops `key`, whatever its type: for a caller that has read it
    /// another way.
    pub fn remove(&mut self, key: &str) {
        self.take_any(key);
    }

    /// The keys left, in order.
    pub fn keys(&self) -> Vec<String> {
        self.entries.iter().map(|e| e.key.clone()).collect()
    }

    /// Removes the items of list `key` whose items are objects, written
    /// `key.0.a=...,key.0.b=...,key.1.a=...`, each as a map of its own.
    pub fn take_groups(&mut self, key: &str) -> Vec<OptionMap> {
        (0..).map_while(|i| self.take_group(&format!("{key}.{i}"))).collect()
    }

    /// `key`'s value, left in place.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.entries.iter().find(|e| e.key == key).map(|e| e.value.as_str())
    }

    /// Whether `key` is present.
    pub fn has(&self, key: &str) -> bool {
        self.entries.iter().any(|e| e.key == key)
    }

    /// Sets `key` (which must be absent) to `value`.
    pub fn insert(&mut self, key: &str, value: impl Into<String>) {
        debug_assert!(!self.has(key));
        self.entries.push(Entry::text(key, value));
    }

    /// Fails if a key was not consumed, or a taken one had the wrong type.
    pub fn finish(self) -> Result<(), OptionError> {
        if let Some(mistyped) = self.mistyped {
            return Err(mistyped);
        }
        match self.entries.into_iter().next() {
            Some(Entry { key, .. }) => Err(OptionError::Unknown { context: self.context, key }),
            None => Ok(()),
        }
    }
}

fn split_key_values(text: &str) -> Result<Vec<Entry>, String> {
    let mut entries = Vec::new();
    let mut chars = text.chars().peekable();
    while chars.peek().is_some() {
        let mut item = String::new();
        while let Some(c) = chars.next() {
            if c == ',' {
                if chars.peek() == Some(&',') {
                    chars.next();
                } else {
                    break;
                }
            }
            item.push(c);
        }
        let Some((key, value)) = item.split_once('=') else {
            return Err(format!("'{item}' is not of the form key=value"));
        };
        if key.is_empty() {
            return Err(format!("'{item}' has an empty key"));
        }
        entries.push(Entry::text(key, value));
    }
    Ok(entries)
}

fn flatten_json(prefix: &str, value: &serde_json::Value, out: &mut Vec<Entry>) -> Result<(), String> {
    use serde_json::Value;
    let Value::Object(map) = value else {
        return Err("the JSON form must be an object".into());
    };
    for (key, value) in map {
        let key = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
        flatten_value(key, value, out)?;
    }
    Ok(())
}

/// One JSON value under `key`; array items go under `key.0`, `key.1`, ...
/// as QEMU's dotted keys write lists (`server.0.host=...`).
fn flatten_value(key: String, value: &serde_json::Value, out: &mut Vec<Entry>) -> Result<(), String> {
    use serde_json::Value;
    let (value, kind) = match value {
        Value::Object(_) => return flatten_json(&key, value, out),
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                flatten_value(format!("{key}.{i}"), item, out)?;
            }
            return Ok(());
        }
        Value::String(s) => (s.clone(), Kind::String),
        Value::Bool(b) => (if *b { "on" } else { "off" }.to_string(), Kind::Bool),
        Value::Number(n) => (n.to_string(), Kind::Number),
        Value::Null => ("null".to_string(), Kind::Null),
    };
    out.push(Entry { key, value, kind });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_split_off_by_prefix() {
        let mut o = OptionMap::parse(
            "--blockdev",
            r#"{"driver": "qcow2", "node-name": "q", "file": {"driver": "file", "filename": "/x", "cache": {"direct": true}}}"#,
        )
        .unwrap();
        let mut file = o.take_group("file").unwrap();
        assert_eq!(file.context(), "--blockdev node-name=q file");
        assert_eq!(file.take("filename").as_deref(), Some("/x"));
        assert_eq!(file.take("cache.direct").as_deref(), Some("on"));
        assert!(file.has("driver") && !o.has("file.driver"));
        assert!(o.take_group("backing").is_none());
        let mut o = OptionMap::parse("--blockdev", "driver=raw,file.driver=file,filename-x=1,files.x=2").unwrap();
        let group = o.take_group("file").unwrap();
        assert_eq!(group.entries, [Entry::text("driver", "file")]);
        assert!(o.has("filename-x") && o.has("files.x"), "only keys under 'file.'");
        o.insert("file", "f0");
        assert_eq!(o.take("file").as_deref(), Some("f0"));
    }

    #[test]
    fn lists_read_alike_from_json_arrays_and_dotted_keys() {
        let json = r#"{"server": [{"host": "a", "port": "1"}, {"host": "b", "port": "2"}], "auth": ["cephx", "none"]}"#;
        let dotted = "server.0.host=a,server.0.port=1,server.1.host=b,server.1.port=2,auth.0=cephx,auth.1=none";
        for text in [json, dotted] {
            let mut o = OptionMap::parse("--blockdev", text).unwrap();
            let servers: Vec<_> = o
                .take_groups("server")
                .into_iter()
                .map(|mut s| (s.take("host").unwrap(), s.take("port").unwrap()))
                .collect();
            assert_eq!(servers, [("a".into(), "1".into()), ("b".into(), "2".into())], "{text}");
            assert_eq!(o.take_values("auth"), ["cephx", "none"], "{text}");
            o.finish().unwrap();
        }
        let mut gap = OptionMap::parse("--blockdev", "auth.0=a,auth.2=c").unwrap();
        assert_eq!(gap.take_values("auth"), ["a"]);
        assert!(gap.finish().is_err(), "an item after a gap is left over, and refused");
    }

    #[test]
    fn key_values_with_escaped_commas() {
        let mut o = OptionMap::parse("--blockdev", "driver=file,node-name=a,filename=/x,,y").unwrap();
        assert_eq!(o.context(), "--blockdev node-name=a");
        assert_eq!(o.take("filename").as_deref(), Some("/x,y"));
        assert_eq!(o.require("driver").unwrap(), "file");
        o.take("node-name");
        o.finish().unwrap();
    }

    #[test]
    fn json_form_flattens_to_dotted_keys() {
        let mut o = OptionMap::parse("--blockdev", r#"{"driver":"file","cache":{"direct":true},"size":4096}"#).unwrap();
        assert_eq!(o.take_bool("cache.direct").unwrap(), Some(true));
        assert_eq!(o.take_size("size").unwrap(), Some(4096));
    }

    #[test]
    fn leftover_keys_are_errors_naming_the_key() {
        let mut o = OptionMap::parse("--export", "id=e,tpye=x").unwrap();
        o.take("id");
        let err = o.finish().unwrap_err();
        assert_eq!(err.to_string(), "--export id=e: unknown parameter 'tpye'");
    }

    #[test]
    fn bad_values_are_errors_naming_the_value() {
        let mut o = OptionMap::parse("--blockdev", "node-name=n,cache.direct=maybe,size=12Q").unwrap();
        let err = o.take_bool("cache.direct").unwrap_err();
        assert!(err.to_string().contains("'maybe'"), "{err}");
        assert!(o.take_size("size").is_err());
    }

    #[test]
    fn json_values_are_typed_as_qapi_types_them() {
        let err = |json: &str, take: fn(&mut OptionMap) -> Result<(), OptionError>| {
            let mut o = OptionMap::parse("--blockdev", json).unwrap();
            take(&mut o).and_then(|()| o.finish()).unwrap_err().to_string()
        };
        let expected = "--blockdev: Invalid parameter type for 'read-only', expected: boolean";
        assert_eq!(err(r#"{"read-only": "yes"}"#, |o| o.take_bool("read-only").map(drop)), expected);
        assert_eq!(err(r#"{"read-only": 1}"#, |o| o.take_bool("read-only").map(drop)), expected);
        let size = "--blockdev: Invalid parameter type for 'size', expected: integer";
        assert_eq!(err(r#"{"size": "1M"}"#, |o| o.take_size("size").map(drop)), size);
        assert!(err(r#"{"queues": true}"#, |o| o.take_u64("queues").map(drop)).ends_with("expected: integer"));
        let string = "--blockdev: Invalid parameter type for 'filename', expected: string";
        assert_eq!(err(r#"{"filename": 5}"#, |o| o.require("filename").map(drop)), string);
        assert_eq!(
            err(r#"{"filename": false}"#, |o| {
                o.take("filename");
                Ok(())
            }),
            string,
            "refused by finish"
        );
        assert!(err(r#"{"aio": 1}"#, |o| o.take_choice("aio", &["threads"]).map(drop)).ends_with("expected: string"));
        // The command line's text takes any type.
        let mut o = OptionMap::parse("--blockdev", "read-only=yes,size=1M,filename=5").unwrap();
        assert_eq!(o.take_bool("read-only").unwrap(), Some(true));
        assert_eq!(o.take_size("size").unwrap(), Some(1 << 20));
        assert_eq!(o.take("filename").as_deref(), Some("5"));
        o.finish().unwrap();
        let mut o = OptionMap::parse("--blockdev", r#"{"backing": null, "cache": {"direct": true}}"#).unwrap();
        assert_eq!(o.take("backing").as_deref(), Some("null"));
        let mut cache = o.take_group("cache").unwrap();
        assert!(cache.take_bool("direct").unwrap().unwrap(), "a group keeps its types");
        o.finish().unwrap();
    }

    #[test]
    fn enum_values_are_refused_in_qemus_words_with_the_choices() {
        let mut o = OptionMap::parse("--blockdev", "node-name=n,aio=posix").unwrap();
        let err = o.take_choice("aio", &["io_uring", "threads"]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "--blockdev node-name=n: Parameter 'aio' does not accept value 'posix' (one of io_uring, threads)"
        );
    }

    #[test]
    fn the_first_item_may_be_the_implied_key() {
        let mut o = OptionMap::parse_implied("--blockdev", "file,node-name=f,filename=/x", "driver").unwrap();
        assert_eq!(o.require("driver").unwrap(), "file");
        let mut o = OptionMap::parse_implied("--export", "type=nbd,id=e", "type").unwrap();
        assert_eq!(o.require("type").unwrap(), "nbd", "given by name, as before");
        let mut o = OptionMap::parse_implied("--blockdev", r#"{"driver": "raw"}"#, "driver").unwrap();
        assert_eq!(o.require("driver").unwrap(), "raw", "JSON has no implied key");
        assert!(OptionMap::parse_implied("--blockdev", "node-name=a,file", "driver").is_err(), "only first");
    }

    #[test]
    fn sizes_and_syntax() {
        assert!(OptionMap::parse("--blockdev", "driver").is_err());
        assert!(OptionMap::parse("--blockdev", "a=1,a=2").is_err());
    }
}
