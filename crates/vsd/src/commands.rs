//! QMP commands, with QEMU's names, argument shapes and error wording.

use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use schemars::JsonSchema;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};
use vsd_block::RemoveError;
use vsd_block::options::OptionMap;
use vsd_block::throttle::{GroupStats, ThrottleGroup};
use vsd_control::qmp::{Dispatch, ErrorClass, QmpError};
use vsd_export::ExportSnapshot;
use vsd_job::Verb;
use vsd_trace::{ExportLabel, OpKind, QueueSnapshot, Stage};

use crate::daemon::{Bins, Daemon, LatencyBins};
use crate::jobs::{BlockJobArgs, JobId};
use crate::qapi;
use crate::schema::{self, Introspection, returns};
use crate::transaction::{Action, Transaction};

type Reply = Result<Value, QmpError>;

/// How a command runs, given its arguments.
type Handler = Box<dyn Fn(&Daemon, Value) -> Reply + Send + Sync>;

/// One QMP command: how it runs and what arguments it takes. The table
/// of them is what `query-commands` and `query-qmp-schema` list, and what
/// runs a command: a command's argument type is the one its handler
/// parses into, so the schema cannot drift from the code.
pub(crate) struct Command {
    pub(crate) name: &'static str,
    run: Handler,
    /// The schema of its arguments; `None` if it takes none.
    pub(crate) args: Option<fn(&mut Introspection) -> Value>,
    /// It may run out-of-band (QEMU's `allow-oob`).
    pub(crate) out_of_band: bool,
    /// The schema of what it answers; `None` if it answers `{}`.
    pub(crate) returns: Option<fn() -> Value>,
}

impl Command {
    /// A command whose arguments are `A`, as `qapi::parse` reads them.
    fn typed<A: DeserializeOwned + JsonSchema + 'static>(name: &'static str, handler: fn(&Daemon, A) -> Reply) -> Self {
        let run = Box::new(move |daemon: &Daemon, args| handler(daemon, qapi::parse(args)?));
        Self { name, run, args: Some(Introspection::schema_of::<A>), out_of_band: false, returns: None }
    }

    /// A command that takes no arguments.
    fn bare(name: &'static str, handler: fn(&Daemon) -> Reply) -> Self {
        let run = Box::new(move |daemon: &Daemon, args| no_arguments(&args).and_then(|()| handler(daemon)));
        Self { name, run, args: None, out_of_band: false, returns: None }
    }

    /// A command that reads its arguments itself (as the command line's
    /// option strings), with the schema declared for them.
    fn declared(
        name: &'static str,
        handler: fn(&Daemon, Value) -> Reply,
        args: fn(&mut Introspection) -> Value,
    ) -> Self {
        Self { name, run: Box::new(handler), args: Some(args), out_of_band: false, returns: None }
    }

    /// May run out-of-band: it waits on no lock that a blocking command
    /// holds (opening a node holds the node graph's), so that a client can
    /// follow its jobs while a command hangs. None of qemu-storage-daemon's
    /// commands may.
    fn out_of_band(self) -> Self {
        Self { out_of_band: true, ..self }
    }

    /// Answers with what `returns` describes.
    fn returning(self, returns: fn() -> Value) -> Self {
        Self { returns: Some(returns), ..self }
    }
}

