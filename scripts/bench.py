#!/usr/bin/env python3
"""The benchmark studies of scripts/bench/, from one place.

  scripts/bench.py list                  every study, one line each
  scripts/bench.py run STUDY [FLAGS]     run one (`run STUDY --help`: its flags)
  scripts/bench.py table [--check]       write BENCHMARKS.md's "Where vsd stands"
                                         from scripts/bench/standings.json
                                         (--check: fail if it differs)

Shared flags of `run`: --reps, --seconds, --peers, --baseline VSD, --cpus
DAEMON/CLIENT, --target-dir DIR, --out ROWS.jsonl (docs/manual/benchmarks.md).
"""
import ast
import json
import os
import re
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
STUDIES = os.path.join(HERE, "bench")
ROOT = os.path.dirname(HERE)
STANDINGS = os.path.join(STUDIES, "standings.json")
BENCHMARKS = os.path.join(ROOT, "BENCHMARKS.md")
# The standing table lies between these lines of BENCHMARKS.md.
BEGIN, END = "<!-- standings: begin (scripts/bench.py table) -->", "<!-- standings: end -->"


def studies():
    """Each study's name and file."""
    names = sorted(f[:-3] for f in os.listdir(STUDIES) if f.endswith(".py") and f != "benchlib.py")
    return {name: os.path.join(STUDIES, name + ".py") for name in names}


def summary(path):
    """The first sentence of a study's docstring, on one line."""
    with open(path) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    return re.split(r"(?<=[.:?])\s", text, maxsplit=1)[0].rstrip(":.")


def run(name, argv):
    path = studies().get(name)
    if path is None:
        sys.exit(f"no study '{name}' (scripts/bench.py list shows them)")
    sys.path.insert(0, STUDIES)
    sys.argv = [path, *argv]
    runpy.run_path(path, run_name="__main__")


def render(standings):
    """The Markdown of the standing table."""
    lines = [BEGIN, "", "| workload | vsd | best peer, same run | vsd / peer | date | commit | reproduce |",
             "|---|---|---|---|---|---|---|"]
    for row in standings["rows"]:
        if row.get("peer") is None:
            peer, ratio = f"— ({row['missing']})", "—"
        else:
            peer, ratio = f"{row['peer']}: {row['peer_figure']}", row["ratio"]
        source = f"[{row['date']}]({row['source']})" if row["source"] else row["date"]
        lines.append(f"| {row['workload']} | {row['vsd']} | {peer} | {ratio} | {source} | {row['commit']} "
                     f"| `{row['command']}` |")
    lines += ["", standings["note"], "", END]
    return "\n".join(lines)


def table(check):
    with open(STANDINGS) as f:
        wanted = render(json.load(f))
    with open(BENCHMARKS) as f:
        page = f.read()
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < 0:
        sys.exit(f"BENCHMARKS.md lacks the lines {BEGIN} and {END}")
    current = page[start:end + len(END)]
    if check:
        if current != wanted:
            sys.exit("BENCHMARKS.md's standing table differs from scripts/bench/standings.json: "
                     "run scripts/bench.py table")
        return
    with open(BENCHMARKS, "w") as f:
        f.write(page[:start] + wanted + page[end + len(END):])


def main():
    argv = sys.argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return
    command, rest = argv[0], argv[1:]
    if command == "list":
        for name, path in studies().items():
            print(f"{name:20} {summary(path)}")
    elif command == "run" and rest:
        run(rest[0], rest[1:])
    elif command == "table" and rest in ([], ["--check"]):
        table(check=bool(rest))
    else:
        sys.exit(f"usage: scripts/bench.py list | run STUDY [FLAGS] | table [--check] (not: {' '.join(argv)})")


if __name__ == "__main__":
    main()
