//! The status page at `--metrics`' `/`, rendered by headless Chromium while
//! a libblkio client reads, compared with `query-blockstats`; the server's
//! bounds against bad clients; and the Grafana dashboard checked against a
//! real scrape and run by a real Prometheus.

mod common;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use common::{Daemon, Scratch};
use serde_json::{Value, json};
use vsd_bench::ClientOptions;
use vsd_control::QmpClient;

/// A daemon serving null-co through a throttle group, with its metrics
/// endpoint and a QMP socket.
struct Served {
    daemon: Daemon,
    dir: Scratch,
    metrics: String,
}

fn serve(name: &str) -> Served {
    let dir = Scratch::new(name);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let args: Vec<String> = [
        "--object".into(),
        "throttle-group,id=tg0,limits.iops-total=1000000".into(),
        "--blockdev".into(),
        "driver=null-co,node-name=null0,size=1073741824".into(),
        "--blockdev".into(),
        "driver=throttle,node-name=disk0,throttle-group=tg0,file=null0".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,addr.path={}",
            dir.path("vhost.sock").display()
        ),
        "--chardev".into(),
        format!("socket,id=qmp,path={},server=on,wait=off", dir.path("qmp.sock").display()),
        "--monitor".into(),
        "qmp".into(),
        "--metrics".into(),
        format!("127.0.0.1:{port}"),
    ]
    .into();
    let daemon = Daemon::vsd(&dir, &args);
    Served { daemon, dir, metrics: format!("127.0.0.1:{port}") }
}

/// A client reading 4 KiB blocks back to back until dropped.
struct Load {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Load {
    fn start(daemon: &Daemon) -> Self {
        let mut client = daemon.connect(ClientOptions { read_only: true, ..Default::default() });
        let mut queue = client.take_queues().pop().expect("a queue");
        let stop = Arc::new(AtomicBool::new(false));
        let running = stop.clone();
        let thread = thread::spawn(move || {
            let _client = client;
            let mut block = vec![0; 4096];
            for i in 0u64.. {
                if running.load(Ordering::Relaxed) {
                    break;
                }
                queue.read_at(i % 1024 * 4096, &mut block).expect("a read");
            }
        });
        Self { stop, thread: Some(thread) }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.take().map(JoinHandle::join);
    }
}

/// `CLOCK_MONOTONIC`, the clock `/status.json` stamps its samples with.
fn monotonic_ns() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given, which lives here.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// One answer of `query-blockstats`: the reads it counted, at some moment
/// between the question and the answer.
#[derive(Clone, Copy, Debug)]
struct Sample {
    asked: u64,
    answered: u64,
    reads: u64,
}

/// `query-blockstats`' reads of export `exp0`, asked every few
/// milliseconds until stopped.
struct Sampler {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Vec<Sample>>,
}

impl Sampler {
    fn start(qmp: &Path) -> Self {
        let mut client = QmpClient::connect(qmp).expect("QMP");
        let stop = Arc::new(AtomicBool::new(false));
        let running = stop.clone();
        let thread = thread::spawn(move || {
            let mut samples = Vec::new();
            while !running.load(Ordering::Relaxed) {
                let asked = monotonic_ns();
                let stats = client.execute("query-blockstats", json!({})).expect("query-blockstats");
                let reads = stats[0]["stats"]["rd_operations"].as_u64().expect("rd_operations");
                samples.push(Sample { asked, answered: monotonic_ns(), reads });
                thread::sleep(Duration::from_millis(5));
            }
            samples
        });
        Self { stop, thread }
    }

