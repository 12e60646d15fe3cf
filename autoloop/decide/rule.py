"""Keep, discard or measure again: the decision, as pure functions (no I/O).

One training run is one sample: seeds move val_bpb by about as much as a typical late
gain. So a candidate is compared with the incumbent on the SAME seeds (same data order
and init stream), where most of the seed noise cancels (docs/decisions.md has the
reasoning and the simulation):

* d_s = candidate(s) - incumbent(s) over the n seeds both have; mean d, se = pair_sd / sqrt(n)
  with pair_sd the run's pooled noise of one paired difference (`pool_noise`), t = mean / se.

Two tiers. A kept candidate is **adopted** (the branch moves) or also **confirmed**
(a group-sequential test against the run's measured noise says so: with a known noise
the chance that a proposal with no effect is ever confirmed is exactly alpha,
`sequential_bound`, carried to t with the pooled df). Every verdict carries
figures["tier"] ("adopted" | "confirmed" | None) and figures["confirmed"] (bool).
The rules (`DecisionConfig.rule`):

* "two-tier" (the default): adopt on the paired mean, like the strict rule; confirmed
  when t reaches the bound. Optionally (`promising`, e.g. -1) look twice at what looks
  too good: while t < promising and not yet confirmed, the candidate is measured again
  (up to max_runs pairs); then it is confirmed when t reached the bound at some look,
  adopted when the paired mean is lower, discarded otherwise. Off by default: in the
  simulation the second look costs more true gain than it buys.
  Exploration moves as fast as the strict rule; honesty comes from the confirmed tier
  and from re-measuring what is reported at seeds no decision used (autoloop/decide/remeasure.py).
* "confirmed-only" (old name "paired"): only confirmed candidates move the branch;
  discard when t >= futility (-0.5) or at max_runs. The bound is computed with this
  futility rule in force (binding), which the rule always follows.
* "strict": one run, kept when it beats the incumbent's run at the same seed by
  `margin` (the old rule). Confirmed when, with noise measured, that one pair also
  passes the one-look bound at alpha.

Measuring again: the incumbent first where the candidate has a seed it lacks (no look
is taken on a half-measured pair), else the candidate on the next seed, preferring seeds
the incumbent already has. Each look n is taken once, with the noise known at that
moment. The baseline (no incumbent) is measured at `baseline_seeds` seeds (one under
the strict rule: the controller measures it so without verification; with verification
at `baseline_seeds` seeds, for the held-out guard's noise) and kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from statistics import NormalDist

from autoloop.errors import AutoloopError

RULES = ("two-tier", "confirmed-only", "paired", "strict")  # "paired": the old name of "confirmed-only"
# The loop's alpha when none is set: confirmed-only moves the branch only on confirmation,
# and at 0.05 it gives up the sub-sigma steps a night is made of (docs/decisions.md, the
# confirmed-only grid: 0.75 x strict's gain at 0.05, 0.87 x at 0.2).
DEFAULT_ALPHA = {"confirmed-only": 0.2}


def default_alpha(rule: str) -> float:
    """The alpha of `rule` when the configuration sets none (0.05, 0.2 under confirmed-only)."""
    return DEFAULT_ALPHA.get(rule, 0.05)
_NORMAL = NormalDist()


# ---------------------------------------------------------------------------------------
# The strict rule (kept as it was: the bench's reference and `decision-rule = strict`)


@dataclass(frozen=True)
class Decision:
    keep: bool
    reason: str


def decide_by_margin(metric: float, best: float | None, margin: float = 0.0) -> Decision:
    """Keep when the metric beats the best by more than `margin` (lower is better)."""
    if best is None:
        return Decision(True, f"first result: val_bpb {metric:.6f}")
    delta = metric - best
    if delta < -margin:
        return Decision(True, f"improved {best:.6f} -> {metric:.6f} ({delta:+.6f})")
    if margin:
        return Decision(False, f"{metric:.6f} does not beat the best {best:.6f} by more than {margin} ({delta:+.6f})")
    return Decision(False, f"{metric:.6f} is not better than the best {best:.6f} ({delta:+.6f})")


# ---------------------------------------------------------------------------------------
# Student t, without scipy: the CDF through the regularized incomplete beta function
# (continued fraction, Numerical Recipes 6.4), the quantile by bisection on the CDF.


def _beta_cf(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        step = d * c
        h *= step
        if abs(step - 1.0) < 1e-15:
            break
    return h


def _beta_inc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_cf(a, b, x) / a
    return 1.0 - front * _beta_cf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df degrees of freedom (df = inf: the normal)."""
    if math.isinf(df) or df > 1e7:
        return _NORMAL.cdf(t)
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * _beta_inc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


