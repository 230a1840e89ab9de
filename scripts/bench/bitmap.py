#!/usr/bin/env python3
"""What a dirty bitmap costs the write path: 4k random writes through a
vhost-user-blk export of null-co and of a raw image on /dev/shm, without a
bitmap ("off") and with one made by `block-dirty-bitmap-add` before the run
("on", QEMU's default granularity: 64 KiB), for vsd and qemu-storage-daemon
in the same run, sides interleaved; daemon pinned to CPU 0, vsd-bench to
CPU 1. Medians of --reps runs and the median of the paired on/off ratios.
With --callgrind, also vsd's instructions per request on null-co at
iodepth 1 (repeatable): off, on at 64 KiB, on at 512 bytes (a new bit set
by almost every write).

usage: scripts/bench.py run bitmap [--seconds 3] [--reps 5] [--iodepths 1,32] [--callgrind]
"""
import json
import os
import statistics
import tempfile

import benchlib
from benchlib import BENCH, QSD, VSD, callgrind_worker, serve_and_bench

BACKENDS = {
    "null-co": ["driver=null-co,node-name=disk0,size=1073741824"],
    "tmpfs raw": ["driver=file,node-name=file0,filename={image}", "driver=raw,node-name=disk0,file=file0"],
}
DAEMONS = {"vsd": VSD, "qsd": QSD}


def bitmap(granularity=None):
    args = {"node": "disk0", "name": "bench"}
    if granularity:
        args["granularity"] = granularity
    return [("block-dirty-bitmap-add", args)]


def main():
    parser = benchlib.parser(__doc__, reps=5, seconds=3.0, baseline=False, out=False)
    parser.add_argument("--iodepths", default="1,32")
    parser.add_argument("--callgrind", action="store_true")
    args = benchlib.parse(parser)
    depths = [int(d) for d in args.iodepths.split(",")]
    rows = []
    image = f"/dev/shm/vsd-bench-bitmap-{os.getpid()}.img"
    benchlib.random_file(image, 1024)
    try:
        with tempfile.TemporaryDirectory() as work:
            for backend, blockdevs in BACKENDS.items():
                devs = [b.format(image=image) for b in blockdevs]
                for depth in depths:
                    for rep in range(args.reps):
                        sides = [(d, s) for d in DAEMONS for s in ("off", "on")]
                        if rep % 2:
                            sides.reverse()
                        for daemon, side in sides:
                            res = serve_and_bench(DAEMONS[daemon], devs, ["--rw", "randwrite", "--iodepth", str(depth)],
                                                  args.seconds, work, qmp=bitmap() if side == "on" else ())
                            row = {"backend": backend, "iodepth": depth, "daemon": daemon, "side": side, "rep": rep,
                                   **res}
                            rows.append(row)
                            print(json.dumps(row), flush=True)
            counts = {}
            if args.callgrind:
                for name, qmp in (("off", ()), ("on-64k", bitmap()), ("on-512", bitmap(512))):
                    per_io, ios, _ = callgrind_worker(VSD, BENCH, work, name, BACKENDS["null-co"],
                                                      ["--rw", "randwrite", "--iodepth", "1"], 5, qmp=qmp)
                    counts[name] = per_io
                    print(json.dumps({"callgrind": name, "instructions_per_io": per_io, "ios": ios}), flush=True)
    finally:
        os.unlink(image)
    print()
    print(f"4k randwrite, medians of {args.reps}; on = a 64 KiB dirty bitmap on the exported node")
    print("| back-end | iodepth | daemon | off IOPS | on IOPS | on/off (median of pairs) | off CPU µs/IO | on CPU µs/IO |")
    print("|---|---|---|---|---|---|---|---|")
    med = lambda rs, k: statistics.median(r[k] for r in rs)
    for backend in BACKENDS:
        for depth in depths:
            for daemon in DAEMONS:
                case = [r for r in rows if (r["backend"], r["iodepth"], r["daemon"]) == (backend, depth, daemon)]
                off = sorted((r for r in case if r["side"] == "off"), key=lambda r: r["rep"])
                on = sorted((r for r in case if r["side"] == "on"), key=lambda r: r["rep"])
                ratio = statistics.median(x["iops"] / y["iops"] for x, y in zip(on, off))
                print(f"| {backend} | {depth} | {daemon} | {med(off, 'iops'):.0f} | {med(on, 'iops'):.0f} "
                      f"| {ratio:.3f} | {med(off, 'cpu_us_per_io'):.2f} | {med(on, 'cpu_us_per_io'):.2f} |")
    if counts:
        print()
        print("| vsd, null-co, randwrite qd1 | instructions per request (worker thread) |")
        print("|---|---|")
        for name, per_io in counts.items():
            print(f"| {name} | {per_io:.0f} |")


if __name__ == "__main__":
    main()
