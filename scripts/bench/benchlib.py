"""Shared by the benchmark studies (scripts/bench.py runs them): their
common flags, serving a block graph with vsd or qemu-storage-daemon pinned
to one CPU (0 by default), driving it with vsd-bench or fio pinned to the
other (1), medians, and the rows a run writes."""

import argparse
import glob
import json
import statistics
import os
import sys
import re
import subprocess
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def target_dir(argv):
    """The cargo target directory the binaries come from: --target-dir's,
    else $CARGO_TARGET_DIR, else the repository's. Read at import, before
    parsing, because studies import VSD and BENCH by name."""
    for i, arg in enumerate(argv):
        if arg == "--target-dir" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--target-dir="):
            return arg.split("=", 1)[1]
    return os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")


VSD = os.path.join(target_dir(sys.argv), "release", "vsd")
BENCH = os.path.join(target_dir(sys.argv), "release", "vsd-bench")
QSD = "qemu-storage-daemon"
TICK_US = 1e6 / os.sysconf("SC_CLK_TCK")
# The daemon's CPU and the client's (--cpus).
DAEMON_CPU, CLIENT_CPU = "0", "1"


def parser(doc, reps=3, seconds=5, peers=None, baseline=True, out=True):
    """The study's argument parser with the shared flags: --reps, --seconds
    (their defaults the study's), --peers (if the study has `peers`, a
    list of names), --baseline (if it can run an older vsd), --cpus,
    --target-dir and --out (if it writes rows)."""
    study = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    p = argparse.ArgumentParser(prog=f"scripts/bench.py run {study}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    shared = p.add_argument_group("shared flags")
    shared.add_argument("--reps", type=int, default=reps, help=f"repetitions, peers interleaved (default {reps})")
    shared.add_argument("--seconds", type=type(seconds), default=seconds, help=f"seconds per run (default {seconds})")
    if peers:
        shared.add_argument("--peers", type=lambda s: s.split(","), default=list(peers),
                            help=f"comma-separated, of: {', '.join(peers)} (default: all)")
    if baseline:
        shared.add_argument("--baseline", metavar="VSD", help="an older vsd binary, measured beside this one")
    shared.add_argument("--cpus", default="0/1", metavar="DAEMON/CLIENT", help="the CPUs to pin to (default 0/1)")
    shared.add_argument("--target-dir",
                        help="take vsd and vsd-bench from this cargo target directory's release build")
    if out:
        shared.add_argument("--out", metavar="ROWS.jsonl", help="append every run's row to this file")
    return p


def parse(p, argv=None):
    """Parses the command line and applies the shared flags."""
    global DAEMON_CPU, CLIENT_CPU
    args = p.parse_args(argv)
    if "/" not in args.cpus:
        p.error(f"--cpus {args.cpus}: expected DAEMON/CLIENT, e.g. 0/1")
    DAEMON_CPU, CLIENT_CPU = args.cpus.split("/", 1)
    for name in getattr(args, "peers", None) or ():
        if name not in p.get_default("peers") + (["base"] if getattr(args, "baseline", None) else []):
            p.error(f"no peer '{name}' (there are: {', '.join(p.get_default('peers'))})")
    return args


def pin(cpu):
    """The prefix that runs a program on `cpu`."""
    return ["taskset", "-c", cpu]


def median(rows, key):
    """The median of `key` over `rows`, None where no row has it."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def paired(num, den, key="iops"):
    """The median of the ratios of paired runs (rep by rep)."""
    return statistics.median(a[key] / b[key] for a, b in zip(num, den))


class Rows:
    """The rows of a run: each printed as JSON on stderr as it comes, and
    appended to `path` (--out) if one is given."""

    def __init__(self, path=None):
        self.all, self.file = [], open(path, "a") if path else None

    def add(self, **row):
        self.all.append(row)
        line = json.dumps(row)
        print(line, file=sys.stderr, flush=True)
        if self.file:
            print(line, file=self.file, flush=True)
        return row


def fio(args, cpu=None, env=None, wrapper=()):
    """fio's JSON report of a run with `args` pinned to `cpu` (the
    client's), under `wrapper` (e.g. setpriv); some engines print a line
    before the JSON."""
    out = subprocess.run([*pin(cpu or CLIENT_CPU), *wrapper, "fio", *args, "--output-format=json"], check=True,
                         capture_output=True, text=True, env=env).stdout
    return json.loads(out[out.index("{"):])


def clat_us(side, percentile):
    """A completion-latency percentile ("50", "99") of a fio job's side, in µs."""
    return side["clat_ns"]["percentile"][f"{percentile}.000000"] / 1000


def random_file(path, mib):
    """A file of `mib` MiB of random data: real data, not a hole (reads of a
    sparse tmpfs file skip the page cache)."""
    subprocess.run(["dd", "if=/dev/urandom", f"of={path}", "bs=1M", f"count={mib}", "status=none"], check=True)


def daemons(baseline=None, peers=None):
    """The daemons a comparison runs, by name: vsd, qemu-storage-daemon, and
    an earlier vsd binary as "base" if one is given; only `peers` if named."""
    programs = {"vsd": VSD, "qsd": QSD}
    if baseline:
        programs["base"] = baseline
    return {n: p for n, p in programs.items() if peers is None or n in peers or n == "base"}


def wait_started(daemon, pidfile, name, timeout=30):
    """Waits until `daemon` (a Popen) has written `pidfile`; fails if it
    exits first or takes over `timeout` seconds."""
    deadline = time.time() + timeout
    while not os.path.exists(pidfile):
        if daemon.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"{name} did not start")
        time.sleep(0.01)


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def thread_ticks(pid):
    """CPU ticks of each thread of `pid`, summed by thread name."""
    ticks = {}
    task_dir = f"/proc/{pid}/task"
    for tid in os.listdir(task_dir):
        try:
            with open(f"{task_dir}/{tid}/stat") as f:
                head, fields = f.read().rsplit(")", 1)
        except (FileNotFoundError, ProcessLookupError):
            # The thread ended meanwhile (its stat vanishes or fails to read).
            continue
        name = head.split("(", 1)[1]
        fields = fields.split()
        ticks[name] = ticks.get(name, 0) + int(fields[11]) + int(fields[12])
    return ticks


