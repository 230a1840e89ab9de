//! qcow2 interop with QEMU, both directions.
//!
//! * Images made by qemu-img and filled by qemu-io (every version, cluster
//!   size, refcount width, extended L2 entries, compression, backing
//!   chains, external data files, preallocation, internal snapshots) read
//!   through vsd exactly as `qemu-img convert -O raw` reads them.
//! * Images written through vsd by a seeded workload on two queues pass
//!   `qemu-img check` and `qemu-img compare` equal to a raw reference that
//!   received the same writes; snapshots stay intact.
//! * An image grown by vsd far past its first L2 table and refcount table
//!   stays readable and writable by QEMU, and the other way round.
//!
//! Every QEMU tool runs in the image's directory, so relative backing and
//! data file names resolve the same way for QEMU and vsd.

mod common;

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::process::{Command, ExitStatus};

use common::{Daemon, Scratch, pattern};
use vsd_bench::{BatchOp, ClientOptions, Queue};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// The largest read or write the export takes in one segment.
const CHUNK: u64 = MIB;
/// The image each builder leaves in its directory (the top of any chain).
const IMG: &str = "img.qcow2";
/// The raw reference each write test keeps next to the image.
const REFERENCE: &str = "ref.raw";

// ---------------------------------------------------------------------------
// QEMU tools

/// Runs a QEMU tool in `dir`; returns its status and stdout + stderr.
fn tool(dir: &Scratch, program: &str, args: &[&str]) -> (ExitStatus, String) {
    let out = Command::new(program)
        .args(args)
        .current_dir(&dir.0)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    (out.status, format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

fn qemu_img(dir: &Scratch, args: &[&str]) -> String {
    let (status, text) = tool(dir, "qemu-img", args);
    assert!(status.success(), "`qemu-img {}` failed ({status}): {text}", args.join(" "));
    text
}

/// Runs `commands` on `image` in one qemu-io process.
fn qemu_io(dir: &Scratch, format: &str, image: &str, commands: &[String]) {
    let mut args = vec!["-f", format];
    for command in commands {
        args.extend(["-c", command.as_str()]);
    }
    args.push(image);
    let (status, text) = tool(dir, "qemu-io", &args);
    assert!(
        status.success() && !text.contains("failed") && !text.to_lowercase().contains("error"),
        "qemu-io on {image} ({status}): {text}\ncommands: {commands:#?}"
    );
}

/// `qemu-img create -f qcow2 [-o OPTS] [-b BACKING -F FMT] NAME [SIZE]`.
fn create(dir: &Scratch, name: &str, opts: &str, backing: Option<(&str, &str)>, size: Option<u64>) {
    let size = size.map(|s| s.to_string());
    let mut args = vec!["create", "-q", "-f", "qcow2"];
    if !opts.is_empty() {
        args.extend(["-o", opts]);
    }
    if let Some((file, format)) = backing {
        args.extend(["-b", file, "-F", format]);
    }
    args.push(name);
    args.extend(size.as_deref());
    qemu_img(dir, &args);
}

/// `qemu-img check` must exit 0 and report no corruption, leak or check
/// error. Returns the JSON report.
fn assert_check_clean(dir: &Scratch, what: &str) -> String {
    let (status, text) = tool(dir, "qemu-img", &["check", "--output=json", IMG]);
    let count = |key| common::json_count(&text, key);
    if !status.success() || count("corruptions") > 0 || count("leaks") > 0 || count("check-errors") > 0 {
        let (_, human) = tool(dir, "qemu-img", &["check", IMG]);
        panic!("{what}: qemu-img check {IMG} exited with {status}:\n{text}\n{human}");
    }
    text
}

/// `qemu-img compare -f qcow2 -F raw IMG reference` must say identical.
fn assert_compare_identical(dir: &Scratch, reference: &str, what: &str) {
    let (status, text) = tool(dir, "qemu-img", &["compare", "-f", "qcow2", "-F", "raw", IMG, reference]);
    assert!(
        status.success() && text.contains("Images are identical"),
        "{what}: qemu-img compare -f qcow2 -F raw {IMG} {reference} exited with {status}: {text}"
    );
}

/// A big-endian header field of the image file.
fn header_u32(dir: &Scratch, offset: u64) -> u32 {
    let mut word = [0u8; 4];
    File::open(dir.path(IMG)).unwrap().read_exact_at(&mut word, offset).unwrap();
    u32::from_be_bytes(word)
}

// ---------------------------------------------------------------------------
// Data

/// A small deterministic generator (xorshift64).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self((seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x9e37_79b9_7f4a_7c15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// A multiple of 512 in `min..=max` (both multiples of 512).
    fn sectors(&mut self, min: u64, max: u64) -> u64 {
        min + self.below((max - min) / 512 + 1) * 512
    }
}

/// Bytes zlib and zstd shrink several times, different for each `seed`:
/// runs of a few letters.
fn compressible(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::with_capacity(len + 16);
    while out.len() < len {
        let x = rng.next();
        out.extend(std::iter::repeat_n(b'a' + (x & 3) as u8, 1 + (x >> 8) as usize % 16));
    }
    out.truncate(len);
    out
}

/// `n` scattered qemu-io commands over a disk of `size` bytes: writes of
/// one byte value or of a pattern file that does not repeat at sector
/// boundaries, zero writes with and without unmap, and discards.
fn io_script(dir: &Scratch, size: u64, seed: u64, n: usize) -> Vec<String> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|i| {
            let kind = rng.below(100);
            let max = if kind < 65 { 256 * KIB } else { MIB };
            let len = rng.sectors(512, max.min(size));
            let off = rng.below((size - len) / 512 + 1) * 512;
            match kind {
                0..45 => format!("write -q -P 0x{:02x} {off} {len}", 1 + rng.below(255)),
                45..65 => {
                    let file = format!("pat-{seed}-{i}.bin");
                    std::fs::write(dir.path(&file), pattern(seed * 1000 + i as u64, 4099 + i)).unwrap();
                    format!("write -q -s {file} {off} {len}")
                }
                65..75 => format!("write -q -z {off} {len}"),
                75..85 => format!("write -q -z -u {off} {len}"),
                _ => format!("discard -q {off} {len}"),
            }
        })
        .collect()
}

/// Describes where `got` (from `names.0`) and `want` (from `names.1`)
/// differ, if they do; `base` is the disk offset of their first byte.
fn describe_diff(got: &[u8], want: &[u8], base: u64, names: (&str, &str)) -> Option<String> {
    if got == want {
        return None;
    }
    let same = |(a, b): (&u8, &u8)| a == b;
    let first = got.iter().zip(want).position(|p| !same(p))?;
    let last = got.iter().zip(want).rposition(|p| !same(p)).unwrap();
    let count = got.iter().zip(want).filter(|&p| !same(p)).count();
    let show = |b: &[u8]| format!("{:02x?}", &b[first..(first + 16).min(b.len())]);
    Some(format!(
        "{count} bytes differ between {:#x} and {:#x}; at {:#x} {} has {} where {} has {}",
        base + first as u64,
        base + last as u64,
        base + first as u64,
        names.0,
        show(got),
        names.1,
        show(want)
    ))
}