@lru_cache(maxsize=4096)
def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (cached: the rule asks for a handful of (p, df) pairs)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile needs 0 < p < 1, got {p}")
    if math.isinf(df) or df > 1e7:
        return _NORMAL.inv_cdf(p)
    if df <= 0:
        raise ValueError(f"t_quantile needs df > 0, got {df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, max(1.0, _NORMAL.inv_cdf(p))
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):  # bisection to float resolution; ~0.5 ms, once per (p, df)
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


# ---------------------------------------------------------------------------------------
# Pooled noise


@dataclass(frozen=True)
class Noise:
    """The run's measured noise: sd of one run (across seeds), sd of one paired difference
    (candidate minus incumbent at a shared seed), and the degrees of freedom behind it."""

    run_sd: float
    pair_sd: float
    df: int


@dataclass(frozen=True)
class NoiseSums:
    """Sums of squares and their degrees of freedom; additive, so a long history can be
    summed once and the groups still changing added on each call (the simulation does)."""

    ss_run: float = 0.0
    df_run: int = 0
    ss_pair: float = 0.0
    df_pair: int = 0

    def __add__(self, other: NoiseSums) -> NoiseSums:
        return NoiseSums(self.ss_run + other.ss_run, self.df_run + other.df_run,
                         self.ss_pair + other.ss_pair, self.df_pair + other.df_pair)

    def __sub__(self, other: NoiseSums) -> NoiseSums:
        """Take out groups summed before (to sum a group again with more runs in it)."""
        return NoiseSums(self.ss_run - other.ss_run, self.df_run - other.df_run,
                         self.ss_pair - other.ss_pair, self.df_pair - other.df_pair)

    def noise(self) -> Noise | None:
        df = self.df_run + self.df_pair
        if df == 0:
            return None
        # Runs of one commit at different seeds estimate run_sd^2; a paired difference
        # without any shared seed component has variance 2 run_sd^2, and sharing only
        # lowers it, so 2 * ss_run is a conservative stand-in for paired sums of squares.
        pair_var = (2.0 * self.ss_run + self.ss_pair) / df
        run_sd = math.sqrt(self.ss_run / self.df_run) if self.df_run else math.sqrt(pair_var / 2.0)
        return Noise(run_sd=run_sd, pair_sd=math.sqrt(pair_var), df=df)


def sum_of_squares(values) -> tuple[float, int]:
    """(sum of squared deviations from the values' own mean, degrees of freedom n - 1)."""
    n = len(values)
    if n < 2:
        return 0.0, 0
    mean = sum(values) / n
    return sum((v - mean) ** 2 for v in values), n - 1


def noise_sums(repeats: list[list[float]], paired_diffs: list[list[float]]) -> NoiseSums:
    ss_run = ss_pair = 0.0
    df_run = df_pair = 0
    for group in repeats:
        ss, df = sum_of_squares(group)
        ss_run += ss
        df_run += df
    for group in paired_diffs:
        ss, df = sum_of_squares(group)
        ss_pair += ss
        df_pair += df
    return NoiseSums(ss_run, df_run, ss_pair, df_pair)


