"""One measurement: a training run of one commit at one seed, its budget checked and its
val_bpb computed by the harness, recorded as a `measurements` row.

A trial owns several measurements (the candidate at several seeds; the incumbent's
re-measurements are rows of the incumbent's trial, with `for_trial_id` naming the
comparison that asked for them). `autoloop.decide` reads them; the controller is the only
writer. One measurement, in order:

1. The commit is checked out (training runs in the project folder, as by hand).
2. What decides is sealed (`autoloop.tamper.StoreSeal`): a training run that writes to
   experiments.db is caught, and the sealed values are put back.
3. Training runs in its own process group, sandboxed (`autoloop.sandbox`) where
   bubblewrap works: no network, the repository read-only but for the run folder, the db,
   `.git`, `.autoloop/` and the data splits invisible. Its batches come from the trusted
   feed (`autoloop.harness.feed`) in this process, which serves the train split only and
   measures what the trial draws and when; `AUTOLOOP_EVAL=external` tells train.py to
   save its checkpoint without evaluating.
4. The budget is checked on the feed's figures (`autoloop.budget`); the harness and data
   are compared with their state before the run (`autoloop.verifier`).
5. val_bpb is computed by the harness in a separate, sandboxed process
   (`autoloop.evaluation`) from the checkpoint; `verify=True` adds causality and the
   held-out split (keep candidates).

A script that does not follow the harness contract (no result JSON, only a printed
block) is measured as before: its printed number is `reported`, never compared with
harness numbers. Without a verifier (`Controller(verifier=None)`, tests with fake
scripts) the result JSON's own val_bpb is the metric (`harness`).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from autoloop import faults
from autoloop.runner import RunOutcome, run_training
from autoloop.store import MetricSource

# Per-run fields copied from the result JSON into the measurement and the trial row.
RESULT_FIELDS = ("training_seconds", "total_seconds", "compile_seconds", "eval_seconds", "num_steps",
                 "total_tokens", "num_params", "mfu_percent", "peak_memory_mb")
_INTEGER_FIELDS = ("num_steps", "total_tokens", "num_params")
# The evaluation's deadline: interpreter and torch start-up, model rebuild, one or two
# evaluations, on a slow, shared machine.
EVAL_DEADLINE_FLOOR_SECONDS = 180.0


@dataclass
class Measurement:
    """What one training run of one commit at one seed gave."""

    id: int | None
    seed: int
    role: str
    status: str  # ok | crash | timeout | invalid | aborted
    reason: str | None
    metric: float | None
    metric_source: str | None
    run_dir: Path
    outcome: RunOutcome | None = None
    fields: dict = field(default_factory=dict)  # for the trial row: timings, steps, tokens, ...
    result: dict | None = None
    heldout: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def checkpoint(self) -> Path:
        return self.run_dir / "checkpoint.pt"


class Measurer:
    """Runs measurements for a controller (which owns the store, the repo and the config)."""

    def __init__(self, controller):
        self.c = controller
        self._sandbox = None
        self._said_unsandboxed = False

    # ------------------------------------------------------------------ set-up

    @property
    def sandbox(self):
        """The sandbox policy of this run (autoloop.sandbox), detected once."""
        if self._sandbox is None:
            from autoloop.sandbox import detect

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
        runs = self.c.trial_dir(owner["number"]) / "runs"
        k = 1 + len(self.c.store.measurements(owner["id"]))
        path = runs / str(k)
        if path.exists():
            shutil.rmtree(path)  # left by a run the controller did not live to record
        path.mkdir(parents=True)
        return path

    def _hidden(self) -> list[Path]:
        c = self.c
        db = c.db_path()
        hidden = [c.git_dir(), c.state_dir, db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]
        return hidden

    # ------------------------------------------------------------------ one run

    def measure(self, commit: str, seed: int, *, owner: dict, role: str, running: dict,
                verify: bool = False) -> Measurement:
        """Train `commit` at `seed` and evaluate it; record the measurement on `owner`.

        `running`: the trial whose comparison this run serves (the row that holds the
        process group while it trains, so recovery can kill it).
        """
        c = self.c
        store = c.store
        run_dir = self.run_dir(owner)
        c.checkout_for_measurement(commit)
        log_path = run_dir / "train.log"
        store.update_trial(running["id"], log_path=str(log_path), heartbeat_at=_now())
        env = c.child_env(run_dir, seed)
        feed = None
        seal = None
        if self.harness_mode:
            from autoloop.evaluation import pycache_env
            from autoloop.harness.contract import cache_root
            from autoloop.harness.data import make_meta_only_view
            from autoloop.harness.feed import FeedServer
            from autoloop.tamper import StoreSeal

            seal = StoreSeal.capture(store, c.run_row["id"])
            feed = FeedServer(c.data_dir(), run_dir / "feed.sock", seed=seed)
            env["AUTOLOOP_FEED"] = None
            if self.external_eval:
                view = make_meta_only_view(c.data_dir(), run_dir / "data")
                env.update({"AUTOLOOP_DATA_DIR": str(view), "AUTOLOOP_EVAL": "external"})
            # Training reads bytecode from its own prefix, filled by a trusted process.
            env.update(pycache_env("train", cache_root()))
        before = c.verifier.snapshot(c) if c.verifier is not None else None
        if c.display is not None:
            c.display.trial_started(running, c.best_metric(), c.config)

        def on_start(pid: int, pgid: int, start_time: int | None) -> None:
            if feed is not None:
                feed.mark_spawn()
            store.update_trial(running["id"], pid=pid, pgid=pgid, pid_start_time=start_time)
            faults.fault_point("during_training")
            if c.scheduler is not None:
                c.scheduler.prefetch(running)  # the next proposal is prepared while this trial trains

        last_beat = [time.monotonic()]

        def should_abort() -> bool:
            if c.display is not None:
                c.display.poll(run_dir / "progress.jsonl")
            if time.monotonic() - last_beat[0] > 30:
                last_beat[0] = time.monotonic()
                store.update_trial(running["id"], heartbeat_at=_now())
            return c.abort_requested

        from autoloop.sandbox import SandboxPaths

        readonly = [c.repo_dir]
        if self.harness_mode:
            from autoloop.evaluation import pycache_dir, warm_pycache
            from autoloop.harness.contract import cache_root

            warm_pycache("train", c.python, cache_root())
            readonly.append(pycache_dir("train", cache_root()))
        sandbox_paths = SandboxPaths(
            writable=(run_dir, *c.compile_cache_dirs()), readonly=tuple(readonly),
            # The data splits stay out of reach: batches come from the feed only.
            hidden=tuple(self._hidden()) + ((c.data_dir(),) if self.external_eval else ()),
        )
        if feed is not None:
            feed.start()
            env["AUTOLOOP_FEED"] = str(feed.address)
        try:
            outcome = run_training(
                c.config.train_argv(), cwd=c.repo_dir, env=env, log_path=log_path,
                deadline_seconds=c.config.time_budget + c.config.grace_seconds, on_start=on_start,
                should_abort=should_abort, sandbox=self.sandbox if self.harness_mode else None,
                sandbox_paths=sandbox_paths,
            )
        finally:
            if feed is not None:
                feed.mark_exit()
                feed.close()
        faults.fault_point("after_training")
        m = Measurement(None, seed, role, outcome.status, outcome.reason, outcome.metric,
                        outcome.metric_source if outcome.metric is not None else None, run_dir, outcome,
                        result=outcome.result)
        m.fields = _fields(outcome)
        problem = seal.check(store) if seal is not None else None
        if problem:
            seal.restore(store)
            return self._record(owner, running, m, "invalid", f"the trial wrote to experiments.db: {problem} "
                                                               "(the recorded values were put back)")
        if outcome.status == "aborted":
            return self._record(owner, running, m, "aborted", "interrupted by the user")
        if c.verifier is not None:
            problem = c.verifier.check_trial(c, running, outcome, before, feed=feed.summary() if feed else None)
            if problem:
                return self._record(owner, running, m, "invalid", problem)
        refused = feed.summary().get("refused") if feed is not None else None
        if refused:
            first = refused[0]
            return self._record(owner, running, m, "invalid", (
                f"asked the data feed for the {first.get('split')} split: training may read only the train split "
                "(val_bpb is computed by the harness's evaluator)"))
        if outcome.status != "ok":
            return self._record(owner, running, m, outcome.status, outcome.reason)
        if feed is not None and outcome.metric_source != MetricSource.REPORTED.value:
            from autoloop.budget import check_budget

            problem, figures = check_budget(
                feed.summary(), outcome.result or {}, time_budget=c.config.time_budget,
                max_steps=c.config.max_steps,
            )
            m.fields["budget"] = figures
            if problem:
                return self._record(owner, running, m, "invalid", problem)
        if self.external_eval and outcome.metric_source != MetricSource.REPORTED.value:
            result = self.evaluate(owner, running, m, verify=verify)
            if result is not None:
                return result
        return self._record(owner, running, m, "ok", None)

    def evaluate(self, owner: dict, running: dict, m: Measurement, *, verify: bool) -> Measurement | None:
        """val_bpb (and, with verify, held-out and causality) from the checkpoint, by the
        harness in its own process. Returns the recorded failure, or None with `m` updated."""
        from autoloop.evaluation import evaluate_checkpoint

        c = self.c
        if not m.checkpoint.exists():
            return self._record(owner, running, m, "invalid", (
                "wrote a result JSON but no checkpoint, so the harness cannot evaluate it: save the trained model "
                "to $AUTOLOOP_CHECKPOINT with autoloop.harness.save_checkpoint"))
        evaluated = self._evaluate(owner, running, m.run_dir, m.checkpoint, m.result or {}, verify=verify, seed=m.seed)
        m.fields["eval_seconds"] = evaluated.seconds
        if not evaluated.ok:
            if c.abort_requested:
                return self._record(owner, running, m, "aborted", "interrupted by the user during evaluation")
            return self._record(owner, running, m, "invalid", evaluated.reason)
        m.metric = evaluated.val_bpb
        m.metric_source = MetricSource.VERIFIED.value if verify else MetricSource.HARNESS.value
        m.heldout = evaluated.heldout_bpb
        return None

    def _evaluate(self, owner: dict, running: dict, run_dir: Path, checkpoint: Path, result: dict, *, verify: bool,
                  seed: int = 0):
        from autoloop.evaluation import evaluate_checkpoint

        c = self.c
        script = c.snapshot_sources(owner["trial_commit"] or c.run_row["base_commit"], run_dir / "source")
        source_dir = run_dir / "source"
        device = "cpu" if str(result.get("device", "cpu")).lower() == "cpu" else "cuda"

        def on_start(pid: int, pgid: int, start_time: int | None) -> None:
            c.store.update_trial(running["id"], pid=pid, pgid=pgid, pid_start_time=start_time)

        splits = ["val", "heldout"] if verify else ["val"]
        return evaluate_checkpoint(
            python=c.python, repo_dir=c.repo_dir, source_dir=source_dir, checkpoint=checkpoint,
            data_dir=c.data_dir(), device=device, splits=splits, causality=verify,
            out_dir=run_dir / ("verify" if verify else "eval"), sandbox=self.sandbox,
            deadline_seconds=max(EVAL_DEADLINE_FLOOR_SECONDS, c.config.grace_seconds), on_start=on_start,
            script=script.relative_to(source_dir).as_posix(), seed=seed, db_path=c.db_path(),
            should_abort=lambda: c.abort_requested,
        )

    def verify(self, owner: dict, running: dict, row: dict) -> tuple[bool, str | None, float | None]:
        """Held-out and causality for an already measured run (a keep candidate's).
        Returns (ok, reason, heldout) and marks the row verified."""
        run_dir = Path(row["log_path"]).parent if row.get("log_path") else None
        if run_dir is None or not (run_dir / "checkpoint.pt").exists():
            return False, f"the checkpoint of its run at seed {row.get('seed')} is gone, so it cannot be verified", None
        evaluated = self._evaluate(owner, running, run_dir, run_dir / "checkpoint.pt", _result_of(run_dir),
                                   verify=True, seed=int(row.get("seed") or 0))
        if not evaluated.ok:
            return False, f"failed verification: {evaluated.reason}", None
        from autoloop.evaluation import suspicious_identity

        if row.get("metric") is not None and abs(evaluated.val_bpb - row["metric"]) > 1e-6:
            return False, (f"re-evaluated val_bpb {evaluated.val_bpb:.6f} differs from its first evaluation "
                           f"{row['metric']:.6f}: the model's outputs are not deterministic"), evaluated.heldout_bpb
        odd = suspicious_identity(evaluated.val_bpb, evaluated.heldout_bpb)
        if odd:
            return False, odd, evaluated.heldout_bpb
        self.c.store.update_measurement(row["id"], heldout_metric=evaluated.heldout_bpb, verified=1)
        return True, None, evaluated.heldout_bpb

    # ------------------------------------------------------------------ recording

    def _record(self, owner: dict, running: dict, m: Measurement, status: str, reason: str | None) -> Measurement:
        m.status, m.reason = status, reason
        if status != "ok":
            m.metric = m.metric if status == "ok" else None
        figures = m.fields.pop("budget", None)
        m.id = self.c.store.add_measurement(
            owner["id"], m.metric if status == "ok" else None, seed=m.seed, role=m.role,
            for_trial_id=running["id"] if running["id"] != owner["id"] else None, status=status, reason=reason,
            num_steps=m.fields.get("num_steps"), total_tokens=m.fields.get("total_tokens"),
            training_seconds=m.fields.get("training_seconds"), wall_seconds=m.fields.get("wall_seconds"),
            eval_seconds=m.fields.get("eval_seconds"), budget=figures, log_path=str(m.run_dir / "train.log"),
        )
        if figures is not None:
            m.fields["budget"] = figures
        if m.outcome is not None and m.outcome.result and m.outcome.result.get("curve") and status == "ok":
            m.fields["curve"] = m.outcome.result["curve"]
        return m


def _result_of(run_dir: Path) -> dict:
    import json

    try:
        return json.loads((run_dir / "result.json").read_text())
    except (OSError, ValueError):
        return {}


def _fields(outcome: RunOutcome) -> dict:
    result = outcome.result or {}
    fields = {
        "wall_seconds": outcome.wall_seconds,
        "error_tail": outcome.error_tail if outcome.status != "ok" else None,
        "result": {k: v for k, v in result.items() if k != "curve"} or None,
    }
    for key in RESULT_FIELDS:
        value = result.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            fields[key] = int(value) if key in _INTEGER_FIELDS else float(value)
    return fields


def _now() -> str:
    from autoloop.store import utcnow

    return utcnow()