    fn finish(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

/// The least and the most reads counted at `at`: at least what an answer
/// that came before says, at most what a question asked after got.
fn reads_at(samples: &[Sample], at: u64) -> (u64, u64) {
    let before = samples.iter().filter(|s| s.answered <= at).map(|s| s.reads).max();
    let after = samples.iter().filter(|s| s.asked >= at).map(|s| s.reads).min();
    (before.expect("a sample before the page's window"), after.expect("a sample after the page's window"))
}

/// Runs headless Chromium on `url` with `args`; its standard output.
fn chromium(scratch: &Scratch, args: &[&str], url: &str) -> String {
    let profile = scratch.path("chromium-profile");
    let output = Command::new("chromium")
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(url)
        .output()
        .unwrap_or_else(|e| panic!("cannot run chromium ({e}): install it with scripts/setup.sh"));
    assert!(output.status.success(), "chromium failed: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).expect("chromium prints UTF-8")
}

/// The value of attribute `name` in the tag that begins `tag`.
fn attribute<'a>(dom: &'a str, tag: &str, name: &str) -> &'a str {
    let start = dom.find(tag).unwrap_or_else(|| panic!("no {tag} in the page: {dom}"));
    let element = &dom[start..start + dom[start..].find('>').unwrap()];
    let value = element.split(&format!(" {name}=\"")).nth(1).unwrap_or_else(|| panic!("no {name} in {element}"));
    &value[..value.find('"').unwrap()]
}

#[test]
fn page_shows_the_export_and_the_iops_query_blockstats_counts() {
    let served = serve("status-page");
    let _load = Load::start(&served.daemon);
    let sampler = Sampler::start(&served.dir.path("qmp.sock"));
    // Virtual time runs ahead while no fetch is pending: the page's 100
    // polls take the real time their fetches take, a few seconds, and it
    // measures over its last 5 s of the daemon's time.
    let dom =
        chromium(&served.dir, &["--virtual-time-budget=100000", "--dump-dom"], &format!("http://{}/", served.metrics));
    let samples = sampler.finish();

    let row = "<tr data-export=\"exp0\"";
    let number = |name| attribute(&dom, row, name).parse::<f64>().unwrap_or_else(|e| panic!("{name}: {e}"));
    let (start, end) = (number("data-window-start-ns") as u64, number("data-window-end-ns") as u64);
    assert!(end - start >= 1_000_000_000, "the page measured over {} ms only", (end - start) / 1_000_000);
    let seconds = (end - start) as f64 / 1e9;
    let ((start_least, start_most), (end_least, end_most)) = (reads_at(&samples, start), reads_at(&samples, end));
    let least = end_least.saturating_sub(start_most) as f64 / seconds;
    let most = (end_most - start_least) as f64 / seconds;
    assert!(least > 100.0, "the load reads at {least:.0} IOPS");
    assert!(most - least <= 0.4 * most, "query-blockstats answered too seldom: {least:.0} to {most:.0} IOPS");
    let shown = number("data-read-iops");
    assert!(
        (0.9 * least..=1.1 * most).contains(&shown),
        "the page shows {shown:.0} read IOPS, query-blockstats {least:.0} to {most:.0}"
    );
    assert_eq!(number("data-write-iops"), 0.0);
    for text in ["vhost-user-blk", "disk0", "connected", "kick -&gt; pop", "submit -&gt; complete", "tg0"] {
        assert!(dom.contains(&format!(">{text}<")), "no {text} in the page: {dom}");
    }
}

/// Sends `request` to `addr` and returns the whole response.
fn exchange(addr: &str, request: &str) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

fn get(addr: &str, path: &str) -> String {
    exchange(addr, &format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n"))
}

fn body(response: &str) -> &str {
    response.split_once("\r\n\r\n").unwrap_or_else(|| panic!("{response:?}")).1
}

#[test]
fn status_json_describes_the_export_and_unknown_paths_get_404() {
    let served = serve("status-json");
    let status: Value = serde_json::from_str(body(&get(&served.metrics, "/status.json"))).unwrap();
    let export = &status["exports"][0];
    assert_eq!(
        (&export["id"], &export["type"], &export["node"]),
        (&json!("exp0"), &json!("vhost-user-blk"), &json!("disk0"))
    );
    assert_eq!(export["client"], false);
    assert_eq!(status["throttle_groups"][0]["group"], "tg0");
    assert!(status["monotonic_ns"].as_u64().is_some_and(|t| t > 0), "{status}");
    for path in ["/status", "/index.html", "/status.json/x", "/../metrics"] {
        let response = get(&served.metrics, path);
        assert!(response.starts_with("HTTP/1.1 404 Not Found\r\n"), "{path}: {response}");
    }
}

#[test]
fn a_stalled_client_holds_scrapes_up_for_one_deadline_at_most() {
    let served = serve("status-stalled");
    // Half a request, then nothing: the server waits for the rest until
    // its deadline (2 s), then hangs up.
    let mut stalled = TcpStream::connect(&served.metrics).unwrap();
    stalled.write_all(b"GET /status.json HTTP/1.1\r\nHost: x\r\n").unwrap();
    let start = Instant::now();
    let response = get(&served.metrics, "/metrics");
    let waited = start.elapsed();
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n") && response.contains("vsd_export_ops_total"), "{response}");
    assert!(waited < Duration::from_secs(10), "a scrape waited {waited:?} behind a stalled client");
    stalled.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut rest = Vec::new();
    stalled.read_to_end(&mut rest).expect("the server hangs up on the stalled client");
    assert!(rest.is_empty(), "a stalled request was answered: {}", String::from_utf8_lossy(&rest));
    assert!(get(&served.metrics, "/").contains("<title>vsd status</title>"));
}

/// The dashboard as JSON, and every query in it: its panels' `expr`s
/// (PromQL) and its variables' `definition`s (`label_values(...)`).
fn dashboard() -> (Value, Vec<String>, Vec<String>) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/grafana/vsd-dashboard.json");
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).expect("the dashboard is JSON");
    let (mut exprs, mut definitions) = (Vec::new(), Vec::new());
    collect(&dashboard, "expr", &mut exprs);
    collect(&dashboard, "definition", &mut definitions);
    (dashboard, exprs, definitions)
}

/// Every metric name in the dashboard's queries is one vsd exports.
#[test]
fn grafana_dashboard_names_only_metrics_vsd_exports() {
    let served = serve("status-grafana");
    let scrape = get(&served.metrics, "/metrics");
    let exported: BTreeSet<&str> =
        body(&scrape).lines().filter(|l| !l.starts_with('#')).map(|l| &l[..l.find(['{', ' ']).unwrap()]).collect();

    let (dashboard, exprs, definitions) = dashboard();
    assert_eq!(dashboard["__inputs"][0]["name"], "DS_PROMETHEUS", "an importable datasource input");
    assert!(exprs.len() >= 8 && definitions.len() == 2, "{exprs:?} {definitions:?}");
    let named: BTreeSet<&str> = exprs.iter().chain(&definitions).flat_map(|e| metric_names(e)).collect();
    let unknown: Vec<_> = named.iter().filter(|n| !exported.contains(*n)).collect();
    assert!(unknown.is_empty(), "the dashboard names metrics vsd does not export: {unknown:?}");
    for family in ["vsd_export_ops_total", "vsd_export_bytes_total", "vsd_export_latency_seconds_bucket"] {
        assert!(named.contains(family), "the dashboard does not show {family}");
    }
    assert!(named.iter().any(|n| n.starts_with("vsd_stage_")) && named.iter().any(|n| n.starts_with("vsd_throttle_")));
}

/// Prometheus scrapes vsd under load; every panel's query, with Grafana's
/// variables filled in as "All" does, parses and answers series.
#[test]
fn grafana_dashboard_queries_answer_from_prometheus() {
    let served = serve("status-prometheus");
    let _load = Load::start(&served.daemon);
    let prometheus = Prometheus::start(&served.dir, &served.metrics);
    let (_, exprs, _) = dashboard();
    let queries: Vec<String> = exprs
        .iter()
        .map(|e| e.replace("$export", ".*").replace("$group", ".*").replace("$__rate_interval", "10s"))
        .collect();
    // Rates need two scrapes in their range; give Prometheus some.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let empty: Vec<&String> =
            queries.iter().filter(|q| prometheus.query(q).as_array().unwrap().is_empty()).collect();
        if empty.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "queries Prometheus answers nothing to: {empty:#?}");
        thread::sleep(Duration::from_millis(500));
    }
}

