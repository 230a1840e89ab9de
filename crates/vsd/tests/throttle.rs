//! I/O limits: `--object throttle-group` and `driver=throttle` against
//! qemu-storage-daemon's answers, and the rates a libblkio client gets
//! through them.
//!
//! The limits here are far below what the machine serves, so that what
//! is checked is the limit (never above it, within 5 % plus the first
//! tenth of a second's burst), not the machine's speed; the lower bounds
//! are loose.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{Daemon, Scratch, monitor};
use serde_json::{Value, json};
use vsd_bench::{Client, ClientOptions};
use vsd_control::client::QmpClient;

fn answer(qmp: &mut QmpClient, command: &str, args: Value) -> Value {
    match qmp.execute(command, args) {
        Ok(value) => json!({ "return": value }),
        Err(e) => json!({ "error": e.to_string() }),
    }
}

#[test]
fn throttle_groups_answer_as_qemu_storage_daemon_does() {
    let group = |id: &str, limits: Value| json!({"qom-type": "throttle-group", "id": id, "limits": limits});
    let script = [
        ("object-add", group("tg0", json!({"iops-total": 100}))),
        ("qom-get", json!({"path": "tg0", "property": "limits"})),
        ("qom-set", json!({"path": "tg0", "property": "limits", "value": {"iops-total": 200, "bps-read": 1000}})),
        ("qom-get", json!({"path": "tg0", "property": "limits"})),
        ("object-add", group("tg1", json!({"iops-total": 100, "iops-read": 5}))),
        ("object-add", group("tg1", json!({"iops-total-max": 100}))),
        ("object-add", group("tg1", json!({"iops-total": 100, "iops-total-max": 50}))),
        ("object-add", group("tg1", json!({"iops-total": -1}))),
        ("object-add", group("tg1", json!({"iops-total": 1_000_000_000_000_001u64}))),
        ("object-add", group("tg1", json!({"iops-total": 100, "iops-total-max": 200, "iops-total-max-length": 0}))),
        ("object-add", group("tg1", json!({"iops-total-max-length": 5}))),
        ("object-add", json!({"qom-type": "throttle-group", "id": "tg1", "x-iops-total": 100})),
        ("qom-get", json!({"path": "tg1", "property": "limits"})),
        ("blockdev-add", json!({"driver": "throttle", "node-name": "t", "throttle-group": "tg0", "file": "r"})),
        ("blockdev-add", json!({"driver": "throttle", "node-name": "t2", "throttle-group": "nope", "file": "r"})),
        ("object-del", json!({"id": "tg0"})),
        ("qom-get", json!({"path": "tg0", "property": "nope"})),
        ("qom-get", json!({"path": "nope", "property": "limits"})),
        ("qom-set", json!({"path": "tg0", "property": "limits", "value": {"iops-total": -5}})),
        ("blockdev-del", json!({"node-name": "t"})),
        ("object-del", json!({"id": "tg0"})),
    ];
    let run_script = |program: fn(&Scratch, &[String]) -> Daemon, name: &str| {
        let dir = Scratch::new(name);
        let image = dir.image("r.img", 1 << 20);
        let socket = dir.path("qmp.sock");
        let mut args = vec!["--blockdev".into(), format!("driver=file,node-name=r,filename={}", image.display())];
        args.extend(monitor(&socket));
        let _daemon = program(&dir, &args);
        let mut qmp = QmpClient::connect(&socket).unwrap();
        script.iter().map(|(c, a)| answer(&mut qmp, c, a.clone())).collect::<Vec<_>>()
    };
    let (vsd, qsd) = (run_script(Daemon::vsd, "throttle-qmp-vsd"), run_script(Daemon::qsd, "throttle-qmp-qsd"));
    for ((command, args), (ours, theirs)) in script.iter().zip(vsd.iter().zip(&qsd)) {
        // Both refuse the blockdev-add of an unknown group; vsd names the option string too.
        if let (Some(ours), Some(theirs)) = (ours["error"].as_str(), theirs["error"].as_str()) {
            assert!(ours.ends_with(theirs), "{command} {args}: vsd {ours:?}, QSD {theirs:?}");
            continue;
        }
        assert_eq!(ours, theirs, "{command} {args}");
    }
}

/// vsd serving null-co through throttle nodes of group `tg0` (`limits`,
/// as `--object` options), exported as `e0`, `e1`... (`members` of them),
/// with `extra` arguments and QMP.
fn throttled(dir: &Scratch, limits: &str, members: usize, extra: &[String]) -> (Daemon, QmpClient) {
    let qmp_socket = dir.path("qmp.sock");
    let mut args = vec!["--object".into(), format!("throttle-group,id=tg0,{limits}")];
    args.extend_from_slice(extra);
    for i in 0..members {
        args.extend([
            "--blockdev".into(),
            format!("driver=null-co,node-name=n{i},size=1073741824"),
            "--blockdev".into(),
            format!("driver=throttle,node-name=t{i},throttle-group=tg0,file=n{i}"),
            "--export".into(),
            format!(
                "type=vhost-user-blk,id=e{i},node-name=t{i},addr.type=unix,addr.path={},writable=on",
                dir.path(&format!("e{i}.sock")).display()
            ),
        ]);
    }
    args.extend(monitor(&qmp_socket));
    let daemon = Daemon::vsd(dir, &args);
    (daemon, QmpClient::connect(&qmp_socket).unwrap())
}

