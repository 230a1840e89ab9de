//! Running under a service manager such as systemd: readiness, status and
//! stopping told over `NOTIFY_SOCKET` (sd_notify(3)), one line per export,
//! server and monitor once the daemon serves, and log lines journald
//! reads a priority from.

use std::io::IsTerminal;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use vsd_sys::notify::Notifier;

use crate::daemon::{Daemon, Export};

/// Syslog priorities, as journald reads them from a line's `<N>` prefix.
pub(crate) const ERR: u8 = 3;
pub(crate) const WARNING: u8 = 4;
pub(crate) const INFO: u8 = 6;
const DEBUG: u8 = 7;

/// How often `STATUS=` is brought up to date: the exports have no hook
/// for their clients coming and going, and a look at them costs a lock.
const STATUS_PERIOD: Duration = Duration::from_secs(2);

/// Whether standard error is journald's stream: `JOURNAL_STREAM` names
/// its device and inode (sd-daemon(3)), which a redirection changes.
pub(crate) fn stderr_is_journal() -> bool {
    static JOURNAL: OnceLock<bool> = OnceLock::new();
    *JOURNAL.get_or_init(|| {
        use std::os::fd::AsFd;
        use std::os::unix::fs::MetadataExt;
        let Some(named) = std::env::var_os("JOURNAL_STREAM") else { return false };
        let stderr = std::io::stderr().as_fd().try_clone_to_owned().map(std::fs::File::from);
        stderr.and_then(|f| f.metadata()).is_ok_and(|m| named.to_str() == Some(&format!("{}:{}", m.dev(), m.ino())))
    })
}

/// The priority journald files a log record of `level` under.
pub(crate) fn priority(level: log::Level) -> u8 {
    match level {
        log::Level::Error => ERR,
        log::Level::Warn => WARNING,
        log::Level::Info => INFO,
        log::Level::Debug | log::Level::Trace => DEBUG,
    }
}

/// Prints `vsd: TEXT` on standard error, with its priority for journald.
pub(crate) fn say(priority: u8, text: &str) {
    match stderr_is_journal() {
        true => eprintln!("<{priority}>vsd: {text}"),
        false => eprintln!("vsd: {text}"),
    }
}

/// What the daemon tells the service manager, if one asked
/// (`NOTIFY_SOCKET`): nothing once a message could not be sent, which is
/// said once.
pub(crate) struct Notify(Arc<Mutex<Option<Notifier>>>);

impl Notify {
    /// Reads `NOTIFY_SOCKET`: call it before any thread starts. A socket
    /// that cannot be reached is warned of, and the daemon serves on.
    pub(crate) fn from_env() -> Self {
        let notifier = Notifier::from_env().and_then(|connected| {
            connected.map_err(|e| say(WARNING, &format!("warning: {e}: the service manager is not told"))).ok()
        });
        Self(Arc::new(Mutex::new(notifier)))
    }

    /// Says the daemon serves (`READY=1`, with its pid if it became a
    /// daemon: the manager started another process), what it serves, and
    /// keeps that current until it stops.
    pub(crate) fn ready(&self, daemon: &Arc<Daemon>, daemonized: bool) {
        let mut status = status(daemon);
        let main_pid = if daemonized { format!("MAINPID={}\n", std::process::id()) } else { String::new() };
        if !send(&self.0, &format!("READY=1\n{main_pid}STATUS={status}")) {
            return;
        }
        let (slot, daemon) = (self.0.clone(), daemon.clone());
        let refresh = move || {
            loop {
                std::thread::sleep(STATUS_PERIOD);
                let now = self::status(&daemon);
                if now != status && !send(&slot, &format!("STATUS={now}")) {
                    return;
                }
                status = now;
            }
        };
        if let Err(e) = std::thread::Builder::new().name("vsd-status".into()).spawn(refresh) {
            log::warn!("STATUS= stays as it is: cannot start its thread: {e}");
        }
    }

    /// Says the daemon is stopping (`STOPPING=1`); nothing is sent after.
    pub(crate) fn stopping(&self) {
        if send(&self.0, "STOPPING=1\nSTATUS=stopping") {
            lock(&self.0).take();
        }
    }
}

fn lock(slot: &Mutex<Option<Notifier>>) -> std::sync::MutexGuard<'_, Option<Notifier>> {
    slot.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Sends `state` if a notifier is left; whether one is.
fn send(slot: &Mutex<Option<Notifier>>, state: &str) -> bool {
    let mut notifier = lock(slot);
    let Some(sent) = notifier.as_ref().map(|n| n.notify(state)) else { return false };
    if let Err(e) = sent {
        say(WARNING, &format!("warning: cannot tell the service manager '{state}': {e}; it is told nothing more"));
        *notifier = None;
    }
    notifier.is_some()
}

/// `STATUS=`: each export, its type and whether a client is connected.
fn status(daemon: &Daemon) -> String {
    let state = daemon.state();
    let exports: Vec<String> = state
        .exports
        .values()
        .map(|e| format!("{} ({}, {})", e.id(), e.kind(), if e.has_client() { "connected" } else { "no client" }))
        .collect();
    let connected = state.exports.values().filter(|e| e.has_client()).count();
    match exports.len() {
        0 => "serving no export".into(),
        n => format!("{n} export{}, {connected} connected: {}", if n == 1 { "" } else { "s" }, exports.join(", ")),
    }
}

/// Says what the daemon serves and where, one line each, when someone
/// reads standard error as it goes: a terminal or the journal. A pipe or
/// file hears nothing, as from qemu-storage-daemon, whose output scripts
/// compare.
pub(crate) fn say_serving(daemon: &Daemon, monitors: &[String]) {
    if !(std::io::stderr().is_terminal() || stderr_is_journal()) {
        return;
    }
    for line in serving(daemon, monitors) {
        say(INFO, &line);
    }
}

fn serving(daemon: &Daemon, monitors: &[String]) -> Vec<String> {
    let state = daemon.state();
    let server = state.nbd.as_ref().map(|s| format!("serving NBD on {}", s.config().addr));
    let exports = state.exports.values().map(|export| {
        let (id, kind, node) = (export.id(), export.kind(), export.node());
        match export {
            Export::VhostUserBlk(e) => {
                format!("serving export {id} ({kind}, node {}) on {}", node.name(), e.config().addr)
            }
            Export::Nbd(e) => {
                format!("serving export {id} ({kind}, node {}) over NBD as '{}'", node.name(), e.config().name)
            }
            Export::Fuse(e) => {
                format!("serving export {id} ({kind}, node {}) as the file '{}'", node.name(), e.config().mountpoint)
            }
        }
    });
    let monitors = monitors.iter().map(|at| format!("serving QMP on {at}"));
    server.into_iter().chain(exports).chain(monitors).collect()
}
