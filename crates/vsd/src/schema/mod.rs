//! `query-qmp-schema`: every command vsd has with the arguments it takes,
//! and every event it sends, in QEMU's introspection format. Commands
//! whose handlers parse a typed struct get the schema derived from that
//! struct; those that read their arguments as the command line's option
//! strings (`blockdev-add`, `block-export-add`, `object-add`,
//! `nbd-server-start`) have theirs declared here, from the same lists
//! their parsers use where such lists exist (drivers, object types).

mod introspect;
#[cfg(test)]
mod manual;
pub(crate) mod returns;
mod validate;

use serde_json::{Value, json};

pub(crate) use introspect::Introspection;

use crate::commands::Command;

/// The whole schema of `commands` and of vsd's events.
pub(crate) fn introspect(commands: &[Command]) -> Value {
    let mut schema = Introspection::new();
    for (name, definition) in definitions() {
        schema.define(&name, definition);
    }
    for command in commands {
        let args = command.args.map(|args| args(&mut schema));
        schema.command(command.name, args, command.returns.map(|returns| returns()), command.out_of_band);
    }
    for (event, data) in events() {
        schema.event(event, Some(data));
    }
    schema.finish()
}

/// A JSON Schema object of `members`, a name ending in `?` optional.
fn object(members: &[(&str, Value)]) -> Value {
    let mut properties = serde_json::Map::new();
    let mut required = Vec::new();
    for (name, schema) in members {
        match name.strip_suffix('?') {
            Some(name) => properties.insert(name.to_string(), schema.clone()),
            None => {
                required.push(json!(name));
                properties.insert(name.to_string(), schema.clone())
            }
        };
    }
    json!({"type": "object", "properties": properties, "required": required})
}

fn string() -> Value {
    json!({"type": "string"})
}

fn int() -> Value {
    json!({"type": "integer"})
}

fn boolean() -> Value {
    json!({"type": "boolean"})
}

fn one_of(values: &[&str]) -> Value {
    json!({"type": "string", "enum": values})
}

fn list(of: Value) -> Value {
    json!({"type": "array", "items": of})
}

fn reference(definition: &str) -> Value {
    json!({ "$ref": format!("#/$defs/{definition}") })
}

/// `schema` marked as vsd's own, which QEMU lacks (QEMU's `unstable`).
fn vsd_own(mut schema: Value) -> Value {
    schema[introspect::FEATURES] = json!(["unstable"]);
    schema
}

/// A flat union of `cases`, each an object with `tag` fixed to its name;
/// the members all share become the base.
fn union(tag: &str, cases: Vec<(&str, Value)>) -> Value {
    let cases: Vec<Value> = cases
        .into_iter()
        .map(|(case, mut members)| {
            members["properties"][tag] = json!({ "const": case });
            if let Some(required) = members["required"].as_array_mut() {
                required.push(json!(tag));
            }
            members
        })
        .collect();
    json!({ "oneOf": cases })
}

/// The types more than one command, or a type itself, refers to.
fn definitions() -> serde_json::Map<String, Value> {
    let definitions = [
        ("BlockdevOptions", blockdev_union()),
        ("BlockdevRef", json!({"anyOf": [reference("BlockdevOptions"), string()]})),
        ("BlockdevRefOrNull", json!({"anyOf": [reference("BlockdevOptions"), string(), {"type": "null"}]})),
        ("SocketAddress", socket_address()),
        ("BlockDeviceInfo", returns::block_device_info()),
        ("ImageInfo", returns::image_info()),
        ("BlockStats", returns::block_stats_entry()),
    ];
    definitions.into_iter().map(|(name, schema)| (name.to_string(), schema)).collect()
}

/// Where `reply`, the answer of `command`, leaves the schema `returns`
/// declares for it: debug builds check every reply.
pub(crate) fn reply_mismatch(returns: fn() -> Value, reply: &Value) -> Option<String> {
    static DEFINITIONS: std::sync::LazyLock<serde_json::Map<String, Value>> = std::sync::LazyLock::new(definitions);
    validate::mismatch(&returns(), reply, &DEFINITIONS)
}

/// The job types vsd runs, as QEMU names them.
const JOB_TYPES: &[&str] = &["commit", "stream", "mirror", "backup", "create"];

fn job_status() -> Value {
    one_of(&[
        "undefined",
        "created",
        "running",
        "paused",
        "ready",
        "standby",
        "waiting",
        "pending",
        "aborting",
        "concluded",
        "null",
    ])
}

