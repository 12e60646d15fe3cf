"""Fault injection: make the controller die at a named point, to test crash recovery.

`AUTOLOOP_FAULT=after_commit` kills the controller with SIGKILL the first time it reaches
that point; `AUTOLOOP_FAULT=after_commit:3` the third time. SIGKILL, not an exception:
nothing gets to clean up, exactly as in a power cut or an OOM kill.

`AUTOLOOP_FAULT=enospc@after_commit` (or `enospc@after_commit:3`) raises
`OSError(ENOSPC, "No space left on device")` there instead: the disk filling up at that
point, which the controller must report as a full disk and pause on.
"""

from __future__ import annotations

import errno
import os
import signal

ENV_FAULT = "AUTOLOOP_FAULT"

POINTS = (
    "after_row",  # the trial row is written, nothing committed yet
    "after_commit",  # the proposal's commit exists, the branch has not moved
    "during_training",  # the training process group is running and recorded
    "after_training",  # training finished, no decision recorded
    "between_measurements",  # a measurement of a trial is recorded, its decision asks for another
    "during_reset",  # decision recorded, git archive/reset half done
)

_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get(ENV_FAULT, "")
    if not spec:
        return
    target, _, nth = spec.partition(":")
    kind, _, point = target.rpartition("@")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] != int(nth or 1):
        return
    if kind == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (AUTOLOOP_FAULT at {name})")
    os.kill(os.getpid(), signal.SIGKILL)
