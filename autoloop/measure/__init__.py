"""One measurement of a commit: a training run (or an evaluation) and what it produced.

`measurer.py` is the controller's half (the slot, the db seal, the measurements row);
`job.py` is the plain-JSON boundary (`MeasureJob` in, `JobResult` out); `worker.py` is the
worker's half (`python -m autoloop.measure.worker`: no db, no git, no controller object);
`runner.py` runs a child process with a deadline and no survivor; `sandbox.py` is the
bubblewrap policy; `executors/` says where measurements run (one slot per device). Import
from the modules: the worker process imports only what it needs.
"""