// ---------------------------------------------------------------------------
// vsd

/// vsd serving `IMG` of `dir` on `dir/vsd.sock`.
fn vsd_args(dir: &Scratch, writable: bool, direct: bool, queues: usize) -> Vec<String> {
    let mut file = format!("driver=file,node-name=f0,filename={}", dir.path(IMG).display());
    let mut qcow2 = "driver=qcow2,node-name=q0,file=f0".to_string();
    let mut export = format!(
        "type=vhost-user-blk,id=e0,node-name=q0,addr.type=unix,addr.path={},num-queues={queues}",
        dir.path("vsd.sock").display()
    );
    if direct {
        file.push_str(",cache.direct=on");
    }
    if writable {
        // Each node acts on discards only with discard=unmap, as in QEMU.
        file.push_str(",discard=unmap");
        qcow2.push_str(",discard=unmap");
        export.push_str(",writable=on");
    } else {
        file.push_str(",read-only=on");
        qcow2.push_str(",read-only=on");
    }
    vec!["--blockdev".into(), file, "--blockdev".into(), qcow2, "--export".into(), export]
}

/// Reads the whole disk in 1 MiB requests and compares it with `expected`.
fn assert_disk_equals(queue: &mut Queue, expected: &Path, what: &str) {
    let file = File::open(expected).unwrap();
    let size = file.metadata().unwrap().len();
    let mut got = vec![0u8; CHUNK as usize];
    let mut want = vec![0u8; CHUNK as usize];
    let mut offset = 0;
    while offset < size {
        let n = CHUNK.min(size - offset) as usize;
        queue
            .read_at(offset, &mut got[..n])
            .unwrap_or_else(|e| panic!("{what}: read of {n} bytes at {offset:#x}: {e}"));
        file.read_exact_at(&mut want[..n], offset).unwrap();
        if let Some(diff) = describe_diff(&got[..n], &want[..n], offset, ("vsd", &expected.display().to_string())) {
            panic!("{what}: {diff}");
        }
        offset += n as u64;
    }
}

/// Connects to `daemon` and compares its whole disk with `expected`.
fn assert_served_equals(daemon: &Daemon, read_only: bool, expected: &Path, what: &str) {
    let mut client = daemon.connect(ClientOptions { read_only, ..Default::default() });
    let size = std::fs::metadata(expected).unwrap().len();
    assert_eq!(client.capacity().unwrap(), size, "{what}: capacity");
    assert_disk_equals(&mut client.take_queue(0).unwrap(), expected, what);
}

/// Serves `IMG` read-only and compares every byte with
/// `qemu-img convert -O raw`; vsd must not change the image file.
fn assert_reads_like_qemu(dir: &Scratch, direct: bool, what: &str) {
    qemu_img(dir, &["convert", "-O", "raw", IMG, "expected.raw"]);
    let before = std::fs::read(dir.path(IMG)).unwrap();
    let daemon = Daemon::vsd(dir, &vsd_args(dir, false, direct, 1));
    assert_served_equals(&daemon, true, &dir.path("expected.raw"), what);
    let status = daemon.stop();
    assert!(status.success(), "{what}: vsd exited with {status}");
    assert!(std::fs::read(dir.path(IMG)).unwrap() == before, "{what}: vsd changed an image it served read-only");
}