/// What vsd-bench gets on `socket` in `seconds`: (IOPS, MiB/s).
fn bench(socket: &Path, rw: &str, bs: &str, iodepth: u32, seconds: f64) -> (f64, f64) {
    let args = [
        "vsd-bench",
        "--socket",
        socket.to_str().unwrap(),
        "--rw",
        rw,
        "--bs",
        bs,
        "--iodepth",
        &iodepth.to_string(),
        "--seconds",
        &seconds.to_string(),
        "--ramp-seconds",
        "0",
    ];
    let config = <vsd_bench::bench::Args as clap::Parser>::parse_from(args).into_config().unwrap();
    let report = vsd_bench::bench::run(&config).unwrap();
    assert_eq!(report.results.errors, 0);
    (report.results.iops, report.results.bw_mib_s)
}

/// Whether `measured` keeps to `limit` over `seconds`: at most 5 % above
/// it once the first tenth of a second's burst is counted, and not far
/// below.
fn holds(measured: f64, limit: f64, seconds: f64) -> bool {
    let burst = limit / 10.0 / seconds;
    measured <= 1.05 * limit + burst && measured >= 0.8 * limit
}

/// The throttle filter's child is opened uncounted, so the filter itself
/// records what it passes down in the child's dirty bitmaps.
#[test]
fn writes_through_a_throttle_reach_its_child_s_dirty_bitmaps() {
    let dir = Scratch::new("throttle-bitmap");
    let (_daemon, mut qmp) = throttled(&dir, "limits.iops-total=100000", 1, &[]);
    qmp.execute("block-dirty-bitmap-add", json!({"node": "n0", "name": "b", "granularity": 65536})).unwrap();
    let mut client = Client::connect(&dir.path("e0.sock"), ClientOptions::default()).unwrap();
    let mut queue = client.take_queue(0).unwrap();
    queue.write_at(0, &[0x5a; 4096]).unwrap();
    queue.write_zeroes(1 << 20, 128 << 10, false).unwrap();
    let nodes = qmp.execute("query-named-block-nodes", json!({})).unwrap();
    let child = nodes.as_array().unwrap().iter().find(|n| n["node-name"] == "n0").unwrap();
    assert_eq!(child["dirty-bitmaps"][0]["count"], json!(3 * 65536), "{child}");
}

#[test]
fn iops_and_bps_limits_hold_at_any_queue_depth() {
    let dir = Scratch::new("throttle-rates");
    let (_daemon, _qmp) = throttled(&dir, "limits.iops-total=400", 1, &[]);
    for iodepth in [1, 16, 64] {
        let (iops, _) = bench(&dir.path("e0.sock"), "randread", "4k", iodepth, 3.0);
        assert!(holds(iops, 400.0, 3.0), "iodepth {iodepth}: {iops} IOPS for a limit of 400");
    }
    drop(_daemon);
    let dir = Scratch::new("throttle-bps");
    let (_daemon, _qmp) = throttled(&dir, "limits.bps-write=4194304", 1, &[]);
    for iodepth in [1, 16] {
        let (_, mib_s) = bench(&dir.path("e0.sock"), "randwrite", "64k", iodepth, 3.0);
        assert!(holds(mib_s, 4.0, 3.0), "iodepth {iodepth}: {mib_s} MiB/s for a limit of 4");
    }
    let (iops, _) = bench(&dir.path("e0.sock"), "randread", "64k", 16, 1.0);
    assert!(iops > 1000.0, "reads are not limited by a write limit: {iops}");
}

#[test]
fn a_burst_runs_at_its_rate_then_the_limit_holds() {
    let dir = Scratch::new("throttle-burst");
    let limits = "limits.iops-total=200,limits.iops-total-max=1000,limits.iops-total-max-length=2";
    let (_daemon, _qmp) = throttled(&dir, limits, 1, &[]);
    let (burst, _) = bench(&dir.path("e0.sock"), "randread", "4k", 16, 1.0);
    assert!(holds(burst, 1000.0, 1.0), "the first second at the burst rate: {burst}");
    // A bucket of 2000 operations: drained after about two seconds of it.
    std::thread::sleep(Duration::from_millis(100));
    let (_, _) = bench(&dir.path("e0.sock"), "randread", "4k", 16, 1.5);
    let (after, _) = bench(&dir.path("e0.sock"), "randread", "4k", 16, 3.0);
    assert!(holds(after, 200.0, 3.0), "then the sustained limit: {after}");
}

