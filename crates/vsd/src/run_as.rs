//! `--run-with user=...`: the user the daemon becomes once it has opened
//! what needs privileges.

use anyhow::{Context, Result};
use vsd_block::options::OptionMap;

/// The user `--run-with user=...` names, which the daemon becomes once it
/// has opened what needs privileges: images, sockets, the pidfile.
pub(crate) struct RunAs {
    /// As the option said it, for messages.
    user: String,
    uid: u32,
    gid: u32,
    groups: Vec<u32>,
}

impl RunAs {
    /// QEMU's `-run-with user=NAME|UID:GID`. A name brings its primary
    /// group and the groups it is a member of; `UID:GID` that one group
    /// alone. Root is refused: it would drop nothing.
    pub(crate) fn parse(text: &str) -> Result<Self> {
        let mut opts = OptionMap::parse("--run-with", text)?;
        let user = opts.take("user");
        // QEMU's chroot= and async-teardown= are not vsd's: named as unknown.
        opts.finish()?;
        let Some(user) = user else { anyhow::bail!("--run-with: give user=NAME or user=UID:GID") };
        let context = || format!("--run-with user={user}");
        let (uid, gid, groups) = if let Some(ids) = vsd_sys::user_by_name(&user).with_context(context)? {
            (ids.uid, ids.gid, vsd_sys::group_list(&user, ids.gid).with_context(context)?)
        } else if let Some((uid, gid)) = numeric_ids(&user) {
            (uid, gid, vec![gid])
        } else {
            anyhow::bail!("--run-with user={user}: no such user (give a user name or UID:GID)");
        };
        if uid == 0 || gid == 0 {
            anyhow::bail!("--run-with user={user}: that is root's user or group, which would drop nothing");
        }
        Ok(Self { user, uid, gid, groups })
    }

    /// Drops to the user for good, then checks that no thread of the
    /// process kept other ids.
    pub(crate) fn drop_privileges(&self) -> Result<()> {
        vsd_sys::drop_privileges(self.uid, self.gid, &self.groups)
            .with_context(|| format!("cannot drop privileges to user {}", self.user))?;
        match threads_not_running_as(self.uid, self.gid) {
            Ok(others) if others.is_empty() => {}
            // Only kernel-made threads can be here (see below). They serve
            // the images already open, so the daemon carries on, but says so.
            Ok(others) => log::warn!(
                "threads that kept their ids after dropping privileges to user {}: {}",
                self.user,
                others.join(", ")
            ),
            Err(e) => log::warn!("cannot check the threads' ids after dropping privileges: {e:#}"),
        }
        log::info!("running as user {} (uid {}, gid {})", self.user, self.uid, self.gid);
        Ok(())
    }
}

/// `UID:GID`, both numbers; `None` otherwise. -1 is not an id.
fn numeric_ids(text: &str) -> Option<(u32, u32)> {
    let (uid, gid) = text.split_once(':')?;
    let id = |t: &str| t.parse::<u32>().ok().filter(|&id| id != u32::MAX);
    Some((id(uid)?, id(gid)?))
}

/// The threads whose real, effective, saved or filesystem ids are not
/// `uid` and `gid`, described. glibc changes every thread it made; threads
/// the kernel made for the process keep the ids they started with: those
/// are io_uring's workers (`iou-wrk-*`), started only if a front-end
/// connected and did I/O before the drop.
fn threads_not_running_as(uid: u32, gid: u32) -> Result<Vec<String>> {
    let threads = vsd_sys::process::thread_statuses().context("listing the threads in /proc/self/task")?;
    let is = |ids: &str, want: u32| ids.split_whitespace().all(|id| id == want.to_string());
    let others = threads.iter().filter(|t| !(is(t.field("Uid"), uid) && is(t.field("Gid"), gid)));
    Ok(others.map(|t| format!("'{}' (uid {}, gid {})", t.field("Name"), t.field("Uid"), t.field("Gid"))).collect())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    fn refusal(text: &str) -> String {
        format!("{:#}", RunAs::parse(text).err().unwrap())
    }

    #[test]
    fn numeric_ids_take_two_numbers() {
        assert_eq!(numeric_ids("1000:1001"), Some((1000, 1001)));
        for bad in ["1000", "1000:", ":1", "x:1", "1:-1", "4294967295:1", "1:4294967295"] {
            assert_eq!(numeric_ids(bad), None, "{bad}");
        }
    }

    #[test]
    fn numeric_user_brings_its_group_alone() {
        // No user database names these ids.
        let run_as = RunAs::parse("user=54321:54322").unwrap();
        assert_eq!((run_as.uid, run_as.gid, run_as.groups), (54321, 54322, vec![54322]));
    }

    #[test]
    fn refuses_root_unknown_users_and_other_options() {
        assert!(refusal("user=root").contains("root's user or group"));
        assert!(refusal("user=0:5").contains("root's user or group"));
        assert!(refusal("user=5:0").contains("root's user or group"));
        assert!(refusal("user=no-such-user-vsd").contains("no such user"));
        assert!(refusal("chroot=/").contains("chroot"));
        assert!(refusal("async-teardown=on").contains("async-teardown"));
    }

    #[test]
    fn threads_with_other_ids_are_named() {
        let me = std::fs::metadata("/proc/self").unwrap();
        assert_eq!(threads_not_running_as(me.uid(), me.gid()).unwrap(), Vec::<String>::new());
        let others = threads_not_running_as(me.uid() + 1, me.gid()).unwrap();
        assert!(!others.is_empty() && others.iter().all(|thread| thread.contains("(uid ")), "{others:?}");
    }
}