/// Runs every case, then fails naming each case that failed (their panic
/// messages are printed as they happen).
fn run_cases(cases: Vec<(String, Box<dyn FnOnce() + '_>)>) {
    let failed: Vec<String> = cases
        .into_iter()
        .filter_map(|(name, case)| catch_unwind(AssertUnwindSafe(case)).is_err().then_some(name))
        .collect();
    assert!(failed.is_empty(), "failed image kinds: {failed:?}");
}

/// One read-interop case per `(kind, builder)`: builds `IMG` in a fresh
/// directory and compares vsd's reads with QEMU's. Every other case opens
/// the file with O_DIRECT.
fn read_cases(family: &str, kinds: Vec<(String, Builder)>) {
    let cases = kinds
        .into_iter()
        .enumerate()
        .map(|(i, (kind, build))| {
            let direct = i % 2 == 1;
            let name = format!("{kind}{}", if direct { " (cache.direct=on)" } else { "" });
            let case: Box<dyn FnOnce()> = Box::new(move || {
                let dir = Scratch::new(&format!("q2r-{family}-{i}"));
                build(&dir);
                assert_reads_like_qemu(&dir, direct, &format!("read {kind}, direct={direct}"));
            });
            (name, case)
        })
        .collect();
    run_cases(cases);
}

// ---------------------------------------------------------------------------
// Image recipes: each leaves `IMG` (and whatever it needs) in `dir`.

/// A new image with these creation options, filled by qemu-io.
fn filled(dir: &Scratch, opts: &str, size: u64, seed: u64) {
    create(dir, IMG, opts, None, Some(size));
    qemu_io(dir, "qcow2", IMG, &io_script(dir, size, seed, 40));
}

/// Extended L2 entries: 4 KiB writes at odd offsets that start and end
/// inside subclusters, zero writes of single subclusters, then the random
/// script.
fn extended_l2(dir: &Scratch, cluster: u64, size: u64) {
    create(dir, IMG, &format!("extended_l2=on,cluster_size={cluster}"), None, Some(size));
    let sub = cluster / 32;
    let clusters = size / cluster;
    let mut commands = Vec::new();
    for k in 0..12u64 {
        let base = (k * 7 % clusters) * cluster;
        let odd = (2 * k + 1) * 4 * KIB + 512 * (k % 3);
        commands.push(format!("write -q -P 0x{:02x} {} 4096", 0x40 + k, base + odd % (cluster - 4 * KIB)));
        commands.push(format!("write -q -z {} {sub}", base + (k * 5 % 32) * sub));
        // One zero subcluster elsewhere, often in an otherwise unallocated cluster.
        commands.push(format!("write -q -z {} {sub}", (k * 7 + 3) % clusters * cluster + (k % 32) * sub));
    }
    commands.extend(io_script(dir, size, cluster + 1, 30));
    qemu_io(dir, "qcow2", IMG, &commands);
}

/// `qemu-img convert -c` of a raw file with compressible, incompressible
/// and zero clusters, then qemu-io changing some compressed clusters
/// (partial overwrite, zero write, discard, a compressed rewrite).
fn compressed(dir: &Scratch, compression: &str) {
    let cs = 64 * KIB;
    let size = 16 * MIB;
    let mut src = vec![0u8; size as usize];
    for (c, cluster) in src.chunks_mut(cs as usize).enumerate() {
        let c = c as u64;
        match c % 8 {
            1 => {}
            2 => cluster.copy_from_slice(&pattern(c, cs as usize)),
            4 => cluster[..cs as usize / 2].copy_from_slice(&compressible(c, cs as usize / 2)),
            _ => cluster.copy_from_slice(&compressible(c, cs as usize)),
        }
    }
    std::fs::write(dir.path("src.raw"), &src).unwrap();
    let opts = format!("compression_type={compression}");
    qemu_img(dir, &["convert", "-c", "-f", "raw", "-O", "qcow2", "-o", &opts, "src.raw", IMG]);
    let report = qemu_img(dir, &["check", "--output=json", IMG]);
    assert!(common::json_count(&report, "compressed-clusters") > 100, "nothing compressed: {report}");
    std::fs::write(dir.path("pat-c.bin"), compressible(33, 4099)).unwrap();
    let mut commands = vec![
        format!("write -q -P 0x61 {} 4096", 3 * cs + 1024),
        format!("write -q -z {} 8192", 5 * cs + 4096),
        format!("discard -q {} {}", 6 * cs, cs),
        // QEMU writes compressed clusters only where nothing is allocated:
        // clusters 9 and 17 are zero in the source.
        format!("write -q -c -P 0x62 {} {}", 9 * cs, cs),
        format!("write -q -c -s pat-c.bin {} {}", 17 * cs, cs),
    ];
    commands.extend(io_script(dir, size, 31, 16));
    qemu_io(dir, "qcow2", IMG, &commands);
}

/// raw base <- v2 4 KiB mid <- v3 64 KiB top <- extended-L2 `IMG`, each
/// layer written by qemu-io; relative backing names.
fn chain(dir: &Scratch) {
    let size = 16 * MIB;
    std::fs::write(dir.path("base.raw"), pattern(41, size as usize)).unwrap();
    create(dir, "mid.qcow2", "compat=0.10,cluster_size=4096", Some(("base.raw", "raw")), None);
    qemu_io(dir, "qcow2", "mid.qcow2", &io_script(dir, size, 42, 30));
    create(dir, "top.qcow2", "cluster_size=65536", Some(("mid.qcow2", "qcow2")), None);
    qemu_io(dir, "qcow2", "top.qcow2", &io_script(dir, size, 43, 30));
    create(dir, IMG, "extended_l2=on", Some(("top.qcow2", "qcow2")), None);
    let mut commands = io_script(dir, size, 44, 30);
    commands.push(format!("write -q -P 0x55 {} 4096", 5 * MIB + 2048 + 512));
    commands.push(format!("write -q -z {} {}", 7 * MIB + 2048, 2048));
    qemu_io(dir, "qcow2", IMG, &commands);
}

/// A 24 MiB image over an 8 MiB + 1536 byte raw backing file: reads past
/// the backing file's end, and writes straddling it.
fn grown_over_backing(dir: &Scratch) {
    let size = 24 * MIB;
    std::fs::write(dir.path("base.raw"), pattern(51, (8 * MIB + 1536) as usize)).unwrap();
    create(dir, IMG, "", Some(("base.raw", "raw")), Some(size));
    let mut commands = io_script(dir, size, 52, 30);
    commands.push(format!("write -q -P 0x71 {} {}", 8 * MIB - 6 * KIB, 12 * KIB));
    commands.push(format!("write -q -P 0x72 {} 512", 8 * MIB + 64 * KIB + 1024));
    commands.push(format!("write -q -P 0x73 {} 512", 8 * MIB - 64 * KIB + 512));
    qemu_io(dir, "qcow2", IMG, &commands);
}

/// A v3 64 KiB image over a patterned raw backing file of the same size.
fn over_raw_backing(dir: &Scratch) {
    let size = 16 * MIB;
    std::fs::write(dir.path("base.raw"), pattern(61, size as usize)).unwrap();
    create(dir, IMG, "", Some(("base.raw", "raw")), None);
    qemu_io(dir, "qcow2", IMG, &io_script(dir, size, 62, 30));
}

/// An external data file `d.raw`, optionally a raw image itself.
fn data_file(dir: &Scratch, raw: bool) {
    let opts = if raw { "data_file=d.raw,data_file_raw=on" } else { "data_file=d.raw" };
    filled(dir, opts, 16 * MIB, 71);
}

/// Writes, snapshot s1, writes, snapshot s2, writes; optionally s2 deleted
/// again (leaving free clusters between used ones).
fn snapshots(dir: &Scratch, delete_s2: bool) {
    let size = 16 * MIB;
    create(dir, IMG, "", None, Some(size));
    qemu_io(dir, "qcow2", IMG, &io_script(dir, size, 81, 30));
    qemu_img(dir, &["snapshot", "-c", "s1", IMG]);
    qemu_io(dir, "qcow2", IMG, &io_script(dir, size, 82, 30));
    qemu_img(dir, &["snapshot", "-c", "s2", IMG]);
    qemu_io(dir, "qcow2", IMG, &io_script(dir, size, 83, 30));
    if delete_s2 {
        qemu_img(dir, &["snapshot", "-d", "s2", IMG]);
    }
}

type Builder = Box<dyn Fn(&Scratch)>;

// ---------------------------------------------------------------------------
// 1. QEMU writes, vsd reads

#[test]
fn reads_match_qemu_for_each_version_and_cluster_size() {
    let mut kinds: Vec<(String, Builder)> = Vec::new();
    for compat in ["0.10", "1.1"] {
        for cluster in [512, 4096, 65536, 2 * MIB] {
            let size = if cluster == 2 * MIB { 32 * MIB } else { 16 * MIB };
            let opts = format!("compat={compat},cluster_size={cluster}");
            kinds.push((opts.clone(), Box::new(move |dir: &Scratch| filled(dir, &opts, size, cluster + 3))));
        }
    }
    read_cases("version", kinds);
}

#[test]
fn reads_match_qemu_for_each_refcount_width() {
    let mut kinds: Vec<(String, Builder)> = Vec::new();
    for bits in [1, 8, 16, 64] {
        for cluster in [512, 4096] {
            let opts = format!("refcount_bits={bits},cluster_size={cluster}");
            kinds.push((opts.clone(), Box::new(move |dir: &Scratch| filled(dir, &opts, 8 * MIB, bits + cluster))));
        }
    }
    read_cases("refcount", kinds);
}

#[test]
fn reads_match_qemu_with_extended_l2_entries() {
    let kinds: Vec<(String, Builder)> = vec![
        ("extended_l2=on,cluster_size=64k".into(), Box::new(|dir: &Scratch| extended_l2(dir, 64 * KIB, 16 * MIB))),
        ("extended_l2=on,cluster_size=2M".into(), Box::new(|dir: &Scratch| extended_l2(dir, 2 * MIB, 32 * MIB))),
    ];
    read_cases("extl2", kinds);
}

#[test]
fn reads_match_qemu_for_compressed_images() {
    let kinds: Vec<(String, Builder)> = vec![
        ("compressed zlib".into(), Box::new(|dir: &Scratch| compressed(dir, "zlib"))),
        ("compressed zstd".into(), Box::new(|dir: &Scratch| compressed(dir, "zstd"))),
    ];
    read_cases("compressed", kinds);
}

#[test]
fn reads_match_qemu_through_backing_chains() {
    let kinds: Vec<(String, Builder)> = vec![
        ("chain raw <- v2 4k <- v3 64k <- extended L2".into(), Box::new(chain)),
        ("24M image over an 8M+1536 raw backing file".into(), Box::new(grown_over_backing)),
        ("v3 over raw backing".into(), Box::new(over_raw_backing)),
    ];
    read_cases("chain", kinds);
}

/// The `flags:` of every descriptor `pid` holds open on `path`.
fn open_flags(pid: u32, path: &Path) -> Vec<i32> {
    let path = std::fs::canonicalize(path).unwrap();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap();
    fds.filter_map(|fd| {
        let fd = fd.unwrap();
        (std::fs::read_link(fd.path()).ok()? == path).then_some(())?;
        let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", fd.file_name().to_str()?)).ok()?;
        let flags = info.lines().find_map(|l| l.strip_prefix("flags:"))?;
        i32::from_str_radix(flags.trim(), 8).ok()
    })
    .collect()
}

/// Serves `IMG`, built by `build`, from a qcow2 node with cache.direct=on:
/// the files it opens from its header (`implicit`) inherit the option, as
/// QEMU's implicitly opened children do, so vsd holds them with O_DIRECT.
fn assert_header_files_inherit_direct(case: &str, build: fn(&Scratch), implicit: &[&str]) {
    let dir = Scratch::new(&format!("q2-inherit-{}", implicit.len()));
    build(&dir);
    let args = [
        "--blockdev".into(),
        format!(
            "driver=qcow2,node-name=q0,read-only=on,cache.direct=on,file.driver=file,file.read-only=on,file.filename={}",
            dir.path(IMG).display()
        ),
        "--export".into(),
        format!("type=vhost-user-blk,id=e0,node-name=q0,addr.type=unix,addr.path={}", dir.path("vsd.sock").display()),
    ];
    let daemon = Daemon::vsd(&dir, &args);
    for name in std::iter::once(&IMG).chain(implicit) {
        let flags = open_flags(daemon.pid(), &dir.path(name));
        assert!(!flags.is_empty(), "{case}: vsd does not hold {name} open");
        assert!(
            flags.iter().all(|f| f & libc::O_DIRECT != 0),
            "{case}: {name} is open without O_DIRECT (flags {flags:?}) under a node with cache.direct=on"
        );
    }
    qemu_img(&dir, &["convert", "-O", "raw", IMG, "expected.raw"]);
    assert_served_equals(&daemon, true, &dir.path("expected.raw"), case);
}

#[test]
fn files_opened_from_the_header_inherit_the_nodes_cache_options() {
    assert_header_files_inherit_direct("backing chain", chain, &["top.qcow2", "mid.qcow2", "base.raw"]);
    assert_header_files_inherit_direct("external data file", |dir| data_file(dir, false), &["d.raw"]);
}

#[test]
fn reads_match_qemu_with_external_data_files() {
    let kinds: Vec<(String, Builder)> = vec![
        ("data_file=d.raw".into(), Box::new(|dir: &Scratch| data_file(dir, false))),
        ("data_file=d.raw,data_file_raw=on".into(), Box::new(|dir: &Scratch| data_file(dir, true))),
    ];
    read_cases("datafile", kinds);
}

#[test]
fn reads_match_qemu_for_each_preallocation_mode() {
    let kinds = ["off", "metadata", "falloc", "full"]
        .into_iter()
        .map(|mode| {
            let build: Builder =
                Box::new(move |dir: &Scratch| filled(dir, &format!("preallocation={mode}"), 16 * MIB, 91));
            (format!("preallocation={mode}"), build)
        })
        .collect();
    read_cases("prealloc", kinds);
}

#[test]
fn reads_match_qemu_with_internal_snapshots() {
    let kinds: Vec<(String, Builder)> = vec![
        ("snapshots s1, s2".into(), Box::new(|dir: &Scratch| snapshots(dir, false))),
        ("snapshots s1, s2, s2 deleted".into(), Box::new(|dir: &Scratch| snapshots(dir, true))),
    ];
    read_cases("snapshots", kinds);
}

// ---------------------------------------------------------------------------
// 2. vsd writes, QEMU checks

/// A seeded mix of requests over one range of the disk.
#[derive(Clone, Copy)]
struct Workload {
    seed: u64,
    ops: usize,
    cluster: u64,
    /// Discards allowed (they read back as zeroes over whole clusters).
    discard: bool,
    /// Bytes written sequentially from the start of the range first.
    sequential: u64,
}

/// Applies `w` to `queue` over `base..base + len` and the same changes to
/// `reference`; reads back through vsd now and then.
fn drive(queue: &mut Queue, reference: &File, base: u64, len: u64, w: Workload, what: &str) {
    let mut rng = Rng::new(w.seed);
    let zeroes = vec![0u8; CHUNK as usize];
    let zero_ref = |off: u64, n: u64| {
        let mut at = off;
        while at < off + n {
            let k = (off + n - at).min(CHUNK);
            reference.write_all_at(&zeroes[..k as usize], at).unwrap();
            at += k;
        }
    };
    let mut log: Vec<(String, u64, u64)> = Vec::new();
    // Panics naming the request and the earlier ones that covered `at`.
    let fail = |log: &[(String, u64, u64)], op: String, at: u64, e: String| {
        let near: Vec<_> = log.iter().filter(|(_, o, n)| *o <= at && at < o + n).map(|(s, _, _)| s).collect();
        panic!("{what}: {op}: {e}\n  earlier requests covering {at:#x}: {near:?}")
    };

    let mut at = base;
    while at < base + w.sequential.min(len) {
        let n = (256 * KIB).min(base + w.sequential.min(len) - at);
        let data = pattern(w.seed ^ at, n as usize);
        let op = format!("write {at:#x}+{n:#x}");
        queue.write_at(at, &data).unwrap_or_else(|e| fail(&log, op.clone(), at, e.to_string()));
        reference.write_all_at(&data, at).unwrap();
        log.push((op, at, n));
        at += n;
    }

    let random_range = |rng: &mut Rng, max: u64| {
        let n = rng.sectors(512, max.min(len));
        (base + rng.below((len - n) / 512 + 1) * 512, n)
    };
    for i in 0..w.ops {
        let kind = rng.below(100);
        let (off, n, op) = match kind {
            // Writes, a third of them across a cluster boundary.
            0..52 => {
                let (mut off, n) = random_range(&mut rng, 256 * KIB);
                let n = n.max(4 * KIB);
                if rng.below(3) == 0 && len / w.cluster >= 2 {
                    let boundary = base + (1 + rng.below(len / w.cluster - 1)) * w.cluster;
                    off = boundary.saturating_sub(rng.sectors(512, n - 512));
                }
                let off = off.clamp(base, base + len - n);
                let data = pattern(w.seed * 100_003 + i as u64, n as usize);
                let op = format!("write {off:#x}+{n:#x}");
                queue.write_at(off, &data).unwrap_or_else(|e| fail(&log, op.clone(), off, e.to_string()));
                reference.write_all_at(&data, off).unwrap();
                (off, n, op)
            }
            52..64 => {
                let (off, n) = random_range(&mut rng, 256 * KIB);
                let mut got = vec![0u8; n as usize];
                let mut want = vec![0u8; n as usize];
                let op = format!("read {off:#x}+{n:#x}");
                queue.read_at(off, &mut got).unwrap_or_else(|e| fail(&log, op.clone(), off, e.to_string()));
                reference.read_exact_at(&mut want, off).unwrap();
                if let Some(diff) = describe_diff(&got, &want, off, ("vsd", "the reference")) {
                    let at = off + got.iter().zip(&want).position(|(a, b)| a != b).unwrap() as u64;
                    fail(&log, op, at, diff);
                }
                continue;
            }
            64..84 => {
                let (off, n) = random_range(&mut rng, 512 * KIB);
                let no_unmap = kind < 74;
                let op = format!("write_zeroes {off:#x}+{n:#x} no_unmap={no_unmap}");
                queue.write_zeroes(off, n, no_unmap).unwrap_or_else(|e| fail(&log, op.clone(), off, e.to_string()));
                zero_ref(off, n);
                (off, n, op)
            }
            84..96 if w.discard => {
                let (off, n) = if rng.below(2) == 0 {
                    let clusters = len / w.cluster;
                    let k = 1 + rng.below(8.min(clusters));
                    (base + rng.below(clusters - k + 1) * w.cluster, k * w.cluster)
                } else {
                    random_range(&mut rng, 512 * KIB)
                };
                let op = format!("discard {off:#x}+{n:#x}");
                queue.discard(off, n).unwrap_or_else(|e| fail(&log, op.clone(), off, e.to_string()));
                // Whole clusters read as zeroes afterwards, partial ones keep their data.
                let (start, end) = (off.next_multiple_of(w.cluster), (off + n) / w.cluster * w.cluster);
                if end > start {
                    zero_ref(start, end - start);
                }
                (off, n, op)
            }
            _ => {
                queue.flush().unwrap_or_else(|e| fail(&log, "flush".into(), base, e.to_string()));
                continue;
            }
        };
        log.push((op, off, n));
    }
    queue.flush().unwrap_or_else(|e| fail(&log, "final flush".into(), base, e.to_string()));
}

/// Runs `w` on two queues from two threads, each on its own half of the
/// disk, against the daemon and the raw `reference` file.
fn run_workload(daemon: &Daemon, reference: &Path, w: Workload, what: &str) {
    let size = std::fs::metadata(reference).unwrap().len();
    let mut client = daemon.connect(ClientOptions { num_queues: 2, ..Default::default() });
    assert_eq!(client.capacity().unwrap(), size, "{what}: capacity");
    let half = size / 2;
    assert_eq!(half % w.cluster, 0);
    let threads: Vec<_> = client
        .take_queues()
        .into_iter()
        .enumerate()
        .map(|(q, mut queue)| {
            let file = OpenOptions::new().read(true).write(true).open(reference).unwrap();
            let what = format!("{what}, queue {q}");
            let w = Workload { seed: w.seed * 2 + q as u64, ..w };
            std::thread::spawn(move || drive(&mut queue, &file, q as u64 * half, half, w, &what))
        })
        .collect();
    assert_eq!(threads.len(), 2);
    let failed = threads.into_iter().map(|t| t.join()).filter(Result::is_err).count();
    assert_eq!(failed, 0, "{what}: {failed} queue(s) failed, see above");
}

/// What a write case checks beyond `qemu-img check` and `compare`.
#[derive(Clone, Copy, Default)]
struct Extra {
    /// An internal snapshot that must read the same before and after.
    snapshot: Option<&'static str>,
    /// The raw external data file, which must equal the reference.
    raw_data_file: Option<&'static str>,
}

/// Builds an image, runs the workload through vsd and on a raw copy of
/// the image's contents, then has QEMU check and compare the two, and
/// reads everything back through a restarted vsd.
fn vsd_writes_qemu_checks(
    name: &str,
    cluster: u64,
    discard: bool,
    direct: bool,
    extra: Extra,
    build: impl FnOnce(&Scratch),
) {
    let what = format!("{name} (cache.direct={})", if direct { "on" } else { "off" });
    let dir = Scratch::new(&format!("q2w-{name}"));
    build(&dir);
    assert_check_clean(&dir, &format!("{what}: as made by QEMU"));
    qemu_img(&dir, &["convert", "-O", "raw", IMG, REFERENCE]);
    let snapshot_before = extra.snapshot.map(|s| {
        let out = format!("{s}-before.raw");
        qemu_img(&dir, &["convert", "-l", &format!("snapshot.name={s}"), "-O", "raw", IMG, &out]);
        out
    });

    let daemon = Daemon::vsd(&dir, &vsd_args(&dir, true, direct, 2));
    let workload = Workload { seed: cluster ^ name.len() as u64, ops: 160, cluster, discard, sequential: 0 };
    run_workload(&daemon, &dir.path(REFERENCE), workload, &what);
    let status = daemon.stop();
    assert!(status.success(), "{what}: vsd exited with {status}");

    assert_check_clean(&dir, &format!("{what}: after vsd wrote"));
    assert_compare_identical(&dir, REFERENCE, &format!("{what}: after vsd wrote"));
    if let (Some(s), Some(before)) = (extra.snapshot, snapshot_before) {
        let after = format!("{s}-after.raw");
        qemu_img(&dir, &["convert", "-l", &format!("snapshot.name={s}"), "-O", "raw", IMG, &after]);
        let (before, after) = (std::fs::read(dir.path(&before)).unwrap(), std::fs::read(dir.path(&after)).unwrap());
        if let Some(diff) = describe_diff(&after, &before, 0, ("the snapshot now", "the snapshot before")) {
            panic!("{what}: snapshot {s} changed while vsd wrote the active layer: {diff}");
        }
    }
    if let Some(data) = extra.raw_data_file {
        let (got, want) = (std::fs::read(dir.path(data)).unwrap(), std::fs::read(dir.path(REFERENCE)).unwrap());
        assert_eq!(got.len(), want.len(), "{what}: size of the raw data file {data}");
        if let Some(diff) = describe_diff(&got, &want, 0, (data, "the reference")) {
            panic!("{what}: the raw external data file {data} (data_file_raw=on) is not the disk's contents: {diff}");
        }
    }

    let daemon = Daemon::vsd(&dir, &vsd_args(&dir, true, direct, 2));
    assert_served_equals(&daemon, false, &dir.path(REFERENCE), &format!("{what}: read back after a restart"));
    let status = daemon.stop();
    assert!(status.success(), "{what}: vsd exited with {status} after the read-back");
    assert_check_clean(&dir, &format!("{what}: after the restart"));
}

#[test]
fn vsd_writes_v3_64k() {
    vsd_writes_qemu_checks("v3-64k", 64 * KIB, true, false, Extra::default(), |dir| {
        filled(dir, "compat=1.1,cluster_size=65536", 16 * MIB, 101)
    });
}

#[test]
fn vsd_writes_v2() {
    vsd_writes_qemu_checks("v2-64k", 64 * KIB, true, true, Extra::default(), |dir| {
        filled(dir, "compat=0.10", 16 * MIB, 102)
    });
}

#[test]
fn vsd_writes_512_byte_clusters() {
    vsd_writes_qemu_checks("v3-512", 512, true, false, Extra::default(), |dir| {
        filled(dir, "cluster_size=512", 8 * MIB, 103)
    });
}

#[test]
fn vsd_writes_extended_l2() {
    vsd_writes_qemu_checks("extl2-64k", 64 * KIB, true, true, Extra::default(), |dir| {
        extended_l2(dir, 64 * KIB, 16 * MIB)
    });
}

#[test]
fn vsd_writes_extended_l2_2m_clusters() {
    vsd_writes_qemu_checks("extl2-2M", 2 * MIB, true, false, Extra::default(), |dir| {
        extended_l2(dir, 2 * MIB, 32 * MIB)
    });
}

#[test]
fn vsd_writes_preallocated_metadata() {
    vsd_writes_qemu_checks("prealloc-metadata", 64 * KIB, true, true, Extra::default(), |dir| {
        filled(dir, "preallocation=metadata", 16 * MIB, 105)
    });
}

#[test]
fn vsd_writes_over_compressed_clusters() {
    for compression in ["zlib", "zstd"] {
        let direct = compression == "zstd";
        vsd_writes_qemu_checks(&format!("compressed-{compression}"), 64 * KIB, true, direct, Extra::default(), |dir| {
            compressed(dir, compression)
        });
    }
}

#[test]
fn vsd_writes_over_a_raw_backing_file() {
    vsd_writes_qemu_checks("backing", 64 * KIB, true, false, Extra::default(), over_raw_backing);
}

/// The extended-L2 top of a four-deep chain: copy-on-write reads from
/// every layer below.
#[test]
fn vsd_writes_over_a_backing_chain() {
    vsd_writes_qemu_checks("chain", 64 * KIB, true, true, Extra::default(), chain);
}

/// Writes straddling the end of a backing file smaller than the disk.
#[test]
fn vsd_writes_over_a_smaller_backing_file() {
    vsd_writes_qemu_checks("grown-backing", 64 * KIB, true, false, Extra::default(), grown_over_backing);
}

/// Version 2 over a backing file: no discards (they would reveal the
/// backing file's data).
#[test]
fn vsd_writes_v2_over_a_raw_backing_file() {
    vsd_writes_qemu_checks("v2-backing", 4 * KIB, false, true, Extra::default(), |dir| {
        let size = 16 * MIB;
        std::fs::write(dir.path("base.raw"), pattern(63, size as usize)).unwrap();
        create(dir, IMG, "compat=0.10,cluster_size=4096", Some(("base.raw", "raw")), None);
        qemu_io(dir, "qcow2", IMG, &io_script(dir, size, 64, 30));
    });
}

#[test]
fn vsd_writes_with_an_external_data_file() {
    vsd_writes_qemu_checks("datafile", 64 * KIB, true, true, Extra::default(), |dir| data_file(dir, false));
}

#[test]
fn vsd_writes_with_a_raw_external_data_file() {
    let extra = Extra { raw_data_file: Some("d.raw"), ..Extra::default() };
    vsd_writes_qemu_checks("datafile-raw", 64 * KIB, true, false, extra, |dir| data_file(dir, true));
}

/// The smallest case of the above: with `data_file_raw=on` the data file
/// must stay a raw image of the disk (qcow2 spec, autoclear bit 1), so
/// `qemu-img compare` of the image against its own data file must find
/// them identical after a discard, as it does after QEMU's discard.
#[test]
fn discard_keeps_a_raw_external_data_file_raw() {
    let dir = Scratch::new("q2-rawdiscard");
    let commands = ["write -q -P 0x5a 0 1M".to_string(), "discard -q 64k 128k".to_string()];
    create(&dir, "qemu.qcow2", "data_file=qemu-d.raw,data_file_raw=on", None, Some(4 * MIB));
    qemu_io(&dir, "qcow2", "qemu.qcow2", &commands);
    let (status, text) = tool(&dir, "qemu-img", &["compare", "-f", "qcow2", "-F", "raw", "qemu.qcow2", "qemu-d.raw"]);
    assert!(status.success(), "control: QEMU's own discard: qemu-img compare {status}: {text}");

    create(&dir, IMG, "data_file=d.raw,data_file_raw=on", None, Some(4 * MIB));
    let daemon = Daemon::vsd(&dir, &vsd_args(&dir, true, false, 1));
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    queue.write_at(0, &[0x5a; MIB as usize]).unwrap();
    queue.discard(64 * KIB, 128 * KIB).unwrap();
    queue.flush().unwrap();
    drop((queue, client));
    assert!(daemon.stop().success());
    assert_check_clean(&dir, "raw data file after a discard");
    assert_compare_identical(&dir, "d.raw", "qcow2 view vs its raw data file d.raw after a discard through vsd");
}

/// Clusters a discard freed are punched out of the file, then allocated
/// again while the image stays open, as QEMU does: rewriting a discarded
/// area elsewhere does not grow the file, QEMU finds no leak, and every
/// byte reads back as written.
#[test]
fn discarded_clusters_are_allocated_again_while_the_image_is_open() {
    let dir = Scratch::new("q2-reuse");
    create(&dir, IMG, "", None, Some(64 * MIB));
    let daemon = Daemon::vsd(&dir, &vsd_args(&dir, true, false, 1));
    let mut client = daemon.connect(ClientOptions::default());
    let mut queue = client.take_queue(0).unwrap();
    let first = pattern(1, 16 * MIB as usize);
    queue.write_at(0, &first).unwrap();
    queue.flush().unwrap();
    let grown = std::fs::metadata(dir.path(IMG)).unwrap().len();
    let allocated = || std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(dir.path(IMG)).unwrap()) * 512;
    let before = allocated();
    queue.discard(0, 16 * MIB).unwrap();
    queue.flush().unwrap();
    // pass-discard-request (on by default): the freed clusters are holes.
    assert!(allocated() + 15 * MIB <= before, "the file kept {} of {before} bytes", allocated());
    let second = pattern(2, 16 * MIB as usize);
    queue.write_at(32 * MIB, &second).unwrap();
    queue.flush().unwrap();
    drop((queue, client));
    assert!(daemon.stop().success());
    let len = std::fs::metadata(dir.path(IMG)).unwrap().len();
    assert!(len <= grown + MIB, "the file grew from {grown} to {len} bytes: freed clusters were not reused");
    assert_check_clean(&dir, "after rewriting discarded clusters");
    let mut want = vec![0u8; 64 * MIB as usize];
    want[32 * MIB as usize..48 * MIB as usize].copy_from_slice(&second);
    std::fs::write(dir.path(REFERENCE), &want).unwrap();
    assert_compare_identical(&dir, REFERENCE, "after rewriting discarded clusters");
}

