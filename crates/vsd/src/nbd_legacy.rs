//! QMP's older NBD export commands, as QEMU keeps them: `nbd-server-add`
//! is a `block-export-add` of type `nbd` whose id is the export's name
//! (default: the device's), and `nbd-server-remove` a `block-export-del`
//! of an NBD export. Both need the server `nbd-server-start` started.

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use vsd_block::options::OptionMap;
use vsd_control::qmp::QmpError;
use vsd_nbd::NbdError;

use crate::commands::{ExportDel, RemoveMode};
use crate::daemon::{Daemon, Export, State};
use crate::jobs::{generic, node, well_formed};

/// `nbd-server-add`'s arguments (QAPI's `NbdServerAddOptions`).
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct NbdServerAdd {
    name: Option<String>,
    description: Option<String>,
    device: String,
    writable: Option<bool>,
    bitmap: Option<String>,
}

/// `nbd-server-remove`'s arguments.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NbdServerRemove {
    name: String,
    #[serde(default)]
    mode: RemoveMode,
}

impl Daemon {
    pub(crate) fn nbd_server_add(&self, args: NbdServerAdd) -> Result<Value, QmpError> {
        let state = self.state();
        let node = node(&state, &args.device)?;
        let name = args.name.unwrap_or(args.device);
        refuse_export_name(&state, &name)?;
        // A read-only node is exported read-only, where block-export-add
        // would refuse a writable export of it.
        let writable = args.writable.unwrap_or(false) && !node.read_only();
        let mut options = json!({
            "type": "nbd",
            "id": name,
            "node-name": node.name(),
            "name": name,
            "writable": writable,
        });
        if let Some(bitmap) = args.bitmap {
            options["bitmaps"] = json!([bitmap]);
        }
        if let Some(description) = args.description {
            options["description"] = json!(description);
        }
        drop(state);
        let options = OptionMap::parse("nbd-server-add", &options.to_string()).map_err(|e| generic(e.to_string()))?;
        self.add_export(options).map_err(in_qemu_words)?;
        Ok(json!({}))
    }

    pub(crate) fn nbd_server_remove(&self, args: NbdServerRemove) -> Result<Value, QmpError> {
        if let Some(export) = self.state().exports.get(&args.name)
            && !matches!(export, Export::Nbd(_))
        {
            return Err(generic(format!("Block export '{}' is not an NBD export", args.name)));
        }
        self.block_export_del(ExportDel { id: args.name, mode: args.mode })
    }
}

/// An export's refusal as QEMU words it for `nbd-server-add`: a bitmap's
/// without the export's id before it.
fn in_qemu_words(e: anyhow::Error) -> QmpError {
    match e.downcast_ref::<NbdError>() {
        Some(NbdError::Invalid { reason, .. }) => generic(reason.clone()),
        _ => generic(format!("{e:#}")),
    }
}

/// QEMU's checks of an export id that is also the export's NBD name, in
/// its order and words.
fn refuse_export_name(state: &State, name: &str) -> Result<(), QmpError> {
    if !well_formed(name) {
        return Err(generic("Invalid block export id"));
    }
    if state.exports.contains_key(name) || state.stopping.contains_key(name) {
        return Err(generic(format!("Block export id '{name}' is already in use")));
    }
    if state.nbd.is_none() {
        return Err(generic("NBD server not running"));
    }
    let named = |export: &Export| matches!(export, Export::Nbd(e) if e.config().name == name);
    if state.exports.values().any(named) {
        return Err(generic(format!("NBD server already has export named '{name}'")));
    }
    Ok(())
}
