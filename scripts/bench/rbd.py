#!/usr/bin/env python3
"""RBD side by side on the test cluster (scripts/ceph.sh): vsd and
qemu-storage-daemon serve the same RBD image over vhost-user-blk, pinned to
CPU 0, driven by vsd-bench (libblkio) from CPU 1; fio's rbd engine, pinned
to CPU 1, reads and writes the image with no daemon in between (the floor).
The OSD and the monitor are not pinned: on a 2-core machine they share
both cores with the rest, and their CPU per I/O is reported too.
Workloads: 4k random reads and writes at iodepth 1 and 32. Peers are
interleaved within each repetition; reported are medians.

`--workloads` and `--peers` pick by name; `--baseline PATH` adds another
vsd binary (another build), as "vsd-base".

usage: scripts/bench.py run rbd [--reps 3] [--seconds 5] [--workloads NAME,...]
                            [--peers vsd,vsd poll-us=0,qsd,fio-rbd] [--baseline PATH]
"""
import json
import os
import resource
import shutil
import statistics
import subprocess
import tempfile

import benchlib
from benchlib import QSD, ROOT, TICK_US, VSD, cpu_ticks, serve_and_bench

IMAGE = "vsd-bench"
IMAGE_MIB = 1024
WORKLOADS = {f"4k {rw} qd{qd}": (rw, qd) for rw in ("randread", "randwrite") for qd in (1, 32)}


