//! The report from synthetic results: every figure, table and failure is
//! there, each plot's table holds the figures it draws, and headless
//! Chromium renders every plot.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::process::Command;

use tempfile::TempDir;
use vsd_lab::config::{Backend, Bus, CacheMode, Config, Driver, Engine, Format, Program, Rw};
use vsd_lab::report::write_report;
use vsd_lab::row::{Breakdown, Latency, Machine, Measured, Row, StageTime};

/// The figures the rows below must give, one per group and metric.
const FIGURES: [&str; 6] = [
    "compare-host-tmpfs-raw-writeback-io_uring-4k-randread-qd32-iops",
    "compare-host-tmpfs-raw-writeback-io_uring-4k-randread-qd32-cpu",
    "compare-host-tmpfs-raw-writeback-io_uring-4k-randread-qd32-latency",
    "compare-host-breakdown",
    "compare-guest-tmpfs-raw-writeback-io_uring-4k-randread-qd32-iops",
    "compare-guest-tmpfs-raw-writeback-io_uring-4k-randread-qd32-latency",
];
const GRID_TABLE: &str = "grid-host-formats-vsd-tmpfs-io_uring-mq1-1jobs-4k-randread-qd32";
const FAILURE: &str = "qsd exited: <socket> & all";

fn config(daemon: &str, program: Program) -> Config {
    Config {
        daemon: daemon.into(),
        program,
        export_options: String::new(),
        driver: Driver::Bench,
        bus: None,
        backend: Backend::Tmpfs,
        format: Format::Raw,
        cache: Some(CacheMode::Writeback),
        engine: Some(Engine::IoUring),
        queues: 1,
        jobs: 1,
        bs: 4096,
        rw: Rw::Randread,
        iodepth: 32,
    }
}

fn measured(iops: f64, daemon_cpu_pct: Option<f64>) -> Measured {
    let mean = 32e6 / iops;
    Measured {
        iops,
        bw_mib_s: iops / 256.0,
        lat_us: Latency { mean, p50: mean * 0.9, p99: mean * 2.5, max: mean * 10.0 },
        daemon_cpu_pct,
        daemon_cpu_us_per_io: daemon_cpu_pct.map(|pct| pct * 1e4 / iops),
        client_cpu_pct: Some(95.0),
        breakdown: None,
    }
}

fn breakdown() -> Breakdown {
    let stage = |name: &str, label: &str, mean_us: f64| StageTime {
        name: name.into(),
        label: label.into(),
        mean_us,
        p50_us: mean_us,
        p99_us: mean_us * 3.0,
    };
    Breakdown {
        stages: vec![
            stage("pop", "kick -> pop", 2.0),
            stage("submit", "pop -> submit", 1.5),
            stage("complete", "submit -> complete", 40.0),
            stage("used", "complete -> used", 1.0),
            stage("call", "used -> call", 0.5),
        ],
        total_mean_us: 45.0,
        events_per_io: BTreeMap::from([
            ("kicks".into(), 0.25),
            ("calls".into(), 0.5),
            ("io_uring_enter".into(), 0.3),
            ("wakeups".into(), 0.2),
            ("poll_hits".into(), 0.75),
            ("batches".into(), 0.1),
        ]),
    }
}

fn row(matrix: &str, config: Config, rep: u32, result: Option<Measured>) -> Row {
    let error = result.is_none().then(|| FAILURE.to_owned());
    Row {
        spec: "report-test".into(),
        matrix: matrix.into(),
        id: config.id(),
        rep,
        started_unix: 1_700_000_000 + u64::from(rep),
        seconds: 10.0,
        config,
        result,
        error,
        machine: Machine {
            cpu_model: "Test CPU @ 3.0GHz".into(),
            cpus: 2,
            mem_gib: 7.8,
            kernel: "6.1.0-test-amd64".into(),
            clocksource: "tsc".into(),
            vsd_version: "0.1.0".into(),
            qemu_version: "QEMU emulator version 10.0.0".into(),
            fio_version: "fio-3.33".into(),
            daemon_cpus: "0".into(),
            client_cpus: "1".into(),
            disk_fs: "ext4".into(),
        },
    }
}

