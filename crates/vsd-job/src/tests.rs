//! The status machine: the verb table and the finishing sequence.

use std::sync::mpsc::{Receiver, channel};
use std::time::Duration;

use super::*;

/// A body that waits for a verdict sent to it, pausing and cancelling as asked.
struct Scripted(Receiver<Result<(), String>>);

impl JobBody for Scripted {
    fn run(&mut self, job: &Arc<Job>) -> Result<(), String> {
        loop {
            if job.cancelled() {
                return Err(CANCELLED.into());
            }
            if !job.pause_point()
                && let Ok(verdict) = self.0.try_recv()
            {
                return verdict;
            }
            job.wait(Some(Instant::now() + Duration::from_millis(5)));
        }
    }
}

/// A registry whose events are collected as `text` makes them of the
/// event's name and data, and a way to read them.
fn registry_logging(text: fn(&str, &Value) -> String) -> (Jobs, Arc<Mutex<Vec<String>>>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let sink = log.clone();
    let emit: Emit = Arc::new(move |name: &str, data: Value| sink.lock().unwrap().push(text(name, &data)));
    (Jobs::new(emit), log)
}

/// A registry whose events are logged as their status, or their name.
fn registry() -> (Jobs, Arc<Mutex<Vec<String>>>) {
    registry_logging(|name, data| data.get("status").and_then(Value::as_str).unwrap_or(name).to_string())
}

fn spec(id: &str, auto: bool) -> JobSpec {
    JobSpec {
        id: id.into(),
        kind: "backup",
        auto_finalize: auto,
        auto_dismiss: auto,
        speed: 0,
        nodes: vec![format!("{id}-target"), format!("{id}-source")],
        group: None,
    }
}

