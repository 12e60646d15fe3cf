"""The worker half of a measurement: train one commit at one seed, check it, evaluate it.

`run_job(job, project_dir=..., run_dir=...)` does, for a `MeasureJob` (autoloop.measure.job),
what happens between the controller's checkout and its record (autoloop.measure.measurer):

1. kind "train": the data feed (autoloop.harness.feed) serves the train split from this
   process; with external evaluation training sees a meta-only view of the dataset and is
   told AUTOLOOP_EVAL=external. Training reads bytecode from its own prefix, filled first
   by a trusted warm-up (autoloop.trust.bytecode.pycache_env).
2. The harness, its bytecode, the import hooks and the data are snapshot before and after
   the run (autoloop.trust.integrity); a change makes the run `invalid`. Planted harness bytecode
   alone is removed and written again by the trusted warm-up (`JobResult.repaired`); any
   other change also sets `JobResult.pause`, because every later run would be measured
   with something else.
3. Training runs in its own process group, sandboxed (autoloop.measure.sandbox) with the layout of
   the controller's day: the project read-only, the run folder and compile cache writable,
   .git, .autoloop, the db and (under external evaluation) the data splits hidden.
4. The budget is checked on the feed's figures (autoloop.trust.budget), the report on the run's
   fingerprints (autoloop.trust.integrity.budget_problem).
5. val_bpb comes from the harness's evaluator in its own sandboxed process
   (autoloop.trust.evaluation), from the commit's files copied into run_dir/source; `verify`
   adds held-out and causality. A "verify" job does only this, for an existing checkpoint.

No db, no git, no controller object: everything comes from the job, and what the
controller records (the seal check, the measurement row, the decision) stays with it.
The same function runs in the controller's process (autoloop.measure.executors.serial), in a
worker process (`python -m autoloop.measure.worker JOB_JSON RESULT_JSON`) or on a Ray node.

The worker process writes run_dir/pids.json ({"pid", "pgid", "start_time"} of the
training or evaluation process, rewritten at each start) so that its parent can record
the group a dead controller's successor must kill; it stops the run when run_dir/ABORT
appears, and writes the result atomically (a temporary file, then os.replace): a worker
killed mid-job leaves no result, which its parent reports as "lost".
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoloop.measure.job import JobResult, MeasureJob
from autoloop.measure.runner import RunOutcome, run_training
from autoloop.store import MetricSource

# Per-run fields copied from the result JSON into the measurement and the trial row.
RESULT_FIELDS = ("training_seconds", "total_seconds", "compile_seconds", "eval_seconds", "num_steps",
                 "total_tokens", "num_params", "mfu_percent", "peak_memory_mb")
_INTEGER_FIELDS = ("num_steps", "total_tokens", "num_params")
# The evaluation's deadline: interpreter and torch start-up, model rebuild, one or two
# evaluations, on a slow, shared machine.
EVAL_DEADLINE_FLOOR_SECONDS = 180.0
PIDS_FILE = "pids.json"
ABORT_FILE = "ABORT"

OnStart = Callable[[int, int, "int | None"], None]


class _Abort:
    """The caller's should_abort, remembered once it said yes (an abort is never taken back)."""

    def __init__(self, ask: Callable[[], bool] | None):
        self.ask = ask
        self.asked = False

    def __call__(self) -> bool:
        if not self.asked and self.ask is not None and self.ask():
            self.asked = True
        return self.asked


# ---------------------------------------------------------------------------------------
# The job's environment and paths
# ---------------------------------------------------------------------------------------


def _cache_root(job: MeasureJob) -> Path:
    if job.cache_root:
        return Path(job.cache_root)
    from autoloop.harness.contract import cache_root

    return cache_root()


def _compile_cache(job: MeasureJob) -> Path:
    path = Path(job.compile_cache or os.environ.get("AUTOLOOP_COMPILE_CACHE") or _cache_root(job) / "compile")
    path.mkdir(parents=True, exist_ok=True)
    return path