#[test]
fn vsd_writes_keep_internal_snapshots() {
    let extra = Extra { snapshot: Some("s1"), ..Extra::default() };
    vsd_writes_qemu_checks("snapshot", 64 * KIB, true, true, extra, |dir| snapshots(dir, true));
}

#[test]
fn vsd_writes_with_1_bit_refcounts() {
    vsd_writes_qemu_checks("refcount1", 4 * KIB, true, false, Extra::default(), |dir| {
        filled(dir, "refcount_bits=1,cluster_size=4096", 16 * MIB, 104)
    });
}

/// Allocating writes in flight together: two queues at depth 32 write
/// 4 KiB blocks of the same fresh clusters at once (queue q the blocks
/// numbered q modulo 2, so no two requests share a byte), with every eighth
/// block zeroed instead, then write them all again in place. Requests wait
/// for allocations of their cluster in flight, on their own queue and on
/// the other: every write lands, no cluster leaks, and QEMU reads what a
/// raw reference got.
#[test]
fn allocating_writes_in_flight_together_on_shared_clusters() {
    let cases: Vec<(String, Box<dyn FnOnce() + '_>)> = vec![
        (
            "64 KiB clusters".into(),
            Box::new(|| allocations_in_flight("64k", false, |dir| create(dir, IMG, "", None, Some(8 * MIB)))),
        ),
        (
            "64 KiB clusters, O_DIRECT".into(),
            Box::new(|| allocations_in_flight("64k-direct", true, |dir| create(dir, IMG, "", None, Some(8 * MIB)))),
        ),
        (
            "over a raw backing file".into(),
            Box::new(|| {
                allocations_in_flight("backing", false, |dir| {
                    std::fs::write(dir.path("base.raw"), pattern(91, 8 * MIB as usize)).unwrap();
                    create(dir, IMG, "", Some(("base.raw", "raw")), None);
                })
            }),
        ),
        (
            "extended L2, 128 KiB clusters".into(),
            Box::new(|| {
                allocations_in_flight("extl2", false, |dir| {
                    create(dir, IMG, "extended_l2=on,cluster_size=131072", None, Some(8 * MIB))
                })
            }),
        ),
    ];
    run_cases(cases);
}

