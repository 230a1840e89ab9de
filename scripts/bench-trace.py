#!/usr/bin/env python3
"""What vsd's always-on request tracing costs: the same export with
trace=on and trace=off, A/B interleaved in one run, daemon pinned to CPU 0
and vsd-bench to CPU 1; medians of --reps runs and the median of the
paired on/off ratios.

usage: scripts/bench-trace.py [--seconds 5] [--reps 5] [--out ROWS.jsonl]
"""
import argparse
import json
import os
import statistics
import tempfile

from benchlib import VSD, serve_and_bench

BACKENDS = {
    "null-co": (["driver=null-co,node-name=disk0,size=1G"], None),
    "tmpfs raw": (["driver=file,node-name=file0,filename={image}", "driver=raw,node-name=disk0,file=file0"],
                  "/dev/shm"),
}
CASES = [("randread", 1), ("randread", 32)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
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
