//! Live migration, as the back-end takes part in it: the dirty log of the
//! guest pages vsd writes (VHOST_F_LOG_ALL, LOG_SHMFD), driven by the
//! tests' own front-end so that every bit can be checked.

mod common;

use std::collections::BTreeSet;
use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::frontend::{BlkFrontend, GuestMemory, QUEUES, REGION_B, REGION_SIZE};
use common::{Daemon, Scratch, file_export};
use serde_json::{Value, json};
use vhost::VhostBackend;
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};
use vsd_control::client::QmpClient;

const PAGE: u64 = 4096;
/// Bytes of log for the test guest's memory (it ends at REGION_B + REGION_SIZE).
const LOG_BYTES: u64 = (REGION_B + REGION_SIZE) / PAGE / 8;

/// A dirty log as QEMU shares it: a memfd of bits, one per 4 KiB page.
struct Log(File);

impl Log {
    fn new(bytes: u64) -> Self {
        let file = vsd_sys::memfd("vsd-test-dirty-log").unwrap();
        file.set_len(bytes).unwrap();
        Self(file)
    }

    /// The pages marked, and clears them (as QEMU's sync does).
    fn take(&self) -> BTreeSet<u64> {
        let len = self.0.metadata().unwrap().len() as usize;
        let mut bits = vec![0u8; len];
        self.0.read_exact_at(&mut bits, 0).unwrap();
        self.0.write_all_at(&vec![0u8; len], 0).unwrap();
        (0..8 * len as u64).filter(|page| bits[(page / 8) as usize] & (1 << (page % 8)) != 0).collect()
    }
}

fn page(addr: u64) -> u64 {
    addr / PAGE
}

/// The pages a completed request of queue `q` writes besides its data:
/// the status byte (beside the header) and the used ring.
fn request_pages(fe: &BlkFrontend, q: usize) -> [u64; 2] {
    let (header, _) = BlkFrontend::scratch_area(q);
    [page(header), page(fe.queues[q].used)]
}

fn served(dir: &Scratch) -> Daemon {
    let image = dir.image("disk.img", 8 << 20);
    let socket = dir.path("vsd.sock");
    Daemon::vsd(dir, &file_export(&image, &socket, "", ",writable=on,num-queues=2"))
}

#[test]
fn every_guest_page_vsd_writes_is_logged_and_no_other() {
    let dir = Scratch::new("dirty-log");
    let daemon = served(&dir);
    let mut fe = BlkFrontend::connect(&daemon.socket, GuestMemory::new()).unwrap();
    let ok = VIRTIO_BLK_S_OK as u8;
    let log = Log::new(LOG_BYTES);
    fe.start_logging(&log.0, LOG_BYTES).unwrap();
    log.take();

    // A write on queue 0 (the device only reads its buffer), a read on
    // queue 1 (the device writes its buffer).
    let before = fe.mem.snapshot();
    let data = common::pattern(1, 8192);
    assert_eq!(fe.io(0, VIRTIO_BLK_T_OUT, 0, &mut data.clone()), Some((ok, 1)));
    let mut back = vec![0u8; 8192];
    assert_eq!(fe.io(1, VIRTIO_BLK_T_IN, 0, &mut back), Some((ok, 8193)));
    assert_eq!(back, data);
    let marked = log.take();

    let (_, read_buffer) = BlkFrontend::scratch_area(1);
    let mut expected: BTreeSet<u64> = [page(read_buffer), page(read_buffer) + 1].into();
    expected.extend(request_pages(&fe, 0));
    expected.extend(request_pages(&fe, 1));
    assert_eq!(marked, expected, "the pages of read data, status bytes and used rings, and only those");
    // Every byte that changed was written by the device, in a marked
    // page, or by the front-end: descriptors, available rings, the data
    // it wrote.
    let (_, write_buffer) = BlkFrontend::scratch_area(0);
    let mut by_front_end: Vec<Range<u64>> =
        fe.queues.iter().flat_map(|q| [q.desc..q.desc + 16 * 16, q.avail..q.avail + 6 + 2 * 16]).collect();
    by_front_end.push(write_buffer..write_buffer + 8192);
    let changed: BTreeSet<u64> = fe.mem.changed_outside(&before, &by_front_end).into_iter().map(page).collect();
    assert!(changed.is_subset(&marked), "pages changed but not logged: {:?}", changed.difference(&marked));
    assert!(!marked.contains(&page(write_buffer)), "a write's buffer is only read by the device");

    // QEMU hands over a new log when guest memory grows: the old one is
    // left alone from then on.
    let grown = Log::new(2 * LOG_BYTES);
    fe.set_log_base(&grown.0, 2 * LOG_BYTES).unwrap();
    log.take();
    let mut back = vec![0u8; 4096];
    assert_eq!(fe.io(0, VIRTIO_BLK_T_IN, 0, &mut back), Some((ok, 4097)));
    assert_eq!(log.take(), BTreeSet::new(), "the replaced log is not written any more");
    let mut expected: BTreeSet<u64> = [page(write_buffer)].into();
    expected.extend(request_pages(&fe, 0));
    let marked = grown.take();
    // Queue 1 moved to the new log too: it writes its used ring's flags
    // (kicks off) when it goes on, which may not have happened yet.
    let restarted = BTreeSet::from([page(fe.queues[1].used)]);
    assert!(marked.is_superset(&expected), "{marked:?} lacks some of {expected:?}");
    assert!(marked.difference(&expected).all(|p| restarted.contains(p)), "{marked:?}");

    // Logging off: nothing is marked any more. (Once it is off: until then
    // a worker going to sleep may still mark its used ring's flags.)
    fe.set_logging(false).unwrap();
    grown.take();
    for q in 0..QUEUES {
        fe.check_service(q, 64, true).unwrap();
    }
    assert_eq!(grown.take(), BTreeSet::new(), "LOG_ALL off");
}

