#!/usr/bin/env python3
"""The Markdown tables of a fast-path matrix run (`vsd-lab run
lab/specs/fast-path.toml`) for BENCHMARKS.md: one table per back-end, one
row per block size x pattern x iodepth, medians over the repetitions.

Columns: vsd's and QSD's IOPS at 1 queue x 1 job and their ratio, vsd/QSD
at 2 queues x 1 job and 2 x 2, each daemon's 2x2 against its own 1x1, the
host's fio (1 job / 2 jobs) and vsd against it, CPU per I/O vsd/QSD at
1x1, vsd's events per I/O at 1x1; with --before, vsd at 1x1 against vsd
in an earlier run's rows. Ratios are of the medians.

Usage: scripts/bench.py run fast-path-table RESULTS.jsonl [--before OLD.jsonl]
"""

import argparse
import json
import statistics
from collections import defaultdict


def load(path):
    """Medians per (matrix, daemon, queues, jobs, bs, rw, iodepth): IOPS,
    CPU per I/O, and vsd's events per I/O."""
    runs = defaultdict(list)
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if row.get("error") or not row.get("result"):
                continue
            c = row["config"]
            key = (row["matrix"], c["daemon"], c["queues"], c["jobs"], c["bs"], c["rw"], c["iodepth"])
            runs[key].append(row["result"])
    return {key: summarize(results) for key, results in runs.items()}


def summarize(results):
    """The medians of one configuration's repetitions."""
    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    events = [(r.get("breakdown") or {}).get("events_per_io") or {} for r in results]
    return {
        "iops": med(r["iops"] for r in results),
        "cpu": med(r.get("daemon_cpu_us_per_io") for r in results),
        "events": {name: med(e.get(name) for e in events) for name in ("kicks", "calls", "io_uring_enter")},
    }


def ratio(a, b):
    return f"{a / b:.2f}" if a and b else "-"


def iops(cell):
    return cell.get("iops")


def kilo(value):
    return f"{value / 1000:.1f}k" if value else "-"


def table(cells, matrix, before):
    """Prints the table of `matrix`."""
    def get(daemon, queues, jobs, bs, rw, qd):
        return cells.get((matrix, daemon, queues, jobs, bs, rw, qd), {})

    shapes = sorted({key[4:] for key in cells if key[0] == matrix})
    header = ["bs", "rw", "qd", "vsd 1x1", "QSD 1x1", "vsd/QSD 1x1", "2x1", "2x2", "vsd 2x2/1x1",
              "QSD 2x2/1x1", "fio 1 job / 2 jobs", "vsd/fio 1x1", "CPU µs/IO vsd/QSD 1x1",
              "kicks/calls/enters per IO 1x1"] + (["vsd 1x1 now/before"] if before else [])
    print(f"#### {matrix}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for bs, rw, qd in shapes:
        vsd = {shape: get("vsd", *shape, bs, rw, qd) for shape in ((1, 1), (2, 1), (2, 2))}
        qsd = {shape: get("qsd", *shape, bs, rw, qd) for shape in ((1, 1), (2, 1), (2, 2))}
        fio1, fio2 = get("fio", 1, 1, bs, rw, qd), get("fio", 1, 2, bs, rw, qd)
        events = vsd[(1, 1)].get("events", {})
        counts = [events.get(n) for n in ("kicks", "calls", "io_uring_enter")]
        row = [f"{bs // 1024}k", rw, str(qd), kilo(iops(vsd[(1, 1)])), kilo(iops(qsd[(1, 1)])),
               ratio(iops(vsd[(1, 1)]), iops(qsd[(1, 1)])), ratio(iops(vsd[(2, 1)]), iops(qsd[(2, 1)])),
               ratio(iops(vsd[(2, 2)]), iops(qsd[(2, 2)])), ratio(iops(vsd[(2, 2)]), iops(vsd[(1, 1)])),
               ratio(iops(qsd[(2, 2)]), iops(qsd[(1, 1)])),
               f"{kilo(iops(fio1))} / {kilo(iops(fio2))}" if fio1 else "- / -",
               ratio(iops(vsd[(1, 1)]), iops(fio1)),
               ratio(vsd[(1, 1)].get("cpu"), qsd[(1, 1)].get("cpu")),
               "/".join(f"{c:.2f}" if c is not None else "-" for c in counts)]
        if before:
            old = before.get((matrix, "vsd", 1, 1, bs, rw, qd), {})
            row.append(ratio(iops(vsd[(1, 1)]), iops(old)))
        print("| " + " | ".join(row) + " |")
    print()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results")
    parser.add_argument("--before", help="an earlier run's rows, for vsd now against vsd then")
    opts = parser.parse_args()
    cells = load(opts.results)
    before = load(opts.before) if opts.before else None
    for matrix in dict.fromkeys(key[0] for key in cells):
        table(cells, matrix, before)


if __name__ == "__main__":
    main()
