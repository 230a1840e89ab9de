#!/usr/bin/env python3
"""qcow2 against raw in vsd, and vsd against qemu-storage-daemon on the
same qcow2 image, in one run, interleaved, medians.

Images are 1 GiB, fully allocated (preallocation=full), on tmpfs (page
cache, cache.direct=off) and on the disk (ext4, cache.direct=on).
4k randread and randwrite at iodepth 1 and 32, 1 queue; then first-write
throughput: sequential 64k writes at iodepth 32 into an empty qcow2 image,
so every write allocates a cluster. Daemon on CPU 0, vsd-bench on CPU 1.

Usage: scripts/bench-qcow2.py [--seconds 5] [--reps 3] [--out FILE.jsonl]
       [--disk-dir /var/tmp] [--places tmpfs,disk]
Prints Markdown tables for BENCHMARKS.md.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import QSD, VSD, serve_and_bench  # noqa: E402

SIZE = "1G"
FIRST_WRITE_SIZE = "8G"
TARGETS = [("vsd", "raw"), ("vsd", "qcow2"), ("qsd", "qcow2"), ("qsd", "raw")]
PROGRAMS = {"vsd": VSD, "qsd": QSD}


def blockdevs(fmt, image, direct):
    cache = ",cache.direct=on" if direct else ""
    return [f"driver=file,node-name=file0,filename={image},aio=io_uring{cache}",
            f"driver={fmt},node-name=disk0,file=file0"]


def make_image(path, fmt, size, prealloc):
    subprocess.run(["qemu-img", "create", "-q", "-f", fmt, "-o", f"preallocation={prealloc}", path, size],
                   check=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--disk-dir", default="/var/tmp")
    parser.add_argument("--places", default="tmpfs,disk", help="comma-separated subset of tmpfs,disk")
    opts = parser.parse_args()

    dirs = {"tmpfs": ("/dev/shm", False), "disk": (opts.disk_dir, True)}
    places = {p: (tempfile.mkdtemp(prefix="vsd-q2-", dir=dirs[p][0]), dirs[p][1]) for p in opts.places.split(",")}
    for where, (workdir, _) in places.items():
        for fmt in ("raw", "qcow2"):
            make_image(os.path.join(workdir, f"disk.{fmt}"), fmt, SIZE, "full")
    cases = [(rw, depth) for rw in ("randread", "randwrite") for depth in (1, 32)]
    rows = {}
    out = open(opts.out, "a") if opts.out else None

    def record(key, result, **fields):
        rows.setdefault(key, []).append(result)
        line = {**fields, **result}
        print(json.dumps(line), file=sys.stderr)
        if out:
            print(json.dumps(line), file=out, flush=True)

    try:
        for rep in range(opts.reps):
            targets = TARGETS if rep % 2 == 0 else list(reversed(TARGETS))
            for where, (workdir, direct) in places.items():
                for rw, depth in cases:
                    for daemon, fmt in targets:
                        image = os.path.join(workdir, f"disk.{fmt}")
                        bench = ["--rw", rw, "--bs", "4k", "--iodepth", str(depth)]
                        result = serve_and_bench(PROGRAMS[daemon], blockdevs(fmt, image, direct), bench,
                                                 opts.seconds, workdir)
                        record((where, rw, depth, daemon, fmt), result, rep=rep, place=where, rw=rw,
                               iodepth=depth, daemon=daemon, format=fmt)
                for daemon in ("vsd", "qsd") if rep % 2 == 0 else ("qsd", "vsd"):
                    image = os.path.join(workdir, "fresh.qcow2")
                    make_image(image, "qcow2", FIRST_WRITE_SIZE, "off")
                    bench = ["--rw", "write", "--bs", "64k", "--iodepth", "32"]
                    result = serve_and_bench(PROGRAMS[daemon], blockdevs("qcow2", image, direct), bench,
                                             opts.seconds, workdir)
                    os.unlink(image)
                    record((where, "first-write", daemon), result, rep=rep, place=where, rw="first-write 64k",
                           iodepth=32, daemon=daemon, format="qcow2")
    finally:
        for workdir, _ in places.values():
            subprocess.run(["rm", "-rf", workdir])

    def med(key, field="iops"):
        values = [r[field] for r in rows.get(key, [])]
        return statistics.median(values) if values else float("nan")

    print("| place | 4k | iodepth | vsd raw | vsd qcow2 | qcow2/raw | QSD qcow2 | vsd/QSD qcow2 | QSD raw |")
    print("|---|---|---|---|---|---|---|---|---|")
    for where in places:
        for rw, depth in cases:
            vr, vq = med((where, rw, depth, "vsd", "raw")), med((where, rw, depth, "vsd", "qcow2"))
            qq, qr = med((where, rw, depth, "qsd", "qcow2")), med((where, rw, depth, "qsd", "raw"))
            print(f"| {where} | {rw} | {depth} | {vr / 1000:.1f}k | {vq / 1000:.1f}k | {vq / vr:.0%} "
                  f"| {qq / 1000:.1f}k | {vq / qq:.2f}x | {qr / 1000:.1f}k |")
    print()
    print("| place | first write, 64k seq, iodepth 32 | vsd MiB/s | QSD MiB/s | vsd/QSD |")
    print("|---|---|---|---|---|")
    for where in places:
        v, q = med((where, "first-write", "vsd"), "bw_mib_s"), med((where, "first-write", "qsd"), "bw_mib_s")
        print(f"| {where} | empty qcow2, 64k clusters | {v:.0f} | {q:.0f} | {v / q:.2f}x |")


if __name__ == "__main__":
    main()
