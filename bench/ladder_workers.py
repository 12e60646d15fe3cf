"""A scale-ladder rung trained serially and on N local workers: its wall time, and the same tags.

    python bench/ladder_workers.py [--seconds 3] [--seeds 3] [--workers 2]

The fake train.py of tests/test_ladder_workers.py (val_bpb a known function of its
constants and the seed; at the rung each run sleeps `--seconds`, a GPU run the CPU does
not have to do) gets a short serial night (the baseline, two kept changes), then the
rung `WIDTH=4 SLEEP=<seconds>` is measured on two copies of the run: on the serial slot,
and with the run's executor set to `local` with `--workers` pretend devices. Printed: the
rung's wall seconds, the runs' own seconds (each run's recorded start to end), and the
tags, which must be the same.

On a 2-core CPU shared with other work (issue 34): serial 38.0 s, 2 workers 22.0 s for 12
runs of 3 s (36.0 s of runs), the tags holds / reverses both times: each run on a local
worker pays ~1-2 s for its worker process, which a 5-minute GPU run does not notice.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the fake train.py and its helpers are the tests'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="Seconds each run sleeps at the rung.")
    parser.add_argument("--seeds", type=int, default=3, help="Fresh seeds of the rung (each commit at each).")
    parser.add_argument("--workers", type=int, default=2, help="Local workers (pretend devices on a CPU).")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ladder-workers-"))
    os.environ["AUTOLOOP_CACHE_DIR"] = str(tmp / "cache")  # the tests' fixed corpus key goes there, never into yours
    os.environ.setdefault("AUTOLOOP_PAIR_SPEED_TOLERANCE", "none")  # the fake's runs are too short to probe
    os.environ["AUTOLOOP_CHECK"] = "0"
    from conftest import copy_run, write_test_corpus_key
    from test_ladder import known_night, ladder_known
    from test_ladder_workers import SLEEPY, ladder_runs, on_workers

    try:
        write_test_corpus_key(Path(os.environ["AUTOLOOP_CACHE_DIR"]))
        night = known_night(tmp / "night", SLEEPY, Path(os.environ["AUTOLOOP_CACHE_DIR"]))
        spec = f"WIDTH=4 SLEEP={args.seconds:g}"
        for name, workers in (("serial", 0), (f"{args.workers} workers", args.workers)):
            repo = copy_run(night, tmp / f"w{workers}")
            if workers:
                on_workers(repo, workers)
            started = time.time()
            rung = ladder_known(repo, spec, seeds=args.seeds)
            wall = time.time() - started
            runs = ladder_runs(repo)
            own = sum(r["ran"]["finished"] - r["ran"]["started"] for r in runs if r["ran"])
            print(f"{name:>10}: {len(runs)} runs at {spec}: {wall:.1f} s wall, the runs' own {own:.1f} s; tags "
                  f"{', '.join(f'trial {r.trial} {r.tag}' for r in rung.rows)}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