def contract_env(job: MeasureJob, run_dir: Path) -> dict[str, Any]:
    """The train-script contract's variables for this run (autoloop.harness.contract), plus
    the job's extra environment."""
    env: dict[str, Any] = {
        "AUTOLOOP_TIME_BUDGET": str(job.time_budget),
        "AUTOLOOP_SEED": str(job.seed),
        "AUTOLOOP_RESULT": str(run_dir / "result.json"),
        "AUTOLOOP_CHECKPOINT": str(run_dir / "checkpoint.pt"),
        "AUTOLOOP_PROGRESS": str(run_dir / "progress.jsonl"),
        "AUTOLOOP_DATA_DIR": str(job.data_dir),
        "AUTOLOOP_COMPILE_CACHE": str(_compile_cache(job)),
    }
    if job.max_steps:
        env["AUTOLOOP_MAX_STEPS"] = str(job.max_steps)
    env.update(job.env or {})
    return env


def _pycache_prefixes(job: MeasureJob) -> list[Path]:
    from autoloop.trust.bytecode import PYCACHE_KINDS, pycache_dir

    root = Path(job.integrity_cache_root) if job.integrity_cache_root else _cache_root(job)
    return [pycache_dir(kind, root) for kind in PYCACHE_KINDS]


def _harness_dir(job: MeasureJob) -> Path:
    if job.harness_dir:
        return Path(job.harness_dir)
    from autoloop.trust import integrity

    return integrity.harness_dir()


def _snapshot(job: MeasureJob):
    from autoloop.trust import integrity

    return integrity.take_snapshot(_harness_dir(job), Path(job.data_dir), pycache_prefixes=_pycache_prefixes(job))


def write_sources(job: MeasureJob, source_dir: Path) -> Path:
    """The commit's editable files into `source_dir` (what the evaluator imports: never the
    working tree); returns the script's copy."""
    import shutil

    if not job.script:
        from autoloop.errors import AutoloopError

        raise AutoloopError("the train command names no .py file, so the harness cannot rebuild the model: use a "
                            "command like 'python train.py', or run with --no-verify")
    if source_dir.exists():
        shutil.rmtree(source_dir)
    for relative, text in job.sources.items():
        target = source_dir / relative
        if not target.resolve().is_relative_to(source_dir.resolve()):
            continue  # never outside the copy
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return source_dir / job.script


@functools.lru_cache(maxsize=None)
def _cuda_device_name(index: str | None) -> str | None:
    """The name nvidia-smi gives the GPU `index` (the first one without); None without
    nvidia-smi. Not torch: initialising CUDA in the controller would hold GPU memory."""
    from autoloop.envinfo import nvidia_smi_query

    query = ["--query-gpu=name"] + (["-i", index] if index is not None else [])
    lines = nvidia_smi_query(*query)
    return lines[0] if lines else None


def device_name(result: dict | None, env: dict[str, Any] | None = None) -> str | None:
    """The device a run trained on: "cpu", the CUDA device's name (the first device
    CUDA_VISIBLE_DEVICES names, in the job's environment or ours), another device type
    as reported, or None when the run reported none."""
    kind = str((result or {}).get("device") or "").strip().lower()
    if not kind:
        return None
    if kind.startswith("cpu"):
        return "cpu"
    if kind.startswith("cuda"):
        visible = str((env or {}).get("CUDA_VISIBLE_DEVICES") or os.environ.get("CUDA_VISIBLE_DEVICES") or "")
        first = visible.split(",")[0].strip()
        return _cuda_device_name(first if first.isdigit() else None) or "cuda"
    return kind


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


# ---------------------------------------------------------------------------------------
# Integrity around a run
# ---------------------------------------------------------------------------------------


def rewarm_bytecode(harness_dir: Path, python: str, cache_root: Path) -> None:
    """Write the harness's bytecode again from a trusted process, in every prefix and, where
    Python writes bytecode beside the sources, there too (after planted bytecode was removed)."""
    from autoloop.trust import integrity
    from autoloop.trust.bytecode import PYCACHE_KINDS, warm_pycache

    for kind in PYCACHE_KINDS:
        warm_pycache(kind, python, cache_root, force=True)
    if not sys.dont_write_bytecode:
        integrity.precompile_harness(harness_dir)


