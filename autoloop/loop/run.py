"""The loop over several workers: one thread per trial in flight, each bound to a slot.

`Controller.run` hands over to `ParallelLoop` when the executor has workers (local, ray).
Each trial still runs the sequential `Controller.execute` (measure as often as its
decision needs, verify, finish), in its own thread and on its own slot, so the decision
code is the one the serial loop runs. The controller process stays the only writer of
the db (the Store serialises its connection) and of git refs (a lock around commits,
finishes and checkouts); workers only train and evaluate.

The main thread fills free slots from the scheduler and waits for any trial to end:

* nothing new starts while the baseline or a circuit-breaker re-run is in flight: every
  later trial needs its answer;
* in *shared* mode every slot trains proposals from the one best commit; a trial that
  beats its incumbent after another trial was kept is not kept over the newer best: the
  controller discards it with that reason and re-queues its edit on the new best when it
  still applies (`Controller._stale_keep`);
* in *islands* mode slot k advances lineage `w<k>` (branch `autoloop/<tag>-w<k>`); every
  `migrate_every` finished trials the best lineage's incumbent is adopted by the lineages
  it beats (`Controller.migrate`);
* a pause (the harness changed, a drift, a full disk) or a stop lets the trials in flight
  end, then ends the loop;
* an error in a trial's thread stops the others (they end `interrupted`) and is raised.
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from autoloop.store import Kind, RunStatus, Status

WAIT_SECONDS = 1.0


class SharedDisplay:
    """The console for several trials at once: one line per event, no live progress line."""

    def __init__(self, display):
        self.display = display
        self.lock = threading.Lock()

    def say(self, message: str, style: str | None = None) -> None:
        with self.lock:
            self.display.say(message, style)

    def trial_started(self, trial: dict, best, config) -> None:
        worker = trial.get("worker") or "?"
        with self.lock:
            self.display.say(f"[{worker}] trial {trial['number']} training: {trial.get('description') or trial['kind']}")

    def poll(self, progress_path) -> None:
        """Several trials train at once: their progress lines would interleave."""

    def trial_finished(self, trial: dict) -> None:
        with self.lock:
            self.display.trial_finished(trial)


class ParallelLoop:
    def __init__(self, controller, executor):
        self.c = controller
        self.executor = executor
        self.slots = list(executor.slots)
        self.inflight: dict[Future, tuple[object, object]] = {}
        self.pause_reason: str | None = None

    def run(self, summary, started: float) -> None:
        c = self.c
        if c.display is not None and not isinstance(c.display, SharedDisplay):
            c.display = SharedDisplay(c.display)
        c.load_requeued()
        free = list(self.slots)
        stopping = False
        error: BaseException | None = None
        pool = ThreadPoolExecutor(max_workers=len(self.slots), thread_name_prefix="autoloop-worker")
        try:
            while True:
                if not stopping and error is None:
                    stopping = self._fill(free, pool, summary, started)
                if not self.inflight:
                    break
                done, _ = wait(list(self.inflight), timeout=WAIT_SECONDS, return_when=FIRST_COMPLETED)
                for future in done:
                    slot, item = self.inflight.pop(future)
                    free.append(slot)
                    free.sort(key=self.slots.index)
                    try:
                        trial = future.result()
                    except BaseException as exc:  # noqa: BLE001 - raised once the others have stopped
                        if error is None:
                            error = exc
                            c.abort_requested = True
                        continue
                    summary.trials_run += 1
                    c.scheduler.observe(trial)
                    c.after_parallel_trial(trial)
        finally:
            if error is not None or c.abort_requested:
                c.abort_requested = True
            pool.shutdown(wait=True)
        if error is not None:
            raise error
        if self.pause_reason is not None:
            summary.stop_reason = f"paused: {self.pause_reason}"
            summary.paused = True
            c.store.update_run(c.run_row["id"], status=RunStatus.PAUSED, pause_reason=self.pause_reason)
            c._event("paused", self.pause_reason)

    def _busy_ids(self) -> set[int]:
        return set(self.c.trials_in_flight())

    def _fill(self, free: list, pool, summary, started: float) -> bool:
        """Start trials on free slots; True once nothing more may start (stop or pause)."""
        c = self.c
        while free:
            reason = c._stop_reason(started, summary.trials_run + len(self.inflight))
            if reason:
                summary.stop_reason = reason
                return True
            if self.inflight and self._blocking():
                return False
            slot = free[0]
            lineage = c.lineage_of(slot)
            item = c._integrity_pause() or c.scheduler.next_item(lineage=lineage, busy=self._busy_ids())
            if item is None:
                if not self.inflight:
                    summary.stop_reason = c.scheduler.exhausted_reason
                    return True
                return False
            if item.kind == "pause":
                self.pause_reason = item.reason
                return True
            free.pop(0)
            future = pool.submit(c.execute_on, slot, item, lineage)
            self.inflight[future] = (slot, item)
        return False

    def _blocking(self) -> bool:
        """A trial in flight whose answer every next trial needs: the baseline (the first
        incumbent) or a circuit-breaker re-run (is the machine broken?)."""
        for _, item in self.inflight.values():
            if item.kind in ("baseline", "rerun") or item.trial_kind in (Kind.BASELINE, Kind.RERUN):
                return True
        store = self.c.store
        return not any(t["status"] == Status.KEEP.value for t in store.trials(self.c.run_row["id"], kind=Kind.BASELINE))
