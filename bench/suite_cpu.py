"""Where the suite's time goes: wall time against CPU time, per file and per test.

    AUTOLOOP_TEST_CPU_LOG=/tmp/cpu.jsonl python -m pytest -n 2    # record (tests/conftest.py)
    python bench/suite_cpu.py /tmp/cpu.jsonl [--top 25]            # print
    python bench/suite_cpu.py /tmp/cpu.jsonl --against /tmp/old.jsonl   # what changed since

Each line of the log is one test: its wall time (setup, call and teardown) and the CPU
seconds its pytest process and every process it started used meanwhile (sandboxed trainings,
scorers and model servers included), read from a cgroup of the pytest process's own where
it may make one (root with cgroup v1's cpuacct); elsewhere from getrusage, which misses
whatever ran in a sandbox's pid namespace (the header says which). A test whose CPU is far below its
wall time waits (a time budget, a sleep, a timeout): more workers than cores would overlap
such tests; a test near or above one CPU second a second keeps its core busy, and only less
work makes it shorter. Prints the suite's span, the CPU it used against what the cores
could give (`busy`), the most disk it held (from the free disk read before, during and after
each test), and the files and tests with the most wall time.

`--against OLD` compares two runs. A shared machine's pace changes from run to run (the
same unchanged tests took 14% more CPU on one run than on the one before, at the median),
so the comparison first measures the pace, the median ratio of CPU over the tests in both
with at least MIN_CPU seconds, then states this run's CPU at the old pace (what the work
changed, apart from the machine) and the tests furthest from the pace.
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


def disk(rows: list[dict]) -> dict | None:
    """The free disk where the tests wrote, at the first test's start and at its lowest
    (each test is read at its start, after its call and after its teardown); None for a log
    without it. What the suite held at most is the difference, give or take what other
    processes on the machine wrote meanwhile."""
    read = sorted((r for r in rows if r.get("disk_free_gb") and r["disk_free_gb"][0] is not None),
                  key=lambda r: r["start"])
    if not read:
        return None
    first = read[0]["disk_free_gb"][0]
    lowest = min(gb for r in read for gb in r["disk_free_gb"] if gb is not None)
    return {"free_at_start_gb": first, "least_free_gb": lowest, "held_at_most_gb": first - lowest}


MIN_CPU = 3.0  # CPU seconds: below this a test's ratio is mostly start-up noise


def compare(old: list[dict], new: list[dict], min_cpu: float = MIN_CPU) -> dict:
    """The machine's pace (median new/old CPU ratio over the tests in both runs with at least
    `min_cpu` in the old), the new run's CPU at the old pace, and every test of either run
    with its CPU beyond what the pace predicts (`excess`, most first; a test in one run only
    counts whole)."""
    import statistics

    before, after = {r["test"]: r["cpu"] for r in old}, {r["test"]: r["cpu"] for r in new}
    ratios = [after[t] / before[t] for t in before if t in after and before[t] >= min_cpu]
    pace = statistics.median(ratios) if ratios else 1.0
    changes = [(t, before.get(t), after.get(t), (after.get(t) or 0.0) - (before.get(t) or 0.0) * pace)
               for t in before.keys() | after.keys()]
    return {"pace": pace, "tests_compared": len(ratios), "old_cpu": sum(before.values()), "new_cpu": sum(after.values()),
            "new_cpu_at_old_pace": sum(after.values()) / pace,
            "changes": sorted(changes, key=lambda c: -abs(c[3]))}


def _print_comparison(c: dict, top: int) -> None:
    change = c["new_cpu_at_old_pace"] / c["old_cpu"] - 1 if c["old_cpu"] else 0.0
    print(f"\nagainst the old run: the machine's pace {c['pace']:.2f}x (the median CPU ratio of {c['tests_compared']} "
          f"tests in both, of {MIN_CPU:g} CPU s or more); CPU {c['old_cpu']:.0f} s -> {c['new_cpu']:.0f} s, "
          f"{c['new_cpu_at_old_pace']:.0f} s at the old pace: the work changed by {100 * change:+.0f}%")
    print(f"{'old CPU':>8} {'new CPU':>8} {'beyond':>8}  test (furthest from the pace)")
    for test, before, after, excess in c["changes"][:top]:
        show = lambda x: f"{x:8.1f}" if x is not None else f"{'-':>8}"  # noqa: E731
        print(f"{show(before)} {show(after)} {excess:+8.1f}  {test}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path, help="the AUTOLOOP_TEST_CPU_LOG file a pytest run wrote")
    parser.add_argument("--top", type=int, default=25, help="files and tests to list")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="the cores the run had")
    parser.add_argument("--against", type=Path, help="an older run's log: what changed, apart from the machine's pace")
    args = parser.parse_args()
    rows = load(args.log)
    s = summary(rows, args.cores)
    sources = sorted({r.get("cpu_source", "?") for r in rows})
    print(f"CPU read from: {', '.join(sources)}" + ("" if sources == ["cgroup"] else " (getrusage misses sandboxed processes)"))
    print(f"{s['tests']} tests on {s['workers']} workers over {s['span_seconds']:.0f} s: wall {s['wall_seconds']:.0f} s "
          f"in all, CPU {s['cpu_seconds']:.0f} s, the {args.cores} cores {100 * s['busy']:.0f}% busy")
    d = disk(rows)
    if d is not None:
        print(f"disk where the tests wrote: {d['free_at_start_gb']:.1f} GB free at the start, {d['least_free_gb']:.1f} GB "
              f"at the least, so the suite held about {d['held_at_most_gb']:.1f} GB at most")
    print(f"\n{'wall s':>8} {'CPU s':>8} {'CPU/wall':>8} {'tests':>5}  file")
    for name, wall, cpu, count in by_file(rows)[:args.top]:
        print(f"{wall:8.1f} {cpu:8.1f} {cpu / wall if wall else 0:8.2f} {count:5d}  {name}")
    print(f"\n{'wall s':>8} {'CPU s':>8} {'CPU/wall':>8}  test")
    for r in sorted(rows, key=lambda r: r["start"] - r["end"])[:args.top]:
        wall, cpu = r["end"] - r["start"], r["cpu"]
        print(f"{wall:8.1f} {cpu:8.1f} {cpu / wall if wall else 0:8.2f}  {r['test']}")
    if args.against:
        _print_comparison(compare(load(args.against), rows), args.top)


if __name__ == "__main__":
    main()
