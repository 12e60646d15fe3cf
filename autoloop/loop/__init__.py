"""The research loop itself: one run from its opening to its close.

`controller.py` opens and closes a run and carries each trial from proposal to decision to
git; `run.py` is the loop over several workers (one thread per trial in flight);
`scheduler.py` picks the next work item from the db, `prefetch.py` prepares the next
proposal while a trial trains, `lock.py` keeps one loop per working tree, and `faults.py`
names the points where tests inject crashes. Import from the modules themselves: the
controller pulls in git, the store and the measurement code, which this package's import
must not.
"""
