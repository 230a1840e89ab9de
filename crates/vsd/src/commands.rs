//! QMP commands, with QEMU's names, argument shapes and error wording.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{Map, Value, json};
use vsd_block::RemoveError;
use vsd_block::options::OptionMap;
use vsd_block::throttle::{GroupStats, ThrottleGroup};
use vsd_control::qmp::{Dispatch, ErrorClass, QmpError};
use vsd_export::ExportSnapshot;
use vsd_job::Verb;
use vsd_trace::{ExportLabel, OpKind, QueueSnapshot};

use crate::daemon::{Bins, Daemon, LatencyBins};
use crate::jobs::{BlockJobArgs, JobId};
use crate::qapi;
use crate::transaction::{Action, Transaction};

type Reply = Result<Value, QmpError>;

/// Every command, as `query-commands` lists them.
const COMMANDS: &[&str] = &[
    "qmp_capabilities",
    "query-version",
    "query-commands",
    "blockdev-add",
    "blockdev-del",
    "blockdev-set-active",
    "blockdev-reopen",
    "block-export-add",
    "block-export-del",
    "query-block-exports",
    "query-named-block-nodes",
    "query-blockstats",
    "block-latency-histogram-set",
    "block_resize",
    "block-dirty-bitmap-add",
    "block-dirty-bitmap-remove",
    "block-dirty-bitmap-clear",
    "block-dirty-bitmap-enable",
    "block-dirty-bitmap-disable",
    "block-dirty-bitmap-merge",
    "transaction",
    "blockdev-backup",
    "blockdev-mirror",
    "block-stream",
    "block-commit",
    "blockdev-snapshot",
    "blockdev-create",
    "query-jobs",
    "job-pause",
    "job-resume",
    "job-cancel",
    "job-complete",
    "job-dismiss",
    "job-finalize",
    "query-block-jobs",
    "block-job-cancel",
    "block-job-set-speed",
    "block-job-pause",
    "block-job-resume",
    "block-job-complete",
    "block-job-dismiss",
    "block-job-finalize",
    "nbd-server-start",
    "nbd-server-stop",
    "object-add",
    "object-del",
    "qom-get",
    "qom-set",
    "quit",
    // Write thresholds, backing files, query-block and block-job-change.
    "block-set-write-threshold",
    "change-backing-file",
    "query-block",
    "block-job-change",
];

/// How long a safe `block-export-del` waits for a front-end that has hung
/// up to be let go before it calls the export still in use.
const CLIENT_GONE_GRACE: Duration = Duration::from_millis(500);

