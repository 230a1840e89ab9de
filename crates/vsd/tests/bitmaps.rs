//! Dirty bitmaps: QMP's `block-dirty-bitmap-*` against qemu-storage-daemon
//! answering the same commands, writes recorded from every kind of
//! client (libblkio over vhost-user, qemu-io over NBD), and bitmaps read
//! back by libnbd's `nbdinfo --map=qemu:dirty-bitmap:NAME`.

mod common;

use std::path::Path;

use common::{Daemon, Scratch, dirty_map, monitor, pattern, run};
use serde_json::{Value, json};
use vsd_bench::ClientOptions;
use vsd_control::client::QmpClient;

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;

/// A qcow2 node `q` over file node `f`, and a raw file node `r`.
fn two_nodes(dir: &Scratch) -> Vec<String> {
    let qcow2 = dir.path("a.qcow2");
    let out = run("qemu-img", &["create", "-q", "-f", "qcow2", qcow2.to_str().unwrap(), "1M"]);
    assert!(out.status.success());
    let raw = dir.image("r.img", MIB);
    vec![
        "--blockdev".into(),
        format!("driver=file,node-name=f,filename={}", qcow2.display()),
        "--blockdev".into(),
        "driver=qcow2,node-name=q,file=f".into(),
        "--blockdev".into(),
        format!("driver=file,node-name=r,filename={}", raw.display()),
    ]
}

/// A `transaction` action of type `block-dirty-bitmap-{kind}`.
fn action(kind: &str, data: Value) -> Value {
    json!({"type": format!("block-dirty-bitmap-{kind}"), "data": data})
}

/// What a command answered: its return value, or its error's class and text.
fn answer(qmp: &mut QmpClient, command: &str, args: Value) -> Value {
    match qmp.execute(command, args) {
        Ok(value) => json!({ "return": value }),
        Err(e) => json!({ "error": e.to_string() }),
    }
}

/// The `dirty-bitmaps` of every node that has some, by node.
fn bitmaps_by_node(qmp: &mut QmpClient) -> Value {
    let nodes = qmp.execute("query-named-block-nodes", json!({})).unwrap();
    let with = nodes.as_array().unwrap().iter().filter_map(|n| Some((n["node-name"].clone(), n.get("dirty-bitmaps")?)));
    Value::Object(with.map(|(name, bitmaps)| (name.as_str().unwrap().to_string(), bitmaps.clone())).collect())
}