#[test]
fn bad_logs_are_refused_and_the_export_serves_on() {
    let dir = Scratch::new("dirty-log-bad");
    let daemon = served(&dir);
    let refused = |what: &str, setup: &dyn Fn(&mut BlkFrontend) -> vhost::Result<()>| {
        let mut fe = BlkFrontend::connect(&daemon.socket, GuestMemory::new()).unwrap();
        assert!(setup(&mut fe).is_err(), "{what} was accepted");
    };
    refused("a log smaller than guest memory needs", &|fe| fe.set_log_base(&Log::new(8).0, 8));
    refused("a log larger than its file", &|fe| fe.set_log_base(&Log::new(LOG_BYTES).0, 2 * LOG_BYTES));
    refused("a pipe as the log", &|fe| {
        let (read, _write) = std::io::pipe().unwrap();
        fe.set_log_base(&File::from(std::os::fd::OwnedFd::from(read)), LOG_BYTES)
    });
    refused("a used ring logged outside guest memory", &|fe| {
        fe.set_log_base(&Log::new(LOG_BYTES).0, LOG_BYTES)?;
        fe.set_vring_addr(0, Some(REGION_B + REGION_SIZE + PAGE))
    });
    let mut fe = BlkFrontend::connect(&daemon.socket, GuestMemory::new()).unwrap();
    for q in 0..QUEUES {
        fe.check_service(q, 8, true).unwrap();
    }
}

/// `driver=qcow2,...` on `image` with an export allowed to be inactive,
/// and a QMP monitor.
fn qcow2_daemon(dir: &Scratch, image: &Path) -> (Daemon, PathBuf) {
    let socket = dir.path("vsd.sock");
    let qmp = dir.path("qmp.sock");
    let mut args = common::qcow2_export(image, &socket, ",writable=on,num-queues=2,allow-inactive=on");
    args.extend([
        "--chardev".into(),
        format!("socket,id=m,path={},server=on,wait=off", qmp.display()),
        "--monitor".into(),
        "chardev=m".into(),
    ]);
    (Daemon::vsd(dir, &args), qmp)
}

fn set_active(qmp: &mut QmpClient, node: &str, active: bool) -> Result<Value, String> {
    qmp.execute("blockdev-set-active", json!({ "node-name": node, "active": active })).map_err(|e| e.to_string())
}

fn node_active(qmp: &mut QmpClient, node: &str) -> bool {
    let nodes = qmp.execute("query-named-block-nodes", Value::Null).unwrap();
    let entry = nodes.as_array().unwrap().iter().find(|n| n["node-name"] == node).cloned();
    entry.unwrap_or_else(|| panic!("no node {node}"))["active"].as_bool().unwrap()
}

fn qemu_img_check(image: &Path) -> String {
    let out = common::run("qemu-img", &["check", image.to_str().unwrap()]);
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "qemu-img check: {report}{}", String::from_utf8_lossy(&out.stderr));
    report
}

