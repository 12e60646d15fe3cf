"""What a trial is given and what it ends with: its context, its outcome, its row's fields.

Shared by the trial's two halves: autoloop.loop.trial (one trial, end to end) and
autoloop.loop.compare (the comparison with the incumbent and the verification of a keep).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autoloop.loop.host import TrialHost
from autoloop.measure.measurer import Measurement, trial_status
from autoloop.measure.run_folder import RunFolder
from autoloop.store import Status


@dataclass(frozen=True)
class TrialContext:
    """Where one trial runs and what it is compared with, passed down to all its code."""

    slot: object  # where its measurements run (autoloop.measure.executors): serial, a worker, a Ray actor
    lineage: str | None = None  # islands mode: the lineage it advances; None: the run's own
    worker: str | None = None  # the worker's name for the trial row (None: the controller's own slot)
    incumbent: dict | None = None  # what it is compared with, read as its measurements begin

    @property
    def moves_branch(self) -> bool:
        """The trial trains in the project folder itself (the serial slot), so the run's
        branch follows it; a worker checks its commit out in a worktree of its own."""
        return bool(getattr(self.slot, "moves_branch", False))

    @property
    def device(self) -> str | None:
        return getattr(self.slot, "device", None)


@dataclass
class TrialOutcome:
    status: Status
    reason: str
    fields: dict  # for the trial row; "curve": the last run's loss curve, stored by finish


def measured_outcome(m: Measurement) -> TrialOutcome | None:
    """The trial's end when a run of its own failed, else None."""
    if m.ok:
        return None
    fields = dict(m.fields)
    fields.pop("curve", None)
    return TrialOutcome(trial_status(m.status), m.reason or m.status, fields)


def interrupted() -> TrialOutcome:
    return TrialOutcome(Status.INTERRUPTED, "interrupted by the user", {})


def trial_fields(c: TrialHost, trial: dict, m: Measurement | None) -> dict:
    """The trial row's fields from its last run (`curve` too, for `finish` to store)."""
    if m is None:
        rows = [r for r in c.store.measurements(trial["id"]) if r.get("status") == "ok"]
        return {"wall_seconds": rows[-1].get("wall_seconds")} if rows else {}
    fields = dict(m.fields)
    fields["checkpoint_path"] = str(m.checkpoint) if m.checkpoint.exists() else None
    if not fields.get("curve"):
        fields.pop("curve", None)
    return fields


def progress_curve(trial: dict, store) -> list[dict] | None:
    """The curve of the trial's last run from its progress lines, for a run that ended
    without a result (a divergence that stopped with FAIL, a crash): the diagnosis reads it.
    The file is the trial's: read as untrusted data (autoloop.trust.untrusted)."""
    from autoloop.trust.untrusted import progress_records

    rows = [r for r in store.measurements(trial["id"]) if r.get("log_path")]
    if not rows:
        return None
    points = [{k: record.get(k) for k in ("step", "loss", "lr", "grad_norm")}
              | {"seconds": record.get("training_seconds")}
              for record in progress_records(RunFolder(Path(rows[-1]["log_path"]).parent).progress)
              if "loss" in record]
    return points or None


def delete_checkpoints(c: TrialHost, trial: dict, keep_last: bool) -> None:
    """Only one checkpoint per kept trial is worth the disk (finalize copies it)."""
    rows = [r for r in c.store.measurements(trial["id"]) if r.get("log_path")]
    keep = Path(rows[0]["log_path"]).parent if (keep_last and rows) else None
    runs = c.trial_dir(trial["number"]) / "runs"
    if not runs.exists():
        return
    for run_dir in runs.iterdir():
        if run_dir != keep:
            RunFolder(run_dir).checkpoint.unlink(missing_ok=True)
