//! QMP's job commands (`blockdev-backup`, `job-*`, `block-job-*`,
//! `query-jobs`, `query-block-jobs`) over the daemon's [`Jobs`], with
//! QEMU's argument shapes and error wording.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use vsd_block::{BlockNode, Perms, User, Users};
use vsd_control::qmp::{ErrorClass, QmpError};
use vsd_job::backup::{Backup, BackupSpec, BitmapMode, Sync};
use vsd_job::{ErrorPolicy, Group, Job, JobBody, JobInfo, JobSpec, Status, Verb};

use crate::chain::Node;
use crate::daemon::{Daemon, Hold, State, hold};
use crate::inactive::{Filter, refuse_filter_over};
use crate::reopen::set_read_only_tree;

type Reply = Result<Value, QmpError>;

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct BackupArgs {
    pub(crate) job_id: Option<String>,
    pub(crate) device: String,
    pub(crate) target: String,
    pub(crate) sync: SyncArg,
    pub(crate) speed: Option<i64>,
    pub(crate) bitmap: Option<String>,
    pub(crate) bitmap_mode: Option<BitmapModeArg>,
    #[serde(default)]
    pub(crate) compress: bool,
    #[serde(default)]
    pub(crate) on_source_error: OnError,
    #[serde(default)]
    pub(crate) on_target_error: OnError,
    pub(crate) auto_finalize: Option<bool>,
    pub(crate) auto_dismiss: Option<bool>,
}

#[derive(Deserialize, JsonSchema, Clone, Copy, PartialEq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum SyncArg {
    Full,
    Top,
    None,
    Incremental,
    Bitmap,
}

#[derive(Deserialize, JsonSchema, Clone, Copy, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum BitmapModeArg {
    OnSuccess,
    Never,
    Always,
}

#[derive(Deserialize, JsonSchema, Clone, Copy, Default)]
#[serde(rename_all = "lowercase")]
pub(crate) enum OnError {
    #[default]
    Report,
    Ignore,
    Enospc,
    Stop,
}

impl From<OnError> for ErrorPolicy {
    fn from(policy: OnError) -> Self {
        match policy {
            OnError::Report => ErrorPolicy::Report,
            OnError::Ignore => ErrorPolicy::Ignore,
            OnError::Enospc => ErrorPolicy::Enospc,
            OnError::Stop => ErrorPolicy::Stop,
        }
    }
}

/// `job-*`'s argument.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct JobId {
    pub(crate) id: String,
}

/// `block-job-pause`'s, `-resume`'s and `-complete`'s argument.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct BlockJobArgs {
    pub(crate) device: String,
}

/// `block-job-cancel`'s arguments.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct BlockJobCancel {
    device: String,
    #[serde(default)]
    force: bool,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct SetSpeed {
    device: String,
    speed: i64,
}

pub(crate) fn generic(text: impl Into<String>) -> QmpError {
    QmpError::generic(text)
}

pub(crate) fn speed(value: i64) -> Result<u64, QmpError> {
    u64::try_from(value).map_err(|_| generic("Parameter 'speed' expects a non-negative value"))
}

/// QEMU's rule for ids: a letter, then letters, digits, `-`, `.`, `_`.
pub(crate) fn well_formed(id: &str) -> bool {
    let mut chars = id.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || "-._".contains(c))
}

/// A job's source's place in its [`JobSpec::nodes`] (the target's is 0).
pub(crate) const SOURCE: usize = 1;

/// What a node used by a job says when something else wants it.
pub(crate) fn busy(node: &str, job: &Job) -> String {
    format!("Node '{node}' is busy: block device is in use by block job: {}", job.kind())
}

impl Daemon {
    /// Starts a backup job (an action of [`Daemon::transaction`]).
    pub(crate) fn blockdev_backup(&self, args: BackupArgs, group: Option<Arc<Group>>) -> Result<Arc<Job>, QmpError> {
        self.start_backup(args, group, &|body| body)
    }

