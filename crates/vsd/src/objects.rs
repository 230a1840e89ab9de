//! User-created objects (`--object`, QMP `object-add`/`object-del`), as
//! QEMU's QOM names them: `secret`, which holds what nodes name by id
//! (`key-secret=ID` of an rbd node), `iothread`, a thread exports share
//! (`iothread=ID` of a vhost-user-blk export), `tls-creds-x509`, the NBD
//! server's certificates (`tls-creds=ID`), and `throttle-group`, limits
//! that `throttle` nodes share (`throttle-group=ID`), changed live with
//! `qom-set`.
//!
//! An I/O thread, credentials or a throttle group in use cannot be deleted (QEMU lets
//! credentials go and keeps a reference; here the NBD server must stop
//! first, so that what `object-del` removed is really out of use).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use cbc::cipher::block_padding::NoPadding;
use cbc::cipher::{BlockModeDecrypt, KeyIvInit};
use vsd_block::NodeObjects;
use vsd_block::options::OptionMap;
use vsd_block::throttle::{Limits, ThrottleGroup};
use vsd_export::{IoThread, PollConfig};
use vsd_nbd::ServerCreds;
use vsd_net::ClientCreds;

use vsd_control::qmp::QmpError;

use crate::chardev::Chardevs;

/// The objects by id, and the chardevs: QOM's `/objects` and `/chardevs`.
#[derive(Default)]
pub struct Objects {
    by_id: Mutex<BTreeMap<String, Object>>,
    pub(crate) chardevs: Chardevs,
}

enum Object {
    /// A `secret`'s bytes (decoded or decrypted, if given so).
    Secret(Vec<u8>),
    IoThread(Arc<IoThread>),
    TlsServer(Arc<ServerCreds>),
    TlsClient(Arc<ClientCreds>),
    ThrottleGroup(Arc<ThrottleGroup>),
}

impl Object {
    /// QOM's name of its type.
    fn type_name(&self) -> &'static str {
        match self {
            Object::Secret(_) => "secret",
            Object::IoThread(_) => "iothread",
            Object::TlsServer(_) | Object::TlsClient(_) => "tls-creds-x509",
            Object::ThrottleGroup(_) => "throttle-group",
        }
    }

    /// Whether something other than the object table holds it.
    fn in_use(&self) -> bool {
        match self {
            Object::Secret(_) => false,
            Object::IoThread(thread) => Arc::strong_count(thread) > 1,
            Object::TlsServer(creds) => Arc::strong_count(creds) > 1,
            Object::TlsClient(creds) => Arc::strong_count(creds) > 1,
            Object::ThrottleGroup(group) => Arc::strong_count(group) > 1,
        }
    }
}

/// The object types `--object` and `object-add` create, as QOM names them.
pub const TYPES: &[&str] = &["iothread", "secret", "throttle-group", "tls-creds-x509"];

/// The properties an object of type `qom_type` takes, as `--object
/// TYPE,help` lists them (QEMU's `NAME=<TYPE>`, sorted), if vsd has the type.
pub fn properties(qom_type: &str) -> Option<Vec<String>> {
    if !TYPES.contains(&qom_type) {
        return None;
    }
    let properties = qom::properties(qom_type)?;
    let mut lines: Vec<String> =
        properties.iter().filter(|(name, _)| name != "type").map(|(name, kind)| format!("{name}=<{kind}>")).collect();
    lines.sort();
    Some(lines)
}

impl Objects {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Object>> {
        // Objects are inserted and removed whole: a panic cannot leave one half-made.
        self.by_id.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Creates an object from its options, `qom-type` and `id` among them.
    /// Errors are QEMU's words.
    pub fn add(&self, mut opts: OptionMap) -> Result<(), String> {
        let qom_type = opts.require("qom-type").map_err(|e| e.to_string())?;
        let id = opts.require("id").map_err(|e| e.to_string())?;
        let duplicate = || format!("attempt to add duplicate property '{id}' to object (type 'container')");
        // Checked before an I/O thread starts, and again when it is in.
        if self.lock().contains_key(&id) {
            return Err(duplicate());
        }
        let object = match qom_type.as_str() {
            "secret" => Object::Secret(secret(&mut opts, |key| self.secret(key))?),
            "iothread" => Object::IoThread(iothread(&id, &mut opts)?),
            "tls-creds-x509" => tls_creds_x509(&mut opts)?,
            "throttle-group" => {
                Object::ThrottleGroup(Arc::new(ThrottleGroup::new(&id, Limits::from_options(&mut opts)?)))
            }
            _ => return Err(format!("invalid object type: {qom_type}")),
        };
        opts.finish().map_err(|e| e.to_string())?;
        let mut objects = self.lock();
        if objects.contains_key(&id) {
            return Err(duplicate());
        }
        objects.insert(id, object);
        Ok(())
    }