/// The source's half of a migration: an inactive qcow2 node has written
/// its metadata back and keeps nothing cached, so another process may
/// write the image; requests wait meanwhile; activated, the node reads
/// the image afresh and sees what the other process wrote.
#[test]
fn an_inactive_qcow2_node_leaves_the_image_to_others_and_reads_it_afresh() {
    let dir = Scratch::new("inactive-qcow2");
    let image = dir.path("disk.qcow2");
    let out = common::run("qemu-img", &["create", "-f", "qcow2", image.to_str().unwrap(), "64M"]);
    assert!(out.status.success(), "{out:?}");
    let (daemon, qmp_socket) = qcow2_daemon(&dir, &image);
    let mut qmp = QmpClient::connect(&qmp_socket).unwrap();
    let mut fe = BlkFrontend::connect(&daemon.socket, GuestMemory::new()).unwrap();
    fe.check_service(0, 0, true).unwrap();

    set_active(&mut qmp, "q0", false).unwrap();
    assert!(!node_active(&mut qmp, "q0") && !node_active(&mut qmp, "f0"), "the file goes with its qcow2 node");
    assert!(qemu_img_check(&image).contains("No errors were found"), "metadata written back on inactivation");
    let resize = qmp.execute("block_resize", json!({ "node-name": "q0", "size": 128 << 20 }));
    assert_eq!(resize.unwrap_err().to_string(), "Permission 'resize' unavailable on inactive node");

    // Another process (the migration's other end) writes the image.
    let other = common::run("qemu-io", &["-f", "qcow2", "-c", "write -P 0x5a 1M 64k", image.to_str().unwrap()]);
    assert!(other.status.success(), "{other:?}");
    // A request meanwhile waits in its ring.
    let head = fe.start_io(1, VIRTIO_BLK_T_IN, (1 << 20) / 512, &[0u8; 4096]);
    assert_eq!(fe.wait_used(1, Duration::from_millis(300)), None, "served while the node is inactive");

    set_active(&mut qmp, "q0", true).unwrap();
    let used = fe.wait_used(1, Duration::from_secs(10)).expect("served once the node is active");
    assert_eq!(used.id, u32::from(head));
    let (_, buffer) = BlkFrontend::scratch_area(1);
    assert_eq!(fe.mem.read_bytes(buffer, 4096), vec![0x5a; 4096], "the other process's data, not stale metadata");
    // New clusters do not land on those the other process allocated.
    fe.check_service(0, (2 << 20) / 512, true).unwrap();
    assert_eq!(daemon.stop().code(), Some(0));
    assert!(qemu_img_check(&image).contains("No errors were found"));
    let read = common::run("qemu-io", &["-f", "qcow2", "-c", "read -P 0x5a 1M 64k", image.to_str().unwrap()]);
    assert!(read.status.success() && !String::from_utf8_lossy(&read.stdout).contains("fail"), "{read:?}");
}

/// QEMU's rules for who may inactivate what, and their wording.
#[test]
fn only_nodes_nothing_active_uses_can_be_inactivated() {
    let dir = Scratch::new("inactive-rules");
    let image = dir.path("disk.qcow2");
    assert!(common::run("qemu-img", &["create", "-f", "qcow2", image.to_str().unwrap(), "64M"]).status.success());
    let (_daemon, qmp_socket) = qcow2_daemon(&dir, &image);
    let mut qmp = QmpClient::connect(&qmp_socket).unwrap();
    assert_eq!(set_active(&mut qmp, "f0", false).unwrap_err(), "Node has active parent node");
    assert_eq!(set_active(&mut qmp, "nope", false).unwrap_err(), "Failed to find node with node-name='nope'");

    let export = |id: &str, extra: &str| {
        let path = dir.path(&format!("{id}.sock"));
        let text = format!(
            r#"{{"type": "vhost-user-blk", "id": "{id}", "node-name": "q0", "addr": {{"type": "unix", "path": "{}"}}{extra}}}"#,
            path.display()
        );
        serde_json::from_str::<Value>(&text).unwrap()
    };
    qmp.execute("block-export-add", export("pinning", "")).unwrap();
    assert_eq!(set_active(&mut qmp, "q0", false).unwrap_err(), "Failed to inactivate node: Operation not permitted");
    assert!(node_active(&mut qmp, "q0") && node_active(&mut qmp, "f0"), "a refusal changes nothing");
    qmp.execute("block-export-del", json!({ "id": "pinning" })).unwrap();

    set_active(&mut qmp, "q0", false).unwrap();
    qmp.execute("block-export-add", export("allowing", r#", "allow-inactive": true"#)).unwrap();
    assert!(!node_active(&mut qmp, "q0"), "an export that allows it leaves the node inactive");
    qmp.execute("block-export-add", export("taking", "")).unwrap();
    assert!(node_active(&mut qmp, "q0"), "an export that does not takes the image over, as in QEMU");
}

/// SET_LOG_FD: an eventfd vsd signals once a batch wrote to the log; any
/// other descriptor is refused, and the connection carries on.
#[test]
fn the_log_eventfd_is_signalled_after_logged_writes() {
    let dir = Scratch::new("dirty-log-fd");
    let daemon = served(&dir);
    let mut fe = BlkFrontend::connect(&daemon.socket, GuestMemory::new()).unwrap();
    let (read, _write) = std::io::pipe().unwrap();
    assert!(fe.conn.set_log_fd(read.as_raw_fd()).is_err(), "a pipe is not an eventfd");
    let call = EventFd::new(EFD_NONBLOCK).unwrap();
    fe.conn.set_log_fd(call.as_raw_fd()).unwrap();
    fe.check_service(0, 0, true).unwrap();
    assert!(call.read().is_err(), "signalled while logging was off");

    let log = Log::new(LOG_BYTES);
    fe.start_logging(&log.0, LOG_BYTES).unwrap();
    fe.check_service(1, 8, true).unwrap();
    assert!(call.read().unwrap() > 0, "not signalled after logged writes");
    assert!(!log.take().is_empty());
}
