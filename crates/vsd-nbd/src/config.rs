//! `--nbd-server` and `--export type=nbd` options, with QEMU's names.

use std::time::Duration;

use vsd_block::options::{OptionError, OptionMap};
pub use vsd_nbd_proto::Address;

/// The NBD server, as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerConfig {
    /// `addr.*`: where it listens.
    pub addr: Address,
    /// `max-connections`: clients served at once, handshaking ones
    /// included (QEMU 10's default 100; 0 = no limit). More wait in the
    /// listen backlog.
    pub max_connections: u32,
    /// `handshake-max-seconds`: a client that has not finished negotiating
    /// by then is disconnected (QEMU's default 10; 0 = no limit).
    pub handshake_max: Option<Duration>,
    /// `tls-creds`: the id of a `tls-creds-x509` object; clients must then
    /// start TLS before anything else.
    pub tls_creds: Option<String>,
}

/// QEMU's `NBD_DEFAULT_MAX_CONNECTIONS`.
const DEFAULT_MAX_CONNECTIONS: u64 = 100;
/// QEMU's `NBD_DEFAULT_HANDSHAKE_MAX_SECS`.
const DEFAULT_HANDSHAKE_SECONDS: u64 = 10;

impl ServerConfig {
    /// Reads `--nbd-server` (or `nbd-server-start`, flattened) options.
    pub fn from_options(opts: &mut OptionMap) -> Result<Self, OptionError> {
        let addr = opts.take_address("addr")?;
        let max = opts.take_u64("max-connections")?.unwrap_or(DEFAULT_MAX_CONNECTIONS);
        let max_connections =
            u32::try_from(max).map_err(|_| opts.invalid("max-connections", max, "a 32-bit number"))?;
        let seconds = opts.take_u64("handshake-max-seconds")?.unwrap_or(DEFAULT_HANDSHAKE_SECONDS);
        let handshake_max = (seconds != 0).then(|| Duration::from_secs(seconds));
        let tls_creds = opts.take("tls-creds");
        if let Some(value) = opts.take("tls-authz") {
            let why = "nothing: vsd has no authorization objects; verify-peer=on already requires a certificate the CA signed";
            return Err(opts.invalid("tls-authz", value, why));
        }
        Ok(Self { addr, max_connections, handshake_max, tls_creds })
    }
}

/// An NBD export, as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportConfig {
    /// `id=`: the export's id among all exports.
    pub id: String,
    /// `node-name=`: the node it serves.
    pub node_name: String,
    /// `name=`: what clients ask for (default: the node's name, as QEMU).
    pub name: String,
    /// `description=`: free text for clients.
    pub description: String,
    /// `writable=`: clients may write (default off).
    pub writable: bool,
    /// `writethrough=`: every write is durable before its reply.
    pub writethrough: bool,
    /// `bitmaps=[...]`: dirty bitmaps of the node (or of a node below it
    /// through backing files) shown as `qemu:dirty-bitmap:NAME` contexts.
    pub bitmaps: Vec<String>,
    /// `allocation-depth=`: show the `qemu:allocation-depth` context.
    pub allocation_depth: bool,
    /// `allow-inactive=`: the node may be inactive (the other end of a
    /// live migration owns its image), so the export neither activates it
    /// nor keeps it from being inactivated; meanwhile clients may read
    /// and flush, other requests get EPERM, as QEMU's.
    pub allow_inactive: bool,
    /// `iothread=`: the id of a `--object iothread`, which must exist, as
    /// in QEMU; vsd serves each connection on a thread of its own anyway.
    pub iothread: Option<String>,
}

