//! Image locking as QEMU does it, so that vsd, QEMU, qemu-storage-daemon
//! and qemu-img see each other: each permission a user of an image holds
//! is a shared lock on byte 100 + its bit of the file, and each permission
//! it does not let others hold one on byte 200 + its bit. A process that
//! wants a permission first checks that nobody refuses it, and one that
//! refuses a permission first checks that nobody holds it.
//!
//! A file node keeps one [`ImageLock`]; its users (a format on top, an
//! export) each [`ImageLock::claim`] what they need, and the file's locks
//! are the union of the claims. An inactive node (the other end of a live
//! migration owns the image) holds none. A node reopened with other access
//! moves the bytes onto its new open of the file ([`ImageLock::move_to`]).
//!
//! Inside the daemon, [`Users`] does for nodes what the locks do for
//! images between processes: the exports and jobs using a node each hold
//! some permissions and share some, and one that conflicts with another is
//! refused in QEMU's words (`Permission conflict on node ...`).

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex, PoisonError};

/// A set of QEMU's permissions on an image.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Perms(u8);

impl Perms {
    /// Nothing.
    pub const NONE: Perms = Perms(0);
    /// Reads see what was written (QEMU's "consistent read").
    pub const READ: Perms = Perms(1 << 0);
    /// Writes.
    pub const WRITE: Perms = Perms(1 << 1);
    /// Writes that leave the data as it was (QEMU's "write unchanged").
    pub const WRITE_UNCHANGED: Perms = Perms(1 << 2);
    /// Changing the size.
    pub const RESIZE: Perms = Perms(1 << 3);
    /// Every permission.
    pub const ALL: Perms = Perms(0b1111);
    /// QEMU's names, by bit.
    const NAMES: [&'static str; 4] = ["consistent read", "write", "write unchanged", "resize"];

    /// Both sets.
    pub const fn with(self, other: Perms) -> Perms {
        Perms(self.0 | other.0)
    }

    /// This set without `other`'s permissions.
    pub const fn without(self, other: Perms) -> Perms {
        Perms(self.0 & !other.0)
    }

    /// Whether the set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// QEMU's names of the set's permissions, as its errors list them.
    pub fn names(self) -> String {
        self.bits().map(|bit| Self::NAMES[bit as usize]).collect::<Vec<_>>().join(", ")
    }

    /// Whether `other` is part of this set.
    pub fn contains(self, other: Perms) -> bool {
        self.0 & other.0 == other.0
    }

    /// The permissions of the set, as bits.
    fn bits(self) -> impl Iterator<Item = u64> {
        (0..Self::NAMES.len() as u64).filter(move |bit| self.0 & (1 << bit) != 0)
    }
}

/// What one user of an image needs: the permissions it holds, and those it
/// does not let other processes hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Claim {
    /// Held.
    pub held: Perms,
    /// Refused to others.
    pub unshared: Perms,
}

/// Why a claim could not be had, in QEMU's words.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process refuses a permission this one needs.
    #[error("Failed to get \"{perm}\" lock. Is another process using the image [{path}]?")]
    Held {
        /// The permission, as QEMU names it.
        perm: &'static str,
        /// The image.
        path: String,
    },
    /// Another process holds a permission this one refuses to share.
    #[error("Failed to get shared \"{perm}\" lock. Is another process using the image [{path}]?")]
    Shared {
        /// The permission, as QEMU names it.
        perm: &'static str,
        /// The image.
        path: String,
    },
    /// A file opened read-only (`auto-read-only`) could not be opened for
    /// a writer (QEMU's words).
    #[error("Could not open '{path}'")]
    Reopen {
        /// The image.
        path: String,
        /// The host's answer.
        #[source]
        source: io::Error,
    },
    /// The host refused a lock operation.
    #[error("cannot lock '{path}'")]
    Io {
        /// The image.
        path: String,
        /// The host's answer.
        #[source]
        source: io::Error,
    },
}

