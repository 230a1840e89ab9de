#!/usr/bin/env python3
"""vsd against qemu-storage-daemon, in one run, interleaved, medians.

Both daemons get the same --blockdev/--export options (vsd takes QSD's
command line) and are driven by the same libblkio client, vsd-bench, in
interrupt mode, 1 queue. The daemon is pinned to CPU 0, the client to
CPU 1; fio with io_uring on the same file, pinned to CPU 1, is the floor.
Daemon CPU per I/O comes from /proc/PID/stat (utime + stime).

With --poll, vsd-bench runs libblkio's poll mode (the client spins on its
completions instead of sleeping on the call eventfd), the regime of a
guest with polling drivers. The fio floor is unchanged (io_uring polling
does not apply to buffered files).

Usage: scripts/bench-compare.py [--seconds 10] [--reps 3] [--poll] [--out FILE.jsonl]
Prints a Markdown table for BENCHMARKS.md.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import QSD, VSD, serve_and_bench  # noqa: E402

IMAGE_SIZE = 1 << 30


def blockdev_args(backend, image):
    if backend == "null-co":
        return [f"driver=null-co,node-name=disk0,size={IMAGE_SIZE}"]
    return [f"driver=file,node-name=file0,filename={image},aio=io_uring", "driver=raw,node-name=disk0,file=file0"]


def run_daemon(program, backend, image, depth, seconds, workdir, poll):
    bench = ["--rw", "randread", "--bs", "4k", "--iodepth", str(depth)] + (["--poll"] if poll else [])
    return serve_and_bench(program, blockdev_args(backend, image), bench, seconds, workdir)


def run_fio(image, depth, seconds):
    out = subprocess.run(
        ["taskset", "-c", "1", "fio", "--name=floor", f"--filename={image}", "--rw=randread", "--bs=4k",
         f"--iodepth={depth}", "--ioengine=io_uring", "--direct=0", f"--runtime={seconds}", "--time_based",
         "--ramp_time=1", "--output-format=json"],
        check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]["read"]
    return {"iops": job["iops"], "p50_us": job["clat_ns"]["percentile"]["50.000000"] / 1000,
            "p99_us": job["clat_ns"]["percentile"]["99.000000"] / 1000, "cpu_us_per_io": None}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--poll", action="store_true", help="libblkio poll mode in the client")
    opts = parser.parse_args()

    workdir = tempfile.mkdtemp(prefix="vsd-bench-", dir="/dev/shm")
    image = os.path.join(workdir, "disk.img")
    # Real data, not a hole: reads of a sparse tmpfs file skip the page cache.
    subprocess.run(["dd", "if=/dev/urandom", f"of={image}", "bs=1M", f"count={IMAGE_SIZE >> 20}", "status=none"],
                   check=True)
    daemons = {"vsd": VSD, "qsd": QSD}
    configs = [(backend, depth) for backend in ("null-co", "file-tmpfs") for depth in (32, 1)]
    rows = {}
    out = open(opts.out, "a") if opts.out else None
    try:
        for rep in range(opts.reps):
            order = list(daemons) if rep % 2 == 0 else list(reversed(daemons))
            for backend, depth in configs:
                runs = [(name, lambda n=name: run_daemon(daemons[n], backend, image, depth, opts.seconds, workdir, opts.poll))
                        for name in order]
                if backend == "file-tmpfs":
                    runs.append(("fio", lambda: run_fio(image, depth, opts.seconds)))
                for name, fn in runs:
                    result = fn()
                    rows.setdefault((backend, depth, name), []).append(result)
                    line = {"rep": rep, "backend": backend, "iodepth": depth, "target": name, "client_poll": opts.poll,
                            **result}
                    print(json.dumps(line), file=sys.stderr)
                    if out:
                        print(json.dumps(line), file=out, flush=True)
    finally:
        subprocess.run(["rm", "-rf", workdir])

    def med(key, backend, depth, name):
        values = [r[key] for r in rows.get((backend, depth, name), []) if r[key] is not None]
        return statistics.median(values) if values else None

    print("| back-end | 4k randread | vsd IOPS | QSD IOPS | vsd/QSD | vsd p50/p99 µs | QSD p50/p99 µs "
          "| vsd CPU µs/IO | QSD CPU µs/IO | fio floor IOPS (p50 µs) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for backend, depth in configs:
        v, q = med("iops", backend, depth, "vsd"), med("iops", backend, depth, "qsd")
        floor = med("iops", backend, depth, "fio")
        floor_text = f"{floor / 1000:.0f}k ({med('p50_us', backend, depth, 'fio'):.0f})" if floor else "—"
        print(f"| {backend} | iodepth {depth} | {v / 1000:.0f}k | {q / 1000:.0f}k | {v / q:.2f}x "
              f"| {med('p50_us', backend, depth, 'vsd'):.0f} / {med('p99_us', backend, depth, 'vsd'):.0f} "
              f"| {med('p50_us', backend, depth, 'qsd'):.0f} / {med('p99_us', backend, depth, 'qsd'):.0f} "
              f"| {med('cpu_us_per_io', backend, depth, 'vsd'):.2f} | {med('cpu_us_per_io', backend, depth, 'qsd'):.2f} "
              f"| {floor_text} |")


if __name__ == "__main__":
    main()
