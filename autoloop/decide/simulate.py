"""Simulated nights: how well a decision rule keeps real changes, at equal compute.

In-process and fast (thousands of nights in seconds), for bench/decision_quality.py and
its tests; the controller never imports it. It lives in the package (not in bench/) so
tests import it like any module, and it drives the SAME `decide()` and `pool_noise()` the
controller uses, with the noise estimated from the night's own repeats exactly as the
controller does (see docs/decisions.md, "What the controller passes").

The noise, in units of sigma (the sd of one run across seeds):

* a run of commit c at seed s gives  mu_c + sqrt(shared) * sigma * b[g_c, s] + sqrt(1 - shared) * sigma * e[c, s]
  with b, e standard normal: b is the part of the seed's luck that every commit of one
  init lineage g shares (same data order and init stream), so pairing cancels it; e is
  the commit's own luck. A proposal inherits its incumbent's lineage, except init-only
  re-draws, which start a new one (no shared component: their paired difference has the
  full unpaired variance 2 sigma^2).
* a night is a fixed number of training runs; every run (baseline, candidate or incumbent
  re-measurement) costs one. The baseline is measured at baseline_seeds seeds under every
  rule. A candidate still being measured when the night's runs are spent is not decided.

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

import math
from dataclasses import dataclass, field, replace

import numpy as np

from autoloop.decide.rule import DecisionConfig, NoiseSums, decide, estimate, noise_sums, pool_noise

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


@dataclass
class Summary:
    """What the rules are judged on, over all simulated nights."""

    rule: str
    nights: int
    decided: int = 0  # proposals decided
    kept: int = 0
    late_decided: int = 0  # proposals started in the last third of a night's runs
    late_kept: int = 0
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
    excess: list[float] = field(default_factory=list)  # Landscape: the final incumbent's distance above the bowls' bottom
    start_excess: list[float] = field(default_factory=list)  # ... and the baseline's

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
    def keep_rate(self) -> float:
        return self.kept / self.decided if self.decided else float("nan")

    @property
    def late_keep_rate(self) -> float:
        return self.late_kept / self.late_decided if self.late_decided else float("nan")

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


def draw_nights(nights: int, world: World, mix: Mix | Landscape, cfg_max_seeds: int, seed: int) -> dict:
    """Every random number of every night, drawn up front, so that all rules see the same
    proposals and the same luck (common random numbers: their differences are sharper).

    Mix: each proposal's kind and effect. Landscape: each night's curvatures and starting
    point, each proposal's type, hyperparameter, signed step and code effect (a step's
    effect is known only once the incumbent it starts from is)."""
    rng = np.random.default_rng(seed)
    n = world.runs  # at most one proposal per run
    own = rng.standard_normal((nights, n + 1, cfg_max_seeds))
    lineage = rng.standard_normal((nights, n + 1, cfg_max_seeds))
    if isinstance(mix, Landscape):
        return _draw_landscape(rng, nights, n, mix, world) | {"own": own, "lineage": lineage}
    kinds = rng.choice(4, size=(nights, n), p=[mix.null, mix.redraw, mix.harmful, mix.helpful])
    u = rng.random((nights, n))
    effects = np.where(kinds == HARMFUL, _log_uniform(u, mix.harmful_range),
                       np.where(kinds == HELPFUL, -_log_uniform(u, mix.helpful_range), 0.0)) * world.sigma
    return {"kinds": kinds, "effects": effects, "own": own, "lineage": lineage}


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
             seed: int = 0, draws: dict | None = None) -> Summary:
    """Run `nights` simulated nights under one rule; `draws` (from draw_nights) to share luck."""
    n_seeds = cfg.baseline_seeds + cfg.max_runs
    if draws is None:
        draws = draw_nights(nights, world, mix, n_seeds, seed)
    out = Summary(rule=_label(cfg), nights=nights)
    for j in range(nights):
        if draws.get("landscape"):
            proposals = _LandscapeNight(draws, j)
        else:
            proposals = _MixNight(draws["kinds"][j].tolist(), draws["effects"][j].tolist())
        _night(cfg, world, proposals, draws["own"][j].tolist(), draws["lineage"][j].tolist(), n_seeds, out)
    return out


def _label(cfg: DecisionConfig) -> str:
    if cfg.rule == "strict":
        return "strict" if not cfg.margin else f"margin {cfg.margin:g}"
    return f"paired (alpha {cfg.alpha:g}, max {cfg.max_runs})"


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


def _night(cfg, world, proposals, own, lineage_noise, n_seeds, out: Summary) -> None:
    seeds = list(range(n_seeds))
    paired = cfg.rule == "paired"
    sd_b = world.sigma * math.sqrt(world.shared)
    sd_e = world.sigma * math.sqrt(1.0 - world.shared)
    state = proposals.start()  # Landscape: the baseline's hyperparameters (log2 offsets from the optimum)
    mu = [0.0]  # true value of commit c (0: the baseline)
    lineage = [0]  # which init lineage commit c belongs to
    states = [state]

    def run(c: int, s: int) -> float:
        return mu[c] + sd_b * lineage_noise[lineage[c]][s] + sd_e * own[c][s]

    budget = world.runs
    late = world.runs / 3.0  # "late": started with less than a third of the night's runs left
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

    for i in range(world.runs):
        if budget == 0:
            break
        c = i + 1
        is_late = budget <= late
        kind, effect, cand_state = proposals.propose(i, states[inc])
        mu.append(mu[inc] + effect)
        states.append(cand_state)
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
        out.kept += kept
        if is_late:
            out.late_decided += 1
            out.late_kept += kept
        out.runs += spent
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
    if states[inc] is not None:
        out.start_excess.append(proposals.excess(states[0]))
        out.excess.append(proposals.excess(states[inc]))


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
