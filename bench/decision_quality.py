"""How well each keep/discard rule keeps real changes, at equal compute (simulated).

    python bench/decision_quality.py            # 2000 nights for the main table, ~1-2 min on 2 shared cores
    python bench/decision_quality.py --quick    # 300 nights, no side tables, ~15 s
    python bench/decision_quality.py --nights 5000 --runs 200 --shared 0.3
    python bench/decision_quality.py --defaults-grid   # max-runs x futility, behind the defaults

A night is a fixed number of training runs (default 100); every run costs one, whether it
measures the baseline, a candidate or the incumbent again. The noise is Gaussian with sd
sigma per run, half of its variance shared by every commit of one init stream at a seed
(so pairing matters). The rules are the ones the controller runs (autoloop/decide/rule.py),
the noise estimated from the night's own repeats. All rules see the same proposals and
the same luck. docs/decisions.md reads the numbers; autoloop/decide/simulate.py has the worlds.

The realistic mix is mechanistic (`Landscape`): the true val_bpb is a sum of quadratic
bowls, one per hyperparameter, plus the code changes kept; the night starts away from the
bowls' bottom and each proposal steps one hyperparameter of the CURRENT incumbent (60%),
re-draws the init stream (10%) or changes the code (30%: 40% of them null, 50% harmful,
10% helpful). The second table is the older independent-effects mix (`Mix`).

Printed per rule: false keeps per null proposal (and for the re-drawn ones alone), share
of real improvements of 2 sigma or more kept, share of harmful ones kept, share of the
keeps that truly helped, keep rate (all proposals / the last third of the night), runs
per decided proposal, proposals decided per night, the final best's true gain over the
baseline (sigma, ± standard error over nights), the winner's curse (its reported mean
minus its true value, sigma; negative = it looks better than it is) and, in the
mechanistic world, how far above the bowls' bottom the final best still is (sigma).
Then the targets, a sensitivity table and the side tables.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoloop.decide.rule import DecisionConfig  # noqa: E402
from autoloop.decide.simulate import ALL_NULL, Landscape, Mix, Summary, World, draw_nights, simulate, targets  # noqa: E402

HEADER = (f"{'rule':<28} {'false keeps':>11} {'re-draws':>9} {'>=2σ kept':>9} {'harm kept':>9} "
          f"{'real keeps':>10} {'keeps all/late':>14} {'runs/prop':>9} {'props':>6} {'true gain σ':>13} "
          f"{'curse σ':>8} {'left σ':>7}")


def row(s: Summary) -> str:
    big = f"{s.big_kept_share:>9.0%}" if s.big else f"{'-':>9}"
    left = f"{np.mean(s.excess):>7.2f}" if s.excess else f"{'-':>7}"
    keeps = f"{s.keep_rate:.1%} / {s.late_keep_rate:.1%}"
    return (f"{s.rule:<28} {s.false_keep_rate:>11.1%} {s.redraw_keep_rate:>9.1%} {big} "
            f"{s.harmful_kept / max(s.harmful, 1):>9.1%} {s.real_keep_share:>10.0%} {keeps:>14} "
            f"{s.runs_per_proposal:>9.2f} {s.decided / s.nights:>6.1f} "
            f"{s.quality:>+7.2f} ±{s.quality_se:4.2f} {s.winners_curse:>+8.2f} {left}")


def rules(margin: float) -> list[DecisionConfig]:
    return [DecisionConfig(rule="strict"), DecisionConfig(rule="strict", margin=margin), DecisionConfig()]


def run_rules(cfgs: list[DecisionConfig], nights: int, world: World, mix, seed: int) -> list[Summary]:
    draws = draw_nights(nights, world, mix, max(c.baseline_seeds + c.max_runs for c in cfgs), seed)
    return [simulate(cfg, nights=nights, world=world, mix=mix, draws=draws) for cfg in cfgs]


def table(title: str, cfgs: list[DecisionConfig], nights: int, world: World, mix, seed: int) -> list[Summary]:
    print(f"\n{title}")
    print(HEADER)
    out = run_rules(cfgs, nights, world, mix, seed)
    for s in out:
        print(row(s), flush=True)
    return out


def sensitivity(args, world: World, land: Landscape, nights: int, quick: bool) -> None:
    """Where each rule wins when the main parameters of the mechanistic world move."""
    settings = [("as above", world, land)]
    if not quick:
        settings += [
            ("curvature x1/3 (flatter, noisier)", world, land.scaled(1 / 3)),
            ("curvature x3 (sharper)", world, land.scaled(3.0)),
            ("start 0.25 log2 from the optimum", world, replace(land, start_sd=0.25)),
            ("start 1.5 log2 from the optimum", world, replace(land, start_sd=1.5)),
            ("helpful code changes 3% of them", world, replace(land, code_helpful=0.03)),
            ("helpful code changes 25% of them", world, replace(land, code_helpful=0.25)),
            ("no code changes (90% steps)", world, replace(land, hp=0.9, code=0.0)),
            ("shared seed variance 0%", replace(world, shared=0.0), land),
            ("shared seed variance 90%", replace(world, shared=0.9), land),
            ("night of 50 runs", replace(world, runs=50), land),
            ("night of 300 runs", replace(world, runs=300), land),
        ]
    print(f"\nSensitivity of the mechanistic world ({nights} nights each; true gain of the final best, sigma; "
          f"strict's keep rate; ours' false keeps, >=2σ kept and curse / strict's curse):")
    print(f"{'setting':<36} {'strict keeps':>13} {'strict':>13} {f'margin {args.margin:g}':>13} {'paired':>13} "
          f"{'paired-strict':>13} {'fk':>5} {'>=2σ':>5} {'curse':>6}")
    for k, (name, w, m) in enumerate(settings):
        st, mg, ours = run_rules(rules(args.margin), nights, w, m, args.seed + 10 + k)
        big = f"{ours.big_kept_share:.0%}" if ours.big else "-"
        print(f"{name:<36} {f'{st.keep_rate:.0%} / {st.late_keep_rate:.0%}':>13} "
              + " ".join(f"{s.quality:>+7.2f} ±{s.quality_se:4.2f}" for s in (st, mg, ours))
              + f" {ours.quality - st.quality:>+13.2f} {ours.false_keep_rate:>5.1%} {big:>5} "
              f"{ours.winners_curse / st.winners_curse:>6.2f}", flush=True)


def defaults_grid(args, land: Landscape, nights: int = 600) -> None:
    """The grid behind the defaults of max-runs and futility (docs/decisions.md, "Defaults and why")."""
    runs, futilities = (3, 4, 5, 8), (-0.5, -0.75, -1.0, -1.25)
    for shared in (0.5, 0.0):
        world = replace(World(), shared=shared, runs=args.runs)
        draws = draw_nights(nights, world, land, 3 + max(runs), 7)
        strict = simulate(DecisionConfig(rule="strict"), nights=nights, world=world, mix=land, draws=draws)
        print(f"\nshared seed variance {shared:.0%}, {nights} nights: strict {strict.quality:+.2f}, curse {strict.winners_curse:+.2f}")
        print(f"{'max-runs':>8} {'futility':>8} {'false keeps':>11} {'>=2σ kept':>9} {'runs/prop':>9} {'true gain σ':>13} {'curse/strict':>12}")
        for m in runs:
            for f in futilities:
                s = simulate(DecisionConfig(max_runs=m, futility=f), nights=nights, world=world, mix=land, draws=draws)
                print(f"{m:>8} {f:>8} {s.false_keep_rate:>11.1%} {s.big_kept_share:>9.0%} {s.runs_per_proposal:>9.2f} "
                      f"{s.quality:>+7.2f} ±{s.quality_se:4.2f} {s.winners_curse / strict.winners_curse:>12.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nights", type=int, default=2000, help="Simulated nights for the main table.")
    ap.add_argument("--runs", type=int, default=100, help="Training runs in a night (the equal compute).")
    ap.add_argument("--shared", type=float, default=0.5, help="Share of the run variance a seed gives every commit of one init stream.")
    ap.add_argument("--margin", type=float, default=1.0, help="The fixed-margin rule's margin, in sigma.")
    ap.add_argument("--seed", type=int, default=0, help="Seed of the simulation.")
    ap.add_argument("--quick", action="store_true", help="300 nights, no side tables.")
    ap.add_argument("--defaults-grid", action="store_true",
                    help="Only the grid of max-runs by futility behind the rule's defaults (about 2 minutes).")
    args = ap.parse_args()
    if args.defaults_grid:
        defaults_grid(args, Landscape())
        return
    nights = 300 if args.quick else args.nights
    side = max(200, nights // 5)
    world = World(shared=args.shared, runs=args.runs)
    land = Landscape()
    start = time.perf_counter()
    print(f"{nights} nights of {world.runs} runs; sigma 1; shared seed variance {world.shared:.0%}; "
          f"baseline at {DecisionConfig().baseline_seeds} seeds; ours: {DecisionConfig()}")

    strict, _, ours = table(
        f"Realistic mix, mechanistic: {land.hyperparameters} hyperparameter bowls (x2 step from the optimum costs "
        f"{land.curvature[0]:g}..{land.curvature[1]:g}σ), start {land.start_sd:g} log2 off; proposals "
        f"{land.hp:.0%} steps x2/x1.41/x1.19 of the incumbent, {land.redraw:.0%} re-draws, {land.code:.0%} code changes",
        rules(args.margin), nights, world, land, args.seed)
    print("\nTargets (ours against strict, realistic mix):")
    for name, (figures, ok) in targets(strict, ours).items():
        print(f"  {'met    ' if ok else 'NOT MET'}  {name}: {figures}")

    sensitivity(args, world, land, side, args.quick)
    if not args.quick:
        table(f"Independent effects (25% null, 10% null re-draws, 55% harmful 0.1-10σ, 10% helpful 0.1-5σ; {side} nights)",
              rules(args.margin), side, world, Mix(), args.seed + 1)
        table(f"All proposals null (70% same stream, 30% re-draws; {side} nights)", rules(args.margin),
              side, world, ALL_NULL, args.seed + 2)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