/// vsd (with its breakdown), qsd and the host floor at two queue/job
/// settings, a guest run, a failed run, and a format × cache grid of vsd.
fn rows() -> Vec<Row> {
    let mut rows = Vec::new();
    for rep in 0..2 {
        let jitter = f64::from(rep) * 2000.0;
        for (queues, jobs) in [(1, 1), (2, 2)] {
            let scale = f64::from(queues);
            let vsd = Config { queues, jobs, ..config("vsd", Program::Vsd) };
            let with_breakdown =
                Measured { breakdown: Some(breakdown()), ..measured(100e3 * scale + jitter, Some(70.0)) };
            rows.push(row("compare", vsd, rep, Some(with_breakdown)));
            let qsd = Config { queues, jobs, ..config("qsd", Program::Qsd) };
            rows.push(row("compare", qsd, rep, Some(measured(60e3 * scale + jitter, Some(85.0)))));
        }
        let floor = Config { driver: Driver::Fio, engine: None, ..config("fio", Program::Fio) };
        rows.push(row("compare", floor, rep, Some(measured(150e3 + jitter, None))));
    }
    let guest = Config { driver: Driver::Guest, bus: Some(Bus::VirtioBlk), ..config("qemu", Program::Qemu) };
    rows.push(row("compare", guest, 0, Some(measured(5e3, None))));
    rows.push(row("compare", config("qsd", Program::Qsd), 2, None));
    for (format, cache, iops) in [
        (Format::Raw, CacheMode::None, 10e3),
        (Format::Raw, CacheMode::Writeback, 20e3),
        (Format::Qcow2, CacheMode::None, 30e3),
        (Format::Qcow2, CacheMode::Writeback, 40e3),
    ] {
        let config = Config { format, cache: Some(cache), ..config("vsd", Program::Vsd) };
        rows.push(row("grid", config, 0, Some(measured(iops, Some(50.0)))));
    }
    rows
}

fn write(dir: &TempDir) -> (PathBuf, String) {
    let index = write_report(&rows(), dir.path()).expect("the report is written");
    let html = fs::read_to_string(&index).expect("index.html is readable");
    (index, html)
}

/// The ids of every `<figure>` on the page.
fn figure_ids(html: &str) -> Vec<&str> {
    html.split("<figure id=\"").skip(1).map(|rest| &rest[..rest.find('"').expect("a closed id")]).collect()
}

/// The cells of each row of the table with `id`, as text, header row first.
fn cells(html: &str, id: &str) -> Vec<Vec<String>> {
    let text = |cell: &str| {
        let inner = &cell[cell.find('>').expect("a closed tag") + 1..];
        inner.replace("&amp;", "&").replace("&gt;", ">").replace("&lt;", "<")
    };
    table(html, id)
        .split("<tr>")
        .skip(1)
        .map(|row| {
            let row = &row[..row.find("</tr>").expect("a closed row")];
            row.split("</t")
                .filter(|cell| cell.contains('<'))
                .map(|cell| text(&cell[cell.rfind("<t").unwrap()..]))
                .collect()
        })
        .collect()
}

/// Whether a table's `shown` figure is `value` rounded to the digits it shows.
fn shows(shown: &str, value: f64) -> bool {
    let decimals = shown.split_once('.').map_or(0, |(_, fraction)| fraction.len());
    let parsed: f64 = shown.replace(',', "").parse().unwrap_or_else(|_| panic!("'{shown}' is not a number"));
    (parsed - value).abs() <= 0.5 * 10f64.powi(-(decimals as i32)) + 1e-9
}

/// The median, lowest and highest of `values`.
fn spread(values: &[f64]) -> (f64, f64, f64) {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    let median = if sorted.len().is_multiple_of(2) { (sorted[mid - 1] + sorted[mid]) / 2.0 } else { sorted[mid] };
    (median, sorted[0], sorted[sorted.len() - 1])
}

