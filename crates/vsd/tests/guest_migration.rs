//! Live migration of a real Linux guest (QEMU under TCG) whose disk vsd
//! serves: the guest runs fio write + crc32c verify on a 2-queue disk while
//! it moves from a QEMU on vsd A to a QEMU on vsd B, both serving the same
//! qcow2 image, and back, the image changing hands between the daemons at
//! each switch-over (`blockdev-set-active`), as a management tool does. On
//! the way, a migration is cancelled half-way, and vsd B is killed and
//! restarted under the guest, which its in-flight region must survive.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Daemon, Scratch};
use serde_json::{Value, json};
use vsd_control::client::QmpClient;

/// Migration bandwidth: slow enough that fio's I/O overlaps the pre-copy.
const MAX_BANDWIDTH: u64 = 64 << 20;

/// One vsd serving `image` as qcow2 node `q0` on `name.sock`, with a QMP
/// monitor on `name-qmp.sock`; an inactive one until it takes the image.
fn vsd(dir: &Scratch, name: &str, image: &Path, active: bool) -> (Daemon, QmpClient) {
    let on = if active { "on" } else { "off" };
    let qmp = dir.path(&format!("{name}-qmp.sock"));
    let args = [
        "--blockdev".into(),
        format!("driver=file,node-name=f0,filename={},active={on}", image.display()),
        "--blockdev".into(),
        format!("driver=qcow2,node-name=q0,file=f0,active={on}"),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=e0,node-name=q0,addr.type=unix,addr.path={},writable=on,num-queues=2,allow-inactive=on",
            dir.path(&format!("{name}.sock")).display()
        ),
        "--chardev".into(),
        format!("socket,id=m,path={},server=on,wait=off", qmp.display()),
        "--monitor".into(),
        "chardev=m".into(),
    ];
    let daemon = Daemon::vsd(dir, &args);
    let client = QmpClient::connect(&qmp).unwrap();
    (daemon, client)
}

/// A QEMU running (or, with `incoming`, waiting for) the test guest, driven
/// over QMP.
struct Qemu {
    child: Child,
    qmp: QmpClient,
    log: PathBuf,
}

impl Qemu {
    fn start(dir: &Scratch, name: &str, socket: &Path, incoming: Option<&str>) -> Self {
        let qmp = dir.path(&format!("{name}.qmp"));
        let log = dir.path(&format!("{name}.log"));
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/guest/run-guest.sh");
        let mut command = Command::new(script);
        command
            .args(["--timeout", "900", "--queues", "2", "--smp", "2", "--iodepth", "32"])
            .args(["--size", "256M", "--bs", "4k", "--reconnect-ms", "200"])
            // A read-back pass long enough for the kill, the restart and
            // the migration back to happen during it.
            .args(["--append", "vsd.verify_iops=1000"])
            .arg("--socket")
            .arg(socket)
            .arg("--qmp")
            .arg(&qmp)
            .arg("--log")
            .arg(&log)
            .stdout(Stdio::null())
            // A destination whose migration is cancelled fails on purpose;
            // what matters is in the console logs.
            .stderr(Stdio::null());
        if let Some(uri) = incoming {
            command.args(["--incoming", uri]);
        }
        let child = command.spawn().expect("run scripts/guest/run-guest.sh");
        let qmp = wait_for(Duration::from_secs(120), &format!("{name}'s QMP socket"), || QmpClient::connect(&qmp).ok());
        Self { child, qmp, log }
    }

    fn run(&mut self, command: &str, args: Value) -> Value {
        self.qmp.execute(command, args).unwrap_or_else(|e| panic!("{command}: {e}"))
    }

    /// Migrates the guest to the QEMU listening at `uri` and waits until
    /// QEMU says it is done; returns the final `query-migrate`.
    fn migrate(&mut self, uri: &str) -> Value {
        self.run("migrate-set-parameters", json!({ "max-bandwidth": MAX_BANDWIDTH }));
        self.run("migrate", json!({ "uri": uri }));
        wait_for(Duration::from_secs(300), "the migration", || {
            let info = self.run("query-migrate", Value::Null);
            match info["status"].as_str() {
                Some("completed") => Some(info),
                Some("failed" | "cancelled") => panic!("migration: {info}"),
                _ => None,
            }
        })
    }

    /// Quits QEMU (a source whose guest has left) and waits for it.
    fn quit(mut self) {
        let _ = self.qmp.execute("quit", Value::Null);
        let status = self.child.wait().unwrap();
        assert!(status.success(), "QEMU exited with {status}");
    }
}

