"""The status vocabulary of a run: what one process ended as, and what a measurement is.

A measurement's status: ok | crash | timeout | invalid | aborted (the user stopped it) |
lost (its worker died: a process, a Ray node) | stopped (the early stop ended a clear
loser's run: autoloop.loop.stops). How each ends the trial is
`autoloop.measure.measurer.trial_status`; docs/architecture.md names them all
(tests/test_docs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MEASUREMENT_STATUSES = ("ok", "crash", "timeout", "invalid", "aborted", "lost", "stopped")


@dataclass
class RunOutcome:
    """What happened to one training process.

    status: "ok" (exit 0 with a finite val_bpb, or under AUTOLOOP_EVAL=external with a
    result JSON and no val_bpb), "crash", "timeout", "aborted", or "invalid" (exit 0 with
    a result JSON that is not one: a link, too big, malformed, a figure out of range;
    autoloop.trust.untrusted).
    metric: val_bpb when finite, else None. metric_source: "harness" (result JSON) or
    "reported" (printed block), None without a metric (except an external-eval "ok":
    "harness", metric None whatever the JSON says). reason: one line, None when ok.
    result: the parsed result JSON, or the parsed summary block, or None.
    """

    status: str
    returncode: int | None
    result: dict[str, Any] | None
    metric: float | None
    metric_source: str | None
    reason: str | None
    error_tail: str
    wall_seconds: float
    pid: int
    pgid: int
    start_time: int | None = None
    limit: str | None = None  # the limit it went over (autoloop.measure.limits); status "invalid"
    resources: dict | None = None  # the peaks the resource watch saw: memory, processes, disk, files
