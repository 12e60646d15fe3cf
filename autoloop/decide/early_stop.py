"""Stop a clear loser early: a rule calibrated on the night's own curves, as pure functions.

Most proposals are worse than the incumbent, and each costs a whole training run. While a
candidate trains, its loss at progress p is compared with the incumbent's loss at the
SAME seed (same batches in the same order) and the same progress; the mean difference
over a window before p is the *partial difference* D(p) (candidate minus incumbent; lower
is better, like the final one). Whether a D(p) is "clearly worse" depends on the
script, the data and the budget, so the threshold is learned from the night itself:

* A calibration pair is a finished candidate run and the incumbent's run at the same
  seed: its D(p) at each checkpoint p of a fixed grid, and its final difference f (the
  metric the decision compares). `calibrate(pairs)` takes them as (p, D, f) triples.
* At each checkpoint the rule protects the candidates that end level or better: among
  the pairs with f <= 0 it fits D = a + b f (least squares) and sets the threshold to the
  upper prediction bound of D for such a candidate, taken at the worst f in [f_min, 0]
  (f = 0 when better finals have lower partials; the best observed f when they do not,
  as when a higher learning rate is worse mid-run and better after the warm-down):

      threshold(p) = a + b f* + t_{n-2}(1 - eps_p) s sqrt(1 + 1/n + (f* - mean f)^2 / S_ff)

  so a candidate that ends level with the incumbent is stopped at p with probability
  about eps_p, a better one less. eps (total, default 5%) is split over the active
  checkpoints (Bonferroni: the chance of being stopped at ANY of them is at most eps).
  The pairs with f <= 0 are the ones the rule (almost) never stops, so stopping the
  losers does not censor the sample the thresholds come from.
* Conservative where the schedule changes shape: a checkpoint whose window holds a
  change of the learning-rate schedule's slope (the start of the warm-down: train.py's
  WARMDOWN_RATIO 0.5 puts it at p = 0.5) is never used, and every checkpoint before the
  last change gets eps_p / `before_change` (10): curves cross there (a higher learning
  rate is worse before the warm-down and better after it). `schedule_changes(curve)`
  finds the changes in the incumbent's recorded `lr` column. And where the candidate's
  own learning-rate multiplier differs from the incumbent's (it changed the schedule: a
  shorter warm-down is level with the incumbent, then behind while the incumbent's LR
  already decays, then ahead), the checkpoint is not used at all (`schedules_match`).
* Never before `min_progress` (default 0.3) of the budget, and never with fewer than
  `min_pairs` (12) calibration pairs or `min_good` (6) with f <= 0 at a checkpoint: the
  rule then never stops. No fixed fallback: without the night's own pairs there is no
  scale for "clearly worse" (loss differences differ by orders of magnitude between a
  CPU run and an H100 run, between datasets and budgets), and stopping wrongly loses a
  real gain while not stopping only costs compute.

Progress is in [0, 1] in both modes: step / max_steps (step mode) or training seconds /
time budget (time mode). Curve points are dicts as train.py writes them ({"step",
"seconds", "loss", "lr"} in the result JSON's `curve`; progress lines also carry
"progress"); a point without "progress" gets it from the rule's budget.

What the worker sees is what the rule was calibrated on: train.py writes a progress line
for every point its recorded curve keeps (every step of a run up to 256 steps, then every
other, ...), not only every LOG_EVERY steps. With one line every 10 steps a 40-step run
had one point in the 30% window, against the twelve whose mean the threshold was set on:
a clear loser (+0.39 bpb at the end) went unstopped (docs/decisions.md, "A real CPU night"). In step mode
(the budget says max_steps) a candidate point is compared with the incumbent's point at
the same step (the same batch: the batch's difficulty cancels); otherwise the
incumbent's loss is interpolated at the candidate's progress. A stopped run costs the fraction of the budget it ran.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from autoloop.decide.rule import t_quantile
from autoloop.errors import AutoloopError

GRID = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # checkpoints, as progress
RULE_VERSION = 1


@dataclass(frozen=True)
class EarlyStopConfig:
    """How the rule is calibrated (docs/decisions.md, "Early stop", has the tuning).

    eps: the chance, summed over checkpoints, that a candidate ending level with the
    incumbent is stopped. min_progress: never stop before this fraction of the budget.
    window: D(p) is the mean difference over the points with progress in (p - window, p].
    min_pairs / min_good: calibration pairs needed at all / with final difference <= 0 at
    a checkpoint. before_change: eps_p is divided by this before the schedule's last
    change of shape.
    """

    eps: float = 0.05
    min_progress: float = 0.3
    window: float = 0.3
    min_pairs: int = 12
    min_good: int = 6
    before_change: float = 10.0
    grid: tuple[float, ...] = GRID

    def __post_init__(self) -> None:
        if not 0.0 < self.eps < 0.5:
            raise AutoloopError(f"early-stop eps is {self.eps}: set it between 0 and 0.5 (default 0.05)")
        if not 0.0 <= self.min_progress < 1.0:
            raise AutoloopError(f"early-stop min-progress is {self.min_progress}: set it within [0, 1) (default 0.3)")
        if not 0.0 < self.window <= 1.0:
            raise AutoloopError(f"early-stop window is {self.window}: set it within (0, 1] (default 0.3)")
        if self.min_good < 4:
            raise AutoloopError(f"early-stop min-good is {self.min_good}: set it to 4 or more (a line and its spread)")


@dataclass(frozen=True)
class StopRule:
    """A calibrated rule, plain JSON (`to_json` / `from_json`): what the worker needs."""

    points: tuple[float, ...]
    thresholds: tuple[float | None, ...]  # stop at points[k] when D > thresholds[k]; None: never there
    window: float
    min_progress: float
    pairs: int  # calibration pairs behind it
    why: str  # one line: how it was calibrated, or why it never stops
    shape_changes: tuple[float, ...] = ()
    budget: dict = field(default_factory=dict)  # {"max_steps": N} or {"time_budget": seconds}: progress of bare points

    @property
    def active(self) -> bool:
        return any(t is not None for t in self.thresholds)

    def to_json(self) -> dict:
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        out["version"] = RULE_VERSION
        return out

    @classmethod
    def from_json(cls, data: dict) -> StopRule:
        if data.get("version") != RULE_VERSION:
            raise ValueError(f"early-stop rule version {data.get('version')!r}, expected {RULE_VERSION}")
        return cls(points=tuple(data["points"]), thresholds=tuple(data["thresholds"]), window=data["window"],
                   min_progress=data["min_progress"], pairs=data["pairs"], why=data["why"],
                   shape_changes=tuple(data.get("shape_changes", ())), budget=dict(data.get("budget") or {}))


def never(why: str, cfg: EarlyStopConfig = EarlyStopConfig(), **kw) -> StopRule:
    """A rule that never stops (too few pairs, or early stopping off)."""
    return StopRule(points=tuple(cfg.grid), thresholds=tuple(None for _ in cfg.grid), window=cfg.window,
                    min_progress=cfg.min_progress, pairs=kw.pop("pairs", 0), why=why, **kw)


# ---------------------------------------------------------------------------------------
# Curves


def progress_of(point: dict, budget: dict | None = None) -> float | None:
    """A curve point's progress in [0, 1]: in step mode step / max_steps; else its own
    "progress", or seconds / time_budget from `budget`; None when neither is known.

    In step mode the step wins over a progress line's "progress" (train.py writes the
    progress at the step's start, (step - 1) / max_steps): the recorded curves the rule is
    calibrated on have no "progress", so both sides must put step k at the same point."""
    budget = budget or {}
    if budget.get("max_steps") and point.get("step") is not None:
        return min(1.0, float(point["step"]) / float(budget["max_steps"]))
    if point.get("progress") is not None:
        return float(point["progress"])
    if budget.get("time_budget") and point.get("seconds") is not None:
        return min(1.0, float(point["seconds"]) / float(budget["time_budget"]))
    return None


def _step_mode(budget: dict | None) -> bool:
    return bool((budget or {}).get("max_steps"))


def _series(curve: list[dict], budget: dict | None) -> list[tuple[float, float, int | None]]:
    """(progress, loss, step) of the points with a finite loss and a known progress, by progress."""
    out = []
    for point in curve or []:
        loss = point.get("loss")
        p = progress_of(point, budget)
        if p is None or loss is None or not math.isfinite(float(loss)):
            continue
        out.append((p, float(loss), point.get("step")))
    out.sort(key=lambda x: x[0])
    return out


def _interpolate(series: list[tuple[float, float, int | None]], p: float) -> float | None:
    if not series or p < series[0][0] or p > series[-1][0]:
        return None
    lo, hi = 0, len(series) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if series[mid][0] <= p:
            lo = mid
        else:
            hi = mid
    (p0, l0, _), (p1, l1, _) = series[lo], series[hi]
    if p1 == p0:
        return l0
    return l0 + (l1 - l0) * (p - p0) / (p1 - p0)


def partial_difference(incumbent_curve: list[dict], candidate_points: list[dict], p: float, window: float = 0.3,
                       budget: dict | None = None) -> float | None:
    """D(p): the mean of candidate loss minus incumbent loss over the candidate's points
    with progress in (p - window, p] (same step where both have it, else the incumbent
    interpolated at the candidate's progress). None when no point can be compared."""
    inc = _series(incumbent_curve, budget)
    # Same step, same batch: only in step mode (in time mode step k comes at different moments).
    by_step = {step: loss for _, loss, step in inc if step is not None} if _step_mode(budget) else {}
    diffs = []
    for q, loss, step in _series(candidate_points, budget):
        if not p - window < q <= p + 1e-9:
            continue
        other = by_step.get(step) if step is not None else None
        if other is None:
            other = _interpolate(inc, q)
        if other is not None:
            diffs.append(loss - other)
    return sum(diffs) / len(diffs) if diffs else None


def schedules_match(incumbent_curve: list[dict], candidate_points: list[dict], p: float, window: float = 0.3,
                    budget: dict | None = None, tol: float = 1e-3) -> bool:
    """Whether the candidate's learning-rate multiplier ("lr") equals the incumbent's over
    the window before p (points without "lr" say nothing). A candidate on another
    schedule (a shorter warm-down) is not compared where the schedules differ: the one
    whose learning rate is lower at that moment is ahead for a while, whoever ends better."""
    inc = [(progress_of(pt, budget), pt.get("step"), pt.get("lr")) for pt in incumbent_curve or []]
    inc_lr = sorted((q, float(lr)) for q, _, lr in inc if q is not None and lr is not None)
    by_step = ({step: float(lr) for _, step, lr in inc if step is not None and lr is not None}
               if _step_mode(budget) else {})
    for pt in candidate_points or []:
        q, lr = progress_of(pt, budget), pt.get("lr")
        if q is None or lr is None or not p - window < q <= p + 1e-9:
            continue
        other = by_step.get(pt.get("step")) if pt.get("step") is not None else None
        if other is None:
            other = _interpolate([(x, y, None) for x, y in inc_lr], q)
        if other is not None and abs(float(lr) - other) > tol * max(1.0, abs(other)):
            return False
    return True


def curve_pairs(incumbent_curve: list[dict], candidate_curve: list[dict], final_diff: float,
                cfg: EarlyStopConfig = EarlyStopConfig(), budget: dict | None = None) -> list[tuple[float, float, float]]:
    """The (p, D(p), final difference) triples of one finished candidate run and the
    incumbent's run at the same seed, at the grid's checkpoints: calibration data."""
    out = []
    for p in cfg.grid:
        if not schedules_match(incumbent_curve, candidate_curve, p, cfg.window, budget):
            continue
        d = partial_difference(incumbent_curve, candidate_curve, p, cfg.window, budget)
        if d is not None:
            out.append((p, d, float(final_diff)))
    return out


def schedule_changes(curve: list[dict], budget: dict | None = None, tol: float = 0.05) -> list[float]:
    """Progress points where the learning-rate schedule (the curve's "lr" column, the
    multiplier of the peak) changes slope: the end of a warm-up, the start of a warm-down."""
    pts = sorted((progress_of(pt, budget), float(pt["lr"])) for pt in curve or []
                 if pt.get("lr") is not None and progress_of(pt, budget) is not None)
    pts = [pt for k, pt in enumerate(pts) if k == 0 or pt[0] > pts[k - 1][0]]
    changes = []
    for k in range(1, len(pts) - 1):
        (p0, l0), (p1, l1), (p2, l2) = pts[k - 1], pts[k], pts[k + 1]
        before, after = (l1 - l0) / (p1 - p0), (l2 - l1) / (p2 - p1)
        if abs(after - before) > tol * max(1.0, abs(before), abs(after)):
            # the change lies between p0 and p2; one per bend (two neighbouring points see it)
            where = p1 if abs(l1 - (l0 + before * (p1 - p0))) < 1e-12 else p0
            if not changes or where - changes[-1] > 2 * (p2 - p0):
                changes.append(round(where, 4))
    return changes


# ---------------------------------------------------------------------------------------
# Calibration and the stop


class Calibration:
    """Running sums of the calibration pairs, per checkpoint: `add(p, D, f)` one triple,
    `rule(...)` the stop rule now. `calibrate(pairs)` is `Calibration(pairs).rule(...)`;
    a loop that gets one pair at a time keeps one of these (O(checkpoints) per update)."""

    def __init__(self, pairs=(), cfg: EarlyStopConfig = EarlyStopConfig()):
        self.cfg = cfg
        self.count = {p: 0 for p in cfg.grid}  # all pairs, per checkpoint
        # pairs with f <= 0: n, sum f, sum f^2, sum D, sum D f, sum D^2, min f
        self.sums = {p: [0, 0.0, 0.0, 0.0, 0.0, 0.0, math.inf] for p in cfg.grid}
        for triple in pairs:
            self.add(*triple)

    def add(self, p: float, d: float | None, f: float | None) -> None:
        key = min(self.cfg.grid, key=lambda g: abs(g - p))
        if abs(key - p) > 1e-6 or d is None or f is None or not (math.isfinite(d) and math.isfinite(f)):
            return
        d, f = float(d), float(f)
        self.count[key] += 1
        if f <= 0:
            s = self.sums[key]
            s[0] += 1
            s[1] += f
            s[2] += f * f
            s[3] += d
            s[4] += d * f
            s[5] += d * d
            s[6] = min(s[6], f)

    @property
    def pairs(self) -> int:
        return max(self.count.values(), default=0)

    def _threshold(self, p: float, eps_p: float, protect: float) -> float:
        """Upper prediction bound of D for a candidate ending at the worst f in
        [min f, -protect] (the pairs with f <= 0 at checkpoint p)."""
        n, sf, sff, sd, sdf, sdd, fmin = self.sums[p]
        mf, md = sf / n, sd / n
        s_ff = max(sff - n * mf * mf, 0.0)
        s_fd = sdf - n * mf * md
        s_dd = max(sdd - n * md * md, 0.0)
        fitted = s_ff > 1e-18 * max(1.0, sff)
        if fitted:
            b, df = s_fd / s_ff, n - 2
            ss = max(s_dd - b * s_fd, 0.0)
        else:  # every pair ended at the same f: no slope, the spread of D alone
            b, df, ss = 0.0, n - 1, s_dd
        a = md - b * mf
        sd_res = math.sqrt(ss / df)
        q = t_quantile(1.0 - eps_p, df)
        top = min(-protect, 0.0)
        bounds = []
        for at in (top, min(fmin, top)):
            lever = (at - mf) ** 2 / s_ff if fitted else 0.0
            bounds.append(a + b * at + q * sd_res * math.sqrt(1.0 + 1.0 / n + lever))
        return max(bounds)

    def rule(self, *, shape_changes=(), budget: dict | None = None, protect: float = 0.0) -> StopRule:
        """The stop rule from the pairs so far. protect: the final difference (metric
        units, >= 0) below which candidates are protected; 0: every candidate that ends
        level or better."""
        cfg = self.cfg
        runs = self.pairs
        changes = tuple(sorted(float(c) for c in shape_changes))
        extra = {"pairs": runs, "shape_changes": changes, "budget": dict(budget or {})}
        if runs < cfg.min_pairs:
            return never(f"never stops: {runs} calibration pair{'s' if runs != 1 else ''} of the night, "
                         f"{cfg.min_pairs} needed", cfg, **extra)
        usable = [p for p in cfg.grid
                  if p + 1e-9 >= cfg.min_progress and self.sums[p][0] >= cfg.min_good
                  and not any(p - cfg.window + 1e-9 < c <= p + 1e-9 for c in changes)]
        if not usable:
            return never(f"never stops: fewer than {cfg.min_good} of the night's {runs} pairs ended level or better "
                         "at any checkpoint", cfg, **extra)
        eps_p = cfg.eps / len(usable)
        last_change = max(changes) if changes else None
        thresholds = []
        for p in cfg.grid:
            if p not in usable:
                thresholds.append(None)
                continue
            e = eps_p / cfg.before_change if last_change is not None and p < last_change else eps_p
            thresholds.append(self._threshold(p, e, protect))
        why = (f"calibrated on {runs} pairs of the night: a candidate that ends level with the incumbent is stopped "
               f"with probability <= {cfg.eps:.0%}, at {len(usable)} checkpoints from {min(usable):.0%} of the budget")
        return StopRule(points=tuple(cfg.grid), thresholds=tuple(thresholds), window=cfg.window,
                        min_progress=cfg.min_progress, why=why, **extra)


def calibrate(pairs, cfg: EarlyStopConfig = EarlyStopConfig(), *, shape_changes=(), budget: dict | None = None,
              protect: float = 0.0) -> StopRule:
    """The stop rule from the night's calibration pairs: (p, D(p), final difference)
    triples of finished candidate runs against the incumbent's run at the same seed
    (`curve_pairs`), p on the grid. shape_changes: progress points where the schedule
    changes shape (`schedule_changes` of the incumbent's curve). budget: {"max_steps": N}
    or {"time_budget": s}, stored for points without a "progress"."""
    return Calibration(pairs, cfg).rule(shape_changes=shape_changes, budget=budget, protect=protect)


def stop_point(rule: StopRule, partials) -> tuple[float, float, float] | None:
    """The first checkpoint whose partial difference is above its threshold:
    (p, D, threshold), or None. partials: {p: D} (None or missing: not evaluated)."""
    for p, limit in zip(rule.points, rule.thresholds):
        if limit is None or p < rule.min_progress:
            continue
        d = partials.get(p)
        if d is not None and d > limit:
            return p, d, limit
    return None


def should_stop(rule: StopRule, incumbent_curve: list[dict], candidate_points: list[dict]) -> tuple[bool, str, float]:
    """Whether to stop the candidate now: (stop, why, progress it has reached).

    incumbent_curve: the incumbent's recorded curve at the candidate's seed; candidate_points:
    the candidate's points so far (its progress lines). Every checkpoint the candidate has
    passed is looked at (the answer for a checkpoint never changes, so calling this after
    every new point stops at the first checkpoint above its threshold)."""
    series = _series(candidate_points, rule.budget)
    reached = series[-1][0] if series else 0.0
    if not rule.active:
        return False, rule.why, reached
    partials = {}
    for p, limit in zip(rule.points, rule.thresholds):
        if limit is not None and p <= reached + 1e-9 and schedules_match(
                incumbent_curve, candidate_points, p, rule.window, rule.budget):
            partials[p] = partial_difference(incumbent_curve, candidate_points, p, rule.window, rule.budget)
    hit = stop_point(rule, partials)
    if hit is None:
        return False, f"not clearly worse at {reached:.0%} of the budget", reached
    p, d, limit = hit
    return True, (f"stopped early at {reached:.0%} of the budget: at {p:.0%} its loss was {d:+.4g} against the "
                  f"incumbent's at the same seed, above the night's threshold {limit:+.4g} ({rule.why})"), reached
