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

use base64::Engine;
use vsd_block::NodeObjects;
use vsd_block::options::OptionMap;
use vsd_block::throttle::{Limits, ThrottleGroup};
use vsd_export::{IoThread, PollConfig};
use vsd_nbd::ServerCreds;
use vsd_net::ClientCreds;

/// The objects by id.
#[derive(Default)]
pub struct Objects {
    by_id: Mutex<BTreeMap<String, Object>>,
}

enum Object {
    /// A `secret`'s bytes (decoded, if given as base64).
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
            "secret" => Object::Secret(secret(&mut opts)?),
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

impl NodeObjects for Objects {
    fn secret(&self, id: &str) -> Result<Vec<u8>, String> {
        match self.lock().get(id) {
            Some(Object::Secret(bytes)) => Ok(bytes.clone()),
            Some(_) => Err(format!("object '{id}' is not a secret")),
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
/// newline trimmed), decoded when `format=base64`.
fn secret(opts: &mut OptionMap) -> Result<Vec<u8>, String> {
    if opts.has("keyid") || opts.has("iv") {
        return Err("secrets encrypted with 'keyid' are not supported: give the secret in the clear".into());
    }
    let base64 = opts.take_choice("format", &["raw", "base64"]).map_err(|e| e.to_string())? == Some("base64");
    let given = match (opts.take("data"), opts.take("file")) {
        (Some(_), Some(_)) => return Err("'data' and 'file' are mutually exclusive".into()),
        (None, None) => return Err("'file' or 'data' must be provided".into()),
        (Some(data), None) => data.into_bytes(),
        (None, Some(path)) => std::fs::read(&path).map_err(|e| format!("Unable to read {path}: {e}"))?,
    };
    if !base64 {
        return Ok(given);
    }
    // Newlines are skipped, as QEMU's decoder skips them: a key file
    // written by `ceph-authtool -p` ends with one.
    let text: Vec<u8> = given.into_iter().filter(|&b| b != b'\n').collect();
    base64::engine::general_purpose::STANDARD.decode(&text).map_err(|e| format!("Invalid base64 secret: {e}"))
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
        assert_eq!(add(&objects, "secret,id=t").unwrap_err(), "'file' or 'data' must be provided");
        assert_eq!(add(&objects, "secret,id=t,data=a,file=b").unwrap_err(), "'data' and 'file' are mutually exclusive");
        assert!(add(&objects, "secret,id=t,data=%%,format=base64").unwrap_err().starts_with("Invalid base64 secret"));
        assert!(add(&objects, "secret,id=t,file=/nonexistent").unwrap_err().starts_with("Unable to read /nonexistent"));
        assert!(add(&objects, "secret,id=t,data=a,colour=red").unwrap_err().contains("unknown parameter 'colour'"));
        // A failed add leaves nothing behind.
        assert_eq!(objects.secret("t").unwrap_err(), "No secret with id 't'");
        assert_eq!(objects.remove("t").unwrap_err(), "object 't' not found");
        objects.remove("s").unwrap();
        assert_eq!(objects.secret("s").unwrap_err(), "No secret with id 's'");
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