impl ExportConfig {
    /// Reads the options of one `--export type=nbd`.
    pub fn from_options(opts: &mut OptionMap) -> Result<Self, OptionError> {
        let kind = opts.require("type")?;
        if kind != "nbd" {
            return Err(opts.invalid("type", kind, "nbd"));
        }
        let id = opts.require("id")?;
        let node_name = opts.require("node-name")?;
        let name = opts.take("name").unwrap_or_else(|| node_name.clone());
        if name.len() > 4096 {
            return Err(opts.invalid("name", "(too long)", "at most 4096 bytes"));
        }
        let description = opts.take("description").unwrap_or_default();
        let writable = opts.take_bool("writable")?.unwrap_or(false);
        let writethrough = opts.take_bool("writethrough")?.unwrap_or(false);
        let bitmaps = opts.take_values("bitmaps");
        let allocation_depth = opts.take_bool("allocation-depth")?.unwrap_or(false);
        let allow_inactive = opts.take_bool("allow-inactive")?.unwrap_or(false);
        let iothread = opts.take("iothread");
        Ok(Self {
            id,
            node_name,
            name,
            description,
            writable,
            writethrough,
            bitmaps,
            allocation_depth,
            allow_inactive,
            iothread,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse<T>(text: &str, f: fn(&mut OptionMap) -> Result<T, OptionError>) -> Result<T, OptionError> {
        let mut opts = OptionMap::parse("--test", text).unwrap();
        let parsed = f(&mut opts)?;
        opts.finish()?;
        Ok(parsed)
    }

    #[test]
    fn server_options_take_qemu_s_defaults() {
        let unix = parse("addr.type=unix,addr.path=/run/nbd.sock", ServerConfig::from_options).unwrap();
        assert_eq!(unix.addr, Address::Unix("/run/nbd.sock".into()));
        assert_eq!((unix.max_connections, unix.handshake_max), (100, Some(Duration::from_secs(10))));
        assert_eq!(unix.tls_creds, None);
        let tls = parse("addr.type=unix,addr.path=p,tls-creds=tls0", ServerConfig::from_options).unwrap();
        assert_eq!(tls.tls_creds.as_deref(), Some("tls0"));
        let inet = "addr.type=inet,addr.host=127.0.0.1,addr.port=10809,max-connections=0,handshake-max-seconds=0";
        let inet = parse(inet, ServerConfig::from_options).unwrap();
        assert_eq!(inet.addr, Address::Inet { host: "127.0.0.1".into(), port: 10809 });
        assert_eq!((inet.max_connections, inet.handshake_max), (0, None));
        let passed = parse("addr.type=fd,addr.str=nbd", ServerConfig::from_options).unwrap();
        assert_eq!(passed.addr, Address::Fd("nbd".into()));
        for bad in [
            "addr.type=vsock,addr.cid=3",
            "addr.type=inet,addr.host=h,addr.port=http",
            "addr.type=unix,addr.path=p,tls-creds=t,tls-authz=a",
            "addr.type=unix",
            "addr.type=fd",
            "addr.type=fd,addr.str=3,addr.path=p",
        ] {
            assert!(parse(bad, ServerConfig::from_options).is_err(), "{bad}");
        }
    }

    #[test]
    fn export_options_default_the_name_to_the_node() {
        let e = parse("type=nbd,id=e,node-name=disk0,writable=on", ExportConfig::from_options).unwrap();
        assert_eq!((e.name.as_str(), e.writable, e.description.as_str()), ("disk0", true, ""));
        let named = parse("type=nbd,id=e,node-name=n,name=,description=hello", ExportConfig::from_options).unwrap();
        assert_eq!((named.name.as_str(), named.description.as_str()), ("", "hello"));
        let marked = parse("type=nbd,id=e,node-name=n,bitmaps.0=b,bitmaps.1=c", ExportConfig::from_options).unwrap();
        assert_eq!(marked.bitmaps, ["b", "c"]);
        let depth = parse("type=nbd,id=e,node-name=n,allocation-depth=on", ExportConfig::from_options).unwrap();
        assert!(depth.allocation_depth && !e.allocation_depth);
        assert!(parse("type=nbd,id=e,node-name=n,allocation-depth=2", ExportConfig::from_options).is_err());
        assert!(parse("type=nbd,id=e,node-name=n,num-queues=2", ExportConfig::from_options).is_err());
    }

    #[test]
    fn allow_inactive_and_iothread_are_off_unless_asked() {
        let e = parse("type=nbd,id=e,node-name=n", ExportConfig::from_options).unwrap();
        let on = parse("type=nbd,id=e,node-name=n,allow-inactive=true", ExportConfig::from_options).unwrap();
        assert!(on.allow_inactive && !e.allow_inactive);
        let threaded = parse("type=nbd,id=e,node-name=n,iothread=io0", ExportConfig::from_options).unwrap();
        assert_eq!((threaded.iothread.as_deref(), e.iothread), (Some("io0"), None));
        let err = parse("type=nbd,id=e,node-name=n,allow-inactive=2", ExportConfig::from_options).unwrap_err();
        assert!(err.to_string().contains("allow-inactive"), "{err}");
    }
}
