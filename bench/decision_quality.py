"""How well each keep/discard rule keeps real changes, at equal compute (simulated).

    python bench/decision_quality.py            # 2000 nights for the main table, ~100 s on 2 shared cores
    python bench/decision_quality.py --quick    # 300 nights, ~20 s
    python bench/decision_quality.py --nights 5000 --runs 200 --shared 0.3

A night is a fixed number of training runs (default 100); every run costs one, whether it
measures the baseline, a candidate or the incumbent again. The proposals come from a mix
with known true effects (default: 25% no effect, 10% no effect but a re-drawn init stream,
55% harmful 0.1..10 sigma, 10% helpful 0.1..5 sigma, log-uniform), the noise is Gaussian
with sd sigma per run, half of its variance shared by every commit of one init stream at a
seed (so pairing matters). The rules are the ones the controller runs (autoloop/decide.py),
the noise estimated from the night's own repeats (autoloop/simulate.py has the world).
All rules see the same proposals and the same luck. docs/decisions.md reads the numbers.

Printed per rule: false keeps per null proposal (and for the re-drawn ones alone), share
of real improvements of 2 sigma or more kept, share of harmful ones kept, share of the
keeps that truly helped, runs per decided proposal, proposals decided per night, the
final best's true gain over the baseline (sigma, ± standard error over nights), and the
winner's curse (its reported mean minus its true value, sigma; negative = it looks better
than it is). Then how the false-keep rate holds up when the world changes, and where on
the helpful share each rule wins.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoloop.decide import DecisionConfig  # noqa: E402
from autoloop.simulate import ALL_NULL, Mix, Summary, World, draw_nights, simulate, targets  # noqa: E402

HEADER = (f"{'rule':<28} {'false keeps':>11} {'re-draws':>9} {'>=2σ kept':>9} {'harm kept':>9} "
          f"{'real keeps':>10} {'runs/prop':>9} {'props':>6} {'true gain σ':>13} {'curse σ':>8}")


def row(s: Summary) -> str:
    big = f"{s.big_kept_share:>9.0%}" if s.big else f"{'-':>9}"
    return (f"{s.rule:<28} {s.false_keep_rate:>11.1%} {s.redraw_keep_rate:>9.1%} {big} "
            f"{s.harmful_kept / max(s.harmful, 1):>9.1%} {s.real_keep_share:>10.0%} {s.runs_per_proposal:>9.2f} {s.decided / s.nights:>6.1f} "
            f"{s.quality:>+7.2f} ±{s.quality_se:4.2f} {s.winners_curse:>+8.2f}")


def rules(margin: float) -> list[DecisionConfig]:
    return [DecisionConfig(rule="strict"), DecisionConfig(rule="strict", margin=margin), DecisionConfig()]


def table(title: str, cfgs: list[DecisionConfig], nights: int, world: World, mix: Mix, seed: int) -> list[Summary]:
    print(f"\n{title}")
    print(HEADER)
    draws = draw_nights(nights, world, mix, max(c.baseline_seeds + c.max_runs for c in cfgs), seed)
    out = []
    for cfg in cfgs:
        s = simulate(cfg, nights=nights, world=world, mix=mix, draws=draws)
        print(row(s), flush=True)
        out.append(s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nights", type=int, default=2000, help="Simulated nights for the main table.")
    ap.add_argument("--runs", type=int, default=100, help="Training runs in a night (the equal compute).")
    ap.add_argument("--shared", type=float, default=0.5, help="Share of the run variance a seed gives every commit of one init stream.")
    ap.add_argument("--margin", type=float, default=1.0, help="The fixed-margin rule's margin, in sigma.")
    ap.add_argument("--seed", type=int, default=0, help="Seed of the simulation.")
    ap.add_argument("--quick", action="store_true", help="300 nights, fewer side tables.")
    args = ap.parse_args()
    nights = 300 if args.quick else args.nights
    side = max(200, nights // 4)
    world = World(shared=args.shared, runs=args.runs)
    mix = Mix()
    start = time.perf_counter()
    print(f"{nights} nights of {world.runs} runs; sigma 1; shared seed variance {world.shared:.0%}; "
          f"baseline at {DecisionConfig().baseline_seeds} seeds; ours: {DecisionConfig()}")

    strict, _, ours = table("Realistic mix (25% null, 10% null re-draws, 55% harmful, 10% helpful)",
                            rules(args.margin), nights, world, mix, args.seed)
    print("\nTargets (ours against strict):")
    for name, (figures, ok) in targets(strict, ours).items():
        print(f"  {'met    ' if ok else 'NOT MET'}  {name}: {figures}")

    if not args.quick:
        for shared in (0.0, 0.9):
            if shared != world.shared:
                table(f"Realistic mix, shared seed variance {shared:.0%} ({side} nights)", rules(args.margin),
                      side, replace(world, shared=shared), mix, args.seed + 1)
        table(f"All proposals null (70% same stream, 30% re-draws; {side} nights)", rules(args.margin),
              side, world, ALL_NULL, args.seed + 2)
    print(f"\nTrue gain of the final best by share of helpful proposals (harmful = 65% - helpful; "
          f"{side} nights each):")
    print(f"{'helpful':>8} " + " ".join(f"{r:>16}" for r in ("strict", f"margin {args.margin:g}", "paired")))
    for helpful in ((0.02, 0.10, 0.20) if args.quick else (0.01, 0.02, 0.03, 0.05, 0.10, 0.20)):
        m = Mix(null=0.25, redraw=0.10, harmful=0.65 - helpful, helpful=helpful)
        draws = draw_nights(side, world, m, 8, args.seed + 3)
        cells = [simulate(c, nights=side, world=world, mix=m, draws=draws) for c in rules(args.margin)]
        print(f"{helpful:>8.0%} " + " ".join(f"{s.quality:>+9.2f} ±{s.quality_se:4.2f}" for s in cells), flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
