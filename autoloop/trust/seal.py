"""The db seal: a training run that writes to experiments.db changes nothing that decides.

Unsandboxed (under bubblewrap the db is not there for a trial to open), training code runs
as the controller's user and can open experiments.db and, say, set the incumbent's metric
to 99 so that the next, far worse trial is "an improvement". The seal holds what decides
against that, and it works with several trials in flight:

* `OwnWrites` is a mirror of the decisive fields (SEALED) of every row of the run that the
  controller's Store wrote: it is told of each write as the Store makes it, from whichever
  thread (autoloop.store.Store.watch_own_writes), and it starts from the db as it was when
  the run's first seal was taken. So it holds what the db would hold if nobody else wrote.
* `StoreSeal.capture()` before a training run notes SQLite's `data_version` (which changes
  only when *another connection* commits: `autoloop seed`, `autoloop stop`, a live page
  seeding an idea, or a trial writing the file); `check()` after the run compares the
  decisive fields of the db with the mirror, but only when data_version moved (one PRAGMA
  otherwise). The controller's own writes meanwhile, from another trial's thread included,
  are in the mirror, so they are never a difference: nothing honest is blamed.
* `restore()` writes the mirror's values back over a difference, deletes measurements and
  marks trials that no controller wrote, and re-inserts rows a foreign writer deleted
  (full copies are kept): the controller's own rows, another thread's measurement among
  them, are never undone.

Who is to blame is the caller's business (autoloop.measure.measurer): with one trial training it
is that trial; with several it cannot be told, and the run pauses instead of failing an
honest one.

Sealed: the run's best_commit and noise figures; every trial's status, metric,
metric_source, heldout_metric, metric_sd, n_runs, trial_commit; every measurement's trial,
seed, metric, heldout_metric, role, status, for_trial_id, verified.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

TRIAL_FIELDS = ("status", "metric", "metric_source", "heldout_metric", "metric_sd", "n_runs", "trial_commit")
MEASUREMENT_FIELDS = ("trial_id", "seed", "metric", "heldout_metric", "role", "status", "for_trial_id", "verified")
RUN_FIELDS = ("best_commit", "noise_sd", "noise_pair_sd", "noise_df")
SEALED = {"runs": RUN_FIELDS, "trials": TRIAL_FIELDS, "measurements": MEASUREMENT_FIELDS}
MAX_LISTED = 6


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _read(store, run_id: int) -> dict[str, dict[int, dict]]:
    """The run's rows as they are in the db now (full rows)."""
    runs = store.query("SELECT * FROM runs WHERE id = ?", (run_id,))
    trials = store.query("SELECT * FROM trials WHERE run_id = ? ORDER BY id", (run_id,))
    measurements = store.query(
        "SELECT m.* FROM measurements m JOIN trials t ON t.id = m.trial_id WHERE t.run_id = ? ORDER BY m.id", (run_id,))
    return {"runs": {r["id"]: r for r in runs}, "trials": {r["id"]: r for r in trials},
            "measurements": {r["id"]: r for r in measurements}}


class OwnWrites:
    """What the db holds by the controller's own writes: full rows of the run, updated with
    every write the Store makes (it is the Store's mirror, one per Store)."""

    def __init__(self, store, run_id: int):
        self.run_id = run_id
        self.lock = threading.Lock()
        self.rows = _read(store, run_id)  # the trusted start: before any trial of this invocation ran
        self.trial_ids = set(self.rows["trials"])
        store.watch_own_writes(self)

    def wrote(self, table: str, row_id: int, encoded: dict[str, Any], inserted: bool = False) -> None:
        if table not in SEALED:
            return
        with self.lock:
            if table == "trials":
                if inserted and encoded.get("run_id") != self.run_id:
                    return
                if row_id not in self.trial_ids and not inserted:
                    return
                self.trial_ids.add(row_id)
            elif table == "measurements":
                if encoded.get("trial_id", self.rows["measurements"].get(row_id, {}).get("trial_id")) \
                        not in self.trial_ids:
                    return
            elif row_id != self.run_id:
                return
            row = self.rows[table].setdefault(row_id, {"id": row_id})
            row.update(encoded)

    def snapshot(self) -> dict[str, dict[int, dict]]:
        with self.lock:
            return {table: {k: dict(v) for k, v in rows.items()} for table, rows in self.rows.items()}


