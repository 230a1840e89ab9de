//! The primitives of `block-stream` on qcow2 graph nodes, checked by QEMU's
//! tools: an overlay populated from its backing chain and then given a
//! new backing file (or none) reads as the chain did, passes `qemu-img
//! check`, and its header names what `qemu-img info` then shows.

mod common;

use std::process::Command;
use std::sync::Arc;

use common::Scratch;
use vsd_block::options::OptionMap;
use vsd_block::{BlockGraph, BlockNode, IoOp, IoQueue, IoVecs};
use vsd_qcow2::buf::AlignedBuf;

const MIB: u64 = 1 << 20;
const CLUSTER: u64 = 64 << 10;

/// Runs a QEMU tool in `dir`, asserting it succeeds; its stdout.
fn tool(dir: &Scratch, program: &str, args: &[&str]) -> String {
    let out = Command::new(program).args(args).current_dir(&dir.0).output().expect("QEMU's tools are installed");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{program} {args:?}: {text}{}", String::from_utf8_lossy(&out.stderr));
    text
}

/// `qemu-img create -f qcow2` of 4 MiB, over `backing` (a qcow2 image) if
/// given, then `qemu-io` writes as `writes` says.
fn image(dir: &Scratch, name: &str, options: &str, backing: Option<&str>, writes: &[&str]) {
    let mut args = vec!["create", "-q", "-f", "qcow2", "-o", options];
    if let Some(backing) = backing {
        args.extend(["-b", backing, "-F", "qcow2"]);
    }
    args.extend([name, "4M"]);
    tool(dir, "qemu-img", &args);
    let mut args = vec!["-f", "qcow2"];
    for write in writes {
        args.extend(["-c", write]);
    }
    args.push(name);
    tool(dir, "qemu-io", &args);
}

/// The qcow2 node of `name`, its backing chain opened from its header.
fn open(graph: &mut BlockGraph, dir: &Scratch, name: &str) -> Arc<dyn BlockNode> {
    let path = dir.path(name);
    let text = format!("driver=qcow2,node-name=top,file.driver=file,file.filename={}", path.display());
    graph.add(OptionMap::parse("--blockdev", &text).unwrap()).unwrap()
}

/// Reads `buf.len()` bytes at `offset` through `queue`.
fn read(queue: &mut dyn IoQueue, offset: u64, buf: &mut AlignedBuf) {
    let iov = [libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() }];
    // SAFETY: `iov` names `buf`, and both outlive the request, reaped below.
    unsafe { queue.push(0, IoOp::Read { offset, len: buf.len() as u64, iov: IoVecs::new(iov.as_ptr(), 1) }) };
    queue.submit().unwrap();
    let mut done = Vec::new();
    while done.is_empty() {
        queue.reap(&mut done);
        if done.is_empty() {
            queue.wait().unwrap();
        }
    }
    assert_eq!(done[0].errno, 0, "read at {offset:#x}");
}

/// Reads each run of `step` bytes of `node` that `wanted` picks (by its
/// offset) and populates it with what it read.
fn populate(node: &Arc<dyn BlockNode>, step: u64, wanted: impl Fn(u64) -> bool) {
    let mut queue = node.open_queue(1).unwrap();
    let mut buf = AlignedBuf::zeroed(step as usize);
    for offset in (0..node.size()).step_by(step as usize).filter(|&offset| wanted(offset)) {
        read(&mut *queue, offset, &mut buf);
        node.populate(offset, &buf).unwrap();
    }
}

/// `qemu-img check` finds nothing wrong with `name`.
fn assert_clean(dir: &Scratch, name: &str) {
    let report = tool(dir, "qemu-img", &["check", name]);
    assert!(report.contains("No errors were found"), "{report}");
}

/// `name` reads as `reference`, a raw image.
fn assert_identical(dir: &Scratch, name: &str, reference: &str) {
    let said = tool(dir, "qemu-img", &["compare", "-f", "qcow2", "-F", "raw", name, reference]);
    assert!(said.contains("Images are identical"), "{said}");
}

/// What `qemu-img info` says of `name`'s backing file, if anything.
fn backing_file(dir: &Scratch, name: &str) -> Option<String> {
    let info = tool(dir, "qemu-img", &["info", "-U", "--output=json", name]);
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    info["backing-filename"].as_str().map(str::to_string)
}

