#!/usr/bin/env python3
"""Does a throttled export slow an unthrottled one on the same I/O thread?
One daemon pinned to CPU 0 serves two exports of null-co nodes, both on
one `--object iothread` (QSD: `iothread=` on its exports too; vsd also
with the thread's polling off, `poll-max-ns=0`): A straight,
B through `driver=throttle` at --iops IOPS. vsd-bench clients on CPU 1
drive A alone, then A and B at once (4k random reads, iodepth 16 each).
Reported per daemon: A's IOPS alone and beside B, their ratio, and what B
got (its limit). vsd and qemu-storage-daemon interleaved; medians.

usage: scripts/bench.py run throttle-neighbour [--reps 3] [--seconds 5] [--iops 2000]
"""
import json
import os
import statistics
import subprocess
import tempfile

import benchlib
from benchlib import BENCH, QSD, VSD, wait_started

# Program, and options of the I/O thread.
PEERS = {"vsd": (VSD, ""), "vsd poll-max-ns=0": (VSD, ",poll-max-ns=0"), "qsd": (QSD, "")}


def run(peer, both, limit, seconds, work):
    program, iothread = PEERS[peer]
    pidfile = os.path.join(work, "daemon.pid")
    socks = {name: os.path.join(work, f"{name}.sock") for name in ("a", "b")}
    for path in [pidfile, *socks.values()]:
        if os.path.exists(path):
            os.unlink(path)
    args = [*benchlib.pin(benchlib.DAEMON_CPU), program, "--object", f"iothread,id=io0{iothread}",
            "--object", f"throttle-group,id=tg0,limits.iops-total={limit}",
            "--blockdev", "driver=null-co,node-name=na,size=1073741824",
            "--blockdev", "driver=null-co,node-name=nb,size=1073741824",
            "--blockdev", "driver=throttle,node-name=tb,throttle-group=tg0,file=nb"]
    for name, node in (("a", "na"), ("b", "tb")):
        args += ["--export", f"type=vhost-user-blk,id={name},node-name={node},addr.type=unix,"
                 f"addr.path={socks[name]},writable=on,iothread=io0"]
    daemon = subprocess.Popen([*args, "--pidfile", pidfile])
    try:
        wait_started(daemon, pidfile, program)
        names = ["a", "b"] if both else ["a"]
        clients = {name: subprocess.Popen(
            [*benchlib.pin(benchlib.CLIENT_CPU), BENCH, "--socket", socks[name], "--rw", "randread", "--bs", "4k",
             "--iodepth", "16", "--seconds", str(seconds), "--ramp-seconds", "1", "--json"],
            stdout=subprocess.PIPE, text=True) for name in names}
        outs = {name: c.communicate(timeout=seconds + 120)[0] for name, c in clients.items()}
    finally:
        daemon.terminate()
        daemon.wait()
    return {name: json.loads(out)["results"]["iops"] for name, out in outs.items()}


def main():
    parser = benchlib.parser(__doc__, reps=3, seconds=5, baseline=False, out=False)
    parser.add_argument("--iops", type=int, default=2000)
    args = benchlib.parse(parser)
    work = tempfile.mkdtemp(prefix="vsd-bench-neighbour-")
    results = {(peer, both): [] for peer in PEERS for both in (False, True)}
    for rep in range(args.reps):
        order = list(PEERS) if rep % 2 == 0 else list(reversed(PEERS))
        for peer in order:
            for both in (False, True):
                res = run(peer, both, args.iops, args.seconds, work)
                results[(peer, both)].append(res)
                print(f"rep {rep + 1} {peer} {'A beside B' if both else 'A alone'}: {json.dumps(res)}", flush=True)
    print(f"| daemon | A alone, IOPS | A beside B (throttled at {args.iops}), IOPS | ratio | B, IOPS |")
    print("|---|---|---|---|---|")
    for peer in PEERS:
        alone = statistics.median(r["a"] for r in results[(peer, False)])
        beside = statistics.median(r["a"] for r in results[(peer, True)])
        b = statistics.median(r["b"] for r in results[(peer, True)])
        print(f"| {peer} | {alone:.0f} | {beside:.0f} | {beside / alone:.2f} | {b:.0f} |")


if __name__ == "__main__":
    main()