    /// Starts a backup job whose body `wrap` wraps (`drive-backup` lets
    /// the target it made go once the job ends).
    pub(crate) fn start_backup(
        &self,
        args: BackupArgs,
        group: Option<Arc<Group>>,
        wrap: &dyn Fn(Box<dyn JobBody>) -> Box<dyn JobBody>,
    ) -> Result<Arc<Job>, QmpError> {
        let mut state = self.state();
        let (source, target) = (node(&state, &args.device)?, node(&state, &args.target)?);
        if source.name() == target.name() {
            return Err(generic("Source and target cannot be the same"));
        }
        if below(&source, target.name()) {
            return Err(generic(format!("Target '{}' is below source '{}'", target.name(), source.name())));
        }
        if source.size() != target.size() {
            return Err(generic("Source and target image have different sizes"));
        }
        let (sync, bitmap) = backup_bitmap(&args, &source)?;
        if args.compress && !target.supports_compressed_writes() {
            // QEMU names the drive by its device name, which a node made by
            // --blockdev or blockdev-add has not: the name is empty.
            return Err(generic("Compression is not supported for this drive "));
        }
        if target.read_only() {
            return Err(generic(format!("Node '{}' is read-only", target.name())));
        }
        if let Some((job, _)) = self.jobs.user_of(target.name()) {
            return Err(generic(busy(target.name(), &job)));
        }
        // Backups may share their source, as in QEMU (each stacks its own
        // copy-before-write filter there); other jobs may not.
        let other_use = |(job, place): &(Arc<Job>, usize)| job.kind() != "backup" || *place != SOURCE;
        if let Some((job, _)) = self.jobs.users_of(source.name()).into_iter().find(other_use) {
            return Err(generic(busy(source.name(), &job)));
        }
        refuse_filter_over(&mut state, &[("file", &source), ("target", &target)], Filter::Opened)?;
        let id = args.job_id.unwrap_or_default();
        if !well_formed(&id) {
            return Err(generic(format!("Invalid job ID '{id}'")));
        }
        let Ok(speed) = speed(args.speed.unwrap_or(0)) else {
            // QEMU makes the job before it looks at the speed.
            for status in ["created", "null"] {
                self.events.emit("JOB_STATUS_CHANGE", json!({ "status": status, "id": id }));
            }
            return Err(generic("Parameter 'speed' expects a non-negative value"));
        };
        let bitmap = match bitmap {
            Some((bitmap, mode)) => Some((bitmap.take().map_err(|e| generic(e.to_string()))?, mode)),
            None => None,
        };
        let spec = JobSpec {
            id,
            kind: "backup",
            auto_finalize: args.auto_finalize.unwrap_or(true),
            auto_dismiss: args.auto_dismiss.unwrap_or(true),
            speed,
            // The target first: `blockdev-del` words the two differently.
            nodes: vec![target.name().to_string(), source.name().to_string()],
            group,
        };
        let claims = backup_claims(&mut state, &source, &target);
        let backup = Backup::new(BackupSpec {
            source,
            target,
            sync,
            bitmap,
            on_source_error: args.on_source_error.into(),
            on_target_error: args.on_target_error.into(),
            compress: args.compress,
        });
        let backup = Claiming::new(backup, &state.users, claims);
        self.jobs.start(spec, wrap(Box::new(backup))).map_err(generic)
    }

    /// The job for `job-*` commands.
    fn job(&self, id: &str) -> Result<Arc<Job>, QmpError> {
        self.jobs.get(id).ok_or_else(|| generic("Job not found"))
    }

    /// The job for `block-job-*` commands.
    pub(crate) fn block_job(&self, id: &str) -> Result<Arc<Job>, QmpError> {
        self.jobs
            .get(id)
            .filter(|job| job.info().block)
            .ok_or_else(|| QmpError::new(ErrorClass::DeviceNotActive, format!("Block job '{id}' not found")))
    }

    pub(crate) fn job_verb(&self, id: &str, verb: Verb) -> Reply {
        act(&*self.job(id)?, verb)
    }

    pub(crate) fn block_job_verb(&self, id: &str, verb: Verb) -> Reply {
        act(&*self.block_job(id)?, verb)
    }

    /// `block-job-cancel`: a ready job asked without `force` ends well.
    pub(crate) fn block_job_cancel(&self, args: BlockJobCancel) -> Reply {
        self.block_job(&args.device)?.block_cancel(args.force).map_err(generic)?;
        Ok(json!({}))
    }

    pub(crate) fn block_job_set_speed(&self, args: SetSpeed) -> Reply {
        let job = self.block_job(&args.device)?;
        job.set_speed(speed(args.speed)?).map_err(generic)?;
        Ok(json!({}))
    }

    pub(crate) fn query_jobs(&self) -> Value {
        let entry = |info: JobInfo| {
            let mut entry = json!({
                "id": info.id,
                "type": info.kind,
                "status": info.status.name(),
                "current-progress": info.progress,
                "total-progress": info.total,
            });
            if let Some(error) = info.error {
                entry["error"] = json!(error);
            }
            entry
        };
        self.jobs.all().iter().map(|job| entry(job.info())).collect()
    }

