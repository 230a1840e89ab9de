#!/usr/bin/env python3
"""What vsd's always-on request tracing costs: the same export with
trace=on and trace=off, A/B interleaved in one run, daemon pinned to CPU 0
and vsd-bench to CPU 1; medians of --reps runs and the median of the
paired on/off ratios.

usage: scripts/bench-trace.py [--seconds 5] [--reps 5] [--out ROWS.jsonl]
       scripts/bench-trace.py --callgrind [--seconds 20]

--callgrind counts instructions instead, which this machine repeats
exactly where its IOPS do not: vsd runs under valgrind --tool=callgrind
with one output file per thread, and the queue worker's instructions are
divided by the requests the client completed (null-co, no ramp).
"""
import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import tempfile
import time

from benchlib import BENCH, VSD, serve_and_bench

BACKENDS = {
    "null-co": (["driver=null-co,node-name=disk0,size=1G"], None),
    "tmpfs raw": (["driver=file,node-name=file0,filename={image}", "driver=raw,node-name=disk0,file=file0"],
                  "/dev/shm"),
}
CASES = [("randread", 1), ("randread", 32)]


def worker_instructions(work, trace, depth, seconds):
    """Instructions per request of the busiest vsd thread (the queue
    worker) under callgrind, and the requests counted."""
    sock, pidfile = os.path.join(work, "cg.sock"), os.path.join(work, "cg.pid")
    out = os.path.join(work, f"callgrind.{trace}.{depth}")
    for path in glob.glob(out + "*") + [sock, pidfile]:
        if os.path.exists(path):
            os.unlink(path)
    daemon = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}.%p",
         VSD, "--blockdev", "driver=null-co,node-name=disk0,size=1G",
         "--export", f"type=vhost-user-blk,id=e0,node-name=disk0,addr.type=unix,addr.path={sock},trace={trace}",
         "--pidfile", pidfile], stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while not os.path.exists(pidfile):
            if daemon.poll() is not None or time.time() > deadline:
                raise RuntimeError("vsd under valgrind did not start")
            time.sleep(0.1)
        res = json.loads(subprocess.run(
            [BENCH, "--socket", sock, "--rw", "randread", "--iodepth", str(depth), "--seconds", str(seconds),
             "--ramp-seconds", "0", "--json"], check=True, capture_output=True, text=True).stdout)["results"]
    finally:
        daemon.terminate()
        daemon.wait()
    counts = []
    for path in glob.glob(out + ".*"):
        with open(path) as f:
            summary = re.search(r"^(?:summary|totals): (\d+)", f.read(), re.M)
        counts.append(int(summary.group(1)) if summary else 0)
    return max(counts) / max(res["ios"], 1), res["ios"]


def callgrind(seconds):
    print("| iodepth | trace=on instr/request | trace=off instr/request | on - off | requests on, off |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        for depth in (1, 32):
            on, n_on = worker_instructions(work, "on", depth, seconds)
            off, n_off = worker_instructions(work, "off", depth, seconds)
            print(f"| {depth} | {on:.0f} | {off:.0f} | {on - off:+.0f} ({100 * (on - off) / off:+.1f}%) "
                  f"| {n_on}, {n_off} |", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out")
    parser.add_argument("--callgrind", action="store_true")
    args = parser.parse_args()
    if args.callgrind:
        callgrind(args.seconds)
        return
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for backend, (blockdevs, image_dir) in BACKENDS.items():
            image = None
            if image_dir:
                image = os.path.join(image_dir, f"vsd-bench-trace-{os.getpid()}.img")
                with open(image, "wb") as f:
                    f.truncate(1 << 30)
            try:
                devs = [b.format(image=image) for b in blockdevs]
                for rw, depth in CASES:
                    for rep in range(args.reps):
                        for trace in ("on", "off"):
                            res = serve_and_bench(VSD, devs, ["--rw", rw, "--iodepth", str(depth)], args.seconds,
                                                  work, export_opts=f",trace={trace}")
                            row = {"backend": backend, "rw": rw, "iodepth": depth, "trace": trace, "rep": rep, **res}
                            rows.append(row)
                            print(json.dumps(row), flush=True)
            finally:
                if image:
                    os.unlink(image)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print()
    print("| back-end | rw | iodepth | trace=on IOPS | trace=off IOPS | on/off (median of pairs) | CPU µs/IO on | off |")
    print("|---|---|---|---|---|---|---|---|")
    for backend in BACKENDS:
        for rw, depth in CASES:
            case = [r for r in rows if (r["backend"], r["rw"], r["iodepth"]) == (backend, rw, depth)]
            on = [r for r in case if r["trace"] == "on"]
            off = [r for r in case if r["trace"] == "off"]
            ratio = statistics.median(a["iops"] / b["iops"] for a, b in zip(on, off))
            med = lambda rs, k: statistics.median(r[k] for r in rs)
            print(f"| {backend} | {rw} | {depth} | {med(on, 'iops'):.0f} | {med(off, 'iops'):.0f} | {ratio:.3f} "
                  f"| {med(on, 'cpu_us_per_io'):.2f} | {med(off, 'cpu_us_per_io'):.2f} |")


if __name__ == "__main__":
    main()
