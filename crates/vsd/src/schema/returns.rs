//! What the commands that answer with data return, in QEMU's shapes
//! (vsd's own members marked `unstable`); debug builds hold every reply
//! to them (`validate`).

use serde_json::{Value, json};

use super::{boolean, int, list, object, one_of, reference, string, vsd_own};

/// `query-version`'s VersionInfo.
pub(crate) fn version() -> Value {
    let triple = object(&[("major", int()), ("minor", int()), ("micro", int())]);
    object(&[("qemu", triple), ("package", string())])
}

/// `query-commands`'s list of CommandInfo.
pub(crate) fn commands() -> Value {
    list(object(&[("name", string())]))
}

/// `query-qmp-schema`'s entities, not described further.
pub(crate) fn entities() -> Value {
    list(json!(true))
}

pub(crate) fn block_exports() -> Value {
    let export = object(&[
        ("id", string()),
        ("type", one_of(crate::daemon::EXPORT_TYPES)),
        ("node-name", string()),
        ("shutting-down", boolean()),
    ]);
    list(export)
}

pub(crate) fn named_block_nodes() -> Value {
    list(reference("BlockDeviceInfo"))
}

/// BlockDeviceInfo: a node as `query-named-block-nodes` and `query-block`
/// describe it.
pub(crate) fn block_device_info() -> Value {
    let bitmap = object(&[
        ("name?", string()),
        ("count", int()),
        ("granularity", int()),
        ("recording", boolean()),
        ("busy", boolean()),
        ("persistent", boolean()),
        ("inconsistent?", boolean()),
    ]);
    let mut members = vec![
        ("file", string()),
        ("node-name?", string()),
        ("ro", boolean()),
        ("drv", string()),
        ("backing_file?", string()),
        ("backing_file_depth", int()),
        ("active", boolean()),
        ("encrypted", boolean()),
        ("detect_zeroes", one_of(&["off", "on", "unmap"])),
    ];
    let limits = ["bps", "bps_rd", "bps_wr", "iops", "iops_rd", "iops_wr"];
    members.extend(limits.map(|limit| (limit, int())));
    members.extend([
        ("image", reference("ImageInfo")),
        ("cache", object(&[("writeback", boolean()), ("direct", boolean()), ("no-flush", boolean())])),
        ("write_threshold", int()),
        ("dirty-bitmaps?", list(bitmap)),
        // vsd's own: each child's node by role.
        ("children?", vsd_own(json!({"type": "object"}))),
    ]);
    object(&members)
}

/// ImageInfo, which holds the backing file's.
pub(crate) fn image_info() -> Value {
    object(&[
        ("filename", string()),
        ("format", string()),
        ("dirty-flag?", boolean()),
        ("actual-size?", int()),
        ("virtual-size", int()),
        ("cluster-size?", int()),
        ("encrypted?", boolean()),
        ("compressed?", boolean()),
        ("backing-filename?", string()),
        ("full-backing-filename?", string()),
        ("backing-filename-format?", string()),
        ("snapshots?", list(snapshot_info())),
        ("format-specific?", json!(true)),
        ("backing-image?", reference("ImageInfo")),
    ])
}

/// SnapshotInfo, also what `blockdev-snapshot-delete-internal-sync` returns.
pub(crate) fn snapshot_info() -> Value {
    object(&[
        ("id", string()),
        ("name", string()),
        ("vm-state-size", int()),
        ("date-sec", int()),
        ("date-nsec", int()),
        ("vm-clock-sec", int()),
        ("vm-clock-nsec", int()),
        ("icount?", int()),
    ])
}

pub(crate) fn block() -> Value {
    list(object(&[
        ("device", string()),
        ("qdev?", string()),
        ("type", string()),
        ("removable", boolean()),
        ("locked", boolean()),
        ("inserted?", reference("BlockDeviceInfo")),
        ("io-status?", one_of(&["ok", "failed", "nospace"])),
    ]))
}