def pool_noise(repeats: list[list[float]], paired_diffs: list[list[float]], *,
               base: NoiseSums | None = None) -> Noise | None:
    """The pooled noise of a paired difference from every repeated measurement.

    repeats: groups of runs of one commit at different seeds (each group once, however
    many comparisons it served in); paired_diffs: per comparison, candidate minus incumbent
    at their shared seeds. Each group contributes its sum of squares about its own mean
    with (size - 1) degrees of freedom (so true effects never inflate the noise);
    pair_sd^2 = (2 SS_run + SS_pair) / (df_run + df_pair). None while there is no degree
    of freedom (fewer than two runs of anything). `base`: sums of groups already summed.
    """
    sums = noise_sums(repeats, paired_diffs)
    if base is not None:
        sums = base + sums
    return sums.noise()


# ---------------------------------------------------------------------------------------
# Configuration and verdicts


@dataclass(frozen=True)
class DecisionConfig:
    """The rule and its thresholds (Config keys decision-rule, baseline-seeds, max-runs, alpha, ...).

    rule: "two-tier" (adopt on the paired mean, confirm by the sequential test),
    "confirmed-only" (only confirmed candidates are kept; "paired" is its old name) or
    "strict" (one run; keep when it beats the incumbent's run at the same seed by `margin`).
    baseline_seeds: seeds the baseline is measured at (its spread starts the noise
    estimate); the strict rule measures the baseline once, as the controller does without
    verification (with verification it gives every rule `baseline_seeds`:
    autoloop.loop.trial.baseline_seed_count).
    max_runs: most runs of one candidate (= most looks of the sequential test).
    alpha: the chance that a proposal with no true effect is confirmed (over all its looks);
    under confirmed-only, kept.
    futility: confirmed-only: discard early when t >= futility (-0.5: not better by half a
    standard error).
    promising: two-tier: measure again while t < promising (-1: better by a standard error
    or more, not yet confirmed), then adopt when the paired mean is lower; None (the
    default): never, adopt on the first pair (docs/decisions.md: the second look costs
    more true gain than it buys). The confirmation bound is computed with this
    continuation region (None: one look).
    adopt: two-tier: adopt when t < adopt (0: any lower paired mean; -0.25: lower by a
    quarter of a standard error).
    margin: the strict rule's margin, in metric units (0: any improvement).
    level: two-sided level of the interval reported in figures.
    reserve_seeds: fresh seeds (no decision uses them) at which the final best is
    re-measured for the reported figures (autoloop/decide/remeasure.py).
    reserve_baseline: re-measure the baseline at the same fresh seeds too (a paired gain,
    4 more runs); off: the baseline's own runs stand for it (it was never selected, so
    its mean carries no winner's curse; docs/decisions.md measures the difference).
    """

    rule: str = "two-tier"
    baseline_seeds: int = 3
    max_runs: int = 5
    alpha: float = 0.05
    futility: float = -0.5
    promising: float | None = None
    adopt: float = 0.0
    margin: float = 0.0
    level: float = 0.95
    reserve_seeds: int = 4
    reserve_baseline: bool = False

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise AutoloopError(f"decision-rule {self.rule!r} is unknown: use one of {', '.join(RULES)}")
        if self.baseline_seeds < 1:
            raise AutoloopError(f"baseline-seeds is {self.baseline_seeds}: set it to 1 or more (3 measures the noise)")
        if self.max_runs < 1:
            raise AutoloopError(f"max-runs is {self.max_runs}: set it to 1 or more (default 5)")
        if not 0.0 < self.alpha < 0.5:
            raise AutoloopError(f"alpha is {self.alpha}: set it between 0 and 0.5 (default 0.05)")
        if not 0.0 < self.level < 1.0:
            raise AutoloopError(f"level is {self.level}: set it between 0 and 1 (default 0.95)")
        if self.margin < 0:
            raise AutoloopError(f"margin is {self.margin}: set it to 0 or more (metric units)")
        if self.adopt > 0:
            raise AutoloopError(f"adopt is {self.adopt}: set it to 0 or below (in standard errors)")
        if self.promising is not None and self.promising > 0:
            raise AutoloopError(f"promising is {self.promising}: set it to 0 or below (in standard errors), or none")
        if self.reserve_seeds < 0:
            raise AutoloopError(f"reserve-seeds is {self.reserve_seeds}: set it to 0 or more (default 4)")

    @property
    def sequential(self) -> str:
        """The rule's family: "two-tier", "confirmed-only" (also for "paired") or "strict"."""
        return "confirmed-only" if self.rule == "paired" else self.rule

    @property
    def baseline_runs(self) -> int:
        """Seeds the baseline is measured at: one under the strict rule (the controller's)."""
        return 1 if self.rule == "strict" else self.baseline_seeds


