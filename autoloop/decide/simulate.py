"""Simulated nights: how well a decision rule improves a night, at equal compute.

In-process and fast (thousands of nights in seconds), for bench/decision_quality.py and
its tests; the controller never imports it. It lives in the package (not in bench/) so
tests import it like any module, and it drives the SAME `decide()`, `pool_noise()`,
early-stop `calibrate()` / `stop_point()` and `headline()` the loop uses, with the noise
estimated from the night's own repeats exactly as the controller does (see
docs/decisions.md, "What the controller passes").

The noise, in units of sigma (the sd of one run across seeds):

* a run of commit c at seed s gives  mu_c + sqrt(shared) * sigma * b[g_c, s] + sqrt(1 - shared) * sigma * e[c, s]
  with b, e standard normal: b is the part of the seed's luck that every commit of one
  init lineage g shares (same data order and init stream), so pairing cancels it; e is
  the commit's own luck. A proposal inherits its incumbent's lineage, except init-only
  re-draws, which start a new one (no shared component: their paired difference has the
  full unpaired variance 2 sigma^2).
* a night is a fixed number of training runs, the equal compute; every run (baseline,
  candidate, incumbent re-measurement, reserve) costs one, and an early-stopped run the
  fraction of the budget it ran. The baseline is measured at the seeds the controller
  gives the rule without verification (one under strict, baseline_seeds otherwise; the
  simulation has no held-out guard, and with verification the controller gives strict
  baseline_seeds too: two runs more, which only favours strict here). A candidate still being
  measured when the night's runs are spent is not decided.
* `Night.reserve`: the final best re-measured at that many fresh seeds (and the baseline
  too with `reserve_baseline`; otherwise its own runs stand for it), set aside from the
  night's runs at the start (autoloop/decide/remeasure.py); the reported value and gain then
  come from them. Without it the reported value is the best's selection mean, as a loop
  that keeps any lower number reports it.
* `Night.early_stop`: a candidate's first run is compared, while it trains, with the
  incumbent's run at the same seed (autoloop/decide/early_stop.py), on the rule calibrated on
  the night's own finished pairs so far. Its partial differences come from `CurveModel`,
  fitted on real train.py curves from this CPU (tests/data/curve_calibration.json).

What the proposals do, two worlds:

* `Landscape` (the realistic mix, mechanistic): the true val_bpb is a sum of quadratic
  bowls, one per hyperparameter (in log2 units of the constant), plus the effects of the
  code changes kept so far. The night starts away from the bowls' bottom; a proposal
  steps ONE hyperparameter of the current incumbent (x2, x1.41 or x1.19 up or down, the
  search proposer's ladder), re-draws the init stream (no effect), or makes a code
  change with a fixed effect (null, harmful or helpful). So a step's effect depends on
  where the incumbent is: far from the bottom, half the steps help, some a lot; near it
  nearly every step hurts, mostly by less than the noise. docs/decisions.md gives the
  parameters and why.
* `Mix` (independent effects): every proposal's effect is an independent draw from a
  fixed mixture, whatever was kept before.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from autoloop.decide.rule import DecisionConfig, NoiseSums, decide, estimate, noise_sums, pool_noise
from autoloop.decide.early_stop import Calibration, EarlyStopConfig, StopRule, never, partial_difference, stop_point
from autoloop.decide.remeasure import headline, reserve_size

RESERVE_MAX = 8  # fresh seeds drawn per commit for the reserve
PROPOSALS_PER_RUN = 3  # proposals drawn per run of the night (an early-stopped run costs a fraction)
CALIBRATION = Path(__file__).resolve().parents[2] / "tests" / "data" / "curve_calibration.json"

NULL, REDRAW, HARMFUL, HELPFUL = 0, 1, 2, 3  # what a decided proposal truly was
HP, CODE = 4, 5  # Landscape proposal types before their effect is known (REDRAW is the third)


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
class Landscape:
    """The mechanistic world (docs/decisions.md, "The simulated night", has the reasons).

    True value (sigma units, relative to the optimum of the bowls):
        sum_j k_j (x_j - x*_j)^2  +  the effects of the code changes kept
    with x_j the log2 of hyperparameter j and k_j the cost of a x2 step from its optimum.
    """

    hyperparameters: int = 10  # constants worth tuning in train.py (learning rates, decay, schedule, betas, ...)
    curvature: tuple[float, float] = (0.1, 10.0)  # k_j, log-uniform: cost in sigma of a x2 step from the optimum
    start_sd: float = 0.75  # log2 distance of the night's starting value from the optimum, N(0, sd^2) per constant
    steps: tuple[float, ...] = (1.0, 0.5, 0.25)  # log2 step sizes, equally likely, up or down (x2, x1.41, x1.19)
    hp: float = 0.6  # share of proposals that step one hyperparameter
    redraw: float = 0.1  # share that only re-draw the init stream (no effect)
    code: float = 0.3  # share that change the code (fixed effect, whatever the incumbent)
    code_null: float = 0.4  # of the code changes: no effect (a refactor, a cosmetic change)
    code_helpful: float = 0.1  # of the code changes: real gains; the rest (0.5) harmful
    code_harmful_range: tuple[float, float] = (0.1, 10.0)  # log-uniform, sigma
    code_helpful_range: tuple[float, float] = (0.1, 5.0)  # log-uniform, sigma

    def __post_init__(self) -> None:
        total = self.hp + self.redraw + self.code
        if abs(total - 1.0) > 1e-9:
            raise ValueError(f"proposal shares sum to {total}, not 1")
        if not 0.0 <= self.code_null + self.code_helpful <= 1.0:
            raise ValueError("code_null + code_helpful must be within 0..1")

    def scaled(self, curvature: float = 1.0) -> Landscape:
        """The same world with every k_j multiplied (a less or more sensitive train.py, relative to the noise)."""
        lo, hi = self.curvature
        return replace(self, curvature=(lo * curvature, hi * curvature))


@dataclass(frozen=True)
class World:
    sigma: float = 1.0  # sd of one run across seeds
    shared: float = 0.5  # share of the run variance that the seed gives every commit of a lineage
    runs: int = 100  # training runs in a night (the equal compute)




@dataclass(frozen=True)
class CurveModel:
    """Partial differences of a candidate's curve from the incumbent's at the same seed,
    fitted on real train.py runs (bench/curve_calibration.py writes the data).

    For a candidate with true effect delta (final, sigma units) whose measured final paired
    difference is delta + e, its partial difference at checkpoint p is

        D(p) = shape(p) * delta + visible(p) * e + residual(p)

    * shape: how a change's effect builds up over the run, one per real change whose final
      effect is clear (|mean| > 3 standard errors): D(p) / final over the seeds. Learning
      rates x2 grow their gain slowly or are worse early; a shorter warm-down is level
      until the warm-downs differ and wins only at the end. A simulated proposal gets one
      at random.
    * comparable: False at checkpoints where that change's learning-rate multiplier
      differs from the unmodified script's (a different schedule): the early stop skips them.
    * visible: the share of the final seed luck of the difference already in D(p) (the
      within-change regression of D(p) on the final difference across seeds).
    * residual: what is left, per real (change, seed), resampled whole (its correlation
      across checkpoints kept), in units of the real run sd.
    """

    grid: tuple[float, ...]
    shapes: tuple[tuple[float, ...], ...]
    comparable: tuple[tuple[bool, ...], ...]
    visible: tuple[float, ...]
    residuals: tuple[tuple[float, ...], ...]
    sigma: float  # the real run sd across seeds (bpb)
    names: tuple[str, ...] = ()
    window: float = 0.1

    @classmethod
    def fit(cls, data: dict, grid: tuple[float, ...] = EarlyStopConfig().grid, window: float = EarlyStopConfig().window,
            clear: float = 3.0, min_seeds: int = 3) -> CurveModel:
        steps = data["steps"]
        budget = {"max_steps": steps}
        runs = {(r["variant"], r["seed"]): r for r in data["runs"]}
        variants = [v for v in data["variants"] if v != "base"]
        # the seeds at which every change ran (an interrupted collection leaves a partial one)
        seeds = sorted(s for s in {s for _, s in runs} if all((v, s) in runs for v in ["base"] + variants))
        if len(seeds) < min_seeds or not variants:
            raise ValueError(f"curve calibration data needs every variant at {min_seeds} or more seeds")

        def points(r):
            return [{"step": st, "loss": loss, "lr": lr} for st, loss, lr in r["curve"]]

        # run sd across seeds, pooled over every variant (the unmodified script included)
        ss = df = 0
        for v in ["base"] + variants:
            vals = np.array([runs[(v, s)]["val_bpb"] for s in seeds])
            ss += float(np.sum((vals - vals.mean()) ** 2))
            df += len(vals) - 1
        sigma = math.sqrt(ss / df)
        D = np.zeros((len(variants), len(seeds), len(grid)))
        f = np.zeros((len(variants), len(seeds)))
        comparable = []
        for i, v in enumerate(variants):
            lr_ok = []
            for j, s in enumerate(seeds):
                inc, cand = points(runs[("base", s)]), points(runs[(v, s)])
                f[i, j] = runs[(v, s)]["val_bpb"] - runs[("base", s)]["val_bpb"]
                for k, p in enumerate(grid):
                    D[i, j, k] = partial_difference(inc, cand, p, window, budget)
                if j == 0:
                    base_lr = {pt["step"]: pt["lr"] for pt in inc}
                    for p in grid:
                        lo, hi = (p - window) * steps, p * steps
                        lr_ok.append(all(abs(pt["lr"] - base_lr.get(pt["step"], pt["lr"])) <= 1e-3
                                         for pt in cand if lo < pt["step"] <= hi + 1e-9))
            comparable.append(tuple(lr_ok))
        n = len(seeds)
        fbar, Dbar = f.mean(axis=1), D.mean(axis=1)
        fd = f - fbar[:, None]
        Dd = D - Dbar[:, None, :]
        sxx = float(np.sum(fd ** 2))
        visible = np.einsum("ij,ijk->k", fd, Dd) / sxx if sxx > 0 else np.zeros(len(grid))
        resid = (Dd - fd[:, :, None] * visible[None, None, :]) * math.sqrt(n / (n - 1)) / sigma
        pair_sd = math.sqrt(sxx / (len(variants) * (n - 1)))
        shapes, keep_comparable, names = [], [], []
        for i, v in enumerate(variants):
            if abs(fbar[i]) > clear * pair_sd / math.sqrt(n):
                shapes.append(tuple(float(x) for x in Dbar[i] / fbar[i]))
                keep_comparable.append(comparable[i])
                names.append(v)
        if not shapes:
            raise ValueError("no change in the curve calibration data has a clear final effect")
        return cls(grid=tuple(grid), shapes=tuple(shapes), comparable=tuple(keep_comparable),
                   visible=tuple(float(x) for x in visible),
                   residuals=tuple(tuple(float(x) for x in resid[i, j]) for i in range(len(variants)) for j in range(n)),
                   sigma=sigma, names=tuple(names), window=window)

    @classmethod
    def load(cls, path: Path | str = CALIBRATION) -> CurveModel:
        return _load_curves(str(path))

    def partials(self, delta: float, e: float, u_shape: float, u_resid: float) -> dict[float, float | None]:
        """{p: D(p)} of one candidate run (sigma units; None where the schedules differ)."""
        k = min(int(u_shape * len(self.shapes)), len(self.shapes) - 1)
        r = self.residuals[min(int(u_resid * len(self.residuals)), len(self.residuals) - 1)]
        shape, ok = self.shapes[k], self.comparable[k]
        return {p: (shape[i] * delta + self.visible[i] * e + r[i]) if ok[i] else None for i, p in enumerate(self.grid)}


@lru_cache(maxsize=4)
def _load_curves(path: str) -> CurveModel:
    return CurveModel.fit(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class Night:
    """How a night runs besides its decision rule: the reserve and the early stop."""

    reserve: int = 0  # fresh seeds the final best is re-measured at (0: report the selection mean)
    reserve_auto: bool = False  # scale the reserve with the night: remeasure.reserve_size(runs, most=reserve)
    reserve_baseline: bool = False  # re-measure the baseline at the fresh seeds too (paired gain); else its own runs
    early_stop: EarlyStopConfig | None = None
    curves: CurveModel | None = None  # needed with early_stop (default: CurveModel.load())
    recalibrate_every: int = 1  # refit the stop rule after this many new pairs (speed)
    protect: float = 0.0  # early stop: protect candidates ending this far (sigma) below level (0: level or better)

    def __post_init__(self) -> None:
        if self.reserve > RESERVE_MAX:
            raise ValueError(f"reserve {self.reserve}: at most {RESERVE_MAX} fresh seeds are drawn")


@dataclass
class Summary:
    """What the rules are judged on, over all simulated nights."""

    rule: str
    nights: int
    decided: int = 0  # proposals decided (early-stopped ones too: discarded)
    kept: int = 0  # adopted (the branch moved), confirmed or not
    confirmed: int = 0
    late_decided: int = 0  # proposals started in the last third of a night's runs
    late_kept: int = 0
    null: int = 0  # decided proposals with no effect (same stream or re-draw)
    null_kept: int = 0
    null_confirmed: int = 0
    redraw: int = 0
    harmful: int = 0
    harmful_kept: int = 0
    big: int = 0  # decided improvements of 2 sigma or more
    big_kept: int = 0
    big_stopped: int = 0  # ... lost to an early stop
    helpful: int = 0
    helpful_kept: int = 0
    helpful_stopped: int = 0
    stopped: int = 0  # candidates stopped early
    stopped_progress: float = 0.0  # sum of the fractions they ran
    runs: float = 0.0  # runs spent on decided proposals (candidate + incumbent re-measurements)
    reserve_runs: int = 0
    final_true: list[float] = field(default_factory=list)  # true value of the final incumbent (baseline 0)
    curse: list[float] = field(default_factory=list)  # its reported value minus its true value
    gain_error: list[float] = field(default_factory=list)  # reported gain minus true gain
    gain_covered: list[bool] = field(default_factory=list)  # the reported interval holds the true gain
    gain_se: list[float] = field(default_factory=list)
    excess: list[float] = field(default_factory=list)  # Landscape: the final incumbent's distance above the bowls' bottom
    start_excess: list[float] = field(default_factory=list)  # ... and the baseline's

    @property
    def false_keep_rate(self) -> float:
        """Null proposals adopted (the branch moved on nothing)."""
        return self.null_kept / self.null if self.null else 0.0

    @property
    def null_confirmed_rate(self) -> float:
        return self.null_confirmed / self.null if self.null else 0.0

    @property
    def big_kept_share(self) -> float:
        return self.big_kept / self.big if self.big else float("nan")

    @property
    def big_stopped_share(self) -> float:
        return self.big_stopped / self.big if self.big else 0.0

    @property
    def harmful_kept_rate(self) -> float:
        """Harmful proposals adopted, per harmful proposal decided."""
        return self.harmful_kept / self.harmful if self.harmful else 0.0

    @property
    def harmful_per_night(self) -> float:
        """Harmful proposals adopted per night (what they cost the night)."""
        return self.harmful_kept / self.nights if self.nights else 0.0

    @property
    def keep_rate(self) -> float:
        return self.kept / self.decided if self.decided else float("nan")

    @property
    def late_keep_rate(self) -> float:
        return self.late_kept / self.late_decided if self.late_decided else float("nan")

    @property
    def runs_per_proposal(self) -> float:
        return self.runs / self.decided if self.decided else float("nan")

    @property
    def stopped_share(self) -> float:
        return self.stopped / self.decided if self.decided else 0.0

    @property
    def mean_stop_progress(self) -> float:
        return self.stopped_progress / self.stopped if self.stopped else float("nan")

    @property
    def quality(self) -> float:
        """Mean true gain of the final best over the baseline, in sigma (higher is better)."""
        return -float(np.mean(self.final_true))

    @property
    def quality_se(self) -> float:
        return float(np.std(self.final_true, ddof=1) / math.sqrt(len(self.final_true))) if len(self.final_true) > 1 else 0.0

    @property
    def winners_curse(self) -> float:
        """Mean of (reported value - its true value): negative = the best looks better than it is."""
        return float(np.mean(self.curse))

    @property
    def winners_curse_se(self) -> float:
        return float(np.std(self.curse, ddof=1) / math.sqrt(len(self.curse))) if len(self.curse) > 1 else 0.0

    @property
    def gain_bias(self) -> float:
        """Mean of (reported gain - true gain), sigma: positive = the gain looks bigger than it is."""
        return float(np.mean(self.gain_error)) if self.gain_error else float("nan")

    @property
    def coverage(self) -> float:
        return float(np.mean(self.gain_covered)) if self.gain_covered else float("nan")


def draw_nights(nights: int, world: World, mix: Mix | Landscape, cfg_max_seeds: int, seed: int) -> dict:
    """Every random number of every night, drawn up front, so that all rules see the same
    proposals and the same luck (common random numbers: their differences are sharper).

    Mix: each proposal's kind and effect. Landscape: each night's curvatures and starting
    point, each proposal's type, hyperparameter, signed step and code effect (a step's
    effect is known only once the incumbent it starts from is). Then, for every rule
    alike: the runs at the reserve's fresh seeds, and each candidate's partial-curve luck
    (which real curve shape and which real residual it gets)."""
    rng = np.random.default_rng(seed)
    n = PROPOSALS_PER_RUN * world.runs  # early stops make room for more proposals than runs
    own = rng.standard_normal((nights, n + 1, cfg_max_seeds))
    lineage = rng.standard_normal((nights, n + 1, cfg_max_seeds))
    if isinstance(mix, Landscape):
        out = _draw_landscape(rng, nights, n, mix, world) | {"own": own, "lineage": lineage}
    else:
        kinds = rng.choice(4, size=(nights, n), p=[mix.null, mix.redraw, mix.harmful, mix.helpful])
        u = rng.random((nights, n))
        effects = np.where(kinds == HARMFUL, _log_uniform(u, mix.harmful_range),
                           np.where(kinds == HELPFUL, -_log_uniform(u, mix.helpful_range), 0.0)) * world.sigma
        out = {"kinds": kinds, "effects": effects, "own": own, "lineage": lineage}
    out["reserve_own"] = rng.standard_normal((nights, n + 1, RESERVE_MAX))
    out["reserve_lineage"] = rng.standard_normal((nights, n + 1, RESERVE_MAX))
    out["curve_u"] = rng.random((nights, n + 1, 2))
    return out


def _log_uniform(u, bounds: tuple[float, float]):
    lo, hi = math.log(bounds[0]), math.log(bounds[1])
    return np.exp(lo + u * (hi - lo))


def _draw_landscape(rng, nights: int, n: int, land: Landscape, world: World) -> dict:
    d = land.hyperparameters
    curv = _log_uniform(rng.random((nights, d)), land.curvature) * world.sigma
    start = rng.normal(0.0, land.start_sd, (nights, d))
    kinds = rng.choice([HP, REDRAW, CODE], size=(nights, n), p=[land.hp, land.redraw, land.code])
    coord = rng.integers(0, d, (nights, n))
    step = rng.choice(np.asarray(land.steps, dtype=float), size=(nights, n)) * rng.choice([-1.0, 1.0], size=(nights, n))
    code_kind = rng.choice([NULL, HELPFUL, HARMFUL], size=(nights, n),
                           p=[land.code_null, land.code_helpful, 1.0 - land.code_null - land.code_helpful])
    u = rng.random((nights, n))
    code_effect = np.where(code_kind == HARMFUL, _log_uniform(u, land.code_harmful_range),
                           np.where(code_kind == HELPFUL, -_log_uniform(u, land.code_helpful_range), 0.0)) * world.sigma
    return {"landscape": True, "curvature": curv, "start": start, "kinds": kinds, "coord": coord, "step": step,
            "code_kind": code_kind, "code_effect": code_effect}




def simulate(cfg: DecisionConfig, *, nights: int = 2000, world: World = World(), mix: Mix | Landscape = Mix(),
             seed: int = 0, draws: dict | None = None, night: Night = Night(), label: str | None = None) -> Summary:
    """Run `nights` simulated nights under one rule; `draws` (from draw_nights) to share luck."""
    n_seeds = cfg.baseline_seeds + cfg.max_runs
    if draws is None:
        draws = draw_nights(nights, world, mix, n_seeds, seed)
    if draws["own"].shape[2] < n_seeds:
        raise ValueError(f"draws hold {draws['own'].shape[2]} seeds, the rule needs {n_seeds}")
    if night.early_stop is not None and night.curves is None:
        night = replace(night, curves=CurveModel.load())
    out = Summary(rule=label or _label(cfg, night), nights=nights)
    for j in range(nights):
        if draws.get("landscape"):
            proposals = _LandscapeNight(draws, j)
        else:
            proposals = _MixNight(draws["kinds"][j].tolist(), draws["effects"][j].tolist())
        luck = {k: draws[k][j].tolist() for k in ("own", "lineage", "reserve_own", "reserve_lineage", "curve_u")}
        _night(cfg, world, night, proposals, luck, n_seeds, out)
    return out


def _label(cfg: DecisionConfig, night: Night = Night()) -> str:
    if cfg.rule == "strict":
        name = "strict" if not cfg.margin else f"margin {cfg.margin:g}"
    elif cfg.sequential == "two-tier":
        name = "two-tier"
        if cfg.promising is not None:
            name += f" (2nd look t<{cfg.promising:g}, max {cfg.max_runs})"
        if cfg.adopt:
            name += f" adopt t<{cfg.adopt:g}"
    else:
        name = f"confirmed-only (alpha {cfg.alpha:g})"
    if night.reserve:
        name += f", reserve {night.reserve}"
    if night.early_stop is not None:
        name += ", early stop"
    return name


class _MixNight:
    """Independent effects: proposal i does what was drawn for it, whatever the incumbent."""

    def __init__(self, kinds: list[int], effects: list[float]):
        self.kinds, self.effects = kinds, effects

    def start(self):
        return None

    def propose(self, i: int, state):
        return self.kinds[i], self.effects[i], None


class _LandscapeNight:
    """A proposal steps one hyperparameter of the CURRENT incumbent (state: its log2
    offsets from the optimum), so its effect depends on where the incumbent is."""

    def __init__(self, draws: dict, j: int):
        self.k = draws["curvature"][j].tolist()
        self.x0 = draws["start"][j].tolist()
        self.kinds = draws["kinds"][j].tolist()
        self.coord = draws["coord"][j].tolist()
        self.step = draws["step"][j].tolist()
        self.code_kind = draws["code_kind"][j].tolist()
        self.code_effect = draws["code_effect"][j].tolist()

    def excess(self, x) -> float:
        return sum(k * v * v for k, v in zip(self.k, x))

    def start(self):
        return tuple(self.x0)

    def propose(self, i: int, x):
        kind = self.kinds[i]
        if kind == REDRAW:
            return REDRAW, 0.0, x
        if kind == CODE:
            return self.code_kind[i], self.code_effect[i], x
        c, step = self.coord[i], self.step[i]
        old = x[c]
        new = old + step
        effect = self.k[c] * (new * new - old * old)
        return (HELPFUL if effect < 0 else HARMFUL), effect, x[:c] + (new,) + x[c + 1:]


def _night(cfg, world, night: Night, proposals, luck: dict, n_seeds, out: Summary) -> None:
    own, lineage_noise = luck["own"], luck["lineage"]
    seeds = list(range(n_seeds))
    pooled = cfg.sequential != "strict"
    sd_b = world.sigma * math.sqrt(world.shared)
    sd_e = world.sigma * math.sqrt(1.0 - world.shared)
    state = proposals.start()  # Landscape: the baseline's hyperparameters (log2 offsets from the optimum)
    mu = [0.0]  # true value of commit c (0: the baseline)
    lineage = [0]  # which init lineage commit c belongs to
    states = [state]

    def run(c: int, s: int) -> float:
        return mu[c] + sd_b * lineage_noise[lineage[c]][s] + sd_e * own[c][s]

    if night.reserve_auto:
        night = replace(night, reserve=reserve_size(world.runs, most=night.reserve), reserve_auto=False)
    reserve_cost = night.reserve * (2 if night.reserve_baseline else 1)  # set aside: the best is not known yet
    budget = float(world.runs - reserve_cost)
    late = budget / 3.0  # "late": started with less than a third of the night's runs left
    base = NoiseSums()  # sums of squares of groups that no longer change
    stopping = night.early_stop is not None
    rule: StopRule | None = never("no pairs yet", night.early_stop) if stopping else None
    calibration = Calibration(cfg=night.early_stop) if stopping else None
    fresh_pairs = 0
    # The baseline: measured at the rule's baseline seeds, its spread is the first noise estimate.
    inc, inc_runs = 0, {}
    while True:
        noise = pool_noise([list(inc_runs.values())], [], base=base) if pooled else None
        v = decide(inc_runs, {}, noise, cfg, seeds)
        if v.action != "measure":
            break
        if budget < 1.0:
            break
        budget -= 1
        inc_runs[v.seed] = run(0, v.seed)
    baseline_runs = dict(inc_runs)

    for i in range(len(proposals.kinds)):
        if budget < 1.0:
            break
        c = i + 1
        is_late = budget <= late
        kind, effect, cand_state = proposals.propose(i, states[inc])
        mu.append(mu[inc] + effect)
        states.append(cand_state)
        lineage.append(c if kind == REDRAW else lineage[inc])
        cand: dict[int, float] = {}
        spent = 0.0
        verdict = None
        stopped = 0.0  # the fraction of the budget an early-stopped first run ran
        diffs: list[float] = []
        while True:
            if pooled:
                diffs = [cand[s] - inc_runs[s] for s in cand if s in inc_runs]
                noise = pool_noise([list(inc_runs.values()), list(cand.values())], [diffs], base=base)
            else:
                noise = None
            v = decide(cand, inc_runs, noise, cfg, seeds)
            if v.action != "measure":
                verdict = v
                break
            if budget < 1.0:
                break
            if v.side == "candidate":
                value = run(c, v.seed)
                if stopping and not cand and v.seed in inc_runs:
                    # The first run, against the incumbent's curve at the same seed.
                    d = value - inc_runs[v.seed]
                    u = luck["curve_u"][c]
                    partials = night.curves.partials(effect, d - effect, u[0], u[1])
                    hit = stop_point(rule, partials) if rule.active else None
                    if hit is not None:
                        budget -= hit[0]
                        spent += hit[0]
                        stopped = hit[0]
                        break
                    for p, x in partials.items():
                        if x is not None:
                            calibration.add(p, x, d)
                    fresh_pairs += 1
                    if fresh_pairs >= night.recalibrate_every:
                        rule = calibration.rule(protect=night.protect * world.sigma)
                        fresh_pairs = 0
                cand[v.seed] = value
            else:
                inc_runs[v.seed] = run(inc, v.seed)
            budget -= 1
            spent += 1
        if verdict is None and not stopped:
            break  # the night ended mid-measurement: not decided
        kept = not stopped and verdict.action == "keep"
        confirmed = kept and bool(verdict.figures.get("confirmed"))
        out.decided += 1
        out.kept += kept
        out.confirmed += confirmed
        if stopped:
            out.stopped += 1
            out.stopped_progress += stopped
        if is_late:
            out.late_decided += 1
            out.late_kept += kept
        out.runs += spent
        if kind in (NULL, REDRAW):
            out.null += 1
            out.null_kept += kept
            out.null_confirmed += confirmed
            if kind == REDRAW:
                out.redraw += 1
        elif kind == HARMFUL:
            out.harmful += 1
            out.harmful_kept += kept
        else:
            out.helpful += 1
            out.helpful_kept += kept
            out.helpful_stopped += bool(stopped)
            if effect <= -2.0 * world.sigma:
                out.big += 1
                out.big_kept += kept
                out.big_stopped += bool(stopped)
        if pooled and not stopped:
            # The comparison's differences are final; a discarded candidate's runs too.
            base = base + noise_sums([] if kept else [list(cand.values())], [diffs])
            if kept:
                base = base + noise_sums([list(inc_runs.values())], [])
        if kept:
            inc, inc_runs = c, cand

    true_gain = -mu[inc]
    if night.reserve:
        k = night.reserve
        ro, rl = luck["reserve_own"], luck["reserve_lineage"]

        def fresh(cm: int) -> dict[int, float]:
            return {1000 + s: mu[cm] + sd_b * rl[lineage[cm]][s] + sd_e * ro[cm][s] for s in range(k)}

        best = fresh(inc)
        base_fresh = fresh(0) if night.reserve_baseline and inc else baseline_runs
        out.reserve_runs += reserve_cost
        # The headline's noise: the night's pooled noise as it stood before the reserve
        # (the loop passes controller.noise()), without the best's runs: its decision run
        # is a selected, lucky one and would inflate the spread of its group.
        sums = base if inc else base + noise_sums([list(baseline_runs.values())], [])
        h = headline(best, best if inc == 0 else base_fresh, sums.noise(), same_commit=inc == 0)
        reported, gain, interval, se = h.value, h.gain, h.interval, h.gain_se
    else:
        reported, _ = estimate(list(inc_runs.values()), None)
        gain = estimate(list(baseline_runs.values()), None)[0] - reported
        interval, se = (math.nan, math.nan), math.nan
    out.final_true.append(mu[inc])
    out.curse.append(reported - mu[inc])
    out.gain_error.append(gain - true_gain)
    out.gain_se.append(se if se is not None else math.nan)
    out.gain_covered.append(bool(interval[0] <= true_gain <= interval[1]))
    if states[inc] is not None:
        out.start_excess.append(proposals.excess(states[0]))
        out.excess.append(proposals.excess(states[inc]))


def targets(strict: Summary, ours: Summary) -> dict[str, tuple[str, bool]]:
    """The issue's targets for `ours` (the default: two tiers, reserve, early stop) against
    the strict rule, one world: name -> (figures, met)."""
    ratio = ours.quality / strict.quality if strict.quality else float("nan")
    # Both rules adopt on the sign of the first paired difference; their nights differ in
    # length and path, and the rate of harmful adoptions with them (a shorter night keeps
    # more of its harmful proposals: its incumbent is less lucky): equal within noise.
    pooled = (ours.harmful_kept + strict.harmful_kept) / max(ours.harmful + strict.harmful, 1)
    harm_se = math.sqrt(pooled * (1 - pooled) * (1 / max(ours.harmful, 1) + 1 / max(strict.harmful, 1)))
    return {
        "final true gain >= 1.05 x strict's": (
            f"{ours.quality:+.2f} vs {strict.quality:+.2f} sigma ({ratio:.3f} x)", ratio >= 1.05),
        "winner's curse of the reported value within ±0.1 sigma": (
            f"{ours.winners_curse:+.3f} ± {ours.winners_curse_se:.3f} sigma", abs(ours.winners_curse) <= 0.1),
        "<= 1% of null proposals confirmed": (f"{ours.null_confirmed_rate:.2%}", ours.null_confirmed_rate <= 0.01),
        ">= 90% of >=2 sigma improvements adopted": (f"{ours.big_kept_share:.1%}", ours.big_kept_share >= 0.90),
        "harmful changes adopted no more often than under strict": (
            f"{ours.harmful_kept_rate:.2%} vs {strict.harmful_kept_rate:.2%} of the harmful proposals (2 se "
            f"{2 * harm_se:.2%}); {ours.harmful_per_night:.2f} vs {strict.harmful_per_night:.2f} a night",
            ours.harmful_kept_rate <= strict.harmful_kept_rate + 2 * harm_se),
        "<= 2% of >=2 sigma improvements lost to early stopping": (
            f"{ours.big_stopped_share:.2%}", ours.big_stopped_share <= 0.02),
    }
