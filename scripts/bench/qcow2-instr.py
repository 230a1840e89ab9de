#!/usr/bin/env python3
"""What the qcow2 layer costs over raw, in instructions per request, which
callgrind repeats exactly where IOPS do not: vsd serves a raw image and a
fully allocated qcow2 copy of it (both on /dev/shm, aio=io_uring) under
valgrind --tool=callgrind with one output file per thread, vsd-bench
drives 4k random reads and writes at iodepth 32 (no ramp), and the queue
worker's (busiest thread's) instructions are divided by the requests the
client completed. The first `--warmup` seconds are not counted, so that
the figures are the warm cache's: every table loaded and every entry
checked (once per cluster, ~16k here) before counting starts. The callgrind files stay in --work for
callgrind_annotate.

usage: scripts/bench.py run qcow2-instr [--seconds 10] [--warmup 5] [--rw randread,randwrite]
                                    [--target-dir target] [--work /dev/shm/qi]
"""
import os
import subprocess

import benchlib
from benchlib import callgrind_worker

IMAGE_MIB = 1024


def images(work):
    """The raw image (random data) and its fully allocated qcow2 copy."""
    raw, qcow2 = os.path.join(work, "raw.img"), os.path.join(work, "full.qcow2")
    os.makedirs(work, exist_ok=True)
    if not os.path.exists(raw):
        benchlib.random_file(raw, IMAGE_MIB)
    if not os.path.exists(qcow2):
        subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, qcow2], check=True)
    return {"raw": raw, "qcow2": qcow2}


def worker_instructions(work, fmt, path, rw, seconds, warmup):
    """Instructions per request of the queue worker, the requests counted,
    and its callgrind file."""
    blockdevs = [f"driver=file,node-name=f0,filename={path},aio=io_uring", f"driver={fmt},node-name=disk0,file=f0"]
    bench_args = ["--rw", rw, "--bs", "4k", "--iodepth", "32"]
    return callgrind_worker(benchlib.VSD, benchlib.BENCH, work, f"{fmt}.{rw}", blockdevs, bench_args, seconds, warmup=warmup)


def main():
    parser = benchlib.parser(__doc__, seconds=10.0, baseline=False, out=False)
    parser.add_argument("--warmup", type=float, default=5)
    parser.add_argument("--rw", default="randread,randwrite")
    parser.add_argument("--work", default="/dev/shm/qi")
    args = benchlib.parse(parser)
    paths = images(args.work)
    print("| rw | raw instr/request | qcow2 instr/request | qcow2 - raw | requests raw, qcow2 |")
    print("|---|---|---|---|---|")
    for rw in args.rw.split(","):
        raw, n_raw, _ = worker_instructions(args.work, "raw", paths["raw"], rw, args.seconds, args.warmup)
        qcow2, n_qcow2, busiest = worker_instructions(args.work, "qcow2", paths["qcow2"], rw, args.seconds,
                                                    args.warmup)
        print(f"| {rw} | {raw:.0f} | {qcow2:.0f} | {qcow2 - raw:+.0f} | {n_raw}, {n_qcow2} |", flush=True)
        print(f"  (qcow2 worker: {busiest})", flush=True)


if __name__ == "__main__":
    main()