#[test]
fn qom_set_changes_the_limit_of_running_exports_and_members_share_it() {
    for members in [2, 4] {
        let dir = Scratch::new(&format!("throttle-share-{members}"));
        let (_daemon, _qmp) = throttled(&dir, "limits.iops-total=1000", members, &[]);
        let runs: Vec<_> = (0..members)
            .map(|i| dir.path(&format!("e{i}.sock")))
            .map(|socket| std::thread::spawn(move || bench(&socket, "randread", "4k", 16, 3.0).0))
            .collect();
        let shares: Vec<f64> = runs.into_iter().map(|r| r.join().unwrap()).collect();
        let (sum, fair) = (shares.iter().sum::<f64>(), 1.0 / members as f64);
        assert!(holds(sum, 1000.0, 3.0), "the group's limit, shared: {shares:?}");
        let even = shares.iter().all(|s| (s / sum - fair).abs() <= 0.15 * fair);
        assert!(even, "each within 15 % of its share: {shares:?}");
    }

    let dir = Scratch::new("throttle-qom-set");
    let (_daemon, mut qmp) = throttled(&dir, "limits.iops-total=1000", 1, &[]);
    qmp.execute("qom-set", json!({"path": "tg0", "property": "limits", "value": {"iops-total": 300}})).unwrap();
    let (iops, _) = bench(&dir.path("e0.sock"), "randread", "4k", 16, 3.0);
    assert!(holds(iops, 300.0, 3.0), "the new limit at once: {iops}");
    qmp.execute("qom-set", json!({"path": "tg0", "property": "limits", "value": {}})).unwrap();
    let (iops, _) = bench(&dir.path("e0.sock"), "randread", "4k", 16, 1.0);
    assert!(iops > 3000.0, "no limit: {iops}");
}

#[test]
fn each_group_counts_what_it_let_through_and_what_waited() {
    let dir = Scratch::new("throttle-stats");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let metrics = ["--metrics".to_string(), format!("127.0.0.1:{port}")];
    let (_daemon, mut qmp) = throttled(&dir, "limits.iops-read=200", 1, &metrics);
    let socket = dir.path("e0.sock");
    let config = ["vsd-bench", "--socket", socket.to_str().unwrap(), "--rw", "randread", "--iodepth", "8"];
    let config = [&config[..], &["--seconds", "1", "--ramp-seconds", "0"]].concat();
    let config = <vsd_bench::bench::Args as clap::Parser>::parse_from(config).into_config().unwrap();
    let ios = vsd_bench::bench::run(&config).unwrap().results.ios;

    let stats = qmp.execute("query-blockstats", json!({"query-nodes": true})).unwrap();
    let node = stats.as_array().unwrap().iter().find(|e| e["node-name"] == "t0" && e.get("qdev").is_none());
    let node = node.unwrap().clone();
    let group = &node["x-vsd-throttle"];
    assert_eq!(group["group"], json!("tg0"), "{node}");
    let read = &group["read"];
    let requests = read["requests"].as_u64().unwrap();
    assert!((ios..=ios + 8).contains(&requests), "{requests} let through, the client had {ios} done: {group}");
    assert_eq!(read["bytes"].as_u64(), Some(requests * 4096));
    assert!(read["delayed"].as_u64().unwrap() > requests / 2, "most waited at 200 IOPS: {group}");
    assert!(read["wait_ns"].as_u64().unwrap() > 100_000_000, "{group}");
    assert_eq!(group["write"]["requests"], json!(0));

    // Prometheus' own parser reads the same.
    let script = format!(
        "import urllib.request, json\n\
         from prometheus_client.parser import text_string_to_metric_families as parse\n\
         text = urllib.request.urlopen('http://127.0.0.1:{port}/metrics').read().decode()\n\
         out = {{}}\n\
         for family in parse(text):\n\
         \x20   for s in family.samples:\n\
         \x20       if s.labels.get('group') == 'tg0':\n\
         \x20           out[s.name + '/' + s.labels['direction']] = s.value\n\
         print(json.dumps(out))\n"
    );
    let out = std::process::Command::new("python3").arg("-c").arg(script).output().unwrap();
    assert!(out.status.success(), "prometheus parse failed: {}", String::from_utf8_lossy(&out.stderr));
    let samples: Value = serde_json::from_slice(&out.stdout).unwrap();
    let sample = |name: &str| samples[name].as_f64().unwrap_or_else(|| panic!("{name} in {samples}"));
    assert_eq!(sample("vsd_throttle_requests_total/read"), requests as f64);
    assert_eq!(sample("vsd_throttle_delayed_total/read"), read["delayed"].as_u64().unwrap() as f64);
    assert_eq!(sample("vsd_throttle_wait_seconds_total/read"), read["wait_ns"].as_u64().unwrap() as f64 / 1e9);
    assert_eq!(sample("vsd_throttle_bytes_total/write"), 0.0);
}
