"""How long a run may take before it is killed, in step mode.

In time mode the budget bounds training, and the grace (`grace-seconds`, 180 s) covers
start-up, compilation and evaluation. In step mode (`--max-steps`) nothing bounds a run's
time but its deadline, and a fixed one fails a sound run on a slow or busy machine: the
README's first command (120 steps) was killed at 300 + 180 s beside another project's
loop, its baseline `timeout`, the run paused. A deadline is there to catch a hang, not a
slow machine, so in step mode it follows what runs of this run took:

* after a run of the run finished (`measurements.wall_seconds` of runs that were ok):
  RUN_SLACK x the slowest of them;
* before any, the pre-run check's estimate of a run (`runs.check_result.budget
  .seconds_per_run`, measured in one process, often on one thread, while the machine was
  as busy as it was then): CHECK_SLACK x that;
* never less than the configured budget + grace, as in time mode.

`grace_for(...)` returns the grace to put in the MeasureJob, so that budget + grace is
that deadline (the evaluator's deadline grows with it).
"""

from __future__ import annotations

RUN_SLACK = 4.0  # a run may take 4x the slowest run so far (a load that doubles, twice)
CHECK_SLACK = 8.0  # the check's estimate was 4x optimistic at load 9 on 2 cores (one thread, 3,958 tok/s)


def grace_for(*, time_budget: float, grace_seconds: float, max_steps: int | None, check_result: dict | None,
              walls: list[float]) -> float:
    """The grace that gives a step-mode run the deadline of the module docstring (the
    configured grace in time mode)."""
    if max_steps is None:
        return grace_seconds
    done = [w for w in walls if w and w > 0]
    if done:
        deadline = RUN_SLACK * max(done)
    else:
        budget = (check_result or {}).get("budget") if isinstance(check_result, dict) else None
        per_run = budget.get("seconds_per_run") if isinstance(budget, dict) else None
        if not isinstance(per_run, (int, float)) or per_run <= 0:
            return grace_seconds
        deadline = CHECK_SLACK * per_run
    return max(grace_seconds, deadline - time_budget)


def run_walls(store, run_id: int) -> list[float]:
    """Wall seconds of the run's training runs that finished ok, of every trial."""
    rows = store.query("SELECT m.wall_seconds FROM measurements m JOIN trials t ON t.id = m.trial_id "
                       "WHERE t.run_id = ? AND m.status = 'ok' AND m.wall_seconds IS NOT NULL", (run_id,))
    return [float(r["wall_seconds"]) for r in rows]  # Store.query: under the store's lock (trials on threads)
