"""The research loop itself: one run from its opening to its close.

`controller.py` opens and closes a run and executes its work items; `run.py` is the one
loop (the executor's slots, or the serial one inline), where stops and pauses are decided;
`trial.py` is one trial from proposal to decision to git, on the `TrialContext` it is
given; `scheduler.py` picks the next work item from the db; `islands.py` (lineages,
re-queued edits), `noise.py`, `recovery.py`, `disk.py`, `environment.py` and `preflight.py`
are one concern each; `prefetch.py` prepares the next proposal while a trial trains,
`lock.py` keeps one loop per working tree, and `faults.py` names the points where tests
inject crashes. Import from the modules themselves: the controller pulls in git, the store
and the measurement code, which this package's import must not.
"""
