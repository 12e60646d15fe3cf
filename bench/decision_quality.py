"""How far each keep/discard rule gets a night, at equal compute, and how honest its report is (simulated).

    python bench/decision_quality.py              # the issue's tables: 2000 nights main, 400 per other row (~10 min)
    python bench/decision_quality.py --quick      # 300 nights, main table and targets only (~1 min)
    python bench/decision_quality.py --tuning     # the grids behind the defaults (two-tier, confirmed-only, early stop)
    python bench/decision_quality.py --how-far    # what more compute buys, and the early stop with a perfect curve
    python bench/decision_quality.py --nights 5000 --runs 200 --shared 0.3

A night is a fixed number of training runs (default 100); every run costs one, whether it
measures the baseline, a candidate, the incumbent again or the reserve, and an
early-stopped run the fraction of the budget it ran. The noise is Gaussian with sd sigma
per run, half of its variance shared by every commit of one init stream at a seed (so
pairing matters). The rules are the ones the controller runs (autoloop/decide/rule.py), the
noise estimated from the night's own repeats; the early stop is autoloop/decide/early_stop.py,
calibrated on the night's own pairs, its partial curves from real train.py runs
(tests/data/curve_calibration.json, made by bench/curve_calibration.py); the reserve is
autoloop/decide/remeasure.py. All rules see the same proposals and the same luck.
docs/decisions.md reads the numbers; autoloop/decide/simulate.py has the worlds.

The realistic mix is mechanistic (`Landscape`): the true val_bpb is a sum of quadratic
bowls, one per hyperparameter, plus the code changes kept; the night starts away from the
bowls' bottom and each proposal steps one hyperparameter of the CURRENT incumbent (60%),
re-draws the init stream (10%) or changes the code (30%: 40% of them null, 50% harmful,
10% helpful).

Printed per rule: null proposals adopted / confirmed, share of real improvements of 2
sigma or more adopted (and lost to an early stop), share of harmful ones adopted, runs
per decided proposal, proposals decided per night, share stopped early (and the mean
progress at the stop), the final best's true gain over the baseline (sigma, ± standard
error over nights) and its ratio to strict's, the winner's curse of the reported value
(reported minus true, sigma; negative = it looks better than it is), and the reported
gain's 95% interval coverage. Then the targets, a sensitivity table and side tables.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoloop.decide.rule import DecisionConfig  # noqa: E402
from autoloop.decide.early_stop import EarlyStopConfig  # noqa: E402
from autoloop.decide.simulate import (  # noqa: E402
    ALL_NULL, CALIBRATION, CurveModel, Landscape, Mix, Night, Summary, World, draw_nights, simulate, targets,
)


def curves_data() -> dict:
    import json

    return json.loads(CALIBRATION.read_text())

HEADER = (f"{'rule':<44} {'nulls adopt/conf':>16} {'>=2σ adopt':>10} {'lost ES':>7} {'harm/prop':>9} {'harm/night':>10} "
          f"{'runs/prop':>9} {'props':>6} {'stopped':>11} {'true gain σ':>13} {'x strict':>8} {'curse σ':>8} "
          f"{'gain bias':>9} {'cover':>6}")


def policies(curves: CurveModel | None = None) -> dict[str, tuple[DecisionConfig, Night]]:
    """The rules compared: name -> (decision config, how the night runs). "reserve 4": the
    final best re-measured at 4 fresh seeds (set aside from the night's runs); "+ baseline":
    the baseline too, at the same seeds."""
    es = EarlyStopConfig()
    d = DecisionConfig()
    return {
        "strict": (DecisionConfig(rule="strict"), Night()),
        "strict, reserve 4": (DecisionConfig(rule="strict"), Night(reserve=4)),
        "confirmed-only α 0.05, reserve 4": (DecisionConfig(rule="confirmed-only"), Night(reserve=4)),
        "confirmed-only α 0.2, reserve 4": (DecisionConfig(rule="confirmed-only", alpha=0.2), Night(reserve=4)),
        "two-tier, 2nd look t<-1, reserve 4": (DecisionConfig(promising=-1.0, max_runs=2), Night(reserve=4)),
        "two-tier, reserve 4 + baseline": (d, Night(reserve=4, reserve_baseline=True)),
        "two-tier, reserve 4": (d, Night(reserve=4)),
        "two-tier, reserve 4 + baseline, early stop": (d, Night(reserve=4, reserve_baseline=True, early_stop=es,
                                                                curves=curves)),
        "default: two-tier, reserve 4, early stop": (d, Night(reserve=d.reserve_seeds, reserve_auto=True,
                                                              reserve_baseline=d.reserve_baseline,
                                                              early_stop=es, curves=curves)),
    }


DEFAULT = "default: two-tier, reserve 4, early stop"


def row(name: str, s: Summary, strict: Summary | None) -> str:
    big = f"{s.big_kept_share:>10.1%}" if s.big else f"{'-':>10}"
    lost = f"{s.big_stopped_share:>7.1%}" if s.big else f"{'-':>7}"
    stopped = f"{s.stopped_share:.0%} @{s.mean_stop_progress:.2f}" if s.stopped else "-"
    ratio = f"{s.quality / strict.quality:>8.3f}" if strict is not None and strict.quality else f"{'-':>8}"
    cover = f"{s.coverage:>6.1%}" if s.gain_se and s.gain_se[0] == s.gain_se[0] else f"{'-':>6}"
    nulls = f"{s.false_keep_rate:.1%} / {s.null_confirmed_rate:.2%}"
    return (f"{name:<44} {nulls:>16} {big} {lost} {s.harmful_kept_rate:>9.2%} {s.harmful_per_night:>10.2f} "
            f"{s.runs_per_proposal:>9.3f} {s.decided / s.nights:>6.1f} {stopped:>11} {s.quality:>+7.2f} ±{s.quality_se:4.2f} "
            f"{ratio} {s.winners_curse:>+8.3f} {s.gain_bias:>+9.3f} {cover}")


def run_all(pols: dict, nights: int, world: World, mix, seed: int) -> dict[str, Summary]:
    n_seeds = max(c.baseline_seeds + c.max_runs for c, _ in pols.values())
    draws = draw_nights(nights, world, mix, n_seeds, seed)
    return {name: simulate(cfg, nights=nights, world=world, mix=mix, draws=draws, night=night)
            for name, (cfg, night) in pols.items()}


def table(title: str, pols: dict, nights: int, world: World, mix, seed: int) -> dict[str, Summary]:
    print(f"\n{title}")
    print(HEADER)
    out = run_all(pols, nights, world, mix, seed)
    strict = out.get("strict")
    for name, s in out.items():
        print(row(name, s, strict), flush=True)
    return out


def sensitivity(args, world: World, land: Landscape, nights: int, curves: CurveModel) -> None:
    """The default against strict when the main parameters of the mechanistic world move."""
    settings = [
        ("as above", world, land),
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
    pols = {k: v for k, v in policies(curves).items() if k in ("strict", "two-tier, reserve 4", DEFAULT)}
    print(f"\nSensitivity of the mechanistic world ({nights} nights each; true gain of the final best, sigma; the "
          "default's honesty figures; harm: harmful adopted, default / strict):")
    print(f"{'setting':<36} {'strict':>13} {'two-tier+res':>13} {'default':>13} {'x strict':>8} {'curse σ':>8} "
          f"{'gain bias':>9} {'null conf':>9} {'>=2σ':>6} {'lost ES':>7} {'harm/night':>11} {'stopped':>11}")
    worst = 1e9
    for k, (name, w, m) in enumerate(settings):
        out = run_all(pols, nights, w, m, args.seed + 10 + k)
        st, tt, d = out["strict"], out["two-tier, reserve 4"], out[DEFAULT]
        ratio = d.quality / st.quality
        worst = min(worst, ratio)
        stopped = f"{d.stopped_share:.0%} @{d.mean_stop_progress:.2f}" if d.stopped else "-"
        print(f"{name:<36} " + " ".join(f"{s.quality:>+7.2f} ±{s.quality_se:4.2f}" for s in (st, tt, d))
              + f" {ratio:>8.3f} {d.winners_curse:>+8.3f} {d.gain_bias:>+9.3f} {d.null_confirmed_rate:>9.2%} "
              f"{d.big_kept_share:>6.0%} {d.big_stopped_share:>7.1%} "
              f"{f'{d.harmful_per_night:.2f}/{st.harmful_per_night:.2f}':>11} {stopped:>11}", flush=True)
    print(f"  worst row: {worst:.3f} x strict (target >= 0.95)")


def tuning(args, world: World, land: Landscape, curves: CurveModel, nights: int, only: str | None = None) -> None:
    """The grids behind the defaults (docs/decisions.md, "Defaults and why")."""
    es = EarlyStopConfig()
    d = DecisionConfig()
    res = Night(reserve=4)
    grids = {
        "two-tier: second look, baseline seeds, adoption margin, reserve of the baseline": {
            "two-tier, reserve 4 (the default's rule)": (d, res),
            "  2nd look t<-1, max 2": (DecisionConfig(promising=-1.0, max_runs=2), res),
            "  2nd look t<-1, max 5": (DecisionConfig(promising=-1.0), res),
            "  2nd look t<-1.5, max 2": (DecisionConfig(promising=-1.5, max_runs=2), res),
            "  baseline 2 seeds": (DecisionConfig(baseline_seeds=2), res),
            "  baseline 5 seeds": (DecisionConfig(baseline_seeds=5), res),
            "  adopt t<-0.1": (DecisionConfig(adopt=-0.1), res),
            "  adopt t<-0.25": (DecisionConfig(adopt=-0.25), res),
            "  reserve: the baseline re-measured too": (d, Night(reserve=4, reserve_baseline=True)),
            "  reserve 2": (d, Night(reserve=2)),
            "  reserve 8": (d, Night(reserve=8)),
            "strict": (DecisionConfig(rule="strict"), Night()),
        },
        "confirmed-only: alpha (reserve 4)": {
            f"confirmed-only α {a:g}": (DecisionConfig(rule="confirmed-only", alpha=a), res)
            for a in (0.05, 0.1, 0.2, 0.3, 0.4)
        } | {"strict": (DecisionConfig(rule="strict"), Night())},
        "early stop: eps, window, min-progress, before-change (two-tier, reserve 4)": {
            f"eps {e:g}, window {w:g}, from {mp:g}, /{bc:g} before the warm-down": (
                d, Night(reserve=4, early_stop=replace(es, eps=e, window=w, min_progress=mp, before_change=bc),
                         curves=curves if w == es.window else CurveModel.fit(curves_data(), window=w)))
            for e, w, mp, bc in ((0.05, 0.2, 0.3, 10), (0.01, 0.2, 0.3, 10), (0.1, 0.2, 0.3, 10), (0.2, 0.2, 0.3, 10),
                                 (0.05, 0.1, 0.3, 10), (0.05, 0.3, 0.3, 10), (0.05, 0.2, 0.2, 10),
                                 (0.05, 0.2, 0.5, 10), (0.05, 0.2, 0.3, 1))
        } | {"two-tier, reserve 4, no early stop": (d, res), "strict": (DecisionConfig(rule="strict"), Night())},
    }
    for k, (title, pols) in enumerate(grids.items()):
        if only is None or title.startswith(only):
            table(f"Tuning, {title} ({nights} nights)", pols, nights, world, land, args.seed + 100 + k)


def how_far(args, land: Landscape, curves: CurveModel, nights: int = 600) -> None:
    """Why the default does not reach 1.05 x strict: what more compute buys the strict rule,
    and what the same early stop gets from a perfectly informative partial curve."""
    from autoloop.decide.early_stop import GRID

    print(f"\nHow far ({nights} nights, the same draws):")
    draws = draw_nights(nights, World(runs=150), land, 8, args.seed + 200)
    ref = None
    for runs in (100, 106, 110, 125, 150):
        s = simulate(DecisionConfig(rule="strict"), nights=nights, world=World(runs=runs), mix=land, draws=draws)
        ref = ref or s.quality
        print(f"  strict, {runs} runs a night: {s.quality:+.2f} sigma ({s.quality / ref:.3f} x strict at 100)", flush=True)
    perfect = CurveModel(grid=GRID, shapes=((1.0,) * len(GRID),), comparable=((True,) * len(GRID),),
                         visible=(0.0,) * len(GRID), residuals=((0.0,) * len(GRID),), sigma=1.0)
    es, d = EarlyStopConfig(), DecisionConfig()
    for name, night in (
            ("two-tier, reserve 4, no early stop", Night(reserve=4)),
            ("default (early stop on the real curves)", Night(reserve=4, early_stop=es, curves=curves)),
            ("default, a perfect partial curve (D = the true effect)", Night(reserve=4, early_stop=es, curves=perfect)),
            ("  ... and eps 0.2 from 20% of the budget", Night(reserve=4, early_stop=replace(es, eps=0.2, min_progress=0.2),
                                                         curves=perfect))):
        s = simulate(d, nights=nights, world=World(), mix=land, draws=draws, night=night)
        stopped = f"{s.stopped_share:.0%} stopped at {s.mean_stop_progress:.2f}" if s.stopped else "none stopped"
        print(f"  {name}: {s.quality:+.2f} sigma ({s.quality / ref:.3f} x); {stopped}, {s.decided / nights:.1f} "
              f"proposals, >=2σ lost {s.big_stopped_share:.1%}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nights", type=int, default=2000, help="Simulated nights for the main table.")
    ap.add_argument("--runs", type=int, default=100, help="Training runs in a night (the equal compute).")
    ap.add_argument("--shared", type=float, default=0.5, help="Share of the run variance a seed gives every commit of one init stream.")
    ap.add_argument("--seed", type=int, default=0, help="Seed of the simulation.")
    ap.add_argument("--quick", action="store_true", help="300 nights, the main table and the targets only.")
    ap.add_argument("--tuning", action="store_true", help="Only the grids behind the defaults (600 nights each).")
    ap.add_argument("--how-far", action="store_true", help="Only the figures behind 'How far it gets' (about 3 minutes).")
    ap.add_argument("--grid", choices=("two-tier", "confirmed-only", "early stop"),
                    help="With --tuning: only this grid.")
    args = ap.parse_args()
    curves = CurveModel.load()
    world = World(shared=args.shared, runs=args.runs)
    land = Landscape()
    start = time.perf_counter()
    if args.how_far:
        how_far(args, land, curves)
        print(f"\n{time.perf_counter() - start:.0f} s")
        return
    if args.tuning:
        tuning(args, world, land, curves, 600, args.grid)
        print(f"\n{time.perf_counter() - start:.0f} s")
        return
    nights = 300 if args.quick else args.nights
    side = max(400, nights // 5)
    print(f"{nights} nights of {world.runs} runs; sigma 1; shared seed variance {world.shared:.0%}; curves fitted on "
          f"{len(curves.residuals)} real (change, seed) pairs of train.py (run sd {curves.sigma:.4f} bpb); "
          f"default: {DecisionConfig()}, {EarlyStopConfig()}")
    out = table(
        f"Realistic mix, mechanistic: {land.hyperparameters} hyperparameter bowls (x2 step from the optimum costs "
        f"{land.curvature[0]:g}..{land.curvature[1]:g}σ), start {land.start_sd:g} log2 off; proposals "
        f"{land.hp:.0%} steps x2/x1.41/x1.19 of the incumbent, {land.redraw:.0%} re-draws, {land.code:.0%} code changes",
        policies(curves), nights, world, land, args.seed)
    print("\nTargets (the default against strict, realistic mix):")
    for name, (figures, ok) in targets(out["strict"], out[DEFAULT]).items():
        print(f"  {'met    ' if ok else 'NOT MET'}  {name}: {figures}")
    if not args.quick:
        sensitivity(args, world, land, side, curves)
        side_pols = {k: v for k, v in policies(curves).items() if k in ("strict", "two-tier, reserve 4", DEFAULT)}
        table(f"Independent effects (25% null, 10% null re-draws, 55% harmful 0.1-10σ, 10% helpful 0.1-5σ; {side} nights)",
              side_pols, side, world, Mix(), args.seed + 1)
        table(f"All proposals null (70% same stream, 30% re-draws; {side} nights)", side_pols, side, world, ALL_NULL,
              args.seed + 2)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
