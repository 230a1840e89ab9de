//! QEMU-style option strings: `key=value,key=value` (a doubled comma is a
//! literal comma) or a JSON object, as `--blockdev` and `--export` take them.

use std::fmt;

use vsd_sys::size::parse_size;

/// A mistake in an option string; each names the option at fault.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
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
    entries: Vec<(String, String)>,
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
        for (i, (key, _)) in entries.iter().enumerate() {
            if entries[..i].iter().any(|(k, _)| k == key) {
                return Err(syntax(format!("parameter '{key}' appears twice")));
            }
        }
        let context = match entries.iter().find(|(k, _)| k == "node-name" || k == "id") {
            Some((k, v)) => format!("{flag} {k}={v}"),
            None => flag.to_string(),
        };
        Ok(Self { context, entries })
    }

    /// Parses `text` whose first item may be a bare value for `implied`, as
    /// QEMU writes `--object secret,id=...` (`qom-type=secret`) and
    /// `--chardev socket,id=...` (`backend=socket`).
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

    /// Removes and returns `key`'s value.
    pub fn take(&mut self, key: &str) -> Option<String> {
        let at = self.entries.iter().position(|(k, _)| k == key)?;
        Some(self.entries.remove(at).1)
    }

    /// Removes and returns `key`'s value, which must be present.
    pub fn require(&mut self, key: &str) -> Result<String, OptionError> {
        self.take(key).ok_or_else(|| OptionError::Missing { context: self.context.clone(), key: key.into() })
    }

    /// A boolean: on/off, true/false, yes/no.
    pub fn take_bool(&mut self, key: &str) -> Result<Option<bool>, OptionError> {
        self.take_parsed(key, "on or off", |v| match v {
            "on" | "true" | "yes" => Some(true),
            "off" | "false" | "no" => Some(false),
            _ => None,
        })
    }

    /// A byte count, with an optional k/M/G/T suffix (powers of 1024).
    pub fn take_size(&mut self, key: &str) -> Result<Option<u64>, OptionError> {
        self.take_parsed(key, "a size in bytes (suffixes k, M, G, T allowed)", |v| parse_size(v).ok())
    }

    /// A plain unsigned integer.
    pub fn take_u64(&mut self, key: &str) -> Result<Option<u64>, OptionError> {
        self.take_parsed(key, "an unsigned integer", |v| v.parse().ok())
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

    /// One of `choices`.
    pub fn take_choice(&mut self, key: &str, choices: &[&'static str]) -> Result<Option<&'static str>, OptionError> {
        let expected = format!("one of {}", choices.join(", "));
        self.take_parsed(key, &expected, |v| choices.iter().copied().find(|c| *c == v))
    }

    fn take_parsed<T>(
        &mut self,
        key: &str,
        expected: &str,
        parse: impl FnOnce(&str) -> Option<T>,
    ) -> Result<Option<T>, OptionError> {
        let Some(value) = self.take(key) else { return Ok(None) };
        match parse(&value) {
            Some(parsed) => Ok(Some(parsed)),
            None => Err(self.invalid(key, &value, expected)),
        }
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
            .partition(|(k, _)| k.starts_with(prefix) && k[prefix.len()..].starts_with('.'));
        self.entries = rest;
        if inner.is_empty() {
            return None;
        }
        let entries: Vec<_> = inner.into_iter().map(|(k, v)| (k[prefix.len() + 1..].to_string(), v)).collect();
        Some(OptionMap { context: format!("{} {prefix}", self.context), entries })
    }

    /// Removes the items of list `key`, written `key.0=...,key.1=...` (QEMU's
    /// dotted form of a JSON array of plain values).
    pub fn take_values(&mut self, key: &str) -> Vec<String> {
        (0..).map_while(|i| self.take(&format!("{key}.{i}"))).collect()
    }

    /// Removes the items of list `key` whose items are objects, written
    /// `key.0.a=...,key.0.b=...,key.1.a=...`, each as a map of its own.
    pub fn take_groups(&mut self, key: &str) -> Vec<OptionMap> {
        (0..).map_while(|i| self.take_group(&format!("{key}.{i}"))).collect()
    }

    /// `key`'s value, left in place.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// Whether `key` is present.
    pub fn has(&self, key: &str) -> bool {
        self.entries.iter().any(|(k, _)| k == key)
    }

    /// Sets `key` (which must be absent) to `value`.
    pub fn insert(&mut self, key: &str, value: impl Into<String>) {
        debug_assert!(!self.has(key));
        self.entries.push((key.into(), value.into()));
    }

    /// Fails if a key was not consumed.
    pub fn finish(self) -> Result<(), OptionError> {
        match self.entries.into_iter().next() {
            Some((key, _)) => Err(OptionError::Unknown { context: self.context, key }),
            None => Ok(()),
        }
    }
}

fn split_key_values(text: &str) -> Result<Vec<(String, String)>, String> {
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
        entries.push((key.to_string(), value.to_string()));
    }
    Ok(entries)
}

fn flatten_json(prefix: &str, value: &serde_json::Value, out: &mut Vec<(String, String)>) -> Result<(), String> {
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
fn flatten_value(key: String, value: &serde_json::Value, out: &mut Vec<(String, String)>) -> Result<(), String> {
    use serde_json::Value;
    match value {
        Value::Object(_) => flatten_json(&key, value, out)?,
        Value::String(s) => out.push((key, s.clone())),
        Value::Bool(b) => out.push((key, if *b { "on" } else { "off" }.into())),
        Value::Number(n) => out.push((key, n.to_string())),
        Value::Null => out.push((key, "null".into())),
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                flatten_value(format!("{key}.{i}"), item, out)?;
            }
        }
    }
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
        assert_eq!(group.entries, [("driver".to_string(), "file".to_string())]);
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
    fn sizes_and_syntax() {
        assert!(OptionMap::parse("--blockdev", "driver").is_err());
        assert!(OptionMap::parse("--blockdev", "a=1,a=2").is_err());
    }
}