/// The HTML of the table with `id`.
fn table<'a>(html: &'a str, id: &str) -> &'a str {
    let start = html.find(&format!("<table id=\"{id}\">")).unwrap_or_else(|| panic!("no table '{id}'"));
    let end = start + html[start..].find("</table>").expect("a closed table");
    &html[start..end]
}

#[test]
fn report_has_every_figure_table_and_failure() {
    let dir = TempDir::new().unwrap();
    let (index, html) = write(&dir);
    assert_eq!(index, dir.path().join("index.html"));

    let ids = figure_ids(&html);
    for id in FIGURES {
        assert!(ids.contains(&id), "no figure '{id}' among {ids:?}");
    }
    // The guest's QEMU has no daemon process, so no CPU figure.
    assert!(!ids.contains(&"compare-guest-tmpfs-raw-writeback-io_uring-4k-randread-qd32-cpu"));
    // Four cells of the grid make four figure groups of three figures.
    assert_eq!(ids.len(), FIGURES.len() + 4 * 3, "{ids:?}");
    assert_eq!(html.matches("<svg class=\"plot\"").count(), ids.len());
    assert_eq!(html.matches("<figcaption>").count(), ids.len());
    // Each plot's figures as a table, inside its figure.
    for id in &ids {
        let figure = &html[html.find(&format!("<figure id=\"{id}\">")).unwrap()..];
        let figure = &figure[..figure.find("</figure>").unwrap()];
        assert!(figure.contains(&format!("<table id=\"{id}-data\">")), "figure {id} has no table");
    }
    // Self-contained: nothing to run, nothing to fetch (SVG's xmlns names, never loads).
    assert!(!html.contains("<script") && !html.contains(" src=") && !html.contains("href=\"http"));

    let svgs: Vec<PathBuf> = fs::read_dir(dir.path())
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "svg"))
        .collect();
    assert_eq!(svgs.len(), ids.len());
    for id in &ids {
        let svg = fs::read_to_string(dir.path().join(format!("{id}.svg"))).expect("every figure has its file");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{id}.svg is not an SVG document");
        assert!(svg.contains("<rect") && svg.contains("<text"), "{id}.svg draws nothing");
    }

    // Guest figures say what they are, and name each run's bus beside its daemon.
    let guest = &html[html.find("<section id=\"compare-guest\"").expect("a guest section")..];
    assert!(guest.contains("Guest under QEMU TCG: functional figures, not performance"));
    assert!(guest.contains("qemu · virtio-blk"));

    // Where the time went: layer by layer, and events per request.
    assert!(html.contains("outside the daemon") && html.contains("kick -&gt; pop"));
    let events = table(&html, "compare-host-events");
    assert!(events.contains("<th>io_uring_enter</th>") && events.contains(">0.30</td>"), "{events}");

    // Rows are formats, columns cache modes, cells median IOPS.
    let grid = table(&html, GRID_TABLE);
    let raw = grid.find("<td>raw</td>").expect("a raw row");
    let qcow2 = grid.find("<td>qcow2</td>").expect("a qcow2 row");
    assert!(raw < qcow2 && grid.contains("<th>none</th><th>writeback</th>"), "{grid}");
    for cell in ["raw · none: 10,000", "raw · writeback: 20,000", "qcow2 · none: 30,000", "qcow2 · writeback: 40,000"]
    {
        assert!(grid.contains(&format!("title=\"{cell} IOPS\"")), "no cell '{cell}' in {grid}");
    }

    // The failed run is listed, escaped, and plotted nowhere.
    let failed = table(&html, "failed");
    assert!(failed.contains("qsd/tmpfs/raw/writeback/io_uring/mq1-1jobs/4k/randread/qd32"), "{failed}");
    assert!(failed.contains("qsd exited: &lt;socket&gt; &amp; all"), "{failed}");
    assert!(html.contains("daemon was pinned to CPUs 0; the driver was pinned to CPUs 1"));
}

