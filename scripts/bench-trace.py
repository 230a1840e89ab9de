#!/usr/bin/env python3
"""What vsd's always-on request tracing costs, in instructions, which this
machine repeats exactly where its IOPS do not: vsd runs under valgrind
--tool=callgrind with one output file per thread, with trace=on and
trace=off, and the queue worker's instructions are divided by the requests
the client completed (null-co, 4k randread, iodepth 1 and 32, no ramp).
The same in IOPS: scripts/bench-ab.py --a trace=on --b trace=off.

usage: scripts/bench-trace.py [--seconds 10]
"""
import argparse
import glob
import json
import os
import re
import subprocess
import tempfile
import time

from benchlib import BENCH, VSD


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
         "--export", f"type=vhost-user-blk,id=e0,node-name=disk0,addr.type=unix,addr.path={sock},trace={trace},poll-us=0",
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
    parser.add_argument("--seconds", type=float, default=10)
    args = parser.parse_args()
    callgrind(args.seconds)


if __name__ == "__main__":
    main()
