#!/usr/bin/env python3
"""Lab script of 2026-11-27 (the 2026-11-27 entry (adfaea2), issue 23): RBD peers side by side
with each daemon thread's CPU and timeslices per I/O, sampled mid-run from
/proc/PID/task/*/schedstat (so the vhost-user queue's worker, which ends
with the client's connection, is counted). Rows in
2026-11-27-rbd-threads.txt; the findings are in BENCHMARKS.md.

usage: docs/bench/2026-11-27-rbd-threads.py REPS SECONDS 'NAME=SPEC|...' [WORKLOAD,...]

SPEC: PROGRAM[+VAR=VALUE...][:CONF LINES, ';'-separated][@EXPORT OPTIONS]
PROGRAM: vsd, qsd or a path. Examples:
  'qsd=qsd|vsd=vsd|thr1=vsd:librados_thread_count = 1|nopoll=vsd@,poll-us=0'
  'vsd=vsd|tcmalloc=vsd+LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4'
Daemon on CPU 0, client on CPU 1 (DCPU, CCPU override), as scripts/bench.py run rbd.
"""
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from benchlib import BENCH, QSD, VSD, wait_started  # noqa: E402

spec = importlib.util.spec_from_file_location("bench_rbd", os.path.join(ROOT, "scripts/bench.py run rbd"))
br = importlib.util.module_from_spec(spec)
spec.loader.exec_module(br)


def sched(pid):
    """Run time (ns) and timeslices of each thread, summed by name."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            run, _, slices = map(int, open(f"/proc/{pid}/task/{tid}/schedstat").read().split())
        except OSError:
            continue
        name = "vsd-worker" if name.startswith("vsd-e") else name
        entry = out.setdefault(name, [0, 0])
        entry[0] += run
        entry[1] += slices
    return out


def run(program, conf, rw, qd, seconds, work, export_opts, env):
    sock, pidfile = os.path.join(work, "b.sock"), os.path.join(work, "b.pid")
    for path in (sock, pidfile):
        if os.path.exists(path):
            os.unlink(path)
    node = f"driver=rbd,node-name=r0,pool=rbd,image={br.IMAGE},conf={conf}"
    export = f"type=vhost-user-blk,id=e0,node-name=disk0,addr.type=unix,addr.path={sock},writable=on{export_opts}"
    args = ["taskset", "-c", os.environ.get("DCPU", "0"), program, "--blockdev", node,
            "--blockdev", "driver=raw,node-name=disk0,file=r0", "--export", export, "--pidfile", pidfile]
    daemon = subprocess.Popen(args, env=dict(os.environ, **env))
    try:
        wait_started(daemon, pidfile, program, timeout=10)
        snaps = []

        def sampler():
            time.sleep(1.5)
            snaps.append((time.monotonic(), sched(daemon.pid)))
            time.sleep(seconds - 1.0)
            snaps.append((time.monotonic(), sched(daemon.pid)))
        thread = threading.Thread(target=sampler)
        thread.start()
        out = subprocess.run(["taskset", "-c", os.environ.get("CCPU", "1"), BENCH, "--socket", sock, "--rw", rw,
                              "--bs", "4k", "--iodepth", str(qd), "--seconds", str(seconds), "--ramp-seconds", "1",
                              "--json"], check=True, capture_output=True, text=True).stdout
        thread.join()
    finally:
        daemon.terminate()
        daemon.wait()
    res = json.loads(out)["results"]
    (t0, first), (t1, last) = snaps
    ios = res["iops"] * (t1 - t0)
    threads = {n: (round((last[n][0] - first.get(n, [0, 0])[0]) / 1000 / ios, 1),
                   round((last[n][1] - first.get(n, [0, 0])[1]) / ios, 2)) for n in last}
    threads = {n: v for n, v in threads.items() if v[0] > 0.2}
    return {"iops": res["iops"], "p50": res["lat_us"]["p50"], "cpu": round(sum(v[0] for v in threads.values()), 1),
            "threads": threads}


def parse(name, spec_text, base, work):
    spec_text, _, export_opts = spec_text.partition("@")
    spec_text, _, extra = spec_text.partition(":")
    program, *env = spec_text.split("+")
    conf = base
    if extra:
        conf = os.path.join(work, name + ".conf")
        with open(base) as src, open(conf, "w") as dst:
            dst.write(src.read().replace("[global]\n", "[global]\n" + extra.replace(";", "\n") + "\n", 1))
    program = {"vsd": VSD, "qsd": QSD}.get(program, program)
    return program, conf, export_opts, dict(e.split("=", 1) for e in env)


def main():
    reps, seconds = int(sys.argv[1]), int(sys.argv[2])
    variants = [v.split("=", 1) for v in sys.argv[3].split("|")]
    workloads = sys.argv[4].split(",") if len(sys.argv) > 4 else list(br.WORKLOADS)
    conf = subprocess.run([os.path.join(ROOT, "scripts/ceph.sh"), "start"], check=True, capture_output=True,
                          text=True).stdout.strip()
    subprocess.run(["rbd", "-c", conf, "rm", "--no-progress", br.IMAGE], capture_output=True)
    br.ceph(conf, "create", "--size", "1024M", br.IMAGE)
    br.ceph(conf, "bench", "--io-type", "write", "--io-size", "4M", "--io-total", "1024M", "--io-pattern", "seq",
            br.IMAGE)
    work = tempfile.mkdtemp(prefix="vsd-lab-rbd-")
    base = br.bench_conf(conf, work)
    peers = {name: parse(name, text, base, work) for name, text in variants}
    res = {(w, p): [] for w in workloads for p in peers}
    for rep in range(reps):
        order = list(peers) if rep % 2 == 0 else list(reversed(peers))
        for w in workloads:
            rw, qd = br.WORKLOADS[w]
            for p in order:
                r = run(*peers[p][:2], rw, qd, seconds, work, *peers[p][2:])
                res[(w, p)].append(r)
                print(f"rep{rep} {w} {p}: {json.dumps(r)}", flush=True)
    ref = variants[0][0]
    print(f"| workload | peer | IOPS | p50 µs | CPU µs/I/O | IOPS / {ref} | CPU / {ref} |")
    for w in workloads:
        ref_iops, ref_cpu = (statistics.median(x[k] for x in res[(w, ref)]) for k in ("iops", "cpu"))
        for p in peers:
            iops, cpu, p50 = (statistics.median(x[k] for x in res[(w, p)]) for k in ("iops", "cpu", "p50"))
            print(f"| {w} | {p} | {iops:.0f} | {p50:.0f} | {cpu:.1f} | {iops / ref_iops:.2f} | {cpu / ref_cpu:.2f} |")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
