"""Why a trial's training went the way it did, read from its loss curve (pure: no I/O).

A trial's curve is a list of points `{step, seconds, loss, lr, grad_norm}` (train.py
thins it to a few hundred). Four flags, each with a one-line message:

* `divergence`: the loss became NaN or infinite, blew up to twice the untrained
  model's at any point, ended above where it started, or climbed back far above its minimum and stayed there (the
  end of the run is worse than its best by more than half of what it had learned). A crash of that kind is the learning rate or the init, not
  the idea behind the change.
* `grad_spike`: one gradient norm many times the median of the points before it, after
  the first tenth of the run (early gradient norms swing widely on their own).
* `plateau`: the last part of the run made no progress: the loss at the end is no
  lower than where that part started, by more than a sliver of what the run learned.
* `too_short`: still falling steeply at the end: the last fifth of the run dropped a
  large share of the total drop, so the budget, not the change, limits the result.

Per-step losses are noisy (each is one batch), so every comparison is between medians of
windows of points, never single points. The thresholds are module constants so a
test can name them; they are deliberately coarse: a flag is for a human or a proposer
reading the morning review, not a rule the loop acts on.
"""

from __future__ import annotations

import math
from statistics import median

DIVERGENCE_GIVEBACK = 0.5  # divergence: the end gave back more than this share of the drop
BLOWUP_FACTOR = 2.0  # divergence: any loss above this times the first (untrained) one
GRAD_SPIKE_RATIO = 8.0  # grad_spike: a norm this many times the median before it
PLATEAU_PART = 0.4  # plateau: the last part of the run examined ...
PLATEAU_PROGRESS = 0.02  # ... made less than this share of the run's total drop
TOO_SHORT_PART = 0.2  # too_short: the last part of the run ...
TOO_SHORT_SHARE = 0.15  # ... made more than this share of the run's total drop
MIN_POINTS = 8  # fewer points than this: too little curve to say anything but NaN


def _finite(value) -> bool:
    return value is not None and isinstance(value, (int, float)) and math.isfinite(value)


def _window(n: int) -> int:
    """Points per median window: a tenth of the curve, at least 3 (one batch's loss is noisy)."""
    return max(3, n // 10)


def diagnose(curve: list[dict]) -> list[dict]:
    """The flags of one trial's curve: [{flag, message, step?, ...figures}], in the order above.

    An empty list means nothing to report (or too short a curve to judge).
    """
    points = [p for p in curve or [] if isinstance(p, dict) and "loss" in p]
    if not points:
        return []
    bad = next((p for p in points if not _finite(p.get("loss"))), None)
    if bad is not None:
        return [{"flag": "divergence", "step": bad.get("step"),
                 "message": f"divergence: the loss became {bad.get('loss')} at step {bad.get('step')}: "
                            "lower the learning rate or add warm-up"}]
    if len(points) < MIN_POINTS:
        return []
    losses = [float(p["loss"]) for p in points]
    steps = [p.get("step", i + 1) for i, p in enumerate(points)]
    n, w = len(losses), _window(len(losses))
    smooth = [median(losses[max(0, i - w + 1): i + 1]) for i in range(n)]  # trailing median
    start = median(losses[:w])
    best_i = min(range(n), key=smooth.__getitem__)
    best, end = smooth[best_i], median(losses[-w:])
    drop = start - best
    flags = []

    blowup = next((i for i in range(1, n) if losses[i] > BLOWUP_FACTOR * losses[0]), None)
    if blowup is not None:  # weights blown up: far worse than the untrained model ever is
        flags.append({"flag": "divergence", "step": steps[blowup], "loss": round(losses[blowup], 4),
                      "message": f"divergence: the loss blew up to {losses[blowup]:.3f} at step {steps[blowup]} "
                                 f"(the untrained model's was {losses[0]:.3f}): lower the learning rate or add warm-up"})
    elif end > losses[0] and best_i < n - w:  # worse than the untrained model it started as
        flags.append({"flag": "divergence", "step": steps[best_i], "best": round(best, 4), "end": round(end, 4),
                      "message": f"divergence: the loss ended at {end:.3f}, above where it started ({losses[0]:.3f}): "
                                 "lower the learning rate or add warm-up"})
    elif drop > 0 and end - best > DIVERGENCE_GIVEBACK * drop and best_i < n - w:
        flags.append({"flag": "divergence", "step": steps[best_i], "best": round(best, 4), "end": round(end, 4),
                      "message": f"divergence: the loss rose from its minimum {best:.3f} (step {steps[best_i]}) "
                                 f"to {end:.3f} at the end: lower the learning rate or add warm-up"})

    spike = _grad_spike(points)
    if spike is not None:
        flags.append(spike)

    diverged = any(f["flag"] == "divergence" for f in flags)
    if not diverged and drop > 0:
        first = int(n * (1 - PLATEAU_PART))
        part_start = median(losses[max(0, first - w // 2): first + w // 2 + 1])
        progress = part_start - end
        if progress < PLATEAU_PROGRESS * drop:
            flags.append({"flag": "plateau", "step": steps[first], "progress": round(progress, 4),
                          "message": f"plateau: no progress over the last {PLATEAU_PART:.0%} of the run "
                                     f"(loss {part_start:.3f} at step {steps[first]}, {end:.3f} at the end)"})
        first = int(n * (1 - TOO_SHORT_PART))
        part_start = median(losses[max(0, first - w // 2): first + w // 2 + 1])
        late = part_start - end
        if late > TOO_SHORT_SHARE * drop:
            flags.append({"flag": "too_short", "step": steps[first], "share": round(late / drop, 3),
                          "message": f"too_short: still falling steeply at the end ({late / drop:.0%} of the run's "
                                     f"loss drop came in its last {TOO_SHORT_PART:.0%}): the budget, not the change, "
                                     "limits this result"})
    return flags


def _grad_spike(points: list[dict]) -> dict | None:
    norms = [p.get("grad_norm") for p in points]
    n = len(norms)
    w = max(3, _window(n))
    worst = None
    for i in range(max(w, n // 10), n):
        if not _finite(norms[i]):
            continue
        before = [g for g in norms[i - w: i] if _finite(g)]
        if len(before) < 2:
            continue
        base = median(before)
        if base > 0 and norms[i] / base > GRAD_SPIKE_RATIO and (worst is None or norms[i] / base > worst[1]):
            worst = (i, norms[i] / base, base)
    if worst is None:
        return None
    i, ratio, base = worst
    step = points[i].get("step", i + 1)
    return {"flag": "grad_spike", "step": step, "ratio": round(ratio, 1),
            "message": f"grad_spike: gradient norm {norms[i]:.3g} at step {step}, {ratio:.0f}x the median "
                       f"{base:.3g} before it: clip gradients or lower the learning rate"}


def messages(flags: list[dict] | None) -> list[str]:
    """The one-line messages of stored flags (the `trials.flags` column), for display."""
    return [f["message"] for f in flags or [] if isinstance(f, dict) and f.get("message")]


def names(flags: list[dict] | None) -> str:
    """The flag names, comma-separated ('' when none): the short form for `autoloop log`."""
    return ",".join(f["flag"] for f in flags or [] if isinstance(f, dict) and f.get("flag"))
