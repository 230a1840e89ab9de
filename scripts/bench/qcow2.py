#!/usr/bin/env python3
"""qcow2 against raw in vsd, and vsd against qemu-storage-daemon on the
same qcow2 image, in one run, interleaved, medians.

Images are 1 GiB, fully allocated (preallocation=full), on tmpfs (page
cache, cache.direct=off) and on the disk (ext4, cache.direct=on).
4k randread and randwrite at iodepth 1 and 32, 1 queue; then first-write
throughput at iodepth 32 into an empty 8 GiB qcow2 image (64 KiB
clusters): sequential 64k writes, each allocating a whole cluster, and
random 4k writes, each allocating a cluster around 4 KiB of data. Daemon on
CPU 0, vsd-bench on CPU 1.

Usage: scripts/bench.py run qcow2 [--seconds 5] [--reps 3] [--out FILE.jsonl]
       [--disk-dir /var/tmp] [--places tmpfs,disk] [--cases randwrite:32,...]
       [--first-writes write:64k,randwrite:4k] [--no-first-write]
       [--baseline VSD] [--target-dir DIR]
       scripts/bench.py run qcow2 --report ROWS.jsonl
--cases '' runs the first writes alone; --baseline runs another vsd binary
(an earlier build) in the first-write interleave, as "base".

--fresh-images makes the raw and qcow2 images anew for every repetition.
On tmpfs where a file's pages happen to lie matters: a fresh copy of the
same raw image measured 0.83-0.96x the IOPS of the original on 4k writes
(more kernel time per write), more than qcow2 adds, so one pair of images
made once tilts every repetition the same way.
Prints Markdown tables for BENCHMARKS.md.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

import benchlib
from benchlib import QSD, serve_and_bench

SIZE = "1G"
FIRST_WRITE_SIZE = "8G"
TARGETS = [("vsd", "raw"), ("vsd", "qcow2"), ("qsd", "qcow2"), ("qsd", "raw")]
ALL_CASES = [(rw, depth) for rw in ("randread", "randwrite") for depth in (1, 32)]


def blockdevs(fmt, image, direct):
    cache = ",cache.direct=on" if direct else ""
    return [f"driver=file,node-name=file0,filename={image},aio=io_uring{cache}",
            f"driver={fmt},node-name=disk0,file=file0"]


def make_image(path, fmt, size, prealloc):
    subprocess.run(["qemu-img", "create", "-q", "-f", fmt, "-o", f"preallocation={prealloc}", path, size],
                   check=True)


def main():
    parser = benchlib.parser(__doc__, reps=3, seconds=5)
    parser.add_argument("--disk-dir", default="/var/tmp")
    parser.add_argument("--places", default="tmpfs,disk", help="comma-separated subset of tmpfs,disk")
    parser.add_argument("--cases", default=None,
                        help="comma-separated subset of RW:IODEPTH, e.g. randwrite:32,randread:32 (default: all four)")
    parser.add_argument("--no-first-write", action="store_true", help="skip the first-write runs")
    parser.add_argument("--first-writes", default="write:64k,randwrite:4k", help="comma-separated RW:BS")
    parser.add_argument("--fresh-images", action="store_true", help="new raw and qcow2 images for every repetition")
    parser.add_argument("--report", metavar="ROWS.jsonl", help="only print the tables of an earlier run")
    opts = benchlib.parse(parser)
    if opts.report:
        return report_file(opts.report)
    programs = {"vsd": benchlib.VSD, "qsd": QSD, "base": opts.baseline}
    cases = ALL_CASES
    if opts.cases is not None:
        cases = [(rw, int(depth)) for rw, depth in (c.split(":") for c in opts.cases.split(",") if c)]
    first_writes = [tuple(c.split(":")) for c in opts.first_writes.split(",")]
    writers = ["vsd", "qsd"] + (["base"] if opts.baseline else [])

    dirs = {"tmpfs": ("/dev/shm", False), "disk": (opts.disk_dir, True)}
    places = {p: (tempfile.mkdtemp(prefix="vsd-q2-", dir=dirs[p][0]), dirs[p][1]) for p in opts.places.split(",")}
    def make_images(formats):
        for workdir, _ in places.values():
            for fmt in formats:
                path = os.path.join(workdir, f"disk.{fmt}")
                if os.path.exists(path):
                    os.unlink(path)
                make_image(path, fmt, SIZE, "full")

    make_images(("raw", "qcow2"))
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
            if opts.fresh_images and rep > 0:
                make_images(("raw", "qcow2") if rep % 2 == 0 else ("qcow2", "raw"))
            for where, (workdir, direct) in places.items():
                for rw, depth in cases:
                    for daemon, fmt in targets:
                        image = os.path.join(workdir, f"disk.{fmt}")
                        bench = ["--rw", rw, "--bs", "4k", "--iodepth", str(depth)]
                        result = serve_and_bench(programs[daemon], blockdevs(fmt, image, direct), bench,
                                                 opts.seconds, workdir)
                        record((where, rw, depth, daemon, fmt), result, rep=rep, place=where, rw=rw,
                               iodepth=depth, daemon=daemon, format=fmt)
                if opts.no_first_write:
                    continue
                for rw, bs in first_writes:
                    for daemon in writers if rep % 2 == 0 else reversed(writers):
                        image = os.path.join(workdir, "fresh.qcow2")
                        make_image(image, "qcow2", FIRST_WRITE_SIZE, "off")
                        bench = ["--rw", rw, "--bs", bs, "--iodepth", "32"]
                        result = serve_and_bench(programs[daemon], blockdevs("qcow2", image, direct), bench,
                                                 opts.seconds, workdir)
                        os.unlink(image)
                        name = first_write_name(rw, bs)
                        record((where, name, daemon), result, rep=rep, place=where, rw=name, iodepth=32,
                               daemon=daemon, format="qcow2")
    finally:
        for workdir, _ in places.values():
            subprocess.run(["rm", "-rf", workdir])

    report(rows, list(places), cases)


def paired(rows, num, den, field="iops"):
    """Per-repetition ratios of neighbouring runs, and their median."""
    ratios = [a[field] / b[field] for a, b in zip(rows.get(num, []), rows.get(den, []))]
    return (statistics.median(ratios) if ratios else float("nan")), ratios


def report(rows, places, cases):
    def med(key, field="iops"):
        values = [r[field] for r in rows.get(key, [])]
        return statistics.median(values) if values else float("nan")

    print("Medians of IOPS (k):\n")
    print("| place | 4k | iodepth | vsd raw | vsd qcow2 | QSD qcow2 | QSD raw |")
    print("|---|---|---|---|---|---|---|")
    for where in places:
        for rw, depth in cases:
            cells = [med((where, rw, depth, d, f)) / 1000 for d, f in TARGETS]
            print(f"| {where} | {rw} | {depth} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    print("\nPaired ratios (median of the per-repetition ratios; per repetition in brackets):\n")
    print("| place | 4k | iodepth | vsd qcow2 / vsd raw | vsd qcow2 / QSD qcow2 | vsd raw / QSD raw |")
    print("|---|---|---|---|---|---|")
    for where in places:
        for rw, depth in cases:
            cells = []
            for num, den in ((("vsd", "qcow2"), ("vsd", "raw")), (("vsd", "qcow2"), ("qsd", "qcow2")),
                             (("vsd", "raw"), ("qsd", "raw"))):
                m, each = paired(rows, (where, rw, depth, *num), (where, rw, depth, *den))
                cells.append(f"{m:.2f} [" + " ".join(f"{x:.2f}" for x in each) + "]")
            print(f"| {where} | {rw} | {depth} | " + " | ".join(cells) + " |")
    names = sorted({key[1] for key in rows if key[1].startswith("first-write")})
    if not names:
        return
    base = any(key[2] == "base" for key in rows if len(key) == 3)
    print("\nFirst write into an empty qcow2 image, iodepth 32 (MiB/s per repetition, median):\n")
    print("| place | writes | vsd | QSD | vsd/QSD (paired median) |" + (" vsd (baseline) | vsd/baseline |" if base else ""))
    print("|---|---|---|---|---|" + ("---|---|" if base else ""))
    def each(key):
        return ", ".join(f"{r['bw_mib_s']:.0f}" for r in rows.get(key, []))

    for where in places:
        for name in names:
            v, q, b = (where, name, "vsd"), (where, name, "qsd"), (where, name, "base")
            ratio, _ = paired(rows, v, q, "bw_mib_s")
            line = (f"| {where} | {name[len('first-write '):]} | {each(v)} → **{med(v, 'bw_mib_s'):.0f}** "
                    f"| {each(q)} → **{med(q, 'bw_mib_s'):.0f}** | {ratio:.2f}x |")
            if base:
                line += f" {each(b)} → **{med(b, 'bw_mib_s'):.0f}** | {paired(rows, v, b, 'bw_mib_s')[0]:.2f}x |"
            print(line)


def first_write_name(rw, bs):
    """The row name of a first-write run; the first version of this script
    ran only sequential 64k writes, named "first-write 64k"."""
    return f"first-write {bs}" if rw == "write" else f"first-write {rw} {bs}"


def report_file(path):
    """Rebuilds the tables from a rows file written with --out."""
    rows, places, cases = {}, [], []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r["place"] not in places:
                places.append(r["place"])
            if r["rw"].startswith("first-write"):
                key = (r["place"], r["rw"], r["daemon"])
            else:
                key = (r["place"], r["rw"], r["iodepth"], r["daemon"], r["format"])
                if (r["rw"], r["iodepth"]) not in cases:
                    cases.append((r["rw"], r["iodepth"]))
            rows.setdefault(key, []).append(r)
    report(rows, places, sorted(cases))

if __name__ == "__main__":
    main()
