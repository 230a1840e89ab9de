#!/usr/bin/env python3
"""vsd and qemu-storage-daemon against the host's fio on a raw file on the
disk with cache.direct=on, for each placement of the daemon and the client
on the two CPUs, in one run, interleaved, medians and paired ratios.

Why placements: the disk's completion interrupts arrive on one CPU (on
these machines virtio-blk has one request queue, and its interrupt is
bound to CPU 1). fio pinned there completes its I/O where the interrupt
lands; a daemon on the other CPU is woken across CPUs for every batch of
completions, one cross-CPU wake-up (25-30 us here) more per round trip
than fio pays. The script prints where the disk's interrupts went in
each run, so the table says which CPU took them.

It also reads the disk's own statistics (sysfs `stat`) around every run:
the mean time a request spent in the block layer and the device (device
await), whoever sent it. Comparing it across vsd, QSD and fio separates
time the daemons add on their side from time the disk itself takes.

With --poll, vsd-bench runs libblkio's poll mode (the client spins on
its completions instead of sleeping on the call eventfd). With --baseline,
a second vsd binary (an earlier build) runs in the same interleave, as a
fourth column; each --variant NAME=PROGRAM adds one more (a build, or a
wrapper script that sets an environment variable and execs vsd). With
--aio io_uring,native each daemon runs with each `aio=` mode (libvirt's
io='native' is aio=native), the others named DAEMON-MODE.

Usage: scripts/bench.py run disk [--seconds 5] [--reps 5] [--cases randread:32,...]
       [--poll] [--placements 0/1,1/0] [--baseline VSD] [--variant NAME=VSD ...] [--aio io_uring,native]
       [--disk-dir /var/tmp]
       [--out FILE.jsonl]
       scripts/bench.py run disk --report ROWS.jsonl
Prints a Markdown table for BENCHMARKS.md.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

import benchlib
from benchlib import QSD, VSD, serve_and_bench

IMAGE_SIZE = "1G"
def block_device(path):
    """The sysfs directory of the whole block device holding `path`."""
    dev = os.stat(path).st_dev
    block = os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if os.path.exists(os.path.join(block, "partition")):
        block = os.path.dirname(block)
    return block


def disk_irqs(block):
    """The interrupt numbers of the PCI device behind `block` (empty if
    sysfs does not say)."""
    device = os.path.realpath(os.path.join(block, "device"))
    for candidate in (device, os.path.dirname(device)):
        msi = os.path.join(candidate, "msi_irqs")
        if os.path.isdir(msi):
            return set(os.listdir(msi))
    return set()


def disk_counts(block):
    """The device's reads and writes completed, and milliseconds spent on
    them, so far (its `stat` file: fields 1, 4, 5 and 8)."""
    with open(os.path.join(block, "stat")) as f:
        fields = [int(n) for n in f.read().split()]
    return fields[0] + fields[4], fields[3] + fields[7]


def device_await_us(before, after):
    """Mean time a request spent in the block layer and the device between
    two `disk_counts`, in microseconds: what the disk itself took, whoever
    sent the request."""
    ios, ms = after[0] - before[0], after[1] - before[1]
    return 1000 * ms / ios if ios else None


def irq_counts(irqs):
    """Interrupts so far of `irqs`, per CPU."""
    with open("/proc/interrupts") as f:
        cpus = len(f.readline().split())
        totals = [0] * cpus
        for line in f:
            fields = line.split()
            if fields and fields[0].rstrip(":") in irqs:
                totals = [t + int(n) for t, n in zip(totals, fields[1:1 + cpus])]
    return totals


def run_fio(image, rw, depth, seconds, cpu):
    job = benchlib.fio(["--name=floor", f"--filename={image}", f"--rw={rw}", "--bs=4k", f"--iodepth={depth}",
                        "--ioengine=io_uring", "--direct=1", f"--runtime={seconds}", "--time_based",
                        "--ramp_time=1"], cpu)["jobs"][0]
    iops = job["read"]["iops"] + job["write"]["iops"]
    side = job["read"] if job["read"]["iops"] else job["write"]
    return {"iops": iops, "p50_us": benchlib.clat_us(side, 50), "cpu_us_per_io": None}


def run_daemon(program, aio, image, rw, depth, seconds, workdir, placement, poll):
    blockdevs = [f"driver=file,node-name=file0,filename={image},aio={aio},cache.direct=on",
                 "driver=raw,node-name=disk0,file=file0"]
    bench = ["--rw", rw, "--bs", "4k", "--iodepth", str(depth)] + (["--poll"] if poll else [])
    return serve_and_bench(program, blockdevs, bench, seconds, workdir, cpus=placement)


def main():
    parser = benchlib.parser(__doc__, reps=5, seconds=5)
    parser.add_argument("--cases", default="randread:32", help="comma-separated RW:IODEPTH")
    parser.add_argument("--poll", action="store_true", help="libblkio poll mode in the client")
    parser.add_argument("--placements", default="0/1,1/0",
                        help="comma-separated DAEMON_CPU/CLIENT_CPU pairs (default: both ways)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=VSD",
                        help="one more vsd program to run as target NAME (repeatable)")
    parser.add_argument("--aio", default="io_uring", help="comma-separated aio= modes every daemon runs with")
    parser.add_argument("--disk-dir", default="/var/tmp")
    parser.add_argument("--report", metavar="ROWS.jsonl", help="only print the table of an earlier run")
    opts = benchlib.parse(parser)
    if opts.report:
        with open(opts.report) as f:
            return report([json.loads(line) for line in f])
    cases = [(rw, int(depth)) for rw, depth in (c.split(":") for c in opts.cases.split(","))]

    workdir = tempfile.mkdtemp(prefix="vsd-bench-", dir="/dev/shm")
    image = os.path.join(opts.disk_dir, "vsd-bench-disk.raw")
    subprocess.run(["qemu-img", "create", "-q", "-f", "raw", "-o", "preallocation=full", image, IMAGE_SIZE],
                   check=True)
    block = block_device(image)
    irqs = disk_irqs(block)
    placements = [tuple(p.split("/")) for p in opts.placements.split(",")]
    variants = dict(v.split("=", 1) for v in opts.variant)
    binaries = {"vsd": VSD, **({"base": opts.baseline} if opts.baseline else {}), **variants, "qsd": QSD}
    aios = opts.aio.split(",")
    programs = {name if i == 0 else f"{name}-{aio}": (program, aio)
                for name, program in binaries.items() for i, aio in enumerate(aios)}
    names = (*programs, "fio")
    targets = [(name, placement) for placement in placements for name in names]
    lines = []
    out = open(opts.out, "a") if opts.out else None
    try:
        for rep in range(opts.reps):
            order = targets if rep % 2 == 0 else list(reversed(targets))
            for rw, depth in cases:
                for name, placement in order:
                    before, disk_before = irq_counts(irqs), disk_counts(block)
                    if name == "fio":
                        result = run_fio(image, rw, depth, opts.seconds, placement[1])
                    else:
                        result = run_daemon(*programs[name], image, rw, depth, opts.seconds, workdir, placement,
                                            opts.poll)
                    irq = [a - b for a, b in zip(irq_counts(irqs), before)]
                    line = {"rep": rep, "rw": rw, "iodepth": depth, "target": name, "daemon_cpu": placement[0],
                            "client_cpu": placement[1], "client_poll": opts.poll, "disk_irqs_per_cpu": irq,
                            "device_await_us": device_await_us(disk_before, disk_counts(block)), **result}
                    lines.append(line)
                    print(json.dumps(line), file=sys.stderr)
                    if out:
                        print(json.dumps(line), file=out, flush=True)
    finally:
        subprocess.run(["rm", "-rf", workdir, image])

    report(lines)


LABELS = {"vsd": "vsd", "base": "vsd (baseline)", "qsd": "QSD", "fio": "fio"}


def label(name):
    """A target's column name: variants go by their own names."""
    return LABELS.get(name, name)


