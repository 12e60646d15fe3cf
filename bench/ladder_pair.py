"""A real pair of changes for the scale ladder on this CPU, and how often its tags come out right.

    python bench/ladder_pair.py                               # 6 seeds, 60 steps, the rung budget=4x (~45 min on 2 cores)
    python bench/ladder_pair.py --seeds 1 2 3 --jobs 1 --out /tmp/pair.jsonl
    python bench/ladder_pair.py --out /tmp/pair.jsonl         # again: reuses the runs already in --out
    python bench/ladder_pair.py --out /tmp/pair.jsonl --night experiments.db:ladder   # and a night's rung

Issue 34 asks for two changes of the real train.py that behave differently at a larger
scale: one that helps at both scales, one that helps only at the night's. On this CPU, in
step mode (60 steps, the default train.py's CPU block), the larger rung is `budget=4x`
(240 steps) and the pair is:

* A, `TOTAL_BATCH_TOKENS=8192` (32 sequences a step instead of 16): more data per step;
  helps at 60 steps and at 240 (in step mode it costs time, not steps);
* B, `MATRIX_LR=0.08` (Muon's learning rate doubled): right for a 60-step run, which it
  speeds up, and too high for a 240-step one, where it ends worse (it reverses).

How it was found: seventeen one-constant changes at 60 steps, 2 seeds each (the learning
rates x2 and x0.5, Muon's also x1.25 and x4, the warm-down 0.3 and 0.8, weight decay 0 and
0.4, the momentum warm-up, the softcap, a final LR fraction, 4 heads, Adam's betas); those that helped were run at
`MODEL_DIM=256` and at `budget=4x`. At width 256 every one that helped at 128 still
helped, so width is no rung that separates them; at 240 steps MATRIX_LR=0.08 went from
-0.076 to +0.052 bpb and no learning-rate or schedule change helped by more than the noise,
so A buys more per step instead. A first try, `DEPTH=3`, helped alone at both scales (-0.043
at 60 and at 240 steps) but not beside B: the ladder measures each change leave-one-out from
the best, and a third block under the doubled learning rate gained only -0.02 (90%
interval -0.11..+0.07) at 240 steps (2 seeds), so it faded. A larger batch suits a higher learning rate instead.

What it measures: the four commits the ladder trains for a best commit with A and B kept
(the baseline, the best A+B, A+B without A, A+B without B) at both scales and at every seed,
each run a fresh `python train.py` in step mode (AUTOLOOP_MAX_STEPS, AUTOLOOP_SEED: the
same seed gives the same batches to every commit, so effects are paired). Each change's
effect at a scale is the ladder's leave-one-out figure, best minus best-without-it per seed,
and its tag at the rung is autoloop.decide.ladder's rule on the interval
autoloop.decide.rule.paired_effect gives at the decisions' default level (0.90, alpha 0.05
one-sided). "How often the tags come out right" is the share of every K-seed subset of the
seeds (K = 3, the ladder's default --ladder-seeds) whose tags are A holds and B fades or
reverses. The controller's own path (`autoloop run --ladder budget=4x --max-steps 60` on
the same pair, seeded A first) is docs/review.md's real night; `--night DB:TAG` adds its
rung's runs (the same four commits at the larger scale, sandboxed, at the ladder's own
seeds) to the large scale's seeds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoloop.decide.ladder import FADES, HOLDS, REVERSES, level_of, tag_of  # noqa: E402
from autoloop.decide.rule import paired_effect  # noqa: E402
from autoloop.pyconst import parse_value, set_constants  # noqa: E402

A = {"TOTAL_BATCH_TOKENS": "8192"}
B = {"MATRIX_LR": "0.08"}
ARMS = {"baseline": {}, "A": A, "B": B, "AB": {**A, **B}}  # "A" = the best without B, "B" = without A


def parse_sets(words: list[str]) -> dict[str, str]:
    sets = {}
    for word in words:
        name, sep, value = word.partition("=")
        if not sep:
            raise SystemExit(f"{word!r} is not NAME=VALUE: write it like MATRIX_LR=0.08")
        sets[name] = value
    return sets


def one_run(source: str, sets: dict[str, str], steps: int, seed: int, threads: int) -> dict:
    text = set_constants(source, {k: parse_value(v) for k, v in sets.items()}, device="cpu") if sets else source
    with tempfile.TemporaryDirectory(prefix="ladder-pair-") as tmp:
        folder = Path(tmp)
        (folder / "train.py").write_text(text)
        result = folder / "result.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOLOOP_") or k == "AUTOLOOP_CACHE_DIR"}
        env.update(AUTOLOOP_MAX_STEPS=str(steps), AUTOLOOP_SEED=str(seed), AUTOLOOP_RESULT=str(result),
                   OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
        started = time.monotonic()
        done = subprocess.run([sys.executable, "train.py"], cwd=folder, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"train.py failed ({sets}, seed {seed}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        return {"val_bpb": json.loads(result.read_text())["val_bpb"], "wall_seconds": time.monotonic() - started}


def effects(runs: dict, scale: str, seeds: list[int]) -> dict[str, dict[int, float]]:
    """Per seed, each change's leave-one-out effect at `scale` (negative: it helps), and the best's gain."""
    at = lambda arm, s: runs[(scale, arm, s)]  # noqa: E731
    return {"A": {s: at("AB", s) - at("B", s) for s in seeds}, "B": {s: at("AB", s) - at("A", s) for s in seeds},
            "best": {s: at("AB", s) - at("baseline", s) for s in seeds},
            "A on baseline": {s: at("A", s) - at("baseline", s) for s in seeds},
            "B on baseline": {s: at("B", s) - at("baseline", s) for s in seeds}}


def night_runs(spec: str, steps: int) -> tuple[dict[tuple, float], list[int]]:
    """The large-scale runs of a night's latest finished rung (`DB:TAG`), as (scale, arm, seed)."""
    from autoloop.store import Kind, Store

    db, _, run_tag = spec.rpartition(":")
    with Store(db) as store:
        run = store.get_run(run_tag)
        if run is None:
            raise SystemExit(f"{db} has no run {run_tag!r}")
        rungs = [r for r in store.rungs(run["id"]) if r["status"] == "done"]
        if not rungs:
            raise SystemExit(f"run {run_tag!r} has no finished ladder rung")
        by_number = {t["number"]: t for t in store.trials(run["id"])}
        runs: dict[tuple, float] = {}
        for t in store.trials(run["id"], kind=Kind.LADDER.value):
            d = t.get("decision") or {}
            if d.get("rung") != rungs[-1]["id"]:
                continue
            arm = {"baseline": "baseline", "best": "AB"}.get(d.get("arm"))
            if d.get("arm") == "without":
                edits = (by_number[d["kept_trial"]].get("edits") or {}).get("edits") or []
                sets = {k: str(v) for e in edits for k, v in (e.get("sets") or {}).items()}
                arm = "B" if sets == A else "A" if sets == B else None  # the best without A is B alone
            for m in store.measurements(t["id"]):
                if arm and m.get("metric") is not None and m.get("num_steps") == steps:
                    runs[("large", arm, m["seed"])] = m["metric"]
    seeds = sorted({s for (_, _, s) in runs if all(("large", a, s) in runs for a in ARMS)})
    return runs, seeds