impl Dispatch for Daemon {
    fn execute(&self, command: &str, arguments: Map<String, Value>) -> Reply {
        let args = Value::Object(arguments);
        match command {
            "query-version" => Ok(version()),
            "query-commands" => Ok(COMMANDS.iter().map(|name| json!({ "name": name })).collect()),
            "blockdev-add" => self.blockdev_add(args),
            "blockdev-del" => self.blockdev_del(qapi::parse(args)?),
            "blockdev-set-active" => self.blockdev_set_active(qapi::parse(args)?),
            "blockdev-reopen" => self.blockdev_reopen(&args),
            "block-export-add" => self.block_export_add(args),
            "block-export-del" => self.block_export_del(qapi::parse(args)?),
            "query-block-exports" => no_arguments(&args).map(|()| self.query_block_exports()),
            "query-named-block-nodes" => qapi::parse::<Flat>(args).map(|_| self.query_named_block_nodes()),
            "query-blockstats" => self.query_blockstats(qapi::parse(args)?),
            "block-latency-histogram-set" => self.latency_histogram_set(qapi::parse(args)?),
            "block_resize" => self.block_resize(qapi::parse(args)?),
            "block-dirty-bitmap-add" => self.transaction(vec![Action::AddBitmap(qapi::parse(args)?)], None),
            "block-dirty-bitmap-remove" => self.transaction(vec![Action::RemoveBitmap(qapi::parse(args)?)], None),
            "block-dirty-bitmap-clear" => self.transaction(vec![Action::ClearBitmap(qapi::parse(args)?)], None),
            "block-dirty-bitmap-enable" => self.transaction(vec![Action::EnableBitmap(qapi::parse(args)?)], None),
            "block-dirty-bitmap-disable" => self.transaction(vec![Action::DisableBitmap(qapi::parse(args)?)], None),
            "block-dirty-bitmap-merge" => self.transaction(vec![Action::MergeBitmaps(qapi::parse(args)?)], None),
            "transaction" => {
                let (actions, group) = qapi::parse::<Transaction>(args)?.parts()?;
                self.transaction(actions, group)
            }
            "blockdev-backup" => self.transaction(vec![Action::Backup(qapi::parse(args)?)], None),
            "blockdev-mirror" => self.blockdev_mirror(qapi::parse(args)?),
            "block-stream" => self.block_stream(qapi::parse(args)?),
            "block-commit" => self.block_commit(qapi::parse(args)?),
            "blockdev-snapshot" => self.blockdev_snapshot(&qapi::parse(args)?),
            "blockdev-create" => self.blockdev_create(qapi::parse(args)?),
            "query-jobs" => no_arguments(&args).map(|()| self.query_jobs()),
            "query-block-jobs" => no_arguments(&args).map(|()| self.query_block_jobs()),
            "block-job-set-speed" => self.block_job_set_speed(qapi::parse(args)?),
            "nbd-server-start" => self.nbd_server_start(args),
            "nbd-server-stop" => no_arguments(&args).and_then(|()| self.nbd_server_stop()),
            "object-add" => {
                self.objects.add(options("object-add", &args)?).map(|()| json!({})).map_err(QmpError::generic)
            }
            "object-del" => {
                self.objects.remove(&qapi::parse::<Id>(args)?.id).map(|()| json!({})).map_err(QmpError::generic)
            }
            "qom-get" => {
                let args: QomPath = qapi::parse(args)?;
                self.objects.get(&args.path, &args.property).map_err(|e| qom_error(&args.path, e))
            }
            "qom-set" => {
                let args: QomSet = qapi::parse(args)?;
                self.objects.set(&args.path, &args.property, &args.value).map_err(|e| qom_error(&args.path, e))?;
                Ok(json!({}))
            }
            "quit" => no_arguments(&args).map(|()| json!({})),
            "block-set-write-threshold" => self.block_set_write_threshold(qapi::parse(args)?),
            "change-backing-file" => self.change_backing_file(qapi::parse(args)?),
            "query-block" => no_arguments(&args).map(|()| self.query_block()),
            "block-job-change" => self.block_job_change(args),
            _ => match job_verb(command) {
                Some((false, verb)) => self.job_verb(&qapi::parse::<JobId>(args)?.id, verb),
                Some((true, verb @ (Verb::Finalize | Verb::Dismiss))) => {
                    self.block_job_verb(&qapi::parse::<JobId>(args)?.id, verb)
                }
                Some((true, Verb::Cancel)) => self.block_job_cancel(qapi::parse(args)?),
                Some((true, verb)) => self.block_job_verb(&qapi::parse::<BlockJobArgs>(args)?.device, verb),
                None => {
                    Err(QmpError::new(ErrorClass::CommandNotFound, format!("The command {command} has not been found")))
                }
            },
        }
    }

    fn after_reply(&self, command: &str) {
        if command == "quit" {
            // The main thread waits for SIGTERM and shuts down in order.
            vsd_sys::raise_termination();
        }
    }
}

/// The verb a `job-*` command names, or a `block-job-*` one (true).
fn job_verb(command: &str) -> Option<(bool, Verb)> {
    let (block, rest) = match command.strip_prefix("block-") {
        Some(rest) => (true, rest),
        None => (false, command),
    };
    let name = rest.strip_prefix("job-")?;
    let verbs = [Verb::Cancel, Verb::Pause, Verb::Resume, Verb::Complete, Verb::Finalize, Verb::Dismiss];
    verbs.into_iter().find(|v| v.name() == name).map(|verb| (block, verb))
}

