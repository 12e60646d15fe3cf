"""A seal on what decides a run, so a trial that writes to experiments.db changes nothing.

Training code runs as the same user as the controller; unsandboxed (or with a sandbox
that cannot hide the database) it can open experiments.db and, say, set the incumbent's
metric to 99 so that the next, far worse trial is "an improvement". The controller seals
the rows that decide right before a training run and checks them right after:

    seal = StoreSeal.capture(store, run_id)
    ... training ...
    problem = seal.check(store)          # None, or "trial 1 metric 2.65 -> 99.0; ..."
    if problem:
        seal.restore(store)              # the sealed values back, in one transaction
        ... the trial is invalid: f"the trial wrote to experiments.db: {problem}"

What is sealed: the run's best_commit and noise figures; for every trial of the run that
has finished (any status but running), status, metric, metric_source, heldout_metric,
metric_sd, n_runs and trial_commit; every measurement of the run's trials (metric, seed,
heldout_metric, role, status, for_trial_id, verified), and which rows exist. A trial that
is running (the one training now, or a candidate between its measurements) may still be
updated by the controller, so only its measurements are sealed. New finished trials and
new measurements that appear between capture and check are tampering too (the controller
writes neither while a training process runs). `restore` puts sealed values back,
re-inserts deleted rows from the full copies taken at capture, deletes added
measurements and marks added trials invalid.

The seal costs one read of the run's trials and measurements (~1 ms per hundred rows).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

TRIAL_FIELDS = ("status", "metric", "metric_source", "heldout_metric", "metric_sd", "n_runs", "trial_commit")
MEASUREMENT_FIELDS = ("trial_id", "seed", "metric", "heldout_metric", "role", "status", "for_trial_id", "verified")
RUN_FIELDS = ("best_commit", "noise_sd", "noise_pair_sd", "noise_df")
MAX_LISTED = 6


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _columns(store, table: str) -> list[str]:
    return [row["name"] for row in store._query(f"PRAGMA table_info({table})")]


@dataclass
class StoreSeal:
    run_id: int
    run: dict[str, Any]
    trials: dict[int, dict[str, Any]]  # trial id -> full row (finished trials)
    measurements: dict[int, dict[str, Any]]  # measurement id -> full row
    running: set[int]  # ids of trials running at capture (their own fields are not sealed)
    digest: str = ""
    numbers: dict[int, int] = field(default_factory=dict)  # trial id -> trial number, for messages

    # ------------------------------------------------------------------ reading

    @staticmethod
    def _read(store, run_id: int) -> tuple[dict, dict, dict, set, dict]:
        runs = store._query("SELECT * FROM runs WHERE id = ?", (run_id,))
        if not runs:
            raise KeyError(f"no run with id {run_id}")
        trials = store._query("SELECT * FROM trials WHERE run_id = ? ORDER BY id", (run_id,))
        measurements = store._query(
            "SELECT m.* FROM measurements m JOIN trials t ON t.id = m.trial_id WHERE t.run_id = ? ORDER BY m.id",
            (run_id,),
        )
        finished = {row["id"]: row for row in trials if row["status"] != "running"}
        running = {row["id"] for row in trials if row["status"] == "running"}
        numbers = {row["id"]: row["number"] for row in trials}
        return runs[0], finished, {row["id"]: row for row in measurements}, running, numbers

    @staticmethod
    def _digest(run: dict, trials: dict, measurements: dict) -> str:
        decisive = {
            "run": {k: run.get(k) for k in RUN_FIELDS},
            "trials": {str(i): {k: row.get(k) for k in TRIAL_FIELDS} for i, row in trials.items()},
            "measurements": {str(i): {k: row.get(k) for k in MEASUREMENT_FIELDS} for i, row in measurements.items()},
        }
        return hashlib.sha256(json.dumps(decisive, sort_keys=True, default=str).encode()).hexdigest()

    @classmethod
    def capture(cls, store, run_id: int) -> StoreSeal:
        """Seal what decides run `run_id`: a digest plus a full copy of the rows."""
        run, trials, measurements, running, numbers = cls._read(store, run_id)
        return cls(run_id=run_id, run=run, trials=trials, measurements=measurements, running=running,
                   digest=cls._digest(run, trials, measurements), numbers=numbers)

    # ------------------------------------------------------------------ checking

    def _differences(self, store) -> list[str]:
        run, trials, measurements, _running, numbers = self._read(store, self.run_id)
        if self._digest(run, trials, measurements) == self.digest and set(trials) == set(self.trials):
            return []
        numbers = {**numbers, **self.numbers}
        found = []
        for key in RUN_FIELDS:
            if run.get(key) != self.run.get(key):
                found.append(f"run {key} {_show(self.run.get(key))} -> {_show(run.get(key))}")
        for trial_id, sealed in self.trials.items():
            now = trials.get(trial_id)
            if now is None:  # deleted, or set back to running (then no longer "finished")
                status = store._query("SELECT status FROM trials WHERE id = ?", (trial_id,))
                found.append(f"trial {sealed['number']} " + (
                    f"status {sealed['status']} -> {status[0]['status']}" if status else "deleted"))
                continue
            for key in TRIAL_FIELDS:
                if now.get(key) != sealed.get(key):
                    found.append(f"trial {sealed['number']} {key} {_show(sealed.get(key))} -> {_show(now.get(key))}")
        for trial_id in sorted(set(trials) - set(self.trials) - self.running):
            found.append(f"trial {trials[trial_id]['number']} added as {trials[trial_id]['status']}")
        for mid, sealed in self.measurements.items():
            now = measurements.get(mid)
            label = f"measurement {mid} (trial {numbers.get(sealed['trial_id'], '?')})"
            if now is None:
                found.append(f"{label} deleted")
                continue
            for key in MEASUREMENT_FIELDS:
                if now.get(key) != sealed.get(key):
                    found.append(f"{label} {key} {_show(sealed.get(key))} -> {_show(now.get(key))}")
        for mid in sorted(set(measurements) - set(self.measurements)):
            found.append(f"measurement {mid} (trial {numbers.get(measurements[mid]['trial_id'], '?')}) added")
        return found

    def check(self, store) -> str | None:
        """What changed since capture, e.g. "trial 1 metric 2.65 -> 99.0", or None."""
        found = self._differences(store)
        if not found:
            return None
        listed = "; ".join(found[:MAX_LISTED])
        return listed + (f"; and {len(found) - MAX_LISTED} more" if len(found) > MAX_LISTED else "")

    # ------------------------------------------------------------------ restoring

    def restore(self, store) -> None:
        """Put every sealed row back as it was at capture, in one transaction."""
        trial_columns = set(_columns(store, "trials"))
        measurement_columns = set(_columns(store, "measurements"))
        with store.transaction():
            conn = store.conn
            conn.execute(f"UPDATE runs SET {', '.join(f'{k} = ?' for k in RUN_FIELDS)} WHERE id = ?",
                         (*(self.run.get(k) for k in RUN_FIELDS), self.run_id))
            for trial_id, row in self.trials.items():
                exists = conn.execute("SELECT 1 FROM trials WHERE id = ?", (trial_id,)).fetchone()
                if exists:
                    conn.execute(f"UPDATE trials SET {', '.join(f'{k} = ?' for k in TRIAL_FIELDS)} WHERE id = ?",
                                 (*(row.get(k) for k in TRIAL_FIELDS), trial_id))
                else:
                    names = [k for k in row if k in trial_columns]
                    conn.execute(f"INSERT INTO trials ({', '.join(names)}) VALUES ({', '.join('?' for _ in names)})",
                                 tuple(row[k] for k in names))
            present = {r[0] for r in conn.execute(
                "SELECT m.id FROM measurements m JOIN trials t ON t.id = m.trial_id WHERE t.run_id = ?", (self.run_id,))}
            for mid in present - set(self.measurements):
                conn.execute("DELETE FROM measurements WHERE id = ?", (mid,))
            for mid, row in self.measurements.items():
                if mid in present:
                    conn.execute(f"UPDATE measurements SET {', '.join(f'{k} = ?' for k in MEASUREMENT_FIELDS)} "
                                 "WHERE id = ?", (*(row.get(k) for k in MEASUREMENT_FIELDS), mid))
                else:
                    names = [k for k in row if k in measurement_columns]
                    conn.execute(f"INSERT INTO measurements ({', '.join(names)}) "
                                 f"VALUES ({', '.join('?' for _ in names)})", tuple(row[k] for k in names))
            sealed_ids = set(self.trials) | self.running
            for (trial_id,) in conn.execute("SELECT id FROM trials WHERE run_id = ?", (self.run_id,)).fetchall():
                if trial_id not in sealed_ids:
                    conn.execute("UPDATE trials SET status = 'invalid', reason = ? WHERE id = ?",
                                 ("row written to experiments.db by another process while a trial ran", trial_id))
