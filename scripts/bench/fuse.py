#!/usr/bin/env python3
"""FUSE exports side by side: vsd's and qemu-storage-daemon's export the same
raw image (on /dev/shm) as a file, the daemon pinned to CPU 0; fio's io_uring
engine drives the mounted file from CPU 1 with direct I/O, and the image file
itself for reference ("file"). Workloads: 4k random reads and writes at
iodepth 1 and 16, 1 MiB sequential reads and writes at iodepth 4. Targets
are interleaved within each repetition (order reversed every other one);
reported are the medians of IOPS and of the daemon's CPU time per I/O.

usage: scripts/bench.py run fuse [--reps 3] [--seconds 5] [--work /dev/shm/vsd-bench-fuse]
       [--workloads NAME,...] [--targets vsd,qsd,file] [--target-dir T]
"""
import argparse
import json
import os
import statistics
import subprocess
import time

import benchlib
from benchlib import TICK_US, cpu_ticks

IMAGE_BYTES = 1 << 30
WORKLOADS = {
    "4k randread qd1": ["--rw=randread", "--bs=4k", "--iodepth=1"],
    "4k randread qd16": ["--rw=randread", "--bs=4k", "--iodepth=16"],
    "4k randwrite qd1": ["--rw=randwrite", "--bs=4k", "--iodepth=1"],
    "4k randwrite qd16": ["--rw=randwrite", "--bs=4k", "--iodepth=16"],
    "1M read qd4": ["--rw=read", "--bs=1M", "--iodepth=4"],
    "1M write qd4": ["--rw=write", "--bs=1M", "--iodepth=4"],
}


def daemons(image, mountpoint):
    """Each daemon's command line, exporting `image` as a file on `mountpoint`."""
    args = ["--blockdev", f"driver=file,node-name=f0,filename={image},aio=io_uring",
            "--blockdev", "driver=raw,node-name=disk,file=f0",
            "--export", f"type=fuse,id=e0,node-name=disk,mountpoint={mountpoint},writable=on"]
    return {"vsd": [benchlib.VSD, *args], "qsd": [benchlib.QSD, *args]}


def fio(filename, workload, seconds):
    out = subprocess.run(
        ["taskset", "-c", "1", "fio", "--name=fuse", f"--filename={filename}", "--ioengine=io_uring", "--direct=1",
         *WORKLOADS[workload], "--time_based", f"--runtime={seconds}", "--output-format=json"],
        check=True, capture_output=True, text=True).stdout
    job = json.loads(out)["jobs"][0]
    side = job["write"] if "write" in workload else job["read"]
    return side["iops"], side["bw"] / 1024, side["total_ios"]


def run(name, command, image, mountpoint, workload, seconds):
    """One fio run on `name`'s file: the daemon's mount, or the image."""
    if command is None:
        iops, mibs, _ = fio(image, workload, seconds)
        return {"iops": iops, "mib_s": mibs, "cpu_us_per_io": 0.0}
    pidfile = os.path.join(os.path.dirname(mountpoint), f"{name}.pid")
    if os.path.exists(pidfile):
        os.unlink(pidfile)
    daemon = subprocess.Popen(["taskset", "-c", "0", *command, "--pidfile", pidfile],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        benchlib.wait_started(daemon, pidfile, name)
        before = cpu_ticks(daemon.pid)
        iops, mibs, ios = fio(mountpoint, workload, seconds)
        ticks = cpu_ticks(daemon.pid) - before
    finally:
        daemon.terminate()
        daemon.wait()
    return {"iops": iops, "mib_s": mibs, "cpu_us_per_io": ticks * TICK_US / max(ios, 1)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--work", default="/dev/shm/vsd-bench-fuse")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--targets", default="vsd,qsd,file")
    parser.add_argument("--target-dir", help="take vsd from this cargo target directory's release build")
    args = parser.parse_args()
    benchlib.use_build(args.target_dir)
    workloads = args.workloads.split(",")
    for workload in workloads:
        if workload not in WORKLOADS:
            parser.error(f"no workload '{workload}' (there are: {', '.join(WORKLOADS)})")
    os.makedirs(args.work, exist_ok=True)
    image, mountpoint = os.path.join(args.work, "disk.img"), os.path.join(args.work, "disk.mnt")
    if not os.path.exists(image):
        subprocess.run(["dd", "if=/dev/urandom", f"of={image}", "bs=1M", f"count={IMAGE_BYTES >> 20}",
                        "status=none"], check=True)
    open(mountpoint, "a").close()
    commands = {**daemons(image, mountpoint), "file": None}
    targets = args.targets.split(",")
    results = {(w, t): [] for w in workloads for t in targets}
    for rep in range(args.reps):
        order = targets if rep % 2 == 0 else list(reversed(targets))
        for workload in workloads:
            for name in order:
                res = run(name, commands[name], image, mountpoint, workload, args.seconds)
                results[(workload, name)].append(res)
                print(f"rep {rep + 1} {workload} {name}: {json.dumps(res)}", flush=True)
                time.sleep(0.2)
    print("| workload | target | IOPS (median) | MiB/s | daemon CPU µs per I/O | IOPS / QSD |")
    print("|---|---|---|---|---|---|")
    for workload in workloads:
        med = {t: {k: statistics.median(r[k] for r in results[(workload, t)]) for k in ("iops", "mib_s", "cpu_us_per_io")}
               for t in targets}
        qsd = med.get("qsd", {}).get("iops")
        for name, m in med.items():
            ratio = f"{m['iops'] / qsd:.2f}" if qsd else "-"
            print(f"| {workload} | {name} | {m['iops']:.0f} | {m['mib_s']:.0f} | {m['cpu_us_per_io']:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
