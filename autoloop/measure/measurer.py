"""One measurement: a training run of one commit at one seed, its budget checked and its
val_bpb computed by the harness, recorded as a `measurements` row.

A trial owns several measurements (the candidate at several seeds; the incumbent's
re-measurements are rows of the incumbent's trial, with `for_trial_id` naming the
comparison that asked for them). `autoloop.decide.rule` reads them; the controller is the only
writer. A measurement has two halves; this module is the controller's:

1. The slot the run goes to (an argument: the trial's, autoloop.loop.outcome.TrialContext;
   the serial slot, or one worker per device when trials run side by side,
   autoloop.measure.executors) checks the commit out (serial: in the project folder, as by
   hand).
2. What decides is sealed (`autoloop.trust.seal.StoreSeal`): a training run that writes to
   experiments.db is caught, and the sealed values are put back.
3. A `MeasureJob` (autoloop.measure.job) carries everything the worker half needs, and the slot
   runs it (`autoloop.measure.worker.run_job`): the trusted data feed, the sandbox, training in its
   own process group, the harness and data compared with their state before the run, the
   budget checked on the feed's figures, val_bpb from the harness's evaluator in its own
   sandboxed process (`verify=True` adds causality and the held-out split). The worker
   answers with a `JobResult`.
4. Here again: the files a remote worker sent back are written into the run folder, the
   seal is checked, and the measurement is recorded with the device it ran on. A worker
   that died ("lost") leaves a `lost` row; the trial ends interrupted, its idea goes back
   to the queue. A harness or data change the worker found pauses the run
   (`MeasureHost.worker_pause`), as the verifier's own check does.

What a Measurer reads from the run it measures for is `MeasureHost` below (the controller
is the one implementation); what one measurement is about comes as arguments: the commit,
the seed, the trial that owns the row (`owner`), the trial whose comparison it serves
(`running`), and the slot it runs on. Nothing depends on the calling thread.

A script that does not follow the harness contract (no result JSON, only a printed
block) is measured as before: its printed number is `reported`, never compared with
harness numbers. Without a verifier (`Controller(verifier=None)`, tests with fake
scripts) the result JSON's own val_bpb is the metric (`harness`).
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from autoloop.base import faults
from autoloop.errors import AutoloopError
from autoloop.measure.job import JobResult, MeasureJob
from autoloop.measure.limits import TrialLimits
from autoloop.measure.run_folder import RunFolder
from autoloop.base.status import RunOutcome
from autoloop.store import Status

if TYPE_CHECKING:
    from autoloop.config import Config
    from autoloop.gitops import GitRepo
    from autoloop.store import Store
    from autoloop.trust.watch import Verifier

# A measurement's status: autoloop.base.status.MEASUREMENT_STATUSES. How each ends the trial
# is `trial_status`.
_OWN_RUN_ENDS = {"aborted": Status.INTERRUPTED, "lost": Status.INTERRUPTED, "timeout": Status.TIMEOUT,
                 "invalid": Status.INVALID, "stopped": Status.DISCARD}


def trial_status(status: str, *, own: bool = True) -> Status:
    """The status a trial ends with when one of its measurements did not succeed: the one
    mapping of measurement statuses onto `Status`.

    A run of the trial's own code (`own`) that timed out or was invalid is the trial's
    fault; aborted or lost is not (`interrupted`: its idea goes back to the queue); a run
    stopped early as a clear loser is discarded (never kept, no metric); any other failure
    is a crash. A failed re-measurement of the incumbent is never the
    candidate's timeout or invalidity: a crash of the comparison, unless aborted or lost.
    """
    if not own:
        return Status.INTERRUPTED if status in ("aborted", "lost") else Status.CRASH
    return _OWN_RUN_ENDS.get(status, Status.CRASH)


@dataclass
class Measurement:
    """What one training run of one commit at one seed gave."""

    id: int | None
    seed: int
    role: str
    status: str  # ok | crash | timeout | invalid | aborted | lost | stopped
    reason: str | None
    metric: float | None
    metric_source: str | None
    run_dir: Path
    outcome: RunOutcome | None = None
    fields: dict = field(default_factory=dict)  # for the trial row: timings, steps, tokens, ...
    result: dict | None = None
    heldout: float | None = None
    device: str | None = None  # "cpu" or the CUDA device's name
    machine_speed: float | None = None  # the speed probe's mean reading around training (autoloop.measure.probe)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def checkpoint(self) -> Path:
        return RunFolder(self.run_dir).checkpoint


class MeasureHost(Protocol):
    """What a Measurer and the executors' slots read from the run they measure for
    (autoloop.loop.controller.Controller; the loop's wider view is autoloop.loop.host.TrialHost).

    Attributes are read when used, not copied: the run row, the display and the abort flag
    change while a run goes on. Members set by the run's `open()` are None before it.
    """

    config: Config  # the budget, train command, sandbox, verify, dataset
    store: Store | None  # the measurements rows, the trial's process group
    run_row: dict | None  # the run: its id, base commit, data fingerprint
    repo: GitRepo | None  # the project's repository (a worker's worktree is made from it)
    verifier: Verifier | None  # the harness's reference fingerprints (None: no harness rules, tests' fakes)
    display: Any  # live progress: trial_started, poll
    notifier: Any  # autoloop.loop.notify.Notifier: `run --notify`, the user's command on the night's events
    abort_requested: bool  # Ctrl-C: the run in flight is stopped
    project_dir: Path  # the project folder: its secret files are hidden from the trial

    @property
    def tag(self) -> str: ...  # the run's name
    @property
    def state_dir(self) -> Path: ...  # .autoloop/ of the project, hidden from the trial
    def trial_dir(self, number: int) -> Path: ...  # a trial's folder; its runs go under runs/<k>
    def db_path(self) -> Path: ...  # experiments.db, hidden from the trial
    def git_dir(self) -> Path: ...  # hidden from the trial
    def data_dir(self) -> Path: ...  # the prepared dataset
    def sources_of(self, commit: str) -> tuple[str, dict[str, str]]: ...  # what the evaluator imports
    def best_commit(self) -> str: ...  # the run's best commit (its base before a keep)
    def checkout_for_measurement(self, commit: str) -> None: ...  # the serial slot's checkout of a commit
    def say(self, message: str, style: str | None = None) -> None: ...  # one console line
    def event(self, kind: str, message: str, trial_id: int | None = None) -> None: ...  # a db event, notified
    def training_started(self, running: dict) -> None: ...  # the scheduler prepares the next proposal
    def worker_pause(self, reason: str) -> None: ...  # a worker found the harness or data changed
    def concurrent_trials(self) -> bool: ...  # several workers: a foreign db write is nobody's in particular


class Measurer:
    """Runs measurements for the run it is given (a `MeasureHost`)."""

    def __init__(self, host: MeasureHost):
        self.c = host
        self._run_dirs_lock = threading.Lock()  # guards: allocating runs/<k> folders (run_dir)
        self._sandbox = None
        self._secret_files: list[Path] | None = None  # found once per run: the sandbox hides them

    # ------------------------------------------------------------------ set-up

    @property
    def sandbox(self):
        """The sandbox policy of this run (autoloop.measure.sandbox), detected once."""
        if self._sandbox is None:
            from autoloop.measure.sandbox import detect

            self._sandbox = detect(self.c.config.sandbox)
        return self._sandbox

    def describe_sandbox(self) -> str:
        return self.sandbox.describe()

    @property
    def harness_mode(self) -> bool:
        """The sandbox, the data feed and the seals apply (the real verifier is on)."""
        return self.c.verifier is not None

    @property
    def external_eval(self) -> bool:
        """val_bpb comes from the harness's evaluator, and training sees no split. Off with
        --no-verify: the script's own number is then trusted (and shown as unverified)."""
        return self.harness_mode and self.c.config.verify

    def run_dir(self, owner: dict) -> Path:
        """A new folder for one run of `owner`: runs/<k>, k past every run recorded and every
        folder there. Two workers may measure one trial at once (the incumbent re-measured
        for two candidates): each gets its own folder, made under the lock, never one the
        other is training in. A folder left by a run the controller did not live to record
        is left as it is."""
        runs = self.c.trial_dir(owner["number"]) / "runs"
        with self._run_dirs_lock:
            runs.mkdir(parents=True, exist_ok=True)
            taken = [int(p.name) for p in runs.iterdir() if p.name.isdigit()]
            k = 1 + max([len(self.c.store.measurements(owner["id"])), *taken])
            path = runs / str(k)
            path.mkdir()
            return path

    def _hidden(self) -> list[Path]:
        """What no stage of a trial sees: .git, .autoloop, the db, the embedded corpus's key (with
        it, val is rebuilt: autoloop/harness/corpus_key.py), and the project's files that hold
        secrets by convention (.env, keys, credentials: autoloop.base.redact)."""
        from autoloop.harness.corpus_key import corpus_key_path
        from autoloop.base.redact import secret_files

        c = self.c
        db = c.db_path()
        hidden = [c.git_dir(), c.state_dir, db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm"),
                  corpus_key_path().parent]
        if self._secret_files is None:
            self._secret_files = secret_files(c.project_dir)
        return hidden + self._secret_files

    # ------------------------------------------------------------------ the job

    def job(self, kind: str, commit: str, seed: int, *, role: str, slot, verify: bool = False, **extra) -> MeasureJob:
        """Everything the worker half needs for one run of `commit` (autoloop.measure.job)."""
        c = self.c
        verifier = c.verifier
        try:
            script, sources = c.sources_of(commit)
        except AutoloopError:
            if self.external_eval:
                raise  # the evaluator needs the script (as it always did)
            script, sources = None, {}
        pycache_root = getattr(verifier, "pycache_root", None)
        from autoloop.harness.contract import cache_root

        return MeasureJob(
            kind=kind, commit=commit, seed=seed, role=role, tag=c.tag, script=script, sources=sources,
            train_argv=c.config.train_argv(), time_budget=c.config.time_budget, max_steps=c.config.max_steps,
            grace_seconds=self._grace(), dataset=c.config.dataset, data_dir=str(c.data_dir()),
            data_fingerprint=(c.run_row or {}).get("data_fingerprint"),
            harness_fingerprint=getattr(verifier, "harness_fingerprint", None),
            harness_mode=self.harness_mode, external_eval=self.external_eval, verify=verify,
            sandbox=c.config.sandbox,
            harness_dir=str(verifier.harness_dir) if getattr(verifier, "harness_dir", None) else None,
            pycache_root=str(pycache_root()) if pycache_root is not None else None,
            integrity_python=getattr(verifier, "python", None), cache_root=str(cache_root()),
            compile_seed=str(c.state_dir / c.tag / "compile-seed"), python=sys.executable,
            hidden=[str(p) for p in self._hidden()], db_path=str(c.db_path()),
            env=dict(getattr(slot, "device_env", None) or {}), startup_reference=self._startup_reference(),
            limits=TrialLimits.from_config(c.config).to_dict(), **extra,
        )

    def _startup_reference(self) -> dict | None:
        """The run's baseline start-up, what the budget allows before a first batch (autoloop.trust.startup)."""
        c = self.c
        if c.run_row is None or c.store is None:
            return None
        from autoloop.trust.startup import startup_reference

        return startup_reference(c.store, c.run_row["id"])

    def _grace(self) -> float:
        """The configured grace, or in step mode what runs of this run took (autoloop.measure.deadline)."""
        from autoloop.measure.deadline import grace_for, run_walls

        c = self.c
        if c.config.max_steps is None or c.run_row is None or c.store is None:
            return c.config.grace_seconds
        run = c.store.get_run(c.tag) or c.run_row
        return grace_for(time_budget=c.config.time_budget, grace_seconds=c.config.grace_seconds,
                         max_steps=c.config.max_steps, check_result=run.get("check_result"),
                         walls=run_walls(c.store, run["id"]))

    def _received(self, result: JobResult, run_dir: Path) -> None:
        """What a worker on another disk sent back goes into the run folder before anything
        reads it; a harness the run repaired or changed is the controller's business too."""
        for name, content in (result.files or {}).items():
            target = (run_dir / name).resolve()
            if not target.is_relative_to(run_dir.resolve()):
                continue  # never outside the run folder
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        if result.repaired:
            refresh = getattr(self.c.verifier, "refresh_bytecode", None)
            if refresh is not None:
                refresh(self.c)
        if result.pause:
            self.c.worker_pause(result.pause)

    # ------------------------------------------------------------------ one run

    def measure(self, commit: str, seed: int, *, owner: dict, role: str, running: dict, slot,
                best_metric: float | None = None, verify: bool = False,
                early_stop: dict | None = None) -> Measurement:
        """Train `commit` at `seed` on `slot` and evaluate it; record the measurement on `owner`.

        `running`: the trial whose comparison this run serves (the row that holds the
        process group while it trains, so recovery can kill it). `best_metric`: its
        incumbent's, for the live display. `early_stop`: the job's early-stop rule
        (autoloop.loop.stops.EarlyStops.payload), None for a run that is never stopped.

        A run that only the budget's load-sensitive rules fail (autoloop.trust.budget) is
        recorded as it was, and the seed is measured once more in a fresh run: that run is
        the measurement. A trial that trains where the budget does not look fails both.
        """
        m = self._measure_once(commit, seed, owner=owner, role=role, running=running, slot=slot,
                               best_metric=best_metric, verify=verify, early_stop=early_stop)
        from autoloop.trust.budget import load_sensitive

        if m.status != "invalid" or not load_sensitive(m.fields.get("budget")) or self.c.abort_requested:
            return m
        message = (f"trial {running['number']}: its run at seed {seed} failed a budget rule a busy machine can trip "
                   f"({m.reason}); measuring it once more at that seed")
        self.c.event("remeasured", message, trial_id=running["id"])
        self.c.say(message, "yellow")
        again = self._measure_once(commit, seed, owner=owner, role=role, running=running, slot=slot,
                                   best_metric=best_metric, verify=verify, early_stop=early_stop)
        if again.status == "invalid" and load_sensitive(again.fields.get("budget")):
            again.reason = f"{again.reason} (and so did its first run at this seed: {m.reason})"
            self.c.store.update_measurement(again.id, reason=again.reason)
        return again

    def _measure_once(self, commit: str, seed: int, *, owner: dict, role: str, running: dict, slot,
                      best_metric: float | None, verify: bool, early_stop: dict | None) -> Measurement:
        c = self.c
        store = c.store
        run_dir = self.run_dir(owner)
        slot.prepare(commit)
        log_path = run_dir / "train.log"
        store.update_trial(running["id"], log_path=str(log_path), heartbeat_at=_now())
        seal = None
        if self.harness_mode:
            from autoloop.trust.seal import StoreSeal

            seal = StoreSeal.capture(store, c.run_row["id"])
        job = self.job("train", commit, seed, role=role, slot=slot, verify=verify, early_stop=early_stop)
        if c.display is not None:
            c.display.trial_started(running, best_metric, c.config, seed=seed, role=role, owner=owner)
        trained = [False]

        def on_start(pid: int, pgid: int, start_time: int | None) -> None:
            store.update_trial(running["id"], pid=pid, pgid=pgid, pid_start_time=start_time)
            if not trained[0]:  # the training process (the evaluation's start comes after)
                trained[0] = True
                faults.fault_point("during_training")
                c.training_started(running)  # the next proposal is prepared while this trial trains

        last_beat = [time.monotonic()]

        def should_abort() -> bool:
            if c.display is not None:
                c.display.poll(RunFolder(run_dir).progress, running)
            if time.monotonic() - last_beat[0] > 30:
                last_beat[0] = time.monotonic()
                store.update_trial(running["id"], heartbeat_at=_now())
            return c.abort_requested

        result = slot.run(job, run_dir, on_start=on_start, should_abort=should_abort)
        self._received(result, run_dir)
        faults.fault_point("after_training")
        m = Measurement(None, seed, role, result.status, result.reason, result.metric, result.metric_source, run_dir,
                        None, fields=dict(result.fields), result=result.result, heldout=result.heldout,
                        device=result.device, machine_speed=result.fields.get("machine_speed"))
        m.fields.pop("machine_speed", None)  # the measurement's, not the trial row's
        problem = seal.check(store) if seal is not None else None
        if problem:
            seal.restore(store)
            if c.concurrent_trials():
                # Several trials may have trained meanwhile: which one wrote cannot be told. The
                # values are back; the run pauses for a human rather than failing an honest trial.
                c.worker_pause(f"experiments.db was written by another process while trial {running['number']} and "
                               f"others trained: {problem} (the recorded values were put back; run with the sandbox "
                               "on, which hides the db from every trial)")
            else:
                for name in ("budget", "eval_seconds"):  # the worker went on; the run ended here
                    m.fields.pop(name, None)
                return self._record(owner, running, m, "invalid", f"the trial wrote to experiments.db: {problem} "
                                                                   "(the recorded values were put back)")
        if result.status == "lost":
            c.notifier.worker_lost(getattr(slot, "name", None), running, result.reason)
            return self._record(owner, running, m, "lost", result.reason or "the worker was lost")
        return self._record(owner, running, m, result.status, result.reason)

    def verify(self, owner: dict, running: dict, row: dict, *, slot, heldout: bool = True,
               power: bool = True) -> tuple[bool | None, str | None, float | None]:
        """Held-out and causality for an already measured run (a keep candidate's), on `slot`.
        Returns (ok, reason, heldout) and marks the row verified; ok is None when the
        worker was lost (not the trial's fault: the trial is interrupted).

        Either way this is the determinism re-check: the run's checkpoint evaluated again in
        fresh processes must give the figure it was measured at (a model that remembers
        what it was shown, or a script that printed a number of its own, does not). With
        `heldout` False (--no-verify) only val and its probes are evaluated. A run that
        fails is recorded `invalid` with no metric: its figure is in the reason, never a
        val_bpb. `power`: probes with power (one run of a keep is enough: its code peeks at the
        same positions in every run)."""
        run_dir = Path(row["log_path"]).parent if row.get("log_path") else None
        if run_dir is None or not RunFolder(run_dir).has_checkpoint():
            return False, f"the checkpoint of its run at seed {row.get('seed')} is gone, so it cannot be verified", None
        c = self.c
        # A proposal's keep gets probes with power (autoloop.harness.probe_power), sized by the
        # run's paired noise; the baseline is the user's own script.
        power = power and row.get("role") != "baseline"
        noise = c.noise.current() if power and c.noise is not None else None
        job = self.job("verify", owner["trial_commit"] or c.run_row["base_commit"], int(row.get("seed") or 0),
                       role=row.get("role") or "candidate", slot=slot, verify=heldout,
                       checkpoint=str(RunFolder(run_dir).checkpoint), result=_result_of(run_dir),
                       probe_power=power, probe_noise=noise.pair_sd if noise is not None else None,
                       probe_factor=c.config.probe_factor if power else None)

        def on_start(pid: int, pgid: int, start_time: int | None) -> None:
            c.store.update_trial(running["id"], pid=pid, pgid=pgid, pid_start_time=start_time)

        result = slot.run(job, run_dir, on_start=on_start, should_abort=lambda: c.abort_requested)
        self._received(result, run_dir)
        if result.status == "lost":
            c.notifier.worker_lost(getattr(slot, "name", None), running, result.reason)
            return None, f"the worker was lost during verification: {result.reason}", None
        if power and (result.fields or {}).get("probe_power"):
            from autoloop.harness.probe_power import describe

            c.event("probes", f"trial {running['number']}, seed {row.get('seed')}: "
                              f"{describe(result.fields['probe_power'])}", trial_id=running["id"])
        if not result.ok:
            if result.status == "aborted" or c.abort_requested:
                return False, f"failed verification: {result.reason}", None
            return False, self._failed(row, f"failed verification: {result.reason} (its first evaluation: "
                                            f"val_bpb {_figure(row.get('metric'))})"), None
        from autoloop.decide.heldout import suspicious_identity

        tolerance = recheck_tolerance(row, scripts_own=not self.external_eval)
        if row.get("metric") is not None and abs(result.metric - row["metric"]) > tolerance:
            return False, self._failed(row, (
                f"failed the determinism re-check: its checkpoint evaluated again in fresh processes gave val_bpb "
                f"{result.metric:.6f}, its first evaluation {row['metric']:.6f} (tolerance {tolerance:g}): the "
                "model's outputs are not a function of its inputs (a model that remembers what it was shown), or "
                "the first figure was not the model's")), result.heldout
        odd = suspicious_identity(result.metric, result.heldout)
        if odd:
            return False, odd, result.heldout
        if heldout:
            c.store.update_measurement(row["id"], heldout_metric=result.heldout, verified=1)
        return True, None, result.heldout

    def _failed(self, row: dict, reason: str) -> str:
        """A run whose figure failed verification: `invalid`, its metric NULL (the figure
        stays in the reason), so no table, noise estimate or decision reads it again."""
        self.c.store.update_measurement(row["id"], status="invalid", metric=None, reason=reason)
        return reason

    # ------------------------------------------------------------------ recording

    def _record(self, owner: dict, running: dict, m: Measurement, status: str, reason: str | None) -> Measurement:
        m.status, m.reason = status, reason
        if status != "ok":
            m.metric = m.metric if status == "ok" else None
        figures = m.fields.pop("budget", None)
        # A run trained and verified in one job (the reserve's) brings its held-out bpb with
        # it: recorded as verify() records a later verification, or the headline has none.
        verified = status == "ok" and m.heldout is not None
        m.id = self.c.store.add_measurement(
            owner["id"], m.metric if status == "ok" else None, seed=m.seed, role=m.role,
            heldout_metric=m.heldout if verified else None, verified=1 if verified else 0,
            for_trial_id=running["id"] if running["id"] != owner["id"] else None, status=status, reason=reason,
            num_steps=m.fields.get("num_steps"), total_tokens=m.fields.get("total_tokens"),
            training_seconds=m.fields.get("training_seconds"), wall_seconds=m.fields.get("wall_seconds"),
            eval_seconds=m.fields.get("eval_seconds"), budget=figures, log_path=str(m.run_dir / "train.log"),
            device=m.device, curve=stored_curve((m.result or {}).get("curve")) if status == "ok" else None,
            machine_speed=m.machine_speed, tokens_per_second=_throughput(figures, m.fields),
        )
        if figures is not None:
            m.fields["budget"] = figures
        if m.result and m.result.get("curve") and status == "ok":
            m.fields["curve"] = m.result["curve"]
        return m


# The determinism re-check compares two evaluations of one checkpoint. Two harness
# evaluations run the same batches through the same code: equal to rounding (1e-6). Under
# --no-verify the first figure is the script's own in-process evaluation: the same batches
# and arithmetic on a CPU (equal, tested), but on a GPU possibly a compiled model's bf16
# logits against an eager one's, so 1e-4 bpb there (set from the arithmetic, not yet
# measured on a GPU); a remembering model moved 0.8 bpb.
RECHECK_TOLERANCE = 1e-6
RECHECK_TOLERANCE_SCRIPT_GPU = 1e-4


def recheck_tolerance(row: dict, *, scripts_own: bool) -> float:
    device = str(row.get("device") or "cpu").lower()
    if scripts_own and device != "cpu":
        return RECHECK_TOLERANCE_SCRIPT_GPU
    return RECHECK_TOLERANCE


def _figure(value) -> str:
    return f"{value:.6f}" if isinstance(value, (int, float)) else "none"


CURVE_KEYS = ("step", "seconds", "loss", "lr")
MAX_CURVE_POINTS = 1024  # a result's curve is already thinned to ~256 (train.py) and capped (trust.untrusted)


def _throughput(figures: dict | None, fields: dict) -> float | None:
    """The feed's tokens served per second of training (the script's own count without a feed)."""
    tokens = (figures or {}).get("tokens_served") or fields.get("total_tokens")
    seconds = fields.get("training_seconds")
    return round(tokens / seconds, 1) if tokens and seconds else None


def stored_curve(curve) -> list[dict] | None:
    """A successful run's loss curve as the early stop reads it (autoloop.loop.stops):
    numeric step, seconds, loss and lr only (the curve was checked when the result was read)."""
    if not isinstance(curve, list):
        return None
    out = []
    for point in curve[:MAX_CURVE_POINTS]:
        if not isinstance(point, dict):
            continue
        kept = {k: point[k] for k in CURVE_KEYS
                if isinstance(point.get(k), (int, float)) and not isinstance(point.get(k), bool)}
        if "loss" in kept:
            out.append(kept)
    return out or None


def _result_of(run_dir: Path) -> dict:
    """The run's result JSON, as the trial wrote it (read as untrusted data; {} if unusable)."""
    from autoloop.trust.untrusted import UntrustedFile, clean_result, read_json_object

    folder = RunFolder(run_dir)
    try:
        return clean_result(read_json_object(folder.root, f"{folder.out.name}/{folder.result.name}"))
    except (OSError, UntrustedFile):
        return {}


def _now() -> str:
    from autoloop.store import utcnow

    return utcnow()
