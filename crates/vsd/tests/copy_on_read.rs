//! `driver=copy-on-read`: reading a disk through the filter pulls what its
//! overlay reads from the backing chain into the overlay, so that the
//! backing file can go; with `bottom`, only what lies down to that node.
//! Each test runs vsd and qemu-storage-daemon alike, and QEMU's tools judge
//! the images they leave.

mod common;

use std::process::Command;

use common::{Daemon, Scratch};
use serde_json::Value;

type Start = fn(&Scratch, &[String]) -> Daemon;

const DAEMONS: [(&str, Start); 2] = [("vsd", Daemon::vsd), ("qemu-storage-daemon", Daemon::qsd)];

/// Runs a QEMU tool in `dir`, asserting it succeeds; its stdout.
fn tool(dir: &Scratch, program: &str, args: &[&str]) -> String {
    let out = Command::new(program).args(args).current_dir(&dir.0).output().expect("QEMU's tools are installed");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{program} {args:?}: {text}{}", String::from_utf8_lossy(&out.stderr));
    text
}

/// A 4 MiB qcow2 image `name` over `backing` (if any), written by qemu-io
/// as `writes` say.
fn image(dir: &Scratch, name: &str, backing: Option<&str>, writes: &[&str]) {
    let mut args = vec!["create", "-q", "-f", "qcow2"];
    if let Some(backing) = backing {
        args.extend(["-b", backing, "-F", "qcow2"]);
    }
    args.extend([name, "4M"]);
    tool(dir, "qemu-img", &args);
    let mut args = vec!["-f", "qcow2"];
    writes.iter().for_each(|write| args.extend(["-c", write]));
    args.push(name);
    tool(dir, "qemu-io", &args);
}

/// `--blockdev`s of `driver=file` node `f<name>` and `driver=qcow2` node
/// `<name>` over it, with `extra` options.
fn qcow2_node(dir: &Scratch, name: &str, extra: &str) -> Vec<String> {
    let file = format!("driver=file,node-name=f{name},filename={}", dir.path(&format!("{name}.qcow2")).display());
    let format = format!("driver=qcow2,node-name={name},file=f{name}{extra}");
    vec!["--blockdev".into(), file, "--blockdev".into(), format]
}

/// Serves node `cor` over NBD, reads all of it (and a first, unaligned
/// piece) through qemu-io, and stops the daemon.
fn read_through(dir: &Scratch, start: Start, mut args: Vec<String>) {
    let socket = dir.path("nbd.sock");
    args.extend([
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", socket.display()),
        "--export".into(),
        "type=nbd,id=e0,node-name=cor".into(),
    ]);
    let daemon = start(dir, &args);
    let uri = format!("nbd+unix:///cor?socket={}", socket.display());
    tool(dir, "qemu-io", &["-r", "-f", "raw", "-c", "read 3000 70000", "-c", "read 0 4M", &uri]);
    drop(daemon);
}

/// `qemu-img map` of `name`: (start, length, depth, data) of each extent.
fn map(dir: &Scratch, name: &str) -> Vec<(u64, u64, u64, bool)> {
    let map: Value = serde_json::from_str(&tool(dir, "qemu-img", &["map", "--output=json", name])).unwrap();
    let field = |e: &Value, key: &str| e[key].as_u64().unwrap();
    map.as_array()
        .unwrap()
        .iter()
        .map(|e| (field(e, "start"), field(e, "length"), field(e, "depth"), e["data"] == true))
        .collect()
}

/// The bytes `name` reads as, through its backing chain.
fn contents(dir: &Scratch, name: &str) -> Vec<u8> {
    let raw = format!("{name}.raw");
    tool(dir, "qemu-img", &["convert", "-O", "raw", name, &raw]);
    std::fs::read(dir.path(&raw)).unwrap()
}

#[test]
fn reading_everything_leaves_an_overlay_that_needs_no_backing_file() {
    for (daemon, start) in DAEMONS {
        let dir = Scratch::new(&format!("cor-pull-{daemon}"));
        image(&dir, "base.qcow2", None, &["write -P 0xaa 0 1M", "write -P 0xbb 2M 512K", "write -P 0xdd 3M 1000"]);
        image(&dir, "ov.qcow2", Some("base.qcow2"), &["write -P 0xcc 960K 128K"]);
        let before = contents(&dir, "ov.qcow2");
        assert!(map(&dir, "ov.qcow2").iter().any(|&(_, _, depth, _)| depth == 1), "{daemon}: the base holds data");

        let mut args = qcow2_node(&dir, "ov", "");
        args.extend(["--blockdev".into(), "driver=copy-on-read,node-name=cor,file=ov".into()]);
        read_through(&dir, start, args);

        // What no image holds reads as zeroes with or without the base:
        // QEMU leaves it unallocated.
        let below: Vec<_> =
            map(&dir, "ov.qcow2").into_iter().filter(|&(_, _, depth, data)| data && depth != 0).collect();
        assert!(below.is_empty(), "{daemon}: the overlay holds all data, yet reads these from below: {below:?}");
        tool(&dir, "qemu-img", &["rebase", "-u", "-b", "", "ov.qcow2"]);
        assert!(contents(&dir, "ov.qcow2") == before, "{daemon}: without its base the overlay reads as the chain did");
        tool(&dir, "qemu-img", &["check", "ov.qcow2"]);
    }
}