pub(crate) fn capabilities(_: &mut Introspection) -> Value {
    object(&[("enable?", list(one_of(&["oob"])))])
}

pub(crate) fn blockdev_options(_: &mut Introspection) -> Value {
    reference("BlockdevOptions")
}

pub(crate) fn blockdev_reopen(_: &mut Introspection) -> Value {
    object(&[("options", list(reference("BlockdevOptions")))])
}

/// Every driver vsd has; each case lists the options vsd's driver reads.
fn blockdev_union() -> Value {
    let common = |own: &[(&str, Value)]| {
        let mut members = vec![
            ("node-name?", string()),
            ("discard?", one_of(&["ignore", "unmap"])),
            ("cache?", object(&[("direct?", boolean()), ("no-flush?", boolean())])),
            ("read-only?", boolean()),
            ("auto-read-only?", boolean()),
            ("force-share?", boolean()),
            ("detect-zeroes?", one_of(&["off", "on", "unmap"])),
            ("active?", boolean()),
        ];
        members.extend(own.iter().cloned());
        object(&members)
    };
    let cases = vsd_block::DRIVERS.iter().map(|&driver| (driver, common(&driver_options(driver)))).collect();
    union("driver", cases)
}

/// The options of `driver`, beyond those every node takes.
fn driver_options(driver: &str) -> Vec<(&'static str, Value)> {
    let file = || reference("BlockdevRef");
    match driver {
        "file" | "host_device" => vec![
            ("filename", string()),
            ("locking?", one_of(&["off", "on", "auto"])),
            ("aio?", one_of(&["threads", "native", "io_uring"])),
        ],
        "raw" => vec![("file", file()), ("offset?", int()), ("size?", int())],
        "qcow2" => vec![
            ("file", file()),
            ("backing?", reference("BlockdevRefOrNull")),
            ("data-file?", file()),
            ("lazy-refcounts?", boolean()),
            ("pass-discard-request?", boolean()),
            ("discard-no-unref?", boolean()),
            ("l2-cache-size?", int()),
            ("l2-cache-entry-size?", int()),
            ("refcount-cache-size?", int()),
            ("cache-clean-interval?", int()),
        ],
        "null-co" | "null-aio" => vec![("size?", int()), ("latency-ns?", int()), ("read-zeroes?", boolean())],
        "nbd" => vec![
            ("server", reference("SocketAddress")),
            ("export?", string()),
            ("tls-creds?", string()),
            ("tls-hostname?", string()),
            ("reconnect-delay?", int()),
        ],
        "throttle" => vec![("throttle-group", string()), ("file", file())],
        "copy-on-read" => vec![("file", file()), ("bottom?", string())],
        "preallocate" => vec![("file", file()), ("prealloc-align?", int()), ("prealloc-size?", int())],
        "compress" | "snapshot-access" => vec![("file", file())],
        "copy-before-write" => vec![
            ("file", file()),
            ("target", file()),
            ("bitmap?", object(&[("node", string()), ("name", string())])),
            ("on-cbw-error?", one_of(&["break-guest-write", "break-snapshot"])),
            ("cbw-timeout?", int()),
        ],
        "blkdebug" => {
            let injection = object(&[
                ("event", string()),
                ("state?", int()),
                ("iotype?", one_of(&["read", "write", "write-zeroes", "discard", "flush", "block-status"])),
                ("errno?", int()),
                ("sector?", int()),
                ("once?", boolean()),
            ]);
            vec![("image", file()), ("inject-error?", list(injection))]
        }
        "rbd" => vec![
            ("pool", string()),
            ("image", string()),
            ("namespace?", string()),
            ("conf?", string()),
            ("snapshot?", string()),
            ("user?", string()),
            ("key-secret?", string()),
            ("auth-client-required?", list(one_of(&["cephx", "none"]))),
            ("server?", list(object(&[("host", string()), ("port", string())]))),
        ],
        "http" | "https" => {
            let mut options = vec![
                ("url", string()),
                ("readahead?", int()),
                ("timeout?", int()),
                ("username?", string()),
                ("password-secret?", string()),
                ("proxy-username?", string()),
                ("proxy-password-secret?", string()),
                ("cookie?", string()),
                ("cookie-secret?", string()),
            ];
            // QEMU's http driver lacks it; vsd's reads it for both.
            options.push(("sslverify?", if driver == "https" { boolean() } else { vsd_own(boolean()) }));
            options
        }
        _ => Vec::new(),
    }
}