fn allocations_in_flight(name: &str, direct: bool, build: impl FnOnce(&Scratch)) {
    const BLOCK: u64 = 4 * KIB;
    const DEPTH: u64 = 32;
    let what = format!("allocations in flight, {name}");
    let dir = Scratch::new(&format!("q2-inflight-{name}"));
    build(&dir);
    qemu_img(&dir, &["convert", "-O", "raw", IMG, REFERENCE]);
    let daemon = Daemon::vsd(&dir, &vsd_args(&dir, true, direct, 2));
    let mut client = daemon.connect(ClientOptions { num_queues: 2, queue_size: Some(128), ..Default::default() });
    let rounds = 2 * MIB / (2 * DEPTH * BLOCK);
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
    let threads: Vec<_> = client
        .take_queues()
        .into_iter()
        .enumerate()
        .map(|(q, mut queue)| {
            let (reference, barrier, what) = (dir.path(REFERENCE), barrier.clone(), format!("{what}, queue {q}"));
            std::thread::spawn(move || {
                let reference = OpenOptions::new().write(true).open(reference).unwrap();
                // Started together, the queues go through the same clusters
                // at about the same pace.
                barrier.wait();
                // Twice over the same 2 MiB: allocations first, then overwrites in place.
                for pass in 0..2 {
                    for round in 0..rounds {
                        let window = round * 2 * DEPTH * BLOCK;
                        let mut rng = Rng::new(pass * 1000 + round * 10 + q as u64);
                        let mut blocks: Vec<u64> = (0..DEPTH).map(|i| window + (2 * i + q as u64) * BLOCK).collect();
                        for i in (1..blocks.len()).rev() {
                            blocks.swap(i, rng.below(i as u64 + 1) as usize);
                        }
                        let data: Vec<Vec<u8>> = blocks.iter().map(|&at| pattern(at ^ pass, BLOCK as usize)).collect();
                        let batch: Vec<BatchOp> = blocks
                            .iter()
                            .zip(&data)
                            .map(|(&at, data)| {
                                if at / BLOCK % 8 == 5 {
                                    BatchOp::WriteZeroes(at, BLOCK)
                                } else {
                                    BatchOp::Write(at, data)
                                }
                            })
                            .collect();
                        queue.run_batch(&batch).unwrap_or_else(|e| panic!("{what}: pass {pass} round {round}: {e}"));
                        for op in &batch {
                            match *op {
                                BatchOp::Write(at, data) => reference.write_all_at(data, at).unwrap(),
                                BatchOp::WriteZeroes(at, len) => {
                                    reference.write_all_at(&vec![0; len as usize], at).unwrap()
                                }
                                BatchOp::Read(..) | BatchOp::Flush => unreachable!("writes only"),
                            }
                        }
                    }
                }
                queue.flush().unwrap_or_else(|e| panic!("{what}: flush: {e}"));
            })
        })
        .collect();
    let failed = threads.into_iter().map(|t| t.join()).filter(Result::is_err).count();
    assert_eq!(failed, 0, "{what}: {failed} queue(s) failed, see above");
    drop(client);
    assert_served_equals(&daemon, false, &dir.path(REFERENCE), &what);
    assert!(daemon.stop().success(), "{what}: vsd exit status");
    assert_check_clean(&dir, &what);
    assert_compare_identical(&dir, REFERENCE, &what);
}