def tag(diffs: dict[int, float], level: float) -> tuple[str, float, float, float]:
    mean, low, high = paired_effect(diffs, {s: 0.0 for s in diffs}, None, level)
    return tag_of(mean, low, high), mean, low, high


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6], help="Seeds every commit runs at.")
    ap.add_argument("--steps", type=int, default=60, help="The night's steps per run (step mode).")
    ap.add_argument("--factor", type=int, default=4, help="The rung's budget factor (budget=Kx).")
    ap.add_argument("--rung", nargs="*", default=[], metavar="NAME=VALUE", help="Constants the rung also sets.")
    ap.add_argument("--subset", type=int, default=3, help="Seeds per ladder (its --ladder-seeds) for the tag accuracy.")
    ap.add_argument("--alpha", type=float, default=0.05, help="The decisions' one-sided alpha.")
    ap.add_argument("--jobs", type=int, default=2, help="Runs at once (one thread each).")
    ap.add_argument("--out", type=Path, default=None, help="A JSON-lines file of the runs (kept runs are reused).")
    ap.add_argument("--night", default=None, metavar="DB:TAG", help="Add a night's latest rung's runs (the same pair).")
    args = ap.parse_args()
    source = (ROOT / "train.py").read_text()
    rung = parse_sets(args.rung)
    scales = {"small": ({}, args.steps), "large": (rung, args.steps * args.factor)}
    runs: dict[tuple, float] = {}
    if args.out and args.out.exists():
        for line in args.out.read_text().splitlines():
            r = json.loads(line)
            if r["steps"] == scales[r["scale"]][1] and r.get("rung", {}) == (rung if r["scale"] == "large" else {}):
                runs[(r["scale"], r["arm"], r["seed"])] = r["val_bpb"]
    todo = [(scale, arm, seed) for seed in args.seeds for scale in scales for arm in ARMS
            if (scale, arm, seed) not in runs]
    print(f"{len(todo)} runs to train ({len(runs)} reused): 4 commits x {len(args.seeds)} seeds at {args.steps} and "
          f"{args.steps * args.factor} steps{' with ' + ' '.join(args.rung) if args.rung else ''}", flush=True)

    def train(key):
        scale, arm, seed = key
        extra, steps = scales[scale]
        r = one_run(source, {**ARMS[arm], **extra}, steps, seed, threads=1 if args.jobs > 1 else 2)
        row = {"scale": scale, "arm": arm, "seed": seed, "steps": steps, "rung": extra, **r}
        if args.out:
            with args.out.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
        print(f"  {scale:<5} {arm:<8} seed {seed}: val_bpb {r['val_bpb']:.4f} ({r['wall_seconds']:.0f} s)", flush=True)
        return key, r["val_bpb"]

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for key, value in pool.map(train, todo):
            runs[key] = value
    large_seeds = list(args.seeds)
    if args.night:
        extra, night_seeds = night_runs(args.night, args.steps * args.factor)
        runs.update(extra)
        large_seeds += night_seeds
        print(f"the night's rung adds seeds {night_seeds} at the large scale")

    level = level_of(args.alpha)
    print("\nmean val_bpb:")
    for scale, (_, steps) in scales.items():
        print(f"  {scale} ({steps} steps, seeds {large_seeds if scale == 'large' else args.seeds}): " + ", ".join(
            f"{arm} {statistics.mean(runs[(scale, arm, s)] for s in (large_seeds if scale == 'large' else args.seeds)):.4f}"
            for arm in ARMS))
    print(f"\neach change's effect (A, B: the ladder's leave-one-out, best minus best without it; 'on baseline': "
          f"alone; negative helps), all seeds, {level:.0%} interval, tag:")
    for scale in scales:
        for name, diffs in effects(runs, scale, large_seeds if scale == "large" else args.seeds).items():
            t, mean, low, high = tag(diffs, level)
            print(f"  {scale:<5} {name:<13} {mean:+.4f} [{low:+.4f}, {high:+.4f}]  {t if name in ('A', 'B') else ''}")
    subsets = list(itertools.combinations(large_seeds, args.subset))
    large = effects(runs, "large", large_seeds)
    right = {"A": 0, "B": 0, "both": 0}
    counts = {"A": {HOLDS: 0, FADES: 0, REVERSES: 0}, "B": {HOLDS: 0, FADES: 0, REVERSES: 0}}
    for subset in subsets:
        ta = tag({s: large["A"][s] for s in subset}, level)[0]
        tb = tag({s: large["B"][s] for s in subset}, level)[0]
        counts["A"][ta] += 1
        counts["B"][tb] += 1
        right["A"] += ta == HOLDS
        right["B"] += tb in (FADES, REVERSES)
        right["both"] += ta == HOLDS and tb in (FADES, REVERSES)
    n = len(subsets)
    print(f"\ntags at the rung over all {n} subsets of {args.subset} seeds:")
    print(f"  A (expected holds):             {counts['A']}  right {right['A']}/{n} = {right['A'] / n:.0%}")
    print(f"  B (expected fades or reverses): {counts['B']}  right {right['B']}/{n} = {right['B'] / n:.0%}")
    print(f"  both right:                     {right['both']}/{n} = {right['both'] / n:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