@dataclass(frozen=True)
class Verdict:
    action: str  # "keep" | "discard" | "measure"
    side: str | None  # "candidate" | "incumbent" when measuring, else None
    seed: int | None
    reason: str  # one line for humans
    figures: dict = field(default_factory=dict)  # JSON-able: statistic, interval, n, bound, why it stopped


@lru_cache(maxsize=64)
def sequential_bound(alpha: float, looks: int, futility: float) -> float:
    """The constant c of the group-sequential test, for a known noise.

    With d_1, d_2, ... iid N(0, 1) under the null and Z_n = (d_1 + ... + d_n) / sqrt(n), the
    test keeps at the first look n <= looks with Z_n <= -c and stops (discards) at the first
    with Z_n >= futility. c is chosen so that P(keep) = alpha exactly (the futility bound is
    binding: the rule always follows it). Computed by propagating the density of the
    partial sum over the continuation region on a grid (Armitage, McPherson and Rowe 1969);
    bisection on c. About 0.1 s once per (alpha, looks, futility).
    """
    import numpy as np  # here, not at the top: the CLI imports this module and starts faster without numpy

    h = 0.02
    span = 8.0 + 7.0 * math.sqrt(looks)
    x = np.arange(-span, span + h / 2, h)
    k = np.arange(-8.0, 8.0 + h / 2, h)
    kernel = np.exp(-0.5 * k * k) / math.sqrt(2 * math.pi) * h
    cdf = np.vectorize(_NORMAL.cdf)

    def type_one(c: float) -> float:
        total = _NORMAL.cdf(-c)
        g = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)  # density of S_1
        for n in range(2, looks + 1):
            g = np.where((x > -c * math.sqrt(n - 1)) & (x < futility * math.sqrt(n - 1)), g, 0.0)
            total += float(np.sum(g * cdf(-c * math.sqrt(n) - x)) * h)
            g = np.convolve(g, kernel, mode="same")
        return total

    lo, hi = 0.0, 8.0
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if type_one(mid) > alpha:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def confirm_constant(cfg: DecisionConfig) -> float:
    """The known-noise constant c of the rule's confirmation test: its looks and its
    continuation region (-c, f) with f = futility (confirmed-only) or promising (two-tier);
    the strict rule, and the two-tier rule without a second look, take one look."""
    if cfg.sequential == "strict" or (cfg.sequential == "two-tier" and cfg.promising is None):
        return sequential_bound(cfg.alpha, 1, 0.0)
    f = cfg.promising if cfg.sequential == "two-tier" else cfg.futility
    return sequential_bound(cfg.alpha, cfg.max_runs, f)


def keep_bound(cfg: DecisionConfig, df: float) -> float:
    """The t a candidate's mean paired difference must reach to be confirmed (negative:
    lower is better); under confirmed-only, to be kept.

    The known-noise bound -c of `sequential_bound`, carried to the t distribution at the
    same one-sided level (Jennison and Turnbull 2000, ch. 11): t_df(Phi(-c)).
    """
    return t_quantile(_NORMAL.cdf(-confirm_constant(cfg)), df)


def estimate(values: list[float], noise: Noise | None) -> tuple[float, float | None]:
    """A trial's metric: the mean of its runs and its standard error (run_sd / sqrt(n)).

    Without pooled noise the runs' own spread is used; with one run and no noise the
    standard error is unknown: None.
    """
    if not values:
        raise ValueError("estimate needs at least one value")
    n = len(values)
    mean = sum(values) / n
    if noise is not None:
        return mean, noise.run_sd / math.sqrt(n)
    ss, df = sum_of_squares(values)
    return mean, (math.sqrt(ss / df / n) if df else None)


