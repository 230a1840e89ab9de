#!/usr/bin/env python3
"""What a node option costs a request, in instructions, which callgrind
repeats exactly where IOPS do not: vsd serves a raw image on /dev/shm
(aio=io_uring) once per variant, each adding its options to the file node,
under valgrind --tool=callgrind with one output file per thread; vsd-bench
drives 4k random writes (or --rw) at iodepth 32 of nonzero data, and the
queue worker's (busiest thread's) instructions are divided by the requests
the client completed, after --warmup seconds not counted.

With --qmp NAME='COMMAND {ARGS}', variant NAME runs that QMP command
first (repeat it for several).

usage: scripts/bench.py run node-instr [--variant NAME=OPTIONS ...] [--qmp NAME='COMMAND {ARGS}' ...]
                                   [--seconds 10] [--warmup 2] [--rw randwrite] [--target-dir target]
                                   [--work /dev/shm/ni]
e.g.   scripts/bench.py run node-instr --variant off= --variant on=,detect-zeroes=on \\
           --variant unmap=,detect-zeroes=unmap,discard=unmap
       scripts/bench.py run node-instr --variant off= --variant armed= \\
           --qmp 'armed=block-set-write-threshold {"node-name": "f0", "write-threshold": 1099511627776}'
"""
import json
import os
import subprocess

import benchlib
from benchlib import callgrind_worker

IMAGE_MIB = 256


def main():
    parser = benchlib.parser(__doc__, seconds=10.0, baseline=False, out=False)
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=OPTIONS appended to the file node (default: off= and detect-zeroes=on)")
    parser.add_argument("--qmp", action="append", default=[],
                        help="NAME='COMMAND {ARGS}': a QMP command variant NAME runs first")
    parser.add_argument("--warmup", type=float, default=2)
    parser.add_argument("--rw", default="randwrite")
    parser.add_argument("--work", default="/dev/shm/ni")
    args = benchlib.parse(parser)
    variants = [v.split("=", 1) for v in args.variant or ["off=", "on=,detect-zeroes=on"]]
    qmp = {}
    for entry in args.qmp:
        name, command = entry.split("=", 1)
        command, _, arguments = command.partition(" ")
        qmp.setdefault(name, []).append((command, json.loads(arguments or "{}")))
    vsd, bench = benchlib.VSD, benchlib.BENCH
    os.makedirs(args.work, exist_ok=True)
    image = os.path.join(args.work, "raw.img")
    subprocess.run(["truncate", "-s", f"{IMAGE_MIB}M", image], check=True)
    print(f"| variant | file node options | instr/request ({args.rw} 4k qd32) | requests |")
    print("|---|---|---|---|")
    for name, options in variants:
        blockdevs = [f"driver=file,node-name=f0,filename={image},aio=io_uring{options}",
                     "driver=raw,node-name=disk0,file=f0"]
        bench_args = ["--rw", args.rw, "--bs", "4k", "--iodepth", "32"]
        per_request, requests, _ = callgrind_worker(vsd, bench, args.work, name, blockdevs, bench_args, args.seconds,
                                                    qmp=qmp.get(name, ()), warmup=args.warmup)
        print(f"| {name} | `{options or '(none)'}` | {per_request:.0f} | {requests} |")


if __name__ == "__main__":
    main()
