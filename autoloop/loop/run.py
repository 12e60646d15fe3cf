"""The one loop: fill free slots from the scheduler, wait for a trial to end, repeat.

`Controller.run` opens the run and hands it to `Loop`. The loop's slots are the
executor's workers (local, ray: one thread per trial in flight) or, with the serial
executor, one inline slot whose trial runs in the main thread itself, start to end,
before the loop looks again. Either way each trial runs the same code
(`Controller.execute` with its `TrialContext`, autoloop.loop.trial), and stops and pauses
are decided here only, before each work item:

* a stop (`stop_reason`): Ctrl-C, `--max-trials` (counting the trials in flight),
  `autoloop stop`, `--hours` (no trial starts that could not finish in time, with the
  reserve's runs at the end: autoloop.loop.reserve), `--max-cost` (no trial starts that
  would take the night's model tokens and GPU time past it: autoloop.loop.cost);
* a pause (`next_pause`): one a trial asked for (a full disk, a large drift), taken first
  whatever else would stop the run; the harness or the data changed under the run (the
  verifier's check, then what a worker found); or the scheduler's own (the baseline
  fails, the incumbent fails on re-run, workers keep getting lost);
* nothing new starts while the baseline, a circuit-breaker re-run or a drift check is in
  flight: every later trial needs its answer;
* a stop or a pause lets the trials in flight end, then ends the loop; the pause is
  recorded on the run;
* an error in a trial's thread stops the others (they end `interrupted`) and is raised;
  with the inline slot it is raised at once.

The controller process stays the only writer of the db (the Store serialises its
connection) and of git refs (`Controller.refs_lock`); workers only train and evaluate.
What trials share across threads is owned by one object with a lock that says what it
guards: `Pauses` below, autoloop.loop.noise's `NoiseEstimate`, autoloop.loop.islands'
`Requeue`, `SharedDisplay`.
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from autoloop.errors import AutoloopError
from autoloop.loop import cost, reserve
from autoloop.loop.scheduler import BLOCKING, Work, WorkItem
from autoloop.store import Kind, RunStatus, Status
from autoloop.loop.host import TrialHost

WAIT_SECONDS = 1.0


class Pauses:
    """Pauses asked for between work items: by a trial (a full disk, a large drift) and by a
    measurement whose worker found the harness or data changed. `lock` guards both: trial
    threads set them, the loop takes them before its next item."""

    def __init__(self):
        self.lock = threading.Lock()
        self._requested: str | None = None
        self._from_worker: str | None = None

    def request(self, reason: str) -> None:
        """Pause before the next work item, whatever else would stop the run (the latest wins)."""
        with self.lock:
            self._requested = reason

    def from_worker(self, reason: str) -> None:
        """A worker's alarm: taken after the verifier's own check (the first one is kept)."""
        with self.lock:
            if self._from_worker is None:
                self._from_worker = reason

    def requested(self) -> bool:
        with self.lock:
            return self._requested is not None

    def take_requested(self) -> str | None:
        with self.lock:
            reason, self._requested = self._requested, None
            return reason

    def take_from_worker(self) -> str | None:
        with self.lock:
            reason, self._from_worker = self._from_worker, None
            return reason


class SharedDisplay:
    """The console for several trials at once: one line per event, and each trial's plain
    progress lines (autoloop.loop.progress.PlainProgress), named by its worker; no live line."""

    def __init__(self, display):
        self.display = display
        self.lock = threading.Lock()  # one line at a time, and the trials' progress below
        self._progress: dict[int, object] = {}  # trial id -> its running run's PlainProgress

    def say(self, message: str, style: str | None = None) -> None:
        with self.lock:
            self.display.say(message, style)

    def trial_started(self, trial: dict, best, config, *, seed: int | None = None, role: str | None = None,
                      owner: dict | None = None) -> None:
        from autoloop.loop.progress import PlainProgress

        worker = trial.get("worker") or "?"
        with self.lock:
            self.display.say(f"[{worker}] trial {trial['number']} training: {trial.get('description') or trial['kind']}"
                             + run_words(trial, seed, role, owner))
            self._progress[trial["id"]] = PlainProgress(f"[{worker}] trial {trial['number']}", config,
                                                        self.display.plain_every)

    def poll(self, progress_path, trial: dict | None = None) -> None:
        """Several trials train at once: plain lines, each naming its worker and trial."""
        with self.lock:
            progress = self._progress.get(trial["id"]) if trial is not None else None
            line = progress.line(progress_path) if progress is not None else None
            if line is not None:
                self.display.say(line)

    def trial_finished(self, trial: dict) -> None:
        with self.lock:
            self._progress.pop(trial["id"], None)
            self.display.trial_finished(trial)


class InlinePool:
    """The serial executor's one slot: `submit` runs the trial now, in this (the main) thread,
    and hands back its finished future; an error is raised at once."""

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        future.set_result(fn(*args))
        return future

    def shutdown(self, wait: bool = True) -> None:
        pass


class Loop:
    def __init__(self, controller: TrialHost, slots: list, *, threaded: bool):
        self.c = controller
        self.slots = list(slots)
        self.threaded = threaded
        self.inflight: dict[Future, tuple[object, WorkItem]] = {}
        self.pause_reason: str | None = None
        # The outage a model-only night is waiting out (a `wait` item): a stop meanwhile names it.
        self.waiting_for: str | None = None
        # The user ended the night (Ctrl-C, `autoloop stop`): a flag, never read back out of a
        # reason's words, which can quote a model server's error text.
        self.user_stopped = False

    def run(self, summary, started: float) -> None:
        c = self.c
        if self.threaded and c.display is not None and not isinstance(c.display, SharedDisplay):
            c.display = SharedDisplay(c.display)
        c.requeue.load()
        free = list(self.slots)
        stopping = False
        error: BaseException | None = None
        if self.threaded:
            pool = ThreadPoolExecutor(max_workers=len(self.slots), thread_name_prefix="autoloop-worker")
        else:
            pool = InlinePool()
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
                    c.islands.after_trial(trial)
                    self.ladder_after_keep(trial)
        finally:
            if error is not None or c.abort_requested:
                c.abort_requested = True
            pool.shutdown(wait=True)
        summary.stopped = summary.stopped or self.user_stopped
        if error is not None:
            raise error
        if self.pause_reason is not None:
            summary.stop_reason = f"paused: {self.pause_reason}"
            summary.paused = True
            c.store.update_run(c.run_row["id"], status=RunStatus.PAUSED, pause_reason=self.pause_reason)
            c.event("paused", self.pause_reason)

    def ladder_after_keep(self, trial: dict) -> None:
        """`--ladder-every K`: after the K-th, 2K-th, ... kept change of a serial run, the
        ladder measures the new best at its rung (nothing else is in flight then). A rung
        that fails is an event; the night goes on."""
        c = self.c
        every = getattr(c.config, "ladder_every", 0) or 0
        if c.ladder_hook is None or every <= 0 or self.threaded or c.abort_requested \
                or trial.get("status") != Status.KEEP.value or trial.get("kind") == Kind.BASELINE.value:
            return
        kept = len([t for t in c.store.trials(c.run_row["id"], status=Status.KEEP.value)
                    if t["kind"] != Kind.BASELINE.value])
        if kept % every:
            return
        try:
            c.ladder_hook(c)
        except AutoloopError as exc:
            c.event("ladder", f"the ladder after trial {trial['number']} failed: {exc}")
            c.say(f"the ladder after trial {trial['number']} failed: {exc}", "yellow")

    def _busy_ids(self) -> set[int]:
        """The trials in flight that the scheduler could offer to resume (only trials of an
        earlier invocation are resumed, and only through a RESUME item)."""
        return {item.derived_from for _, item in self.inflight.values() if item.kind is Work.RESUME}

    def _fill(self, free: list, pool, summary, started: float) -> bool:
        """Start trials on free slots; True once nothing more may start (stop or pause)."""
        c = self.c
        while free:
            reason = self.stop_reason(started, summary.trials_run + len(self.inflight))
            if reason:
                summary.stop_reason = f"{reason}; meanwhile {self.waiting_for}" if self.waiting_for else reason
                return True
            if self.inflight and self._blocking():
                return False
            slot = free[0]
            lineage = c.islands.lineage_of(slot)
            item = self.next_pause() or c.scheduler.next_item(lineage=lineage, busy=self._busy_ids())
            if item is None:
                if not self.inflight:
                    summary.stop_reason = c.scheduler.exhausted_reason
                    return True
                return False
            if item.kind is Work.PAUSE:
                self.pause_reason = item.reason
                return True
            self.waiting_for = item.reason if item.kind is Work.WAIT else None
            if item.kind is Work.WAIT:
                if self.inflight:
                    return False  # the trials in flight end first; the scheduler is asked again then
                reason = self.wait_for_model(item, started, summary.trials_run)
                if reason:
                    summary.stop_reason = reason
                    return True
                continue
            free.pop(0)
            self.inflight[pool.submit(c.execute, item, c.context(slot, item, lineage))] = (slot, item)
        return False

    def _blocking(self) -> bool:
        """A trial in flight whose answer every next trial needs: the baseline (the first
        incumbent), a circuit-breaker re-run (is the machine broken?) or a drift check."""
        for _, item in self.inflight.values():
            if item.kind in BLOCKING or item.trial_kind in (Kind.BASELINE, Kind.RERUN):
                return True
        store = self.c.store
        return not any(t["status"] == Status.KEEP.value for t in store.trials(self.c.run_row["id"], kind=Kind.BASELINE))

    # ------------------------------------------------------------------ stops and pauses

    def stop_reason(self, started: float, trials_run: int) -> str | None:
        c = self.c
        cfg = c.config
        if c.pauses.requested():
            return None  # the pause (a full disk, a drift) is recorded first, whatever else would stop the run
        if c.abort_requested:
            self.user_stopped = True
            return "interrupted (Ctrl-C)"
        if cfg.max_trials is not None and trials_run >= cfg.max_trials:
            return f"reached --max-trials {cfg.max_trials}"
        if c.store.stop_requested(c.run_row["id"]):
            self.user_stopped = True
            return "stopped by `autoloop stop`"
        if cfg.hours is not None:
            left = started + cfg.hours * 3600 - time.time()
            # the headline's runs and the ladder's (`--ladder`: a run per worker at a time) come after
            ladder = reserve.ladder_seconds_needed(c, workers=len(self.slots))
            if left < self.trial_estimate() + reserve.seconds_needed(c) + ladder:
                return f"--hours {cfg.hours}: the next trial could not finish in the {max(left, 0) / 60:.1f} min left"
        if cfg.max_cost is not None:  # tokens and GPU time (autoloop.loop.cost)
            # the headline's runs and the ladder's are paid for like trials
            return cost.cap_reason(c.store, c.run_row, cfg, self.trial_estimate(),
                                   reserve.seconds_needed(c) + reserve.ladder_seconds_needed(c))
        return None

    def wait_for_model(self, item: WorkItem, started: float, trials_run: int) -> str | None:
        """Nothing to propose but a model that is away: sleep until its next try, looking at
        the stops as usual (Ctrl-C, `autoloop stop`, --hours); a stop names the outage too."""
        while time.time() < (item.wait_until or 0.0):
            reason = self.stop_reason(started, trials_run)
            if reason or self.c.pauses.requested():
                return f"{reason}; meanwhile {item.reason}" if reason else None
            time.sleep(min(WAIT_SECONDS, max(0.0, (item.wait_until or 0.0) - time.time())))
        return None

    def trial_estimate(self) -> float:
        """The median wall time of a recent trial, every run it took (its own and the
        incumbent's re-measurements) counted."""
        c = self.c
        walls = []
        for t in c.store.trials(c.run_row["id"], last=20):
            runs = [m.get("wall_seconds") or 0.0 for m in c.store.measurements_for(t["id"])]
            wall = sum(runs) if runs else t.get("wall_seconds")
            if wall:
                walls.append(wall)
        if walls:
            return statistics.median(walls)
        return c.config.time_budget + 30.0

    def next_pause(self) -> WorkItem | None:
        """A pause when the disk filled up, a drift check found a large shift, or the harness
        or the data changed under the run (autoloop.trust.watch, or a worker's own check)."""
        c = self.c
        requested = c.pauses.take_requested()
        if requested:
            return WorkItem(Work.PAUSE, reason=requested)
        check = getattr(c.verifier, "check_run", None)
        reason = check(c) if check is not None else None
        from_worker = c.pauses.take_from_worker()
        return WorkItem(Work.PAUSE, reason=reason or from_worker) if (reason or from_worker) else None


def run_words(trial: dict, seed: int | None, role: str | None, owner: dict | None) -> str:
    """' | candidate at seed 1338', ' | the incumbent (trial 1) at seed 1339, to pair with it':
    which run of a trial this is ('' when the caller does not say)."""
    if seed is None and role is None:
        return ""
    where = f" at seed {seed}" if seed is not None else ""
    if owner is not None and owner.get("id") != trial.get("id"):
        return f" | the incumbent (trial {owner['number']}){where}, to pair with it"
    what = {"drift": "the incumbent again", "rerun": "the incumbent again"}
    return f" | {what.get(role or '', role or 'run')}{where}"