/// The members of an object schema, each member of an object-valued one
/// as `member.inner` (a `$ref`, a list or a union stays one member).
fn flattened(schema: &Value) -> Vec<(String, &Value)> {
    let mut found = Vec::new();
    for (name, value) in schema["properties"].as_object().into_iter().flatten() {
        match value["properties"].as_object() {
            Some(inner) => found.extend(inner.iter().map(|(k, v)| (format!("{name}.{k}"), v))),
            None => found.push((name.clone(), value)),
        }
    }
    found
}

/// The case `tag = value` of a flat union schema.
fn case<'a>(union: &'a Value, tag: &str, value: &str) -> &'a Value {
    union["oneOf"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|case| case["properties"][tag]["const"] == value)
        .unwrap_or_else(|| panic!("no case {tag}={value}"))
}

/// `--blockdev DRIVER,help`: the driver's options, as `name=<type>`.
pub(crate) fn blockdev_help(driver: &str) -> Option<Vec<String>> {
    vsd_block::DRIVERS.contains(&driver).then(|| option_lines(case(&blockdev_union(), "driver", driver), "driver"))
}

/// `--export TYPE,help`: the export type's options, as `name=<type>`.
pub(crate) fn export_help(kind: &str) -> Option<Vec<String>> {
    let union = block_export_options(&mut Introspection::new());
    crate::daemon::EXPORT_TYPES.contains(&kind).then(|| option_lines(case(&union, "type", kind), "type"))
}

fn option_lines(schema: &Value, tag: &str) -> Vec<String> {
    let mut lines: Vec<String> = flattened(schema)
        .into_iter()
        .filter(|(name, _)| name != tag)
        .map(|(name, value)| format!("{name}=<{}>", kind(value)))
        .collect();
    lines.sort();
    lines
}

/// A member's type, in the words of QEMU's `help` lists.
fn kind(schema: &Value) -> String {
    if let Some(values) = schema["enum"].as_array() {
        return values.iter().filter_map(Value::as_str).collect::<Vec<_>>().join("|");
    }
    if let Some(reference) = schema["$ref"].as_str() {
        return reference.rsplit('/').next().unwrap_or(reference).to_string();
    }
    match schema["type"].as_str() {
        Some("boolean") => "bool".into(),
        Some("integer") => "int".into(),
        Some("array") => format!("list of {}", kind(&schema["items"])),
        Some(other) => other.into(),
        None => "any".into(),
    }
}

fn socket_address() -> Value {
    union(
        "type",
        vec![
            ("unix", object(&[("path", string())])),
            ("inet", object(&[("host", string()), ("port", string()), ("ipv4?", boolean()), ("ipv6?", boolean())])),
            ("fd", object(&[("str", string())])),
        ],
    )
}

pub(crate) fn block_export_options(_: &mut Introspection) -> Value {
    let base = |own: Vec<(&'static str, Value)>| {
        let mut members = vec![
            ("id", string()),
            ("node-name", string()),
            ("writable?", boolean()),
            ("writethrough?", boolean()),
            ("iothread?", string()),
            ("allow-inactive?", boolean()),
        ];
        members.extend(own);
        object(&members)
    };
    let vhost_user_blk = vec![
        ("addr", reference("SocketAddress")),
        ("logical-block-size?", int()),
        ("num-queues?", int()),
        ("serial?", vsd_own(string())),
        ("trace?", vsd_own(boolean())),
        ("poll-us?", vsd_own(int())),
        ("call-batch-us?", vsd_own(int())),
        ("num-threads?", vsd_own(int())),
        ("cpu-affinity?", vsd_own(string())),
        ("socket-mode?", vsd_own(string())),
        ("socket-owner?", vsd_own(string())),
        ("socket-group?", vsd_own(string())),
        ("iothread-vq-mapping?", vsd_own(list(object(&[("iothread", string()), ("vqs?", list(int()))])))),
    ];
    let nbd = vec![
        ("name?", string()),
        ("description?", string()),
        ("bitmaps?", list(string())),
        ("allocation-depth?", boolean()),
    ];
    let fuse =
        vec![("mountpoint", string()), ("growable?", boolean()), ("allow-other?", one_of(&["off", "on", "auto"]))];
    union("type", vec![("vhost-user-blk", base(vhost_user_blk)), ("nbd", base(nbd)), ("fuse", base(fuse))])
}