impl LockError {
    /// The error as QMP words it: QEMU's, without the hint its command
    /// line adds.
    pub fn qmp_text(&self) -> String {
        match self {
            LockError::Held { perm, .. } => format!("Failed to get \"{perm}\" lock"),
            LockError::Shared { perm, .. } => format!("Failed to get shared \"{perm}\" lock"),
            LockError::Io { path, source } => format!("cannot lock '{path}': {source}"),
            e @ LockError::Reopen { source, .. } => format!("{e}: {source}"),
        }
    }
}

/// The lock bytes of an image file, on the open of it its users go through.
pub struct ImageLock {
    path: String,
    /// `locking=off`: claims are kept but nothing is locked.
    enabled: bool,
    state: Mutex<State>,
    /// Told each time a claim goes, after its bytes are dropped.
    released: std::sync::OnceLock<ReleaseHook>,
}

/// What [`ImageLock::on_release`] calls.
pub type ReleaseHook = Box<dyn Fn(&ImageLock) + Send + Sync>;

struct State {
    /// The open the bytes are locked on.
    file: Arc<File>,
    claims: Vec<(u64, Claim)>,
    next_id: u64,
    /// What the file's bytes say now.
    applied: Claim,
    /// Inactive: the bytes say nothing.
    inactive: bool,
}

impl State {
    fn wanted(&self) -> Claim {
        if self.inactive {
            return Claim::default();
        }
        self.claims.iter().fold(Claim::default(), |all, (_, c)| Claim {
            held: all.held.with(c.held),
            unshared: all.unshared.with(c.unshared),
        })
    }
}

/// Keeps a claim until dropped.
pub struct ClaimGuard {
    lock: Arc<ImageLock>,
    id: u64,
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        let mut state = self.lock.state();
        state.claims.retain(|(id, _)| *id != self.id);
        // Dropping locks cannot conflict; a failure leaves a byte locked
        // until the file closes, as QEMU tolerates (NFS).
        let _ = self.lock.apply(&mut state);
        drop(state);
        if let Some(hook) = self.lock.released.get() {
            hook(&self.lock);
        }
    }
}

impl ImageLock {
    /// The locks of `file` (opened as `path`), unless `enabled` is false
    /// (`locking=off`); `active` false for a node opened inactive.
    pub fn new(file: Arc<File>, path: String, enabled: bool, active: bool) -> Arc<Self> {
        let state = State { file, claims: Vec::new(), next_id: 0, applied: Claim::default(), inactive: !active };
        Arc::new(Self { path, enabled, state: Mutex::new(state), released: Default::default() })
    }

    /// Calls `hook` each time a claim goes (once; later hooks are ignored).
    pub fn on_release(&self, hook: ReleaseHook) {
        let _ = self.released.set(hook);
    }

    /// What the claims hold, active or not.
    pub fn held(&self) -> Perms {
        self.state().claims.iter().fold(Perms::NONE, |all, (_, c)| all.with(c.held))
    }

    /// The open of the file the bytes are locked on, for I/O.
    pub fn file(&self) -> Arc<File> {
        self.state().file.clone()
    }

