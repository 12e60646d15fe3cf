"""The rung's runs: every (arm, seed) pair the rung still lacks, on the run's slots.

autoloop.review.ladder decides which runs a rung needs (seed by seed, so an interrupted
rung has balanced pairs) and what each one means (an arm that failed, the slowdown from
the baseline's first run, an interruption); this module only says where they train:

* **serial** (the run's executor is `serial`, or a `--ladder-every` rung inside a serial
  night): one run at a time on the controller's own slot, in the queue's order.
* **on the workers** (`--workers N`, `--executor ray`): the executor the run's config names
  is built (`make_executor`, as `Controller.run` builds it; a night's own is used when the
  controller already holds one) and the queue goes to all its slots at once: each slot
  takes the next run when it is free, in a thread of its own, as the loop's trial threads
  do (autoloop.loop.run). A thread only measures (`Controller.measure_commit` on its slot's
  context: the Measurer writes the row, the Store serialises its connection, and no slot
  moves a git ref); the main thread alone hands out runs and reads each result back, so
  the rung's bookkeeping needs no lock of its own. A failed run marks its arm failed and
  the runs of other arms go on; an interruption (Ctrl-C, a run aborted) or an error starts
  nothing new and lets the runs in flight end (each is recorded, so a resume trains only
  the rest). The executor built here is closed when the rung ends, whatever ended it.

Slots of different GPU models (`--allow-mixed-devices`) would pair a seed's runs across
devices; the rung then uses only the slots of the kind most of them have.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager

from autoloop.base.faults import fault_point
from autoloop.loop.host import TrialHost

WAIT_SECONDS = 1.0


@contextmanager
def rung_slots(controller: TrialHost, say):
    """The slots the rung's runs go to (None: the serial slot, one run at a time). An
    executor built here is the controller's for the rung (so `concurrent_trials` is true
    while its runs train) and is closed afterwards."""
    if controller.executor is not None:  # a night's own workers (a rung inside a parallel night): never a second set
        yield _one_kind(controller.executor.slots, say)
        return
    if controller.config.executor == "serial":
        yield None
        return
    from autoloop.measure.executors import make_executor

    executor = make_executor(controller)
    controller.executor = executor
    try:
        slots = _one_kind(executor.slots, say)
        say(f"the ladder's runs go to {len(slots)} {controller.config.executor} workers at once "
            f"({', '.join(f'{s.name} on {s.device}' for s in slots)})")
        yield slots
    finally:
        controller.executor = None
        executor.close()


def _one_kind(slots: list, say) -> list:
    kinds = Counter(slot.device for slot in slots)
    if len(kinds) <= 1:
        return list(slots)
    kind = kinds.most_common(1)[0][0]
    say(f"the workers have different devices ({', '.join(sorted(kinds))}): the ladder pairs each seed's runs on "
        f"one kind, so its runs go only to the {kinds[kind]} on {kind}")
    return [slot for slot in slots if slot.device == kind]


def measure_runs(controller: TrialHost, slots: list | None, queue: list, *, skip, record, role: str) -> None:
    """Train each (arm, seed) of `queue` (arm: autoloop.review.ladder.Arm, measured). `skip(arm)`:
    True once its arm has failed. `record(arm, seed, measurement)` reads a run back in the
    main thread and returns True when the rung must start nothing more (interrupted)."""
    if not slots:
        for arm, seed in queue:
            if skip(arm):
                continue
            m = controller.measure_commit(arm.sha, seed, owner=arm.trial, role=role)
            fault_point("between_measurements")  # a run recorded, the rung asks for another
            if record(arm, seed, m):
                return
        return
    _on_workers(controller, slots, deque(queue), skip=skip, record=record, role=role)


def _on_workers(controller: TrialHost, slots: list, pending: deque, *, skip, record, role: str) -> None:
    from autoloop.loop.run import SharedDisplay

    incumbent = controller.islands.incumbent(None)  # for the live display only, as the serial slot shows it
    contexts = {slot.name: dataclasses.replace(controller.context(slot), incumbent=incumbent) for slot in slots}
    display = controller.display
    if display is not None and not isinstance(display, SharedDisplay):
        controller.display = SharedDisplay(display)  # several runs' progress lines, each named by its worker
    free = list(slots)
    inflight: dict = {}
    stopping = False
    error: BaseException | None = None
    pool = ThreadPoolExecutor(max_workers=len(slots), thread_name_prefix="autoloop-ladder")
    try:
        while True:
            while free and pending and not stopping:
                arm, seed = pending.popleft()
                if skip(arm):
                    continue
                slot = free.pop(0)
                # The row as the measurer reads it, named by the worker for the console's lines.
                owner = {**arm.trial, "worker": slot.name}
                future = pool.submit(controller.measure_commit, arm.sha, seed, owner=owner, role=role,
                                     ctx=contexts[slot.name])
                inflight[future] = (slot, arm, seed)
            if not inflight:
                break
            done, _ = wait(list(inflight), timeout=WAIT_SECONDS, return_when=FIRST_COMPLETED)
            for future in done:
                slot, arm, seed = inflight.pop(future)
                free.append(slot)
                free.sort(key=slots.index)
                try:
                    m = future.result()
                except BaseException as exc:  # noqa: BLE001 - raised once the runs in flight have ended
                    error = error or exc
                    stopping = True
                    continue
                try:
                    fault_point("between_measurements")  # a run recorded, the rung asks for another
                    if record(arm, seed, m):
                        stopping = True
                except BaseException as exc:  # noqa: BLE001 - the same: the others end first
                    error = error or exc
                    stopping = True
    finally:
        pool.shutdown(wait=True)
        controller.display = display
    if error is not None:
        raise error
