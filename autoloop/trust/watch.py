"""The harness watch: the harness and the data stay what they were when the run began.

The controller holds one `Verifier` (the default; `Controller(verifier=None)` turns all
of this off, for tests with fake scripts). It owns the run's reference fingerprints:

* `check_run(controller)` before each work item: the harness, its bytecode and the
  prepared data are still what they were when this invocation started (and, at the first
  call, the data splits still match the hashes recorded when they were prepared). A
  difference pauses the run with the changed files named. The first call also writes the
  harness's bytecode in both prefixes from a trusted process (autoloop.trust.bytecode),
  so an honest trial adds none.
* `harness_fingerprint`: the harness a run's report must name; it goes into each
  `MeasureJob`, with `harness_dir`, `python` and `pycache_root()`.
* `refresh_bytecode(controller)`: a worker found planted harness bytecode, removed it and
  wrote it again (autoloop.measure.worker); the reference takes the fresh bytecode.

Around each training run the worker half of the measurement (autoloop.measure.worker, which
may run in another process or on another machine) takes the integrity snapshots and
applies the rules (autoloop.trust.integrity). A keep candidate is verified there too: its
checkpoint is evaluated again in a fresh, sandboxed process (`verify` jobs,
autoloop.measure.evaluation.evaluate_checkpoint), and the controller decides again on the
verified value (`Controller` and `Measurer.verify`).

Which trials can be verified:
* metric_source `reported` (a third-party script: no result JSON, only the printed
  block): nothing to rebuild, so the keep stays `reported` and is shown as unverified
  everywhere; the controller never compares such a metric with a verified one.
* a result JSON (the harness contract) but no checkpoint, no `build_model`, or a train
  command that names no .py file: `invalid`. A script that claims the contract is held
  to it; silently trusting its number would defeat the check.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Protocol

from autoloop.trust import integrity



class WatchedRun(Protocol):
    """What the Verifier reads from the run it watches (autoloop.loop.controller.Controller)."""

    @property
    def tag(self) -> str: ...  # the run's name, in a pause reason
    def data_dir(self) -> Path: ...  # the prepared dataset whose files are fingerprinted

class Verifier:
    """The run's reference fingerprints of the harness and the data, checked before every work item."""

    def __init__(self, harness_dir: Path | str | None = None, python: str | None = None, *,
                 cache_root: Path | str | None = None):
        # The harness the training processes import; the default is the one this process
        # imports (tests point it at a copy so that a trial may tamper with it safely).
        self.harness_dir = Path(harness_dir) if harness_dir is not None else integrity.harness_dir()
        self.python = python or sys.executable
        # The cache holding the bytecode prefixes (None: the harness's cache root).
        self.cache_root = Path(cache_root) if cache_root is not None else None
        self._reference: integrity.Snapshot | None = None
        self._harness_fingerprint: str | None = None

    def pycache_root(self) -> Path:
        """The cache holding the bytecode prefixes (autoloop.trust.bytecode.pycache_env)."""
        if self.cache_root is not None:
            return self.cache_root
        from autoloop.harness.contract import cache_root

        return cache_root()

    def pycache_prefixes(self) -> list[Path]:
        """The bytecode prefixes autoloop's children use (training's and the evaluator's)."""
        from autoloop.trust.bytecode import PYCACHE_KINDS, pycache_dir

        return [pycache_dir(kind, self.pycache_root()) for kind in PYCACHE_KINDS]

    def snapshot(self, controller: WatchedRun) -> integrity.Snapshot:
        return integrity.take_snapshot(self.harness_dir, controller.data_dir(), pycache_prefixes=self.pycache_prefixes())

    def check_run(self, controller: WatchedRun) -> str | None:
        """A pause reason if the harness or the data changed since this invocation began."""
        now = self.snapshot(controller)
        if self._reference is None or self._reference.data_dir != now.data_dir:
            problems = integrity.dataset_problems(controller.data_dir()) + integrity.bytecode_problems(self.harness_dir)
            if problems:
                return integrity.describe_pause(problems, controller.tag)
            from autoloop.trust.bytecode import PYCACHE_KINDS, warm_pycache

            for kind in PYCACHE_KINDS:
                # The harness's bytecode in both prefixes, written by a trusted process now, so
                # an honest trial adds none and the snapshot below treats any change as tampering.
                warm_pycache(kind, self.python, self.pycache_root())
            if not sys.dont_write_bytecode:
                # Current bytecode now, so a training process that writes bytecode beside the
                # sources (no PYTHONPYCACHEPREFIX) finds nothing to write: an honest trial never
                # shows up as "harness bytecode added".
                integrity.precompile_harness(self.harness_dir)
            now = self.snapshot(controller)
            self._reference = now
            from autoloop.harness import compute_harness_fingerprint

            self._harness_fingerprint = compute_harness_fingerprint(self.harness_dir)
            return None
        found = integrity.changes(self._reference, now)
        return integrity.describe_pause(found, controller.tag) if found else None

    @property
    def harness_fingerprint(self) -> str | None:
        """The harness's fingerprint when this invocation began (None before `check_run`):
        a run's report naming another harness is invalid (it goes into each MeasureJob)."""
        return self._harness_fingerprint

    def refresh_bytecode(self, controller: WatchedRun) -> None:
        """A run's planted bytecode was removed and written again by the trusted warm-up
        (autoloop.measure.worker): the reference takes the fresh bytecode, so the next `check_run`
        compares with what the runs after it will find, and the run goes on."""
        if self._reference is not None:
            import dataclasses

            fresh = self.snapshot(controller)
            self._reference = dataclasses.replace(self._reference, bytecode=fresh.bytecode)