pub(crate) fn nbd_server_options(_: &mut Introspection) -> Value {
    let legacy = union(
        "type",
        ["unix", "inet", "fd"]
            .into_iter()
            .zip(socket_address()["oneOf"].as_array().cloned().unwrap_or_default())
            .map(|(kind, mut data)| {
                if let Some(properties) = data["properties"].as_object_mut() {
                    properties.remove("type");
                }
                if let Some(required) = data["required"].as_array_mut() {
                    required.retain(|m| m != "type");
                }
                (kind, object(&[("data", data)]))
            })
            .collect(),
    );
    object(&[
        ("addr", legacy),
        ("tls-creds?", string()),
        ("tls-authz?", string()),
        ("max-connections?", int()),
        ("handshake-max-seconds?", int()),
    ])
}

pub(crate) fn object_options(_: &mut Introspection) -> Value {
    let typed = |kind: &str| match kind {
        "string" => string(),
        "int" => int(),
        "bool" => boolean(),
        "QCryptoSecretFormat" => one_of(&["raw", "base64"]),
        "QCryptoTLSCredsEndpoint" => one_of(&["client", "server"]),
        "ThrottleLimits" => {
            let limits: Vec<(String, Value)> =
                vsd_block::throttle::Limits::keys().map(|k| (format!("{k}?"), int())).collect();
            object(&limits.iter().map(|(k, v)| (k.as_str(), v.clone())).collect::<Vec<_>>())
        }
        _ => json!(true),
    };
    // vsd's own: an iothread's CPUs.
    let own = |qom_type: &str, name: &str| qom_type == "iothread" && name == "cpu-affinity";
    let cases = crate::objects::TYPES
        .iter()
        .map(|&qom_type| {
            let properties = crate::objects::properties(qom_type).unwrap_or_default();
            let mut members: Vec<(String, Value)> = vec![("id".into(), string())];
            for property in properties {
                let (name, kind) = property.split_once("=<").unwrap_or((&property, "any>"));
                let schema = typed(kind.trim_end_matches('>'));
                members.push((format!("{name}?"), if own(qom_type, name) { vsd_own(schema) } else { schema }));
            }
            let members: Vec<(&str, Value)> = members.iter().map(|(n, v)| (n.as_str(), v.clone())).collect();
            (qom_type, object(&members))
        })
        .collect();
    union("qom-type", cases)
}

