"""The scale ladder's pure half: what a rung is, what it costs, and how a kept change is tagged.

A rung says what "larger" means for the project: `"DEPTH=8 MODEL_DIM=512"` (UPPER_CASE
constants of train.py set as `seed --set` sets them), `budget=4x` (the training budget,
seconds or steps, multiplied), or both. At the rung the best commit and the baseline are
measured at the same fresh seeds, and each kept change leave-one-out from the best, as
`autoloop ablate` does (autoloop.review.ladder runs it).

**Tags.** A kept change's effect at the rung is val_bpb with it minus without it, paired
by seed (negative: it helps). It is read with the confidence the decisions use: the
run's alpha is one-sided (a keep is confirmed when the chance that a change with no
effect gets there is alpha), so the interval is the two-sided one at level 1 - 2 alpha
(0.90 at the default alpha 0.05) and each side of it is a one-sided test at alpha:

* `holds`: the whole interval below 0 (it helps at the larger scale);
* `reverses`: the whole interval above 0 (it hurts there);
* `fades`: the interval holds 0 (indistinguishable from zero there).

**Cost.** Runs = seeds x (2 + kept changes) (the baseline, the best and one leave-one-out
commit each), each run the night's median run x the budget factor x the slowdown of the
larger model (1 until measured: the baseline's first run at the rung measures it). That
is its GPU time (what `--max-cost` counts); on N workers the runs go N at a time, so its
wall time (what `--hours` plans for) is the runs in rounds of N.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from autoloop.errors import AutoloopError

HOLDS, FADES, REVERSES = "holds", "fades", "reverses"
DEFAULT_SEEDS = 3
_CONSTANT = re.compile(r"[A-Z][A-Z0-9_]*\Z")
_BUDGET = re.compile(r"budget=([0-9]*\.?[0-9]+)x\Z", re.IGNORECASE)


@dataclass(frozen=True)
class RungSpec:
    """One rung: train.py's constants overridden ({NAME: value text}) and the budget factor."""

    text: str
    overrides: dict[str, str] = field(default_factory=dict)
    budget_factor: float = 1.0


def parse_spec(text: str | None) -> RungSpec | None:
    """`"DEPTH=8 MODEL_DIM=512 budget=4x"` -> RungSpec; None for no ladder (None or blank).
    Values are checked against train.py where the commit is made (autoloop.review.ladder)."""
    if text is None or not str(text).strip():
        return None
    overrides: dict[str, str] = {}
    factor = 1.0
    for word in str(text).split():
        budget = _BUDGET.match(word)
        if budget:
            factor = float(budget.group(1))
            if not 0 < factor <= 1000:
                raise AutoloopError(f"--ladder {word}: the budget factor must be above 0 (e.g. budget=4x)")
            continue
        name, sep, value = word.partition("=")
        if not sep or not value or not _CONSTANT.match(name):
            raise AutoloopError(f"--ladder {text!r}: {word!r} is neither NAME=VALUE (an UPPER_CASE constant of "
                                "train.py) nor budget=Kx: write it like --ladder \"DEPTH=8 MODEL_DIM=512 budget=4x\"")
        if name in overrides:
            raise AutoloopError(f"--ladder {text!r} sets {name} twice: give each constant once")
        overrides[name] = value
    if not overrides and factor == 1.0:
        raise AutoloopError(f"--ladder {text!r} is the night's own scale: name larger constants or budget=Kx")
    return RungSpec(text=" ".join(str(text).split()), overrides=overrides, budget_factor=factor)


def level_of(alpha: float) -> float:
    """The two-sided level whose sides are one-sided tests at the decisions' alpha."""
    return 1.0 - 2.0 * alpha


def tag_of(effect: float, low: float | None, high: float | None) -> str:
    """holds / fades / reverses from a change's effect at the rung and its interval (an
    unbounded interval, stored as None, establishes nothing: fades)."""
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        return FADES
    if high < 0.0:
        return HOLDS
    if low > 0.0:
        return REVERSES
    return FADES


def runs_needed(kept: int, seeds: int) -> int:
    """Training runs of one rung: the baseline, the best and each kept change left out, at every seed."""
    return seeds * (2 + max(0, kept))


def seconds_needed(kept: int, seeds: int, *, run_seconds: float, budget_factor: float, slowdown: float = 1.0,
                   workers: int = 1) -> float:
    """A rung's cost in seconds (module docstring): on one worker its GPU time, on `workers`
    its wall time (its runs in rounds of that many)."""
    rounds = math.ceil(runs_needed(kept, seeds) / max(1, int(workers)))
    return rounds * run_seconds * budget_factor * max(slowdown, 0.0)