#[test]
fn bitmap_commands_answer_as_qemu_storage_daemon_does() {
    let long = "x".repeat(1024);
    let script = [
        ("block-dirty-bitmap-add", json!({"node": "q", "name": "b"})),
        ("block-dirty-bitmap-add", json!({"node": "q", "name": "b"})),
        ("block-dirty-bitmap-add", json!({"node": "zz", "name": "b"})),
        ("block-dirty-bitmap-add", json!({"node": "q", "name": ""})),
        ("block-dirty-bitmap-add", json!({"node": "q", "name": long})),
        ("block-dirty-bitmap-add", json!({"node": "q", "name": "c", "granularity": 1000})),
        ("block-dirty-bitmap-add", json!({"node": "q", "name": "c", "granularity": 256})),
        ("block-dirty-bitmap-add", json!({"node": "r", "name": "p", "persistent": true})),
        ("block-dirty-bitmap-add", json!({"node": "q", "name": "p", "persistent": true, "granularity": 4096})),
        ("block-dirty-bitmap-add", json!({"node": "q", "name": "d", "disabled": true, "granularity": 512})),
        ("block-dirty-bitmap-add", json!({"node": "r", "name": "e", "granularity": 4096})),
        ("block-dirty-bitmap-add", json!({"node": "f", "name": "g"})),
        ("block-dirty-bitmap-remove", json!({"node": "q", "name": "zz"})),
        ("block-dirty-bitmap-remove", json!({"node": "zz", "name": "zz"})),
        ("block-dirty-bitmap-clear", json!({"node": "q", "name": "zz"})),
        ("block-dirty-bitmap-merge", json!({"node": "q", "target": "b", "bitmaps": ["d", {"node": "r", "name": "e"}]})),
        ("block-dirty-bitmap-merge", json!({"node": "q", "target": "b", "bitmaps": ["nope"]})),
        ("block-dirty-bitmap-merge", json!({"node": "q", "target": "b", "bitmaps": [{"node": "r", "name": "no"}]})),
        ("block-dirty-bitmap-merge", json!({"node": "q", "target": "nope", "bitmaps": ["d"]})),
        ("block-dirty-bitmap-disable", json!({"node": "q", "name": "b"})),
        ("block-dirty-bitmap-enable", json!({"node": "q", "name": "d"})),
        ("block-dirty-bitmap-clear", json!({"node": "q", "name": "b"})),
        ("block-dirty-bitmap-remove", json!({"node": "f", "name": "g"})),
        // All or nothing: the failing third action undoes the first two.
        (
            "transaction",
            json!({"actions": [action("add", json!({"node": "q", "name": "new"})),
            action("enable", json!({"node": "q", "name": "b"})), action("add", json!({"node": "q", "name": "b"}))]}),
        ),
        (
            "transaction",
            json!({"actions": [action("add", json!({"node": "q", "name": "new"})),
            action("disable", json!({"node": "q", "name": "d"})), action("clear", json!({"node": "q", "name": "d"})),
            action("merge", json!({"node": "q", "target": "new", "bitmaps": ["d"]})),
            action("remove", json!({"node": "q", "name": "d"}))]}),
        ),
        (
            "transaction",
            json!({"actions": [action("remove", json!({"node": "q", "name": "new"})),
            action("remove", json!({"node": "q", "name": "new"}))]}),
        ),
        ("transaction", json!({"actions": [{"type": "bogus", "data": {}}]})),
        ("transaction", json!({"actions": []})),
    ];
    let run_script = |program: fn(&Scratch, &[String]) -> Daemon, name: &str| {
        let dir = Scratch::new(name);
        let socket = dir.path("qmp.sock");
        let mut args = two_nodes(&dir);
        args.extend(monitor(&socket));
        let _daemon = program(&dir, &args);
        let mut qmp = QmpClient::connect(&socket).unwrap();
        let mut answers: Vec<Value> = script.iter().map(|(c, a)| answer(&mut qmp, c, a.clone())).collect();
        answers.push(bitmaps_by_node(&mut qmp));
        answers
    };
    let (vsd, qsd) = (run_script(Daemon::vsd, "bitmap-qmp-vsd"), run_script(Daemon::qsd, "bitmap-qmp-qsd"));
    for ((command, args), (ours, theirs)) in script.iter().zip(vsd.iter().zip(&qsd)) {
        assert_eq!(ours, theirs, "{command} {args}");
    }
    assert_eq!(vsd.last(), qsd.last(), "query-named-block-nodes' dirty-bitmaps");
    assert_eq!(vsd.last().unwrap()["q"].as_array().unwrap().len(), 3, "new, p and b, newest first");
}