/// The comparison figures' tables hold every bar the plot draws, and only
/// those: each the median, lowest and highest of its repetitions (and the
/// median p99 of the latency figures), in the order the bars stand.
#[test]
fn comparison_tables_hold_the_plotted_figures() {
    let dir = TempDir::new().unwrap();
    let (_, html) = write(&dir);
    let rows = rows();
    type Read = fn(&Measured) -> Option<f64>;
    let metrics: [(&str, Read, Option<Read>); 3] = [
        ("iops", |m| Some(m.iops), None),
        ("cpu", |m| m.daemon_cpu_pct, None),
        ("latency", |m| Some(m.lat_us.mean), Some(|m| Some(m.lat_us.p99))),
    ];
    for (slug, value, marker) in metrics {
        let id = format!("compare-host-tmpfs-raw-writeback-io_uring-4k-randread-qd32-{slug}-data");
        let table = cells(&html, &id);
        assert_eq!(table[0][..2], ["daemon", "queues and jobs"], "{id}");
        assert_eq!(table[0].len(), 5 + usize::from(marker.is_some()), "{id}: {:?}", table[0]);
        // Bars stand cluster by cluster, each cluster's daemons in order of appearance.
        let mut expected = Vec::new();
        for (queues, jobs) in [(1, 1), (2, 2)] {
            for daemon in ["vsd", "qsd", "fio"] {
                let reps: Vec<&Measured> = rows
                    .iter()
                    .filter(|row| row.matrix == "compare" && row.config.driver != Driver::Guest)
                    .filter(|row| row.config.daemon == daemon && (row.config.queues, row.config.jobs) == (queues, jobs))
                    .filter_map(|row| row.result.as_ref())
                    .collect();
                let values: Vec<f64> = reps.iter().filter_map(|m| value(m)).collect();
                if !values.is_empty() {
                    let markers: Option<Vec<f64>> = marker.map(|read| reps.iter().filter_map(|m| read(m)).collect());
                    expected.push((daemon, format!("mq{queues}-{jobs}jobs"), spread(&values), markers));
                }
            }
        }
        assert_eq!(table.len() - 1, expected.len(), "{id}: one row per bar: {table:?}");
        for (row, (daemon, cluster, (median, lowest, highest), markers)) in table[1..].iter().zip(&expected) {
            assert_eq!((row[0].as_str(), &row[1]), (*daemon, cluster), "{id}");
            for (shown, value) in row[2..5].iter().zip([median, lowest, highest]) {
                assert!(shows(shown, *value), "{id}, {daemon} {cluster}: {shown} is not {value}");
            }
            if let Some(markers) = markers {
                assert!(shows(&row[5], spread(markers).0), "{id}, {daemon} {cluster}: p99 {}", row[5]);
            }
        }
    }
    // The host floor has no daemon process: no CPU row.
    assert!(!table(&html, "compare-host-tmpfs-raw-writeback-io_uring-4k-randread-qd32-cpu-data").contains(">fio<"));
    let guest = cells(&html, "compare-guest-tmpfs-raw-writeback-io_uring-4k-randread-qd32-iops-data");
    assert_eq!(guest[1][..3], ["qemu · virtio-blk", "mq1-1jobs", "5,000"]);
}

/// The breakdown's table holds each stack's segments as drawn: vsd's
/// stages, then the driver's latency less vsd's total, and their sum.
#[test]
fn breakdown_table_holds_the_plotted_segments() {
    let dir = TempDir::new().unwrap();
    let (_, html) = write(&dir);
    let table = cells(&html, "compare-host-breakdown-data");
    let stages = breakdown().stages;
    let head: Vec<String> = std::iter::once("configuration".to_owned())
        .chain(stages.iter().map(|stage| format!("{}: {}", stage.name, stage.label)))
        .chain(["outside the daemon".to_owned(), "total".to_owned()])
        .collect();
    assert_eq!(table[0], head);
    assert_eq!(table.len(), 3, "one row per vsd configuration: {table:?}");
    for (row, (queues, base)) in table[1..].iter().zip([(1, 100e3), (2, 200e3)]) {
        assert_eq!(row[0], format!("mq{queues}-{queues}jobs"));
        // Two repetitions, 2000 IOPS apart; the latency is 32e6 / IOPS.
        let (latency, _, _) = spread(&[32e6 / base, 32e6 / (base + 2000.0)]);
        let outside = latency - breakdown().total_mean_us;
        let expected: Vec<f64> = stages.iter().map(|stage| stage.mean_us).chain([outside, latency]).collect();
        for (shown, value) in row[1..].iter().zip(&expected) {
            assert!(shows(shown, *value), "{}: {shown} is not {value}", row[0]);
        }
    }
    // vsd's own stages get a panel of their own, without the host's I/O.
    let svg = fs::read_to_string(dir.path().join("compare-host-breakdown.svg")).unwrap();
    assert!(svg.contains("The whole request") && svg.contains("vsd&apos;s own stages, on their own scale"), "{svg}");
}

