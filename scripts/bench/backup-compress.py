#!/usr/bin/env python3
"""A compressed backup (`blockdev-backup` with `compress: true`) of a
qcow2 image of mixed data into a new qcow2 image, zlib and zstd: seconds
from the command to BLOCK_JOB_COMPLETED and the target's size, vsd and
qemu-storage-daemon in the same run, interleaved, pinned to CPU 0, images
on /dev/shm. The source holds, by quarters: text-like data, noise, 64 KiB
clusters of 8 KiB noise then zeroes, and a hole with zero clusters in it.
Each target is checked equal to the source (`qemu-img compare`).

usage: scripts/bench.py run backup-compress [--reps 3] [--size-mib 256] [--target-dir DIR]
"""
import os
import random
import statistics
import subprocess
import tempfile

import benchlib
from benchlib import job_seconds

WORDS = [b"qcow2 ", b"cluster ", b"backup ", b"compressed ", b"daemon ", b"zlib ", b"zstd\n"]


def text(rng, size):
    out = bytearray()
    while len(out) < size:
        out += rng.choice(WORDS)
    return bytes(out[:size])


def make_source(path, size):
    """Writes the mixed source as qcow2 at `path`."""
    rng = random.Random(1)
    quarter = size // 4
    raw = path + ".raw"
    with open(raw, "wb") as f:
        f.write(text(rng, quarter))
        f.write(os.urandom(quarter))
        for _ in range(quarter // 65536):
            f.write(os.urandom(8192) + bytes(65536 - 8192))
        f.truncate(size)
    subprocess.run(["qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", raw, path], check=True)
    os.unlink(raw)
    # Zero clusters in the last quarter's hole, as a guest's write-zeroes leaves them.
    subprocess.run(["qemu-io", "-c", f"write -q -z {3 * quarter} {quarter // 2}", path], check=True)


def main():
    parser = benchlib.parser(__doc__, reps=3, baseline=False, out=False)
    parser.add_argument("--size-mib", type=int, default=256)
    args = benchlib.parse(parser)
    size = args.size_mib << 20
    source = f"/dev/shm/vsd-bench-compress-src-{os.getpid()}.qcow2"
    target = f"/dev/shm/vsd-bench-compress-tgt-{os.getpid()}.qcow2"
    make_source(source, size)
    daemons = [("vsd", benchlib.VSD), ("qsd", benchlib.QSD)]
    kinds = ["zlib", "zstd"]
    seconds = {(d, k): [] for d, _ in daemons for k in kinds}
    sizes = {}
    try:
        with tempfile.TemporaryDirectory() as work:
            for rep in range(args.reps):
                for name, program in daemons if rep % 2 == 0 else reversed(daemons):
                    for kind in kinds:
                        if os.path.exists(target):
                            os.unlink(target)
                        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-o",
                                        f"compression_type={kind}", target, str(size)], check=True)
                        nodes = [f"driver=file,node-name=sf,filename={source}", "driver=qcow2,node-name=src,file=sf",
                                 f"driver=file,node-name=tf,filename={target}", "driver=qcow2,node-name=tgt,file=tf"]
                        backup = {"job-id": "b", "device": "src", "target": "tgt", "sync": "full", "compress": True}
                        took = job_seconds(program, nodes, work, "blockdev-backup", backup, "BLOCK_JOB_COMPLETED")
                        subprocess.run(["qemu-img", "compare", "-q", source, target], check=True)
                        seconds[(name, kind)].append(took)
                        sizes[(name, kind)] = os.path.getsize(target)
                        print(f"rep {rep} {name} {kind}: {took:.2f} s, {sizes[(name, kind)]} bytes", flush=True)
    finally:
        for path in (source, target):
            if os.path.exists(path):
                os.unlink(path)
    print()
    print(f"| daemon | compression | seconds (median of {args.reps}) | MiB/s | target MiB |")
    print("|---|---|---|---|---|")
    for (name, kind), values in seconds.items():
        median = statistics.median(values)
        print(f"| {name} | {kind} | {median:.2f} | {args.size_mib / median:.0f} | {sizes[(name, kind)] / 2**20:.1f} |")


if __name__ == "__main__":
    main()
