"""Notifications: `autoloop run --notify CMD` runs your command on the night's events.

Events (the `event` field of the JSON):

* `keep`: a proposal was kept (adopted: the branch moved);
* `confirmed`: a kept proposal whose decision says its gain is confirmed (the decision
  record's `"confirmed": true`), sent instead of `keep`;
* `paused`: the run paused (a full disk, a large drift, the harness changed, ...);
* `worker_lost`: a worker died under a trial (its process, a Ray node); the trial is
  interrupted and its idea re-queued;
* `end`: the run ended (finished, stopped, interrupted, or an error), with the reason.

How the command runs, and why it can never hurt the run:

* through `/bin/sh -c CMD` (so `"$WEBHOOK_URL"` and pipes work), in its own process
  group, with the event as one line of JSON on stdin and, for one-liners, the
  `AUTOLOOP_EVENT` and `AUTOLOOP_MESSAGE` environment variables. Text from trials (a
  description an LLM wrote) only ever arrives as data, never inside the command line:
  quote `"$AUTOLOOP_MESSAGE"`;
* on one background thread, one event at a time, from a bounded queue (`QUEUE_SIZE`):
  the loop only enqueues, so a slow command never slows it; when the queue is full the
  event is dropped and counted;
* with a bounded time (`notify_timeout`, 10 s by default): then its whole process group
  is killed;
* a failure (exit status, timeout, a command that does not start) is logged once, to the
  console and as a `notify_failed` event in experiments.db; later ones are only counted,
  and the count is said at the end of the run. The run goes on in every case;
* at the end of the run, the queue gets `close()`'s time to drain (at most one timeout
  per event still queued, and `DRAIN_SECONDS` in all); what is left is dropped.

The JSON also carries `text` (the same line as `message`) so that Slack- and
Mattermost-style incoming webhooks take it as it is:
`--notify 'curl -sf -H "Content-Type: application/json" -d @- "$WEBHOOK_URL"'`.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
from collections.abc import Callable

from autoloop.store import utcnow
from autoloop.base.processes import kill_group

QUEUE_SIZE = 100
DEFAULT_TIMEOUT = 10.0
DRAIN_SECONDS = 30.0
CHANGE_KINDS = ("proposal", "repair")  # a keep of these moved the branch (the baseline is the start)
_STOP = object()


def _fmt(value, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def _one_line(text, limit: int = 200) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


class Notifier:
    """The user's notify command, fed from a bounded queue by one background thread.

    `Notifier(None)` (no command configured) does nothing and starts no thread.
    `on_failure(message)` is called once, from the background thread, on the first failure.
    """

    def __init__(self, command: str | None, *, timeout: float = DEFAULT_TIMEOUT, tag: str = "",
                 on_failure: Callable[[str], None] | None = None):
        self.command = command.strip() if command and command.strip() else None
        self.timeout = float(timeout)
        self.tag = tag
        self.on_failure = on_failure
        self.failures = 0
        self.dropped = 0
        self.sent = 0
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_SIZE)
        self._current: subprocess.Popen | None = None  # the command running now (killed by close if late)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the thread's start and the counters
        self._closed = False

    @property
    def enabled(self) -> bool:
        return self.command is not None

    # -- what the loop calls ------------------------------------------------------------

    def emit(self, event: str, message: str, **fields) -> None:
        """Queue one event; never blocks, never raises."""
        if self.command is None or self._closed:
            return
        from autoloop.base.text import strip_controls_in

        # A trial's text reaches the user's command and, through it, their terminal or chat.
        payload = strip_controls_in({"event": event, "run": self.tag, "message": _one_line(message, 500),
                                     "time": utcnow(), **fields})
        payload["text"] = payload["message"]
        try:
            self._start()
            self._queue.put_nowait(payload)
        except queue.Full:
            with self._lock:
                self.dropped += 1
        except Exception:  # noqa: BLE001 - a notification is never a reason for the loop to fail
            with self._lock:
                self.dropped += 1

    def trial_finished(self, trial: dict) -> None:
        """`keep` or `confirmed` for a kept proposal (see the module docstring)."""
        try:
            if self.command is None or trial.get("status") != "keep" or trial.get("kind") not in CHANGE_KINDS:
                return
            decision = trial.get("decision")  # decoded: the trial's row as the Store reads it
            confirmed = isinstance(decision, dict) and decision.get("confirmed") is True
            event = "confirmed" if confirmed else "keep"
            what = "kept, gain confirmed" if confirmed else "kept"
            delta = trial.get("delta")
            self.emit(event, f"autoloop {self.tag}: trial {trial['number']} {what}: "
                             f"{_one_line(trial.get('description'), 120)} (val_bpb {_fmt(trial.get('metric'))}, "
                             f"{_fmt(delta, '+.4f')})",
                      trial=trial["number"], description=trial.get("description"), metric=trial.get("metric"),
                      metric_sd=trial.get("metric_sd"), n_runs=trial.get("n_runs"), delta=delta,
                      best_before=trial.get("best_before"), commit=trial.get("trial_commit"),
                      worker=trial.get("worker"))
        except Exception:  # noqa: BLE001
            pass

    def event(self, kind: str, message: str, trial: int | None = None) -> None:
        """A run event the controller logged: a pause becomes `paused`."""
        if kind == "paused":
            self.emit("paused", f"autoloop {self.tag} paused: {_one_line(message, 300)}", reason=message, trial=trial)

    def worker_lost(self, worker: str | None, trial: dict, reason: str | None) -> None:
        self.emit("worker_lost", f"autoloop {self.tag}: worker {worker or '?'} lost during trial "
                                 f"{trial.get('number')}: {_one_line(reason, 200)}",
                  worker=worker, trial=trial.get("number"), reason=reason)

    def run_ended(self, summary, error: BaseException | None = None) -> None:
        """`end`, unless the run paused (`paused` said so already)."""
        try:
            if self.command is None or getattr(summary, "paused", False):
                return
            if error is not None and not isinstance(error, (KeyboardInterrupt, SystemExit)):
                reason = f"error: {type(error).__name__}: {_one_line(error, 200)}"
            else:
                reason = summary.stop_reason or "ended"
            best = getattr(summary, "best_metric", None)
            base = getattr(summary, "baseline_metric", None)
            from autoloop.decide.figures import baseline_to_best, pair_text

            pair = baseline_to_best(base, best, getattr(summary, "headline", None))
            self.emit("end", f"autoloop {self.tag} ended ({reason}): {summary.trials_run} trial(s) this time, "
                             + (pair_text(pair) if pair else f"baseline {_fmt(base)} -> best {_fmt(best)}"),
                      reason=reason, trials_run=summary.trials_run, kept=getattr(summary, "kept", None),
                      best_metric=best, baseline_metric=base, best_commit=getattr(summary, "best_commit", None),
                      statuses=dict(getattr(summary, "statuses", {}) or {}))
        except Exception:  # noqa: BLE001
            pass

    def close(self, drain_seconds: float = DRAIN_SECONDS) -> str | None:
        """Let queued events go out (bounded), stop the thread; returns a line about
        failures and drops worth saying, or None."""
        self._closed = True
        thread = self._thread
        if thread is not None:
            try:
                self._queue.put(_STOP, timeout=1.0)
            except queue.Full:
                pass
            budget = min(drain_seconds, self.timeout * (self._queue.qsize() + 1) + 1.0)
            thread.join(budget)
            current = self._current
            if thread.is_alive() and current is not None:
                kill_group(current)  # out of time: no command outlives the run
        with self._lock:
            problems = []
            if self.failures > 1:
                problems.append(f"{self.failures} notifications failed")
            if self.dropped:
                problems.append(f"{self.dropped} were dropped (the command was too slow)")
        return ("notify: " + "; ".join(problems)) if problems else None

    # -- the background thread ------------------------------------------------------------

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="autoloop-notify", daemon=True)
                self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            problem = self._deliver(item)
            if problem is None:
                with self._lock:
                    self.sent += 1
                continue
            with self._lock:
                self.failures += 1
                first = self.failures == 1
            if first and self.on_failure is not None:
                try:
                    self.on_failure(f"notify command failed on a '{item['event']}' event ({problem}); the run goes on, "
                                    "and later failures are only counted")
                except Exception:  # noqa: BLE001
                    pass

    def _deliver(self, payload: dict) -> str | None:
        """Run the command once for `payload`; None when it succeeded, else why not."""
        data = (json.dumps(payload, default=str, allow_nan=False) + "\n").encode()
        env = {**os.environ, "AUTOLOOP_EVENT": str(payload["event"]), "AUTOLOOP_MESSAGE": payload["message"]}
        try:
            proc = subprocess.Popen(["/bin/sh", "-c", self.command], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, env=env, start_new_session=True, close_fds=True)
        except OSError as exc:
            return f"it did not start: {exc}"
        self._current = proc
        try:
            _, err = proc.communicate(data, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return f"still running after {self.timeout:g} s (notify_timeout), killed"
        except (BrokenPipeError, OSError):
            # It exited without reading stdin (notify-send does not): its status decides.
            try:
                proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                return f"still running after {self.timeout:g} s (notify_timeout), killed"
            err = b""
        finally:
            self._current = None
        if proc.returncode != 0:
            lines = (err or b"").decode(errors="replace").strip().splitlines()
            return f"exit status {proc.returncode}" + (f": {_one_line(lines[-1], 160)}" if lines else "")
        return None


def notifier_for(config, on_failure: Callable[[str], None] | None = None) -> Notifier:
    """The run's Notifier from its config (`notify`, `notify_timeout`)."""
    return Notifier(getattr(config, "notify", None), timeout=getattr(config, "notify_timeout", DEFAULT_TIMEOUT),
                    tag=getattr(config, "tag", ""), on_failure=on_failure)
