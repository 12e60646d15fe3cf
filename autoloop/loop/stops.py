"""The early stop in the loop: the night's calibration, the rule a candidate's job carries,
and the end of a stopped run.

The rule itself is pure (autoloop.decide.early_stop); this module feeds it from the db and
hands it to the worker, which asks it while the candidate trains
(autoloop.measure.stop_watch):

* A **calibration pair** is a finished candidate run (role `candidate`, status `ok`, its
  curve recorded in `measurements.curve`) and the run of the incumbent it was compared
  with (the trial's `decision.incumbent_id`) at the same seed, with the final paired
  difference. `EarlyStops` reads them from the db, each candidate run once, so a resumed
  run, and several workers, calibrate on the same pairs. One per run, owned by the
  controller; `lock` guards the calibration (trials on several workers update it).
* `EarlyStops.payload(incumbent, seed)`: what a candidate's FIRST run carries (as in the
  simulation, bench/decision_quality.py): {"rule": StopRule.to_json(), "incumbent_curve":
  the incumbent's recorded curve at that seed}; None when early stopping is off, when
  the incumbent has no recorded curve at the seed, or while the rule would never stop
  (fewer than 12 pairs of the night: there is no scale for "clearly worse" yet).
* `stopped_outcome`: a run the worker stopped (measurement status `stopped`) ends its
  trial as `autoloop.measure.measurer.trial_status` maps it (discard), with the progress
  it reached (`trials.stopped_at`) and no metric: a stopped run is never a measurement of
  the candidate's val_bpb, and never kept.

Progress is step / max_steps in step mode, training seconds / time budget in time mode
(the rule's `budget`), so both modes, serial and with workers, work alike.
"""

from __future__ import annotations

import threading

from autoloop.decide.early_stop import Calibration, EarlyStopConfig, curve_pairs, schedule_changes
from autoloop.loop.noise import INCUMBENT_ROLES
from autoloop.store import Status


def budget_of(config) -> dict:
    """The budget a curve point's progress is measured against: steps, else seconds."""
    if config.max_steps:
        return {"max_steps": int(config.max_steps)}
    return {"time_budget": float(config.time_budget)}


class EarlyStops:
    """The night's early-stop calibration (see the module docstring)."""

    def __init__(self, store, run_id: int, config, cfg: EarlyStopConfig = EarlyStopConfig()):
        self.store = store
        self.run_id = run_id
        self.config = config
        self.cfg = cfg
        self.lock = threading.Lock()  # guards the calibration and the sets below
        self.calibration = Calibration(cfg=cfg)
        self._done: set[int] = set()  # candidate measurements added, or left out for good

    @property
    def enabled(self) -> bool:
        return bool(getattr(self.config, "early_stop", True))

    def incumbent_curve(self, trial_id: int, seed: int) -> tuple[float, list[dict]] | None:
        """(metric, curve) of the first successful run of `trial_id`'s own code at `seed`
        with a recorded curve, or None."""
        for row in self.store.measurements(trial_id):
            if row.get("status") != "ok" or row.get("seed") != seed or row.get("metric") is None:
                continue
            if (row.get("role") or "candidate") in INCUMBENT_ROLES and row.get("curve"):
                return float(row["metric"]), row["curve"]
        return None

    def update(self) -> int:
        """Add the night's new calibration pairs; returns how many pairs are behind the rule."""
        with self.lock:
            rows = self.store.rows(
                "trials", "SELECT m.id, m.trial_id, m.seed, m.metric, t.status, t.decision FROM measurements m "
                "JOIN trials t ON t.id = m.trial_id WHERE t.run_id = ? AND m.role = 'candidate' "
                "AND m.status = 'ok' AND m.metric IS NOT NULL AND m.curve IS NOT NULL ORDER BY m.id",
                (self.run_id,))
            budget = budget_of(self.config)
            for row in rows:
                if row["id"] in self._done:
                    continue
                decision = row.get("decision")
                incumbent_id = decision.get("incumbent_id") if isinstance(decision, dict) else None
                partner = self.incumbent_curve(incumbent_id, row["seed"]) if incumbent_id else None
                if partner is None:
                    if row["status"] != Status.RUNNING.value:
                        self._done.add(row["id"])  # finished without a partner at its seed: never a pair
                    continue  # its incumbent may still be measured at this seed
                curve = self._curve_of(row["id"])
                metric, inc_curve = partner
                for p, d, f in curve_pairs(inc_curve, curve or [], float(row["metric"]) - metric, self.cfg, budget):
                    self.calibration.add(p, d, f)
                self._done.add(row["id"])
            return self.calibration.pairs

    def _curve_of(self, measurement_id: int) -> list[dict] | None:
        rows = self.store.rows("measurements", "SELECT curve FROM measurements WHERE id = ?", (measurement_id,))
        return rows[0]["curve"] if rows else None

    def payload(self, incumbent: dict | None, seed: int) -> dict | None:
        """What a candidate's first run at `seed` carries to its worker, or None (see the
        module docstring)."""
        if not self.enabled or incumbent is None:
            return None
        partner = self.incumbent_curve(incumbent["id"], seed)
        if partner is None:
            return None
        self.update()
        budget = budget_of(self.config)
        with self.lock:
            rule = self.calibration.rule(shape_changes=schedule_changes(partner[1], budget), budget=budget)
        if not rule.active:
            return None
        return {"rule": rule.to_json(), "incumbent_curve": partner[1]}


def stopped_outcome(trial: dict, m, record: dict, status) -> tuple:
    """(status, reason, fields) of a trial whose candidate run the worker stopped early."""
    fields = {k: v for k, v in m.fields.items() if k != "curve"}
    progress = fields.get("stopped_at")
    reason = m.reason or (f"stopped early at {progress:.0%} of the budget" if progress is not None
                          else "stopped early")
    record = {**record, "action": "discard", "reason": reason, "stopped": "early stop", "tier": None,
              "confirmed": False, "near_miss": False, "early_stop": {"progress": progress, "seed": m.seed}}
    fields.update(decision=record, stopped_at=progress, tier=None)
    return status, f"discard: {reason}", fields
