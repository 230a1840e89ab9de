#!/usr/bin/env python3
"""What a running mirror costs the guest, and how soon a mirror is in
sync: vsd and qemu-storage-daemon in the same run, interleaved.

1. Guest-visible writes: 4k random writes at iodepth 16 through a
   vhost-user-blk export of a raw image on /dev/shm, without a mirror
   ("off") and while a `blockdev-mirror` (sync=full, no speed limit) to
   another /dev/shm image runs from the start of the run ("on"): the bulk
   copy first, then, ready, the copy of every block written. Daemon
   pinned to CPU 0, vsd-bench to CPU 1.
2. Time to ready: `blockdev-mirror` to BLOCK_JOB_READY with no guest
   I/O (the image full of random data), then cancelled.

usage: scripts/bench-mirror.py [--seconds 5] [--reps 3] [--size-mib 1024] [--target-dir DIR]
"""
import argparse
import json
import os
import subprocess
import tempfile

import benchlib
from benchlib import QSD, job_seconds, print_on_off, print_seconds, serve_and_bench, use_build


def nodes(source, target):
    return [f"driver=file,node-name=f0,filename={source}", "driver=raw,node-name=disk0,file=f0",
            f"driver=file,node-name=tgt,filename={target}"]


def empty(path, size):
    """A sparse file of `size` bytes, whatever `path` held."""
    with open(path, "w") as f:
        f.truncate(size)


MIRROR = {"job-id": "m", "device": "disk0", "target": "tgt", "sync": "full"}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--target-dir", default=None)
    args = parser.parse_args()
    use_build(args.target_dir)
    size = args.size_mib << 20
    source, target = (f"/dev/shm/vsd-bench-mirror-{name}-{os.getpid()}.img" for name in ("src", "tgt"))
    subprocess.run(["dd", "if=/dev/urandom", f"of={source}", "bs=1M", f"count={args.size_mib}", "status=none"],
                   check=True)
    daemons = [("vsd", benchlib.VSD), ("qsd", QSD)]
    rows, times = [], {name: [] for name, _ in daemons}
    try:
        with tempfile.TemporaryDirectory() as work:
            for rep in range(args.reps):
                order = [(d, s) for d in daemons for s in ("off", "on")]
                for (name, program), side in order if rep % 2 == 0 else reversed(order):
                    empty(target, size)
                    qmp = [("blockdev-mirror", MIRROR)] if side == "on" else ()
                    res = serve_and_bench(program, nodes(source, target), ["--rw", "randwrite", "--iodepth", "16"],
                                          args.seconds, work, qmp=qmp)
                    row = {"daemon": name, "side": side, "rep": rep, **res}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                for name, program in daemons if rep % 2 == 0 else reversed(daemons):
                    empty(target, size)
                    seconds = job_seconds(program, nodes(source, target), work, "blockdev-mirror", MIRROR,
                                          "BLOCK_JOB_READY")
                    times[name].append(seconds)
                    print(json.dumps({"daemon": name, "rep": rep, "ready_seconds": times[name][-1]}), flush=True)
    finally:
        for path in (source, target):
            if os.path.exists(path):
                os.unlink(path)
    title = (f"4k randwrite iodepth 16 on a {args.size_mib} MiB raw image in /dev/shm, medians of {args.reps}; "
             "on = a full mirror running from the start (bulk copy, then ready)")
    print_on_off(rows, [name for name, _ in daemons], title)
    print_seconds(times, "time to ready, guest idle", args.size_mib)

if __name__ == "__main__":
    main()
