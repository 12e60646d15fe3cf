"""The worker's half of the early stop: a candidate's progress lines read as they come,
and the night's rule asked whether it is a clear loser (autoloop.decide.early_stop).

The controller puts the rule in the job (`MeasureJob.early_stop`: {"rule":
StopRule.to_json(), "incumbent_curve": [...]}, autoloop.loop.stops) only for a
candidate's first run, and only once the night has pairs enough to calibrate it. While
the run trains, `StopWatch` is polled with the runner's abort check: at most every
`every` seconds, and only when the progress file grew, it reads the file's readable
records (as untrusted data: autoloop.trust.untrusted, no links, capped, numbers checked),
keeps them by step, and calls `should_stop`. When the answer is yes the runner stops the
training process group as for an abort, and the job ends with status "stopped", the
reason naming the checkpoint, and `fields["stopped_at"]` the progress it reached. A job
without a rule, or with one this worker cannot read (another autoloop version), is never
stopped.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from autoloop.decide.early_stop import StopRule, should_stop


class StopWatch:
    def __init__(self, rule: StopRule, incumbent_curve: list[dict], progress: Path, *, every: float = 0.5):
        self.rule = rule
        self.incumbent_curve = list(incumbent_curve or [])
        self.progress = Path(progress)
        self.every = every
        self.stopped = False
        self.why: str | None = None
        self.reached: float | None = None
        self._points: dict = {}
        self._size = -1
        self._last = 0.0

    @classmethod
    def from_job(cls, job, progress: Path) -> StopWatch | None:
        payload = getattr(job, "early_stop", None)
        if not isinstance(payload, dict):
            return None
        try:
            rule = StopRule.from_json(payload["rule"])
        except (KeyError, TypeError, ValueError):
            return None  # a rule this autoloop cannot read: never stop rather than guess
        curve = payload.get("incumbent_curve")
        if not rule.active or not isinstance(curve, list):
            return None
        return cls(rule, curve, progress)

    def wrap(self, abort: Callable[[], bool]) -> Callable[[], bool]:
        """The runner's should_abort: the caller's abort first, then the early stop."""
        return lambda: abort() or self()

    def __call__(self) -> bool:
        if self.stopped:
            return True
        now = time.monotonic()
        if now - self._last < self.every:
            return False
        self._last = now
        try:
            size = os.lstat(self.progress).st_size
        except OSError:
            return False
        if size == self._size:
            return False
        self._size = size
        from autoloop.trust.untrusted import progress_records

        for record in progress_records(self.progress):
            self._points[(record.get("step"), record.get("progress"))] = record  # re-read lines count once
        stop, why, reached = should_stop(self.rule, self.incumbent_curve, list(self._points.values()))
        self.reached = reached
        if stop:
            self.stopped, self.why = True, why
        return stop
