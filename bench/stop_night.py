"""The early stop on a real night against the simulator's prediction for that night's pairs.

    python bench/night.py --runs 30 --steps 40 --rules two-tier --keep /tmp/night
    python bench/stop_night.py /tmp/night/two-tier/experiments.db

Reads a finished night (bench/night.py's, tag "night") and prints, in the order the
candidates ran: each proposal's first candidate run, its final paired difference f against
the incumbent at the same seed (bpb), whether the night stopped it and where, and the
simulator's chance of stopping it (autoloop/decide/simulate.py's CurveModel: partial
differences fitted on real train.py curves, in units of the run sd; the rule calibrated, as in
the simulation, on the pairs before it, from 12 pairs on). A candidate the night stopped has
no final difference: it counts as a predicted stop too, so the comparison is "the night's
stops" against "those plus the simulator's expected stops among the candidates it let
finish". Issue 33's target: the night stops at least half the predicted rate, and no
candidate that ended better than the incumbent (none can: a stopped run has no final, and
a finished one was not stopped).

Approximation: a finished candidate's measured f is taken as its true effect (e = 0 in the
simulator's D(p) = shape(p) delta + visible(p) e + residual(p)); the night's run sd (the
runs row's noise_sd) puts f in the simulator's units.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoloop.decide.early_stop import Calibration, EarlyStopConfig, stop_point  # noqa: E402
from autoloop.decide.simulate import CurveModel  # noqa: E402
from autoloop.loop.stops import EarlyStops  # noqa: E402
from autoloop.store import Store  # noqa: E402


def candidates(store, run: dict) -> list[dict]:
    """Each proposal's first candidate run: {trial, f (None when stopped), stopped_at, desc}."""
    stops = EarlyStops(store, run["id"], None)
    out = []
    for trial in sorted(store.trials(run["id"]), key=lambda t: t["number"]):
        if trial["kind"] != "proposal":
            continue
        runs = [m for m in store.measurements(trial["id"]) if (m.get("role") or "candidate") == "candidate"]
        if not runs:
            continue
        first = runs[0]
        row = {"trial": trial["number"], "f": None, "stopped_at": None, "desc": (trial.get("description") or "")[:48],
               "commit": trial.get("trial_commit"), "seed": first.get("seed"), "finished": None}
        if first.get("status") == "stopped":
            row["stopped_at"] = trial.get("stopped_at")
            decision = trial.get("decision") if isinstance(trial.get("decision"), dict) else {}
            partner = stops.incumbent_curve(decision.get("incumbent_id"), first["seed"]) \
                if decision.get("incumbent_id") else None
            row["incumbent"] = partner[0] if partner else None
        elif first.get("status") == "ok" and first.get("metric") is not None:
            decision = trial.get("decision") if isinstance(trial.get("decision"), dict) else {}
            partner = stops.incumbent_curve(decision.get("incumbent_id"), first["seed"]) \
                if decision.get("incumbent_id") else None
            if partner is None:
                continue
            row["f"] = float(first["metric"]) - partner[0]
        else:
            continue
        out.append(row)
    return out


def finish(repo: Path, row: dict, steps: int) -> float | None:
    """A stopped candidate trained to its end by hand (its commit's train.py, the same seed and
    steps: step mode is deterministic), its final val_bpb minus the incumbent's at that seed."""
    import json
    import os
    import subprocess
    import tempfile

    if row.get("incumbent") is None or not row.get("commit"):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source = subprocess.run(["git", "-C", str(repo), "show", f"{row['commit']}:train.py"], check=True,
                                capture_output=True, text=True).stdout
        (Path(tmp) / "train.py").write_text(source)
        env = {**os.environ, "AUTOLOOP_MAX_STEPS": str(steps), "AUTOLOOP_SEED": str(row["seed"]),
               "AUTOLOOP_RESULT": str(Path(tmp) / "result.json"), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "train.py"], cwd=tmp, env=env, check=True, capture_output=True)
        return json.loads((Path(tmp) / "result.json").read_text())["val_bpb"] - row["incumbent"]


def predicted(rows: list[dict], sd: float, reps: int, seed: int) -> list[float]:
    """The simulator's chance of stopping each finished candidate (1 for the night's stops)."""
    model, cfg, rng = CurveModel.load(), EarlyStopConfig(), random.Random(seed)
    chance = [0.0] * len(rows)
    for _ in range(reps):
        calibration = Calibration(cfg=cfg)
        for k, row in enumerate(rows):
            if row["f"] is None:
                continue
            f = row["f"] / sd
            partials = model.partials(f, 0.0, rng.random(), rng.random())
            rule = calibration.rule()
            if rule.active and stop_point(rule, partials) is not None:
                chance[k] += 1.0 / reps
                continue  # a stopped run is no calibration pair (as in the simulation)
            for p, d in partials.items():
                if d is not None:
                    calibration.add(p, d, f)
    return [1.0 if row["f"] is None else c for row, c in zip(rows, chance)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("db", help="The night's experiments.db (bench/night.py --keep FOLDER: FOLDER/<rule>/experiments.db).")
    parser.add_argument("--tag", default="night", help="The run's tag.")
    parser.add_argument("--reps", type=int, default=2000, help="Simulated draws of each candidate's curve.")
    parser.add_argument("--seed", type=int, default=0, help="The draws' seed.")
    parser.add_argument("--finish", action="store_true",
                        help="Train each stopped candidate to its end by hand, to see whether it would have ended better.")
    args = parser.parse_args()
    with Store(Path(args.db)) as store:
        run = store.get_run(args.tag)
        if run is None:
            raise SystemExit(f"{args.db} has no run '{args.tag}': name it with --tag")
        rows = candidates(store, run)
        sd = run.get("noise_sd")
        steps = int((run.get("config") or {}).get("max_steps") or 0)
    if args.finish:
        for row in rows:
            if row["f"] is None and steps:
                row["finished"] = finish(Path(args.db).parent, row, steps)
    if not sd:
        raise SystemExit("the run has no measured noise (runs.noise_sd): it needs its baseline's seeds")
    chance = predicted(rows, float(sd), args.reps, args.seed)
    print(f"run sd {sd:.4f} bpb; {len(rows)} candidates")
    print(f"{'trial':>5}  {'f (bpb)':>9}  {'night':>12}  {'simulator':>9}  change")
    for row, c in zip(rows, chance):
        night = f"stopped {row['stopped_at']:.0%}" if row["f"] is None else "ran"
        f = f"{row['f']:+.4f}" if row["f"] is not None else (
            f"({row['finished']:+.4f})" if row.get("finished") is not None else "-")
        print(f"{row['trial']:>5}  {f:>9}  {night:>12}  {c:>9.2f}  {row['desc']}")
    stops = sum(1 for r in rows if r["f"] is None)
    expected = sum(chance)
    finished = [r["finished"] for r in rows if r.get("finished") is not None]
    better = (f"{sum(1 for f in finished if f <= 0)} of {len(finished)} finished by hand" if args.finish
              else "not checked (--finish trains them to their end)")
    print(f"night: {stops} stopped of {len(rows)} ({stops / max(len(rows), 1):.0%}); simulator: {expected:.2f} expected "
          f"({expected / max(len(rows), 1):.0%}); ratio {stops / expected if expected else float('nan'):.2f} "
          f"(target >= 0.5); stopped that would have ended level or better: {better}")
    print("(f in parentheses: a stopped candidate trained to its end by hand)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