    /// Removes object `id`. Nodes keep what they took from a secret when
    /// they were opened, so a secret can go while they run, as in QEMU.
    pub fn remove(&self, id: &str) -> Result<(), String> {
        let mut objects = self.lock();
        match objects.get(id) {
            None => Err(format!("object '{id}' not found")),
            Some(object) if object.in_use() => Err(format!("object '{id}' is in use, can not be deleted")),
            Some(_) => {
                objects.remove(id);
                Ok(())
            }
        }
    }

    /// I/O thread `id`, for an export to run on.
    pub fn iothread(&self, id: &str) -> Result<Arc<IoThread>, String> {
        match self.lock().get(id) {
            Some(Object::IoThread(thread)) => Ok(thread.clone()),
            _ => Err(format!("iothread \"{id}\" not found")),
        }
    }
}

impl Objects {
    /// Credentials `id`, for the NBD server; errors are QEMU's.
    pub fn tls_creds(&self, id: &str) -> Result<Arc<ServerCreds>, String> {
        match self.lock().get(id) {
            Some(Object::TlsServer(creds)) => Ok(creds.clone()),
            Some(Object::TlsClient(_)) => Err("Expecting TLS credentials with a server endpoint".into()),
            Some(_) => Err(format!("Object with id '{id}' is not TLS credentials")),
            None => Err(format!("No TLS credentials with id '{id}'")),
        }
    }
}

impl Objects {
    /// Every throttle group, in id order (Prometheus' metrics).
    pub fn throttle_groups(&self) -> Vec<Arc<ThrottleGroup>> {
        let objects = self.lock();
        let groups = objects.values().filter_map(|o| match o {
            Object::ThrottleGroup(group) => Some(group.clone()),
            _ => None,
        });
        groups.collect()
    }

    /// QMP `qom-get`: a throttle group's `limits`. `path` is the object's
    /// id, or `/objects/ID`. The error says whether the object (`None`) or
    /// the property (`Some(message)`) is missing.
    pub fn get(&self, path: &str, property: &str) -> Result<serde_json::Value, Option<String>> {
        let objects = self.lock();
        let object = objects.get(path.strip_prefix("/objects/").unwrap_or(path)).ok_or(None)?;
        match (object, property) {
            (Object::ThrottleGroup(group), "limits") => Ok(group.limits().to_json()),
            _ => Err(Some(format!("Property '{}.{property}' not found", object.type_name()))),
        }
    }

    /// QMP `qom-set`: a throttle group's `limits`, all of them at once.
    pub fn set(&self, path: &str, property: &str, value: &serde_json::Value) -> Result<(), Option<String>> {
        let objects = self.lock();
        let object = objects.get(path.strip_prefix("/objects/").unwrap_or(path)).ok_or(None)?;
        match (object, property) {
            (Object::ThrottleGroup(group), "limits") => {
                group.set_limits(Limits::from_json(value).map_err(Some)?);
                Ok(())
            }
            _ => Err(Some(format!("Property '{}.{property}' not found", object.type_name()))),
        }
    }
}

impl Objects {
    /// QMP `qom-list`: the object at `path`'s properties and children.
    pub fn qom_list(&self, args: qom::ListArgs) -> Result<serde_json::Value, QmpError> {
        let mut nodes: Vec<(String, String)> = ["/", "/backend", "/objects", "/chardevs"]
            .iter()
            .map(|path| (path.to_string(), "container".into()))
            .collect();
        let objects = self.lock();
        nodes.extend(objects.iter().map(|(id, o)| (format!("/objects/{id}"), o.type_name().to_string())));
        drop(objects);
        nodes.extend(self.chardevs.qom_children().into_iter().map(|(id, kind)| (format!("/chardevs/{id}"), kind)));
        qom::list(&args.path, &nodes)
    }
}

/// QOM as vsd has it: the types of its objects and chardevs with their
/// properties (`qom-list-types`, `qom-list-properties`), and the tree
/// `qom-list` walks: `/objects/ID`, `/chardevs/ID` and `/backend`, as in
/// qemu-storage-daemon.
pub mod qom {
    use schemars::JsonSchema;
    use serde::Deserialize;
    use serde_json::{Value, json};
    use vsd_block::throttle::Limits;
    use vsd_control::qmp::{ErrorClass, QmpError};

