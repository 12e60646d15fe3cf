"""Where measurements run: an executor is a set of slots, one per device.

The controller runs one thread per trial in flight, each on a slot (its TrialContext's); the trial's
measurements (training runs and evaluations) go through that slot as `MeasureJob`s and
come back as `JobResult`s (autoloop.measure.job). A slot never touches the db or git refs: the
controller records what it returns. Three executors:

* `serial` (the default): one slot that runs jobs in this process, in the project folder;
* `local`: one slot per GPU of this machine (or `workers` pretend devices on a CPU), each
  with its own git worktree and `CUDA_VISIBLE_DEVICES`, running every job in a worker
  process (`python -m autoloop.measure.worker`) so that a killed worker loses one trial, not the run;
* `ray`: one slot per GPU of a Ray cluster (autoloop.measure.executors.ray, the `[ray]` extra).

Slot interface (duck-typed): `name`, `device` (the GPU model, or "cpu"; comparisons pair
runs on the same kind), `moves_branch` (optional, False by default: True only for the
serial slot, whose training runs on the run's own branch in the project folder, so the
branch follows each trial), `project_dir` (where training runs; None for a remote worker),
`device_env` (environment that pins the device), `prepare(commit)` (make the project
folder hold `commit`'s files), `run(job, run_dir, on_start=None, should_abort=None) ->
JobResult`, `close()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autoloop.errors import AutoloopError
from autoloop.measure.measurer import MeasureHost


@dataclass
class Executor:
    kind: str
    slots: list = field(default_factory=list)
    closer: object = None  # what close() calls last (the Ray connection)

    def close(self) -> None:
        for slot in self.slots:
            try:
                slot.close()
            except Exception:  # noqa: BLE001 - one slot's cleanup must not stop the others'
                pass
        if self.closer is not None:
            self.closer()

    def devices(self) -> list[str]:
        return [slot.device for slot in self.slots]


def check_devices(executor: Executor, allow_mixed: bool) -> None:
    """Trials on different GPU models are not comparable in time mode (a faster GPU buys
    more steps): refused unless the user allows it."""
    kinds = sorted(set(executor.devices()))
    if len(kinds) > 1 and not allow_mixed:
        raise AutoloopError(
            f"the workers have different devices ({', '.join(kinds)}): their val_bpb is not comparable; use one "
            "GPU model (CUDA_VISIBLE_DEVICES, or Ray resources), or pass --allow-mixed-devices to compare each "
            "candidate only with the incumbent measured on the same kind"
        )


def make_executor(controller: MeasureHost) -> Executor:
    """The executor the controller's config asks for (serial: None, the controller's own slot)."""
    cfg = controller.config
    if cfg.executor == "local":
        from autoloop.measure.executors.local import local_slots

        executor = Executor("local", local_slots(controller, cfg.workers))
    elif cfg.executor == "ray":
        try:
            from autoloop.measure.executors.ray import RayExecutor
        except ImportError as exc:
            raise AutoloopError(f"--executor ray needs Ray ({exc}): pip install -e '.[ray]'") from exc
        # The project folder: a job sends its commit's tracked files, so modules train.py imports reach the node.
        ray = RayExecutor(address=cfg.ray_address, workers=cfg.workers or None, repo_dir=controller.project_dir)
        executor = Executor("ray", list(ray.slots), ray.close)
    else:
        raise AutoloopError(f"executor = {cfg.executor!r} is not one of serial, local, ray: fix the setting")
    check_devices(executor, cfg.allow_mixed_devices)
    return executor