def paired_effect(cand: dict[int, float], inc: dict[int, float], noise: Noise | None,
                  level: float = 0.95) -> tuple[float, float, float]:
    """Mean of candidate minus incumbent over shared seeds with its two-sided interval.

    The interval uses the pooled pair_sd and its df; without noise, the differences' own
    spread (df n - 1); with one shared seed and no noise the interval is unbounded.
    """
    shared = sorted(set(cand) & set(inc))
    if not shared:
        raise ValueError("paired_effect needs at least one seed measured on both sides")
    diffs = [cand[s] - inc[s] for s in shared]
    n = len(diffs)
    mean = sum(diffs) / n
    if noise is not None:
        sd, df = noise.pair_sd, noise.df
    else:
        ss, df = sum_of_squares(diffs)
        if not df:
            return mean, -math.inf, math.inf
        sd = math.sqrt(ss / df)
    half = t_quantile(0.5 + level / 2.0, df) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


# ---------------------------------------------------------------------------------------
# The decision


def _decimals(scale: float) -> int:
    """Enough decimals to show `scale` with two significant digits (at least 4)."""
    if not scale or not math.isfinite(scale):
        return 4
    return max(4, min(8, 1 - math.floor(math.log10(abs(scale)))))


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _seeds_word(n: int) -> str:
    return f"{n} paired seed" + ("" if n == 1 else "s")


def _next_candidate_seed(candidate: dict, incumbent: dict, seeds: list[int]) -> int | None:
    # A seed the incumbent already has costs one run; any other costs two.
    for s in seeds:
        if s not in candidate and s in incumbent:
            return s
    for s in seeds:
        if s not in candidate:
            return s
    return None


def decide(candidate: dict[int, float], incumbent: dict[int, float], noise: Noise | None,
           cfg: DecisionConfig, seeds: list[int]) -> Verdict:
    """Keep, discard, or which measurement to run next.

    candidate / incumbent: metric by seed (the runs that finished ok); incumbent empty
    means this is the baseline. noise: the run's pooled noise (`pool_noise`, including this
    comparison's own runs and differences), None while nothing was repeated. seeds: the
    run's seed sequence (base seed, base+1, ...), long enough for baseline_seeds and
    max_runs. A keep is figures["tier"] "adopted" or "confirmed" (figures["confirmed"]).
    """
    if not incumbent:
        return _baseline(candidate, noise, cfg, seeds)
    if cfg.sequential == "strict":
        return _strict(candidate, incumbent, noise, cfg, seeds)
    return _sequential(candidate, incumbent, noise, cfg, seeds)


def _tiered(figures: dict, action: str, confirmed: bool) -> dict:
    figures["confirmed"] = bool(confirmed and action == "keep")
    figures["tier"] = ("confirmed" if figures["confirmed"] else "adopted") if action == "keep" else None
    return figures


def _baseline(candidate, noise, cfg, seeds) -> Verdict:
    for s in seeds[: cfg.baseline_runs]:
        if s not in candidate:
            return Verdict("measure", "candidate", s,
                           f"measure the baseline at seed {s} ({len(candidate) + 1} of {cfg.baseline_runs})",
                           {"rule": cfg.rule, "n": len(candidate), "stopped": "baseline seeds"})
    mean, se = estimate(list(candidate.values()), noise)
    dec = _decimals(se or 0.0)
    spread = f" ± {se:.{dec}f}" if se is not None else ""
    # The baseline is the reference, not a change: nothing to confirm, and always the first incumbent.
    return Verdict("keep", None, None,
                   f"baseline: {mean:.{dec}f}{spread} bpb over {len(candidate)} seed{'s' if len(candidate) != 1 else ''}",
                   {"rule": cfg.rule, "n": len(candidate), "mean": mean, "se": se, "stopped": "baseline",
                    "tier": "baseline", "confirmed": False})