    struct Type {
        name: &'static str,
        parent: Option<&'static str>,
        is_abstract: bool,
        interfaces: &'static [&'static str],
        /// Its own, each with QOM's name of its type.
        properties: &'static [(&'static str, &'static str)],
    }

    const CREATABLE: &[&str] = &["user-creatable"];

    const fn base(
        name: &'static str,
        parent: Option<&'static str>,
        properties: &'static [(&'static str, &'static str)],
    ) -> Type {
        Type { name, parent, is_abstract: true, interfaces: &[], properties }
    }

    const fn concrete(
        name: &'static str,
        parent: &'static str,
        properties: &'static [(&'static str, &'static str)],
    ) -> Type {
        Type { name, parent: Some(parent), is_abstract: false, interfaces: &[], properties }
    }

    const fn creatable(mut kind: Type) -> Type {
        kind.interfaces = CREATABLE;
        kind
    }

    /// QEMU's types of what vsd has, with the properties vsd takes
    /// (`cpu-affinity` is vsd's own); parents before children.
    const TYPES: &[Type] = &[
        base("object", None, &[("type", "string")]),
        base("interface", None, &[]),
        base("user-creatable", Some("interface"), &[]),
        concrete("container", "object", &[]),
        creatable(base("event-loop-base", Some("object"), &[])),
        concrete(
            "iothread",
            "event-loop-base",
            &[("cpu-affinity", "string"), ("poll-grow", "int"), ("poll-max-ns", "int"), ("poll-shrink", "int")],
        ),
        creatable(base(
            "secret_common",
            Some("object"),
            &[("format", "QCryptoSecretFormat"), ("iv", "string"), ("keyid", "string")],
        )),
        concrete("secret", "secret_common", &[("data", "string"), ("file", "string")]),
        base(
            "tls-creds",
            Some("object"),
            &[("dir", "string"), ("endpoint", "QCryptoTLSCredsEndpoint"), ("verify-peer", "bool")],
        ),
        creatable(concrete("tls-creds-x509", "tls-creds", &[])),
        // And an `x-` property of each limit, added by `properties`.
        creatable(concrete("throttle-group", "object", &[("limits", "ThrottleLimits")])),
        base("chardev", Some("object"), &[]),
        base("chardev-fd", Some("chardev"), &[]),
        concrete("chardev-file", "chardev-fd", &[]),
        concrete("chardev-stdio", "chardev-fd", &[]),
        concrete("chardev-null", "chardev", &[]),
        concrete("chardev-ringbuf", "chardev", &[]),
        concrete("chardev-memory", "chardev-ringbuf", &[]),
        concrete("chardev-socket", "chardev", &[("addr", "SocketAddress"), ("connected", "bool")]),
    ];