def report(lines):
    """Prints the table of `lines` (rows as written to --out)."""
    rows = {}
    for line in lines:
        placement = (line["daemon_cpu"], line["client_cpu"])
        rows.setdefault((line["client_poll"], line["rw"], line["iodepth"], placement), {}).setdefault(
            line["target"], []).append(line)
    present = {n for by_target in rows.values() for n in by_target}
    names = [n for n in LABELS if n in present and n not in ("qsd", "fio")]
    names += sorted(present - set(LABELS)) + [n for n in ("qsd", "fio") if n in present]
    daemons = [n for n in names if n != "fio"]
    pairs = [(n, "fio") for n in daemons] + [("vsd", n) for n in daemons if n != "vsd"]
    header = (["4k", "client", "daemon CPU / client CPU"] + [f"{label(n)} IOPS" for n in names]
              + [f"{label(a)}/{label(b)}, paired median" for a, b in pairs]
              + [f"CPU µs/IO, {' / '.join(label(n) for n in daemons)}",
                 f"device await µs, {' / '.join(label(n) for n in names)}", "disk interrupts on CPU 0 / 1"])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for (poll, rw, depth, placement), by_target in sorted(rows.items()):
        def paired(a, b):
            return f"{statistics.median(x['iops'] / y['iops'] for x, y in zip(by_target[a], by_target[b])):.2f}"

        def med(name, key, scale=1, digits=1):
            # Rows of runs before the script recorded a figure have none.
            values = [r[key] for r in by_target[name] if r.get(key)]
            return f"{statistics.median(values) / scale:.{digits}f}" if values else "-"

        irq = [statistics.median(r["disk_irqs_per_cpu"][i] for r in by_target["vsd"]) for i in range(2)]
        share = irq[0] / max(sum(irq), 1)
        cells = ([f"{rw} qd{depth}", "poll" if poll else "interrupt", f"{placement[0]} / {placement[1]}"]
                 + [med(n, "iops", 1000) + "k" for n in names] + [paired(a, b) for a, b in pairs]
                 + [" / ".join(med(n, "cpu_us_per_io", 1, 2) for n in daemons),
                    " / ".join(med(n, "device_await_us", 1, 0) for n in names),
                    f"{share:.0%} / {1 - share:.0%}"])
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