fn version() -> Value {
    let number = |text: &str| text.parse::<u64>().unwrap_or(0);
    json!({
        "qemu": {
            "major": number(env!("CARGO_PKG_VERSION_MAJOR")),
            "minor": number(env!("CARGO_PKG_VERSION_MINOR")),
            "micro": number(env!("CARGO_PKG_VERSION_PATCH")),
        },
        "package": concat!("vsd ", env!("CARGO_PKG_VERSION")),
    })
}

/// Arguments that take the same keys as the command line's option strings.
fn options(command: &str, args: &Value) -> Result<OptionMap, QmpError> {
    OptionMap::parse(command, &args.to_string()).map_err(generic)
}

fn no_arguments(args: &Value) -> Result<(), QmpError> {
    match args.as_object().and_then(|m| m.keys().next()) {
        Some(key) => Err(QmpError::generic(format!("Parameter '{key}' is unexpected"))),
        None => Ok(()),
    }
}

fn generic(e: impl std::fmt::Display) -> QmpError {
    QmpError::generic(format!("{e:#}"))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Flat {
    /// Accepted for QEMU compatibility: vsd's listing is always flat.
    #[serde(default, rename = "flat")]
    _flat: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Id {
    id: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QomPath {
    path: String,
    property: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QomSet {
    path: String,
    property: String,
    value: Value,
}

/// A `qom-get`/`qom-set` refusal: no object at `path` (QEMU's class for
/// it), or the property's own error.
fn qom_error(path: &str, error: Option<String>) -> QmpError {
    match error {
        None => QmpError::new(ErrorClass::DeviceNotFound, format!("Device '{path}' not found")),
        Some(message) => QmpError::generic(message),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct NodeName {
    node_name: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct SetActive {
    /// Every node if absent.
    node_name: Option<String>,
    active: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExportDel {
    id: String,
    #[serde(default)]
    mode: RemoveMode,
}

#[derive(Deserialize, Default, PartialEq)]
#[serde(rename_all = "lowercase")]
enum RemoveMode {
    #[default]
    Safe,
    Hard,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct StatsQuery {
    #[serde(default)]
    query_nodes: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct HistogramSet {
    id: String,
    boundaries: Option<Vec<u64>>,
    boundaries_read: Option<Vec<u64>>,
    boundaries_write: Option<Vec<u64>>,
    boundaries_flush: Option<Vec<u64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct Resize {
    device: Option<String>,
    node_name: Option<String>,
    size: i64,
}

impl Daemon {
    fn blockdev_add(&self, args: Value) -> Reply {
        self.add_blockdev(options("blockdev-add", &args)?).map_err(generic)?;
        Ok(json!({}))
    }

    fn blockdev_del(&self, args: NodeName) -> Reply {
        let mut guard = self.state();
        let state = &mut *guard;
        let node = state
            .graph
            .get(&args.node_name)
            .ok_or_else(|| QmpError::generic(format!("Failed to find node with node-name='{}'", args.node_name)))?;
        match self.jobs.user_of(&args.node_name) {
            Some((job, 0)) => return Err(QmpError::generic(crate::jobs::busy(&args.node_name, &job))),
            Some(_) => return Err(QmpError::generic(format!("Block device {} is in use", args.node_name))),
            None => {}
        }
        let (exports, stopping) = (&state.exports, &state.stopping);
        let exported = |name: &str| {
            let serving = exports.values().find(|e| e.node().name() == name).map(|e| e.id().to_string());
            serving.or_else(|| {
                stopping.iter().find(|(_, (node, _))| node == name).map(|(id, _)| format!("{id}, shutting down"))
            })
        };
        state.graph.remove(&args.node_name, exported).map_err(|e| match e {
            // Only a backing link blocks the deletion in QEMU: other
            // children are merely referenced.
            RemoveError::Child { role, .. } if role != "backing" => {
                QmpError::generic(format!("Block device {} is in use", args.node_name))
            }
            e => QmpError::generic(format!("Node '{}' is busy: {e}", args.node_name)),
        })?;
        node.close().map_err(|e| QmpError::generic(format!("Node '{}': writing back failed: {e}", args.node_name)))?;
        Ok(json!({}))
    }

    fn blockdev_set_active(&self, args: SetActive) -> Reply {
        self.set_active(args.node_name.as_deref(), args.active).map_err(generic)?;
        Ok(json!({}))
    }

    fn block_export_add(&self, args: Value) -> Reply {
        self.add_export(options("block-export-add", &args)?).map_err(generic)?;
        Ok(json!({}))
    }

    fn nbd_server_start(&self, mut args: Value) -> Reply {
        // QMP's addr is QAPI's legacy socket address, its fields under
        // "data"; the command line's is flat. Both are taken.
        if let Some(addr) = args.get_mut("addr").and_then(Value::as_object_mut)
            && let Some(Value::Object(data)) = addr.remove("data")
        {
            addr.extend(data);
        }
        self.start_nbd_server(options("nbd-server-start", &args)?).map_err(generic)?;
        Ok(json!({}))
    }

    fn nbd_server_stop(&self) -> Reply {
        for id in self.stop_nbd_server().map_err(generic)? {
            self.events.emit("BLOCK_EXPORT_DELETED", json!({ "id": id }));
        }
        Ok(json!({}))
    }

    fn block_export_del(&self, args: ExportDel) -> Reply {
        // A front-end that has just hung up is let go by the export's own
        // thread, a moment later: a safe deletion gives it that moment.
        let deadline = Instant::now() + CLIENT_GONE_GRACE;
        let state = loop {
            let state = self.state();
            if state.stopping.contains_key(&args.id) {
                return Err(QmpError::generic(format!("Export '{}' is already shutting down", args.id)));
            }
            let export = state
                .exports
                .get(&args.id)
                .ok_or_else(|| QmpError::generic(format!("Export '{}' is not found", args.id)))?;
            if args.mode == RemoveMode::Hard || !export.has_client() {
                break state;
            }
            if Instant::now() >= deadline {
                return Err(QmpError::generic(format!(
                    "export '{}' still in use (use mode='hard' to disconnect the front-end)",
                    args.id
                )));
            }
            drop(state);
            std::thread::sleep(Duration::from_millis(10));
        };
        drop(self.delete_export(state, &args.id));
        self.events.emit("BLOCK_EXPORT_DELETED", json!({ "id": args.id }));
        Ok(json!({}))
    }

    fn query_block_exports(&self) -> Value {
        let state = self.state();
        let entry = |kind: &str, id: &str, node: &str, shutting_down: bool| json!({ "type": kind, "id": id, "node-name": node, "shutting-down": shutting_down });
        let serving = state.exports.values().map(|e| entry(e.kind(), e.id(), e.node().name(), false));
        let stopping = state.stopping.iter().map(|(id, (node, kind))| entry(kind, id, node, true));
        serving.chain(stopping).collect()
    }

    fn query_named_block_nodes(&self) -> Value {
        self.state().graph.nodes().map(crate::query_block::device_info).collect()
    }

    fn query_blockstats(&self, args: StatsQuery) -> Reply {
        let state = self.state();
        let snapshots: Vec<(&str, String, ExportSnapshot)> =
            state.exports.values().map(|e| (e.id(), e.node().name().to_string(), e.stats())).collect();
        let mut entries: Vec<Value> = snapshots
            .iter()
            .map(|(id, node, snapshot)| {
                let mut entry = json!({
                    "device": "",
                    "qdev": id,
                    "node-name": node,
                    "stats": device_stats(&snapshot.merged(), state.histograms.get(*id)),
                    "x-vsd": snapshot,
                });
                entry["x-vsd"]["export"] = json!(id);
                entry
            })
            .collect();
        if args.query_nodes {
            // A node's figures are what it was sent: by the nodes above it
            // (counted from submission to completion) and by the exports
            // serving it (counted by the export, from kick to call).
            for node in state.graph.nodes() {
                let mut stats = node.stats().unwrap_or_default();
                for (_, _, snapshot) in snapshots.iter().filter(|(_, n, _)| *n == node.name()) {
                    stats.merge(&snapshot.merged());
                }
                let mut entry = json!({ "device": "", "node-name": node.name(), "stats": device_stats(&stats, None) });
                if let Some(group) = node.throttle_group() {
                    entry["x-vsd-throttle"] = group_stats(&group);
                }
                entries.push(entry);
            }
        }
        Ok(Value::Array(entries))
    }

    fn latency_histogram_set(&self, args: HistogramSet) -> Reply {
        let mut state = self.state();
        let export = state
            .exports
            .get(&args.id)
            .ok_or_else(|| QmpError::new(ErrorClass::DeviceNotFound, format!("Device '{}' not found", args.id)))?;
        let merged = export.stats().merged();
        // Bins count from now: each keeps the histogram as it is as a baseline.
        let bins = |kind: OpKind, specific: Option<Vec<u64>>| -> Result<Option<Bins>, QmpError> {
            let Some(boundaries_ns) = specific.or_else(|| args.boundaries.clone()) else { return Ok(None) };
            if boundaries_ns.is_empty() || boundaries_ns.windows(2).any(|w| w[0] >= w[1]) || boundaries_ns[0] == 0 {
                return Err(QmpError::generic("boundaries must be positive and strictly increasing"));
            }
            Ok(Some(Bins { boundaries_ns, baseline: merged.op(kind).latency.clone() }))
        };
        let set = LatencyBins {
            read: bins(OpKind::Read, args.boundaries_read.clone())?,
            write: bins(OpKind::Write, args.boundaries_write.clone())?,
            flush: bins(OpKind::Flush, args.boundaries_flush.clone())?,
        };
        state.histograms.insert(args.id, set);
        Ok(json!({}))
    }

    fn block_resize(&self, args: Resize) -> Reply {
        let name =
            args.node_name.or(args.device).ok_or_else(|| QmpError::generic("Parameter 'node-name' is missing"))?;
        let size = u64::try_from(args.size)
            .ok()
            .filter(|s| *s > 0 && s % 512 == 0)
            .ok_or_else(|| QmpError::generic("Parameter 'size' must be a positive multiple of 512"))?;
        let state = self.state();
        let node = state.graph.get(&name).ok_or_else(|| {
            QmpError::new(ErrorClass::DeviceNotFound, format!("Cannot find device='' nor node-name='{name}'"))
        })?;
        if let Some((job, _)) = self.jobs.user_of(&name) {
            // A backup's source and target keep the same size.
            return Err(QmpError::generic(crate::jobs::busy(&name, &job)));
        }
        if !node.active() {
            return Err(QmpError::generic("Permission 'resize' unavailable on inactive node"));
        }
        node.resize(size).map_err(|e| QmpError::generic(format!("Cannot resize node '{name}': {e}")))?;
        for export in state.exports.values() {
            if let Err(e) = export.capacity_changed() {
                log::warn!("export '{}': cannot tell the front-end about the new size: {e}", export.id());
            }
        }
        Ok(json!({}))
    }
}

/// QEMU's BlockDeviceStats for a set of counters.
fn device_stats(s: &QueueSnapshot, bins: Option<&LatencyBins>) -> Value {
    let op = |kind| s.op(kind);
    let (rd, wr, fl, un) = (op(OpKind::Read), op(OpKind::Write), op(OpKind::Flush), op(OpKind::Unmap));
    let mut stats = json!({
        "rd_bytes": rd.bytes, "wr_bytes": wr.bytes, "unmap_bytes": un.bytes,
        // QEMU counts a failed request as failed only, not as an operation.
        // (Saturating: a snapshot taken mid-update may see the failure first.)
        "rd_operations": rd.ops.saturating_sub(rd.failed), "wr_operations": wr.ops.saturating_sub(wr.failed),
        "flush_operations": fl.ops.saturating_sub(fl.failed), "unmap_operations": un.ops.saturating_sub(un.failed),
        "rd_total_time_ns": rd.latency.sum_ns(), "wr_total_time_ns": wr.latency.sum_ns(),
        "flush_total_time_ns": fl.latency.sum_ns(), "unmap_total_time_ns": un.latency.sum_ns(),
        "failed_rd_operations": rd.failed, "failed_wr_operations": wr.failed,
        "failed_flush_operations": fl.failed, "failed_unmap_operations": un.failed,
        "invalid_rd_operations": 0, "invalid_wr_operations": 0, "invalid_flush_operations": 0,
        "invalid_unmap_operations": 0, "rd_merged": 0, "wr_merged": 0, "unmap_merged": 0,
        "wr_highest_offset": 0, "account_invalid": false, "account_failed": true, "timed_stats": [],
    });
    let Some(bins) = bins else { return stats };
    for (key, kind, set) in [
        ("rd_latency_histogram", OpKind::Read, &bins.read),
        ("wr_latency_histogram", OpKind::Write, &bins.write),
        ("flush_latency_histogram", OpKind::Flush, &bins.flush),
    ] {
        if let Some(set) = set {
            let since = op(kind).latency.since(&set.baseline);
            stats[key] = json!({ "boundaries": set.boundaries_ns, "bins": since.bins(&set.boundaries_ns) });
        }
    }
    stats
}

/// Prometheus text for every export.
pub(crate) fn metrics(daemon: &Daemon) -> String {
    let state = daemon.state();
    let snapshots: Vec<_> =
        state.exports.values().map(|e| (e.id().to_string(), e.node().name().to_string(), e.stats())).collect();
    let labelled: Vec<_> = snapshots.iter().map(|(export, node, s)| (ExportLabel { export, node }, s)).collect();
    let mut text = vsd_trace::prometheus(&labelled);
    text.push_str(&throttle_metrics(&daemon.objects.throttle_groups()));
    text
}

/// A throttle group's statistics, per direction, for `query-blockstats`.
fn group_stats(group: &ThrottleGroup) -> Value {
    let [read, write] = group
        .stats()
        .map(|s| json!({ "requests": s.requests, "bytes": s.bytes, "delayed": s.delayed, "wait_ns": s.wait_ns }));
    json!({ "group": group.name(), "read": read, "write": write })
}

/// A group metric: its name's end, its help text, and its value.
type GroupMetric = (&'static str, &'static str, fn(&GroupStats) -> f64);

/// Prometheus' metrics of every throttle group.
fn throttle_metrics(groups: &[Arc<ThrottleGroup>]) -> String {
    use std::fmt::Write;
    let metrics: [GroupMetric; 4] = [
        ("requests_total", "Requests a throttle group let through.", |s| s.requests as f64),
        ("bytes_total", "Bytes of those requests.", |s| s.bytes as f64),
        ("delayed_total", "Requests that waited for the group's limits.", |s| s.delayed as f64),
        ("wait_seconds_total", "Time requests waited for the group's limits.", |s| s.wait_ns as f64 / 1e9),
    ];
    let mut text = String::new();
    for (name, help, value) in metrics {
        let _ = writeln!(text, "# HELP vsd_throttle_{name} {help}\n# TYPE vsd_throttle_{name} counter");
        for group in groups {
            for (direction, stats) in ["read", "write"].iter().zip(group.stats()) {
                let labels = format!("group=\"{}\",direction=\"{direction}\"", group.name());
                let _ = writeln!(text, "vsd_throttle_{name}{{{labels}}} {}", value(&stats));
            }
        }
    }
    text
}