def ceph(conf, *args):
    subprocess.run(["rbd", "-c", conf, *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def osd_pid(conf):
    with open(os.path.join(os.path.dirname(conf), "run", "osd.0.pid")) as f:
        return int(f.read())


def bench_conf(conf, work):
    """The cluster's ceph.conf, with librbd's cache in writeback from the
    start: by default it writes through until the client's first flush,
    which a guest sends within seconds and a benchmark client never."""
    path = os.path.join(work, "ceph.conf")
    with open(conf) as src, open(path, "w") as dst:
        dst.write(src.read().replace("[global]\n", "[global]\nrbd_cache_writethrough_until_flush = false\n", 1))
    return path


def daemon_run(program, conf, rw, qd, seconds, work, export_opts=""):
    node = f"driver=rbd,node-name=r0,pool=rbd,image={IMAGE},conf={conf}"
    return serve_and_bench(program, [node, "driver=raw,node-name=disk0,file=r0"],
                           ["--rw", rw, "--bs", "4k", "--iodepth", str(qd)], seconds, work, export_opts=export_opts)


def fio_run(conf, rw, qd, seconds):
    """fio's CPU is its own and librbd's threads', from the kernel's count."""
    env = dict(os.environ, CEPH_CONF=conf)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    fio = subprocess.Popen(
        [*benchlib.pin(benchlib.CLIENT_CPU), "fio", "--name=rbd", "--ioengine=rbd", "--clientname=admin", "--pool=rbd",
         f"--rbdname={IMAGE}", f"--rw={rw}", "--bs=4k", f"--iodepth={qd}", "--time_based", "--ramp_time=1",
         f"--runtime={seconds}", "--output-format=json"], env=env, stdout=subprocess.PIPE, text=True)
    out, _ = fio.communicate(timeout=seconds + 60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_us = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1e6
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["read"] if rw == "randread" else job["write"]
    # The ramp second's I/O is not in the count, but its CPU is.
    ios_with_ramp = max(side["total_ios"], 1) * (seconds + 1) / seconds
    return {"iops": side["iops"], "p50_us": side["clat_ns"]["percentile"]["50.000000"] / 1000,
            "cpu_us_per_io": cpu_us / ios_with_ramp}


def librbd_threads(res):
    """CPU per I/O of librbd's messenger and completion threads in a
    daemon's run (None for fio, whose threads are not told apart)."""
    threads = res.get("threads_cpu_us_per_io")
    if threads is None:
        return None
    return sum(us for name, us in threads.items() if name.startswith(("msgr-worker", "io_context_pool")))


def ratio(value, reference):
    return f"{value / reference:.2f}" if reference else "-"


def main():
    parser = benchlib.parser(__doc__, reps=3, seconds=5, out=False)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated names")
    parser.add_argument("--peers", help="comma-separated names (default: all)")
    args = benchlib.parse(parser)
    workloads = {name: WORKLOADS[name] for name in args.workloads.split(",")}
    conf = subprocess.run([os.path.join(ROOT, "scripts/ceph.sh"), "start"], check=True, capture_output=True,
                          text=True).stdout.strip()
    subprocess.run(["rbd", "-c", conf, "rm", "--no-progress", IMAGE], capture_output=True)
    ceph(conf, "create", "--size", f"{IMAGE_MIB}M", IMAGE)
    # Every object written, so that reads find data.
    ceph(conf, "bench", "--io-type", "write", "--io-size", "4M", "--io-total", f"{IMAGE_MIB}M",
         "--io-pattern", "seq", IMAGE)
    osd = osd_pid(conf)
    work = tempfile.mkdtemp(prefix="vsd-bench-rbd-")
    conf = bench_conf(conf, work)
    # vsd polls its ring for a while after a completion (its default); "vsd
    # poll-us=0" sleeps instead, as QSD's main loop does: what polling costs.
    peers = {"vsd": lambda rw, qd, work: daemon_run(VSD, conf, rw, qd, args.seconds, work),
             "vsd poll-us=0": lambda rw, qd, work: daemon_run(VSD, conf, rw, qd, args.seconds, work, ",poll-us=0"),
             "qsd": lambda rw, qd, work: daemon_run(QSD, conf, rw, qd, args.seconds, work),
             "fio-rbd": lambda rw, qd, work: fio_run(conf, rw, qd, args.seconds)}
    if args.baseline:
        peers["vsd-base"] = lambda rw, qd, work: daemon_run(args.baseline, conf, rw, qd, args.seconds, work)
    if args.peers:
        peers = {name: peers[name] for name in args.peers.split(",")}
    results = {(w, p): [] for w in workloads for p in peers}
    try:
        for rep in range(args.reps):
            order = list(peers) if rep % 2 == 0 else list(reversed(peers))
            for workload, (rw, qd) in workloads.items():
                for name in order:
                    before = cpu_ticks(osd)
                    res = peers[name](rw, qd, work)
                    ios = res["iops"] * args.seconds
                    res["osd_cpu_us_per_io"] = (cpu_ticks(osd) - before) * TICK_US / max(ios, 1)
                    results[(workload, name)].append(res)
                    print(f"rep {rep + 1} {workload} {name}: {json.dumps(res)}", flush=True)
    finally:
        shutil.rmtree(work)
    # Best effort: the last client's watch on the image may still be closing.
    subprocess.run(["rbd", "-c", conf, "rm", "--no-progress", IMAGE], capture_output=True)
    print("| workload | peer | IOPS | p50 µs | CPU µs/I/O | of which librbd threads | OSD CPU µs/I/O | IOPS / QSD "
          "| IOPS / fio-rbd | CPU / QSD |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for workload in workloads:
        med = {}
        for name in peers:
            runs = results[(workload, name)]
            med[name] = {k: statistics.median(r[k] for r in runs)
                         for k in ("iops", "p50_us", "cpu_us_per_io", "osd_cpu_us_per_io")}
            librbd = [us for us in map(librbd_threads, runs) if us is not None]
            med[name]["librbd"] = f"{statistics.median(librbd):.1f}" if librbd else "-"
        qsd, fio = med.get("qsd", {}), med.get("fio-rbd", {})
        for name, m in med.items():
            print(f"| {workload} | {name} | {m['iops']:.0f} | {m['p50_us']:.0f} | {m['cpu_us_per_io']:.1f} | "
                  f"{m['librbd']} | {m['osd_cpu_us_per_io']:.1f} | {ratio(m['iops'], qsd.get('iops'))} | "
                  f"{ratio(m['iops'], fio.get('iops'))} | {ratio(m['cpu_us_per_io'], qsd.get('cpu_us_per_io'))} |")


if __name__ == "__main__":
    main()
