//! QMP `block-set-write-threshold`: the node's writers send
//! `BLOCK_WRITE_THRESHOLD` once the first write ends past it (see
//! [`vsd_block::threshold`]).

use schemars::JsonSchema;
use serde::Deserialize;
use serde::de::{Deserializer, Error, Unexpected};
use serde_json::{Value, json};
use vsd_block::BlockNode;
use vsd_control::qmp::QmpError;

use crate::daemon::Daemon;

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct SetThreshold {
    node_name: String,
    /// QAPI's `uint64`; 0 disarms.
    #[serde(deserialize_with = "uint64")]
    write_threshold: u64,
}

/// A QAPI `uint64` as QEMU's input visitor takes it: a negative integer
/// wraps around (-1 is the largest); anything else but an integer
/// `expects uint64`.
fn uint64<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    let value = Value::deserialize(deserializer)?;
    let wrapped = value.as_u64().or_else(|| value.as_i64().map(|n| n as u64));
    wrapped.ok_or_else(|| D::Error::invalid_value(Unexpected::Other("not an integer"), &"u64"))
}

/// A node's threshold as QMP's `write_threshold` shows it: QAPI's `int`,
/// so the largest `uint64` shows as -1, as in QEMU.
pub(crate) fn shown(node: &dyn BlockNode) -> i64 {
    node.dirty_bitmaps().map_or(0, |bitmaps| bitmaps.write_threshold().get() as i64)
}

impl Daemon {
    pub(crate) fn block_set_write_threshold(&self, args: SetThreshold) -> Result<Value, QmpError> {
        let state = self.state();
        let not_found = || QmpError::generic(format!("Device '{}' not found", args.node_name));
        let node = state.graph.get(&args.node_name).ok_or_else(not_found)?;
        node.dirty_bitmaps().ok_or_else(not_found)?.write_threshold().set(args.write_threshold);
        Ok(json!({}))
    }
}