    /// Moves the bytes onto `file`, another open of the same image (with
    /// other access), which [`Self::file`] answers from then on. The new
    /// open takes them before the old one lets them go, so the image is
    /// never unlocked meanwhile: both opens' locks are shared ones, which
    /// never conflict with each other. Nothing changes on a failure.
    pub fn move_to(&self, file: Arc<File>) -> Result<(), LockError> {
        let mut state = self.state();
        if self.enabled && !state.inactive {
            if let Err(e) = self.set_bytes(&file, state.applied) {
                let _ = self.set_bytes(&file, Claim::default());
                return Err(e);
            }
            // Dropping locks cannot conflict; as in ClaimGuard::drop, a
            // failure leaves a byte locked until the old open closes.
            let _ = self.set_bytes(&state.file, Claim::default());
        }
        state.file = file;
        Ok(())
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds `claim` to what the file's locks say, if no other process
    /// conflicts with it; it holds until the guard drops.
    pub fn claim(self: &Arc<Self>, claim: Claim) -> Result<ClaimGuard, LockError> {
        let mut state = self.state();
        let id = state.next_id;
        state.next_id += 1;
        state.claims.push((id, claim));
        if let Err(e) = self.apply(&mut state) {
            state.claims.retain(|(other, _)| *other != id);
            return Err(e);
        }
        Ok(ClaimGuard { lock: self.clone(), id })
    }

    /// Drops every lock while the node is inactive; takes the claims'
    /// locks again when it becomes active (which fails if another process
    /// took the image meanwhile).
    pub fn set_active(&self, active: bool) -> Result<(), LockError> {
        let mut state = self.state();
        let was = state.inactive;
        state.inactive = !active;
        self.apply(&mut state).inspect_err(|_| state.inactive = was)
    }

    /// Makes the bytes say what the claims want: first locks what either
    /// the old or the new set has, so that a process doing the same at
    /// the same time sees this one, then checks for conflicts, then drops
    /// what only the old set had (or, on a conflict, what only the new one
    /// had).
    fn apply(&self, state: &mut State) -> Result<(), LockError> {
        let (old, new) = (state.applied, state.wanted());
        if !self.enabled || old == new {
            return Ok(());
        }
        let both = Claim { held: old.held.with(new.held), unshared: old.unshared.with(new.unshared) };
        let result = self.set_bytes(&state.file, both).and_then(|()| self.check(&state.file, new));
        let kept = if result.is_ok() { new } else { old };
        let cleanup = self.set_bytes(&state.file, kept);
        state.applied = kept;
        result.and(cleanup)
    }

    /// Locks exactly the bytes of `claim` on `file`.
    fn set_bytes(&self, file: &File, claim: Claim) -> Result<(), LockError> {
        for bit in 0..Perms::NAMES.len() as u64 {
            let perm = Perms(1 << bit);
            for (base, set) in [(100, claim.held), (200, claim.unshared)] {
                vsd_sys::lock::share_byte(file.as_fd(), base + bit, set.contains(perm))
                    .map_err(|source| LockError::Io { path: self.path.clone(), source })?;
            }
        }
        Ok(())
    }

    /// Whether another process (another open than `file`) refuses what
    /// `claim` holds, or holds what it refuses.
    fn check(&self, file: &File, claim: Claim) -> Result<(), LockError> {
        let locked = |at| {
            vsd_sys::lock::byte_locked_elsewhere(file.as_fd(), at)
                .map_err(|source| LockError::Io { path: self.path.clone(), source })
        };
        let path = || self.path.clone();
        for bit in claim.held.bits() {
            if locked(200 + bit)? {
                return Err(LockError::Held { perm: Perms::NAMES[bit as usize], path: path() });
            }
        }
        for bit in claim.unshared.bits() {
            if locked(100 + bit)? {
                return Err(LockError::Shared { perm: Perms::NAMES[bit as usize], path: path() });
            }
        }
        Ok(())
    }
}

/// One user of a node inside the daemon (an export, a job), as QEMU's
/// permission system sees a parent of the node: what it holds, what it
/// lets the others hold, and how QEMU's errors name it.
#[derive(Clone, Debug)]
pub struct User {
    /// As QEMU names the parent: `an unnamed block device`, `stream job 'job0'`.
    pub who: String,
    /// The name of its link to the node (`root`, `intermediate node`...).
    pub role: &'static str,
    /// Held.
    pub held: Perms,
    /// Let others hold.
    pub shared: Perms,
    /// Stands for a filter QEMU puts above the node, which takes over its
    /// users of the moment: only users that come after are checked
    /// against it.
    pub above_users: bool,
}

impl User {
    /// What the user asks of the images below the node (their locks).
    pub fn claim(&self) -> Claim {
        Claim { held: self.held, unshared: Perms::ALL.without(self.shared) }
    }
}

/// The users of every node of the daemon, by node name: a new one that
/// holds what another refuses, or refuses what another holds, is refused
/// in QEMU's words. Image locks do the same between processes.
#[derive(Default)]
pub struct Users {
    state: Mutex<UsersState>,
}

#[derive(Default)]
struct UsersState {
    /// Oldest first.
    by_node: std::collections::BTreeMap<String, Vec<(u64, User)>>,
    next_id: u64,
}

/// Keeps a user on its node until dropped.
pub struct UserGuard {
    users: Arc<Users>,
    node: String,
    id: u64,
}

impl Drop for UserGuard {
    fn drop(&mut self) {
        let mut state = self.users.state();
        if let Some(users) = state.by_node.get_mut(&self.node) {
            users.retain(|(id, _)| *id != self.id);
            if users.is_empty() {
                state.by_node.remove(&self.node);
            }
        }
    }
}

impl Users {
    fn state(&self) -> std::sync::MutexGuard<'_, UsersState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds `user` to node `node`'s users unless it conflicts with one of
    /// them; the error is QEMU's.
    pub fn attach(self: &Arc<Self>, node: &str, user: User) -> Result<UserGuard, String> {
        let mut state = self.state();
        let others = state.by_node.get(node).map(Vec::as_slice).unwrap_or_default();
        if let Some(conflict) = first_conflict(node, &user, others) {
            return Err(conflict);
        }
        let id = state.next_id;
        state.next_id += 1;
        state.by_node.entry(node.to_string()).or_default().push((id, user));
        Ok(UserGuard { users: self.clone(), node: node.to_string(), id })
    }
}

/// The conflict QEMU would report first when `new` joins `others` (oldest
/// first): it walks the users newest first, asking of each whether it lets
/// every other hold what that one holds; `new` is the newest.
fn first_conflict(node: &str, new: &User, others: &[(u64, User)]) -> Option<String> {
    let older = || others.iter().rev().map(|(_, user)| user);
    let refused = |by: &User, of: &User| of.held.without(by.shared);
    if !new.above_users
        && let Some(other) = older().find(|other| !refused(new, other).is_empty())
    {
        return Some(conflict_text(node, other, new, refused(new, other)));
    }
    older()
        .find(|other| !refused(other, new).is_empty())
        .map(|other| conflict_text(node, new, other, refused(other, new)))
}

fn conflict_text(node: &str, holder: &User, refuser: &User, perms: Perms) -> String {
    format!(
        "Permission conflict on node '{node}': permissions '{}' are both required by {} (uses node '{node}' as '{}' \
         child) and unshared by {} (uses node '{node}' as '{}' child).",
        perms.names(),
        holder.who,
        holder.role,
        refuser.who,
        refuser.role
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const WRITER: Claim =
        Claim { held: Perms::READ.with(Perms::WRITE).with(Perms::RESIZE), unshared: Perms::WRITE.with(Perms::RESIZE) };
    const READER: Claim = Claim { held: Perms::READ, unshared: Perms::WRITE };

    /// `N` opens of one file: `N` processes, as far as the locks can tell.
    fn opens<const N: usize>() -> (String, [Arc<File>; N]) {
        let path =
            std::env::temp_dir().join(format!("vsd-lock-{}-{:?}", std::process::id(), std::thread::current().id()));
        let open =
            |_| Arc::new(File::options().read(true).write(true).create(true).truncate(false).open(&path).unwrap());
        let files = std::array::from_fn(open);
        std::fs::remove_file(&path).unwrap();
        (path.display().to_string(), files)
    }

    /// The locks of two opens of one file.
    fn two_opens() -> (Arc<ImageLock>, Arc<ImageLock>) {
        let (name, [a, b]) = opens();
        (ImageLock::new(a, name.clone(), true, true), ImageLock::new(b, name, true, true))
    }

    #[test]
    fn a_writer_and_a_reader_that_refuses_writes_exclude_each_other() {
        let (a, b) = two_opens();
        let writer = a.claim(WRITER).unwrap();
        let error = b.claim(READER).err().unwrap().to_string();
        assert!(error.starts_with("Failed to get shared \"write\" lock"), "{error}");
        assert!(matches!(b.claim(WRITER), Err(LockError::Held { perm: "write", .. })));
        drop(writer);
        let reader = b.claim(READER).unwrap();
        assert!(matches!(a.claim(WRITER), Err(LockError::Held { perm: "write", .. })), "now the other way");
        drop(reader);
        a.claim(WRITER).unwrap();
    }

    #[test]
    fn readers_that_share_everything_go_together() {
        let (a, b) = two_opens();
        let plain = Claim { held: Perms::READ, unshared: Perms::NONE };
        let _first = a.claim(plain).unwrap();
        let _second = b.claim(plain).unwrap();
        assert!(b.claim(Claim { held: Perms::READ.with(Perms::WRITE), unshared: Perms::NONE }).is_ok());
    }

    #[test]
    fn an_inactive_image_holds_nothing_until_it_is_taken_back() {
        let (a, b) = two_opens();
        let _writer = a.claim(WRITER).unwrap();
        a.set_active(false).unwrap();
        let other = b.claim(WRITER).unwrap();
        assert!(matches!(a.set_active(true), Err(LockError::Held { .. })), "the other process has it now");
        drop(other);
        a.set_active(true).unwrap();
        assert!(b.claim(READER).is_err(), "active again, with its claims");
    }

    #[test]
    fn moving_to_another_open_keeps_the_bytes_and_leaves_none_behind() {
        let (name, [old, new, other]) = opens();
        let node = ImageLock::new(old, name.clone(), true, true);
        let other = ImageLock::new(other, name, true, true);
        let _reader = node.claim(READER).unwrap();
        node.move_to(new.clone()).unwrap();
        assert!(Arc::ptr_eq(&node.file(), &new));
        assert!(matches!(other.claim(WRITER), Err(LockError::Held { perm: "write", .. })), "still refused");
        // The old open refusing writes would refuse the node itself.
        let _writer = node.claim(WRITER).unwrap();
        assert!(other.claim(READER).is_err());
    }

    fn user(who: &str, held: Perms, shared: Perms) -> User {
        User { who: who.into(), role: "root", held, shared, above_users: false }
    }

    #[test]
    fn a_user_that_refuses_what_another_holds_is_refused_in_qemus_words() {
        let users = Arc::new(Users::default());
        let export = user("an unnamed block device", Perms::READ.with(Perms::WRITE), Perms::ALL);
        let _export = users.attach("base", export.clone()).unwrap();
        let job = User { role: "intermediate node", ..user("stream job 'job0'", Perms::NONE, Perms::READ) };
        assert_eq!(
            users.attach("base", job.clone()).err().unwrap(),
            "Permission conflict on node 'base': permissions 'write' are both required by an unnamed block device \
             (uses node 'base' as 'root' child) and unshared by stream job 'job0' (uses node 'base' as \
             'intermediate node' child)."
        );
        assert!(users.attach("other", job.clone()).is_ok(), "another node's users are not this one's");
        drop(_export);
        let _job = users.attach("base", job).unwrap();
        let refused = users.attach("base", export).err().unwrap();
        assert!(refused.contains("'write' are both required by an unnamed block device"), "{refused}");
    }

    #[test]
    fn a_filter_above_takes_over_the_users_it_finds_but_not_later_ones() {
        let users = Arc::new(Users::default());
        let writer = user("an unnamed block device", Perms::READ.with(Perms::WRITE), Perms::ALL);
        let _early = users.attach("src", writer.clone()).unwrap();
        let filter = User { above_users: true, ..user("node '#block1'", Perms::READ, Perms::READ) };
        let _filter = users.attach("src", filter).unwrap();
        let refused = users.attach("src", writer).err().unwrap();
        assert!(refused.contains("permissions 'write' are both required"), "{refused}");
        assert!(refused.contains("unshared by node '#block1'"), "{refused}");
    }

    #[test]
    fn locking_off_claims_without_locking() {
        let (a, b) = two_opens();
        let quiet = ImageLock::new(a.file(), a.path.clone(), false, true);
        let _held = quiet.claim(WRITER).unwrap();
        b.claim(WRITER).unwrap();
    }
}
