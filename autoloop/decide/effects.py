"""How a trial's result reads against the incumbent, with its uncertainty: the one
reading shared by `log`, `show`, the report, the search proposer and the LLM brief.

A trial owns one or more measurements (training runs at different seeds). The controller
stores, on the trial row, the mean of its candidate runs (`metric`), the standard error
of that mean (`metric_sd`), the number of runs (`n_runs`) and the decision's figures
(`decision`, JSON): the paired difference from the incumbent at shared seeds
(`mean_diff`, its standard error `se`, a 95% interval `low`..`high`), whether that
interval excludes zero (`distinguishable`) and whether a discarded trial lies within the
noise of the incumbent (`near_miss`).

Trials from before noise-aware decisions (one run, no decision) have none of that: they
read as a single value and a bare delta, exactly as before, and no claim is made about
whether the difference is real (`distinguishable` is None).

An ablation trial's decision holds the marginal effect of one kept change instead
(`ablation_effect`): effect = val_bpb of the best commit minus that of the best commit
with the change reverted, paired by seed; negative means the change helps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

NOT_DISTINGUISHABLE = "not distinguishable from the incumbent"
NEAR_MISS = "near miss"


def decision_of(trial: dict) -> dict:
    """The trial's decision figures as a dict (the column may hold JSON text when read
    with a plain query); {} for a trial without one."""
    value = trial.get("decision")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}


# The decision's figures under the names the brief of this wave uses, with the names
# autoloop.decide.rule's Verdict.figures uses as fallbacks (the controller may store either).
_ALIASES = {"statistic": ("statistic", "t"), "bound": ("bound", "keep_bound"),
            "stopped_because": ("stopped_because", "stopped")}


def decision_figures(trial: dict) -> dict:
    """The decision with its figures under one set of names: low/high (also read from
    `interval: [low, high]`), statistic (or `t`), bound (or `keep_bound`),
    stopped_because (or `stopped`); everything else as stored."""
    decision = dict(decision_of(trial))
    interval = decision.pop("interval", None)
    if isinstance(interval, (list, tuple)) and len(interval) == 2:
        decision.setdefault("low", interval[0])
        decision.setdefault("high", interval[1])
    for name, aliases in _ALIASES.items():
        values = [decision.pop(alias, None) for alias in aliases]
        value = next((v for v in values if v is not None), None)
        if value is not None:
            decision[name] = value
    return decision


def flags_of(trial: dict) -> list[dict]:
    """The trial's diagnosis flags ([{flag, message}]), whatever form the column is in."""
    value = trial.get("flags")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return []
    if not isinstance(value, list):
        return []
    return [f if isinstance(f, dict) else {"flag": str(f), "message": ""} for f in value]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class Effect:
    """A trial's result and its comparison with the incumbent (lower val_bpb is better)."""

    metric: float | None  # mean of the trial's runs
    se: float | None  # standard error of that mean (None for a single run)
    n: int  # runs behind the mean
    diff: float | None  # trial minus incumbent: the paired mean difference, else the bare delta
    diff_se: float | None  # standard error of diff (None without a noise-aware decision)
    low: float | None  # 95% interval of diff
    high: float | None
    distinguishable: bool | None  # the interval excludes 0; None: no claim (old trial, no decision)
    near_miss: bool  # a discard within the noise of the incumbent

    @property
    def noise_aware(self) -> bool:
        return self.distinguishable is not None


def trial_effect(trial: dict) -> Effect:
    decision = decision_figures(trial)
    metric = _number(trial.get("metric"))
    n = trial.get("n_runs") or (1 if metric is not None else 0)
    se = _number(trial.get("metric_sd")) if n > 1 else None
    diff = _number(decision.get("mean_diff"))
    if diff is None:
        diff = _number(trial.get("delta"))
        if diff is None and metric is not None and _number(trial.get("best_before")) is not None:
            diff = metric - trial["best_before"]
    low, high = _number(decision.get("low")), _number(decision.get("high"))
    # The interval is the evidence: a stored flag is read only where there is none (one
    # pair before any noise was measured), so a clearly worse trial never reads as
    # "not distinguishable" because it was discarded.
    if low is not None and high is not None:
        distinguishable = not low <= 0.0 <= high
    else:
        distinguishable = decision.get("distinguishable")
        if not isinstance(distinguishable, bool):
            distinguishable = None
    return Effect(metric=metric, se=se, n=int(n), diff=diff, diff_se=_number(decision.get("se")), low=low,
                  high=high, distinguishable=distinguishable, near_miss=bool(decision.get("near_miss")))


