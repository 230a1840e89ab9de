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
    /// QEMU's names, by bit.
    const NAMES: [&'static str; 4] = ["consistent read", "write", "write unchanged", "resize"];

    /// Both sets.
    pub const fn with(self, other: Perms) -> Perms {
        Perms(self.0 | other.0)
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

    #[test]
    fn locking_off_claims_without_locking() {
        let (a, b) = two_opens();
        let quiet = ImageLock::new(a.file(), a.path.clone(), false, true);
        let _held = quiet.claim(WRITER).unwrap();
        b.claim(WRITER).unwrap();
    }
}
