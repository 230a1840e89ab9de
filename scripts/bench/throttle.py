#!/usr/bin/env python3
"""I/O limits: how close vsd's throttle groups keep to their limit, and
what a throttle node costs when its group has no limit.

1. 4k random reads through `driver=throttle` over null-co, limits of
   --iops IOPS (`iops-total`) and --mib MiB/s (`bps-total`, 64k reads),
   at iodepth 1, 16 and 64, for vsd and qemu-storage-daemon in the same
   run, interleaved; daemon pinned to CPU 0, vsd-bench to CPU 1. Reported:
   what the client got as a share of the limit (medians of --reps).
2. vsd's instructions per request (callgrind, repeatable) of 4k random
   reads on null-co at iodepth 1 and 32, straight and through a throttle
   node whose group has no limit.

usage: scripts/bench.py run throttle [--seconds 5] [--reps 3] [--iops 5000] [--mib 50]
"""
import json
import statistics
import tempfile

import benchlib
from benchlib import BENCH, QSD, VSD, callgrind_worker, serve_and_bench

NULL = "driver=null-co,node-name=n0,size=1073741824"
THROTTLED = [NULL, "driver=throttle,node-name=disk0,throttle-group=tg0,file=n0"]


def group(limits):
    return ["--object", "throttle-group,id=tg0," + ",".join(f"limits.{k}={v}" for k, v in limits.items())]


def main():
    parser = benchlib.parser(__doc__, reps=3, seconds=5.0, baseline=False, out=False)
    parser.add_argument("--iops", type=int, default=5000)
    parser.add_argument("--mib", type=int, default=50)
    args = benchlib.parse(parser)
    cases = [("iops-total", args.iops, "4k", "iops"), ("bps-total", args.mib << 20, "64k", "bw_mib_s")]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for limit, value, bs, measure in cases:
            want = value if measure == "iops" else value / (1 << 20)
            for depth in (1, 16, 64):
                for rep in range(args.reps):
                    daemons = [("vsd", VSD), ("qsd", QSD)]
                    for name, program in daemons if rep % 2 == 0 else reversed(daemons):
                        res = serve_and_bench(program, THROTTLED, ["--rw", "randread", "--bs", bs, "--iodepth", str(depth)],
                                              args.seconds, work, extra_args=group({limit: value}))
                        row = {"limit": limit, "value": want, "iodepth": depth, "daemon": name, "rep": rep,
                               "got": res[measure], "share": res[measure] / want, "cpu_us_per_io": res["cpu_us_per_io"]}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        counts = {}
        for depth in (1, 32):
            for name, blockdevs, extra in (("straight", [NULL.replace("n0", "disk0")], ()),
                                           ("unlimited throttle", THROTTLED, group({}))):
                per_io, ios, _ = callgrind_worker(VSD, BENCH, work, name.replace(" ", "-"), blockdevs,
                                                  ["--rw", "randread", "--iodepth", str(depth)], 5, extra_args=extra)
                counts[(name, depth)] = per_io
                print(json.dumps({"callgrind": name, "iodepth": depth, "instructions_per_io": per_io, "ios": ios}),
                      flush=True)
    print()
    print(f"Share of the limit the client got (medians of {args.reps}, {args.seconds:g} s runs, the first"
          " tenth of a second's burst included)")
    print("| limit | bs | iodepth | vsd | QSD | vsd CPU µs/IO | QSD CPU µs/IO |")
    print("|---|---|---|---|---|---|---|")
    med = lambda rs, k: statistics.median(r[k] for r in rs)
    for limit, value, bs, measure in cases:
        for depth in (1, 16, 64):
            case = lambda d: [r for r in rows if (r["limit"], r["iodepth"], r["daemon"]) == (limit, depth, d)]
            shown = f"{value} IOPS" if measure == "iops" else f"{value >> 20} MiB/s"
            print(f"| {limit} {shown} | {bs} | {depth} | {med(case('vsd'), 'share'):.3f} | {med(case('qsd'), 'share'):.3f} "
                  f"| {med(case('vsd'), 'cpu_us_per_io'):.2f} | {med(case('qsd'), 'cpu_us_per_io'):.2f} |")
    print()
    print("| vsd, null-co, randread | iodepth | instructions per request (worker thread) |")
    print("|---|---|---|")
    for (name, depth), per_io in counts.items():
        print(f"| {name} | {depth} | {per_io:.0f} |")


if __name__ == "__main__":
    main()
