#!/usr/bin/env python3
"""qcow2 with an L2 cache far smaller than the disk's tables: vsd against
qemu-storage-daemon, and against an earlier vsd build (--baseline), in one
run, interleaved, medians.

The image is a 64 GiB qcow2 (64 KiB clusters, preallocation=metadata: 8 MiB
of L2 tables, data clusters mapped but sparse) on tmpfs, served with
`l2-cache-size=1M` (16 of its 128 tables), so nearly every 4k random read
over the whole disk needs a table the cache lacks; `--warm` adds the same
reads with the default cache (all tables fit), the case the cold path must
not slow down. 4k randread at --iodepth (32), 1 queue, daemon on CPU 0,
vsd-bench on CPU 1.

Usage: scripts/bench.py run qcow2-cold [--seconds 5] [--reps 3] [--iodepth 32]
       [--baseline VSD] [--warm] [--target-dir DIR] [--out ROWS.jsonl]
Prints a Markdown table for BENCHMARKS.md.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

import benchlib
from benchlib import serve_and_bench


def blockdevs(image, cache):
    qcow2 = "driver=qcow2,node-name=disk0,file=file0"
    if cache:
        qcow2 += f",l2-cache-size={cache}"
    return [f"driver=file,node-name=file0,filename={image},aio=io_uring", qcow2]


def main():
    parser = benchlib.parser(__doc__, reps=3, seconds=5)
    parser.add_argument("--iodepth", type=int, default=32)
    parser.add_argument("--warm", action="store_true", help="also run with the default (whole-disk) L2 cache")
    opts = benchlib.parse(parser)
    programs = benchlib.daemons(opts.baseline)
    caches = {"cold (l2-cache-size=1M)": str(1 << 20)}
    if opts.warm:
        caches["warm (default cache)"] = None

    workdir = tempfile.mkdtemp(prefix="vsd-q2cold-", dir="/dev/shm")
    image = os.path.join(workdir, "disk.qcow2")
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-o", "preallocation=metadata", image, "64G"],
                   check=True)
    rows = {}
    out = open(opts.out, "a") if opts.out else None
    bench = ["--rw", "randread", "--bs", "4k", "--iodepth", str(opts.iodepth)]
    try:
        for rep in range(opts.reps):
            order = list(programs) if rep % 2 == 0 else list(reversed(programs))
            for case, cache in caches.items():
                for daemon in order:
                    result = serve_and_bench(programs[daemon], blockdevs(image, cache), bench, opts.seconds, workdir)
                    rows.setdefault((case, daemon), []).append(result)
                    line = {"rep": rep, "case": case, "daemon": daemon, **result}
                    print(json.dumps(line), file=sys.stderr)
                    if out:
                        print(json.dumps(line), file=out, flush=True)
    finally:
        subprocess.run(["rm", "-rf", workdir])

    print("| L2 cache | daemon | IOPS | p50 µs | p99 µs | CPU µs/IO | vs QSD |")
    print("|---|---|---|---|---|---|---|")
    for case in caches:
        qsd = statistics.median(r["iops"] for r in rows[(case, "qsd")])
        for daemon in programs:
            results = rows[(case, daemon)]
            iops = statistics.median(r["iops"] for r in results)
            med = lambda key: statistics.median(r[key] for r in results)  # noqa: E731
            print(f"| {case} | {daemon} | {iops:.0f} | {med('p50_us'):.0f} | {med('p99_us'):.0f} "
                  f"| {med('cpu_us_per_io'):.1f} | {iops / qsd:.2f}x |")


if __name__ == "__main__":
    main()