/// Every event vsd sends, with its data.
fn events() -> Vec<(&'static str, Value)> {
    let job_type = one_of(JOB_TYPES);
    let job = |extra: &[(&'static str, Value)]| {
        let mut members =
            vec![("type", job_type.clone()), ("device", string()), ("len", int()), ("offset", int()), ("speed", int())];
        members.extend(extra.iter().cloned());
        object(&members)
    };
    let status = job_status();
    vec![
        ("BLOCK_EXPORT_DELETED", object(&[("id", string())])),
        (
            "BLOCK_IMAGE_CORRUPTED",
            object(&[
                ("device", string()),
                ("node-name?", string()),
                ("msg", string()),
                ("offset?", int()),
                ("size?", int()),
                ("fatal", boolean()),
            ]),
        ),
        ("BLOCK_JOB_CANCELLED", job(&[])),
        ("BLOCK_JOB_COMPLETED", job(&[("error?", string())])),
        (
            "BLOCK_JOB_ERROR",
            object(&[
                ("device", string()),
                ("operation", one_of(&["read", "write"])),
                ("action", one_of(&["ignore", "report", "stop"])),
            ]),
        ),
        ("BLOCK_JOB_PENDING", object(&[("type", job_type.clone()), ("id", string())])),
        ("BLOCK_JOB_READY", job(&[])),
        ("JOB_STATUS_CHANGE", object(&[("id", string()), ("status", status)])),
        (
            "BLOCK_WRITE_THRESHOLD",
            object(&[("node-name", string()), ("amount-exceeded", int()), ("write-threshold", int())]),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// Every event some crate's source sends is in the schema.
    #[test]
    fn every_event_sent_is_described() {
        let described: Vec<&str> = events().into_iter().map(|(name, _)| name).collect();
        let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut sent = Vec::new();
        for source in sources(&crates) {
            let text = std::fs::read_to_string(&source).unwrap();
            for sender in ["emit(\"", "emit)(\"", "events(\""] {
                let names = text.split(sender).skip(1).filter_map(|rest| rest.split('"').next());
                sent.extend(
                    names
                        .filter(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
                        .map(String::from),
                );
            }
        }
        assert!(sent.len() >= described.len(), "found {sent:?}");
        for name in sent {
            assert!(described.contains(&name.as_str()), "{name} is sent and not in the schema");
        }
    }

    /// Every option a driver's source reads is in its case of
    /// `blockdev-add`'s schema (the options all nodes take aside).
    #[test]
    fn every_option_a_driver_reads_is_described() {
        let drivers = Path::new(env!("CARGO_MANIFEST_DIR")).join("../vsd-block/src/drivers");
        let common = ["read-only", "auto-read-only", "discard", "node-name", "driver", "cache", "detect-zeroes"];
        // Read from inside an option described as a whole.
        let nested = [("copy-before-write", "node"), ("copy-before-write", "name"), ("rbd", "host"), ("rbd", "port")];
        let mut missing = Vec::new();
        for &driver in vsd_block::DRIVERS {
            let module = match driver {
                "host_device" => "file".to_string(),
                "null-co" | "null-aio" => "null".to_string(),
                "https" => "http".to_string(),
                other => other.replace('-', "_"),
            };
            let described: Vec<String> =
                driver_options(driver).iter().map(|(name, _)| name.trim_end_matches('?').to_string()).collect();
            let files = [drivers.join(format!("{module}.rs"))].into_iter().chain(sources_in(&drivers.join(&module)));
            for source in files.filter(|f| f.exists()) {
                for key in options_read(&std::fs::read_to_string(&source).unwrap()) {
                    let inside = nested.contains(&(driver, key.as_str()));
                    if !common.contains(&key.as_str()) && !described.contains(&key) && !inside {
                        missing.push(format!("{driver}: '{key}' ({})", source.display()));
                    }
                }
            }
        }
        assert!(missing.is_empty(), "read and not in the schema: {missing:#?}");
    }

    /// Every option an export type's source reads is in its case of
    /// `block-export-add`'s schema.
    #[test]
    fn every_option_an_export_reads_is_described() {
        let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let union = block_export_options(&mut Introspection::new());
        let sources = [("vhost-user-blk", "vsd-export/src/config.rs"), ("nbd", "vsd-nbd/src/config.rs")];
        // Read inside an option described as a whole, or the NBD server's.
        let inside = ["vqs", "addr", "tls-creds", "tls-authz", "max-connections", "handshake-max-seconds"];
        let mut missing = Vec::new();
        for (kind, source) in sources {
            let case = union["oneOf"].as_array().unwrap().iter().find(|c| c["properties"]["type"]["const"] == kind);
            let described = &case.unwrap()["properties"];
            for key in options_read(&std::fs::read_to_string(crates.join(source)).unwrap()) {
                if described.get(&key).is_none() && !inside.contains(&key.as_str()) {
                    missing.push(format!("{kind}: '{key}' ({source})"));
                }
            }
        }
        assert!(missing.is_empty(), "read and not in the schema: {missing:#?}");
    }

    /// The option keys `source` reads by name (`take_bool("key")`, ...,
    /// `child(opts, "key")`), each up to its first dot.
    fn options_read(source: &str) -> Vec<String> {
        let key =
            |rest: &str| rest.split('"').next().unwrap_or_default().split('.').next().unwrap_or_default().to_string();
        // `child(opts, "key")` and the helpers that take the map first.
        let mut keys: Vec<String> = source.split("(opts, \"").skip(1).map(key).collect();
        for (at, _) in source.match_indices("(\"") {
            let call =
                source[..at].rsplit(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).next().unwrap_or_default();
            if call.starts_with("take") || call.starts_with("require") || call == "remove" {
                keys.push(key(&source[at + 2..]));
            }
        }
        keys
    }

    fn sources_in(dir: &Path) -> Vec<std::path::PathBuf> {
        std::fs::read_dir(dir).into_iter().flatten().map(|e| e.unwrap().path()).collect()
    }

    /// The Rust sources under each crate's `src`, tests left out.
    fn sources(crates: &Path) -> Vec<std::path::PathBuf> {
        let mut found = Vec::new();
        let mut dirs: Vec<_> = std::fs::read_dir(crates).unwrap().map(|e| e.unwrap().path().join("src")).collect();
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).into_iter().flatten().map(|e| e.unwrap().path()) {
                match entry.extension() {
                    _ if entry.is_dir() => dirs.push(entry),
                    Some(ext) if ext == "rs" && !entry.ends_with("tests.rs") => found.push(entry),
                    _ => {}
                }
            }
        }
        found
    }
}
