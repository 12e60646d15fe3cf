"""What `autoloop check` costs: its wall time, per part, and its share of a default night.

    python bench/check_cost.py [--repo .] [--hours 8] [--repeats 1]

Runs the whole check (overfit, LR range test, budget plan, device health) on the
repository's train.py in a temporary copy (so .autoloop/check of the repository is left
alone), as `autoloop run` would at start-up, and prints the figures. Not a test: the
numbers depend on the machine and its load, which is printed beside them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--hours", type=float, default=8.0, help="the night the share is of (8 h by default)")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    from autoloop.check import run_check

    totals, parts = [], {}
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="check-cost-") as tmp:
            repo = Path(tmp)
            shutil.copy(args.repo / "train.py", repo / "train.py")
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
            start = time.perf_counter()
            result = run_check(repo, hours=args.hours, say=lambda line: None)
            totals.append(time.perf_counter() - start)
            for name in ("overfit", "lr", "device"):
                seconds = (result.get(name) or {}).get("seconds")
                if seconds is not None:
                    parts.setdefault(name, []).append(seconds)
            print(f"run {i + 1}: {totals[-1]:.1f} s (load {load:.1f} on {os.cpu_count()} cores, device {result['device_type']})")
    total = statistics.median(totals)
    night = args.hours * 3600
    print(f"autoloop check: {total:.1f} s (median of {len(totals)}), "
          f"{100 * total / night:.3f}% of a {args.hours:g} h night")
    for name, values in parts.items():
        print(f"  {name}: {statistics.median(values):.1f} s")


if __name__ == "__main__":
    main()