    fn find(name: &str) -> Option<&'static Type> {
        TYPES.iter().find(|t| t.name == name)
    }

    /// `name`'s type, then its parent's, up to the root.
    fn ancestry(name: &str) -> impl Iterator<Item = &'static Type> {
        std::iter::successors(find(name), |t| t.parent.and_then(find))
    }

    /// Whether `kind` is `wanted`, descends from it, or implements it.
    fn implements(kind: &Type, wanted: &str) -> bool {
        ancestry(kind.name).any(|t| {
            t.name == wanted || t.interfaces.iter().any(|interface| ancestry(interface).any(|i| i.name == wanted))
        })
    }

    /// Every property of type `name`, its ancestors' first, if vsd has it.
    pub fn properties(name: &str) -> Option<Vec<(String, &'static str)>> {
        find(name)?;
        let mut lineage: Vec<&Type> = ancestry(name).collect();
        lineage.reverse();
        let mut properties: Vec<(String, &'static str)> =
            lineage.iter().flat_map(|t| t.properties).map(|(p, kind)| (p.to_string(), *kind)).collect();
        if name == "throttle-group" {
            properties.extend(Limits::keys().map(|key| (format!("x-{key}"), "int")));
        }
        Some(properties)
    }

    /// `qom-list-types`.
    #[derive(Deserialize, JsonSchema)]
    #[serde(deny_unknown_fields)]
    pub struct ListTypesArgs {
        implements: Option<String>,
        #[serde(rename = "abstract")]
        include_abstract: Option<bool>,
    }

    /// `qom-list-types`: concrete types unless `abstract`, only those
    /// that are or implement `implements` if given.
    pub fn list_types(args: ListTypesArgs) -> Value {
        let listed = TYPES.iter().filter(|t| args.include_abstract.unwrap_or(false) || !t.is_abstract);
        let wanted = listed.filter(|t| args.implements.as_deref().is_none_or(|wanted| implements(t, wanted)));
        wanted
            .map(|t| {
                let mut info = json!({ "name": t.name });
                if let Some(parent) = t.parent {
                    info["parent"] = parent.into();
                }
                if t.is_abstract {
                    info["abstract"] = true.into();
                }
                info
            })
            .collect()
    }

    /// `qom-list-properties`.
    #[derive(Deserialize, JsonSchema)]
    #[serde(deny_unknown_fields)]
    pub struct ListPropertiesArgs {
        typename: String,
    }

    /// `qom-list-properties`: what an object of the type has. Interfaces
    /// have no objects.
    pub fn list_properties(args: ListPropertiesArgs) -> Result<Value, QmpError> {
        let name = &args.typename;
        let Some(properties) = properties(name) else {
            return Err(QmpError::new(ErrorClass::DeviceNotFound, format!("Class '{name}' not found")));
        };
        if ancestry(name).any(|t| t.name == "interface") {
            return Err(QmpError::generic("Parameter 'typename' expects a QOM type"));
        }
        Ok(properties.iter().map(|(name, kind)| json!({ "name": name, "type": kind })).collect())
    }

    /// `qom-list`.
    #[derive(Deserialize, JsonSchema)]
    #[serde(deny_unknown_fields)]
    pub struct ListArgs {
        pub(super) path: String,
    }

    /// `qom-list` over `nodes` (each path and type): the node's properties
    /// and its children, `child<TYPE>`.
    pub fn list(path: &str, nodes: &[(String, String)]) -> Result<Value, QmpError> {
        let (node, kind) = resolve(path, nodes)?;
        let own =
            properties(kind).unwrap_or_default().into_iter().map(|(name, kind)| json!({ "name": name, "type": kind }));
        let prefix = if node == "/" { "/".to_string() } else { format!("{node}/") };
        let children = nodes.iter().filter_map(|(child, kind)| {
            let name = child.strip_prefix(&prefix).filter(|name| !name.is_empty() && !name.contains('/'))?;
            Some(json!({ "name": name, "type": format!("child<{kind}>") }))
        });
        Ok(own.chain(children).collect())
    }

    /// The node `path` names, as QEMU resolves it: an absolute path
    /// exactly, a partial one (`sec0`, `objects/sec0`) by the one node
    /// it ends.
    fn resolve<'a>(path: &str, nodes: &'a [(String, String)]) -> Result<(&'a str, &'a str), QmpError> {
        fn components(path: &str) -> Vec<&str> {
            path.split('/').filter(|c| !c.is_empty()).collect()
        }
        let wanted = components(path);
        let matches: Vec<&(String, String)> = nodes
            .iter()
            .filter(|(node, _)| {
                let node = components(node);
                if path.starts_with('/') { node == wanted } else { node.ends_with(&wanted) }
            })
            .collect();
        match matches[..] {
            [(node, kind)] => Ok((node, kind)),
            [] => Err(QmpError::new(ErrorClass::DeviceNotFound, format!("Device '{path}' not found"))),
            _ => Err(QmpError::generic(format!("Path '{path}' is ambiguous"))),
        }
    }
}

impl NodeObjects for Objects {
    fn secret(&self, id: &str) -> Result<Vec<u8>, String> {
        match self.lock().get(id) {
            Some(Object::Secret(bytes)) => Ok(bytes.clone()),
            Some(_) => Err(format!("Object with id '{id}' is not a secret")),
            None => Err(format!("No secret with id '{id}'")),
        }
    }

    fn tls_client_creds(&self, id: &str) -> Result<Arc<ClientCreds>, String> {
        match self.lock().get(id) {
            Some(Object::TlsClient(creds)) => Ok(creds.clone()),
            Some(Object::TlsServer(_)) => Err("Expecting TLS credentials with a client endpoint".into()),
            Some(_) => Err(format!("Object with id '{id}' is not TLS credentials")),
            None => Err(format!("No TLS credentials with id '{id}'")),
        }
    }