    pub(crate) fn query_block_jobs(&self) -> Value {
        let entry = |info: JobInfo| {
            let mut entry = json!({
                "type": info.kind,
                "device": info.id,
                "len": info.total,
                "offset": info.progress,
                "busy": false,
                "paused": info.paused,
                "speed": info.speed,
                "io-status": if info.io_failed { "failed" } else { "ok" },
                "ready": matches!(info.status, Status::Ready | Status::Standby),
                "status": info.status.name(),
                "auto-finalize": info.auto_finalize,
                "auto-dismiss": info.auto_dismiss,
            });
            if info.kind == "mirror" {
                entry["actively-synced"] = json!(info.actively_synced.unwrap_or(false));
            }
            if let Some(error) = info.error {
                entry["error"] = json!(error);
            }
            entry
        };
        self.jobs.all().iter().map(|job| job.info()).filter(|info| info.block).map(entry).collect()
    }
}

fn act(job: &Job, verb: Verb) -> Reply {
    match verb {
        Verb::Cancel => job.cancel(),
        Verb::Pause => job.pause(),
        Verb::Resume => job.resume(),
        Verb::Complete => job.complete(),
        Verb::Finalize => job.finalize(),
        Verb::Dismiss => job.dismiss(),
        Verb::SetSpeed => Err("set-speed takes a speed".into()),
        Verb::Change => Err("change takes options".into()),
    }
    .map(|()| json!({}))
    .map_err(generic)
}

/// Whether node `name` is a child of `node`, or further down: writing
/// it would change the source behind the hook's back.
pub(crate) fn below(node: &Arc<dyn BlockNode>, name: &str) -> bool {
    node.children().iter().any(|(_, child)| child.name() == name || below(child, name))
}

pub(crate) fn node(state: &State, name: &str) -> Result<Arc<dyn BlockNode>, QmpError> {
    state.graph.get(name).ok_or_else(|| generic(format!("Cannot find device='{name}' nor node-name='{name}'")))
}

/// The sync mode, and the bitmap with its mode if one is given, checked
/// as QEMU checks them.
type BitmapChoice = Option<(Arc<vsd_block::dirty::Bitmap>, BitmapMode)>;

fn backup_bitmap(args: &BackupArgs, source: &Arc<dyn BlockNode>) -> Result<(Sync, BitmapChoice), QmpError> {
    let sync = match args.sync {
        SyncArg::Full => Sync::Full,
        SyncArg::Top => Sync::Top,
        SyncArg::None => Sync::None,
        SyncArg::Incremental | SyncArg::Bitmap => Sync::Bitmap,
    };
    let Some(name) = &args.bitmap else {
        if sync == Sync::Bitmap {
            let word = if args.sync == SyncArg::Incremental { "incremental" } else { "bitmap" };
            return Err(generic(format!("must provide a valid bitmap name for '{word}' sync mode")));
        }
        if args.bitmap_mode.is_some() {
            return Err(generic("Cannot specify bitmap sync mode without a bitmap"));
        }
        return Ok((sync, None));
    };
    let bitmap = source
        .dirty_bitmaps()
        .and_then(|bitmaps| bitmaps.get(name).ok())
        .ok_or_else(|| generic(format!("Bitmap '{name}' could not be found")))?;
    let mode = match (args.sync, args.bitmap_mode) {
        (SyncArg::Incremental, None | Some(BitmapModeArg::OnSuccess)) => BitmapMode::OnSuccess,
        (SyncArg::Incremental, Some(_)) => {
            return Err(generic("Bitmap sync mode must be 'on-success' when using sync mode 'incremental'"));
        }
        (_, None) => return Err(generic("Bitmap sync mode must be given when providing a bitmap")),
        (SyncArg::None, Some(_)) => return Err(generic("vsd takes no bitmap with sync 'none'")),
        (_, Some(BitmapModeArg::OnSuccess)) => BitmapMode::OnSuccess,
        (_, Some(BitmapModeArg::Never)) => BitmapMode::Never,
        (_, Some(BitmapModeArg::Always)) => BitmapMode::Always,
    };
    Ok((sync, Some((bitmap, mode))))
}

/// What a backup takes, as QEMU's copy-before-write filter over the
/// source (named as QEMU names a node it makes) takes: the source read
/// and nobody else writing or resizing it from then on (the source's
/// users of the moment go through the filter in QEMU), and the target
/// written and not resized.
fn backup_claims(state: &mut State, source: &Node, target: &Node) -> Vec<(Node, User)> {
    let who = format!("node '{}'", state.graph.implicit_name());
    let source_user = User {
        who: who.clone(),
        role: "file",
        held: Perms::READ,
        shared: Perms::READ.with(Perms::WRITE_UNCHANGED),
        above_users: true,
    };
    let target_user =
        User { who, role: "target", held: Perms::WRITE, shared: Perms::ALL.without(Perms::RESIZE), above_users: false };
    vec![(source.clone(), source_user), (target.clone(), target_user)]
}

