"""The verifier: no trial is kept on a number the harness did not check.

The controller holds one `Verifier` (the default; `Controller(verifier=None)` turns all
of this off, for tests with fake scripts) and calls it at four points:

* `check_run(controller)` before each work item: the harness and the prepared data are
  still what they were when this invocation started (and, at the first call, the data
  splits still match the hashes recorded when they were prepared). A difference pauses
  the run with the changed files named.
* around each training run, the worker half of the measurement (autoloop.measure.worker, which
  may run in another process or on another machine) takes the snapshot before and after
  and applies the same rules as `check_trial(controller, trial, outcome, before)`: a
  trial that changed the harness or the data is `invalid` (and the run pauses, through
  `Controller.worker_pause` and the next `check_run`); a finished one whose report breaks
  its budget or names another dataset or harness (`harness_fingerprint`) is `invalid`
  (autoloop.trust.integrity). Planted bytecode alone is removed and rewritten by the worker;
  `refresh_bytecode` then updates the reference here.
* `verifier(controller, trial, outcome, fields) -> Verdict` for a trial the decision would
  keep (only when `config.verify`): the trial's train.py (and the other editable files
  named by a literal path) are read from its commit into the trial folder's `source/`,
  and `autoloop.trust.evaluation.evaluate_checkpoint` runs a fresh process on the same device
  (`python -m autoloop.harness.evaluate`, from that folder: own process group recorded in
  the row, deadline, log file `verify.log`, verdict `verify.json`, the evaluator's
  read-only bytecode cache, the verifier's sandbox if it has one) that seals the harness,
  rebuilds the model from that copy and the checkpoint, checks causality, re-evaluates
  val_bpb and evaluates the held-out split.
  Nothing the trial left in the working tree is used. On success the trial's metric becomes the re-evaluated
  value with metric_source `verified`, and the held-out bpb and the verification time
  are stored; the controller decides again on the verified value.

Which trials can be verified:
* metric_source `reported` (a third-party script: no result JSON, only the printed
  block): nothing to rebuild, so the keep stays `reported` and is shown as unverified
  everywhere; the controller never compares such a metric with a verified one.
* a result JSON (the harness contract) but no checkpoint, no `build_model`, or a train
  command that names no .py file: `invalid`. A script that claims the contract is held
  to it; silently trusting its number would defeat the check.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from autoloop.trust import integrity
from autoloop.errors import AutoloopError
from autoloop.trust.evaluation import evaluate_checkpoint
from autoloop.measure.runner import RunOutcome
from autoloop.store import MetricSource

VERDICT_FILE = "verify.json"
VERIFY_LOG = "verify.log"
# The verification deadline: rebuild + causality + two evaluations. The evaluations cost
# about what the trial's own evaluation did; the floor covers interpreter and torch
# start-up and a slow, shared machine.
DEADLINE_FLOOR_SECONDS = 120.0
DEADLINE_EVAL_FACTOR = 4.0


@dataclass
class Verdict:
    ok: bool
    reason: str = ""
    fields: dict = field(default_factory=dict)  # merged into the trial row


class Verifier:
    """Integrity checks around every trial and out-of-process verification of keep candidates."""

    def __init__(self, harness_dir: Path | str | None = None, python: str | None = None, *, sandbox=None,
                 cache_root: Path | str | None = None):
        # The harness the training processes import; the default is the one this process
        # imports (tests point it at a copy so that a trial may tamper with it safely).
        self.harness_dir = Path(harness_dir) if harness_dir is not None else integrity.harness_dir()
        self.python = python or sys.executable
        # The evaluation's sandbox (autoloop.measure.sandbox policy, None: unsandboxed) and the cache
        # holding the bytecode prefixes (None: the harness's cache root).
        self.sandbox = sandbox
        self.cache_root = Path(cache_root) if cache_root is not None else None
        self._reference: integrity.Snapshot | None = None
        self._harness_fingerprint: str | None = None

    # ------------------------------------------------------------------ integrity

    def pycache_root(self) -> Path:
        """The cache holding the bytecode prefixes (autoloop.trust.evaluation.pycache_env)."""
        if self.cache_root is not None:
            return self.cache_root
        from autoloop.harness.contract import cache_root

        return cache_root()

    def pycache_prefixes(self) -> list[Path]:
        """The bytecode prefixes autoloop's children use (training's and the evaluator's)."""
        from autoloop.trust.evaluation import PYCACHE_KINDS, pycache_dir

        return [pycache_dir(kind, self.pycache_root()) for kind in PYCACHE_KINDS]

    def snapshot(self, controller) -> integrity.Snapshot:
        return integrity.take_snapshot(self.harness_dir, controller.data_dir(), pycache_prefixes=self.pycache_prefixes())

    def check_run(self, controller) -> str | None:
        """A pause reason if the harness or the data changed since this invocation began."""
        now = self.snapshot(controller)
        if self._reference is None or self._reference.data_dir != now.data_dir:
            problems = integrity.dataset_problems(controller.data_dir()) + integrity.bytecode_problems(self.harness_dir)
            if problems:
                return integrity.describe_pause(problems, controller.tag)
            from autoloop.trust.evaluation import PYCACHE_KINDS, warm_pycache

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

    def _rewarm(self) -> None:
        from autoloop.measure.worker import rewarm_bytecode

        rewarm_bytecode(self.harness_dir, self.python, self.pycache_root())

    def refresh_bytecode(self, controller) -> None:
        """A run's planted bytecode was removed and written again by the trusted warm-up
        (autoloop.measure.worker): the reference takes the fresh bytecode, so the next `check_run`
        compares with what the runs after it will find, and the run goes on."""
        if self._reference is not None:
            import dataclasses

            fresh = self.snapshot(controller)
            self._reference = dataclasses.replace(self._reference, bytecode=fresh.bytecode)

    def check_trial(self, controller, trial: dict, outcome: RunOutcome, before: integrity.Snapshot | None,
                    feed: dict | None = None) -> str | None:
        """Why the trial is invalid whatever its metric (tampering, a broken budget), or None.

        `feed`: the data feed's summary when the run drew its batches from it; then the
        feed's own measurements (autoloop.trust.budget) judge the time spent, not the trial's
        report or the wall clock."""
        if before is not None:
            after = self.snapshot(controller)
            found = integrity.changes(before, after)
            if found:
                if integrity.remove_planted_bytecode(self.harness_dir, before, after) is not None:
                    # Only bytecode: removed, and written again by the trusted warm-up, so the
                    # runs after this one are measured with the real harness and the run goes on.
                    self._rewarm()
                    self.refresh_bytecode(controller)
                return "changed the fixed harness or data while it ran: " + "; ".join(found)
        if outcome.status != "ok":
            return None
        return integrity.budget_problem(
            controller.config, outcome, data_fingerprint=(controller.run_row or {}).get("data_fingerprint"),
            harness_fingerprint=self._harness_fingerprint,
            measured_by_feed=bool(feed and feed.get("batches")),
        )

    # ------------------------------------------------------------------ verification

    @staticmethod
    def _snapshot_sources(controller, commit: str, script: str, source_dir: Path) -> Path:
        """Copy the train script and the other editable files (literal paths; glob patterns
        are skipped) from the trial's commit into `source_dir`; returns the script's copy."""
        if source_dir.exists():
            shutil.rmtree(source_dir)
        paths = [script] + [p for p in controller.config.editable if p != script and not any(c in p for c in "*?[")]
        for path in paths:
            try:
                text = controller.repo.show_file(commit, path)
            except AutoloopError:
                if path == script:
                    raise
                continue  # an editable file this commit does not have
            target = source_dir / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        return source_dir / script

    def __call__(self, controller, trial: dict, outcome: RunOutcome, fields: dict) -> Verdict:
        number = trial["number"]
        if outcome.metric_source == MetricSource.REPORTED.value:
            controller._say(
                f"trial {number}: only a printed val_bpb (no result JSON), so it cannot be verified; "
                "it is kept as reported (unverified)", "yellow",
            )
            return Verdict(True, "", {"metric_source": MetricSource.REPORTED.value})
        trial_dir = controller.trial_dir(number)
        checkpoint = trial_dir / "checkpoint.pt"
        if not checkpoint.exists():
            return Verdict(False, (
                "wrote a result JSON but no checkpoint, so its val_bpb cannot be verified: save the trained model "
                "to $AUTOLOOP_CHECKPOINT with autoloop.harness.save_checkpoint"
            ))
        script = controller._train_script()
        if script is None:
            return Verdict(False, (
                f"the train command {controller.config.train_command!r} names no .py file, so the verifier cannot "
                "rebuild the model: use a command like 'python train.py', or run with --no-verify"
            ))
        source_dir = trial_dir / "source"
        try:
            relative = script.resolve().relative_to(controller.repo_dir).as_posix()
            self._snapshot_sources(controller, trial["trial_commit"], relative, source_dir)
        except (ValueError, AutoloopError) as exc:
            return Verdict(False, f"cannot read the trial's {script.name} from its commit: {exc}")

        result = outcome.result or {}
        device = "cpu" if str(result.get("device", "cpu")).lower() == "cpu" else "cuda"
        eval_seconds = result.get("eval_seconds") if isinstance(result.get("eval_seconds"), (int, float)) else 0.0
        deadline = max(DEADLINE_FLOOR_SECONDS, controller.config.grace_seconds) + DEADLINE_EVAL_FACTOR * min(
            max(float(eval_seconds), 0.0), float(controller.config.time_budget))
        controller._say(f"verifying trial {number} in a fresh process: causality, val_bpb, held-out")

        def on_start(pid: int, pgid: int, start_time: int | None) -> None:
            # The row names the process group working for the trial, so that recovery after a
            # dead controller stops the verifier too.
            controller.store.update_trial(trial["id"], pid=pid, pgid=pgid, pid_start_time=start_time)

        ran = evaluate_checkpoint(
            python=self.python, repo_dir=controller.repo_dir, source_dir=source_dir, checkpoint=checkpoint,
            data_dir=controller.data_dir(), device=device, splits=("val", "heldout"), causality=True,
            out_dir=trial_dir, sandbox=self.sandbox, deadline_seconds=deadline, on_start=on_start,
            script=relative, seed=number, reported=float(outcome.metric), cache_root=self.pycache_root(),
            should_abort=lambda: controller.abort_requested, db_path=getattr(controller.store, "path", None),
            verdict_file=VERDICT_FILE, log_file=VERIFY_LOG,
        )
        timing = {"verify_seconds": ran.seconds}
        if ran.status == "aborted":
            return Verdict(False, "verification was interrupted, so the trial is not kept", timing)
        if ran.status == "timeout":
            return Verdict(False, f"verification did not finish within {deadline:.0f} s (see {VERIFY_LOG})", timing)
        if ran.status in ("crash", "data"):
            return Verdict(False, f"verification crashed: {ran.reason}", timing)
        if ran.heldout_bpb is not None:
            timing["heldout_metric"] = float(ran.heldout_bpb)
        if not ran.ok:
            return Verdict(False, f"failed verification: {ran.reason or 'no reason given'}", timing)
        val = float(ran.val_bpb)
        controller._say(
            f"trial {number} verified in {ran.seconds:.1f} s: val_bpb {val:.6f} (reported "
            f"{outcome.metric:.6f}), held-out {timing.get('heldout_metric', float('nan')):.6f}, causal", "green",
        )
        return Verdict(True, "", {**timing, "metric": val, "metric_source": MetricSource.VERIFIED.value})