def monitor_args(workdir, qmp):
    """A QMP monitor's arguments if there are `qmp` commands to run, and its socket."""
    if not qmp:
        return [], None
    sock = os.path.join(workdir, "bench-qmp.sock")
    if os.path.exists(sock):
        os.unlink(sock)
    return ["--chardev", f"socket,id=bench-m,path={sock},server=on,wait=off", "--monitor", "chardev=bench-m"], sock


def run_qmp(sock, qmp):
    """Runs each (command, arguments) of `qmp` on the monitor at `sock`; any error is fatal."""
    if not qmp:
        return
    from qemu.qmp.legacy import QEMUMonitorProtocol
    monitor = QEMUMonitorProtocol(sock)
    monitor.connect()
    try:
        for command, arguments in qmp:
            reply = monitor.cmd_raw(command, arguments)
            if "error" in reply:
                raise RuntimeError(f"{command}: {reply['error']}")
    finally:
        monitor.close()


def serve_and_bench(program, blockdevs, bench_args, seconds, workdir, node="disk0", export_opts="", cpus=None,
                    qmp=(), extra_args=()):
    """Runs `program` with `blockdevs` (a list of --blockdev values), the
    `extra_args` (e.g. --object ...) and an export of `node` (plus
    `export_opts`, e.g. ",trace=off"), runs the `qmp` commands ((command,
    arguments) pairs), then vsd-bench with `bench_args` for `seconds`;
    `cpus` are the daemon's and the client's."""
    sock = os.path.join(workdir, "bench.sock")
    pidfile = os.path.join(workdir, "bench.pid")
    for path in (sock, pidfile):
        if os.path.exists(path):
            os.unlink(path)
    daemon_cpu, client_cpu = cpus or (DAEMON_CPU, CLIENT_CPU)
    args = [*pin(daemon_cpu), program, *extra_args]
    for blockdev in blockdevs:
        args += ["--blockdev", blockdev]
    monitor, qmp_sock = monitor_args(workdir, qmp)
    args += ["--export", f"type=vhost-user-blk,id=e0,node-name={node},addr.type=unix,addr.path={sock},writable=on{export_opts}",
             "--pidfile", pidfile, *monitor]
    daemon = subprocess.Popen(args)
    try:
        wait_started(daemon, pidfile, program, timeout=10)
        run_qmp(qmp_sock, qmp)
        before = cpu_ticks(daemon.pid)
        threads = {"first": {}, "last": {}, "seconds": 1.0}
        sampler = threading.Thread(target=sample_threads, args=(daemon.pid, seconds, threads))
        sampler.start()
        out = subprocess.run(
            [*pin(client_cpu), BENCH, "--socket", sock, *bench_args,
             "--seconds", str(seconds), "--ramp-seconds", "1", "--json"],
            check=True, capture_output=True, text=True, timeout=seconds + 60).stdout
        after = cpu_ticks(daemon.pid)
        sampler.join()
    finally:
        daemon.terminate()
        daemon.wait()
    res = json.loads(out)["results"]
    # The ramp second is not in `ios`, but its CPU is: count it in.
    ios_with_ramp = max(res["ios"], 1) * (seconds + 1) / seconds
    window_ios = max(res["iops"] * threads["seconds"], 1)
    return {"iops": res["iops"], "bw_mib_s": res["bw_mib_s"], "p50_us": res["lat_us"]["p50"],
            "p99_us": res["lat_us"]["p99"], "cpu_us_per_io": (after - before) * TICK_US / ios_with_ramp,
            "threads_cpu_us_per_io": {name: round((ticks - threads["first"].get(name, 0)) * TICK_US / window_ios, 2)
                                      for name, ticks in threads["last"].items()
                                      if ticks > threads["first"].get(name, 0)}}


