//! `--sandbox on`: once it serves, the daemon keeps to the system calls
//! serving needs. Before any thread starts, no thread may gain privileges
//! (no new privileges) and a daemon that will not drop to a user gives up
//! its capabilities; once every socket listens and `--run-with` has
//! dropped to its user, a seccomp allow-list covers every thread. A call
//! off the list ends the daemon with SIGSYS, as QEMU's `-sandbox on` does,
//! after a line naming it.
//!
//! The list is what the test suite makes the daemon do (`strace -f` over
//! every test: the calls, and the arguments checked below), with the other
//! spellings the C library and Rust's may use for them. What it leaves
//! out: starting programs (`execve`, and `clone` without `CLONE_THREAD`),
//! tracing, mounting, module loading, changing ids or keys, raw and packet
//! sockets, signals to other processes.
//!
//! io_uring requests are not system calls: seccomp does not see them.
//! vsd's own rings are restricted to their file (vsd-engine's `uring`),
//! but a ring set up by code running inside the daemon reaches what the
//! daemon's user may (`--run-with` bounds that), not what this list says.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};
use vsd_block::options::OptionMap;

/// `--sandbox on|off`, with QEMU's `-sandbox` spelling: `enable` is the
/// implied key. QEMU's finer switches may be given as `deny`, which is
/// what vsd's sandbox always does.
pub(crate) fn parse(text: &str) -> Result<bool> {
    let mut opts = OptionMap::parse_implied("--sandbox", text, "enable")?;
    let on = opts.take_bool("enable")?.context("--sandbox: say on or off")?;
    for switch in ["obsolete", "elevateprivileges", "spawn", "resourcecontrol"] {
        match opts.take(switch).as_deref() {
            None | Some("deny") => {}
            Some(other) => {
                anyhow::bail!("--sandbox: {switch}={other} is not vsd's: its sandbox always denies {switch}")
            }
        }
    }
    opts.finish()?;
    Ok(on)
}

/// Before any thread starts, so every thread inherits it: no thread can
/// gain privileges by `execve`, and a daemon that will not drop to a user
/// (`--run-with`, which needs its capabilities until then and loses them
/// all at the drop) gives up root's capabilities now, keeping root's ids.
pub(crate) fn prepare(drops_to_a_user: bool) -> Result<()> {
    vsd_sys::confine::forbid_new_privileges().context("--sandbox: cannot forbid new privileges")?;
    if !drops_to_a_user {
        vsd_sys::confine::drop_capabilities().context("--sandbox: cannot drop capabilities")?;
    }
    Ok(())
}

/// A start-up error of a daemon that gave up its capabilities first
/// ([`prepare`] without `--run-with`): one refused for want of them says
/// what would have kept them.
pub(crate) fn started_without_capabilities(error: anyhow::Error) -> anyhow::Error {
    let text = format!("{error:#}");
    match text.contains("Operation not permitted") || text.contains("Permission denied") {
        true => anyhow::anyhow!(
            "{text} (--sandbox on without --run-with starts without root's capabilities; \
             with --run-with they last until the drop to its user)"
        ),
        false => error,
    }
}

/// Once the daemon serves: the allow-list in every thread.
pub(crate) fn enter() -> Result<()> {
    check_no_capabilities()?;
    vsd_sys::confine::report_trapped_calls().context("--sandbox: cannot handle SIGSYS")?;
    for program in programs().context("--sandbox: cannot build the filter")? {
        seccompiler::apply_filter_all_threads(&program).context("--sandbox: cannot install the filter")?;
    }
    log::info!("sandbox on");
    Ok(())
}

/// Every thread of the daemon has given up its capabilities. Threads the
/// kernel starts for io_uring keep what their ring's thread had when they
/// started; the drop comes before any ring has work, so there should be
/// none, and one is said (the daemon carries on, as with `--run-with`).
fn check_no_capabilities() -> Result<()> {
    let threads = vsd_sys::process::thread_statuses().context("--sandbox: cannot list the threads")?;
    for thread in threads {
        let held =
            ["CapPrm", "CapEff", "CapAmb"].iter().any(|set| !thread.field(set).trim_start_matches('0').is_empty());
        let name = thread.field("Name");
        match (held, name.starts_with("iou-")) {
            (false, _) => {}
            (true, true) => log::warn!("--sandbox: io_uring's thread '{name}' kept capabilities"),
            (true, false) => anyhow::bail!("--sandbox: thread '{name}' kept capabilities {}", thread.field("CapEff")),
        }
    }
    Ok(())
}

