"""The pre-night check: `autoloop check` on a new run's train.py, before the baseline.

A model that cannot overfit one batch has a bug, and the night should not be spent on
it. The check (autoloop.check: overfit one batch, the LR range test, the budget plan) runs
in a process of its own, the way a user runs it, and stores its result on the run: the
search proposer and the LLM brief read the LR range test from there. A failed check stops
the run with the check's own message; `--no-check` skips it.

The check takes a minute or two, and the user may change their mind meanwhile: it runs in
a process group of its own, and the controller polls its Ctrl-C flag while it waits, so
one Ctrl-C ends the whole group at once and the run stops the usual way (the loop sees
the flag before the baseline). A second Ctrl-C (KeyboardInterrupt) ends it too.
"""

from __future__ import annotations

import subprocess
import sys

from autoloop.errors import AutoloopError
from autoloop.base.processes import kill_group
from autoloop.loop.host import TrialHost

POLL_SECONDS = 0.2


def needed(c: TrialHost) -> bool:
    """A new run's own train.py, with the check on and the real verifier."""
    if not c.config.check or c.verifier is None or c.run_row.get("check_result") is not None \
            or c.store.trials(c.run_row["id"], last=1):
        return False
    script = c.train_script()
    return script is not None and script.name == "train.py" and script.parent == c.project_dir


def command(c: TrialHost) -> list[str]:
    cfg = c.config
    argv = [sys.executable, "-m", "autoloop", "check", "--repo", str(c.project_dir), "--tag", c.tag,
            "--db", str(c.db_path()), "--parts", "overfit,lr,budget", "--time-budget", str(cfg.time_budget)]
    if cfg.max_steps:
        argv += ["--max-steps", str(cfg.max_steps)]
    if cfg.hours:
        argv += ["--hours", str(cfg.hours)]
    if cfg.dataset:
        argv += ["--dataset", cfg.dataset]
    return argv


def check_before_the_night(c: TrialHost) -> None:
    """Run the check if this run needs it; raise AutoloopError if it fails. Returns early
    (nothing stored, the next start checks again) when the user stopped the run meanwhile."""
    if not needed(c):
        return
    c.say("checking train.py before the night: overfit one batch, LR range test, budget plan (--no-check skips)")
    proc = subprocess.Popen(command(c), cwd=c.project_dir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        while True:
            if c.abort_requested:
                kill_group(proc, reap_seconds=10)
                c.say("the check before the night was stopped (Ctrl-C)", "yellow")
                return
            try:
                stdout, stderr = proc.communicate(timeout=POLL_SECONDS)
                break
            except subprocess.TimeoutExpired:
                continue
    except BaseException:  # a second Ctrl-C, or anything else: the check must not outlive us
        kill_group(proc, reap_seconds=10)
        raise
    for line in stdout.splitlines():
        c.say(f"  {line}")
    c.run_row = c.store.get_run(c.tag)
    if proc.returncode != 0:
        result = c.run_row.get("check_result") or {}
        failed = [part.get("message") for part in result.values()
                  if isinstance(part, dict) and part.get("status") == "fail" and part.get("message")]
        tail = "; ".join(failed) or (stderr.strip().splitlines() or stdout.strip().splitlines() or ["no output"])[-1]
        c.event("check_failed", tail)
        raise AutoloopError(f"`autoloop check` failed before the baseline: {tail} (fix train.py, or run with "
                            "--no-check to start anyway)")


