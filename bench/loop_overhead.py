"""The controller's own overhead per trial, with a training command that returns at once.

    python bench/loop_overhead.py              # 1,000 trials (a few minutes)
    python bench/loop_overhead.py --trials 100

It builds a throwaway git repo whose "training" is a shell script that writes a result
JSON and exits, seeds one idea per trial (a one-constant change), runs the real
Controller in this process, and prints per-trial time split into git, db, proposal and
process (start + wait for the instant child), plus the median total by trial range, so
growth between trial 10 and trial 1,000 shows. Target: median under 0.5 s, no growth.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import bench_repo

FAST_TRAIN = """#!/bin/sh
# Instant "training": the contract's result JSON, nothing else.
LR=0.02  # placeholder so the file has a constant
echo '{"val_bpb": 1.5, "training_seconds": 0.0, "total_seconds": 0.0, "num_steps": 1}' > "$AUTOLOOP_RESULT"
"""
TRAIN_PY = "LR = 0.02  # learning rate\n"


def make_repo(root: Path) -> Path:
    return bench_repo.make_repo(root, TRAIN_PY, {"fast_train.sh": FAST_TRAIN})


class Timers:
    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, bucket: str):
        original = getattr(owner, name)
        timers = self

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timers.totals[bucket] += time.perf_counter() - start

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        out = dict(self.totals)
        self.totals.clear()
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    args = parser.parse_args()

    import autoloop.loop.controller as controller_mod
    import autoloop.measure.executors.serial as serial_mod
    from autoloop.config import resolve
    from autoloop.loop.controller import Controller
    from autoloop.gitops import GitRepo
    from autoloop.store import Store

    timers = Timers()
    for name in ("commit_files", "checkout_commit", "archive", "diff", "show_file", "branch_commit", "is_dirty",
                 "archived", "commit_exists"):
        timers.wrap(GitRepo, name, "git")
    for name in ("new_trial", "update_trial", "trials", "best_trial", "get_run", "trial_by_id", "add_curve",
                 "set_idea_status", "stop_requested", "add_event"):
        timers.wrap(Store, name, "db")
    timers.wrap(serial_mod, "run_training", "process")
    timers.wrap(controller_mod, "materialize", "proposal")
    timers.wrap(controller_mod, "validate", "proposal")

    with tempfile.TemporaryDirectory() as tmp:
        repo = make_repo(Path(tmp) / "repo")
        os.environ.setdefault("AUTOLOOP_CACHE_DIR", str(Path(tmp) / "cache"))
        store = Store(repo / "experiments.db")
        with store.transaction():
            for i in range(args.trials):
                store.add_idea(f"lr {i}", sets={"LR": f"{0.01 + i * 1e-6:.6f}"})
        store.close()
        config = resolve(repo, {"tag": "bench", "max_trials": args.trials + 1, "train_command": "sh fast_train.sh",
                                "proposers": "ideas", "time_budget": 5, "grace_seconds": 30, "verify": False})
        ctl = Controller(config, repo, verifier=None)
        per_trial: list[dict] = []
        original_execute = ctl.execute

        def execute(item, ctx):
            timers.take()
            start = time.perf_counter()
            trial = original_execute(item, ctx)
            split = timers.take()
            end = time.perf_counter()
            split["total"] = end - start
            # The whole cycle: from the previous trial's end (stop checks, scheduler,
            # proposer chain) to this one's.
            split["cycle"] = end - (per_trial[-1]["end"] if per_trial else start)
            split["end"] = end
            per_trial.append(split)
            return trial

        ctl.execute = execute
        # Proposal time outside execute (asking the chain) counts too.
        timers.wrap(type(ctl.chain()), "propose", "proposal_chain")
        start = time.perf_counter()
        summary = ctl.run()
        elapsed = time.perf_counter() - start

    print(f"trials: {summary.trials_run}  wall: {elapsed:.1f} s  ({elapsed / max(summary.trials_run, 1):.3f} s/trial)")
    print("per-trial seconds (median):")
    for bucket in ("cycle", "total", "process", "git", "db", "proposal"):
        values = [t.get(bucket, 0.0) for t in per_trial]
        print(f"  {bucket:<9} {statistics.median(values):.4f}")
    overhead = [t["cycle"] - t.get("process", 0.0) for t in per_trial]
    print(f"controller overhead per trial (cycle - process), median: {statistics.median(overhead):.4f} s")
    print("median cycle by trial range (growth check):")
    for lo in (1, 10, 100, 500, 900):
        hi = min(lo + 10, len(per_trial))
        if lo < len(per_trial):
            window = [t["cycle"] for t in per_trial[lo:hi]]
            print(f"  trials {lo:>4}-{hi:<4} {statistics.median(window):.4f} s")


if __name__ == "__main__":
    sys.exit(main())