/// `query-blockstats`'s BlockStats, with vsd's own per-stage figures.
pub(crate) fn block_stats() -> Value {
    list(reference("BlockStats"))
}

pub(crate) fn block_stats_entry() -> Value {
    object(&[
        ("device?", string()),
        ("qdev?", string()),
        ("node-name?", string()),
        ("stats", device_stats()),
        ("parent?", reference("BlockStats")),
        ("backing?", reference("BlockStats")),
        ("x-vsd?", vsd_own(json!({"type": "object"}))),
        // A throttle group's own counters, on its entry.
        ("x-vsd-throttle?", vsd_own(json!({"type": "object"}))),
    ])
}

/// BlockDeviceStats: every counter QEMU has, zone appends included.
fn device_stats() -> Value {
    let kinds = ["rd", "wr", "zone_append", "flush", "unmap"];
    let mut members: Vec<(String, Value)> = Vec::new();
    for kind in ["rd", "wr", "zone_append", "unmap"] {
        members.push((format!("{kind}_bytes"), int()));
    }
    for what in ["operations", "total_time_ns"] {
        members.extend(kinds.map(|kind| (format!("{kind}_{what}"), int())));
    }
    members.push(("wr_highest_offset".into(), int()));
    members.extend(["rd", "wr", "zone_append", "unmap"].map(|kind| (format!("{kind}_merged"), int())));
    members.push(("idle_time_ns?".into(), int()));
    for what in ["failed", "invalid"] {
        members.extend(kinds.map(|kind| (format!("{what}_{kind}_operations"), int())));
    }
    members.push(("account_invalid".into(), boolean()));
    members.push(("account_failed".into(), boolean()));
    members.push(("timed_stats".into(), list(json!({"type": "object"}))));
    let histogram = object(&[("boundaries", list(int())), ("bins", list(int()))]);
    let timed = ["rd", "wr", "zone_append", "flush"];
    members.extend(timed.map(|kind| (format!("{kind}_latency_histogram?"), histogram.clone())));
    object(&members.iter().map(|(name, schema)| (name.as_str(), schema.clone())).collect::<Vec<_>>())
}

pub(crate) fn jobs() -> Value {
    list(object(&[
        ("id", string()),
        ("type", one_of(super::JOB_TYPES)),
        ("status", super::job_status()),
        ("current-progress", int()),
        ("total-progress", int()),
        ("error?", string()),
    ]))
}

pub(crate) fn block_jobs() -> Value {
    let info = |own: &[(&'static str, Value)]| {
        let mut members = vec![
            ("device", string()),
            ("len", int()),
            ("offset", int()),
            ("busy", boolean()),
            ("paused", boolean()),
            ("speed", int()),
            ("io-status", one_of(&["ok", "failed", "nospace"])),
            ("ready", boolean()),
            ("status", super::job_status()),
            ("auto-finalize", boolean()),
            ("auto-dismiss", boolean()),
            ("error?", string()),
        ];
        members.extend(own.iter().cloned());
        object(&members)
    };
    let cases = super::JOB_TYPES
        .iter()
        .map(|&kind| (kind, if kind == "mirror" { info(&[("actively-synced", boolean())]) } else { info(&[]) }))
        .collect();
    list(super::union("type", cases))
}

pub(crate) fn chardevs() -> Value {
    list(object(&[("label", string()), ("filename", string()), ("frontend-open", boolean())]))
}

pub(crate) fn chardev_backends() -> Value {
    list(object(&[("name", string())]))
}

/// `qom-list`'s and `qom-list-properties`' ObjectPropertyInfo.
pub(crate) fn properties() -> Value {
    list(object(&[("name", string()), ("type", string()), ("description?", string()), ("default-value?", json!(true))]))
}

pub(crate) fn types() -> Value {
    list(object(&[("name", string()), ("abstract?", boolean()), ("parent?", string())]))
}

pub(crate) fn text() -> Value {
    string()
}

pub(crate) fn anything() -> Value {
    json!(true)
}