    fn throttle_group(&self, id: &str) -> Result<Arc<ThrottleGroup>, String> {
        match self.lock().get(id) {
            Some(Object::ThrottleGroup(group)) => Ok(group.clone()),
            _ => Err(format!("Throttle group '{id}' does not exist")),
        }
    }
}

/// An I/O thread with QEMU's polling options (`poll-max-ns`, default
/// 32768 as in QEMU; `poll-grow`, `poll-shrink`, 0 for the default factor
/// 2) and vsd's `cpu-affinity` (`0-3` or `1:3`: the CPUs it may run on).
fn iothread(id: &str, opts: &mut OptionMap) -> Result<Arc<IoThread>, String> {
    let mut number =
        |key: &str, default: u64| opts.take_u64(key).map(|n| n.unwrap_or(default)).map_err(|e| e.to_string());
    let poll = PollConfig {
        max_ns: number("poll-max-ns", 32768)?,
        grow: number("poll-grow", 0)?,
        shrink: number("poll-shrink", 0)?,
    };
    let cpus = match opts.take("cpu-affinity") {
        Some(text) => vsd_sys::parse_cpu_list(&text, ':').map_err(|why| format!("cpu-affinity '{text}': {why}"))?,
        None => Vec::new(),
    };
    IoThread::start(id, poll, cpus).map(Arc::new).map_err(|e| format!("cannot start iothread '{id}': {e}"))
}

/// X.509 credentials read now from `dir` with QEMU's file names: a
/// server's (`endpoint=server`) or a client's (`endpoint=client`, QEMU's
/// default), for `driver=nbd`. `verify-peer` defaults to on, as in QEMU: a
/// server's clients need a certificate the CA signed (a client always
/// checks the server's).
fn tls_creds_x509(opts: &mut OptionMap) -> Result<Object, String> {
    let endpoint = opts.take_choice("endpoint", &["server", "client"]).map_err(|e| e.to_string())?;
    let verify_peer = opts.take_bool("verify-peer").map_err(|e| e.to_string())?.unwrap_or(true);
    if opts.take_bool("sanity-check").map_err(|e| e.to_string())? == Some(true) {
        return Err("sanity-check=on is not supported: vsd does not check certificates' usage and dates when it \
                    loads them (clients do when they connect); leave it out or give sanity-check=off"
            .into());
    }
    if opts.has("priority") {
        return Err("'priority' is not supported: vsd's TLS takes rustls' safe defaults (TLS 1.2 and 1.3)".into());
    }
    if opts.has("passwordid") {
        return Err("'passwordid' is not supported: give server-key.pem unencrypted".into());
    }
    let dir = opts.take("dir").ok_or("Missing 'dir' property value")?;
    match endpoint {
        Some("server") => ServerCreds::load(dir.as_ref(), verify_peer).map(|c| Object::TlsServer(Arc::new(c))),
        _ => ClientCreds::load(dir.as_ref()).map(|c| Object::TlsClient(Arc::new(c))),
    }
    .map_err(|e| error_chain(&e))
}

/// An error and its causes on one line, as anyhow's `{:#}` prints them.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text = format!("{text}: {cause}");
        source = cause.source();
    }
    text
}

/// A secret's bytes from `data=` or `file=` (read now, used as is, with no
/// newline trimmed). With `keyid` (libvirt's way) they are AES-256-CBC
/// ciphertext, in base64 if `format=base64`, decrypted with secret `keyid`;
/// without, `format=base64` data is decoded. An `iv` without `keyid` is
/// ignored, as QEMU ignores it.
fn secret(opts: &mut OptionMap, key: impl Fn(&str) -> Result<Vec<u8>, String>) -> Result<Vec<u8>, String> {
    let base64 = opts.take_choice("format", &["raw", "base64"]).map_err(|e| e.to_string())? == Some("base64");
    let given = match (opts.take("data"), opts.take("file")) {
        (Some(_), Some(_)) => return Err("'file' and 'data' are mutually exclusive".into()),
        (None, None) => return Err("Either 'file' or 'data' must be provided".into()),
        (Some(data), None) => data.into_bytes(),
        (None, Some(path)) => read_secret_file(&path)?,
    };
    let iv = opts.take("iv");
    match opts.take("keyid") {
        Some(keyid) => decrypt(&key(&keyid)?, iv.as_deref(), given, base64),
        None if base64 => decode_base64(&given),
        None => Ok(given),
    }
}