def format_estimate(mean: float | None, se: float | None = None, n: int | None = None) -> str:
    """'2.543100' for one run (as before), '2.5431 ± 0.0040 (3)' for a mean of several."""
    if mean is None:
        return "-"
    if n is not None and n > 1 and se is not None:
        return f"{mean:.4f} ± {se:.4f} ({n})"
    return f"{mean:.6f}"


def format_interval(low: float | None, high: float | None, level: float = 0.95) -> str:
    if low is None or high is None:
        return ""
    return f"{level * 100:.0f}% CI {low:+.4f}..{high:+.4f}"


def comparison_text(effect: Effect) -> str:
    """The trial against the incumbent, in words a proposer should read:
    '+0.0012 ± 0.0030 vs the incumbent (95% CI -0.0047..+0.0071, 3 runs): not
    distinguishable from the incumbent'. Old trials: the bare delta, as before."""
    if effect.diff is None:
        return ""
    if not effect.noise_aware:
        return f"{effect.diff:+.4f}"
    spread = f" ± {effect.diff_se:.4f}" if effect.diff_se is not None else ""
    interval = format_interval(effect.low, effect.high)
    details = ", ".join(x for x in (interval, f"{effect.n} run{'s' if effect.n != 1 else ''}") if x)
    text = f"{effect.diff:+.4f}{spread} vs the incumbent ({details})"
    if effect.near_miss:
        return text + f": {NEAR_MISS}, {NOT_DISTINGUISHABLE}"
    if not effect.distinguishable:
        return text + f": {NOT_DISTINGUISHABLE}"
    return text


def sensitivity(effect: Effect) -> float | None:
    """How much a change demonstrably moved val_bpb: |diff|, but 0 when the decision
    found it not distinguishable from the incumbent (a difference inside the noise is no
    evidence that the constant matters). None when unknown."""
    if effect.diff is None:
        return None
    if effect.distinguishable is False:
        return 0.0
    return abs(effect.diff)


# ---------------------------------------------------------------------------- ablations


@dataclass(frozen=True)
class AblationEffect:
    effect: float | None  # best minus best-without-the-change; negative: the change helps
    low: float | None
    high: float | None
    n: int
    null: bool | None  # the interval contains 0: a candidate to drop
    drop: bool | None  # no demonstrated benefit (null, or the change demonstrably hurts)
    level: float = 0.95


def ablation_effect(trial: dict) -> AblationEffect | None:
    """The figures an ablation trial stored, or None when it has none (skipped, crashed,
    still running, or a trial of another kind)."""
    decision = decision_of(trial)
    if "effect" not in decision:
        return None
    effect, low, high = (_number(decision.get(k)) for k in ("effect", "low", "high"))
    null = decision.get("null")
    if not isinstance(null, bool):
        null = (low <= 0.0 <= high) if low is not None and high is not None else None
    drop = decision.get("drop")
    if not isinstance(drop, bool):
        drop = None if null is None else (null or (low is not None and low > 0.0))
    return AblationEffect(effect=effect, low=low, high=high, n=int(decision.get("n") or 0), null=null, drop=drop,
                          level=float(decision.get("level") or 0.95))


def ablation_verdict(a: AblationEffect) -> str:
    if a.effect is None:
        return "no effect measured"
    if a.null:
        return "not distinguishable from zero: candidate to drop"
    if a.low is not None and a.low > 0.0:
        return "the change makes val_bpb worse: candidate to drop"
    return "helps"
