#!/usr/bin/env python3
"""What a running mirror or active commit costs the guest, and how soon
it is in sync: vsd and qemu-storage-daemon in the same run, interleaved.

1. Guest-visible writes: 4k random writes at iodepth 16 through a
   vhost-user-blk export of a disk on /dev/shm, without a job ("off") and
   while the job (no speed limit) runs from the start of the run ("on"):
   the bulk copy first, then, ready, what the guest writes. Daemon pinned
   to CPU 0, vsd-bench to CPU 1.
2. Time to ready: the job's command to BLOCK_JOB_READY with no guest I/O
   (the disk full of random data).

The jobs (--job):
- mirror: `blockdev-mirror` sync=full of a raw image onto another,
  copy-mode=background (the default) or write-blocking (--copy-mode);
- commit: `block-commit` of a qcow2 overlay holding the data into its
  empty qcow2 base (an active commit).

usage: scripts/bench.py run mirror [--job mirror|commit] [--copy-mode background|write-blocking]
                               [--seconds 5] [--reps 3] [--size-mib 1024] [--target-dir DIR]
"""
import json
import os
import shutil
import subprocess
import tempfile

import benchlib
from benchlib import QSD, job_seconds, print_on_off, print_seconds, serve_and_bench


def empty(path, size):
    """A sparse file of `size` bytes, whatever `path` held."""
    with open(path, "w") as f:
        f.truncate(size)


class Mirror:
    """A raw disk of random data mirrored onto an empty raw image."""

    def __init__(self, data, size, copy_mode):
        self.source, self.target, self.size = data, f"/dev/shm/vsd-bench-mirror-tgt-{os.getpid()}.img", size
        self.command = ("blockdev-mirror", {"job-id": "m", "device": "disk0", "target": "tgt", "sync": "full",
                                            "copy-mode": copy_mode})

    def nodes(self):
        """Fresh images for one run, and their --blockdev options."""
        empty(self.target, self.size)
        return [f"driver=file,node-name=f0,filename={self.source}", "driver=raw,node-name=disk0,file=f0",
                f"driver=file,node-name=tgt,filename={self.target}"]

    def files(self):
        return [self.target]


class Commit:
    """A qcow2 overlay holding the random data, committed into its empty
    qcow2 base."""

    def __init__(self, data, size):
        prefix = f"/dev/shm/vsd-bench-commit-{os.getpid()}"
        self.pristine, self.overlay, self.base = (f"{prefix}-{name}.qcow2" for name in ("pristine", "top", "base"))
        self.size = size
        subprocess.run(["qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", data, self.pristine], check=True)
        self.command = ("block-commit", {"job-id": "m", "device": "disk0"})

    def nodes(self):
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", self.base, str(self.size)], check=True)
        shutil.copyfile(self.pristine, self.overlay)
        subprocess.run(["qemu-img", "rebase", "-q", "-u", "-f", "qcow2", "-b", self.base, "-F", "qcow2",
                        self.overlay], check=True)
        return [f"driver=file,node-name=fb,filename={self.base}", "driver=qcow2,node-name=base,file=fb,read-only=on",
                f"driver=file,node-name=f0,filename={self.overlay}", "driver=qcow2,node-name=disk0,file=f0,backing=base"]

    def files(self):
        return [self.pristine, self.overlay, self.base]


def main():
    parser = benchlib.parser(__doc__, reps=3, seconds=5.0, baseline=False, out=False)
    parser.add_argument("--job", choices=("mirror", "commit"), default="mirror")
    parser.add_argument("--copy-mode", choices=("background", "write-blocking"), default="background")
    parser.add_argument("--size-mib", type=int, default=1024)
    args = benchlib.parse(parser)
    size = args.size_mib << 20
    data = f"/dev/shm/vsd-bench-jobs-data-{os.getpid()}.img"
    benchlib.random_file(data, args.size_mib)
    job = Mirror(data, size, args.copy_mode) if args.job == "mirror" else Commit(data, size)
    daemons = [("vsd", benchlib.VSD), ("qsd", QSD)]
    rows, times = [], {name: [] for name, _ in daemons}
    try:
        with tempfile.TemporaryDirectory() as work:
            for rep in range(args.reps):
                order = [(d, s) for d in daemons for s in ("off", "on")]
                for (name, program), side in order if rep % 2 == 0 else reversed(order):
                    qmp = [job.command] if side == "on" else ()
                    res = serve_and_bench(program, job.nodes(), ["--rw", "randwrite", "--iodepth", "16"],
                                          args.seconds, work, qmp=qmp)
                    row = {"daemon": name, "side": side, "rep": rep, **res}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                for name, program in daemons if rep % 2 == 0 else reversed(daemons):
                    seconds = job_seconds(program, job.nodes(), work, *job.command, "BLOCK_JOB_READY")
                    times[name].append(seconds)
                    print(json.dumps({"daemon": name, "rep": rep, "ready_seconds": times[name][-1]}), flush=True)
    finally:
        for path in (data, *job.files()):
            if os.path.exists(path):
                os.unlink(path)
    what = f"a full mirror, copy-mode={args.copy_mode}" if args.job == "mirror" else "an active commit"
    title = (f"4k randwrite iodepth 16 on a {args.size_mib} MiB disk in /dev/shm, medians of {args.reps}; "
             f"on = {what} running from the start (bulk copy, then ready)")
    print_on_off(rows, [name for name, _ in daemons], title)
    print_seconds(times, "time to ready, guest idle", args.size_mib)


if __name__ == "__main__":
    main()