def _integrity_problem(job: MeasureJob, before, outcome: RunOutcome, feed: dict | None) -> tuple[str | None, str | None,
                                                                                                 list[str]]:
    """(why the run is invalid whatever its metric, the pause the run needs, bytecode repaired).

    The harness or data changed while the run ran: invalid; planted bytecode alone is
    removed and rewritten (no pause), anything else pauses the run. A finished run whose
    report breaks its budget or names another dataset or harness: invalid."""
    from autoloop.trust import integrity

    if before is not None:
        after = _snapshot(job)
        found = integrity.changes(before, after)
        if found:
            harness = _harness_dir(job)
            removed = integrity.remove_planted_bytecode(harness, before, after)
            pause, repaired = None, []
            if removed is not None:
                # Only bytecode: removed and written again by the trusted warm-up, so the runs
                # after this one are measured with the real harness and the run goes on.
                root = Path(job.integrity_cache_root) if job.integrity_cache_root else _cache_root(job)
                rewarm_bytecode(harness, job.integrity_python or job.python or sys.executable, root)
                repaired = [str(path) for path in removed]
            else:
                pause = integrity.describe_pause(found, job.tag)
            return "changed the fixed harness or data while it ran: " + "; ".join(found), pause, repaired
    if outcome.status != "ok":
        return None, None, []
    from autoloop.config import Config

    problem = integrity.budget_problem(
        Config(time_budget=job.time_budget, max_steps=job.max_steps), outcome,
        data_fingerprint=job.data_fingerprint, harness_fingerprint=job.harness_fingerprint,
        measured_by_feed=bool(feed and feed.get("batches")),
    )
    return problem, None, []


# ---------------------------------------------------------------------------------------
# Running a job
# ---------------------------------------------------------------------------------------


def run_job(job: MeasureJob, *, project_dir: Path | str, run_dir: Path | str, on_start: OnStart | None = None,
            should_abort: Callable[[], bool] | None = None, runner: Callable[..., RunOutcome] | None = None) -> JobResult:
    """Run `job` with the project checked out at `project_dir` (training's working folder),
    writing into `run_dir` (train.log, result.json, checkpoint.pt, progress.jsonl, source/,
    eval/ or verify/).

    `on_start(pid, pgid, start_time)`: called at each process start, training's first,
    then the evaluation's. `should_abort()`: polled while a process runs; once true the run
    stops and the job ends "aborted". `runner`: the function that runs the training process
    (default autoloop.measure.runner.run_training). Exceptions of the worker's own (a full disk, a
    training command that cannot start, a broken dataset) propagate."""
    project_dir, run_dir = Path(project_dir), Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    abort = _Abort(should_abort)
    if job.kind == "verify":
        return _verify_job(job, project_dir, run_dir, on_start, abort)
    return _train_job(job, project_dir, run_dir, on_start, abort, runner or run_training)