/// Every command, in the order `query-commands` lists them.
pub(crate) static COMMANDS: LazyLock<Vec<Command>> = LazyLock::new(|| {
    use Command as C;
    vec![
        C::declared("qmp_capabilities", |_, _| Ok(json!({})), schema::capabilities),
        C::bare("query-version", |_| Ok(vsd_control::qmp::version())).out_of_band().returning(returns::version),
        C::bare("query-commands", |_| Ok(COMMANDS.iter().map(|c| json!({ "name": c.name })).collect()))
            .out_of_band()
            .returning(returns::commands),
        C::bare("query-qmp-schema", |_| Ok(schema::introspect(&COMMANDS))).out_of_band().returning(returns::entities),
        C::declared("blockdev-add", Daemon::blockdev_add, schema::blockdev_options),
        C::typed("blockdev-del", Daemon::blockdev_del),
        C::typed("blockdev-set-active", Daemon::blockdev_set_active),
        C::declared("blockdev-reopen", |d, args| d.blockdev_reopen(&args), schema::blockdev_reopen),
        C::declared("block-export-add", Daemon::block_export_add, schema::block_export_options),
        C::typed("block-export-del", Daemon::block_export_del),
        C::bare("query-block-exports", |d| Ok(d.query_block_exports())).returning(returns::block_exports),
        C::typed("query-named-block-nodes", |d, _: Flat| Ok(d.query_named_block_nodes()))
            .returning(returns::named_block_nodes),
        C::typed("query-blockstats", Daemon::query_blockstats).returning(returns::block_stats),
        C::typed("block-latency-histogram-set", Daemon::latency_histogram_set),
        C::typed("block_resize", Daemon::block_resize),
        C::typed("block-dirty-bitmap-add", |d, a| d.transaction(vec![Action::AddBitmap(a)], None)),
        C::typed("block-dirty-bitmap-remove", |d, a| d.transaction(vec![Action::RemoveBitmap(a)], None)),
        C::typed("block-dirty-bitmap-clear", |d, a| d.transaction(vec![Action::ClearBitmap(a)], None)),
        C::typed("block-dirty-bitmap-enable", |d, a| d.transaction(vec![Action::EnableBitmap(a)], None)),
        C::typed("block-dirty-bitmap-disable", |d, a| d.transaction(vec![Action::DisableBitmap(a)], None)),
        C::typed("block-dirty-bitmap-merge", |d, a| d.transaction(vec![Action::MergeBitmaps(a)], None)),
        C::typed("transaction", |d, t: Transaction| {
            let (actions, group) = t.parts()?;
            d.transaction(actions, group)
        }),
        C::typed("blockdev-backup", |d, a| d.transaction(vec![Action::Backup(a)], None)),
        C::typed("blockdev-mirror", Daemon::blockdev_mirror),
        C::typed("block-stream", Daemon::block_stream),
        C::typed("block-commit", Daemon::block_commit),
        C::typed("blockdev-snapshot", |d, a| d.blockdev_snapshot(&a)),
        C::typed("blockdev-snapshot-internal-sync", Daemon::blockdev_snapshot_internal_sync),
        C::typed("blockdev-snapshot-delete-internal-sync", Daemon::blockdev_snapshot_delete_internal_sync)
            .returning(returns::snapshot_info),
        C::typed("blockdev-create", Daemon::blockdev_create),
        C::bare("query-jobs", |d| Ok(d.query_jobs())).out_of_band().returning(returns::jobs),
        C::typed("job-pause", |d, a: JobId| d.job_verb(&a.id, Verb::Pause)),
        C::typed("job-resume", |d, a: JobId| d.job_verb(&a.id, Verb::Resume)),
        C::typed("job-cancel", |d, a: JobId| d.job_verb(&a.id, Verb::Cancel)),
        C::typed("job-complete", |d, a: JobId| d.job_verb(&a.id, Verb::Complete)),
        C::typed("job-dismiss", |d, a: JobId| d.job_verb(&a.id, Verb::Dismiss)),
        C::typed("job-finalize", |d, a: JobId| d.job_verb(&a.id, Verb::Finalize)),
        C::bare("query-block-jobs", |d| Ok(d.query_block_jobs())).out_of_band().returning(returns::block_jobs),
        C::typed("block-job-cancel", Daemon::block_job_cancel),
        C::typed("block-job-set-speed", Daemon::block_job_set_speed),
        C::typed("block-job-pause", |d, a: BlockJobArgs| d.block_job_verb(&a.device, Verb::Pause)),
        C::typed("block-job-resume", |d, a: BlockJobArgs| d.block_job_verb(&a.device, Verb::Resume)),
        C::typed("block-job-complete", |d, a: BlockJobArgs| d.block_job_verb(&a.device, Verb::Complete)),
        C::typed("block-job-dismiss", |d, a: JobId| d.block_job_verb(&a.id, Verb::Dismiss)),
        C::typed("block-job-finalize", |d, a: JobId| d.block_job_verb(&a.id, Verb::Finalize)),
        C::declared("nbd-server-start", Daemon::nbd_server_start, schema::nbd_server_options),
        C::bare("nbd-server-stop", Daemon::nbd_server_stop),
        C::declared("object-add", Daemon::object_add, schema::object_options),
        C::typed("object-del", |d, a: Id| d.objects.remove(&a.id).map(|()| json!({})).map_err(QmpError::generic)),
        C::typed("qom-get", |d, a: QomPath| d.objects.get(&a.path, &a.property).map_err(|e| qom_error(&a.path, e)))
            .returning(returns::anything),
        C::typed("qom-set", |d, a: QomSet| {
            d.objects.set(&a.path, &a.property, &a.value).map_err(|e| qom_error(&a.path, e))?;
            Ok(json!({}))
        }),
        C::bare("quit", |_| Ok(json!({}))),
        // The older commands that make their targets, and NBD's older
        // export commands.
        C::typed("drive-mirror", Daemon::drive_mirror),
        C::typed("drive-backup", |d, a| d.transaction(vec![Action::DriveBackup(a)], None)),
        C::typed("blockdev-snapshot-sync", |d, a| d.transaction(vec![Action::SnapshotSync(a)], None)),
        C::typed("nbd-server-add", Daemon::nbd_server_add),
        C::typed("nbd-server-remove", Daemon::nbd_server_remove),
        // Character devices and QOM.
        C::typed("chardev-add", |d, a| d.objects.chardevs.add(a)),
        C::typed("chardev-change", |d, a| d.objects.chardevs.change(a)),
        C::typed("chardev-remove", |d, a| d.objects.chardevs.remove(a)),
        C::typed("chardev-send-break", |d, a| d.objects.chardevs.send_break(a)),
        C::bare("query-chardev", |d| Ok(d.objects.chardevs.query())).returning(returns::chardevs),
        C::bare("query-chardev-backends", |_| Ok(crate::chardev::backends())).returning(returns::chardev_backends),
        C::typed("ringbuf-write", |d, a| d.objects.chardevs.ringbuf_write(a)),
        C::typed("ringbuf-read", |d, a| d.objects.chardevs.ringbuf_read(a)).returning(returns::text),
        C::typed("qom-list", |d, a| d.objects.qom_list(a)).returning(returns::properties),
        C::typed("qom-list-types", |_, a| Ok(crate::objects::qom::list_types(a))).returning(returns::types),
        C::typed("qom-list-properties", |_, a| crate::objects::qom::list_properties(a)).returning(returns::properties),
        // Write thresholds, backing files, query-block and block-job-change.
        C::typed("block-set-write-threshold", Daemon::block_set_write_threshold),
        C::typed("change-backing-file", Daemon::change_backing_file),
        C::bare("query-block", |d| Ok(d.query_block())).returning(returns::block),
        C::declared("block-job-change", Daemon::block_job_change, Introspection::schema_of::<crate::mirror::JobChange>),
    ]
});