def sample_threads(pid, seconds, out):
    """Each thread's CPU ticks of daemon `pid` (summed by name) at the end of
    the client's ramp second and shortly before its run ends, into `out`
    ("first", "last" and the "seconds" between): a thread that ends with
    the client's connection (a vhost-user queue's worker) is gone once the
    client exits."""
    try:
        time.sleep(1.1)
        start, first = time.monotonic(), thread_ticks(pid)
        time.sleep(max(seconds - 0.5, 0.1))
        last = thread_ticks(pid)
    except OSError:
        return  # the daemon is gone: the client's failure says why
    out.update(first=first, last=last, seconds=time.monotonic() - start)


def callgrind_worker(vsd, bench, work, name, blockdevs, bench_args, seconds, export_opts="", qmp=(), extra_args=(),
                     warmup=0):
    """`vsd` serving `blockdevs` (--blockdev values; the exported node is
    disk0, with `export_opts` such as ",trace=off", and `qmp` commands run
    first) under valgrind --tool=callgrind with one output file per thread, driven by `bench`
    (vsd-bench, with `bench_args`) for `seconds` without ramp, after
    `warmup` seconds of the same load whose instructions are not counted
    (callgrind_control --zero: what the first requests pay once, such as
    loading and checking tables, is left out). Returns the
    instructions per request of the busiest thread (the queue worker), the
    requests completed, and that thread's callgrind file, which stays in
    `work` (named after `name`) for callgrind_annotate."""
    sock, pidfile = os.path.join(work, "cg.sock"), os.path.join(work, "cg.pid")
    out = os.path.join(work, f"callgrind.{name}")
    for stale in glob.glob(out + ".*") + [sock, pidfile]:
        if os.path.exists(stale):
            os.unlink(stale)
    args = ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}.%p", vsd, *extra_args]
    for blockdev in blockdevs:
        args += ["--blockdev", blockdev]
    monitor, qmp_sock = monitor_args(work, qmp)
    args += ["--export", f"type=vhost-user-blk,id=e0,node-name=disk0,addr.type=unix,addr.path={sock},writable=on,"
             f"poll-us=0{export_opts}", "--pidfile", pidfile, *monitor]
    daemon = subprocess.Popen(args, stderr=subprocess.DEVNULL)
    try:
        wait_started(daemon, pidfile, "vsd under valgrind", timeout=60)
        run_qmp(qmp_sock, qmp)
        drive = [bench, "--socket", sock, *bench_args, "--ramp-seconds", "0", "--json", "--seconds"]
        if warmup > 0:
            subprocess.run(drive + [str(warmup)], check=True, capture_output=True)
            subprocess.run(["callgrind_control", "--zero", str(daemon.pid)], check=True, capture_output=True)
        res = json.loads(subprocess.run(drive + [str(seconds)], check=True, capture_output=True,
                                        text=True).stdout)["results"]
    finally:
        daemon.terminate()
        daemon.wait()
    counts = {}
    for path in glob.glob(out + ".*"):
        with open(path) as f:
            summary = re.search(r"^(?:summary|totals): (\d+)", f.read(), re.M)
        counts[path] = int(summary.group(1)) if summary else 0
    busiest = max(counts, key=counts.get)
    return counts[busiest] / max(res["ios"], 1), res["ios"], busiest


