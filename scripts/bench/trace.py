#!/usr/bin/env python3
"""What vsd's always-on request tracing costs, in instructions, which this
machine repeats exactly where its IOPS do not: vsd runs under valgrind
--tool=callgrind with one output file per thread, with trace=on and
trace=off, and the queue worker's instructions are divided by the requests
the client completed (null-co, 4k randread, iodepth 1 and 32, no ramp).
The same in IOPS: scripts/bench.py run ab --a trace=on --b trace=off.

usage: scripts/bench.py run trace [--seconds 10]
"""
import tempfile

import benchlib
from benchlib import BENCH, VSD, callgrind_worker


def worker_instructions(work, trace, depth, seconds):
    """Instructions per request of the queue worker, and the requests counted."""
    instructions, ios, _ = callgrind_worker(
        VSD, BENCH, work, f"{trace}.{depth}", ["driver=null-co,node-name=disk0,size=1G"],
        ["--rw", "randread", "--iodepth", str(depth)], seconds, export_opts=f",trace={trace}")
    return instructions, ios


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
    parser = benchlib.parser(__doc__, seconds=10.0, baseline=False, out=False)
    args = benchlib.parse(parser)
    callgrind(args.seconds)


if __name__ == "__main__":
    main()