def _train_job(job: MeasureJob, project_dir: Path, run_dir: Path, on_start: OnStart | None, abort: _Abort,
               runner: Callable[..., RunOutcome]) -> JobResult:
    from autoloop.measure.sandbox import SandboxPaths

    log_path = run_dir / "train.log"
    data_dir = Path(job.data_dir)
    env = contract_env(job, run_dir)
    python = job.python or sys.executable
    cache_root = _cache_root(job)
    feed = None
    readonly = [project_dir]
    sandbox = None
    if job.harness_mode:
        from autoloop.trust.bytecode import pycache_dir, pycache_env, warm_pycache
        from autoloop.harness.data import make_meta_only_view
        from autoloop.harness.feed import FeedServer
        from autoloop.measure.sandbox import detect

        sandbox = detect(job.sandbox)
        feed = FeedServer(data_dir, run_dir / "feed.sock", seed=job.seed)
        env["AUTOLOOP_FEED"] = None
        if job.external_eval:
            view = make_meta_only_view(data_dir, run_dir / "data")
            env.update({"AUTOLOOP_DATA_DIR": str(view), "AUTOLOOP_EVAL": "external"})
        # Training reads bytecode from its own prefix, filled by a trusted process (before
        # the snapshot: the warm-up is what an honest run finds, not a change).
        env.update(pycache_env("train", cache_root))
        warm_pycache("train", python, cache_root)
        readonly.append(pycache_dir("train", cache_root))
    before = _snapshot(job) if job.harness_mode else None

    def started(pid: int, pgid: int, start_time: int | None) -> None:
        if feed is not None:
            feed.mark_spawn()
        if on_start is not None:
            on_start(pid, pgid, start_time)

    sandbox_paths = SandboxPaths(
        writable=(run_dir, Path(env["AUTOLOOP_COMPILE_CACHE"])), readonly=tuple(readonly),
        # The data splits stay out of reach: batches come from the feed only.
        hidden=tuple(Path(p) for p in job.hidden) + ((data_dir,) if job.external_eval else ()),
    )
    try:
        if feed is not None:
            feed.start()
            env["AUTOLOOP_FEED"] = str(feed.address)
        outcome = runner(
            job.train_argv, cwd=project_dir, env=env, log_path=log_path,
            deadline_seconds=job.time_budget + job.grace_seconds, on_start=started, should_abort=abort,
            sandbox=sandbox, sandbox_paths=sandbox_paths,
        )
    finally:
        if feed is not None:
            feed.mark_exit()
            feed.close()
    summary = feed.summary() if feed is not None else None
    out = JobResult(outcome.status, outcome.reason, outcome.metric,
                    outcome.metric_source if outcome.metric is not None else None,
                    fields=_fields(outcome), result=outcome.result, device=device_name(outcome.result, env))

    def ended(status: str, reason: str | None) -> JobResult:
        out.status, out.reason = status, reason
        if status != "ok":
            out.metric = out.metric_source = out.heldout = None
        return out

    if outcome.status == "aborted":
        return ended("aborted", "interrupted by the user")
    if job.harness_mode:
        problem, out.pause, out.repaired = _integrity_problem(job, before, outcome, summary)
        if problem:
            return ended("invalid", problem)
    refused = (summary or {}).get("refused")
    if refused:
        first = refused[0]
        return ended("invalid", (
            f"asked the data feed for the {first.get('split')} split: training may read only the train split "
            "(val_bpb is computed by the harness's evaluator)"))
    if outcome.status != "ok":
        return ended(outcome.status, outcome.reason)
    if summary is not None and outcome.metric_source != MetricSource.REPORTED.value:
        from autoloop.trust.budget import check_budget

        problem, figures = check_budget(summary, outcome.result or {}, time_budget=job.time_budget,
                                        max_steps=job.max_steps)
        out.fields["budget"] = figures
        if problem:
            return ended("invalid", problem)
    if job.external_eval and outcome.metric_source != MetricSource.REPORTED.value:
        if not (run_dir / "checkpoint.pt").exists():
            return ended("invalid", (
                "wrote a result JSON but no checkpoint, so the harness cannot evaluate it: save the trained model "
                "to $AUTOLOOP_CHECKPOINT with autoloop.harness.save_checkpoint"))
        evaluated = _evaluate(job, project_dir, run_dir, outcome.result or {}, verify=job.verify,
                              on_start=on_start, abort=abort)
        out.fields["eval_seconds"] = evaluated.seconds
        if not evaluated.ok:
            if abort():
                return ended("aborted", "interrupted by the user during evaluation")
            return ended("invalid", evaluated.reason)
        out.metric = evaluated.val_bpb
        out.metric_source = MetricSource.VERIFIED.value if job.verify else MetricSource.HARNESS.value
        out.heldout = evaluated.heldout_bpb
    return ended("ok", None)


def _evaluate(job: MeasureJob, project_dir: Path, run_dir: Path, result: dict, *, verify: bool,
              on_start: OnStart | None, abort: _Abort, checkpoint: Path | None = None):
    """val_bpb (and, with verify, held-out and causality) of the run's checkpoint, by the
    harness in its own sandboxed process (autoloop.trust.evaluation.evaluate_checkpoint)."""
    from autoloop.trust.evaluation import evaluate_checkpoint
    from autoloop.measure.sandbox import detect

    source_dir = run_dir / "source"
    script = write_sources(job, source_dir)
    device = "cpu" if str(result.get("device", "cpu")).lower() == "cpu" else "cuda"
    splits = ["val", "heldout"] if verify else ["val"]
    return evaluate_checkpoint(
        python=job.python or sys.executable, repo_dir=project_dir, source_dir=source_dir,
        checkpoint=checkpoint or run_dir / "checkpoint.pt", data_dir=Path(job.data_dir), device=device,
        splits=splits, causality=verify, out_dir=run_dir / ("verify" if verify else "eval"),
        sandbox=detect(job.sandbox), deadline_seconds=max(EVAL_DEADLINE_FLOOR_SECONDS, job.grace_seconds),
        on_start=on_start, script=script.relative_to(source_dir).as_posix(), seed=job.seed,
        db_path=Path(job.db_path) if job.db_path else None, should_abort=abort,
        cache_root=_cache_root(job), env=dict(job.env or {}) or None,
    )


