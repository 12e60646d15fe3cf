"""Evaluation outside training: the controller's side of `python -m autoloop.harness.evaluate`.

Under the controller a trial's training process never evaluates (AUTOLOOP_EVAL=external);
its metric comes from a separate process that rebuilds the model from the trial's
train.py (copied from its commit) and checkpoint and evaluates it with the harness
(autoloop.harness.evaluate: it seals the harness and the torch functions it scores with
before the trial's code is imported). `evaluate_checkpoint` runs that process through
the runner (own process group, deadline, log file), sandboxed when given a sandbox:
it reads the source copy, the checkpoint, the data and its bytecode cache, and writes
only `out_dir`.

Bytecode (why every child gets PYTHONPYCACHEPREFIX, `pycache_env`)
    Python trusts a .pyc in `__pycache__` whose header carries the source's mtime and
    size, so a trial that writes a poisoned `autoloop/harness/__pycache__/metric.*.pyc`
    with the real file's mtime and size would change every later evaluation. With
    PYTHONPYCACHEPREFIX set, Python neither reads nor writes `__pycache__` beside the
    sources: it uses the prefix folder. Training and evaluation get separate prefixes
    under the controller's cache: training's is writable by training (its own cache; its
    harness part is written first by `warm_pycache` and then watched by the integrity
    snapshot); the evaluator's is written only by `warm_pycache` (a trusted process that imports
    the harness and torch, no trial code) and is read-only for the evaluator
    (PYTHONDONTWRITEBYTECODE=1, read-only in the sandbox) and never visible writable to a
    training run. Unsandboxed, the evaluator's prefix is watched: a change while the
    worker ran fails the evaluation, naming the file. The integrity snapshot
    (autoloop.trust.integrity) also covers the harness's `__pycache__` and the `.pth` files of
    site-packages around every training run.

Held-out guard (`heldout_guard`)
    A keep candidate's val bpb improved by `val_delta` (candidate - incumbent, negative
    is better) over n paired runs; its held-out bpb moved by `heldout_delta`. For honest
    work the two move together: both splits are unseen text of the same distribution.
    The gap g = heldout_delta - val_delta is ~0 plus noise. Each delta is a mean of n
    paired differences whose one-run SD is `pair_sd`, so its standard error is
    pair_sd / sqrt(n), and the gap's is at most sqrt(2) * pair_sd / sqrt(n) (the two
    deltas are positively correlated in practice - same model, same seeds - which only
    makes the true SD smaller, so the rule errs towards keeping). The candidate is
    refused when

        g > HELDOUT_Z * sqrt(2 / n) * pair_sd   (and g > HELDOUT_MIN_GAP)

    HELDOUT_Z = 2: an honest candidate is refused with probability <= 2.3% (one-sided
    normal tail) and a candidate that fits val at held-out's expense (val -0.57, held-out
    +0.10: g = 0.67) is refused at any realistic noise. HELDOUT_MIN_GAP ignores gaps below
    the precision anything is reported at when the noise estimate is ~0.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoloop.measure.runner import run_training

VERDICT_FILE = "eval.json"
EVAL_LOG = "eval.log"
HELDOUT_Z = 2.0
HELDOUT_MIN_GAP = 1e-3
# Val and held-out are different text: an honest gain on one is rarely exactly the gain on
# the other (measured: a 0.305 bpb LR fix gained 0.287 on held-out). This share of the val
# gain is allowed besides the noise; fitting val (0.57 on val, -0.10 on held-out) is far past it.
HELDOUT_RELATIVE = 0.1
PYCACHE_KINDS = ("train", "eval")
# Python's own flags for the bytecode cache.
ENV_PYCACHE_PREFIX = "PYTHONPYCACHEPREFIX"
ENV_DONT_WRITE_BYTECODE = "PYTHONDONTWRITEBYTECODE"

_warmed: set[tuple[str, str, str, str]] = set()


# ---------------------------------------------------------------------------------------
# Bytecode caches
# ---------------------------------------------------------------------------------------


def pycache_dir(kind: str, cache_root: Path | str) -> Path:
    if kind not in PYCACHE_KINDS:
        raise ValueError(f"pycache kind must be one of {PYCACHE_KINDS}, not {kind!r}")
    return Path(cache_root) / "pycache" / kind


def pycache_env(kind: str, cache_root: Path | str) -> dict[str, str | None]:
    """Environment entries for an autoloop child process's bytecode (None = unset it).

    Both prefixes are written only by `warm_pycache`, a trusted process that imports no
    trial code; the children read them (PYTHONDONTWRITEBYTECODE=1, and the sandbox mounts
    them read-only). kind "train": what training imports (torch, its compiler, the
    harness), so a trial starts fast and no trial can leave bytecode behind for the runs
    after it (the incumbent's re-measurements among them). kind "eval": the evaluator's,
    which imports the trial's train.py. A change in either is tampering (autoloop.trust.integrity).
    """
    return {
        ENV_PYCACHE_PREFIX: str(pycache_dir(kind, cache_root)),
        ENV_DONT_WRITE_BYTECODE: "1",
    }


def warm_eval_cache(python: str, cache_root: Path | str, *, env: dict[str, str] | None = None) -> float:
    """Fill the evaluator's bytecode prefix (see `warm_pycache`)."""
    return warm_pycache("eval", python, cache_root, env=env)


def warm_pycache(kind: str, python: str, cache_root: Path | str, *, env: dict[str, str] | None = None,
                 force: bool = False) -> float:
    """Fill a bytecode prefix from a trusted process (the harness + torch, no trial code);
    once per (kind, python, prefix, PYTHONPATH) in this process. Returns the seconds spent.

    For "eval" this is the only writer. For "train" it makes the harness's bytecode there
    current before any trial runs, so an honest trial writes none of it and the integrity
    snapshot can treat any harness .pyc a trial adds or changes there as tampering."""
    prefix = pycache_dir(kind, cache_root)
    base = dict(env if env is not None else os.environ)
    key = (kind, python, str(prefix), base.get("PYTHONPATH", ""))
    if key in _warmed and not force:
        return 0.0
    prefix.mkdir(parents=True, exist_ok=True)
    base.pop(ENV_DONT_WRITE_BYTECODE, None)
    base[ENV_PYCACHE_PREFIX] = str(prefix)
    started = time.monotonic()
    code = "import autoloop.harness.evaluate as e; e._harness_modules()"
    if kind == "train":
        # What a training run imports beyond the harness: the optimizers and, on a GPU, the
        # compiler (imported lazily by torch.compile); best effort.
        code += "\ntry:\n    import torch.optim, torch._dynamo, torch._inductor.compile_fx\nexcept Exception:\n    pass"
    done = subprocess.run([python, "-c", code], env=base, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=600, check=False)
    if done.returncode == 0:
        _warmed.add(key)
    return time.monotonic() - started


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

    `source_dir`: the trial's editable files copied from its commit (Verifier's
    `_snapshot_sources`); the worker runs from there so the trial's imports of its own
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


