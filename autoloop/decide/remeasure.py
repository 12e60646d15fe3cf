"""The honest headline: the best's value and its gain, re-measured at seeds no decision used.

A night's best is the candidate that looked best; its selection mean is a lucky draw (the
winner's curse: in the simulation the strict rule's best looks 2 sigma better than it
is). Runs at fresh seeds of the final best were never part of any decision, so their
mean is an unbiased measure of it. So the reported value and the gain over the baseline
come from a *reserve*: the final best at `n` fresh seeds (`reserve_seeds`: far from the
decision seeds base, base+1, ...; `reserve_size` scales n with a short night), and
optionally the baseline at the same seeds (otherwise its own runs: the baseline is never
selected, so its mean carries no winner's curse), at the end of a night, on `finalize`,
or whenever the headline is asked for a run that has none.

* value = mean of the best's fresh runs, se = run_sd / sqrt(n).
* gain = baseline minus best (positive: the best is better, in metric units), over the
  seeds both have: paired (the seed's shared luck cancels), se = pair_sd / sqrt(n), with
  the run's pooled noise (pair_sd, df) when given, or the differences' own spread
  (df = n - 1) when there is no pooled noise or the own spread is the larger.
  pair_sd carries the conservative 2 x run variance term (decide.pool_noise),
  so a best on a re-drawn init stream, which shares no seed luck with the baseline, is
  covered too. Without shared seeds: unpaired, se = run_sd sqrt(1/n_best + 1/n_base).
* interval: gain ± t_df(0.5 + level/2) se.

Pure: the caller runs the measurements `reserve_plan` lists and passes their metrics.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from autoloop.decide.rule import Noise, sum_of_squares, t_quantile

RESERVE_OFFSET = 1_000_000  # reserve seeds start here above the run's base seed: no decision reaches them


def reserve_size(night_runs: float, most: int = 4, share: float = 0.04, least: int = 2) -> int:
    """Fresh seeds for a night of `night_runs` training runs: 4% of the night, at least 2,
    at most `most` (reserve-seeds). A fixed cost weighs more in a short night: 4 runs are
    8% of a 50-run night (docs/decisions.md, sensitivity), 2 leave a value se of 0.7 run sd."""
    return max(min(least, most), min(most, int(share * night_runs + 1e-9)))


def reserve_seeds(base_seed: int, n: int) -> list[int]:
    """The n fresh seeds of the reserve (the same for the best and the baseline: paired)."""
    return [base_seed + RESERVE_OFFSET + k for k in range(n)]


def reserve_plan(best_runs: dict[int, float], baseline_runs: dict[int, float], base_seed: int, n: int, *,
                 baseline: bool = False, same_commit: bool = False) -> list[tuple[str, int]]:
    """The measurements still missing for the headline: [("best" | "baseline", seed)].
    baseline: the baseline at the same fresh seeds too (DecisionConfig.reserve_baseline);
    off, its own runs stand for it. same_commit: the best is the baseline (nothing was
    kept): its runs serve both."""
    out = []
    for seed in reserve_seeds(base_seed, n):
        if seed not in best_runs:
            out.append(("best", seed))
        if baseline and not same_commit and seed not in baseline_runs:
            out.append(("baseline", seed))
    return out


@dataclass(frozen=True)
class Headline:
    value: float  # the best's re-measured metric (mean over its fresh seeds)
    value_se: float | None
    gain: float  # baseline minus best: positive = better than the baseline
    gain_se: float | None
    interval: tuple[float, float]  # of the gain, two-sided at `level`
    level: float
    n: int  # fresh seeds of the best
    paired: bool  # the gain is over seeds both have
    df: int | None
    seeds: tuple[int, ...]

    def to_json(self) -> dict:
        out = asdict(self)
        out["interval"] = [_finite(x) for x in self.interval]
        return out


def _finite(x):
    return x if x is not None and math.isfinite(x) else None


def headline(best: dict[int, float], baseline: dict[int, float], noise: Noise | None = None, *,
             level: float = 0.95, seeds: list[int] | None = None, same_commit: bool = False) -> Headline:
    """The reported value and gain from the reserve's runs.

    best / baseline: {seed: metric} at fresh seeds (only those in `seeds` when given:
    pass `reserve_seeds(...)` to drop any decision seed). noise: the run's pooled noise;
    None: the runs' own spread. same_commit: the best is the baseline (nothing was kept):
    gain 0 exactly, se 0; pass its runs as both."""
    if seeds is not None:
        keep = set(seeds)
        best = {s: v for s, v in best.items() if s in keep}
        baseline = {s: v for s, v in baseline.items() if s in keep}
    if not best:
        raise ValueError("headline needs at least one fresh run of the best")
    if not baseline:
        raise ValueError("headline needs at least one fresh run of the baseline")
    vals = list(best.values())
    n = len(vals)
    value = sum(vals) / n
    shared = sorted(set(best) & set(baseline))
    if noise is not None:
        run_sd, pair_sd, df = noise.run_sd, noise.pair_sd, noise.df
    else:
        run_sd = pair_sd = df = None

    value_se = run_sd / math.sqrt(n) if run_sd is not None else _own_se(vals)
    if shared:
        d = [baseline[s] - best[s] for s in shared]
        m = len(d)
        gain = sum(d) / m
        ss, dfo = sum_of_squares(d)
        own_sd = math.sqrt(ss / dfo) if dfo else None
        if same_commit:
            se, df_gain = 0.0, df
        elif own_sd is not None and (pair_sd is None or own_sd > pair_sd):
            # Without a pooled noise, or when the best is far from the baseline (a night of
            # keeps: another width, another batch) and their seeds' luck differs more than
            # the small changes' the noise was pooled from, the pairs' own spread is the
            # honest one (a real CPU night: 0.088 against a pooled 0.019).
            se, df_gain = own_sd / math.sqrt(m), dfo
        elif pair_sd is not None:
            se, df_gain = pair_sd / math.sqrt(m), df
        else:
            se, df_gain = None, None
        paired = True
    else:
        base_vals = list(baseline.values())
        gain = sum(base_vals) / len(base_vals) - value
        if run_sd is not None:
            se, df_gain = run_sd * math.sqrt(1.0 / n + 1.0 / len(base_vals)), df
        else:
            ss1, df1 = sum_of_squares(vals)
            ss2, df2 = sum_of_squares(base_vals)
            dfo = df1 + df2
            se = math.sqrt((ss1 + ss2) / dfo * (1.0 / n + 1.0 / len(base_vals))) if dfo else None
            df_gain = dfo or None
        paired = False
    if se is None or df_gain is None:
        interval = (-math.inf, math.inf) if se is None else (gain, gain)
    elif se == 0:
        interval = (gain, gain)
    else:
        half = t_quantile(0.5 + level / 2.0, df_gain) * se
        interval = (gain - half, gain + half)
    return Headline(value=value, value_se=value_se, gain=gain, gain_se=se, interval=interval, level=level, n=n,
                    paired=paired, df=df_gain, seeds=tuple(sorted(best)))


def _own_se(vals: list[float]) -> float | None:
    ss, df = sum_of_squares(vals)
    return math.sqrt(ss / df / len(vals)) if df else None
