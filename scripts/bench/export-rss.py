#!/usr/bin/env python3
"""What an export costs in memory: a daemon's resident memory with N
exports of 2 queues on null-co, never connected, then once each has served
a libblkio client (vsd-bench, 4k randread, iodepth 4, 2 queues) and gone.

VmRSS from /proc/PID/status, each daemon in turn, interleaved over the
repetitions; the daemon pinned to the first CPU of --cpus, the clients to
the second.
"""
import os
import subprocess
import tempfile
import time

import benchlib
from benchlib import BENCH


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def measure(program, exports, work):
    args = []
    for i in range(exports):
        args += ["--blockdev", f"driver=null-co,node-name=n{i},size=1073741824",
                 "--export", f"type=vhost-user-blk,id=e{i},node-name=n{i},addr.type=unix,"
                             f"addr.path={work}/e{i}.sock,num-queues=2"]
    pidfile = os.path.join(work, "daemon.pid")
    daemon = subprocess.Popen(benchlib.pin(benchlib.DAEMON_CPU) + [program, *args, "--pidfile", pidfile])
    try:
        benchlib.wait_started(daemon, pidfile, program)
        time.sleep(0.5)
        idle = rss_kib(daemon.pid)
        for i in range(exports):
            subprocess.run(benchlib.pin(benchlib.CLIENT_CPU) + [BENCH, "--socket", f"{work}/e{i}.sock", "--rw",
                           "randread", "--iodepth", "4", "--queues", "2", "--seconds", "1"],
                           check=True, stdout=subprocess.DEVNULL)
        time.sleep(1)
        return idle, rss_kib(daemon.pid)
    finally:
        daemon.terminate()
        daemon.wait()


def main():
    p = benchlib.parser(__doc__, reps=2, seconds=1, peers=["vsd", "qsd"], out=False)
    p.add_argument("--exports", type=int, default=64, help="exports per daemon (default 64)")
    args = benchlib.parse(p)
    results = {}
    for _ in range(args.reps):
        for name, program in benchlib.daemons(args.baseline, args.peers).items():
            with tempfile.TemporaryDirectory() as work:
                results.setdefault(name, []).append(measure(program, args.exports, work))
    print(f"{args.exports} exports of 2 queues, VmRSS in MiB (each repetition)")
    print(f"{'daemon':8} {'never connected':>24} {'served once, idle':>24}")
    for name, runs in results.items():
        never = " ".join(f"{a / 1024:.1f}" for a, _ in runs)
        served = " ".join(f"{b / 1024:.1f}" for _, b in runs)
        print(f"{name:8} {never:>24} {served:>24}")


if __name__ == "__main__":
    main()
