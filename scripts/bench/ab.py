#!/usr/bin/env python3
"""Two settings of a vsd export, A/B interleaved in one run: the same
export with option string A and with B (e.g. `trace=on` vs `trace=off`,
`poll-us=50` vs `poll-us=0`), with daemon arguments on one side
(`--a-args "--sandbox on"`), or through a filter node on one side
(`--a-filter throttle`: a throttle node whose group has no limits),
daemon pinned to CPU 0 and vsd-bench to CPU 1; medians of --reps runs and
the median of the paired A/B ratios.

usage: scripts/bench.py run ab [--a OPTS] [--b OPTS] [--a-args ARGS] [--b-args ARGS]
                           [--a-filter throttle] [--b-filter throttle]
                           [--seconds 3] [--reps 10] [--iodepths 1,32]
                           [--target-dir DIR] [--out ROWS.jsonl]
"""
import json
import os
import shlex
import statistics
import tempfile

import benchlib

BACKENDS = {
    "null-co": (["driver=null-co,node-name=disk0,size=1G"], None),
    "tmpfs raw": (["driver=file,node-name=file0,filename={image}", "driver=raw,node-name=disk0,file=file0"],
                  "/dev/shm"),
}

# What a side adds over the back-end: (--object values, --blockdev values,
# the node exported).
FILTERS = {
    "none": ([], [], "disk0"),
    "throttle": (["throttle-group,id=tg0"], ["driver=throttle,node-name=thr0,throttle-group=tg0,file=disk0"], "thr0"),
}


def main():
    parser = benchlib.parser(__doc__, reps=10, seconds=3.0, baseline=False)
    parser.add_argument("--a", default="", help="export options of A, e.g. trace=on")
    parser.add_argument("--b", default="", help="export options of B, e.g. trace=off")
    parser.add_argument("--a-args", default="", help='daemon arguments of A, e.g. "--sandbox on"')
    parser.add_argument("--b-args", default="", help="daemon arguments of B")
    parser.add_argument("--a-filter", choices=FILTERS, default="none", help="a filter node A exports")
    parser.add_argument("--b-filter", choices=FILTERS, default="none", help="a filter node B exports")
    parser.add_argument("--iodepths", default="1,32")
    args = benchlib.parse(parser)
    depths = [int(d) for d in args.iodepths.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for backend, (blockdevs, image_dir) in BACKENDS.items():
            image = None
            if image_dir:
                image = os.path.join(image_dir, f"vsd-bench-ab-{os.getpid()}.img")
                benchlib.random_file(image, 1024)
            try:
                devs = [b.format(image=image) for b in blockdevs]
                for depth in depths:
                    for rep in range(args.reps):
                        # Alternate which side goes first.
                        order = ("a", "b") if rep % 2 == 0 else ("b", "a")
                        for side in order:
                            opts = getattr(args, side)
                            filt = getattr(args, f"{side}_filter")
                            objects, filters, node = FILTERS[filt]
                            daemon_args = shlex.split(getattr(args, f"{side}_args"))
                            res = benchlib.serve_and_bench(benchlib.VSD, devs + filters, ["--rw", "randread", "--iodepth", str(depth)],
                                                  args.seconds, work, node=node,
                                                  export_opts="," + opts if opts else "",
                                                  extra_args=[a for o in objects for a in ("--object", o)]
                                                  + daemon_args)
                            row = {"backend": backend, "rw": "randread", "iodepth": depth, "side": side,
                                   "options": opts, "args": daemon_args, "filter": filt, "rep": rep, **res}
                            rows.append(row)
                            print(json.dumps(row), flush=True)
            finally:
                if image:
                    os.unlink(image)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print()
    def side(opts, extra, filt):
        return " ".join(x for x in (opts, extra, f"through {filt}" if filt != "none" else "") if x) or "default"
    print(f"A = {side(args.a, args.a_args, args.a_filter)}, B = {side(args.b, args.b_args, args.b_filter)}; "
          f"4k randread, medians of {args.reps}")
    print("| back-end | iodepth | A IOPS | B IOPS | A/B (median of pairs) | A p50 µs | B p50 µs "
          "| A CPU µs/IO | B CPU µs/IO |")
    print("|---|---|---|---|---|---|---|---|---|")
    med = lambda rs, k: statistics.median(r[k] for r in rs)
    for backend in BACKENDS:
        for depth in depths:
            case = [r for r in rows if (r["backend"], r["iodepth"]) == (backend, depth)]
            a = sorted((r for r in case if r["side"] == "a"), key=lambda r: r["rep"])
            b = sorted((r for r in case if r["side"] == "b"), key=lambda r: r["rep"])
            ratio = statistics.median(x["iops"] / y["iops"] for x, y in zip(a, b))
            print(f"| {backend} | {depth} | {med(a, 'iops'):.0f} | {med(b, 'iops'):.0f} | {ratio:.3f} "
                  f"| {med(a, 'p50_us'):.1f} | {med(b, 'p50_us'):.1f} "
                  f"| {med(a, 'cpu_us_per_io'):.2f} | {med(b, 'cpu_us_per_io'):.2f} |")


if __name__ == "__main__":
    main()