def _verify_job(job: MeasureJob, project_dir: Path, run_dir: Path, on_start: OnStart | None,
                abort: _Abort) -> JobResult:
    """Held-out and causality (and val again) for a run's existing checkpoint."""
    checkpoint = Path(job.checkpoint) if job.checkpoint else run_dir / "checkpoint.pt"
    result = job.result or {}
    if not checkpoint.exists():
        return JobResult("invalid", f"the checkpoint of its run at seed {job.seed} is gone, so it cannot be verified",
                         result=result)
    evaluated = _evaluate(job, project_dir, run_dir, result, verify=True, on_start=on_start, abort=abort,
                          checkpoint=checkpoint)
    fields = {"eval_seconds": evaluated.seconds}
    if not evaluated.ok:
        status = "aborted" if evaluated.status == "aborted" or abort() else "invalid"
        return JobResult(status, evaluated.reason, heldout=evaluated.heldout_bpb, fields=fields, result=result,
                         device=device_name(result, job.env))
    return JobResult("ok", None, metric=evaluated.val_bpb, metric_source=MetricSource.VERIFIED.value,
                     heldout=evaluated.heldout_bpb, fields=fields, result=result, device=device_name(result, job.env))


# ---------------------------------------------------------------------------------------
# python -m autoloop.measure.worker JOB_JSON RESULT_JSON
# ---------------------------------------------------------------------------------------


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file and os.replace: a reader sees the whole
    file or none, even when the writer is killed half-way."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _terminate(signum, frame) -> None:
    # An exception, not the default death: run_training kills the trial's process group on
    # the way out, so a worker told to stop leaves nothing running.
    raise SystemExit(128 + signum)


WARMED_ENV = "AUTOLOOP_WARMED_PYCACHE"


def _inherit_warm_pycache() -> None:
    """Bytecode prefixes the parent (the controller, on this machine) has already filled by
    its trusted warm-up: a worker process per job need not import torch again to redo it."""
    from autoloop.trust import bytecode

    try:
        keys = json.loads(os.environ.pop(WARMED_ENV, "") or "[]")
    except ValueError:
        return
    for key in keys:
        if isinstance(key, list) and len(key) == 4:
            bytecode.mark_warmed(tuple(key))


def main(argv: list[str] | None = None) -> int:
    """Run the job in JOB_JSON, write its JobResult to RESULT_JSON; exit 0 when written.

    The job file names project_dir and run_dir. Writes run_dir/pids.json at each process
    start; stops the run when run_dir/ABORT appears. A failure of the worker itself (an
    exception: a full disk, a broken dataset) writes no result: the traceback goes to
    stderr and the exit code is 1."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m autoloop.measure.worker JOB_JSON RESULT_JSON", file=sys.stderr)
        return 2
    job_path, result_path = Path(args[0]), Path(args[1])
    job = MeasureJob.from_json(job_path.read_text())
    if not job.project_dir or not job.run_dir:
        print(f"{job_path}: the job names no project_dir or run_dir", file=sys.stderr)
        return 2
    run_dir = Path(job.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _inherit_warm_pycache()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _terminate)

    def on_start(pid: int, pgid: int, start_time: int | None) -> None:
        write_atomically(run_dir / PIDS_FILE, json.dumps({"pid": pid, "pgid": pgid, "start_time": start_time}))

    def should_abort() -> bool:
        return (run_dir / ABORT_FILE).exists()

    try:
        result = run_job(job, project_dir=job.project_dir, run_dir=run_dir, on_start=on_start,
                         should_abort=should_abort)
    except Exception:
        traceback.print_exc()
        return 1
    write_atomically(result_path, result.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
