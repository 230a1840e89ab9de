//! `blockdev-create`: files and qcow2 images made over QMP by vsd and by
//! qemu-storage-daemon from the same commands, their jobs' answers and
//! events compared, the images read by qemu-img, and vsd serving what it
//! made.

mod common;

use std::path::Path;

use common::qmp::Qmp;
use common::{Daemon, Scratch, monitor, ok};
use serde_json::{Value, json};

const MIB: u64 = 1 << 20;

/// What qemu-img says of an image, without what differs by who made it
/// (sizes on the host, paths).
fn described(image: &Path) -> Value {
    let info: Value =
        serde_json::from_str(&ok("qemu-img", &["info", "--output=json", image.to_str().unwrap()])).unwrap();
    json!({
        "format": info["format"],
        "virtual-size": info["virtual-size"],
        "cluster-size": info["cluster-size"],
        "format-specific": info["format-specific"],
        "backing-filename": info["backing-filename"],
        "backing-filename-format": info["backing-filename-format"],
    })
}

/// Runs create job `id` with `options`: the command's answer, the job's
/// statuses and error, then dismisses it.
fn create(qmp: &mut Qmp, id: &str, options: Value) -> Vec<Value> {
    let answer = qmp.answer("blockdev-create", json!({"job-id": id, "options": options}));
    if answer.get("error").is_some() {
        return vec![answer];
    }
    qmp.await_event("JOB_STATUS_CHANGE", json!({"id": id, "status": "concluded"}));
    let jobs = qmp.ok("query-jobs", json!({}));
    let job = jobs.as_array().unwrap().iter().find(|j| j["id"] == id).cloned().unwrap();
    qmp.ok("job-dismiss", json!({"id": id}));
    vec![answer, json!({"type": job["type"], "status": job["status"], "error": job["error"]})]
}

/// The same script on both daemons: a file, qcow2 images of several
/// kinds on it and on others, and the mistakes QEMU finds (in the job).
fn script(program: &str) -> (Vec<Value>, Vec<Value>, Scratch) {
    let dir = Scratch::new(&format!("create-{program}"));
    let args = monitor(&dir.path("qmp.sock"));
    let daemon = match program {
        "vsd" => Daemon::vsd(&dir, &args),
        _ => Daemon::qsd(&dir, &args),
    };
    let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
    std::fs::write(dir.path("base.img"), vec![0; 64 * MIB as usize]).unwrap();
    let mut said = Vec::new();
    let mut images = Vec::new();
    let kinds = [
        ("plain", json!({})),
        ("v2", json!({"version": "v2", "cluster-size": 4096})),
        (
            "fancy",
            json!({"lazy-refcounts": true, "extended-l2": true, "compression-type": "zstd", "refcount-bits": 64}),
        ),
        ("overlay", json!({"backing-file": "base.img", "backing-fmt": "raw", "cluster-size": 131072})),
    ];
    for (i, (name, extra)) in kinds.into_iter().enumerate() {
        let path = dir.path(&format!("{name}.qcow2"));
        said.extend(create(&mut qmp, &format!("f{i}"), json!({"driver": "file", "filename": path, "size": 0})));
        qmp.ok("blockdev-add", json!({"driver": "file", "node-name": name, "filename": path}));
        let mut options = json!({"driver": "qcow2", "file": name, "size": 64 * MIB});
        options.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        said.extend(create(&mut qmp, &format!("q{i}"), options));
        images.push(path);
    }
    let raw = dir.path("raw.img");
    said.extend(create(
        &mut qmp,
        "r",
        json!({"driver": "file", "filename": raw, "size": 3 * MIB, "preallocation": "full"}),
    ));
    images.push(raw);
    for (i, bad) in [
        json!({"driver": "qcow2", "file": "plain", "size": 1000}),
        json!({"driver": "qcow2", "file": "plain", "size": MIB, "cluster-size": 1000}),
        json!({"driver": "qcow2", "file": "plain", "size": MIB, "version": "v2", "lazy-refcounts": true}),
        json!({"driver": "qcow2", "file": "plain", "size": MIB, "backing-fmt": "raw"}),
        json!({"driver": "qcow2", "file": "nowhere", "size": MIB}),
        json!({"driver": "raw"}),
    ]
    .into_iter()
    .enumerate()
    {
        said.extend(create(&mut qmp, &format!("bad{i}"), bad));
    }
    let events: Vec<Value> = qmp.event_log().into_iter().filter(|e| e[0] == "JOB_STATUS_CHANGE").collect();
    said.push(json!(events));
    drop(daemon);
    let described: Vec<Value> = images.iter().map(|image| described(image)).collect();
    (said, described, dir)
}

#[test]
fn images_made_as_qemu_storage_daemon_makes_them() {
    let (vsd, vsd_images, dir) = script("vsd");
    let (qsd, qsd_images, _qsd_dir) = script("qsd");
    assert_eq!(vsd, qsd);
    assert_eq!(vsd_images, qsd_images);
    for name in ["plain", "v2", "fancy", "overlay"] {
        ok("qemu-img", &["check", "-q", dir.path(&format!("{name}.qcow2")).to_str().unwrap()]);
    }
    assert_eq!(std::fs::read(dir.path("raw.img")).unwrap(), vec![0; 3 * MIB as usize]);
}

/// vsd serves a qcow2 image it made, and qemu-img reads what was written.
#[test]
fn vsd_serves_the_image_it_made() {
    let dir = Scratch::new("create-serve");
    let mut args = monitor(&dir.path("qmp.sock"));
    args.extend(["--nbd-server".into(), format!("addr.type=unix,addr.path={}", dir.path("nbd.sock").display())]);
    let _daemon = Daemon::vsd(&dir, &args);
    let mut qmp = Qmp::connect(&dir.path("qmp.sock"));
    let image = dir.path("made.qcow2");
    create(&mut qmp, "f", json!({"driver": "file", "filename": image, "size": 0}));
    qmp.ok("blockdev-add", json!({"driver": "file", "node-name": "f0", "filename": image}));
    let made = create(&mut qmp, "q", json!({"driver": "qcow2", "file": "f0", "size": 32 * MIB}));
    assert_eq!(made[1]["error"], Value::Null, "{made:?}");
    qmp.ok("blockdev-add", json!({"driver": "qcow2", "node-name": "disk", "file": "f0"}));
    qmp.ok(
        "block-export-add",
        json!({"type": "nbd", "id": "e", "node-name": "disk", "name": "disk", "writable": true}),
    );
    let uri = format!("nbd+unix:///disk?socket={}", dir.path("nbd.sock").display());
    ok("qemu-io", &["-f", "raw", "-c", "write -P 0x5a 5M 1M", &uri]);
    qmp.ok("block-export-del", json!({"id": "e"}));
    qmp.ok("blockdev-del", json!({"node-name": "disk"}));
    qmp.ok("blockdev-del", json!({"node-name": "f0"}));
    ok("qemu-img", &["check", "-q", image.to_str().unwrap()]);
    let read = ok("qemu-io", &["-f", "qcow2", "-c", "read -P 0x5a 5M 1M", image.to_str().unwrap()]);
    assert!(!read.contains("verification failed"), "{read}");
}