// ---------------------------------------------------------------------------
// 3. Growth, both ways

/// A 1 GiB disk with 512-byte clusters: each L2 table maps 32 KiB and each
/// refcount block 128 KiB of file, so vsd's writes allocate hundreds of L2
/// tables and outgrow the one-cluster refcount table. QEMU then checks,
/// compares and writes more; vsd reads all of it back and writes again.
#[test]
fn growth_past_the_first_l2_and_refcount_tables_both_ways() {
    let what = "1 GiB, 512-byte clusters";
    let dir = Scratch::new("q2-growth");
    let size = 1 << 30;
    create(&dir, IMG, "cluster_size=512", None, Some(size));
    qemu_io(&dir, "qcow2", IMG, &io_script(&dir, size, 111, 12));
    let refcount_table_clusters = header_u32(&dir, 56);
    assert_eq!(refcount_table_clusters, 1, "qemu-img made a bigger refcount table than expected");
    qemu_img(&dir, &["convert", "-O", "raw", IMG, REFERENCE]);

    // vsd writes: 4 MiB sequentially at the start of each half, then
    // scattered requests over the whole disk.
    let workload = Workload { seed: 112, ops: 150, cluster: 512, discard: true, sequential: 4 * MIB };
    let daemon = Daemon::vsd(&dir, &vsd_args(&dir, true, false, 2));
    run_workload(&daemon, &dir.path(REFERENCE), workload, &format!("{what}: vsd writes"));
    assert!(daemon.stop().success());
    let report = assert_check_clean(&dir, &format!("{what}: after vsd grew the image"));
    assert_compare_identical(&dir, REFERENCE, &format!("{what}: after vsd grew the image"));
    let file_len = std::fs::metadata(dir.path(IMG)).unwrap().len();
    assert!(
        header_u32(&dir, 56) > 1 && file_len > 8 * MIB,
        "the refcount table did not grow (file is {file_len} bytes): {report}"
    );

    // QEMU writes to the vsd-grown image, and the same to the reference
    // (a discard of whole 512-byte clusters reads as zeroes: a zero write
    // on the raw file).
    let commands = io_script(&dir, size, 113, 40);
    qemu_io(&dir, "qcow2", IMG, &commands);
    let raw_commands: Vec<String> = commands.iter().map(|c| c.replace("discard -q", "write -q -z")).collect();
    qemu_io(&dir, "raw", REFERENCE, &raw_commands);
    assert_check_clean(&dir, &format!("{what}: after QEMU wrote to the vsd-grown image"));
    assert_compare_identical(&dir, REFERENCE, &format!("{what}: after QEMU wrote to the vsd-grown image"));

    // vsd reads all of it, then writes again.
    let daemon = Daemon::vsd(&dir, &vsd_args(&dir, true, false, 2));
    assert_served_equals(&daemon, false, &dir.path(REFERENCE), &format!("{what}: vsd reads after QEMU wrote"));
    let workload = Workload { seed: 114, ops: 120, sequential: 0, ..workload };
    run_workload(&daemon, &dir.path(REFERENCE), workload, &format!("{what}: vsd writes again"));
    assert!(daemon.stop().success());
    assert_check_clean(&dir, &format!("{what}: after vsd wrote again"));
    assert_compare_identical(&dir, REFERENCE, &format!("{what}: after vsd wrote again"));
}

