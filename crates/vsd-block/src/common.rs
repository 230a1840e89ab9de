//! The options QEMU gives every node besides the cache ones:
//! `detect-zeroes`, `force-share`, `auto-read-only` and `discard`.
//!
//! The graph reads them for every driver. `discard` is acted on by the
//! drivers that reach the host (file, host_device, rbd) and by the formats
//! (raw, qcow2), which take it from the options themselves, and for the
//! filters by the graph ([`DiscardsAnswered`]): without `discard=unmap`
//! each node answers discards at once, as QEMU's nodes. `auto-read-only`
//! is acted on by the file driver. On the other nodes both are checked
//! and dropped.

use vsd_engine::IoOp;

use crate::drivers::{Filter, Route};
use crate::options::{OptionError, OptionMap};
use crate::zeroes::DetectZeroes;

/// QEMU's spellings of `discard`: the first two ignore discards.
pub(crate) const DISCARD: &[&str] = &["ignore", "off", "unmap", "on"];

/// What the graph keeps of the common options of one node.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Common {
    pub(crate) detect_zeroes: DetectZeroes,
    /// `force-share=on`: the node lets other processes hold whatever they
    /// like of its images (QEMU's `qemu-img -U`); read-only nodes only.
    pub(crate) force_share: bool,
    /// `discard=unmap` (or `on`): the node acts on discards.
    pub(crate) acts_on_discards: bool,
}

impl Common {
    /// Those a child defined inline takes from its parent, as in QEMU.
    pub(crate) const INHERITED: [&'static str; 2] = ["auto-read-only", "force-share"];
    /// Those the drivers that act on them take themselves.
    const LEFT_TO_DRIVERS: [&'static str; 2] = ["discard", "auto-read-only"];

    /// Reads and checks them, in QEMU's words.
    pub(crate) fn take(opts: &mut OptionMap) -> Result<Self, OptionError> {
        // Checked here for every driver, read again by those acting on it.
        let mut check = opts.clone();
        let acts_on_discards = matches!(check.take_choice("discard", DISCARD)?, Some("unmap" | "on"));
        check.take_bool("auto-read-only")?;
        let read_only = check.take_bool("read-only")?.unwrap_or(false);
        let detect_zeroes = DetectZeroes::take(opts)?;
        let force_share = opts.take_bool("force-share")?.unwrap_or(false);
        if force_share && !read_only {
            return Err(opts.rejected("force-share=on can only be used with read-only images"));
        }
        Ok(Self { detect_zeroes, force_share, acts_on_discards })
    }

    /// Drops those the node's driver left: it has no use for them.
    pub(crate) fn drop_unused(opts: &mut OptionMap) {
        for key in Self::LEFT_TO_DRIVERS {
            opts.remove(key);
        }
    }
}

/// A request as a node without `discard=unmap` passes it on: a discard is
/// answered at once (QEMU's `discard=ignore`), and a write-zeroes may no
/// longer deallocate.
pub(crate) fn without_unmap(op: IoOp) -> Route {
    match op {
        IoOp::Discard { .. } => Route::Answer(0),
        IoOp::WriteZeroes { offset, len, may_unmap: true, fast } => {
            Route::Forward(IoOp::WriteZeroes { offset, len, may_unmap: false, fast })
        }
        op => Route::Forward(op),
    }
}

/// What the graph puts under a filter node without `discard=unmap`.
pub(crate) struct DiscardsAnswered;

impl Filter for DiscardsAnswered {
    fn route(&self, op: IoOp) -> Route {
        without_unmap(op)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take(text: &str) -> Result<Common, String> {
        Common::take(&mut OptionMap::parse("--blockdev", text).unwrap()).map_err(|e| e.to_string())
    }

    #[test]
    fn force_share_is_for_read_only_nodes() {
        assert!(take("force-share=on,read-only=on").unwrap().force_share);
        assert!(!take("force-share=off").unwrap().force_share);
        assert_eq!(
            take("node-name=n,force-share=on").unwrap_err(),
            "--blockdev node-name=n: force-share=on can only be used with read-only images"
        );
    }

    #[test]
    fn discard_and_auto_read_only_are_checked_for_every_driver() {
        assert!(take("discard=unmap,auto-read-only=on").is_ok());
        assert!(take("discard=sometimes").unwrap_err().contains("does not accept value 'sometimes'"));
        assert!(take("auto-read-only=maybe").unwrap_err().contains("'auto-read-only'"));
        for text in ["discard=unmap,auto-read-only=on", r#"{"discard": "unmap", "auto-read-only": true}"#] {
            let mut opts = OptionMap::parse("--blockdev", text).unwrap();
            Common::take(&mut opts).unwrap();
            assert!(opts.has("discard") && opts.has("auto-read-only"), "left for the driver");
            Common::drop_unused(&mut opts);
            opts.finish().unwrap();
        }
    }
}
