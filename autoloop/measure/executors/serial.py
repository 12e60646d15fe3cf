"""The serial slot: measurements run one at a time, in the controller's process and folder.

What autoloop always did, expressed as a Slot (autoloop.measure.executors): the commit is checked
out in the repository itself (`Controller.checkout_for_measurement`), and `run_job`
(autoloop.measure.worker) runs in this process, so the training process is the controller's own
child and the controller records its process group directly through `on_start`.

`run_training` below is the training runner this slot hands the worker, read at each run:
tests replace `autoloop.measure.executors.serial.run_training` to fake a training run (the
evaluator keeps the real runner).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from autoloop.measure.job import JobResult, MeasureJob
from autoloop.measure.runner import run_training
from autoloop.measure.measurer import MeasureHost


class SerialSlot:
    """One slot, the controller's own folder and devices (no device environment of its own)."""

    name = "serial"
    moves_branch = True  # training runs in the project folder, on the run's branch: it follows each trial

    def __init__(self, controller: MeasureHost):
        self.controller = controller
        self.device_env: dict[str, str] = {}

    @property
    def project_dir(self) -> Path:
        return self.controller.project_dir

    def prepare(self, commit: str) -> None:
        self.controller.checkout_for_measurement(commit)

    def run(self, job: MeasureJob, run_dir: Path, on_start: Callable | None = None,
            should_abort: Callable[[], bool] | None = None) -> JobResult:
        from autoloop.measure.worker import run_job

        result = run_job(job, project_dir=self.project_dir, run_dir=run_dir, on_start=on_start,
                         should_abort=should_abort, runner=run_training)
        result.worker = self.name
        return result

    def close(self) -> None:
        pass