/// The whole file, or QEMU's words (GLib's, within) for why not.
fn read_secret_file(path: &str) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let failed = |what: &str, e: std::io::Error| {
        let why = vsd_job::strerror(e.raw_os_error().unwrap_or(libc::EIO));
        format!("Unable to read {path}: {what} \u{201c}{path}\u{201d}: {why}")
    };
    let mut file = std::fs::File::open(path).map_err(|e| failed("Failed to open file", e))?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).map_err(|e| failed("Error reading file", e))?;
    Ok(bytes)
}

/// Decrypts an encrypted secret's data (base64 first if `base64`) as QEMU
/// does: the key must be 32 bytes and the IV base64 of 16; the last byte of
/// the plaintext says how many to drop (PKCS#7 padding, of which QEMU checks
/// only that count, 0 to 16, so vsd takes what QEMU takes).
fn decrypt(key: &[u8], iv: Option<&str>, given: Vec<u8>, base64: bool) -> Result<Vec<u8>, String> {
    type Aes256CbcDec = cbc::Decryptor<aes::Aes256>;
    let key: &cbc::cipher::Key<Aes256CbcDec> = key.try_into().map_err(|_| "Key should be 32 bytes in length")?;
    let iv = decode_base64(iv.ok_or("IV is required to decrypt secret")?.as_bytes())?;
    let iv: &cbc::cipher::Iv<Aes256CbcDec> =
        iv.as_slice().try_into().map_err(|_| format!("IV should be 16 bytes in length not {}", iv.len()))?;
    let mut data = if base64 { decode_base64(&given)? } else { given };
    let len = data.len();
    // Without padding to remove, the only error is a partial block.
    Aes256CbcDec::new(key, iv)
        .decrypt_padded::<NoPadding>(&mut data)
        .map_err(|_| format!("Length {len} must be a multiple of block size 16"))?;
    // Whole blocks: a count up to 16 is never more than the bytes there.
    // No ciphertext is an empty secret (QEMU, reading the byte before its
    // buffer for the count, took it too).
    let padding = data.last().copied().unwrap_or(0);
    if padding > 16 {
        return Err(format!("Incorrect number of padding bytes ({padding}) found on decrypted data"));
    }
    data.truncate(len - usize::from(padding));
    Ok(data)
}