def _strict(candidate, incumbent, noise, cfg, seeds) -> Verdict:
    seed = next((s for s in seeds if s in candidate), seeds[0] if seeds else None)
    if seed is None:
        raise ValueError("decide needs a seed sequence")
    if seed not in candidate:
        return Verdict("measure", "candidate", seed, f"measure the candidate at seed {seed}",
                       {"rule": cfg.rule, "n": 0, "stopped": "continue"})
    if seed not in incumbent:
        return Verdict("measure", "incumbent", seed, f"measure the incumbent at seed {seed} to compare on the same seed",
                       {"rule": cfg.rule, "n": 0, "stopped": "continue"})
    d = decide_by_margin(candidate[seed], incumbent[seed], cfg.margin)
    diff = candidate[seed] - incumbent[seed]
    action = "keep" if d.keep else "discard"
    figures = {"rule": cfg.rule, "n": 1, "seed": seed, "mean_diff": diff, "margin": cfg.margin,
               "stopped": "margin" if d.keep else "not better by the margin"}
    confirmed = False
    if noise is not None:
        # One pair, one look: confirmed when it also passes the one-look bound at alpha.
        bound = keep_bound(cfg, noise.df)
        t = diff / noise.pair_sd if noise.pair_sd > 0 else (-math.inf if diff < 0 else math.inf)
        confirmed = t <= bound
        figures.update(t=_finite(t), keep_bound=bound, df=noise.df, pair_sd=noise.pair_sd, run_sd=noise.run_sd)
    tier = " (confirmed)" if confirmed and d.keep else ""
    return Verdict(action, None, None, f"{action}{tier}: {d.reason}", _tiered(figures, action, confirmed))