#[test]
fn bottom_is_the_last_layer_copied_from() {
    for (daemon, start) in DAEMONS {
        let dir = Scratch::new(&format!("cor-bottom-{daemon}"));
        image(&dir, "base.qcow2", None, &["write -P 0xaa 0 1M"]);
        image(&dir, "mid.qcow2", Some("base.qcow2"), &["write -P 0xbb 2M 1M"]);
        image(&dir, "top.qcow2", Some("mid.qcow2"), &[]);
        let before = contents(&dir, "top.qcow2");

        let mut args = qcow2_node(&dir, "base", "");
        args.extend(qcow2_node(&dir, "mid", ",backing=base"));
        args.extend(qcow2_node(&dir, "top", ",backing=mid"));
        args.extend(["--blockdev".into(), "driver=copy-on-read,node-name=cor,file=top,bottom=mid".into()]);
        read_through(&dir, start, args);

        let depth_at = |at: u64| {
            let extents = map(&dir, "top.qcow2");
            extents.iter().find(|&&(start, len, _, _)| (start..start + len).contains(&at)).unwrap().2
        };
        assert_eq!(depth_at(2 << 20), 0, "{daemon}: what the bottom node held is copied into the top");
        assert_eq!(depth_at(0), 2, "{daemon}: what only the base holds stays there");
        assert!(contents(&dir, "top.qcow2") == before, "{daemon}: the chain reads as before");
        tool(&dir, "qemu-img", &["check", "top.qcow2"]);
    }
}

/// Runs `program` with `args` (startup fails); its stderr.
fn refused(program: &str, args: &[String]) -> String {
    let out = Command::new(program).args(args).output().unwrap();
    assert!(!out.status.success(), "{program} {args:?} started");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn bad_options_are_refused_as_qemu_refuses_them() {
    let help = Command::new(common::VSD).args(["--blockdev", "help"]).output().unwrap();
    assert!(
        String::from_utf8_lossy(&help.stdout).lines().any(|l| l.trim() == "copy-on-read"),
        "--blockdev help lists it"
    );
    let dir = Scratch::new("cor-refused");
    image(&dir, "ov.qcow2", None, &[]);
    let cases = [
        ("", "driver=copy-on-read,node-name=cor", "Parameter 'file' is missing"),
        ("", "driver=copy-on-read,node-name=cor,file=ov,bottom=nope", "Bottom node 'nope' not found"),
        (",read-only=on", "driver=copy-on-read,node-name=cor,file=ov", "Block node is read-only"),
    ];
    for (ov_options, cor, words) in cases {
        let mut args = qcow2_node(&dir, "ov", ov_options);
        args.extend(["--blockdev".into(), cor.into()]);
        for program in [common::VSD, "qemu-storage-daemon"] {
            let stderr = refused(program, &args);
            assert!(stderr.to_lowercase().contains(&words.to_lowercase()), "{program} {cor}: {stderr}");
        }
    }
    // A bottom outside the chain: QEMU 10 hangs looking for it; vsd says so.
    let mut args = qcow2_node(&dir, "ov", "");
    let other = dir.image("other.raw", 4096);
    args.extend(["--blockdev".into(), format!("driver=file,node-name=other,filename={}", other.display())]);
    args.extend(["--blockdev".into(), "driver=copy-on-read,node-name=cor,file=ov,bottom=other".into()]);
    let stderr = refused(common::VSD, &args);
    assert!(stderr.contains("Bottom node 'other' is not in the backing chain of 'ov'"), "{stderr}");
}

#[test]
fn a_filter_cannot_be_the_bottom() {
    let dir = Scratch::new("cor-filter-bottom");
    image(&dir, "base.qcow2", None, &[]);
    image(&dir, "top.qcow2", Some("base.qcow2"), &[]);
    let mut args: Vec<String> = vec!["--object".into(), "throttle-group,id=g".into()];
    args.extend(qcow2_node(&dir, "base", ""));
    args.extend(["--blockdev".into(), "driver=throttle,node-name=th,throttle-group=g,file=base".into()]);
    args.extend(qcow2_node(&dir, "top", ",backing=th"));
    args.extend(["--blockdev".into(), "driver=copy-on-read,node-name=cor,file=top,bottom=th".into()]);
    for program in [common::VSD, "qemu-storage-daemon"] {
        let stderr = refused(program, &args);
        assert!(stderr.contains("Bottom node 'th' is a filter"), "{program}: {stderr}");
    }
}