#[test]
fn chromium_renders_every_plot() {
    let dir = TempDir::new().unwrap();
    let (index, html) = write(&dir);

    let screenshot = dir.path().join("screenshot.png");
    chromium(dir.path(), &[&format!("--screenshot={}", screenshot.display()), "--window-size=1280,4000"], &index);
    let (width, height, coloured) = coloured_share(&screenshot);
    assert_eq!((width, height), (1280, 4000));
    assert!(coloured > 0.02, "only {:.1} % of the screenshot shows bars", coloured * 100.0);

    // A copy of the page that writes each plot's laid-out size into it.
    let probe = dir.path().join("probe.html");
    let script = "<script>addEventListener('load', () => { for (const svg of document.querySelectorAll('svg.plot')) \
                  { const box = svg.getBoundingClientRect(); svg.dataset.rendered = box.width + 'x' + box.height; } \
                  });</script>\n</body>";
    fs::write(&probe, html.replace("</body>", script)).unwrap();
    let dom = chromium(dir.path(), &["--dump-dom"], &probe);
    let sizes: Vec<(f64, f64)> = dom.split("data-rendered=\"").skip(1).map(size).collect();
    assert_eq!(sizes.len(), figure_ids(&html).len(), "not every plot was laid out");
    for (width, height) in sizes {
        assert!(width >= 200.0 && height >= 150.0, "a plot rendered at {width}x{height}");
    }
}

/// Runs headless Chromium on `page` and returns what it printed. Chromium is
/// required: scripts/setup.sh installs it, so its absence is a failure.
fn chromium(scratch: &Path, args: &[&str], page: &Path) -> String {
    let profile = tempfile::tempdir_in(scratch).unwrap();
    let output = Command::new("chromium")
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(args)
        .arg(format!("file://{}", page.display()))
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run chromium ({e}): install it with scripts/setup.sh (apt-get install chromium)")
        });
    assert!(output.status.success(), "chromium failed: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).expect("chromium prints UTF-8")
}

/// The screenshot's size and the share of its pixels in a strong colour:
/// bars, as text, tables and the page are black, grey or pale.
fn coloured_share(path: &Path) -> (u32, u32, f64) {
    let mut decoder = png::Decoder::new(BufReader::new(File::open(path).expect("chromium wrote a screenshot")));
    decoder.set_transformations(png::Transformations::normalize_to_color8());
    let mut reader = decoder.read_info().expect("the screenshot is a PNG");
    let mut pixels = vec![0; reader.output_buffer_size().expect("a sane size")];
    let frame = reader.next_frame(&mut pixels).expect("the screenshot decodes");
    let channels = frame.color_type.samples();
    assert!(channels >= 3, "a colour screenshot");
    let pixels = &pixels[..frame.buffer_size()];
    let coloured = pixels
        .chunks_exact(channels)
        .filter(|pixel| {
            let rgb = &pixel[..3];
            rgb.iter().max().unwrap() - rgb.iter().min().unwrap() > 80
        })
        .count();
    (frame.width, frame.height, coloured as f64 / (pixels.len() / channels) as f64)
}

/// "640x380\"..." -> (640.0, 380.0)
fn size(attribute: &str) -> (f64, f64) {
    let value = &attribute[..attribute.find('"').expect("a closed attribute")];
    let (width, height) = value.split_once('x').expect("WxH");
    (width.parse().expect("a width"), height.parse().expect("a height"))
}
