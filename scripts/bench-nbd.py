#!/usr/bin/env python3
"""NBD servers side by side: vsd, qemu-storage-daemon, qemu-nbd and nbdkit
(file plugin) export the same raw image on /dev/shm over a unix socket,
pinned to CPU 0; fio's libnbd engine (ioengine=nbd) drives each from CPU 1.
Workloads: 4k random reads at iodepth 32 on one connection, the same on 4
connections (numjobs=4, iodepth 8 each), and 64k sequential reads at
iodepth 8. Servers are interleaved within each repetition; reported are
the medians of IOPS and of the server's CPU time per I/O.

usage: scripts/bench-nbd.py [--reps 3] [--seconds 5] [--work /dev/shm/vsd-bench-nbd]
"""
import argparse
import json
import os
import statistics
import subprocess
import time

from benchlib import TICK_US, VSD, cpu_ticks

IMAGE_BYTES = 1 << 30
WORKLOADS = {
    "4k randread qd32": ["--rw=randread", "--bs=4k", "--iodepth=32", "--numjobs=1"],
    "4k randread 4 conns x qd8": ["--rw=randread", "--bs=4k", "--iodepth=8", "--numjobs=4"],
    "64k read qd8": ["--rw=read", "--bs=64k", "--iodepth=8", "--numjobs=1"],
}


def servers(image, sock):
    """Each server's command line, exporting `image` as 'disk' on `sock`."""
    blockdevs = ["--blockdev", f"driver=file,node-name=f0,filename={image},aio=io_uring",
                 "--blockdev", "driver=raw,node-name=disk,file=f0",
                 "--nbd-server", f"addr.type=unix,addr.path={sock}",
                 "--export", "type=nbd,id=e0,node-name=disk,name=disk,writable=on"]
    return {
        "vsd": [VSD, *blockdevs],
        "qsd": ["qemu-storage-daemon", *blockdevs],
        "qemu-nbd": ["qemu-nbd", "-f", "raw", "--aio=io_uring", "-k", sock, "-x", "disk", "--persistent",
                     "--shared=8", image],
        "nbdkit": ["nbdkit", "-f", "-U", sock, "file", f"file={image}"],
    }


def run(command, sock, workload, seconds):
    if os.path.exists(sock):
        os.unlink(sock)
    server = subprocess.Popen(["taskset", "-c", "0", *command], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 20
        while not os.path.exists(sock):
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{command[0]} did not start")
            time.sleep(0.02)
        time.sleep(0.2)
        before = cpu_ticks(server.pid)
        out = subprocess.run(
            ["taskset", "-c", "1", "fio", "--name=nbd", "--ioengine=nbd", f"--uri=nbd+unix:///disk?socket={sock}",
             *WORKLOADS[workload], "--time_based", f"--runtime={seconds}", "--group_reporting",
             "--output-format=json"], check=True, capture_output=True, text=True).stdout
        ticks = cpu_ticks(server.pid) - before
    finally:
        server.terminate()
        server.wait()
    # fio's nbd engine says it connected before the JSON.
    job = json.loads(out[out.index("{"):])["jobs"][0]["read"]
    ios = job["total_ios"]
    return {"iops": job["iops"], "cpu_us_per_io": ticks * TICK_US / max(ios, 1)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--work", default="/dev/shm/vsd-bench-nbd")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    image, sock = os.path.join(args.work, "disk.img"), os.path.join(args.work, "nbd.sock")
    if not os.path.exists(image):
        subprocess.run(["dd", "if=/dev/urandom", f"of={image}", "bs=1M", f"count={IMAGE_BYTES >> 20}",
                        "status=none"], check=True)
    commands = servers(image, sock)
    results = {(w, s): [] for w in WORKLOADS for s in commands}
    for rep in range(args.reps):
        order = list(commands) if rep % 2 == 0 else list(reversed(commands))
        for workload in WORKLOADS:
            for name in order:
                res = run(commands[name], sock, workload, args.seconds)
                results[(workload, name)].append(res)
                print(f"rep {rep + 1} {workload} {name}: {json.dumps(res)}", flush=True)
    print("| workload | server | IOPS (median) | server CPU µs per I/O (median) | IOPS / QSD | CPU / QSD |")
    print("|---|---|---|---|---|---|")
    for workload in WORKLOADS:
        med = {s: (statistics.median(r["iops"] for r in results[(workload, s)]),
                   statistics.median(r["cpu_us_per_io"] for r in results[(workload, s)])) for s in commands}
        for name, (iops, cpu) in med.items():
            qsd_iops, qsd_cpu = med["qsd"]
            print(f"| {workload} | {name} | {iops:.0f} | {cpu:.2f} | {iops / qsd_iops:.2f} | {cpu / qsd_cpu:.2f} |")


if __name__ == "__main__":
    main()
