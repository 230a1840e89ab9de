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
does not apply to buffered files). --backends and --iodepths pick the
cases (default: null-co and a raw file on tmpfs, iodepth 32 and 1).

e.g.   scripts/bench.py run compare --reps 3 --seconds 10 --out ROWS.jsonl
Prints a Markdown table for BENCHMARKS.md.
"""

import os
import subprocess
import tempfile

import benchlib
from benchlib import median, serve_and_bench

IMAGE_SIZE = 1 << 30
BACKENDS = ("null-co", "file-tmpfs")


def blockdev_args(backend, image):
    if backend == "null-co":
        return [f"driver=null-co,node-name=disk0,size={IMAGE_SIZE}"]
    return [f"driver=file,node-name=file0,filename={image},aio=io_uring", "driver=raw,node-name=disk0,file=file0"]


def run_daemon(program, backend, image, depth, seconds, workdir, poll):
    bench = ["--rw", "randread", "--bs", "4k", "--iodepth", str(depth)] + (["--poll"] if poll else [])
    return serve_and_bench(program, blockdev_args(backend, image), bench, seconds, workdir)


def run_fio(image, depth, seconds):
    job = benchlib.fio(["--name=floor", f"--filename={image}", "--rw=randread", "--bs=4k", f"--iodepth={depth}",
                        "--ioengine=io_uring", "--direct=0", f"--runtime={seconds}", "--time_based",
                        "--ramp_time=1"])["jobs"][0]["read"]
    return {"iops": job["iops"], "p50_us": benchlib.clat_us(job, 50), "p99_us": benchlib.clat_us(job, 99),
            "cpu_us_per_io": None}


def main():
    parser = benchlib.parser(__doc__, reps=3, seconds=10, peers=["vsd", "qsd", "fio"])
    parser.add_argument("--poll", action="store_true", help="libblkio poll mode in the client")
    parser.add_argument("--backends", type=lambda s: s.split(","), default=list(BACKENDS),
                        help=f"comma-separated, of: {', '.join(BACKENDS)}")
    parser.add_argument("--iodepths", default="32,1")
    opts = benchlib.parse(parser)

    workdir = tempfile.mkdtemp(prefix="vsd-bench-", dir="/dev/shm")
    image = os.path.join(workdir, "disk.img")
    benchlib.random_file(image, IMAGE_SIZE >> 20)
    daemons = benchlib.daemons(opts.baseline, opts.peers)
    configs = [(backend, int(depth)) for backend in opts.backends for depth in opts.iodepths.split(",")]
    rows = benchlib.Rows(opts.out)
    try:
        for rep in range(opts.reps):
            order = list(daemons) if rep % 2 == 0 else list(reversed(daemons))
            for backend, depth in configs:
                runs = [(name, lambda n=name: run_daemon(daemons[n], backend, image, depth, opts.seconds, workdir,
                                                         opts.poll)) for name in order]
                if backend == "file-tmpfs" and "fio" in opts.peers:
                    runs.append(("fio", lambda: run_fio(image, depth, opts.seconds)))
                for name, fn in runs:
                    rows.add(rep=rep, backend=backend, iodepth=depth, target=name, client_poll=opts.poll, **fn())
    finally:
        subprocess.run(["rm", "-rf", workdir])

    def med(key, backend, depth, name):
        return median([r for r in rows.all if (r["backend"], r["iodepth"], r["target"]) == (backend, depth, name)],
                      key)

    def cell(value, form):
        return format(value, form) if value is not None else "—"

    names = [n for n in daemons if n != "qsd"]
    print("| back-end | 4k randread | " + " | ".join(f"{n} IOPS" for n in names) + " | QSD IOPS | "
          + " | ".join(f"{n}/QSD" for n in names) + " | " + " | ".join(f"{n} p50/p99 µs" for n in names)
          + " | QSD p50/p99 µs | " + " | ".join(f"{n} CPU µs/IO" for n in names)
          + " | QSD CPU µs/IO | fio floor IOPS (p50 µs) |")
    print("|---" * (5 * len(names) + 5) + "|")
    for backend, depth in configs:
        iops = {n: med("iops", backend, depth, n) for n in daemons}
        kilo = lambda v: f"{v / 1000:.0f}k" if v else "—"  # noqa: E731
        lat = lambda n: f"{cell(med('p50_us', backend, depth, n), '.0f')} / {cell(med('p99_us', backend, depth, n), '.0f')}"  # noqa: E501,E731
        floor = med("iops", backend, depth, "fio")
        floor_text = f"{floor / 1000:.0f}k ({med('p50_us', backend, depth, 'fio'):.0f})" if floor else "—"
        ratios = [f"{iops[n] / iops['qsd']:.2f}x" if iops.get(n) and iops.get("qsd") else "—" for n in names]
        cells = ([backend, f"iodepth {depth}"] + [kilo(iops[n]) for n in names] + [kilo(iops.get("qsd"))] + ratios
                 + [lat(n) for n in names] + [lat("qsd")]
                 + [cell(med("cpu_us_per_io", backend, depth, n), ".2f") for n in names]
                 + [cell(med("cpu_us_per_io", backend, depth, "qsd"), ".2f"), floor_text])
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
