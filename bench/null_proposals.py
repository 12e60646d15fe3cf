"""Null proposals on the real train.py: does a change that only re-draws the init stream get kept?

    python bench/null_proposals.py [--nulls 8] [--max-steps 40] [--rules paired,strict]

For each decision rule, a throwaway repository holds train.py with its matrix learning
rate ten times too small, and the loop (the real controller, sandboxed where bubblewrap
works) runs the baseline, then `--nulls` proposals that only re-seed the model's init
(true effect zero: same data order, same everything else), then one real improvement
(the learning rate restored). It prints, per rule, how many null proposals were kept
(false keeps), whether the real improvement was kept, and the runs spent.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_repo import make_repo

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ANCHOR = "    torch.manual_seed(spec.seed)\n"


def _repo(path: Path) -> Path:
    from autoloop.pyconst import read_constants, set_constants

    source = (ROOT / "train.py").read_text()
    lr = read_constants(source)["MATRIX_LR"].value
    return make_repo(path, set_constants(source, {"MATRIX_LR": lr / 10}))


def _seed(repo: Path, config, nulls: int, lr: float) -> None:
    from autoloop.proposers.seeding import seed_idea

    source = (repo / "train.py").read_text()
    assert ANCHOR in source, "train.py no longer seeds torch as the bench expects"
    for k in range(1, nulls + 1):
        (repo / "train.py").write_text(source.replace(ANCHOR, ANCHOR + f"    torch.manual_seed(spec.seed * 7919 + {k})  # re-draw the init\n", 1))
        diff = subprocess.run(["git", "diff"], cwd=repo, capture_output=True, check=True).stdout
        patch = repo.parent / f"null-{k}.diff"
        patch.write_bytes(diff)
        seed_idea(config, repo, f"null: re-draw the init stream ({k})", sets=[], patch=patch)
    (repo / "train.py").write_text(source)
    seed_idea(config, repo, "real: restore the matrix learning rate", sets=[f"MATRIX_LR={lr}"], patch=None)


def run_rule(rule: str, nulls: int, max_steps: int, work: Path) -> dict:
    from autoloop.config import resolve
    from autoloop.loop.controller import Controller
    from autoloop.pyconst import read_constants
    from autoloop.store import Store

    repo = _repo(work / rule)
    lr = read_constants((ROOT / "train.py").read_text())["MATRIX_LR"].value
    config = resolve(repo, {"tag": "nulls", "proposers": "ideas", "decision_rule": rule, "max_steps": max_steps,
                            "max_trials": nulls + 2, "drift_every": 0, "grace_seconds": 300})
    _seed(repo, config, nulls, lr)
    started = time.monotonic()
    Controller(config, repo).run()
    store = Store(repo / "experiments.db")
    try:
        run = store.get_run("nulls")
        trials = store.trials(run["id"])
        runs = sum(len(store.measurements(t["id"])) for t in trials)
    finally:
        store.close()
    null_rows = [t for t in trials if (t.get("description") or "").startswith("null:")]
    real = [t for t in trials if (t.get("description") or "").startswith("real:")]
    return {"rule": rule, "nulls": len(null_rows), "null_keeps": sum(t["status"] == "keep" for t in null_rows),
            "null_statuses": [t["status"] for t in null_rows], "real": real[0]["status"] if real else "not run",
            "real_reason": real[0]["reason"] if real else "", "runs": runs, "seconds": time.monotonic() - started,
            "noise": (run.get("noise_sd"), run.get("noise_pair_sd"), run.get("noise_df"))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nulls", type=int, default=8, help="null proposals per rule")
    parser.add_argument("--max-steps", type=int, default=40, help="training steps per run (step mode)")
    parser.add_argument("--rules", default="paired,strict", help="decision rules to compare")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="null-proposals-") as tmp:
        os.environ.setdefault("AUTOLOOP_CACHE_DIR", str(Path(tmp) / "cache"))
        for rule in args.rules.split(","):
            r = run_rule(rule.strip(), args.nulls, args.max_steps, Path(tmp))
            noise = ", ".join("-" if v is None else f"{v:.4g}" for v in r["noise"])
            print(f"{r['rule']:>7}: null proposals kept {r['null_keeps']} of {r['nulls']} "
                  f"({' '.join(r['null_statuses'])}); real improvement: {r['real']}; "
                  f"{r['runs']} training runs in {r['seconds']:.0f} s; noise (run sd, pair sd, df) {noise}", flush=True)
            if r["real"] != "keep":
                print(f"         real improvement's reason: {r['real_reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
