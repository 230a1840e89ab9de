#!/usr/bin/env python3
"""Many exports busy at once: one daemon pinned to CPU 0 serves N exports
(one queue each, its own node), and N vsd-bench clients pinned to CPU 1
drive them at the same time (4k random reads, iodepth 8 each). Reported:
aggregate IOPS, the daemon's CPU per I/O, and the smallest and largest
export's share of the mean. Peers (vsd with its default configuration,
vsd with `poll-us=0`, vsd with every export on one `--object iothread`,
qemu-storage-daemon) are interleaved within each
repetition; reported are medians.

usage: scripts/bench.py run density [--exports 1,8] [--backends null-co,tmpfs] [--reps 3] [--seconds 5]
                                [--baseline PATH]   # another vsd build, default configuration, as peer "baseline"
"""
import json
import os
import statistics
import subprocess
import tempfile

import benchlib
from benchlib import BENCH, QSD, TICK_US, VSD, cpu_ticks, wait_started

# Program, options of every export, arguments before them.
PEERS = {"vsd": (VSD, "", []), "vsd poll-us=0": (VSD, ",poll-us=0", []),
         "vsd iothread": (VSD, ",iothread=io0", ["--object", "iothread,id=io0"]), "qsd": (QSD, "", [])}
IMAGE_MIB = 64


def blockdevs(backend, n, work):
    if backend == "null-co":
        return [f"driver=null-co,node-name=d{i},size=1073741824" for i in range(n)]
    devs = []
    for i in range(n):
        path = os.path.join(work, f"img{i}.raw")
        if not os.path.exists(path):
            with open(path, "wb") as f:
                f.truncate(IMAGE_MIB << 20)
            subprocess.run(["dd", "if=/dev/urandom", f"of={path}", "bs=1M", f"count={IMAGE_MIB}", "conv=notrunc",
                            "status=none"], check=True)
        devs.append(f"driver=file,node-name=d{i},filename={path}")
    return devs


def run(peer, backend, n, seconds, work):
    program, export_opts, extra = PEERS[peer]
    pidfile = os.path.join(work, "daemon.pid")
    if os.path.exists(pidfile):
        os.unlink(pidfile)
    args = [*benchlib.pin(benchlib.DAEMON_CPU), program, *extra]
    for dev in blockdevs(backend, n, work):
        args += ["--blockdev", dev]
    socks = [os.path.join(work, f"e{i}.sock") for i in range(n)]
    for i, sock in enumerate(socks):
        if os.path.exists(sock):
            os.unlink(sock)
        args += ["--export", f"type=vhost-user-blk,id=e{i},node-name=d{i},addr.type=unix,addr.path={sock},"
                 f"writable=on{export_opts}"]
    args += ["--pidfile", pidfile]
    daemon = subprocess.Popen(args)
    try:
        wait_started(daemon, pidfile, peer)
        before = cpu_ticks(daemon.pid)
        clients = [subprocess.Popen(
            [*benchlib.pin(benchlib.CLIENT_CPU), BENCH, "--socket", sock, "--rw", "randread", "--bs", "4k", "--iodepth", "8",
             "--seconds", str(seconds), "--ramp-seconds", "1", "--json"], stdout=subprocess.PIPE, text=True)
            for sock in socks]
        outs = [c.communicate(timeout=seconds + 120)[0] for c in clients]
        after = cpu_ticks(daemon.pid)
    finally:
        daemon.terminate()
        daemon.wait()
    results = [json.loads(out)["results"] for out in outs]
    iops = [r["iops"] for r in results]
    ios_with_ramp = max(sum(r["ios"] for r in results), 1) * (seconds + 1) / seconds
    mean = statistics.mean(iops)
    return {"iops": sum(iops), "cpu_us_per_io": (after - before) * TICK_US / ios_with_ramp,
            "min_share": min(iops) / mean, "max_share": max(iops) / mean}


def main():
    parser = benchlib.parser(__doc__, reps=3, seconds=5, out=False)
    parser.add_argument("--exports", default="1,8")
    parser.add_argument("--backends", default="null-co,tmpfs")
    parser.add_argument("--peers", default=",".join(PEERS))
    args = benchlib.parse(parser)
    peers = args.peers.split(",")
    if args.baseline:
        PEERS["baseline"] = (args.baseline, "", [])
        peers.insert(0, "baseline")
    rows = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as work:
        for rep in range(args.reps):
            for backend in args.backends.split(","):
                for n in map(int, args.exports.split(",")):
                    for peer in peers:
                        row = run(peer, backend, n, args.seconds, work)
                        rows.setdefault((backend, n, peer), []).append(row)
                        print(json.dumps({"rep": rep, "backend": backend, "exports": n, "peer": peer, **row}),
                              flush=True)
    print(f"\n| back-end | exports | peer | IOPS | CPU µs/I/O | min/max share | / {peers[-1]} |")
    print("|---|---|---|---|---|---|---|")
    for (backend, n, peer), runs in rows.items():
        med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        base = statistics.median(r["iops"] for r in rows[(backend, n, peers[-1])])
        print(f"| {backend} | {n} | {peer} | {med['iops']:,.0f} | {med['cpu_us_per_io']:.2f} | "
              f"{med['min_share']:.2f}/{med['max_share']:.2f} | {med['iops'] / base:.2f}x |")


if __name__ == "__main__":
    main()