/// The chain's data, zero clusters and allocations partly in both layers.
const BASE_WRITES: [&str; 4] =
    ["write -P 0x11 0 1M", "write -P 0x12 1536K 256K", "write -z 2M 128K", "write -P 0x13 3M 1M"];
const TOP_WRITES: [&str; 4] =
    ["write -P 0x21 64K 4K", "write -P 0x22 1600K 64K", "write -z 3M 64K", "write -P 0x23 2304K 8K"];

/// An overlay populated with everything it reads, then cut from its
/// backing file, reads alone as the chain did.
fn stream_all(name: &str, top_options: &str) {
    let dir = Scratch::new(name);
    image(&dir, "base.qcow2", "cluster_size=64k", None, &BASE_WRITES);
    image(&dir, "top.qcow2", top_options, Some("base.qcow2"), &TOP_WRITES);
    tool(&dir, "qemu-img", &["convert", "-O", "raw", "top.qcow2", "chain.raw"]);
    {
        let mut graph = BlockGraph::new();
        let top = open(&mut graph, &dir, "top.qcow2");
        // The most one populate takes.
        populate(&top, MIB, |_| true);
        top.set_backing(None, None).unwrap();
        assert!(top.children().iter().all(|(role, _)| *role != "backing"), "no backing node left");
        top.close().unwrap();
    }
    assert_eq!(backing_file(&dir, "top.qcow2"), None);
    assert_clean(&dir, "top.qcow2");
    assert_identical(&dir, "top.qcow2", "chain.raw");
}

#[test]
fn a_populated_overlay_without_its_backing_file_reads_as_the_chain_did() {
    stream_all("stream-all", "cluster_size=64k");
}

/// With subclusters, the overlay's partly allocated clusters get the rest.
#[test]
fn a_populated_overlay_with_subclusters_reads_as_the_chain_did() {
    stream_all("stream-subclusters", "cluster_size=64k,extended_l2=on");
}

/// base <- mid <- top: what mid holds goes into top, which then names
/// base as its backing file; what only base holds stays there.
#[test]
fn streaming_the_middle_of_a_chain_leaves_the_overlay_over_its_base() {
    let dir = Scratch::new("stream-mid");
    image(&dir, "base.qcow2", "cluster_size=64k", None, &BASE_WRITES);
    image(
        &dir,
        "mid.qcow2",
        "cluster_size=64k",
        Some("base.qcow2"),
        &["write -P 0x31 512K 128K", "write -P 0x32 3M 64K"],
    );
    image(&dir, "top.qcow2", "cluster_size=64k", Some("mid.qcow2"), &TOP_WRITES);
    tool(&dir, "qemu-img", &["convert", "-O", "raw", "top.qcow2", "chain.raw"]);
    let base = dir.path("base.qcow2").display().to_string();
    {
        let mut graph = BlockGraph::new();
        let top = open(&mut graph, &dir, "top.qcow2");
        populate(&top, CLUSTER, |offset| top.allocation_depth(offset, CLUSTER).unwrap() == (2, CLUSTER));
        let mid = backing_of(&top);
        let base_node = backing_of(&mid);
        top.set_backing(Some(base_node.clone()), Some((base.clone(), "qcow2".into()))).unwrap();
        assert!(Arc::ptr_eq(&backing_of(&top), &base_node));
        assert_eq!(top.allocation_depth(512 << 10, CLUSTER).unwrap(), (1, CLUSTER), "mid's cluster is top's");
        assert_eq!(top.allocation_depth(0, CLUSTER).unwrap(), (2, CLUSTER), "base's stays in base");
        top.close().unwrap();
    }
    assert_eq!(backing_file(&dir, "top.qcow2").as_deref(), Some(base.as_str()));
    assert_clean(&dir, "top.qcow2");
    assert_identical(&dir, "top.qcow2", "chain.raw");
}

/// The backing node of `node`.
fn backing_of(node: &Arc<dyn BlockNode>) -> Arc<dyn BlockNode> {
    let children = node.children();
    children.into_iter().find(|(role, _)| *role == "backing").expect("a backing node").1
}