/// Random reads 32 at a time through a cache of two L2 tables, over an
/// image of 512 tables: nearly every read waits for a table, many for the
/// same one, more than a queue reads at once, and reads that span two
/// tables resume after the first; every byte must be QEMU's.
#[test]
fn reads_at_depth_wait_for_tables() {
    let what = "512-byte clusters, 2 L2 tables cached, 32 reads in flight";
    let dir = Scratch::new("q2r-table-loads");
    filled(&dir, "cluster_size=512", 16 * MIB, 121);
    qemu_img(&dir, &["convert", "-O", "raw", IMG, REFERENCE]);
    let reference = File::open(dir.path(REFERENCE)).unwrap();
    let mut args = vsd_args(&dir, false, false, 1);
    args[3].push_str(",l2-cache-size=1024");
    let daemon = Daemon::vsd(&dir, &args);
    let mut client = daemon.connect(ClientOptions { read_only: true, ..Default::default() });
    let mut queue = client.take_queue(0).unwrap();
    let mut rng = Rng::new(122);
    let mut want = vec![0u8; 8 * KIB as usize];
    for _ in 0..100 {
        let mut bufs: Vec<(u64, Vec<u8>)> =
            (0..32).map(|_| (rng.below(16 * MIB / 512 - 16) * 512, vec![0u8; 8 * KIB as usize])).collect();
        let mut reads: Vec<(u64, &mut [u8])> = bufs.iter_mut().map(|(at, buf)| (*at, &mut buf[..])).collect();
        queue.read_batch(&mut reads).unwrap_or_else(|e| panic!("{what}: {e}"));
        for (at, got) in &bufs {
            reference.read_exact_at(&mut want, *at).unwrap();
            if let Some(diff) = describe_diff(got, &want, *at, ("vsd", REFERENCE)) {
                panic!("{what}: {diff}");
            }
        }
    }
    drop(queue);
    drop(client);
    assert!(daemon.stop().success(), "{what}: vsd exit status");
}