def own_writes(store, run_id: int) -> OwnWrites:
    """The Store's mirror for `run_id`, made once (the first seal of the invocation)."""
    mirror = store.mirror
    if mirror is None or mirror.run_id != run_id:
        mirror = OwnWrites(store, run_id)
    return mirror


@dataclass
class StoreSeal:
    run_id: int
    mirror: OwnWrites
    data_version: int
    found: list[str] = field(default_factory=list)

    @classmethod
    def capture(cls, store, run_id: int) -> StoreSeal:
        mirror = own_writes(store, run_id)
        return cls(run_id=run_id, mirror=mirror, data_version=store.data_version())

    def _differences(self, store) -> list[str]:
        if store.data_version() == self.data_version:
            return []  # no other connection committed anything
        now = _read(store, self.run_id)
        ours = self.mirror.snapshot()
        number = {tid: row.get("number") for tid, row in {**now["trials"], **ours["trials"]}.items()}
        found = []
        for table, fields in SEALED.items():
            for row_id, mine in ours[table].items():
                theirs = now[table].get(row_id)
                label = {"runs": "run", "trials": f"trial {number.get(row_id)}",
                         "measurements": f"measurement {row_id} (trial {number.get(mine.get('trial_id'), '?')})"}[table]
                if theirs is None:
                    found.append(f"{label} deleted")
                    continue
                for key in fields:
                    if key in mine and theirs.get(key) != mine.get(key):
                        found.append(f"{label} {key} {_show(mine.get(key))} -> {_show(theirs.get(key))}")
            for row_id in sorted(set(now[table]) - set(ours[table])):
                if table == "measurements":
                    found.append(f"measurement {row_id} (trial {number.get(now[table][row_id].get('trial_id'), '?')}) added")
                elif table == "trials":
                    found.append(f"trial {now[table][row_id].get('number')} added as {now[table][row_id].get('status')}")
        return found

    def check(self, store) -> str | None:
        """What another process changed since capture, e.g. "trial 1 metric 2.65 -> 99.0", or None."""
        self.found = self._differences(store)
        if not self.found:
            return None
        listed = "; ".join(self.found[:MAX_LISTED])
        return listed + (f"; and {len(self.found) - MAX_LISTED} more" if len(self.found) > MAX_LISTED else "")

    def restore(self, store) -> None:
        """The controller's own values back over whatever another process changed, in one transaction."""
        ours = self.mirror.snapshot()
        now = _read(store, self.run_id)
        with store.transaction():
            conn = store.conn
            for table, fields in SEALED.items():
                columns = {row["name"] for row in store.query(f"PRAGMA table_info({table})")}
                for row_id, mine in ours[table].items():
                    keep = {k: v for k, v in mine.items() if k in columns}
                    if row_id in now[table]:
                        sealed = {k: keep[k] for k in fields if k in keep}
                        if sealed:
                            conn.execute(f"UPDATE {table} SET {', '.join(f'{k} = ?' for k in sealed)} WHERE id = ?",
                                         (*sealed.values(), row_id))
                    elif table != "runs":
                        names = list(keep)
                        conn.execute(f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' for _ in names)})",
                                     tuple(keep[k] for k in names))
                for row_id in set(now[table]) - set(ours[table]):
                    if table == "measurements":
                        conn.execute("DELETE FROM measurements WHERE id = ?", (row_id,))
                    elif table == "trials":
                        reason = "row written to experiments.db by another process while a trial ran"
                        conn.execute("UPDATE trials SET status = 'invalid', reason = ? WHERE id = ?", (reason, row_id))
                        # Neutralised, it stays (its number is taken) and decides nothing: ours now.
                        self.mirror.wrote("trials", row_id, {**now[table][row_id], "status": "invalid",
                                                             "reason": reason}, inserted=True)
        self.data_version = store.data_version()