fn wait_for(job: &Job, status: Status) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while job.status() != status {
        assert!(Instant::now() < deadline, "still {:?}, not {status:?}", job.status());
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn events(log: &Mutex<Vec<String>>) -> Vec<String> {
    std::mem::take(&mut *log.lock().unwrap())
}

#[test]
fn the_verb_table_is_qemus() {
    use Status::*;
    let all = [Created, Running, Paused, Ready, Standby, Waiting, Pending, Aborting, Concluded, Null];
    let allowed = |verb: Verb| all.iter().filter(|s| verb.allowed(**s)).map(|s| s.name()).collect::<Vec<_>>();
    assert_eq!(allowed(Verb::Cancel), ["created", "running", "paused", "ready", "standby", "waiting", "pending"]);
    for verb in [Verb::Pause, Verb::Resume, Verb::SetSpeed, Verb::Change] {
        assert_eq!(allowed(verb), ["created", "running", "paused", "ready", "standby"], "{verb:?}");
    }
    assert_eq!(allowed(Verb::Complete), ["ready"]);
    assert_eq!(allowed(Verb::Finalize), ["pending"]);
    assert_eq!(allowed(Verb::Dismiss), ["concluded"]);
}

#[test]
fn a_job_that_succeeds_goes_through_every_status_in_order() {
    let (jobs, log) = registry();
    let (send, receive) = channel();
    let job = jobs.start(spec("j1", true), Box::new(Scripted(receive))).unwrap();
    wait_for(&job, Status::Running);
    assert_eq!(
        jobs.start(spec("j1", true), Box::new(Scripted(channel().1))).err().unwrap(),
        "Job ID 'j1' already in use"
    );
    assert_eq!(job.dismiss().unwrap_err(), "Job 'j1' in state 'running' cannot accept command verb 'dismiss'");
    assert_eq!(job.complete().unwrap_err(), "Job 'j1' in state 'running' cannot accept command verb 'complete'");
    assert_eq!(jobs.user_of("j1-source").map(|(_, at)| at), Some(1));
    send.send(Ok(())).unwrap();
    wait_for(&job, Status::Null);
    assert_eq!(events(&log), ["created", "running", "waiting", "pending", "BLOCK_JOB_COMPLETED", "concluded", "null"]);
    assert!(jobs.get("j1").is_none() && jobs.user_of("j1-target").is_none(), "dismissed jobs go");
}

#[test]
fn pause_resume_and_manual_finalize_and_dismiss() {
    let (jobs, log) = registry();
    let (send, receive) = channel();
    let job = jobs.start(spec("j2", false), Box::new(Scripted(receive))).unwrap();
    job.pause().unwrap();
    assert_eq!(job.pause().unwrap_err(), "Job is already paused");
    wait_for(&job, Status::Paused);
    assert!(job.info().paused);
    job.resume().unwrap();
    assert_eq!(job.resume().unwrap_err(), "Can't resume a job that was not paused");
    wait_for(&job, Status::Running);
    send.send(Ok(())).unwrap();
    wait_for(&job, Status::Pending);
    assert!(job.pause().is_err(), "a pending job cannot pause");
    job.finalize().unwrap();
    wait_for(&job, Status::Concluded);
    assert_eq!(job.finalize().unwrap_err(), "Job 'j2' in state 'concluded' cannot accept command verb 'finalize'");
    job.dismiss().unwrap();
    let want = [
        "created",
        "running",
        "paused",
        "running",
        "waiting",
        "pending",
        "BLOCK_JOB_PENDING",
        "BLOCK_JOB_COMPLETED",
        "concluded",
        "null",
    ];
    assert_eq!(events(&log), want);
}

#[test]
fn failures_and_cancels_abort() {
    let (jobs, log) = registry();
    let (send, receive) = channel();
    let failed = jobs.start(spec("f", false), Box::new(Scripted(receive))).unwrap();
    send.send(Err("Input/output error".into())).unwrap();
    wait_for(&failed, Status::Concluded);
    assert_eq!(failed.info().error.as_deref(), Some("Input/output error"));
    assert_eq!(events(&log), ["created", "running", "aborting", "BLOCK_JOB_COMPLETED", "concluded"]);

    let (send, receive) = channel();
    let pending = jobs.start(spec("p", false), Box::new(Scripted(receive))).unwrap();
    send.send(Ok(())).unwrap();
    wait_for(&pending, Status::Pending);
    pending.cancel().unwrap();
    wait_for(&pending, Status::Concluded);
    assert_eq!(pending.info().error.as_deref(), Some(CANCELLED));
    let want = [
        "created",
        "running",
        "waiting",
        "pending",
        "BLOCK_JOB_PENDING",
        "aborting",
        "BLOCK_JOB_CANCELLED",
        "concluded",
    ];
    assert_eq!(events(&log), want);

    let running = jobs.start(spec("r", true), Box::new(Scripted(channel().1))).unwrap();
    running.pause().unwrap();
    wait_for(&running, Status::Paused);
    jobs.shutdown();
    assert_eq!(running.status(), Status::Null, "shutdown cancels a paused job and waits for it");
    assert_eq!(jobs.all().len(), 2, "concluded jobs stay until dismissed");
}

#[test]
fn errors_follow_the_policy() {
    let (jobs, log) = registry();
    let job = jobs.start(spec("e", true), Box::new(Scripted(channel().1))).unwrap();
    assert!(!job.io_error(ErrorPolicy::Report, true, libc::EIO));
    assert!(job.io_error(ErrorPolicy::Ignore, false, libc::EIO));
    assert!(!job.io_error(ErrorPolicy::Enospc, true, libc::EIO));
    assert!(!job.info().io_failed);
    assert!(job.io_error(ErrorPolicy::Enospc, true, libc::ENOSPC));
    wait_for(&job, Status::Paused);
    assert!(job.info().io_failed);
    job.resume().unwrap();
    assert!(!job.info().io_failed);
    job.cancel().unwrap();
    wait_for(&job, Status::Null);
    assert_eq!(strerror(libc::EIO), "Input/output error");
    assert_eq!(events(&log).iter().filter(|e| *e == "BLOCK_JOB_ERROR").count(), 4);
}

/// A registry whose events are logged as `id:status` or `id:EVENT`.
fn registry_by_id() -> (Jobs, Arc<Mutex<Vec<String>>>) {
    registry_logging(|name, data| {
        let id = data.get("id").or_else(|| data.get("device")).and_then(Value::as_str).unwrap_or_default();
        let what = data.get("status").and_then(Value::as_str).unwrap_or(name);
        format!("{id}:{what}")
    })
}

fn grouped(id: &str, group: &Arc<Group>) -> JobSpec {
    JobSpec { group: Some(group.clone()), ..spec(id, true) }
}

/// Grouped jobs wait for each other, then become pending together and
/// conclude newest first, as QEMU's job transactions do.
#[test]
fn grouped_jobs_finish_together() {
    let (jobs, log) = registry_by_id();
    let group = Group::new();
    let (send_a, receive_a) = channel();
    let (send_b, receive_b) = channel();
    let a = jobs.start(grouped("a", &group), Box::new(Scripted(receive_a))).unwrap();
    let b = jobs.start(grouped("b", &group), Box::new(Scripted(receive_b))).unwrap();
    group.seal();
    send_a.send(Ok(())).unwrap();
    wait_for(&a, Status::Waiting);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(a.status(), Status::Waiting, "a waits for b");
    send_b.send(Ok(())).unwrap();
    wait_for(&a, Status::Null);
    wait_for(&b, Status::Null);
    let want = [
        "a:created",
        "a:running",
        "b:created",
        "b:running",
        "a:waiting",
        "b:waiting",
        "b:pending",
        "a:pending",
        "b:BLOCK_JOB_COMPLETED",
        "b:concluded",
        "b:null",
        "a:BLOCK_JOB_COMPLETED",
        "a:concluded",
        "a:null",
    ];
    assert_eq!(events(&log), want);
}

/// A grouped job that fails cancels the others, running or waiting.
#[test]
fn a_failed_member_cancels_its_group() {
    let (jobs, log) = registry_by_id();
    let group = Group::new();
    let (send_a, receive_a) = channel();
    let (send_b, receive_b) = channel();
    let a = jobs.start(grouped("a", &group), Box::new(Scripted(receive_a))).unwrap();
    let b = jobs.start(grouped("b", &group), Box::new(Scripted(receive_b))).unwrap();
    let c = jobs.start(grouped("c", &group), Box::new(Scripted(channel().1))).unwrap();
    group.seal();
    send_a.send(Ok(())).unwrap();
    wait_for(&a, Status::Waiting);
    send_b.send(Err("Input/output error".into())).unwrap();
    for job in [&a, &b, &c] {
        wait_for(job, Status::Null);
    }
    let mut ends: Vec<String> = events(&log).into_iter().filter(|e| e.contains("BLOCK_JOB")).collect();
    ends.sort();
    assert_eq!(ends, ["a:BLOCK_JOB_CANCELLED", "b:BLOCK_JOB_COMPLETED", "c:BLOCK_JOB_CANCELLED"]);
    assert_eq!(b.info().error.as_deref(), Some("Input/output error"));
    assert_eq!(a.info().error.as_deref(), Some(CANCELLED));
}
