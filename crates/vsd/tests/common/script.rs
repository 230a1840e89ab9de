//! One QMP script run against vsd and against qemu-storage-daemon, the
//! answers and events compared: vsd must say what QEMU says.

use serde_json::Value;

use super::qmp::Qmp;
use super::{Daemon, Scratch, monitor};

/// One step of a script.
#[derive(Clone)]
pub enum Step {
    Command(&'static str, Value),
    /// Waits for an event (its name, and members its data must hold).
    Await(&'static str, Value),
    /// Lets the daemon work for this many milliseconds.
    Sleep(u64),
}

/// Runs `script` on a daemon `program` starts in scratch directory
/// `name`, with the arguments `setup` makes there (a monitor is added);
/// returns the answers, the events as `filter` keeps them, and the script.
/// `after` looks at the directory once the daemon stopped.
fn run(
    program: fn(&Scratch, &[String]) -> Daemon,
    name: &str,
    setup: &dyn Fn(&Scratch) -> Vec<String>,
    script: &dyn Fn(&Scratch) -> Vec<Step>,
    filter: fn(Vec<Value>) -> Vec<Value>,
    after: &dyn Fn(&Scratch),
) -> (Vec<Value>, Vec<Value>, Vec<Step>) {
    let dir = Scratch::new(name);
    let script = script(&dir);
    let socket = dir.path("qmp.sock");
    let mut args = setup(&dir);
    args.extend(monitor(&socket));
    let daemon = program(&dir, &args);
    let mut qmp = Qmp::connect(&socket);
    let mut answers = Vec::new();
    for step in &script {
        match step {
            Step::Command(command, args) => answers.push(qmp.answer(command, args.clone())),
            Step::Await(event, data) => drop(qmp.await_event(event, data.clone())),
            Step::Sleep(ms) => std::thread::sleep(std::time::Duration::from_millis(*ms)),
        }
    }
    let events = filter(qmp.event_log());
    drop(daemon);
    after(&dir);
    let (answers, events) = (in_any_dir(&dir, answers), in_any_dir(&dir, events));
    (answers, events, script)
}

/// `values` with the paths of scratch directory `dir` written `$DIR`, as
/// each daemon has a directory of its own.
fn in_any_dir(dir: &Scratch, values: Vec<Value>) -> Vec<Value> {
    let text = serde_json::to_string(&values).unwrap().replace(dir.0.to_str().unwrap(), "$DIR");
    serde_json::from_str(&text).unwrap()
}

/// Paused and running flap around every command in QEMU (its drained
/// sections): a filter keeping only the other job statuses.
pub fn stable(events: Vec<Value>) -> Vec<Value> {
    events.into_iter().filter(|e| !matches!(e[1]["status"].as_str(), Some("paused" | "running"))).collect()
}

/// Runs `script` on vsd and on qemu-storage-daemon (scratch directories
/// named after `name`) and asserts that every answer and every event, as
/// `filter` keeps them, is the same.
pub fn assert_same_as_qsd(
    name: &str,
    setup: &dyn Fn(&Scratch) -> Vec<String>,
    script: &[Step],
    filter: fn(Vec<Value>) -> Vec<Value>,
) {
    assert_same_as_qsd_then(name, setup, script, filter, &|_| {});
}

/// [`assert_same_as_qsd`], with `after` looking at each daemon's
/// directory once it stopped: vsd's, then qemu-storage-daemon's.
pub fn assert_same_as_qsd_then(
    name: &str,
    setup: &dyn Fn(&Scratch) -> Vec<String>,
    script: &[Step],
    filter: fn(Vec<Value>) -> Vec<Value>,
    after: &dyn Fn(&Scratch),
) {
    assert_same_as_qsd_in(name, setup, &|_| script.to_vec(), filter, after);
}

/// [`assert_same_as_qsd_then`], with a script made for each daemon's
/// directory (commands that name files in it).
pub fn assert_same_as_qsd_in(
    name: &str,
    setup: &dyn Fn(&Scratch) -> Vec<String>,
    script: &dyn Fn(&Scratch) -> Vec<Step>,
    filter: fn(Vec<Value>) -> Vec<Value>,
    after: &dyn Fn(&Scratch),
) {
    let vsd = run(Daemon::vsd, &format!("{name}-vsd"), setup, script, filter, after);
    let qsd = run(Daemon::qsd, &format!("{name}-qsd"), setup, script, filter, after);
    let commands = vsd.2.iter().filter_map(|s| match s {
        Step::Command(command, args) => Some((command, args)),
        _ => None,
    });
    for ((command, args), (ours, theirs)) in commands.zip(vsd.0.iter().zip(&qsd.0)) {
        assert_eq!(ours, theirs, "{command} {args}");
    }
    for (at, (ours, theirs)) in vsd.1.iter().zip(&qsd.1).enumerate() {
        assert_eq!(ours, theirs, "event {at}; vsd's: {:#?}", &vsd.1);
    }
    assert_eq!(vsd.1.len(), qsd.1.len(), "as many events");
}