/// Two filters, in the order they are installed: one that answers
/// `clone3` with ENOSYS (its flags are behind a pointer, out of a filter's
/// sight), so that the C library falls back to `clone`, whose flags the
/// list checks; then the allow-list, which has no `seccomp` on it.
fn programs() -> Result<Vec<BpfProgram>> {
    let arch = TargetArch::try_from(std::env::consts::ARCH)?;
    let clone3 = BTreeMap::from([(libc::SYS_clone3, vec![])]);
    let no_clone3 = SeccompFilter::new(clone3, SeccompAction::Allow, SeccompAction::Errno(libc::ENOSYS as u32), arch)?;
    let allowed = SeccompFilter::new(allow_list()?, SeccompAction::Trap, SeccompAction::Allow, arch)?;
    Ok(vec![no_clone3.try_into()?, allowed.try_into()?])
}

/// Calls allowed whatever their arguments.
const ANY_ARGUMENTS: &[libc::c_long] = &[
    // memory
    libc::SYS_brk,
    libc::SYS_mmap,
    libc::SYS_mprotect,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_madvise,
    libc::SYS_memfd_create,
    // threads and time
    libc::SYS_futex,
    libc::SYS_set_robust_list,
    libc::SYS_set_tid_address,
    libc::SYS_rseq,
    libc::SYS_clone3,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_setaffinity,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_clock_gettime,
    libc::SYS_clock_getres,
    libc::SYS_gettimeofday,
    libc::SYS_restart_syscall,
    libc::SYS_getrandom,
    libc::SYS_getrusage,
    libc::SYS_prlimit64,
    libc::SYS_uname,
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getegid,
    // signals: the daemon's own (termination, interrupting a worker, SIGSYS)
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigtimedwait,
    libc::SYS_sigaltstack,
    // files: images, sockets, the pidfile, /proc/self
    libc::SYS_openat,
    libc::SYS_close,
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_preadv2,
    libc::SYS_pwritev2,
    libc::SYS_lseek,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_fallocate,
    libc::SYS_ftruncate,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_fstatfs,
    libc::SYS_statfs,
    libc::SYS_getdents64,
    libc::SYS_readlinkat,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_unlinkat,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_mkdirat,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    // a socket's owner (`socket-owner`): without CAP_CHOWN, only to the
    // daemon's own user, as the kernel checks
    libc::SYS_fchown,
    libc::SYS_fchownat,
    libc::SYS_fcntl,
    libc::SYS_dup,
    libc::SYS_dup3,
    libc::SYS_pipe2,
    // the NBD server's spliced reads: page cache -> pipe -> socket
    libc::SYS_splice,
    vsd_sys::pipe::SYS_CACHESTAT,
    // waiting and waking
    libc::SYS_eventfd2,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_pwait,
    libc::SYS_ppoll,
    libc::SYS_timerfd_create,
    libc::SYS_timerfd_settime,
    libc::SYS_timerfd_gettime,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    // sockets (which families: below)
    libc::SYS_socketpair,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept4,
    libc::SYS_connect,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
    libc::SYS_sendto,
    libc::SYS_recvfrom,
    libc::SYS_shutdown,
];

/// The older spellings of some calls above, which x86_64's C library and
/// Rust's standard library still make.
#[cfg(target_arch = "x86_64")]
const ANY_ARGUMENTS_X86_64: &[libc::c_long] = &[
    libc::SYS_arch_prctl,
    libc::SYS_access,
    libc::SYS_readlink,
    libc::SYS_unlink,
    libc::SYS_rename,
    libc::SYS_mkdir,
    libc::SYS_rmdir,
    libc::SYS_chmod,
    libc::SYS_lchown,
    libc::SYS_poll,
    libc::SYS_epoll_create,
    libc::SYS_epoll_wait,
    libc::SYS_stat,
    libc::SYS_lstat,
];
#[cfg(not(target_arch = "x86_64"))]
const ANY_ARGUMENTS_X86_64: &[libc::c_long] = &[];

