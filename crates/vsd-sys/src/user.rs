//! Users and groups: looking them up by name, and becoming one for good.

use std::ffi::CString;
use std::io;

use crate::check;

/// A user's ids, as the user database (`/etc/passwd`, NSS) has them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UserIds {
    /// The user id.
    pub uid: u32,
    /// The user's primary group.
    pub gid: u32,
}

/// Looks user `name` up (`getpwnam_r`); `None` if there is no such user.
pub fn user_by_name(name: &str) -> io::Result<Option<UserIds>> {
    let Ok(name) = CString::new(name) else { return Ok(None) };
    // SAFETY: passwd is plain data (ints and pointers); all-zero is valid.
    let mut entry: libc::passwd = unsafe { std::mem::zeroed() };
    let found = with_lookup_buffer(|buf| {
        let mut result = std::ptr::null_mut();
        // SAFETY: name is NUL-terminated; entry, result and buf (of the
        // length passed) are live and only written by the call.
        let ret =
            unsafe { libc::getpwnam_r(name.as_ptr(), &mut entry, buf.as_mut_ptr().cast(), buf.len(), &mut result) };
        (ret, !result.is_null())
    })?;
    Ok(found.then_some(UserIds { uid: entry.pw_uid, gid: entry.pw_gid }))
}

/// Looks group `name` up (`getgrnam_r`); its id, or `None` if there is no
/// such group.
pub fn group_by_name(name: &str) -> io::Result<Option<u32>> {
    let Ok(name) = CString::new(name) else { return Ok(None) };
    // SAFETY: group is plain data (ints and pointers); all-zero is valid.
    let mut entry: libc::group = unsafe { std::mem::zeroed() };
    let found = with_lookup_buffer(|buf| {
        let mut result = std::ptr::null_mut();
        // SAFETY: as in user_by_name, for getgrnam_r.
        let ret =
            unsafe { libc::getgrnam_r(name.as_ptr(), &mut entry, buf.as_mut_ptr().cast(), buf.len(), &mut result) };
        (ret, !result.is_null())
    })?;
    Ok(found.then_some(entry.gr_gid))
}

/// Runs a `get*nam_r` lookup with a scratch buffer for the entry's strings,
/// growing it while the lookup says it is too small; whether an entry was
/// found.
fn with_lookup_buffer(mut lookup: impl FnMut(&mut [u8]) -> (libc::c_int, bool)) -> io::Result<bool> {
    let mut buf = vec![0u8; 1024];
    loop {
        match lookup(&mut buf) {
            (0, found) => return Ok(found),
            // Some NSS modules say "not found" with an error number.
            (libc::ENOENT | libc::ESRCH, _) => return Ok(false),
            (libc::ERANGE, _) if buf.len() < 1 << 20 => buf.resize(buf.len() * 2, 0),
            (err, _) => return Err(io::Error::from_raw_os_error(err)),
        }
    }
}

/// The groups user `name` is a member of, with `gid` (its primary group)
/// among them: what `initgroups(3)` would give it (`getgrouplist`).
pub fn group_list(name: &str, gid: u32) -> io::Result<Vec<u32>> {
    let name = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut groups = vec![0; 32];
    loop {
        let mut count = libc::c_int::try_from(groups.len()).map_err(|_| io::Error::other("too many groups"))?;
        // SAFETY: name is NUL-terminated; groups has room for `count` ids,
        // and count is a live local the call updates.
        let ret = unsafe { libc::getgrouplist(name.as_ptr(), gid, groups.as_mut_ptr(), &mut count) };
        let count = usize::try_from(count).unwrap_or(0);
        if ret >= 0 {
            groups.truncate(count);
            return Ok(groups);
        }
        // Too small: count is how many there are.
        if count <= groups.len() {
            return Err(io::Error::other(format!("getgrouplist for user {name:?} failed")));
        }
        groups.resize(count, 0);
    }
}

/// Becomes user `uid`, group `gid`, with exactly the supplementary
/// `groups`, for good: the real, effective and saved ids all change, and
/// `setuid(0)` is tried afterwards, which must fail.
///
/// Every thread changes, not only the caller: glibc's wrappers have each
/// thread of the process make the same call (POSIX semantics; the kernel
/// changes only the calling thread). Kernel threads of the process, such
/// as io_uring's workers, are not glibc's and keep the ids they started
/// with.
pub fn drop_privileges(uid: u32, gid: u32, groups: &[u32]) -> io::Result<()> {
    // Groups before the user id: changing them takes CAP_SETGID, which
    // leaves with the user id.
    // SAFETY: setgroups reads groups.len() ids from a live slice.
    check(unsafe { libc::setgroups(groups.len(), groups.as_ptr()) }.into())?;
    // SAFETY: setresgid takes no pointers.
    check(unsafe { libc::setresgid(gid, gid, gid) }.into())?;
    // SAFETY: setresuid takes no pointers.
    check(unsafe { libc::setresuid(uid, uid, uid) }.into())?;
    // SAFETY: setuid takes no pointers; it must fail now.
    if unsafe { libc::setuid(0) } == 0 {
        return Err(io::Error::other("setuid(0) still succeeds: the privileges were not dropped"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_and_groups_are_looked_up_by_name() {
        assert_eq!(user_by_name("root").unwrap(), Some(UserIds { uid: 0, gid: 0 }));
        assert_eq!(group_by_name("root").unwrap(), Some(0));
        assert_eq!(user_by_name("no-such-user-vsd").unwrap(), None);
        assert_eq!(group_by_name("no-such-group-vsd").unwrap(), None);
        assert_eq!(user_by_name("nul\0inside").unwrap(), None);
        assert!(group_list("root", 0).unwrap().contains(&0), "the primary group is in the list");
    }
}