/// Where `reply` leaves what `command` declares it answers.
#[cfg(debug_assertions)]
fn reply_mismatch(command: &Command, reply: &Value) -> Option<String> {
    match command.returns {
        Some(returns) => schema::reply_mismatch(returns, reply),
        None if reply.is_null() || *reply == json!({}) => None,
        None => Some(format!("{reply} where {{}} is declared")),
    }
}

/// The command named `name`.
fn command(name: &str) -> Result<&'static Command, QmpError> {
    COMMANDS
        .iter()
        .find(|c| c.name == name)
        .ok_or_else(|| QmpError::new(ErrorClass::CommandNotFound, format!("The command {name} has not been found")))
}

/// How long a safe `block-export-del` waits for a front-end that has hung
/// up to be let go before it calls the export still in use.
const CLIENT_GONE_GRACE: Duration = Duration::from_millis(500);

impl Dispatch for Daemon {
    fn execute(&self, name: &str, arguments: Map<String, Value>) -> Reply {
        let command = command(name)?;
        let reply = (command.run)(self, Value::Object(arguments));
        // The schema says it answers `{}`: tests catch a command that
        // starts answering more.
        #[cfg(debug_assertions)]
        if let Ok(value) = &reply
            && let Some(mismatch) = reply_mismatch(command, value)
        {
            // Tests see where the reply left the schema.
            return Err(QmpError::generic(format!("vsd: the reply of {name} is not its schema's: {mismatch}")));
        }
        reply
    }