fn allow_list() -> Result<BTreeMap<i64, Vec<SeccompRule>>> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        ANY_ARGUMENTS.iter().chain(ANY_ARGUMENTS_X86_64).map(|&call| (call, vec![])).collect();
    // Threads only: a new process could not run anything anyway (no
    // execve), but need not exist either.
    let thread = CLONE_THREAD;
    rules.insert(libc::SYS_clone, vec![rule(&[(0, SeccompCmpOp::MaskedEq(thread), thread)])?]);
    // Unix sockets (vhost-user, QMP, NBD), TCP (NBD, Ceph) and the
    // routing netlink the C library's name lookup asks for its addresses.
    let mut sockets = [libc::AF_UNIX, libc::AF_INET, libc::AF_INET6]
        .iter()
        .map(|&family| rule(&[(0, SeccompCmpOp::Eq, family as u64)]))
        .collect::<Result<Vec<_>>>()?;
    let route = [(0, SeccompCmpOp::Eq, libc::AF_NETLINK as u64), (2, SeccompCmpOp::Eq, libc::NETLINK_ROUTE as u64)];
    sockets.push(rule(&route)?);
    rules.insert(libc::SYS_socket, sockets);
    // Only the requests the daemon makes: a block device's size and
    // sector size, a descriptor's flags, whether stderr is a terminal (for
    // the log's colours). Not a terminal's input (TIOCSTI), nor anything
    // a device driver would do.
    let requests = [libc::FIONBIO, libc::FIOCLEX, libc::FIONCLEX, libc::FIONREAD, libc::TCGETS, BLKGETSIZE64]
        .into_iter()
        .chain([libc::BLKSSZGET, libc::BLKPBSZGET].map(|request| request as libc::c_ulong));
    let ioctls = requests.map(|request| rule(&[(1, SeccompCmpOp::Eq, request)])).collect::<Result<_>>()?;
    rules.insert(libc::SYS_ioctl, ioctls);
    // Threads' names (Rust's and the C library's), nothing else.
    let names = [libc::PR_SET_NAME, libc::PR_GET_NAME].map(|op| rule(&[(0, SeccompCmpOp::Eq, op as u64)]));
    rules.insert(libc::SYS_prctl, names.into_iter().collect::<Result<_>>()?);
    // Signals to the daemon's own threads, never to another process.
    let me = u64::from(std::process::id());
    rules.insert(libc::SYS_tgkill, vec![rule(&[(0, SeccompCmpOp::Eq, me)])?]);
    rules.insert(libc::SYS_kill, vec![rule(&[(0, SeccompCmpOp::Eq, me)])?]);
    Ok(rules)
}

const CLONE_THREAD: u64 = libc::CLONE_THREAD as u64;
/// `_IOR(0x12, 114, u64)`, which the libc crate does not name.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

/// A rule: every (argument, comparison, value) holds, on the argument's
/// low 32 bits: all the arguments compared are `int`s, or flags and
/// requests that fit in them (the kernel reads an ioctl's as 32 bits).
fn rule(conditions: &[(u8, SeccompCmpOp, u64)]) -> Result<SeccompRule> {
    let conditions = conditions
        .iter()
        .map(|(arg, op, value)| SeccompCondition::new(*arg, SeccompCmpArgLen::Dword, op.clone(), *value))
        .collect::<Result<_, _>>()?;
    Ok(SeccompRule::new(conditions)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spelled_as_qemu_spells_it() {
        assert!(parse("on").unwrap());
        assert!(!parse("off").unwrap());
        assert!(parse("enable=on,spawn=deny,elevateprivileges=deny").unwrap());
        let said = |text: &str| format!("{:#}", parse(text).unwrap_err());
        assert!(said("on,spawn=allow").contains("always denies spawn"), "{}", said("on,spawn=allow"));
        assert!(said("on,bogus=1").contains("bogus"), "{}", said("on,bogus=1"));
        assert!(said("maybe").contains("maybe"), "{}", said("maybe"));
        assert!(said("spawn=deny").contains("say on or off"), "{}", said("spawn=deny"));
    }

    #[test]
    fn the_filters_compile() {
        let programs = programs().unwrap();
        assert_eq!(programs.len(), 2);
        assert!(programs.iter().all(|p| !p.is_empty()));
    }
}