fn wait_for<T>(limit: Duration, what: &str, mut ready: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = ready() {
            return value;
        }
        assert!(Instant::now() < deadline, "waited {limit:?} for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Requests of these kinds (`rd_operations`, `wr_operations`) the guest
/// made through a daemon's export so far.
fn requests(vsd: &mut QmpClient, kinds: &[&str]) -> u64 {
    let stats = vsd.execute("query-blockstats", Value::Null).unwrap();
    kinds.iter().map(|kind| stats[0]["stats"][kind].as_u64().unwrap()).sum()
}

const ANY: &[&str] = &["rd_operations", "wr_operations"];
const READS: &[&str] = &["rd_operations"];

/// Waits until the guest has made `more` requests of `kinds` through `vsd`
/// since now.
fn wait_for_requests(vsd: &mut QmpClient, kinds: &[&str], more: u64, what: &str) {
    let from = requests(vsd, kinds);
    wait_for(Duration::from_secs(300), what, || (requests(vsd, kinds) >= from + more).then_some(()));
}

/// Hands the image from one daemon to the other: the source lets it go
/// (writing its metadata back), then the destination takes it.
fn hand_over(from: &mut QmpClient, to: &mut QmpClient) {
    from.execute("blockdev-set-active", json!({ "node-name": "q0", "active": false })).unwrap();
    to.execute("blockdev-set-active", json!({ "node-name": "q0", "active": true })).unwrap();
}

/// Moves the guest from `source` to a new QEMU `name` on `to` (a daemon
/// serving the image inactive), as a management tool does: migrate, hand
/// the image from `from_qmp`'s daemon to `to_qmp`'s, resume, quit the
/// source. Returns the new QEMU, the final `query-migrate` and the
/// source's console log.
fn switch_over(
    dir: &Scratch,
    mut source: Qemu,
    name: &str,
    to: &Daemon,
    from_qmp: &mut QmpClient,
    to_qmp: &mut QmpClient,
) -> (Qemu, Value, PathBuf) {
    let uri = format!("unix:{}", dir.path(&format!("{name}-incoming.sock")).display());
    let mut destination = Qemu::start(dir, name, &to.socket, Some(&uri));
    let info = source.migrate(&uri);
    hand_over(from_qmp, to_qmp);
    destination.run("cont", Value::Null);
    let log = source.log.clone();
    source.quit();
    (destination, info, log)
}

/// The guest's facts, from every console it printed to, in order.
fn facts(logs: &[&Path]) -> HashMap<String, String> {
    let text: String = logs.iter().map(|log| std::fs::read_to_string(log).unwrap_or_default()).collect();
    text.lines()
        .filter_map(|l| l.trim_end_matches('\r').strip_prefix("VSD-GUEST "))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn a_guest_under_fio_verify_migrates_between_two_vsds_and_back() {
    let dir = Scratch::new("guest-migration");
    let image = dir.path("disk.qcow2");
    let out = common::run("qemu-img", &["create", "-f", "qcow2", image.to_str().unwrap(), "512M"]);
    assert!(out.status.success(), "{out:?}");
    let (vsd_a, mut qmp_a) = vsd(&dir, "a", &image, true);
    let (mut vsd_b, mut qmp_b) = vsd(&dir, "b", &image, false);

    let mut first = Qemu::start(&dir, "qemu1", &vsd_a.socket, None);
    wait_for_requests(&mut qmp_a, ANY, 2000, "the guest's requests on vsd A");

    // A migration cancelled half-way: the source goes on serving.
    let cancelled = format!("unix:{}", dir.path("mig0.sock").display());
    let mut abandoned = Qemu::start(&dir, "qemu0", &vsd_b.socket, Some(&cancelled));
    first.run("migrate-set-parameters", json!({ "max-bandwidth": 1 << 20 }));
    first.run("migrate", json!({ "uri": cancelled }));
    wait_for_requests(&mut qmp_a, ANY, 500, "the guest's requests on vsd A while RAM is being sent");
    first.run("migrate_cancel", Value::Null);
    wait_for(Duration::from_secs(60), "the cancellation", || {
        (first.run("query-migrate", Value::Null)["status"] == "cancelled").then_some(())
    });
    // The destination gives up once its source does.
    let _ = abandoned.child.wait();
    wait_for_requests(&mut qmp_a, ANY, 500, "the guest's requests on vsd A after the cancellation");

    let (second, there, first_log) = switch_over(&dir, first, "qemu2", &vsd_b, &mut qmp_a, &mut qmp_b);
    // Once fio has written and flushed everything (writes acknowledged but
    // not flushed are lost with a killed daemon, as with QEMU's), and reads
    // it back: the reads completed during the switch-over back reach the
    // destination only through the dirty log.
    wait_for(Duration::from_secs(300), "the guest's write pass", || {
        facts(&[&first_log, &second.log]).contains_key("fio_write_status").then_some(())
    });
    wait_for_requests(&mut qmp_b, READS, 2000, "the guest's reads on vsd B");
    // vsd B dies with requests in flight; its successor takes over from the
    // in-flight region QEMU kept, as without a migration.
    vsd_b.kill();
    common::wait_until_unlocked(&image);
    (vsd_b, qmp_b) = vsd(&dir, "b", &image, true);
    wait_for_requests(&mut qmp_b, READS, 2000, "the guest's reads on the restarted vsd B");

    // And back: a new QEMU on vsd A, whose export the first one left.
    let (mut third, back, second_log) = switch_over(&dir, second, "qemu3", &vsd_a, &mut qmp_b, &mut qmp_a);
    wait_for_requests(&mut qmp_a, ANY, 1000, "the guest's requests on vsd A after the return");
    let status = third.child.wait().unwrap();
    assert!(status.success(), "the last QEMU: {status}");

    let facts = facts(&[&first_log, &second_log, &third.log]);
    assert_eq!(facts["queues"], "2", "the guest uses both virtqueues");
    assert_eq!(facts["fio_write_status"], "0", "{facts:?}");
    assert_eq!(facts["fio_verify_status"], "0", "{facts:?}");
    assert_eq!(facts["fio_verify_read_bytes"], facts["fio_expected_bytes"]);
    assert_eq!(facts["fio_write_write_bytes"], facts["fio_expected_bytes"]);
    let log3 = std::fs::read_to_string(&third.log).unwrap();
    assert!(log3.lines().any(|l| l.trim_end() == "VSD-GUEST done"), "the guest finished on the third QEMU");
    // Both migrations moved RAM while the guest kept writing.
    for info in [&there, &back] {
        assert!(info["ram"]["transferred"].as_u64().unwrap() > 0, "{info}");
    }

    assert_eq!(vsd_a.stop().code(), Some(0));
    assert_eq!(vsd_b.stop().code(), Some(0));
    let check = common::run("qemu-img", &["check", image.to_str().unwrap()]);
    let report = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success() && report.contains("No errors were found"), "{report}");
}