/// Base64 as QEMU reads it: only the alphabet, `=` and newlines (a key file
/// of `ceph-authtool -p` ends with one) pass; then, as GLib decodes,
/// newlines are skipped, each four characters give three
/// bytes but those where the third or fourth is `=`, and a last group of
/// fewer than four gives nothing.
pub(crate) fn decode_base64(text: &[u8]) -> Result<Vec<u8>, String> {
    if text.contains(&0) {
        return Err("Base64 data contains embedded NUL characters".into());
    }
    let sextet = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        b'=' => Some(0),
        _ => None,
    };
    let chars: Vec<u8> = text.iter().copied().filter(|&c| c != b'\n').collect();
    let sextets: Vec<u8> =
        chars.iter().map(|&c| sextet(c)).collect::<Option<_>>().ok_or("Base64 data contains invalid characters")?;
    let mut bytes = Vec::with_capacity(chars.len() / 4 * 3);
    for (group, values) in chars.chunks_exact(4).zip(sextets.chunks_exact(4)) {
        let [_, a, b, c] = values.iter().fold(0u32, |v, &sextet| v << 6 | u32::from(sextet)).to_be_bytes();
        bytes.push(a);
        bytes.extend((group[2] != b'=').then_some(b));
        bytes.extend((group[3] != b'=').then_some(c));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add(objects: &Objects, text: &str) -> Result<(), String> {
        objects.add(OptionMap::parse_implied("--object", text, "qom-type").unwrap())
    }

    #[test]
    fn secrets_read_back_raw_base64_and_from_files() {
        let objects = Objects::default();
        add(&objects, "secret,id=raw,data=pa,,ss").unwrap();
        add(&objects, "secret,id=b64,data=aGVsbG8=,format=base64").unwrap();
        let key = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(key.path(), b"aGVs\nbG8=\n").unwrap();
        add(&objects, &format!("secret,id=keyfile,file={},format=base64", key.path().display())).unwrap();
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), b"key\n").unwrap();
        add(&objects, &format!("secret,id=file,file={}", file.path().display())).unwrap();
        assert_eq!(objects.secret("raw").unwrap(), b"pa,ss");
        assert_eq!(objects.secret("b64").unwrap(), b"hello");
        assert_eq!(objects.secret("keyfile").unwrap(), b"hello");
        assert_eq!(objects.secret("file").unwrap(), b"key\n");
    }

    #[test]
    fn mistakes_are_qemus_errors() {
        let objects = Objects::default();
        add(&objects, "secret,id=s,data=x").unwrap();
        assert_eq!(
            add(&objects, "secret,id=s,data=y").unwrap_err(),
            "attempt to add duplicate property 's' to object (type 'container')"
        );
        assert_eq!(add(&objects, "iothread2,id=t").unwrap_err(), "invalid object type: iothread2");
        assert_eq!(add(&objects, "secret,id=t").unwrap_err(), "Either 'file' or 'data' must be provided");
        assert_eq!(add(&objects, "secret,id=t,data=a,file=b").unwrap_err(), "'file' and 'data' are mutually exclusive");
        assert_eq!(
            add(&objects, "secret,id=t,data=a%,format=base64").unwrap_err(),
            "Base64 data contains invalid characters"
        );
        assert_eq!(
            add(&objects, "secret,id=t,file=/nonexistent").unwrap_err(),
            "Unable to read /nonexistent: Failed to open file \u{201c}/nonexistent\u{201d}: No such file or directory"
        );
        assert_eq!(
            add(&objects, "secret,id=t,file=/").unwrap_err(),
            "Unable to read /: Error reading file \u{201c}/\u{201d}: Is a directory"
        );
        assert!(add(&objects, "secret,id=t,data=a,colour=red").unwrap_err().contains("unknown parameter 'colour'"));
        // A failed add leaves nothing behind.
        assert_eq!(objects.secret("t").unwrap_err(), "No secret with id 't'");
        assert_eq!(objects.remove("t").unwrap_err(), "object 't' not found");
        objects.remove("s").unwrap();
        assert_eq!(objects.secret("s").unwrap_err(), "No secret with id 's'");
    }

    /// The key of these vectors is bytes 0 to 31, the IV bytes 0xa0 to 0xaf;
    /// the ciphertexts are `openssl enc -aes-256-cbc -K .. -iv .. -base64`'s
    /// (with `-nopad` for a last byte of 17 or 0 in place of padding).
    const KEY: &str = "secret,id=key,format=base64,data=AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
    const IV: &str = "oKGio6SlpqeoqaqrrK2urw==";

    fn encrypted(data: &str, format: &str) -> String {
        format!("secret,id=s,data={data},keyid=key,iv={IV},format={format}")
    }

    #[test]
    fn secrets_encrypted_with_a_key_secret_decrypt_as_qemus() {
        let cases: [(&str, &[u8]); 4] = [
            (
                "Sq+rn3Uo5wjzkOXcmE9HpFbl6zmD2AYkVX1oVGGxS0bqVeZoXy4ztgDBPGwu0Z3p",
                b"AQD9kltipjBfHhAArt2hXYn7bZP7Mbb+M6h6hw==",
            ),
            ("q+vr2UaEM48l0zYn5sLNZ+vZ8e2ifnumhd2YnFeMrBo=", b"sixteen bytes!!!"),
            ("YA0Ho7myxOQIIVPW0XB6pg==", b""),
            // QEMU checks only the count: 0 drops nothing.
            ("XvbVFzjR5kUK5fEW0GCR7w==", b"fifteen bytes..\0"),
        ];
        for (ciphertext, plaintext) in cases {
            let objects = Objects::default();
            add(&objects, KEY).unwrap();
            add(&objects, &encrypted(ciphertext, "base64")).unwrap();
            assert_eq!(objects.secret("s").unwrap(), plaintext, "{ciphertext}");
        }
        // With format=raw, the ciphertext is the file's bytes as they are.
        let objects = Objects::default();
        add(&objects, KEY).unwrap();
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), decode_base64(b"q+vr2UaEM48l0zYn5sLNZ+vZ8e2ifnumhd2YnFeMrBo=").unwrap()).unwrap();
        add(&objects, &format!("secret,id=s,file={},keyid=key,iv={IV}", file.path().display())).unwrap();
        assert_eq!(objects.secret("s").unwrap(), b"sixteen bytes!!!");
        // No key needed without keyid: the IV is ignored, as by QEMU.
        add(&objects, "secret,id=plain,data=x,iv=%%").unwrap();
        assert_eq!(objects.secret("plain").unwrap(), b"x");
    }

    #[test]
    fn encrypted_secrets_are_refused_in_qemus_order_and_words() {
        let objects = Objects::default();
        add(&objects, KEY).unwrap();
        add(&objects, "secret,id=short,data=0123456789abcdef0123456789abcde").unwrap();
        add(&objects, "iothread,id=thread").unwrap();
        let refused = |text: &str| add(&objects, text).unwrap_err();
        let good = "YA0Ho7myxOQIIVPW0XB6pg==";
        assert_eq!(refused("secret,id=s,data=x,keyid=nokey"), "No secret with id 'nokey'");
        assert_eq!(refused("secret,id=s,data=x,keyid=thread"), "Object with id 'thread' is not a secret");
        assert_eq!(refused("secret,id=s,data=x,keyid=short,iv=%"), "Key should be 32 bytes in length");
        assert_eq!(refused("secret,id=s,data=x,keyid=key"), "IV is required to decrypt secret");
        assert_eq!(refused("secret,id=s,data=x,keyid=key,iv=%"), "Base64 data contains invalid characters");
        assert_eq!(refused("secret,id=s,data=x,keyid=key,iv=AAAA"), "IV should be 16 bytes in length not 3");
        // GLib drops a last group of fewer than four characters.
        assert_eq!(
            refused("secret,id=s,data=x,keyid=key,iv=oKGio6SlpqeoqaqrrK2urw"),
            "IV should be 16 bytes in length not 15"
        );
        assert_eq!(refused(&encrypted("%", "base64")), "Base64 data contains invalid characters");
        assert_eq!(refused(&encrypted(good, "raw")), "Length 24 must be a multiple of block size 16");
        assert_eq!(
            refused(&encrypted("ObsefVbF4HNMvbAygHaCbg==", "base64")),
            "Incorrect number of padding bytes (17) found on decrypted data"
        );
        // The data is read before the key is looked for.
        assert_eq!(refused("secret,id=s,keyid=nokey"), "Either 'file' or 'data' must be provided");
        assert_eq!(objects.secret("s").unwrap_err(), "No secret with id 's'");
    }

    #[test]
    fn base64_is_read_as_glib_reads_it() {
        let decoded = |text: &str| decode_base64(text.as_bytes()).unwrap();
        assert_eq!(decoded("aGVsbG8="), b"hello");
        assert_eq!(decoded("aGVs\nbG8=\n"), b"hello");
        assert_eq!(decoded("aGVsbG8"), b"hel");
        assert_eq!(decoded("aGVsbG8=aGk="), b"hellohi");
        assert_eq!(decoded("AB=C"), [0, 2]);
        assert_eq!(decoded("QQ=="), b"A");
        assert_eq!(decoded("QQ"), b"");
        assert_eq!(decode_base64(b"aGVs bG8=").unwrap_err(), "Base64 data contains invalid characters");
        assert_eq!(decode_base64(b"aGVs\0bG8=").unwrap_err(), "Base64 data contains embedded NUL characters");
    }

    #[test]
    fn tls_credentials_refuse_what_vsd_does_not_do() {
        let objects = Objects::default();
        let refused = |text: &str| add(&objects, text).unwrap_err();
        let missing = "Unable to access credentials /d/ca-cert.pem: No such file or directory (os error 2)";
        assert_eq!(refused("tls-creds-x509,id=t,dir=/d"), missing, "endpoint=client is QEMU's default");
        assert_eq!(refused("tls-creds-x509,id=t,dir=/d,endpoint=client"), missing);
        assert!(refused("tls-creds-x509,id=t,dir=/d,endpoint=peer").contains("endpoint"));
        assert_eq!(refused("tls-creds-x509,id=t,endpoint=server"), "Missing 'dir' property value");
        assert!(refused("tls-creds-x509,id=t,dir=/d,endpoint=server,priority=NORMAL").starts_with("'priority'"));
        assert!(refused("tls-creds-x509,id=t,dir=/d,endpoint=server,passwordid=s").starts_with("'passwordid'"));
        assert!(refused("tls-creds-x509,id=t,dir=/d,endpoint=server,sanity-check=on").starts_with("sanity-check=on"));
        assert_eq!(
            refused("tls-creds-x509,id=t,dir=/nonexistent,endpoint=server,sanity-check=off"),
            "Unable to access credentials /nonexistent/ca-cert.pem: No such file or directory (os error 2)"
        );
        add(&objects, "secret,id=s,data=x").unwrap();
        assert_eq!(objects.tls_creds("s").unwrap_err(), "Object with id 's' is not TLS credentials");
        assert_eq!(objects.tls_creds("t").unwrap_err(), "No TLS credentials with id 't'");
    }
}
