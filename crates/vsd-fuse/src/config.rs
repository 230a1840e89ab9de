//! `--export type=fuse` options, with QEMU's names.

use vsd_block::options::{OptionError, OptionMap};

/// `allow-other=`: whether users other than the daemon's may open the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllowOther {
    /// Others may (the mount fails if it may not allow them).
    On,
    /// Only the daemon's user may.
    Off,
    /// On if the mount allows it (root, or `user_allow_other` in
    /// /etc/fuse.conf), else off: QEMU's default.
    Auto,
}

/// A FUSE export, as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportConfig {
    /// `id=`: the export's id among all exports.
    pub id: String,
    /// `node-name=`: the node it serves.
    pub node_name: String,
    /// `mountpoint=`: an existing regular file the node is mounted over.
    pub mountpoint: String,
    /// `writable=`: the file may be written (default off).
    pub writable: bool,
    /// `writethrough=`: every write is durable before its reply.
    pub writethrough: bool,
    /// `growable=`: a write past the end grows the node, as in QEMU;
    /// otherwise it ends at the end.
    pub growable: bool,
    /// `allow-other=`: see [`AllowOther`].
    pub allow_other: AllowOther,
    /// `allow-inactive=`: the node may be inactive.
    pub allow_inactive: bool,
    /// `iothread=`: the id of a `--object iothread`, which must exist, as in
    /// QEMU; vsd serves the file on reader threads of its own anyway.
    pub iothread: Option<String>,
}

impl ExportConfig {
    /// Reads the options of one `--export type=fuse`.
    pub fn from_options(opts: &mut OptionMap) -> Result<Self, OptionError> {
        let kind = opts.require("type")?;
        if kind != "fuse" {
            return Err(opts.invalid("type", kind, "fuse"));
        }
        let allow_other = match opts.take_choice("allow-other", &["on", "off", "auto"])? {
            Some("on") => AllowOther::On,
            Some("off") => AllowOther::Off,
            _ => AllowOther::Auto,
        };
        Ok(Self {
            id: opts.require("id")?,
            node_name: opts.require("node-name")?,
            mountpoint: opts.require("mountpoint")?,
            writable: opts.take_bool("writable")?.unwrap_or(false),
            writethrough: opts.take_bool("writethrough")?.unwrap_or(false),
            growable: opts.take_bool("growable")?.unwrap_or(false),
            allow_other,
            allow_inactive: opts.take_bool("allow-inactive")?.unwrap_or(false),
            iothread: opts.take("iothread"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ExportConfig, OptionError> {
        let mut opts = OptionMap::parse("--export", text).unwrap();
        let config = ExportConfig::from_options(&mut opts)?;
        opts.finish()?;
        Ok(config)
    }

    #[test]
    fn options_take_qemus_names_and_defaults() {
        let c = parse("type=fuse,id=e,node-name=n,mountpoint=/tmp/f").unwrap();
        assert_eq!((c.writable, c.growable, c.allow_other), (false, false, AllowOther::Auto));
        let c = parse("type=fuse,id=e,node-name=n,mountpoint=/f,writable=on,growable=on,allow-other=off").unwrap();
        assert_eq!((c.writable, c.growable, c.allow_other), (true, true, AllowOther::Off));
    }

    #[test]
    fn bad_options_are_refused_in_qemus_words() {
        let e = parse("type=fuse,id=e,node-name=n").unwrap_err().to_string();
        assert!(e.contains("mountpoint"), "{e}");
        let e = parse("type=fuse,id=e,node-name=n,mountpoint=/f,allow-other=yes").unwrap_err().to_string();
        assert!(e.contains("allow-other"), "{e}");
    }
}
