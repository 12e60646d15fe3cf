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
"""

from __future__ import annotations

import threading

from autoloop.decide.rule import Noise, pool_noise
from autoloop.store import Kind

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
