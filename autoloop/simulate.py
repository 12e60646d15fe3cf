"""Simulated nights: how well a decision rule keeps real changes, at equal compute.

In-process and fast (thousands of nights in seconds), for bench/decision_quality.py and
its tests; the controller never imports it. It lives in the package (not in bench/) so
tests import it like any module, and it drives the SAME `decide()` and `pool_noise()` the
controller uses, with the noise estimated from the night's own repeats exactly as the
controller does (see docs/decisions.md, "What the controller passes").

The world, in units of sigma (the sd of one run across seeds):

* a run of commit c at seed s gives  mu_c + sqrt(shared) * sigma * b[g_c, s] + sqrt(1 - shared) * sigma * e[c, s]
  with b, e standard normal: b is the part of the seed's luck that every commit of one
  init lineage g shares (same data order and init stream), so pairing cancels it; e is
  the commit's own luck. A proposal inherits its incumbent's lineage, except init-only
  re-draws, which start a new one (no shared component: their paired difference has the
  full unpaired variance 2 sigma^2).
* a night is a fixed number of training runs; every run (baseline, candidate or incumbent
  re-measurement) costs one. The baseline is measured at baseline_seeds seeds under every
  rule. A proposal changes the incumbent's true value by its effect: 0 (null; a share
  of them init re-draws), > 0 (harmful) or < 0 (helpful), magnitudes log-uniform in a range.
* a candidate still being measured when the night's runs are spent is not decided.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from autoloop.decide import DecisionConfig, NoiseSums, decide, estimate, noise_sums, pool_noise

NULL, REDRAW, HARMFUL, HELPFUL = 0, 1, 2, 3


@dataclass(frozen=True)
class Mix:
    """What a night's proposals do (shares sum to 1; magnitudes in sigma, log-uniform)."""

    null: float = 0.25  # no effect, same init stream (a refactor, a no-op constant)
    redraw: float = 0.10  # no effect, new init stream (re-seeding, reordering parameter creation)
    harmful: float = 0.55  # most edits to a tuned script hurt, from barely to badly
    helpful: float = 0.10  # about one in ten helps, mostly by less than the noise
    harmful_range: tuple[float, float] = (0.1, 10.0)
    helpful_range: tuple[float, float] = (0.1, 5.0)

    def __post_init__(self) -> None:
        total = self.null + self.redraw + self.harmful + self.helpful
        if abs(total - 1.0) > 1e-9:
            raise ValueError(f"mix shares sum to {total}, not 1")


ALL_NULL = Mix(null=0.7, redraw=0.3, harmful=0.0, helpful=0.0)


@dataclass(frozen=True)
class World:
    sigma: float = 1.0  # sd of one run across seeds
    shared: float = 0.5  # share of the run variance that the seed gives every commit of a lineage
    runs: int = 100  # training runs in a night (the equal compute)


@dataclass
class Summary:
    """What the rules are judged on, over all simulated nights."""

    rule: str
    nights: int
    decided: int = 0  # proposals decided
    null: int = 0  # decided proposals with no effect (same stream or re-draw)
    null_kept: int = 0
    redraw: int = 0
    redraw_kept: int = 0
    harmful: int = 0
    harmful_kept: int = 0
    big: int = 0  # decided improvements of 2 sigma or more
    big_kept: int = 0
    helpful: int = 0
    helpful_kept: int = 0
    runs: int = 0  # runs spent on decided proposals (candidate + incumbent re-measurements)
    final_true: list[float] = field(default_factory=list)  # true value of the final incumbent (baseline 0)
    curse: list[float] = field(default_factory=list)  # its reported mean minus its true value

    @property
    def false_keep_rate(self) -> float:
        return self.null_kept / self.null if self.null else 0.0

    @property
    def redraw_keep_rate(self) -> float:
        return self.redraw_kept / self.redraw if self.redraw else 0.0

    @property
    def big_kept_share(self) -> float:
        return self.big_kept / self.big if self.big else float("nan")

    @property
    def real_keep_share(self) -> float:
        """Of the proposals kept, the share that truly helped."""
        kept = self.null_kept + self.harmful_kept + self.helpful_kept
        return self.helpful_kept / kept if kept else float("nan")

    @property
    def runs_per_proposal(self) -> float:
        return self.runs / self.decided if self.decided else float("nan")

    @property
    def quality(self) -> float:
        """Mean true gain of the final best over the baseline, in sigma (higher is better)."""
        return -float(np.mean(self.final_true))

    @property
    def quality_se(self) -> float:
        return float(np.std(self.final_true, ddof=1) / math.sqrt(len(self.final_true))) if len(self.final_true) > 1 else 0.0

    @property
    def winners_curse(self) -> float:
        """Mean of (reported best - its true value): negative = the best looks better than it is."""
        return float(np.mean(self.curse))


def draw_nights(nights: int, world: World, mix: Mix, cfg_max_seeds: int, seed: int) -> dict:
    """Every random number of every night, drawn up front, so that all rules see the same
    proposals and the same luck (common random numbers: their differences are sharper)."""
    rng = np.random.default_rng(seed)
    n = world.runs  # at most one proposal per run
    kinds = rng.choice(4, size=(nights, n), p=[mix.null, mix.redraw, mix.harmful, mix.helpful])
    u = rng.random((nights, n))
    lo_h, hi_h = np.log(mix.harmful_range[0]), np.log(mix.harmful_range[1])
    lo_g, hi_g = np.log(mix.helpful_range[0]), np.log(mix.helpful_range[1])
    effects = np.where(kinds == HARMFUL, np.exp(lo_h + u * (hi_h - lo_h)),
                       np.where(kinds == HELPFUL, -np.exp(lo_g + u * (hi_g - lo_g)), 0.0)) * world.sigma
    own = rng.standard_normal((nights, n + 1, cfg_max_seeds))
    lineage = rng.standard_normal((nights, n + 1, cfg_max_seeds))
    return {"kinds": kinds, "effects": effects, "own": own, "lineage": lineage}


