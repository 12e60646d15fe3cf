"""Where the suite's time goes: wall time against CPU time, per file and per test.

    AUTOLOOP_TEST_CPU_LOG=/tmp/cpu.jsonl python -m pytest -n 2    # record (tests/conftest.py)
    python bench/suite_cpu.py /tmp/cpu.jsonl [--top 25]            # print

Each line of the log is one test: its wall time (setup, call and teardown) and the CPU
seconds its pytest process and every process it started used meanwhile (sandboxed trainings,
scorers and model servers included), read from a cgroup of the pytest process's own where
it may make one (root with cgroup v1's cpuacct); elsewhere from getrusage, which misses
whatever ran in a sandbox's pid namespace (the header says which). A test whose CPU is far below its
wall time waits (a time budget, a sleep, a timeout): more workers than cores would overlap
such tests; a test near or above one CPU second a second keeps its core busy, and only less
work makes it shorter. Prints the suite's span, the CPU it used against what the cores
could give (`busy`), and the files and tests with the most wall time.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary(rows: list[dict], cores: int) -> dict:
    """The suite's span, total wall and CPU, and how busy the cores were over the span."""
    span = max(r["end"] for r in rows) - min(r["start"] for r in rows)
    wall = sum(r["end"] - r["start"] for r in rows)
    cpu = sum(r["cpu"] for r in rows)
    return {"tests": len(rows), "workers": len({r["worker"] for r in rows}), "span_seconds": span,
            "wall_seconds": wall, "cpu_seconds": cpu, "busy": cpu / (cores * span) if span else 0.0}


def by_file(rows: list[dict]) -> list[tuple[str, float, float, int]]:
    """(file, wall, cpu, tests), most wall first."""
    wall, cpu, count = defaultdict(float), defaultdict(float), defaultdict(int)
    for r in rows:
        name = r["test"].split("::")[0]
        wall[name] += r["end"] - r["start"]
        cpu[name] += r["cpu"]
        count[name] += 1
    return sorted(((f, wall[f], cpu[f], count[f]) for f in wall), key=lambda t: -t[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path, help="the AUTOLOOP_TEST_CPU_LOG file a pytest run wrote")
    parser.add_argument("--top", type=int, default=25, help="files and tests to list")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="the cores the run had")
    args = parser.parse_args()
    rows = load(args.log)
    s = summary(rows, args.cores)
    sources = sorted({r.get("cpu_source", "?") for r in rows})
    print(f"CPU read from: {', '.join(sources)}" + ("" if sources == ["cgroup"] else " (getrusage misses sandboxed processes)"))
    print(f"{s['tests']} tests on {s['workers']} workers over {s['span_seconds']:.0f} s: wall {s['wall_seconds']:.0f} s "
          f"in all, CPU {s['cpu_seconds']:.0f} s, the {args.cores} cores {100 * s['busy']:.0f}% busy")
    print(f"\n{'wall s':>8} {'CPU s':>8} {'CPU/wall':>8} {'tests':>5}  file")
    for name, wall, cpu, count in by_file(rows)[:args.top]:
        print(f"{wall:8.1f} {cpu:8.1f} {cpu / wall if wall else 0:8.2f} {count:5d}  {name}")
    print(f"\n{'wall s':>8} {'CPU s':>8} {'CPU/wall':>8}  test")
    for r in sorted(rows, key=lambda r: r["start"] - r["end"])[:args.top]:
        wall, cpu = r["end"] - r["start"], r["cpu"]
        print(f"{wall:8.1f} {cpu:8.1f} {cpu / wall if wall else 0:8.2f}  {r['test']}")


if __name__ == "__main__":
    main()
