"""How long an idle OpenMP thread spins before it sleeps, for every process of ours.

torch's CPU build runs its intra-op threads on GNU OpenMP, whose idle threads spin for
GOMP_SPINCOUNT (300,000) iterations at every barrier before they sleep. On a quiet
machine that is free. On a busy one it is a trap: when both threads of a step land on a
core a burner shares, each barrier spins out its time slice while the thread it waits for
cannot run. Measured on a 2-core VM beside two `while True: pass` burners (train.py's
real CPU step, 150 steps; `python bench/openmp_spin.py`): at GNU's default the steps took
109-209 s in three tries, with 2-21 of them over 4x the median (up to 5.7 s against
0.7 s) in phases of a dozen steps, each charged as much CPU as wall time; at 10,000 they
took 66-70 s in two, none over 4x the median, and their CPU time was the work's. Quiet,
the step is the same (0.16-0.17 s either way); at 1,000 it is 0.22 s, and with
OMP_WAIT_POLICY=PASSIVE 0.26 s.

That spinning is not only slow: CPU time inflated by it is what made the budget's tail
rules (autoloop.trust.budget) take an honest last step for hidden training.

The count changes when a thread sleeps, never what it computes: the numbers are the same.
A user who set their own OpenMP wait policy keeps it.
"""

from __future__ import annotations

import os
from typing import Mapping, MutableMapping

SPINCOUNT = "10000"
# Any of these set by the user is their choice of how OpenMP threads wait.
USER_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def openmp_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """What to add to a process's environment `environ` (empty when the user chose)."""
    if any(name in environ for name in USER_SETTINGS):
        return {}
    return {"GOMP_SPINCOUNT": SPINCOUNT}


def apply_openmp_defaults(environ: MutableMapping[str, str] | None = None) -> None:
    """Set the defaults in `environ` (ours by default) before torch is imported: GNU
    OpenMP reads them once, when it is loaded."""
    environ = os.environ if environ is None else environ
    environ.update(openmp_defaults(environ))
