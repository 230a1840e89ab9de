//! Thin wrappers around the Linux system calls vsd makes directly, by
//! subject: files, pipes and splice, event counters, unix sockets, users,
//! CPUs, becoming a daemon and telling the service manager how it does,
//! its termination signals, interrupting a blocked thread, and confinement (no new privileges, no capabilities,
//! the sandbox's SIGSYS).
//!
//! Every call returns `io::Result`, so callers never look at `errno`
//! themselves, and every `unsafe` block of that kind lives here. Also the
//! few text parsers every tool shares ([`size`], [`parse_cpu_list`]).

#![deny(missing_docs)]

pub mod activation;
pub mod confine;
pub mod counter;
pub mod cpu;
pub mod daemon;
pub mod file;
pub mod interrupt;
pub mod lock;
pub mod notify;
pub mod pipe;
pub mod process;
pub mod size;
pub mod socket;
pub mod termination;
pub mod user;

use std::io;

pub use counter::{read_counter, set_nonblocking, signal_counter};
pub use cpu::{allowed_cpus, parse_cpu_list, set_thread_affinity};
pub use file::{
    Residence, dio_alignment, falloc, fallocate, fdatasync, file_size, logical_block_size, memfd, preadv2, pwritev2,
    residence, seek_data_or_hole,
};
pub use pipe::{Pipe, fully_cached, page_size};
pub use socket::{ListenError, listen_unix, listen_unix_owned, peek};
pub use termination::{block_termination_signals, raise_termination, wait_for_termination};
pub use user::{UserIds, drop_privileges, group_by_name, group_list, user_by_name};

pub(crate) fn check(ret: libc::c_long) -> io::Result<usize> {
    if ret < 0 { Err(io::Error::last_os_error()) } else { Ok(ret as usize) }
}