def print_on_off(rows, names, title):
    """The table of a job's cost to the guest: each daemon's IOPS without
    ("off") and with the job running ("on"), the median of the per-rep
    ratios, and the p99 latencies; `rows` carry daemon, side, rep, iops and
    p99_us."""
    med = lambda rs, k: statistics.median(r[k] for r in rs)
    print()
    print(title)
    print("| daemon | off IOPS | on IOPS | on/off (median of pairs) | off p99 µs | on p99 µs |")
    print("|---|---|---|---|---|---|")
    for name in names:
        side = lambda s: sorted((r for r in rows if (r["daemon"], r["side"]) == (name, s)), key=lambda r: r["rep"])
        off, on = side("off"), side("on")
        ratio = statistics.median(x["iops"] / y["iops"] for x, y in zip(on, off))
        print(f"| {name} | {med(off, 'iops'):.0f} | {med(on, 'iops'):.0f} | {ratio:.3f} "
              f"| {med(off, 'p99_us'):.0f} | {med(on, 'p99_us'):.0f} |")


def print_seconds(times, what, size_mib):
    """Each daemon's median seconds for `what` over `size_mib` MiB, and the rate."""
    print()
    print(f"| daemon | {what}: seconds | MiB/s |")
    print("|---|---|---|")
    for name, values in times.items():
        seconds = statistics.median(values)
        print(f"| {name} | {seconds:.2f} | {size_mib / seconds:.0f} |")


def job_seconds(program, blockdevs, work, command, arguments, until):
    """Seconds from QMP `command` to the event `until` on `program` serving
    `blockdevs` (pinned to the daemon's CPU, no guest I/O); a job that ends otherwise
    fails the run."""
    from qemu.qmp.legacy import QEMUMonitorProtocol

    qmp_sock, pidfile = os.path.join(work, "job-qmp.sock"), os.path.join(work, "job.pid")
    for path in (qmp_sock, pidfile):
        if os.path.exists(path):
            os.unlink(path)
    args = [*pin(DAEMON_CPU), program]
    for blockdev in blockdevs:
        args += ["--blockdev", blockdev]
    args += ["--chardev", f"socket,id=m,path={qmp_sock},server=on,wait=off", "--monitor", "chardev=m",
             "--pidfile", pidfile]
    daemon = subprocess.Popen(args)
    try:
        wait_started(daemon, pidfile, program)
        qmp = QEMUMonitorProtocol(qmp_sock)
        qmp.connect()
        start = time.monotonic()
        reply = qmp.cmd_raw(command, arguments)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        while True:
            event = qmp.pull_event(wait=120.0)
            if event is None:
                raise RuntimeError(f"no {until} within 120 s")
            if event["event"] == until:
                return time.monotonic() - start
            if event["event"] in ("BLOCK_JOB_COMPLETED", "BLOCK_JOB_CANCELLED"):
                raise RuntimeError(f"the job ended before {until}: {event}")
    finally:
        daemon.terminate()
        daemon.wait()