/// A Prometheus server scraping one target every second, stopped on drop.
struct Prometheus {
    child: std::process::Child,
    addr: String,
}

impl Prometheus {
    fn start(dir: &Scratch, target: &str) -> Self {
        let config = dir.path("prometheus.yml");
        std::fs::write(
            &config,
            format!("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: vsd\n    static_configs:\n      - targets: ['{target}']\n"),
        )
        .unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr = format!("127.0.0.1:{port}");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path("tsdb").display()))
            .arg(format!("--web.listen-address={addr}"))
            .stderr(std::fs::File::create(dir.path("prometheus.log")).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run prometheus ({e}): install it with scripts/setup.sh"));
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(&addr).is_err() {
            assert!(Instant::now() < deadline, "prometheus did not listen on {addr}");
            thread::sleep(Duration::from_millis(100));
        }
        Self { child, addr }
    }

    /// The result of an instant query; a query Prometheus refuses fails.
    fn query(&self, query: &str) -> Value {
        let encoded: String = query
            .bytes()
            .map(|b| match b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                true => (b as char).to_string(),
                false => format!("%{b:02X}"),
            })
            .collect();
        // HTTP/1.0: the body ends with the connection, never chunked.
        let response = exchange(&self.addr, &format!("GET /api/v1/query?query={encoded} HTTP/1.0\r\n\r\n"));
        let answer: Value = serde_json::from_str(body(&response)).unwrap_or_else(|e| panic!("{e}: {response}"));
        assert_eq!(answer["status"], "success", "{query}: {answer}");
        answer["data"]["result"].clone()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every string under the key `key`, anywhere in `value`.
fn collect(value: &Value, key: &str, found: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            found.extend(map.get(key).and_then(Value::as_str).map(str::to_owned));
            map.values().for_each(|v| collect(v, key, found));
        }
        Value::Array(values) => values.iter().for_each(|v| collect(v, key, found)),
        _ => {}
    }
}

/// The `vsd_…` identifiers in a query.
fn metric_names(expr: &str) -> impl Iterator<Item = &str> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).filter(|word| word.starts_with("vsd_"))
}