def _sequential(candidate, incumbent, noise, cfg, seeds) -> Verdict:
    two_tier = cfg.sequential == "two-tier"
    # Pair first: a candidate run on a seed the incumbent lacks is not yet a paired difference.
    order = list(seeds) + sorted(set(candidate) - set(seeds))
    for s in order:
        if s in candidate and s not in incumbent:
            return Verdict("measure", "incumbent", s,
                           f"measure the incumbent at seed {s} to pair the candidate's run there",
                           {"rule": cfg.rule, "n": len(set(candidate) & set(incumbent)), "stopped": "pairing"})
    shared = [s for s in order if s in candidate and s in incumbent]
    if not shared:
        s = _next_candidate_seed(candidate, incumbent, seeds)
        if s is None:
            raise ValueError("decide needs a seed sequence")
        return Verdict("measure", "candidate", s, f"measure the candidate at seed {s}",
                       {"rule": cfg.rule, "n": 0, "stopped": "continue"})

    diffs = [candidate[s] - incumbent[s] for s in shared]
    n = len(diffs)
    mean = sum(diffs) / n
    k = cfg.max_runs
    source = "pooled"
    if noise is None:
        # Nothing repeated anywhere else yet: fall back on this comparison's own spread.
        noise = pool_noise([[candidate[s] for s in shared], [incumbent[s] for s in shared]], [diffs])
        source = "own"
    figures: dict = {"rule": cfg.rule, "n": n, "seeds": shared, "mean_diff": mean, "max_runs": k,
                     "alpha": cfg.alpha, "noise_source": source if noise else None}
    if two_tier:
        figures["promising"] = cfg.promising
    else:
        figures["futility"] = cfg.futility
    has_seed = _next_candidate_seed(candidate, incumbent, seeds) is not None

    if noise is None:
        # One paired seed and no noise at all (baseline-seeds = 1): the sign still says
        # whether the candidate is better (two-tier: adopt it) or can be worth a second run.
        figures.update(t=None, keep_bound=None, df=0)
        dec = _decimals(mean)
        summary = f"{mean:+.{dec}f} bpb on {_seeds_word(n)}"
        if two_tier:
            if mean < 0:
                figures["stopped"] = "paired mean"
                return Verdict("keep", None, None, f"adopt: {summary}, lower; no noise measured yet to confirm it",
                               _tiered(figures, "keep", False))
            figures.update(stopped="not better", near_miss=False)
            return Verdict("discard", None, None, f"discard: {summary}, not better than the incumbent",
                           _tiered(figures, "discard", False))
        if mean >= 0 or n >= k or not has_seed:
            figures["stopped"] = "futility" if mean >= 0 else ("max runs" if n >= k else "no seeds left")
            return Verdict("discard", None, None,
                           f"discard: {summary}, not better and no noise measured yet",
                           _tiered(figures | {"near_miss": mean < 0}, "discard", False))
        return _measure_candidate(candidate, incumbent, seeds, figures, f"{summary}, no noise measured yet")

    se = noise.pair_sd / math.sqrt(n)
    bound = keep_bound(cfg, noise.df)
    if se > 0:
        t = mean / se
    else:  # no noise at all: the sign decides
        t = -math.inf if mean < 0 else (math.inf if mean > 0 else 0.0)
    low, high = mean, mean
    if se > 0:
        half = t_quantile(0.5 + cfg.level / 2.0, noise.df) * se
        low, high = mean - half, mean + half
    figures.update(se=se, t=_finite(t), keep_bound=bound, df=noise.df, pair_sd=noise.pair_sd,
                   run_sd=noise.run_sd, interval=[low, high], level=cfg.level)
    dec = _decimals(se)
    t_text = f"{t:+.1f}" if math.isfinite(t) else ("-inf" if t < 0 else "+inf")
    summary = f"{mean:+.{dec}f} ± {se:.{dec}f} bpb over {_seeds_word(n)}"

    if t <= bound:
        figures["stopped"] = "keep bound"
        return Verdict("keep", None, None, f"keep (confirmed): {summary} (t = {t_text}, bound {bound:.1f})",
                       _tiered(figures, "keep", True))
    if two_tier:
        if cfg.promising is not None and n < k and t < cfg.promising and has_seed:
            return _measure_candidate(candidate, incumbent, seeds, figures,
                                      f"{summary}, better than it may be (t = {t_text}, bound {bound:.1f})")
        if mean < 0 and t < cfg.adopt:
            figures["stopped"] = "paired mean"
            return Verdict("keep", None, None,
                           f"adopt: {summary}, lower on average, not confirmed (t = {t_text}, bound {bound:.1f})",
                           _tiered(figures, "keep", False))
        figures.update(stopped="not better", near_miss=False)
        return Verdict("discard", None, None, f"discard: {summary}, not better than the incumbent (t = {t_text})",
                       _tiered(figures, "discard", False))
    if n >= k:
        figures.update(stopped="max runs", near_miss=mean < 0)
        return Verdict("discard", None, None,
                       f"discard: {summary}, not distinguishable from the incumbent after {k} runs "
                       f"(t = {t_text}, bound {bound:.1f})", _tiered(figures, "discard", False))
    if t >= cfg.futility:
        figures.update(stopped="futility", near_miss=mean < 0)
        why = "not better than the incumbent" if mean >= 0 else "too little better to measure again"
        return Verdict("discard", None, None, f"discard: {summary}, {why} (t = {t_text} >= {cfg.futility:g})",
                       _tiered(figures, "discard", False))
    return _measure_candidate(candidate, incumbent, seeds, figures,
                              f"{summary} (t = {t_text}, bound {bound:.1f})")


def _measure_candidate(candidate, incumbent, seeds, figures, summary) -> Verdict:
    s = _next_candidate_seed(candidate, incumbent, seeds)
    if s is None:
        figures.update(stopped="no seeds left", near_miss=figures.get("mean_diff", 0.0) < 0)
        return Verdict("discard", None, None, f"discard: {summary}; no seed left to measure",
                       _tiered(figures, "discard", False))
    figures["stopped"] = "continue"
    return Verdict("measure", "candidate", s, f"measure the candidate at seed {s}: {summary}", figures)
