"""Trials per hour on 1, 2 and 4 workers, on the local executor and on Ray.

    python bench/parallel_scaling.py [--seconds 5] [--rounds 3] [--workers 1,2,4] [--executors local,ray]

A fake training script that sleeps `--seconds` (a GPU run the CPU does not have to do)
stands in for train.py, so the figure is the loop's own: scheduling, worktrees, worker
processes or Ray tasks, the db and git. For each executor and worker count a throwaway
repository runs the baseline, then `rounds x workers` proposals (one run each, the strict
rule, no verification: the harness is not what is measured). The rate counts proposals
from the first proposal's start to the last one's end.

Target (issue 15): N local workers give at least 0.9 x N the rate of one. The serial
executor (in the controller's process) at one worker is the reference for the overhead
per trial of a worker process (local) and of a Ray actor call.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from bench_repo import make_repo

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FAKE = ROOT / "tests" / "fakes" / "fake_train.py"


def _repo(path: Path, seconds: float) -> Path:
    return make_repo(path, FAKE.read_text().replace("SLEEP = 0.0", f"SLEEP = {seconds}"))


def _ts(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def measure(executor: str, workers: int, seconds: float, rounds: int, tmp: Path) -> dict:
    from autoloop.config import resolve
    from autoloop.loop.controller import Controller
    from autoloop.proposers.seeding import seed_idea
    from autoloop.store import Store

    repo = _repo(tmp / f"{executor}-{workers}", seconds)
    proposals = rounds * workers
    for k in range(proposals):
        # Worse learning rates: every proposal is a discard, so all start from one parent.
        seed_idea(resolve(repo, {}), repo, f"lr {k}", sets=[f"LR={0.03 + 0.001 * k:.3f}"], patch=None)
    flags = {"tag": "bench", "proposers": "ideas", "time_budget": 60, "grace_seconds": 60, "decision_rule": "strict",
             "drift_every": 0, "check": False, "max_trials": 1 + proposals, "executor": executor,
             "workers": 0 if executor == "serial" else workers}
    summary = Controller(resolve(repo, flags), repo, verifier=None).run()
    store = Store(repo / "experiments.db")
    rows = store.trials(store.get_run("bench")["id"])
    store.close()
    done = [r for r in rows[1:] if r["status"] in ("keep", "discard")]
    if len(done) != proposals:
        raise SystemExit(f"{executor} x{workers}: {len(done)} of {proposals} proposals finished ({summary.stop_reason})")
    span = max(_ts(r["finished_at"]) for r in done) - min(_ts(r["started_at"]) for r in done)
    per_trial = sum(_ts(r["finished_at"]) - _ts(r["started_at"]) for r in done) / len(done)
    return {"executor": executor, "workers": workers, "trials": len(done), "span": span,
            "per_hour": 3600 * len(done) / span, "per_trial": per_trial}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="what one fake training run takes")
    parser.add_argument("--rounds", type=int, default=3, help="proposals per worker")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--executors", default="serial,local,ray")
    args = parser.parse_args()
    os.environ.setdefault("AUTOLOOP_CHECK", "0")
    counts = [int(n) for n in args.workers.split(",")]
    executors = [e for e in args.executors.split(",") if e]
    if "ray" in executors:
        try:
            import ray  # noqa: F401
        except ImportError:
            print("ray is not installed (pip install -e '.[ray]'): measuring the local executor only")
            executors = [e for e in executors if e != "ray"]
    tmp = Path(tempfile.mkdtemp(prefix="autoloop-scale-"))
    results = []
    try:
        for executor in executors:
            if executor == "ray":
                _start_ray(tmp, max(counts))
            for n in ([1] if executor == "serial" else counts):
                started = time.monotonic()
                r = measure(executor, n, args.seconds, args.rounds, tmp)
                results.append(r)
                print(f"{executor:5s} x{n}: {r['trials']} trials in {r['span']:.1f} s -> {r['per_hour']:.0f} trials/h "
                      f"({r['per_trial']:.2f} s per trial of {args.seconds:g} s; bench {time.monotonic() - started:.0f} s)",
                      flush=True)
            if executor == "ray":
                import ray

                ray.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(f"{'executor':8s} {'workers':>7s} {'trials/h':>9s} {'x one':>6s} {'target':>7s}")
    for r in results:
        one = min((x for x in results if x["executor"] == r["executor"]), key=lambda x: x["workers"])
        speedup = r["per_hour"] / one["per_hour"] * one["workers"]
        target = 0.9 * r["workers"]
        print(f"{r['executor']:8s} {r['workers']:7d} {r['per_hour']:9.0f} {speedup:6.2f} {target:7.2f}"
              + ("" if r["executor"] != "local" else ("  ok" if speedup >= target else "  BELOW TARGET")))
    serial = next((r for r in results if r["executor"] == "serial"), None)
    print()
    for r in results:
        if serial is not None and r["executor"] != "serial" and r["workers"] == 1:
            print(f"{r['executor']} overhead per trial against serial (one worker): "
                  f"{r['per_trial'] - serial['per_trial']:+.2f} s ({r['per_trial']:.2f} s against {serial['per_trial']:.2f} s)")


def _start_ray(tmp: Path, gpus: int) -> None:
    """A local Ray cluster with pretend GPUs, its files in the bench's temporary folder."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=max(2, gpus), num_gpus=gpus, include_dashboard=False, _temp_dir=str(tmp / "ray"),
             log_to_driver=False)


if __name__ == "__main__":
    main()
