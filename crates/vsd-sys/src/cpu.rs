//! CPUs: lists as users write them, and pinning threads to them.

use std::io;

use crate::check;

/// A list of CPUs such as `0-3,8`: single numbers and inclusive ranges,
/// joined by `separator` (`,` on a command line of its own; `:` inside a
/// QEMU-style option string, where `,` separates the options).
pub fn parse_cpu_list(text: &str, separator: char) -> Result<Vec<usize>, String> {
    let cpu = |t: &str| t.trim().parse::<usize>().map_err(|_| format!("{t:?} is not a CPU number"));
    let mut cpus = Vec::new();
    for part in text.split(separator) {
        let (first, last) = match part.split_once('-') {
            Some((a, b)) => (cpu(a)?, cpu(b)?),
            None => (cpu(part)?, cpu(part)?),
        };
        if first > last {
            return Err(format!("CPU range {part:?} is reversed"));
        }
        cpus.extend(first..=last);
    }
    Ok(cpus)
}

/// The CPUs the calling thread may run on.
pub fn allowed_cpus() -> io::Result<Vec<usize>> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: set is a live cpu_set_t of the size passed.
    let ret = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    check(ret.into())?;
    // SAFETY: CPU_ISSET reads the set, for numbers below CPU_SETSIZE.
    Ok((0..libc::CPU_SETSIZE as usize).filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) }).collect())
}

/// Pins the calling thread to `cpus`.
pub fn set_thread_affinity(cpus: &[usize]) -> io::Result<()> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        if cpu >= libc::CPU_SETSIZE as usize {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "cpu number too large"));
        }
        // SAFETY: cpu is below CPU_SETSIZE, checked above.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: set is a live, initialised cpu_set_t of the size passed.
    let ret = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    check(ret.into()).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_take_numbers_and_ranges() {
        assert_eq!(parse_cpu_list("0-2:5", ':').unwrap(), vec![0, 1, 2, 5]);
        assert_eq!(parse_cpu_list("3", ',').unwrap(), vec![3]);
        assert!(parse_cpu_list("2-1", ',').unwrap_err().contains("reversed"));
        assert!(parse_cpu_list("x", ',').unwrap_err().contains("not a CPU"));
        assert!(parse_cpu_list("1,2", ':').is_err(), "the other separator is not one");
    }
}
