"""What verification costs, against training, at the CPU scale.

    python bench/verify_cost.py                  # a 30 s time budget
    python bench/verify_cost.py --max-steps 40   # a step budget instead
    python bench/verify_cost.py --keep-rate 0.1  # the share of trials that are keep candidates

Runs the real train.py (the repository's, or --train-py) as the baseline of a run in a
throwaway git repository, with the real Controller and Verifier, so the figures are the
ones the trial row records: the trial's wall time and training seconds, and the
verifier's wall time (a fresh process: interpreter and torch start-up, rebuild,
causality, val and held-out evaluation), broken down from its verdict file. It also times
the integrity snapshot (harness and data fingerprints) that every trial pays twice.

Verification runs only for keep candidates, so its share of a night is
keep rate x verification / (trial + keep rate x verification); the default keep rate is 20%.
The data cache is the usual one ($AUTOLOOP_CACHE_DIR, else ~/.cache/autoloop).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench_repo import make_repo

ROOT = Path(__file__).resolve().parents[1]



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-budget", type=float, default=30.0, help="seconds of timed training")
    parser.add_argument("--max-steps", type=int, default=None, help="a step budget instead of the time budget")
    parser.add_argument("--train-py", type=Path, default=ROOT / "train.py", help="the training script to measure")
    parser.add_argument("--keep-rate", type=float, default=0.2, help="share of trials that are keep candidates")
    args = parser.parse_args()

    from autoloop.trust import integrity
    from autoloop.config import Config
    from autoloop.loop.controller import Controller
    from autoloop.harness import default_data_dir
    from autoloop.store import Store

    with tempfile.TemporaryDirectory(prefix="autoloop-bench-") as tmp:
        repo = Path(tmp) / "repo"
        make_repo(repo, args.train_py.read_text())
        config = Config(tag="bench", time_budget=args.time_budget, max_steps=args.max_steps, max_trials=1,
                        proposers=["ideas"])
        Controller(config, repo).run()
        store = Store(repo / "experiments.db")
        (trial,) = store.trials(store.get_run("bench")["id"])
        store.close()
        if trial["status"] != "keep" or not trial.get("verify_seconds"):
            sys.exit(f"the baseline was not verified ({trial['status']}: {trial.get('reason')}); "
                     f"see {repo / '.autoloop'}")
        verdict = json.loads((repo / ".autoloop" / "bench" / "trials" / "1" / "verify.json").read_text())

        data_dir = default_data_dir()
        started, checks = time.perf_counter(), 5
        for _ in range(checks):
            integrity.take_snapshot(integrity.harness_dir(), data_dir)
        snapshot = (time.perf_counter() - started) / checks

    parts = verdict["seconds"]
    inside = parts.get("total", 0.0)
    wall, verify = trial["wall_seconds"], trial["verify_seconds"]
    share = verify / (wall + verify)
    budget = f"{args.max_steps} steps" if args.max_steps else f"{args.time_budget:g} s"
    print(f"verification cost at the CPU scale (budget {budget}, device {verdict['device']}, "
          f"{trial['num_params']:,} parameters)")
    print(f"  trial wall time       {wall:7.1f} s  (training {trial['training_seconds']:.1f} s, compile "
          f"{trial['compile_seconds']:.1f} s, eval {trial['eval_seconds']:.1f} s)")
    print(f"  verification          {verify:7.1f} s  (start-up {verify - inside:.1f}, rebuild {parts['rebuild']:.1f}, "
          f"causality {parts['causality']:.1f}, val {parts['val']:.1f}, held-out {parts['heldout']:.1f})")
    print(f"  integrity snapshot    {snapshot:7.3f} s  per check, two per trial")
    print(f"  val_bpb               {trial['metric']:.6f} verified (reported {trial['result']['val_bpb']:.6f}), "
          f"held-out {trial['heldout_metric']:.6f}")
    night = args.keep_rate * verify / (wall + args.keep_rate * verify)
    print(f"  a keep candidate spends {share:.0%} of its time on verification; at {args.keep_rate:.0%} keep "
          f"candidates that is {night:.1%} of the night")


if __name__ == "__main__":
    main()
