"""The run's noise: every repeated measurement of the run pooled into one estimate.

A decision (autoloop.decide.rule) compares a candidate with the incumbent against the
noise of a paired difference. The estimate is pooled from the whole run's repeats (the
baseline at several seeds, candidates and incumbents measured again, ablations) and from
the paired differences of earlier comparisons (`pool_noise`), so it sharpens as the
night goes on, and is stored on the run row for the review and the proposers' brief.

One `NoiseEstimate` per run, owned by the controller. Trials on several workers update it
between their measurements and read it in their decisions: `lock` guards the cached
estimate, and an update (read the db, pool, store) holds it from start to end, so the
cache is always the estimate of the db as some update saw it, never a mix of two.

`paired_decision` is the paired rule seen from the loop: a candidate's runs are paired
with the incumbent's only at one machine speed (autoloop.decide.confound), a confounded
seed asks for the incumbent again next to the candidate, and before the run's first keep
the incumbent is measured again next to the candidate (a drift check on the way).
`decision-rule = strict`, a reported incumbent and the baseline decide on the runs as
they came, as before.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from autoloop.decide.confound import (
    FIRST_KEEP_CHECK, SPEED_TOLERANCE, Pairing, decide_pairs, describe, drift_check, needs_first_keep_check, pair_runs,
    waiting,
)
from autoloop.decide.rule import DecisionConfig, Noise, Verdict, decide, pool_noise
from autoloop.store import Kind
from autoloop.loop.host import TrialHost

# The roles whose runs measure a trial's own code: what the incumbent is paired with.
INCUMBENT_ROLES = ("baseline", "candidate", "incumbent")


def runs_of(store, trial: dict, roles: tuple[str, ...] | None = None, device: str | None = None) -> dict[int, float]:
    """{seed: metric} of a trial's successful runs (the first run per seed); with
    `device`, only runs on that kind of device (or of unknown kind)."""
    runs: dict[int, float] = {}
    for row in store.measurements(trial["id"]):
        if row.get("status") not in (None, "ok") or row.get("metric") is None or row.get("seed") is None:
            continue
        if device is not None and row.get("device") not in (None, device):
            continue
        if roles is not None and (row.get("role") or "candidate") not in roles:
            continue
        runs.setdefault(int(row["seed"]), float(row["metric"]))
    return runs


class NoiseEstimate:
    """The pooled noise of one run (see the module docstring for its lock)."""

    def __init__(self, store, run_id: int):
        self.store = store
        self.run_id = run_id
        self.lock = threading.Lock()  # guards `_current`; held through a whole update
        self._current: Noise | None = None

    def current(self) -> Noise | None:
        """The latest estimate (None before the first update, or with no repeats yet)."""
        with self.lock:
            return self._current

    def known(self) -> bool:
        with self.lock:
            return self._current is not None

    def update(self) -> Noise | None:
        """Pool every repeated measurement of the run into the noise of a paired difference."""
        with self.lock:
            store = self.store
            repeats, paired = [], []
            trials = {t["id"]: t for t in store.trials(self.run_id)}
            by_trial: dict[int, dict[int, float]] = {}
            for tid, trial in trials.items():
                runs = runs_of(store, trial, INCUMBENT_ROLES + ("ablation",))
                if runs:
                    by_trial[tid] = runs
                if len(runs) >= 2:
                    repeats.append(list(runs.values()))
            for tid, trial in trials.items():
                incumbent_id = (trial.get("decision") or {}).get("incumbent_id")
                if incumbent_id in by_trial and tid in by_trial and trial["kind"] != Kind.BASELINE.value:
                    cand, inc = by_trial[tid], by_trial[incumbent_id]
                    diffs = [cand[s] - inc[s] for s in cand if s in inc]
                    if len(diffs) >= 2:
                        paired.append(diffs)
            noise = pool_noise(repeats, paired)
            self._current = noise
            if noise is not None:
                store.update_run(self.run_id, noise_sd=noise.run_sd, noise_pair_sd=noise.pair_sd, noise_df=noise.df)
            return noise


# ---------------------------------------------------------------------------- pairs at one machine speed


@dataclass
class PairedDecision:
    """One step of a candidate's comparison: the verdict and the runs it stood on."""

    verdict: Verdict
    pairing: Pairing
    candidate: dict[int, float]  # {seed: metric} the rule used, each side
    incumbent: dict[int, float]
    own: dict[int, float]  # the candidate's runs at every seed, paired or not (its metric and n_runs)
    paired: bool  # the machine-speed pairing applied (the paired rule with an incumbent)
    tolerance: float = SPEED_TOLERANCE  # `pair-speed-tolerance` (inf: none)

    def figures(self) -> dict:
        """What the decision record keeps of the pairing."""
        return self.pairing.figures() if self.paired else {}

    def confounded_note(self) -> str | None:
        """A line for the run's events when the incumbent is measured again because the
        pair at the verdict's seed ran at different machine speeds, else None."""
        v = self.verdict
        if self.paired and v.action == "measure" and v.side == "incumbent" and v.seed in waiting(self.pairing):
            return describe(self.pairing.confounded)
        return None

    def drift_before(self, metric: float | None, speed: float | None) -> float | None:
        """The incumbent's earlier value at the verdict's seed to judge a fresh run of it
        against, when this measurement is the drift check before the first keep."""
        if not self.paired or metric is None or self.verdict.figures.get("stopped") != FIRST_KEEP_CHECK:
            return None
        return drift_check(self.pairing, self.verdict.seed, metric, speed, self.tolerance)


def paired_decision(c: TrialHost, trial: dict, incumbent: dict | None, cfg: DecisionConfig, seeds: list[int],
                    device: str | None) -> PairedDecision:
    """The rule's next step for `trial` against `incumbent` (module docstring)."""
    noise = c.noise.current()
    if incumbent is None or cfg.rule == "strict":
        candidate = runs_of(c.store, trial, ("candidate",))
        inc_runs = c.incumbent_runs(incumbent, device) if incumbent is not None else {}
        return PairedDecision(decide(candidate, inc_runs, noise, cfg, seeds), Pairing(own=candidate),
                              candidate, inc_runs, candidate, paired=False)
    # A shift of the incumbent at one seed beyond this is drift (as autoloop.loop.compare.judge_drift says).
    limit = c.config.drift_event_sigmas * max(noise.pair_sd if noise is not None else 0.0, 1e-6)
    tolerance = c.config.pair_speed_tolerance
    tolerance = math.inf if tolerance is None else tolerance  # none: every pair is a pair
    pairing = pair_runs(c.store.measurements(trial["id"]), c.store.measurements(incumbent["id"]),
                        for_trial=trial["id"], device=device, drift_limit=limit, tolerance=tolerance)
    verdict = decide_pairs(pairing, noise, cfg, seeds, first_keep=needs_first_keep_check(c.store.trials(c.run_row["id"])))
    return PairedDecision(verdict, pairing, pairing.candidate, pairing.incumbent, pairing.own, paired=True,
                          tolerance=tolerance)
