#!/usr/bin/env python3
"""What a running backup costs the guest, and how fast a backup copies:
vsd and qemu-storage-daemon in the same run, interleaved.

1. Guest-visible writes: 4k random writes at iodepth 16 through a
   vhost-user-blk export of a raw image on /dev/shm, without a backup
   ("off") and while a full `blockdev-backup` to another /dev/shm image
   runs, slowed (`speed`) so that it lasts the whole run ("on"): every
   first write to a 64 KiB cluster waits for its old data to be copied
   (copy-before-write). Daemon pinned to CPU 0, vsd-bench to CPU 1.
2. Throughput: a full backup of the image at full speed with no guest
   I/O, from `blockdev-backup` to BLOCK_JOB_COMPLETED.

usage: scripts/bench.py run backup [--seconds 5] [--reps 3] [--size-mib 1024]
"""
import json
import os
import subprocess
import tempfile

import benchlib
from benchlib import QSD, VSD, job_seconds, print_on_off, print_seconds, serve_and_bench


def nodes(source, target):
    return [f"driver=file,node-name=f0,filename={source}", "driver=raw,node-name=disk0,file=f0",
            f"driver=file,node-name=tgt,filename={target}"]


def main():
    parser = benchlib.parser(__doc__, reps=3, seconds=5.0, baseline=False, out=False)
    parser.add_argument("--size-mib", type=int, default=1024)
    args = benchlib.parse(parser)
    size = args.size_mib << 20
    source, target = (f"/dev/shm/vsd-bench-backup-{name}-{os.getpid()}.img" for name in ("src", "tgt"))
    benchlib.random_file(source, args.size_mib)
    subprocess.run(["truncate", "-s", str(size), target], check=True)
    # Slow enough to last the run and its ramp second.
    backup = {"job-id": "b", "device": "disk0", "target": "tgt", "sync": "full",
              "speed": int(size / (args.seconds + 3))}
    daemons = [("vsd", VSD), ("qsd", QSD)]
    rows, times = [], {name: [] for name, _ in daemons}
    try:
        with tempfile.TemporaryDirectory() as work:
            for rep in range(args.reps):
                order = [(d, s) for d in daemons for s in ("off", "on")]
                for (name, program), side in order if rep % 2 == 0 else reversed(order):
                    qmp = [("blockdev-backup", backup)] if side == "on" else ()
                    res = serve_and_bench(program, nodes(source, target), ["--rw", "randwrite", "--iodepth", "16"],
                                          args.seconds, work, qmp=qmp)
                    row = {"daemon": name, "side": side, "rep": rep, **res}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                for name, program in daemons if rep % 2 == 0 else reversed(daemons):
                    unlimited = {"job-id": "tp", "device": "disk0", "target": "tgt", "sync": "full"}
                    seconds = job_seconds(program, nodes(source, target), work, "blockdev-backup", unlimited,
                                          "BLOCK_JOB_COMPLETED")
                    times[name].append(seconds)
                    print(json.dumps({"daemon": name, "rep": rep, "backup_seconds": times[name][-1]}), flush=True)
    finally:
        os.unlink(source)
        os.unlink(target)
    title = (f"4k randwrite iodepth 16 on a {args.size_mib} MiB raw image in /dev/shm, medians of {args.reps}; "
             "on = a full backup running (copy-before-write)")
    print_on_off(rows, [name for name, _ in daemons], title)
    print_seconds(times, "full backup, guest idle", args.size_mib)

if __name__ == "__main__":
    main()
