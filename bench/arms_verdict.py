"""The pre-registered verdict on the proposal scheduler (issue 33; docs/search.md, "The
larger check, fixed before it runs"): several nights of `bench/night.py --arms`, one per
base seed, read from their `--json` files, and the one figure the decision rests on.

    python bench/arms_verdict.py arms-1337.json arms-2337.json arms-3337.json

For each base seed s the difference D_s = the scheduler's re-measured val gain minus that
of the better single-source arm, the better one being the arm (model-only or search-only)
with the higher mean gain over all the seeds: fixed once, not picked per seed, so the
scheduler is never compared with whichever arm happened to lose that night. The verdict is
met when the mean of D is positive and at least one standard error of D over the seeds
(sd / sqrt(n)): night-to-night spread, which one night's reserve seeds cannot see. One
seed gives no spread, so it gives no verdict.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

SINGLE = ("model-only", "search-only")


def gains(rows: list[dict]) -> dict[str, float]:
    """Arm -> its re-measured val gain, from one night's `bench/night.py --arms --json` rows."""
    return {r["rule"]: float(r["val"]["gain"]) for r in rows}


def verdict(nights: list[list[dict]]) -> dict:
    per_seed = [gains(rows) for rows in nights]
    for k, g in enumerate(per_seed):
        missing = [arm for arm in ("scheduler", *SINGLE) if arm not in g]
        if missing:
            raise SystemExit(f"night {k + 1} has no {missing[0]} arm: run bench/night.py with "
                             "--arms scheduler model-only search-only")
    means = {arm: statistics.fmean(g[arm] for g in per_seed) for arm in ("scheduler", *SINGLE)}
    better = max(SINGLE, key=lambda arm: means[arm])
    diffs = [g["scheduler"] - g[better] for g in per_seed]
    n = len(diffs)
    mean = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(n) if n >= 2 else None
    met = se is not None and mean > 0 and mean >= se
    return {"nights": n, "means": means, "better": better, "diffs": diffs, "mean": mean, "se": se, "met": met}


def describe(v: dict) -> str:
    lines = [f"{v['nights']} nights; mean re-measured val gain per arm: "
             + ", ".join(f"{arm} {gain:+.4f}" for arm, gain in v["means"].items()),
             f"the better single-source arm: {v['better']}",
             "scheduler minus it, per night: " + ", ".join(f"{d:+.4f}" for d in v["diffs"])]
    if v["se"] is None:
        lines.append("one night has no night-to-night spread: no verdict")
    else:
        lines.append(f"mean {v['mean']:+.4f}, standard error over the nights {v['se']:.4f} -> "
                     + ("MET: the scheduler is ahead by at least one standard error" if v["met"] else "NOT MET"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("nights", nargs="+", type=Path, help="bench/night.py --arms ... --json files, one per base seed")
    args = ap.parse_args(argv)
    print(describe(verdict([json.loads(p.read_text()) for p in args.nights])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
