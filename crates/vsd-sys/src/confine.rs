//! What the sandbox needs from the kernel besides the seccomp filter
//! itself: no new privileges, no capabilities, and a clear last word
//! when the filter stops a system call.
//!
//! Each of these is per thread in Linux. The daemon calls the first two
//! before it starts any thread, so that every thread inherits them.

use std::io;

use crate::check;

/// No `execve` can give this thread (or its future threads) privileges
/// it does not have: setuid binaries and file capabilities are ignored.
/// seccomp requires it of an unprivileged filter.
pub fn forbid_new_privileges() -> io::Result<()> {
    // SAFETY: no pointer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }.into()).map(drop)
}

/// `_LINUX_CAPABILITY_VERSION_3`: two 32-bit words per set.
const CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Gives up every capability of the calling thread, for good: the
/// bounding set (when it may: that takes `CAP_SETPCAP`), the ambient set,
/// then the effective, permitted and inheritable sets. Threads started
/// afterwards have none either.
pub fn drop_capabilities() -> io::Result<()> {
    // PR_CAPBSET_READ fails past the kernel's highest capability number.
    let known = (0..64).take_while(|&cap| {
        // SAFETY: no pointer arguments.
        unsafe { libc::prctl(libc::PR_CAPBSET_READ, cap, 0, 0, 0) >= 0 }
    });
    for cap in known {
        // EPERM: not ours to shrink (no CAP_SETPCAP). Without new
        // privileges (above) an exec could not use it anyway.
        // SAFETY: no pointer arguments.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EPERM) {
                return Err(e);
            }
        }
    }
    // SAFETY: no pointer arguments.
    check(unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) }.into())?;
    let mut header = CapHeader { version: CAPABILITY_VERSION_3, pid: 0 };
    let data = [CapData::default(); 2];
    // SAFETY: a version 3 header and the two data words it asks for.
    check(unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) })?;
    Ok(())
}

/// The layout of `siginfo_t` for SIGSYS (the kernel's `_sigsys` member),
/// which the libc crate does not describe.
#[repr(C)]
struct SigsysInfo {
    _signo: i32,
    _errno: i32,
    _code: i32,
    #[cfg(target_pointer_width = "64")]
    _pad: i32,
    _call_addr: *mut libc::c_void,
    syscall: i32,
    _arch: u32,
}

/// The first line of what the daemon says when its sandbox stops it;
/// the system call's number follows.
const STOPPED: &[u8] = b"vsd: the sandbox stopped the daemon: it made system call ";

/// Makes a system call that a seccomp filter traps (`SECCOMP_RET_TRAP`)
/// end the process with SIGSYS, as a kill by the filter would, but with a
/// line on stderr naming the call first.
pub fn report_trapped_calls() -> io::Result<()> {
    // SAFETY: a zeroed sigaction is valid; the handler has the
    // SA_SIGINFO signature and only makes async-signal-safe calls.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_trapped_call as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO;
        check(libc::sigaction(libc::SIGSYS, &action, std::ptr::null_mut()).into())?;
    }
    Ok(())
}

extern "C" fn on_trapped_call(_signal: i32, info: *mut libc::siginfo_t, _context: *mut libc::c_void) {
    // SAFETY: the kernel hands a SIGSYS handler a siginfo_t whose union
    // holds `_sigsys`; nothing here allocates or takes a lock.
    unsafe {
        let number = (*info.cast::<SigsysInfo>()).syscall;
        let mut line = [0u8; 96];
        let len = STOPPED.len();
        line[..len].copy_from_slice(STOPPED);
        let len = len + write_decimal(number, &mut line[len..]);
        let tail = b", which is not on its list\n";
        line[len..len + tail.len()].copy_from_slice(tail);
        libc::write(libc::STDERR_FILENO, line.as_ptr().cast(), len + tail.len());
        // Blocked until this handler returns, then taken by its default
        // action: the whole process ends, killed by SIGSYS.
        libc::signal(libc::SIGSYS, libc::SIG_DFL);
        libc::syscall(libc::SYS_tgkill, libc::getpid(), libc::gettid(), libc::SIGSYS);
    }
}

/// Writes `n` in decimal at the start of `out`; returns its length.
fn write_decimal(n: i32, out: &mut [u8]) -> usize {
    let mut digits = [0u8; 11];
    let mut value = n.unsigned_abs();
    let mut len = 0;
    loop {
        digits[len] = b'0' + (value % 10) as u8;
        len += 1;
        value /= 10;
        if value == 0 {
            break;
        }
    }
    let sign = usize::from(n < 0);
    if sign == 1 {
        out[0] = b'-';
    }
    for (i, digit) in digits[..len].iter().rev().enumerate() {
        out[sign + i] = *digit;
    }
    sign + len
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimals() {
        for n in [0, 7, 59, 435, -1, i32::MAX, i32::MIN] {
            let mut out = [0u8; 11];
            let len = write_decimal(n, &mut out);
            assert_eq!(std::str::from_utf8(&out[..len]).unwrap(), n.to_string());
        }
    }

    #[test]
    fn sigsys_layout_is_the_kernels() {
        // glibc: si_call_addr at 16, si_syscall at 24, si_arch at 28.
        assert_eq!(std::mem::offset_of!(SigsysInfo, _call_addr), 16);
        assert_eq!(std::mem::offset_of!(SigsysInfo, syscall), 24);
        assert_eq!(std::mem::offset_of!(SigsysInfo, _arch), 28);
    }
}