    fn execute_oob(&self, name: &str, arguments: Map<String, Value>) -> Reply {
        let command = command(name)?;
        if !command.out_of_band {
            return Err(QmpError::generic(format!("The command {name} does not support OOB")));
        }
        (command.run)(self, Value::Object(arguments))
    }

    fn after_reply(&self, command: &str) {
        if command == "quit" {
            // The main thread waits for SIGTERM and shuts down in order.
            vsd_sys::raise_termination();
        }
    }
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

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct Flat {
    /// Accepted for QEMU compatibility: vsd's listing is always flat.
    #[serde(default, rename = "flat")]
    _flat: bool,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct Id {
    id: String,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct QomPath {
    path: String,
    property: String,
}

#[derive(Deserialize, JsonSchema)]
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

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct NodeName {
    node_name: String,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct SetActive {
    /// Every node if absent.
    node_name: Option<String>,
    active: bool,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ExportDel {
    pub(crate) id: String,
    #[serde(default)]
    pub(crate) mode: RemoveMode,
}

#[derive(Deserialize, JsonSchema, Default, PartialEq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum RemoveMode {
    #[default]
    Safe,
    Hard,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct StatsQuery {
    #[serde(default)]
    query_nodes: bool,
}

/// QEMU's, though not qemu-storage-daemon's.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
#[schemars(extend("x-features" = ["unstable"]))]
struct HistogramSet {
    id: String,
    boundaries: Option<Vec<u64>>,
    boundaries_read: Option<Vec<u64>>,
    boundaries_write: Option<Vec<u64>>,
    boundaries_flush: Option<Vec<u64>>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct Resize {
    device: Option<String>,
    node_name: Option<String>,
    size: i64,
}

impl Daemon {
    fn blockdev_add(&self, args: Value) -> Reply {
        self.add_blockdev(options("blockdev-add", &args)?).map_err(crate::inactive::added_node_error)?;
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

    fn object_add(&self, args: Value) -> Reply {
        self.objects.add(options("object-add", &args)?).map(|()| json!({})).map_err(QmpError::generic)
    }

    fn nbd_server_stop(&self) -> Reply {
        for id in self.stop_nbd_server().map_err(generic)? {
            self.events.emit("BLOCK_EXPORT_DELETED", json!({ "id": id }));
        }
        Ok(json!({}))
    }

    pub(crate) fn block_export_del(&self, args: ExportDel) -> Reply {
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
        crate::inactive::require_active(&node, "resize")?;
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
    // Zoned devices' appends, which vsd's nodes never see.
    for counter in ["bytes", "operations", "total_time_ns", "merged"].map(|c| format!("zone_append_{c}")) {
        stats[counter] = json!(0);
    }
    for counter in ["failed", "invalid"].map(|c| format!("{c}_zone_append_operations")) {
        stats[counter] = json!(0);
    }
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

/// The status page's data: every export with its statistics (queues
/// summed), the stages they are timed in, and the throttle groups, stamped
/// with `CLOCK_MONOTONIC` so that the page can turn counters into rates.
pub(crate) fn status(daemon: &Daemon) -> String {
    let state = daemon.state();
    let exports: Vec<Value> = state
        .exports
        .values()
        .map(|e| {
            json!({
                "id": e.id(), "type": e.kind(), "node": e.node().name(),
                "client": e.has_client(), "stats": e.stats().merged(),
            })
        })
        .collect();
    let stages: Vec<Value> = Stage::ALL.iter().map(|s| json!({ "name": s.name(), "label": s.label() })).collect();
    let groups: Vec<Value> = daemon.objects.throttle_groups().iter().map(|g| group_stats(g)).collect();
    json!({ "monotonic_ns": monotonic_ns(), "exports": exports, "stages": stages, "throttle_groups": groups })
        .to_string()
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock other programs on the host
/// (a test, a collector) can read too, unlike `Instant`'s.
fn monotonic_ns() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given, which lives here.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
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
