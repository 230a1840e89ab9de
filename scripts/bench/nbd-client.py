#!/usr/bin/env python3
"""The NBD client driver side by side: vsd and qemu-storage-daemon each
serve, over vhost-user-blk, a `driver=nbd` node on the same nbdkit export
(the memory plugin, 1 GiB). The daemon is pinned to CPU 0; vsd-bench
(libblkio) and nbdkit share CPU 1. Workloads: 4k random reads at iodepth 1
and 32, 4k random writes at iodepth 32. Peers are interleaved within each
repetition; reported are medians, and the daemon's CPU per I/O. With
--baseline, an earlier vsd binary runs as a third peer, "base".
--callgrind instead counts the instructions per request of vsd's busiest
thread (the client's connection thread; and the baseline's), 4k random
reads and writes at iodepth 8: repeatable where IOPS here are not.

usage: scripts/bench.py run nbd-client [--reps 3] [--seconds 5] [--target-dir DIR] [--baseline VSD] [--callgrind]
"""
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import benchlib

WORKLOADS = {"4k randread qd1": ("randread", 1), "4k randread qd32": ("randread", 32),
             "4k randwrite qd32": ("randwrite", 32)}


def start_nbdkit(work):
    sock = os.path.join(work, "kit.sock")
    kit = subprocess.Popen([*benchlib.pin(benchlib.CLIENT_CPU), "nbdkit", "-f", "-U", sock, "memory", "1G"])
    deadline = time.time() + 10
    while not os.path.exists(sock):
        if kit.poll() is not None or time.time() > deadline:
            raise RuntimeError("nbdkit did not start")
        time.sleep(0.01)
    return kit, sock


def main():
    parser = benchlib.parser(__doc__, reps=3, seconds=5, out=False)
    parser.add_argument("--callgrind", action="store_true", help="instructions per request instead of IOPS")
    args = benchlib.parse(parser)
    work = tempfile.mkdtemp(prefix="vsd-bench-nbdc-")
    kit, sock = start_nbdkit(work)
    node = f"driver=nbd,node-name=n0,server.type=unix,server.path={sock}"
    peers = benchlib.daemons(args.baseline)
    blockdevs = [node, "driver=raw,node-name=disk0,file=n0"]
    if args.callgrind:
        try:
            count_instructions(peers, blockdevs, work)
        finally:
            kit.terminate()
            kit.wait()
            shutil.rmtree(work)
        return
    results = {(w, p): [] for w in WORKLOADS for p in peers}
    try:
        for rep in range(args.reps):
            order = list(peers) if rep % 2 == 0 else list(reversed(peers))
            for workload, (rw, qd) in WORKLOADS.items():
                for name in order:
                    res = benchlib.serve_and_bench(peers[name], blockdevs,
                                                   ["--rw", rw, "--bs", "4k", "--iodepth", str(qd)], args.seconds, work)
                    results[(workload, name)].append(res)
                    print(f"rep {rep + 1} {workload} {name}: {json.dumps(res)}", flush=True)
    finally:
        kit.terminate()
        kit.wait()
        shutil.rmtree(work)
    print("| workload | peer | IOPS | p50 µs | p99 µs | CPU µs/I/O | IOPS / QSD | CPU / QSD |")
    print("|---|---|---|---|---|---|---|---|")
    for workload in WORKLOADS:
        med = {p: {k: statistics.median(r[k] for r in results[(workload, p)])
                   for k in ("iops", "p50_us", "p99_us", "cpu_us_per_io")} for p in peers}
        for name, m in med.items():
            print(f"| {workload} | {name} | {m['iops']:.0f} | {m['p50_us']:.0f} | {m['p99_us']:.0f} | "
                  f"{m['cpu_us_per_io']:.1f} | {m['iops'] / med['qsd']['iops']:.2f} | "
                  f"{m['cpu_us_per_io'] / med['qsd']['cpu_us_per_io']:.2f} |")


def count_instructions(peers, blockdevs, work):
    print("| vsd | 4k, iodepth 8 | instructions per request (busiest thread) |")
    print("|---|---|---|")
    for name in (p for p in peers if p != "qsd"):
        for rw in ("randread", "randwrite"):
            per_io, _, _ = benchlib.callgrind_worker(peers[name], benchlib.BENCH, work, f"{name}-{rw}", blockdevs,
                                                     ["--rw", rw, "--iodepth", "8"], 4)
            print(f"| {name} | {rw} | {per_io:.0f} |", flush=True)


if __name__ == "__main__":
    main()