# ---------------------------------------------------------------------------------------
# Rules on the figures
# ---------------------------------------------------------------------------------------


def suspicious_identity(val_bpb: float | None, heldout_bpb: float | None) -> str | None:
    """A reason when val and held-out bpb agree to 9 significant digits (see
    autoloop.harness.evaluate.suspicious_identity, the one rule)."""
    from autoloop.harness.evaluate import suspicious_identity as rule

    return rule(val_bpb, heldout_bpb)


def heldout_threshold(pair_sd: float | None, n: int) -> float:
    """The largest held-out-minus-val gap the noise explains (see the module docstring)."""
    sd = pair_sd if pair_sd is not None and math.isfinite(pair_sd) and pair_sd > 0 else 0.0
    return max(HELDOUT_Z * math.sqrt(2.0 / max(int(n), 1)) * sd, HELDOUT_MIN_GAP)


def heldout_guard(val_delta: float, heldout_delta: float | None, pair_sd: float | None, n: int) -> str | None:
    """Why a keep candidate is refused because held-out did not follow val, or None.

    Deltas are candidate minus incumbent in bpb (negative is better); `pair_sd` the SD of
    one paired difference (the run's pooled noise), `n` the number of paired runs the
    deltas average. No held-out figure: nothing to guard (None).
    """
    if heldout_delta is None or val_delta is None:
        return None
    gap = heldout_delta - val_delta
    allowed = heldout_threshold(pair_sd, n) + HELDOUT_RELATIVE * max(-val_delta, 0.0)
    if gap <= allowed:
        return None
    held = f"got worse by {heldout_delta:.4f}" if heldout_delta > 0 else f"improved only {-heldout_delta:.4f}"
    val = f"improved by {-val_delta:.4f}" if val_delta < 0 else f"changed by {val_delta:+.4f}"
    return (f"held-out bpb {held} while val bpb {val}: a gap of {gap:.4f} bpb, more than the {allowed:.4f} the "
            f"noise and the splits' difference explain ({HELDOUT_Z:g} x sqrt(2/{n}) x paired SD {pair_sd or 0:.4f} "
            f"+ {HELDOUT_RELATIVE:g} x the val gain); it fits val, not the text")
