"""The speed probe's own noise, and what load does to it (calibrates autoloop.decide.confound).

    python bench/probe_noise.py               # 40 readings as the machine is, then beside 2 burners
    python bench/probe_noise.py --readings 80 --burners 2

For each condition (the machine as it is now, then beside N `python -c "while True: pass"`
burners) it takes `--readings` probe readings (autoloop.measure.probe.machine_speed) a
short pause apart, and prints: the load average, the median speed, the spread of one
reading (sd of log speed), and the spread of the figure a pair is judged on: the log
ratio of two runs' speeds, each run's speed the mean of two readings (before and after
its training), as the worker records it. Then the ratio of the busy median to the quiet
one: the size of the change the rule must see. The tolerance in autoloop/decide/
confound.py must sit well above the pair spread of both conditions and well below that
ratio.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoloop.measure.probe import machine_speed  # noqa: E402


def readings(n: int, pause: float) -> list[float]:
    out = []
    for _ in range(n):
        out.append(machine_speed())
        time.sleep(pause)
    return out


def pair_spread(values: list[float]) -> float:
    """sd of log(speed of run A / speed of run B), a run's speed being the mean of two
    consecutive readings; runs taken from the sequence in order, so slow drifts count."""
    runs = [(values[i] + values[i + 1]) / 2 for i in range(0, len(values) - 1, 2)]
    ratios = [math.log(a / b) for a, b in zip(runs, runs[1:])]
    return statistics.pstdev(ratios) if len(ratios) > 1 else float("nan")


def summary(label: str, values: list[float]) -> dict:
    logs = [math.log(v) for v in values]
    return {"condition": label, "load": os.getloadavg()[0], "median": statistics.median(values),
            "min": min(values), "max": max(values), "sd_log": statistics.pstdev(logs), "pair_sd_log": pair_spread(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readings", type=int, default=40)
    parser.add_argument("--burners", type=int, default=2)
    parser.add_argument("--pause", type=float, default=0.2, help="seconds between readings")
    args = parser.parse_args()
    rows = [summary("as the machine is", readings(args.readings, args.pause))]
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    try:
        time.sleep(1.0)
        rows.append(summary(f"beside {args.burners} burners", readings(args.readings, args.pause)))
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    print(f"{'condition':<22} {'load':>5} {'median':>7} {'min':>6} {'max':>6} {'sd log':>7} {'pair sd':>8}")
    for r in rows:
        print(f"{r['condition']:<22} {r['load']:5.1f} {r['median']:7.2f} {r['min']:6.2f} {r['max']:6.2f} "
              f"{r['sd_log']:7.3f} {r['pair_sd_log']:8.3f}")
    ratio = rows[1]["median"] / rows[0]["median"]
    print(f"busy / as-is median speed: {ratio:.2f} (log {math.log(ratio):+.2f}); speeds in million loop iterations/s")
    from autoloop.decide.confound import SPEED_TOLERANCE

    print(f"tolerance in autoloop/decide/confound.py: |log ratio| > {SPEED_TOLERANCE} "
          f"(a {math.exp(SPEED_TOLERANCE) - 1:.0%} change) makes a pair confounded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