def simulate(cfg: DecisionConfig, *, nights: int = 2000, world: World = World(), mix: Mix = Mix(),
             seed: int = 0, draws: dict | None = None) -> Summary:
    """Run `nights` simulated nights under one rule; `draws` (from draw_nights) to share luck."""
    n_seeds = cfg.baseline_seeds + cfg.max_runs
    if draws is None:
        draws = draw_nights(nights, world, mix, n_seeds, seed)
    out = Summary(rule=_label(cfg), nights=nights)
    for j in range(nights):
        _night(cfg, world, draws["kinds"][j].tolist(), draws["effects"][j].tolist(),
               draws["own"][j].tolist(), draws["lineage"][j].tolist(), n_seeds, out)
    return out


def _label(cfg: DecisionConfig) -> str:
    if cfg.rule == "strict":
        return "strict" if not cfg.margin else f"margin {cfg.margin:g}"
    return f"paired (alpha {cfg.alpha:g}, max {cfg.max_runs})"


def _night(cfg, world, kinds, effects, own, lineage_noise, n_seeds, out: Summary) -> None:
    seeds = list(range(n_seeds))
    paired = cfg.rule == "paired"
    sd_b = world.sigma * math.sqrt(world.shared)
    sd_e = world.sigma * math.sqrt(1.0 - world.shared)
    mu = [0.0]  # true value of commit c (0: the baseline)
    lineage = [0]  # which init lineage commit c belongs to

    def run(c: int, s: int) -> float:
        return mu[c] + sd_b * lineage_noise[lineage[c]][s] + sd_e * own[c][s]

    budget = world.runs
    base = NoiseSums()  # sums of squares of groups that no longer change
    # The baseline: measured at baseline_seeds seeds, its spread is the first noise estimate.
    inc, inc_runs = 0, {}
    while True:
        noise = pool_noise([list(inc_runs.values())], [], base=base) if paired else None
        v = decide(inc_runs, {}, noise, cfg, seeds)
        if v.action != "measure":
            break
        if budget == 0:
            break
        budget -= 1
        inc_runs[v.seed] = run(0, v.seed)

    for i in range(len(effects)):
        if budget == 0:
            break
        c = i + 1
        kind = kinds[i]
        mu.append(mu[inc] + effects[i])
        lineage.append(c if kind == REDRAW else lineage[inc])
        cand: dict[int, float] = {}
        spent = 0
        verdict = None
        diffs: list[float] = []
        while True:
            if paired:
                diffs = [cand[s] - inc_runs[s] for s in cand if s in inc_runs]
                noise = pool_noise([list(inc_runs.values()), list(cand.values())], [diffs], base=base)
            else:
                noise = None
            v = decide(cand, inc_runs, noise, cfg, seeds)
            if v.action != "measure":
                verdict = v
                break
            if budget == 0:
                break
            budget -= 1
            spent += 1
            if v.side == "candidate":
                cand[v.seed] = run(c, v.seed)
            else:
                inc_runs[v.seed] = run(inc, v.seed)
        if verdict is None:
            break  # the night ended mid-measurement: not decided
        kept = verdict.action == "keep"
        out.decided += 1
        out.runs += spent
        effect = effects[i]
        if kind in (NULL, REDRAW):
            out.null += 1
            out.null_kept += kept
            if kind == REDRAW:
                out.redraw += 1
                out.redraw_kept += kept
        elif kind == HARMFUL:
            out.harmful += 1
            out.harmful_kept += kept
        else:
            out.helpful += 1
            out.helpful_kept += kept
            if effect <= -2.0 * world.sigma:
                out.big += 1
                out.big_kept += kept
        if paired:
            # The comparison's differences are final; a discarded candidate's runs too.
            base = base + noise_sums([] if kept else [list(cand.values())], [diffs])
            if kept:
                base = base + noise_sums([list(inc_runs.values())], [])
        if kept:
            inc, inc_runs = c, cand

    reported, _ = estimate(list(inc_runs.values()), None)
    out.final_true.append(mu[inc])
    out.curse.append(reported - mu[inc])


def targets(strict: Summary, ours: Summary) -> dict[str, tuple[str, bool]]:
    """The issue's targets for `ours` against the strict rule: name -> (figures, met)."""
    curse_ratio = abs(ours.winners_curse) / abs(strict.winners_curse) if strict.winners_curse else float("inf")
    return {
        "false keeps <= 5% per null proposal": (f"{ours.false_keep_rate:.1%}", ours.false_keep_rate <= 0.05),
        ">= 80% of improvements of 2 sigma or more kept": (f"{ours.big_kept_share:.0%}", ours.big_kept_share >= 0.80),
        "final true quality better than strict's": (
            f"{ours.quality:+.2f} vs {strict.quality:+.2f} sigma", ours.quality > strict.quality),
        "winner's curse <= 1/3 of strict's": (
            f"{ours.winners_curse:+.2f} vs {strict.winners_curse:+.2f} sigma ({curse_ratio:.2f})", curse_ratio <= 1 / 3),
    }
