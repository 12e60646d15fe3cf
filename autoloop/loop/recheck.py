"""The determinism re-check of a keep candidate under --no-verify.

With verification on, every run of a keep candidate is evaluated again in fresh processes
(val, held-out, probes: autoloop.loop.compare.verify_keep), and a figure the re-evaluation
does not reproduce ends the trial. That re-evaluation is also what catches a model that
remembers the windows it was shown (its first evaluation 3.85, its second 3.04, its
probes passed: a remembered window replays its outputs). --no-verify skips held-out and
trusts the script's own evaluation, so a remembering model, or a script that printed a
number of its own, would be kept on a figure nobody reproduced. This keeps the one cheap
part: each run of a keep candidate is evaluated once more by the harness (val and its
probes, with power for the first run: one evaluation per run; the baseline, the user's
own script, is not) and must give the figure it was measured at (autoloop.measure.measurer.verify, heldout=False).

A run that saved no checkpoint cannot be evaluated again: --no-verify does not require one
(a third-party script's result JSON is enough), so its figure stays the script's own,
shown as unverified, as before. docs/verification.md says so.
"""

from __future__ import annotations

import time
from pathlib import Path

from autoloop.measure.run_folder import RunFolder
from autoloop.store import Kind
from autoloop.loop.host import TrialHost


def recheck_keep(c: TrialHost, slot, trial: dict, fields: dict) -> tuple[bool | None, str | None] | None:
    """(ok, reason) of the first run that failed the re-check (ok None: the worker was
    lost), or None when every run reproduced its figure. `fields` gets verify_seconds."""
    if trial["kind"] == Kind.BASELINE.value:
        return None
    started = time.monotonic()
    first = True
    for row in c.store.measurements(trial["id"]):
        if row.get("role") != "candidate" or row.get("status") != "ok" or row.get("metric") is None:
            continue
        if not row.get("log_path") or not RunFolder(Path(row["log_path"]).parent).has_checkpoint():
            continue  # nothing to evaluate again: the script's own figure, unverified
        ok, reason, _ = c.measurer.verify(trial, trial, row, slot=slot, heldout=False, power=first)
        first = False
        fields["verify_seconds"] = time.monotonic() - started
        if not ok:
            return ok, reason
    return None