#[test]
fn writes_from_every_client_are_recorded_and_nbd_shows_exactly_them() {
    let dir = Scratch::new("bitmap-record");
    let image = dir.image("disk.img", 64 * MIB);
    let (qmp_socket, nbd_socket) = (dir.path("qmp.sock"), dir.path("nbd.sock"));
    let mut args = common::disk_over_vhost_and_nbd(&dir, &image);
    args.extend(monitor(&qmp_socket));
    let daemon = Daemon::vsd(&dir, &args);
    let mut qmp = QmpClient::connect(&qmp_socket).unwrap();
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    queue.write_at(0, &pattern(1, 4096)).unwrap(); // before the bitmap: not recorded
    qmp.execute("block-dirty-bitmap-add", json!({"node": "disk", "name": "b", "granularity": 65536})).unwrap();
    qmp.execute("block-dirty-bitmap-add", json!({"node": "disk", "name": "fine", "granularity": 4096})).unwrap();

    queue.write_at(MIB + 512, &pattern(2, 4096)).unwrap(); // inside one 64 KiB granule
    queue.write_at(8 * MIB - 4096, &pattern(3, 8192)).unwrap(); // across two
    queue.discard(20 * MIB, MIB).unwrap();
    let nbd = format!("nbd+unix:///rw?socket={}", nbd_socket.display());
    let out = run("qemu-io", &["-f", "raw", "-c", "write -P 7 40M 100k", "-c", "write -z 60M 64k", &nbd]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut back = vec![0u8; 4096];
    queue.read_at(30 * MIB, &mut back).unwrap(); // reads are not writes

    let g = 64 * KIB;
    let want = [(MIB, g), (8 * MIB - g, 2 * g), (20 * MIB, MIB), (40 * MIB, 2 * g), (60 * MIB, g)];
    let count: u64 = want.iter().map(|(_, len)| len).sum();
    let listed = bitmaps_by_node(&mut qmp);
    let b = listed["disk"].as_array().unwrap().iter().find(|b| b["name"] == "b").unwrap().clone();
    assert_eq!(
        b,
        json!({"name": "b", "count": count, "granularity": g, "recording": true, "busy": false, "persistent": false})
    );

    // A read-only export may show a bitmap only once it stops recording.
    let view = json!({"type": "nbd", "id": "n1", "node-name": "disk", "name": "view", "bitmaps": ["b", "fine"]});
    let refused = qmp.execute("block-export-add", view.clone()).unwrap_err().to_string();
    assert!(refused.contains("Enabled bitmap 'b' incompatible with readonly export"), "{refused}");
    qmp.execute("block-dirty-bitmap-disable", json!({"node": "disk", "name": "b"})).unwrap();
    qmp.execute("block-dirty-bitmap-disable", json!({"node": "disk", "name": "fine"})).unwrap();
    qmp.execute("block-export-add", view).unwrap();
    queue.write_at(50 * MIB, &pattern(4, 4096)).unwrap(); // after the disable: in neither

    assert_eq!(dirty_map(&nbd_socket, "view", "b"), want);
    let fine = [(MIB, 8 * KIB), (8 * MIB - 4096, 8 * KIB), (20 * MIB, MIB), (40 * MIB, 100 * KIB), (60 * MIB, g)];
    assert_eq!(dirty_map(&nbd_socket, "view", "fine"), fine);

    let busy = qmp.execute("block-dirty-bitmap-remove", json!({"node": "disk", "name": "b"})).unwrap_err();
    assert!(busy.to_string().contains("is currently in use by another operation"), "{busy}");
    assert_eq!(bitmaps_by_node(&mut qmp)["disk"][1]["busy"], json!(true), "exported: busy");
    qmp.execute("block-export-del", json!({"id": "n1"})).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while qmp.execute("block-dirty-bitmap-remove", json!({"node": "disk", "name": "b"})).is_err() {
        assert!(std::time::Instant::now() < deadline, "the export's end frees the bitmap");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn a_bitmap_follows_a_resize_and_merges_across_nodes() {
    let dir = Scratch::new("bitmap-resize");
    let image = dir.image("disk.img", 4 * MIB);
    let (qmp_socket, nbd_socket) = (dir.path("qmp.sock"), dir.path("nbd.sock"));
    let mut args = vec![
        "--blockdev".into(),
        format!("driver=file,node-name=disk,filename={}", image.display()),
        "--blockdev".into(),
        "driver=null-co,node-name=other,size=8M".into(),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", nbd_socket.display()),
        "--export".into(),
        "type=nbd,id=n0,node-name=disk,name=rw,writable=on".into(),
    ];
    args.extend(monitor(&qmp_socket));
    let _daemon = Daemon::vsd(&dir, &args);
    let mut qmp = QmpClient::connect(&qmp_socket).unwrap();
    qmp.execute("block-dirty-bitmap-add", json!({"node": "disk", "name": "b", "granularity": 4096})).unwrap();
    qmp.execute("block_resize", json!({"node-name": "disk", "size": 8 * MIB})).unwrap();
    let nbd = format!("nbd+unix:///rw?socket={}", nbd_socket.display());
    let out = run("qemu-io", &["-f", "raw", "-c", "write 3M 4k", "-c", "write 7M 4k", &nbd]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    qmp.execute("block-dirty-bitmap-add", json!({"node": "other", "name": "copy", "disabled": true})).unwrap();
    let merge = json!({"node": "other", "target": "copy", "bitmaps": [{"node": "disk", "name": "b"}]});
    qmp.execute("block-dirty-bitmap-merge", merge).unwrap();
    let listed = bitmaps_by_node(&mut qmp);
    assert_eq!(listed["disk"][0]["count"], json!(8192), "a write past the old end is recorded");
    assert_eq!(listed["other"][0]["count"], json!(2 * 65536), "merged into 64 KiB granules");
}

/// `qemu-img info`'s bitmaps of `image`: (name, granularity, flags).
fn image_bitmaps(image: &Path) -> Vec<(String, u64, Vec<String>)> {
    let out = run("qemu-img", &["info", "--output=json", "-U", image.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let info: Value = serde_json::from_slice(&out.stdout).unwrap();
    let listed = info["format-specific"]["data"]["bitmaps"].as_array().cloned().unwrap_or_default();
    let flags = |b: &Value| b["flags"].as_array().unwrap().iter().map(|f| f.as_str().unwrap().to_string()).collect();
    listed.iter().map(|b| (b["name"].as_str().unwrap().into(), b["granularity"].as_u64().unwrap(), flags(b))).collect()
}

fn qemu_img_check_is_clean(image: &Path) {
    let out = run("qemu-img", &["check", image.to_str().unwrap()]);
    assert!(out.status.success(), "qemu-img check: {}", String::from_utf8_lossy(&out.stdout));
}

/// vsd serving qcow2 `image` as node `disk` over NBD (export `rw`), with QMP.
fn serve_qcow2(dir: &Scratch, image: &Path) -> (Daemon, QmpClient) {
    let qmp_socket = dir.path("qmp.sock");
    let mut args = common::qcow2_over_nbd(dir, image);
    args.extend(monitor(&qmp_socket));
    let daemon = Daemon::vsd(dir, &args);
    (daemon, QmpClient::connect(&qmp_socket).unwrap())
}

fn qemu_io_over_nbd(dir: &Scratch, commands: &[&str]) {
    let uri = format!("nbd+unix:///rw?socket={}", dir.path("nbd.sock").display());
    let mut args = vec!["-f", "raw"];
    commands.iter().for_each(|c| args.extend(["-c", c]));
    args.push(&uri);
    let out = run("qemu-io", &args);
    assert!(out.status.success(), "qemu-io: {}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn persistent_bitmaps_outlive_a_clean_stop_and_qemu_reads_them() {
    let dir = Scratch::new("bitmap-persist");
    let image = dir.path("disk.qcow2");
    assert!(run("qemu-img", &["create", "-q", "-f", "qcow2", image.to_str().unwrap(), "64M"]).status.success());
    let (daemon, mut qmp) = serve_qcow2(&dir, &image);
    let add = json!({"node": "disk", "name": "ck1", "persistent": true, "granularity": 65536});
    qmp.execute("block-dirty-bitmap-add", add).unwrap();
    qmp.execute("block-dirty-bitmap-add", json!({"node": "disk", "name": "temp"})).unwrap();
    qemu_io_over_nbd(&dir, &["write -P 1 1M 4k", "write -P 2 10M 128k"]);
    assert_eq!(daemon.stop().code(), Some(0));

    assert_eq!(
        image_bitmaps(&image),
        [("ck1".to_string(), 65536, vec!["auto".to_string()])],
        "only the persistent one"
    );
    qemu_img_check_is_clean(&image);

    // QEMU's own reading of the bits: a copy merged into a new bitmap by qemu-img.
    let img = image.to_str().unwrap();
    let out = run("qemu-img", &["bitmap", "--add", "-g", "65536", "--merge", "ck1", img, "copy"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (_daemon, mut qmp) = serve_qcow2(&dir, &image);
    let listed = bitmaps_by_node(&mut qmp)["disk"].clone();
    let count = |name: &str| listed.as_array().unwrap().iter().find(|b| b["name"] == name).unwrap()["count"].clone();
    assert_eq!((count("ck1"), count("copy")), (json!(3 * 65536), json!(3 * 65536)), "{listed}");
    qmp.execute("block-dirty-bitmap-disable", json!({"node": "disk", "name": "ck1"})).unwrap();
    let view = json!({"type": "nbd", "id": "v", "node-name": "disk", "name": "view", "bitmaps": ["ck1"]});
    qmp.execute("block-export-add", view).unwrap();
    assert_eq!(dirty_map(&dir.path("nbd.sock"), "view", "ck1"), [(MIB, 65536), (10 * MIB, 2 * 65536)]);
    assert_eq!(
        image_bitmaps(&image)[0].2,
        ["in-use", "auto"],
        "flagged in use while served: {:?}",
        image_bitmaps(&image)
    );
}

#[test]
fn a_killed_daemon_leaves_its_bitmaps_inconsistent_and_they_can_go() {
    let dir = Scratch::new("bitmap-kill");
    let image = dir.path("disk.qcow2");
    let img = image.to_str().unwrap();
    assert!(run("qemu-img", &["create", "-q", "-f", "qcow2", img, "16M"]).status.success());
    assert!(run("qemu-img", &["bitmap", "--add", "-g", "4096", img, "made-by-qemu"]).status.success());
    assert!(run("qemu-io", &["-c", "write 0 8k", img]).status.success(), "recorded by QEMU");
    let (daemon, mut qmp) = serve_qcow2(&dir, &image);
    let loaded = &bitmaps_by_node(&mut qmp)["disk"][0];
    assert_eq!(
        (&loaded["name"], &loaded["count"], &loaded["persistent"]),
        (&json!("made-by-qemu"), &json!(8192), &json!(true))
    );
    qemu_io_over_nbd(&dir, &["write 1M 4k"]);
    daemon.kill();
    common::wait_until_unlocked(&image);

    assert_eq!(image_bitmaps(&image)[0].2, ["in-use", "auto"]);
    let (daemon, mut qmp) = serve_qcow2(&dir, &image);
    let loaded = bitmaps_by_node(&mut qmp)["disk"][0].clone();
    assert_eq!(loaded["inconsistent"], json!(true), "{loaded}");
    let refused = qmp.execute("block-dirty-bitmap-clear", json!({"node": "disk", "name": "made-by-qemu"})).unwrap_err();
    assert!(refused.to_string().contains("is inconsistent and cannot be used"), "{refused}");
    let view = json!({"type": "nbd", "id": "v", "node-name": "disk", "name": "view", "bitmaps": ["made-by-qemu"]});
    assert!(qmp.execute("block-export-add", view).unwrap_err().to_string().contains("inconsistent"));
    qmp.execute("block-dirty-bitmap-remove", json!({"node": "disk", "name": "made-by-qemu"})).unwrap();
    assert_eq!(image_bitmaps(&image), [], "removed from the image at once");
    assert_eq!(daemon.stop().code(), Some(0));
    qemu_img_check_is_clean(&image);
}

#[test]
fn persistent_bitmaps_move_with_the_image_in_a_migration() {
    let dir = Scratch::new("bitmap-handover");
    let image = dir.path("disk.qcow2");
    let img = image.to_str().unwrap();
    assert!(run("qemu-img", &["create", "-q", "-f", "qcow2", img, "16M"]).status.success());
    assert!(run("qemu-img", &["bitmap", "--add", img, "ck"]).status.success());
    assert!(run("qemu-io", &["-c", "write 2M 64k", img]).status.success());
    let daemon = |name: &str, inactive: &str| {
        let socket = dir.path(&format!("{name}.sock"));
        let mut args = vec![
            "--blockdev".into(),
            format!("driver=file,node-name=f0,filename={img}{inactive}"),
            "--blockdev".into(),
            format!("driver=qcow2,node-name=disk,file=f0{inactive}"),
        ];
        args.extend(monitor(&socket));
        let daemon = Daemon::vsd(&dir, &args);
        (daemon, QmpClient::connect(&socket).unwrap())
    };
    let (_a, mut a) = daemon("a", "");
    let (_b, mut b) = daemon("b", ",active=off");
    assert_eq!(bitmaps_by_node(&mut a)["disk"][0]["count"], json!(65536));
    assert_eq!(bitmaps_by_node(&mut b), json!({}), "an inactive node loads nothing");
    let set_active = |qmp: &mut QmpClient, active: bool| {
        qmp.execute("blockdev-set-active", json!({"node-name": "disk", "active": active})).unwrap();
    };
    set_active(&mut a, false);
    assert_eq!(image_bitmaps(&image)[0].2, ["auto"], "stored back, not in use");
    assert_eq!(bitmaps_by_node(&mut a), json!({}), "the source lets them go");
    set_active(&mut b, true);
    let moved = &bitmaps_by_node(&mut b)["disk"][0];
    assert_eq!((&moved["name"], &moved["count"], &moved["persistent"]), (&json!("ck"), &json!(65536), &json!(true)));
    assert_eq!(image_bitmaps(&image)[0].2, ["in-use", "auto"]);
}