/// A user of a node as QEMU's errors name a job's own link to it.
pub(crate) fn job_user(kind: &str, id: &str, role: &'static str, held: Perms, shared: Perms) -> User {
    User { who: format!("{kind} job '{id}'"), role, held, shared, above_users: false }
}

/// What a job holds of its nodes while it lives, by node name; shared with
/// what moves exports onto a node the job holds (a mirror's switch lets go
/// of the target first, as QEMU's does).
#[derive(Clone, Default)]
pub(crate) struct Held(Arc<Mutex<Vec<(String, Hold)>>>);

impl Held {
    fn list(&self) -> MutexGuard<'_, Vec<(String, Hold)>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Lets go of what the job holds of node `name`.
    pub(crate) fn release(&self, name: &str) {
        self.list().retain(|(node, _)| node != name);
    }
}

/// A job's body with what it takes of its nodes (QEMU's permissions):
/// taken as the job starts, in order (a conflict fails the job's start in
/// QEMU's words, nothing kept), and let go once the job has ended,
/// however it ended.
pub(crate) struct Claiming<B> {
    body: B,
    users: Arc<Users>,
    wanted: Vec<(Node, User)>,
    pub(crate) held: Held,
}

impl<B> Claiming<B> {
    pub(crate) fn new(body: B, users: &Arc<Users>, wanted: Vec<(Node, User)>) -> Self {
        Self { body, users: users.clone(), wanted, held: Held::default() }
    }

    /// The same, keeping what it holds in `held`.
    pub(crate) fn sharing(self, held: Held) -> Self {
        Self { held, ..self }
    }

    fn take(&mut self) -> Result<(), String> {
        let mut taken = Vec::new();
        for (node, user) in std::mem::take(&mut self.wanted) {
            taken.push((node.name().to_string(), hold(&self.users, &node, user).map_err(|e| e.qmp_text())?));
        }
        *self.held.list() = taken;
        Ok(())
    }
}

impl<B: JobBody> JobBody for Claiming<B> {
    fn prepare(&mut self, job: &Arc<vsd_job::Job>) -> Result<(), String> {
        self.take()?;
        self.body.prepare(job).inspect_err(|_| self.held.list().clear())
    }

    fn run(&mut self, job: &Arc<vsd_job::Job>) -> Result<(), String> {
        self.body.run(job)
    }

    fn commit(&mut self) {
        self.body.commit();
    }

    fn abort(&mut self) {
        self.body.abort();
    }

    fn clean(&mut self) {
        self.body.clean();
        self.held.list().clear();
    }

    fn copy_mode(&self) -> Option<Arc<vsd_job::mirror::Mode>> {
        self.body.copy_mode()
    }
}

/// A job's body, with the node it writes into writable while it runs
/// (QEMU reopens it so): read-only again if the job fails, or `always`.
/// A stream's overlay and an intermediate commit's base are read-only
/// again after any end; an active commit's base becomes the active layer,
/// and QEMU 10 leaves it writable too when a soft `block-job-cancel` ends
/// the job.
pub(crate) struct Restoring<B> {
    pub(crate) body: B,
    pub(crate) node: Node,
    /// The node was made writable for the job.
    pub(crate) reopened: bool,
    pub(crate) always: bool,
}

impl<B> Restoring<B> {
    fn restore(&mut self) {
        if std::mem::take(&mut self.reopened)
            && let Err(e) = set_read_only_tree(&self.node, true)
        {
            log::warn!("node '{}' stays writable after the job: {e}", self.node.name());
        }
    }
}

impl<B: JobBody> JobBody for Restoring<B> {
    fn prepare(&mut self, job: &Arc<vsd_job::Job>) -> Result<(), String> {
        if self.node.read_only() {
            set_read_only_tree(&self.node, false)?;
            self.reopened = true;
        }
        self.body.prepare(job).inspect_err(|_| self.restore())
    }

    fn run(&mut self, job: &Arc<vsd_job::Job>) -> Result<(), String> {
        self.body.run(job)
    }

    fn commit(&mut self) {
        self.body.commit();
        if self.always {
            self.restore();
        }
    }

    fn abort(&mut self) {
        self.body.abort();
        self.restore();
    }

    fn clean(&mut self) {
        self.body.clean();
    }
}
