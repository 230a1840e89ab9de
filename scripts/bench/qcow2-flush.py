#!/usr/bin/env python3
"""qcow2 writes that allocate and must be durable: a `writethrough=on`
export of a fresh (empty) 64 GiB qcow2 image, 4k random writes over the
whole disk, so that nearly every write allocates a cluster and is answered
only once its data and metadata are flushed. With --overlay the image is
an overlay over a raw backing file of the same size, filled with data, so
that every write also copies the rest of its 64 KiB cluster up from the
backing file; --cache writeback measures without writethrough; --direct
opens the files with cache.direct=on (the disk only: tmpfs has no
O_DIRECT), so that what the copy-ups read comes from the disk;
--backing-delay-ms serves the backing file over NBD from nbdkit (its
pattern plugin: data everywhere, nothing stored), each read delayed (a
base image on a slow or distant store). vsd against
qemu-storage-daemon (same export options) and an earlier vsd build
(--baseline), in one run, interleaved, medians; the image on tmpfs (a flush
costs nearly nothing) and on the machine's disk (`--disk-dir`, where it
costs an fsync). Daemon on CPU 0, vsd-bench on CPU 1, 1 queue.

Usage: scripts/bench.py run qcow2-flush [--seconds 5] [--reps 3] [--iodepths 1,16]
       [--size 64G] [--overlay] [--cache writethrough|writeback] [--direct]
       [--places tmpfs,disk] [--backing-delay-ms MS]
       [--baseline VSD] [--disk-dir /var/tmp] [--target-dir DIR]
Prints a Markdown table for BENCHMARKS.md.
"""

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import benchlib
from benchlib import serve_and_bench


def fill(path, size):
    """Writes `size` (qemu-img's spelling) bytes of data to a new file."""
    total = int(size[:-1]) << {"K": 10, "M": 20, "G": 30}[size[-1].upper()]
    chunk = b"\x5a" * (1 << 20)
    with open(path, "wb") as f:
        for _ in range(total // len(chunk)):
            f.write(chunk)


def backing_node(base, workdir, opts, file_opts, servers):
    """The backing node `base0`: file `base`, or, with a delay, an NBD
    node on nbdkit serving its pattern plugin's data (no zeroes, nothing
    stored), each read delayed (the server is added to `servers`)."""
    if opts.backing_delay_ms is None:
        return f"driver=file,node-name=base0,filename={base},read-only=on{file_opts}"
    sock = os.path.join(workdir, "kit.sock")
    servers.append(subprocess.Popen(["nbdkit", "-f", "-r", "-U", sock, "--filter=delay", "pattern",
                                     f"size={opts.size}", f"delay-read={opts.backing_delay_ms}ms"]))
    deadline = time.time() + 10
    while not os.path.exists(sock):
        if time.time() > deadline:
            sys.exit("nbdkit did not start")
        time.sleep(0.05)
    return f"driver=nbd,node-name=base0,server.type=unix,server.path={sock},export=,read-only=on"


def main():
    parser = benchlib.parser(__doc__, reps=3, seconds=5, out=False)
    parser.add_argument("--iodepths", default="1,16")
    parser.add_argument("--size", default="64G", help="the disk's size (qemu-img's spelling)")
    parser.add_argument("--overlay", action="store_true", help="over a raw backing file: every write copies up")
    parser.add_argument("--cache", choices=["writethrough", "writeback"], default="writethrough")
    parser.add_argument("--direct", action="store_true", help="cache.direct=on")
    parser.add_argument("--places", default="tmpfs,disk")
    parser.add_argument("--backing-delay-ms", type=int, help="the backing file on nbdkit, reads this slow")
    parser.add_argument("--disk-dir", default="/var/tmp", help="a directory on a real disk")
    opts = benchlib.parse(parser)
    programs = benchlib.daemons(opts.baseline)
    depths = [int(d) for d in opts.iodepths.split(",")]
    places = {p: {"tmpfs": "/dev/shm", "disk": opts.disk_dir}[p] for p in opts.places.split(",")}
    file_opts = ",aio=io_uring" + (",cache.direct=on" if opts.direct else "")
    export_opts = ",writethrough=on" if opts.cache == "writethrough" else ""

    results = {}
    servers = []
    for place, parent in places.items():
        workdir = tempfile.mkdtemp(prefix="vsd-q2flush-", dir=parent)
        try:
            image = os.path.join(workdir, "disk.qcow2")
            create = ["qemu-img", "create", "-q", "-f", "qcow2", image, opts.size]
            blockdevs = [f"driver=file,node-name=file0,filename={image}{file_opts}",
                         "driver=qcow2,node-name=disk0,file=file0"]
            if opts.overlay:
                base = os.path.join(workdir, "base.raw")
                if opts.backing_delay_ms is None:
                    fill(base, opts.size)
                # The backing node is given (`backing=base0`): the header's name is not opened.
                create[5:5] = ["-u", "-F", "raw", "-b", base]
                blockdevs[1:1] = [backing_node(base, workdir, opts, file_opts, servers)]
                blockdevs[-1] += ",backing=base0"
            for rep in range(opts.reps):
                for depth in depths:
                    for name, program in programs.items():
                        if os.path.exists(image):
                            os.unlink(image)
                        subprocess.run(create, check=True)
                        bench = ["--rw", "randwrite", "--bs", "4k", "--iodepth", str(depth)]
                        row = serve_and_bench(program, blockdevs, bench, opts.seconds, workdir,
                                              export_opts=export_opts)
                        results.setdefault((place, depth, name), []).append(row)
                        print(f"rep {rep} {place} iodepth {depth} {name}: {row['iops']:.0f} IOPS, "
                              f"{row['cpu_us_per_io']:.1f} CPU us/IO", file=sys.stderr)
        finally:
            for server in servers:
                server.kill()
                server.wait()
            servers.clear()
            shutil.rmtree(workdir, ignore_errors=True)

    names = list(programs)
    print("| image on | iodepth | " + " | ".join(f"{n} IOPS (CPU µs/I/O)" for n in names) + " | vsd / qsd |"
          + (" vsd / base |" if "base" in names else ""))
    print("|---" * (len(names) + 3 + ("base" in names)) + "|")
    for place in places:
        for depth in depths:
            rows = {n: results[(place, depth, n)] for n in names}
            med = {n: statistics.median(r["iops"] for r in rows[n]) for n in names}
            cpu = {n: statistics.median(r["cpu_us_per_io"] for r in rows[n]) for n in names}
            cells = " | ".join(f"{med[n]:.0f} ({cpu[n]:.1f})" for n in names)
            line = f"| {place} | {depth} | {cells} | {med['vsd'] / med['qsd']:.2f}x |"
            if "base" in names:
                line += f" {med['vsd'] / med['base']:.2f}x |"
            print(line)


if __name__ == "__main__":
    main()