/// A cache of two tables' worth of 4 KiB slices over an image of eight
/// 64 KiB tables: tables are loaded, changed and written back a slice at a
/// time, and evicted with some slices never loaded; QEMU still finds the
/// image clean and equal to the reference.
#[test]
fn vsd_writes_through_a_cache_of_table_slices() {
    let what = "64 KiB clusters, 8 L2 tables of 16 slices, 32 slices cached";
    let dir = Scratch::new("q2w-slices");
    filled(&dir, "cluster_size=65536", 4096 * MIB, 131);
    qemu_img(&dir, &["convert", "-O", "raw", IMG, REFERENCE]);
    let mut args = vsd_args(&dir, true, false, 2);
    args[3].push_str(",l2-cache-size=131072");
    let daemon = Daemon::vsd(&dir, &args);
    let workload = Workload { seed: 132, ops: 200, cluster: 65536, discard: true, sequential: 0 };
    run_workload(&daemon, &dir.path(REFERENCE), workload, what);
    assert!(daemon.stop().success(), "{what}: vsd exit status");
    assert_check_clean(&dir, what);
    assert_compare_identical(&dir, REFERENCE, what);
}

/// `l2-cache-entry-size` as QEMU takes it: whole tables at once read the
/// same bytes as the default slices, and a size that is not a power of two
/// between 512 and the cluster size is refused in QEMU's words.
#[test]
fn l2_cache_entry_size_is_qemus_option() {
    let dir = Scratch::new("q2r-entry-size");
    filled(&dir, "cluster_size=65536", 64 * MIB, 141);
    qemu_img(&dir, &["convert", "-O", "raw", IMG, "expected.raw"]);
    for entry in ["65536", "512"] {
        let what = format!("l2-cache-entry-size={entry}");
        let mut args = vsd_args(&dir, false, false, 1);
        args[3].push_str(&format!(",{what},l2-cache-size=131072"));
        let daemon = Daemon::vsd(&dir, &args);
        assert_served_equals(&daemon, true, &dir.path("expected.raw"), &what);
        assert!(daemon.stop().success(), "{what}: vsd exit status");
    }
    for entry in ["1000", "256", "131072"] {
        let mut args = vsd_args(&dir, false, false, 1);
        args[3].push_str(&format!(",l2-cache-entry-size={entry}"));
        let refused = common::vsd_fails(&args);
        assert!(
            refused.contains("L2 cache entry size must be a power of two between 512 and the cluster size (65536)"),
            "l2-cache-entry-size={entry}: {refused}"
        );
    }
}

/// Tiny caches that must evict all the time, and a cleaner that drops
/// unused entries every second in the middle of the workload: QEMU still
/// finds the image clean and equal to the reference.
#[test]
fn vsd_writes_with_tiny_caches_and_cache_cleaning() {
    let what = "512-byte clusters, 2 L2 tables and 2 refcount blocks cached, cleaned every second";
    let dir = Scratch::new("q2w-tiny-caches");
    filled(&dir, "cluster_size=512", 16 * MIB, 105);
    qemu_img(&dir, &["convert", "-O", "raw", IMG, REFERENCE]);
    let mut args = vsd_args(&dir, true, false, 2);
    args[3].push_str(",l2-cache-size=1024,refcount-cache-size=1024,cache-clean-interval=1");
    let daemon = Daemon::vsd(&dir, &args);
    for seed in [7, 8] {
        let workload = Workload { seed, ops: 160, cluster: 512, discard: true, sequential: 0 };
        run_workload(&daemon, &dir.path(REFERENCE), workload, what);
        std::thread::sleep(std::time::Duration::from_millis(1500));
    }
    assert!(daemon.stop().success(), "{what}: vsd exit status");
    assert_check_clean(&dir, what);
    assert_compare_identical(&dir, REFERENCE, what);
}
