#!/usr/bin/env python3
"""NBD servers side by side: vsd, qemu-storage-daemon, qemu-nbd and nbdkit
(file plugin) export the same raw image on /dev/shm over a unix socket,
pinned to CPU 0; fio's libnbd engine (ioengine=nbd) drives each from CPU 1.
Workloads: 4k random reads at iodepth 32 on one connection, the same on 4
connections (numjobs=4, iodepth 8 each), and 64k sequential reads at
iodepth 8. Servers are interleaved within each repetition; reported are
the medians of IOPS and of the server's CPU time per I/O.

`--workloads` picks others by name, among them sequential reads of 4k, 16k
and 256k at iodepth 8 (`--workloads "64k read qd8,256k read qd8"`);
`--servers` picks servers; `--baseline PATH` adds another vsd binary
(`vsd-base`), interleaved with the rest; `--target-dir T` takes vsd from a
cargo target directory's release build.

usage: scripts/bench.py run nbd [--reps 3] [--seconds 5] [--work /dev/shm/vsd-bench-nbd]
       [--workloads NAME,...] [--servers NAME,...] [--baseline PATH] [--target-dir T]
"""
import json
import os
import statistics
import subprocess
import time

import benchlib
from benchlib import TICK_US, cpu_ticks

IMAGE_BYTES = 1 << 30
WORKLOADS = {
    "4k randread qd32": ["--rw=randread", "--bs=4k", "--iodepth=32", "--numjobs=1"],
    "4k randread 4 conns x qd8": ["--rw=randread", "--bs=4k", "--iodepth=8", "--numjobs=4"],
    "64k read qd8": ["--rw=read", "--bs=64k", "--iodepth=8", "--numjobs=1"],
}
# Run only when named (--workloads).
MORE_WORKLOADS = {
    "4k read qd8": ["--rw=read", "--bs=4k", "--iodepth=8", "--numjobs=1"],
    "16k read qd8": ["--rw=read", "--bs=16k", "--iodepth=8", "--numjobs=1"],
    "256k read qd8": ["--rw=read", "--bs=256k", "--iodepth=8", "--numjobs=1"],
}
ALL_WORKLOADS = {**WORKLOADS, **MORE_WORKLOADS}


def servers(image, sock, baseline=None):
    """Each server's command line, exporting `image` as 'disk' on `sock`;
    `baseline`, another vsd binary, as `vsd-base`."""
    blockdevs = ["--blockdev", f"driver=file,node-name=f0,filename={image},aio=io_uring",
                 "--blockdev", "driver=raw,node-name=disk,file=f0",
                 "--nbd-server", f"addr.type=unix,addr.path={sock}",
                 "--export", "type=nbd,id=e0,node-name=disk,name=disk,writable=on"]
    base = {"vsd-base": [baseline, *blockdevs]} if baseline else {}
    return {
        "vsd": [benchlib.VSD, *blockdevs],
        **base,
        "qsd": ["qemu-storage-daemon", *blockdevs],
        "qemu-nbd": ["qemu-nbd", "-f", "raw", "--aio=io_uring", "-k", sock, "-x", "disk", "--persistent",
                     "--shared=8", image],
        "nbdkit": ["nbdkit", "-f", "-U", sock, "file", f"file={image}"],
    }


def run(command, sock, workload, seconds):
    if os.path.exists(sock):
        os.unlink(sock)
    server = subprocess.Popen([*benchlib.pin(benchlib.DAEMON_CPU), *command], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 20
        while not os.path.exists(sock):
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{command[0]} did not start")
            time.sleep(0.02)
        time.sleep(0.2)
        before = cpu_ticks(server.pid)
        report = benchlib.fio(["--name=nbd", "--ioengine=nbd", f"--uri=nbd+unix:///disk?socket={sock}",
                               *ALL_WORKLOADS[workload], "--time_based", f"--runtime={seconds}", "--group_reporting"])
        ticks = cpu_ticks(server.pid) - before
    finally:
        server.terminate()
        server.wait()
    job = report["jobs"][0]["read"]
    ios = job["total_ios"]
    return {"iops": job["iops"], "cpu_us_per_io": ticks * TICK_US / max(ios, 1)}


def main():
    parser = benchlib.parser(__doc__, reps=3, seconds=5, out=False)
    parser.add_argument("--work", default="/dev/shm/vsd-bench-nbd")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--servers", help="comma-separated names (default: all)")
    args = benchlib.parse(parser)
    workloads = args.workloads.split(",")
    for workload in workloads:
        if workload not in ALL_WORKLOADS:
            parser.error(f"no workload '{workload}' (there are: {', '.join(ALL_WORKLOADS)})")
    os.makedirs(args.work, exist_ok=True)
    image, sock = os.path.join(args.work, "disk.img"), os.path.join(args.work, "nbd.sock")
    if not os.path.exists(image):
        benchlib.random_file(image, IMAGE_BYTES >> 20)
    commands = servers(image, sock, args.baseline)
    if args.servers:
        commands = {name: commands[name] for name in args.servers.split(",")}
    results = {(w, s): [] for w in workloads for s in commands}
    for rep in range(args.reps):
        order = list(commands) if rep % 2 == 0 else list(reversed(commands))
        for workload in workloads:
            for name in order:
                res = run(commands[name], sock, workload, args.seconds)
                results[(workload, name)].append(res)
                print(f"rep {rep + 1} {workload} {name}: {json.dumps(res)}", flush=True)
    print("| workload | server | IOPS (median) | server CPU µs per I/O (median) | IOPS / QSD | CPU / QSD |")
    print("|---|---|---|---|---|---|")
    for workload in workloads:
        med = {s: (statistics.median(r["iops"] for r in results[(workload, s)]),
                   statistics.median(r["cpu_us_per_io"] for r in results[(workload, s)])) for s in commands}
        for name, (iops, cpu) in med.items():
            qsd_iops, qsd_cpu = med["qsd"]
            print(f"| {workload} | {name} | {iops:.0f} | {cpu:.2f} | {iops / qsd_iops:.2f} | {cpu / qsd_cpu:.2f} |")


if __name__ == "__main__":
    main()
