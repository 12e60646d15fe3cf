"""Evaluation outside training: the controller's side of `python -m autoloop.harness.evaluate`.

Under the controller a trial's training process never evaluates (AUTOLOOP_EVAL=external);
its metric comes from a separate process that rebuilds the model from the trial's
train.py (copied from its commit) and checkpoint and evaluates it with the harness
(autoloop.harness.evaluate: it seals the harness and the torch functions it scores with
before the trial's code is imported). `evaluate_checkpoint` runs that process through
the runner (own process group, deadline, log file), sandboxed when given a sandbox:
it reads the source copy, the checkpoint, the data and its bytecode cache, and writes
only `out_dir`.

The bytecode prefixes the evaluator reads are autoloop.trust.bytecode's; the rules on the
figures it returns (held-out guard, identical val/held-out) are autoloop.decide.heldout's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoloop.decide.heldout import suspicious_identity
from autoloop.measure.runner import run_training
from autoloop.trust.bytecode import pycache_dir, pycache_env, warm_eval_cache

VERDICT_FILE = "eval.json"
EVAL_LOG = "eval.log"


# ---------------------------------------------------------------------------------------
# Watching the evaluator's bytecode prefix
# ---------------------------------------------------------------------------------------


def tree_signature(root: Path) -> dict[str, str]:
    """size, mtime and inode of every file under `root` (~7 ms for torch's 1000 .pyc files)."""
    signature: dict[str, str] = {}
    if not root.is_dir():
        return signature
    for folder, _dirs, files in os.walk(root):
        for name in files:
            path = Path(folder) / name
            try:
                stat = path.lstat()
            except OSError:
                continue
            signature[path.relative_to(root).as_posix()] = f"{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}"
    return signature


def _signature_changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return [name for name in sorted(set(before) | set(after)) if before.get(name) != after.get(name)]


# ---------------------------------------------------------------------------------------
# Running the evaluation
# ---------------------------------------------------------------------------------------


@dataclass
class EvalResult:
    """One evaluation of a checkpoint.

    ok: the verdict passed. reason: one line when not. status: "ok", "failed" (a verdict
    that failed: the trial's fault), "timeout", "crash" (no verdict), "aborted", or
    "data" (the worker says the dataset is broken: not the trial's fault).
    fields: the verdict JSON as written by the worker (stage, seconds, replaced, ...).
    """

    ok: bool
    reason: str | None
    status: str
    val_bpb: float | None = None
    heldout_bpb: float | None = None
    causality: dict | None = None
    seconds: float = 0.0  # wall seconds of the evaluation process, spawn to exit
    fields: dict = field(default_factory=dict)
    log_path: Path | None = None
    verdict_path: Path | None = None


def evaluation_command(*, python: str, train_py: Path, checkpoint: Path, out: Path, data_dir: Path, device: str,
                       splits: tuple[str, ...] | list[str], causality: bool, seed: int,
                       reported: float | None) -> list[str]:
    command = [
        python, "-m", "autoloop.harness.evaluate", "--train-py", str(train_py), "--checkpoint", str(checkpoint),
        "--out", str(out), "--data-dir", str(data_dir), "--device", device, "--splits", ",".join(splits),
        "--seed", str(seed),
    ]
    if causality:
        command.append("--causality")
    if reported is not None:
        command += ["--reported", repr(float(reported))]
    return command


def evaluate_checkpoint(
    *,
    python: str,
    repo_dir: Path,
    source_dir: Path,
    checkpoint: Path,
    data_dir: Path,
    device: str,
    splits: tuple[str, ...] | list[str] = ("val",),
    causality: bool = False,
    out_dir: Path,
    sandbox=None,
    deadline_seconds: float,
    on_start: Callable[[int, int, int | None], None] | None = None,
    script: str = "train.py",
    seed: int = 0,
    reported: float | None = None,
    cache_root: Path | None = None,
    should_abort: Callable[[], bool] | None = None,
    db_path: Path | None = None,
    env: dict[str, Any] | None = None,
    verdict_file: str = VERDICT_FILE,
    log_file: str = EVAL_LOG,
) -> EvalResult:
    """Evaluate `checkpoint` with the model of `source_dir/script` in a separate process.

    `source_dir`: the trial's editable files copied from its commit
    (autoloop.measure.worker.write_sources); the worker runs from there so the trial's imports of its own
    siblings resolve to the copy. `sandbox`: an object with `.wrap(argv, *, env, cwd,
    writable, readonly, hidden) -> (argv, env)` (autoloop.measure.sandbox), or None to run
    unsandboxed. Writes `out_dir/eval.json` (the verdict) and `out_dir/eval.log` (names:
    `verdict_file`, `log_file`).
    `reported`: the trial's own val_bpb, when it has one to hold it to (verification).
    `cache_root`: the controller's cache (bytecode prefixes); default the harness's.
    """
    repo_dir, source_dir, checkpoint, data_dir, out_dir = map(Path, (repo_dir, source_dir, checkpoint, data_dir, out_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    if cache_root is None:
        from autoloop.harness.contract import cache_root as harness_cache_root

        cache_root = harness_cache_root()
    verdict_path = out_dir / verdict_file
    log_path = out_dir / log_file
    verdict_path.unlink(missing_ok=True)
    device = "cpu" if device == "cpu" else "cuda"
    splits = tuple(splits)

    if (source_dir / "autoloop").exists():
        # The worker runs from source_dir and `python -m` puts it first on sys.path.
        return EvalResult(ok=False, status="failed", reason=(
            f"the trial's files include {source_dir / 'autoloop'}, which would be imported instead of the installed "
            "harness: an editable file may not be named autoloop/..."))
    warm_eval_cache(python, cache_root)
    prefix = pycache_dir("eval", cache_root)
    command = evaluation_command(python=python, train_py=source_dir / script, checkpoint=checkpoint, out=verdict_path,
                                 data_dir=data_dir, device=device, splits=splits, causality=causality, seed=seed,
                                 reported=reported)
    child_env: dict[str, Any] = {
        # The contract variables are the training run's: nothing here may overwrite its
        # result or checkpoint, and the evaluator never runs "external" itself.
        "AUTOLOOP_RESULT": None, "AUTOLOOP_CHECKPOINT": None, "AUTOLOOP_PROGRESS": None, "AUTOLOOP_EVAL": None,
        "AUTOLOOP_DATA_DIR": str(data_dir), **pycache_env("eval", cache_root), **(env or {}),
    }
    if sandbox is not None:
        db = Path(db_path) if db_path is not None else repo_dir / "experiments.db"
        hidden = [repo_dir / ".git", repo_dir / ".autoloop", db, db.with_name(db.name + "-wal"),
                  db.with_name(db.name + "-shm")]
        command, child_env = sandbox.wrap(command, env=child_env, cwd=source_dir, writable=[out_dir],
                                          readonly=[source_dir, checkpoint, data_dir, prefix], hidden=hidden)
    before = tree_signature(prefix)
    ran = run_training(command, cwd=source_dir, env=child_env, log_path=log_path, deadline_seconds=deadline_seconds,
                       on_start=on_start, should_abort=should_abort)
    written = _signature_changes(before, tree_signature(prefix))

    def result(ok: bool, reason: str | None, status: str, verdict: dict | None = None) -> EvalResult:
        verdict = verdict or {}
        return EvalResult(ok=ok, reason=reason, status=status, val_bpb=verdict.get("val_bpb"),
                          heldout_bpb=verdict.get("heldout_bpb"), causality=verdict.get("causality"),
                          seconds=ran.wall_seconds, fields=verdict, log_path=log_path, verdict_path=verdict_path)

    if ran.status == "aborted":
        return result(False, "the evaluation was interrupted", "aborted")
    if ran.status == "timeout":
        return result(False, f"the evaluation did not finish within {deadline_seconds:.0f} s (see {log_path})", "timeout")
    if written:
        listed = ", ".join(written[:5]) + (f" and {len(written) - 5} more" if len(written) > 5 else "")
        return result(False, f"the evaluation of the trial's code wrote to the evaluator's bytecode cache {prefix}: "
                             f"{listed}", "failed")
    if ran.returncode == 2 and not verdict_path.exists():
        return result(False, f"the evaluation found the dataset broken: {ran.reason}", "data")
    try:
        if ran.returncode != 0:
            raise ValueError("the worker failed")
        verdict = json.loads(verdict_path.read_text())
        if not isinstance(verdict, dict):
            raise ValueError("not an object")
    except (OSError, ValueError):
        why = ran.reason or f"exit {ran.returncode}"
        return result(False, f"the evaluation crashed ({why}; see {log_path})", "crash")
    if not verdict.get("ok"):
        return result(False, verdict.get("reason") or "the evaluation failed without a reason", "failed", verdict)
    identical = suspicious_identity(verdict.get("val_bpb"), verdict.get("heldout_bpb"))
    if identical:  # the worker checks this too; a verdict file is only as good as its writer
        return result(False, identical, "failed", verdict)
    return result(True, None, "ok", verdict)
