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
   (autoloop.measure.evaluation), from the commit's files copied into run_dir/source; `verify`
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
import shutil
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoloop.measure.job import JobResult, MeasureJob
from autoloop.measure.run_folder import RunFolder
from autoloop.base.files import copy_regular_files
from autoloop.base.status import RunOutcome
from autoloop.measure.runner import run_training
from autoloop.trust.import_root import trusted_python_path
from autoloop.store import MetricSource

# Per-run fields copied from the result JSON into the measurement and the trial row.
RESULT_FIELDS = ("training_seconds", "total_seconds", "compile_seconds", "eval_seconds", "num_steps",
                 "total_tokens", "num_params", "mfu_percent", "peak_memory_mb")
_INTEGER_FIELDS = ("num_steps", "total_tokens", "num_params")
# The evaluation's deadline: interpreter and torch start-up, model rebuild, one or two
# evaluations, on a slow, shared machine.
EVAL_DEADLINE_FLOOR_SECONDS = 180.0

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


def contract_env(job: MeasureJob, folder: RunFolder) -> dict[str, Any]:
    """The train-script contract's variables for this run (autoloop.harness.contract), plus
    the job's extra environment. The outputs go to the run's `out/`, the compile caches to
    its own `compile/` (set explicitly: a user's TORCHINDUCTOR_CACHE_DIR would be a cache
    every trial writes and every later one reads)."""
    env: dict[str, Any] = {
        "AUTOLOOP_TIME_BUDGET": str(job.time_budget),
        "AUTOLOOP_SEED": str(job.seed),
        "AUTOLOOP_RESULT": str(folder.result),
        "AUTOLOOP_CHECKPOINT": str(folder.checkpoint),
        "AUTOLOOP_PROGRESS": str(folder.progress),
        "AUTOLOOP_DATA_DIR": str(job.data_dir),
        "AUTOLOOP_COMPILE_CACHE": str(folder.compile),
        "TORCHINDUCTOR_CACHE_DIR": str(folder.compile / "inductor"),
        "TRITON_CACHE_DIR": str(folder.compile / "triton"),
    }
    if job.max_steps:
        env["AUTOLOOP_MAX_STEPS"] = str(job.max_steps)
    env.update(job.env or {})
    return env


def _pycache_root(job: MeasureJob) -> Path:
    """Where the trusted bytecode prefixes of this project live (autoloop.trust.bytecode)."""
    return Path(job.pycache_root) if job.pycache_root else _cache_root(job)


def _pycache_prefixes(job: MeasureJob) -> list[Path]:
    from autoloop.trust.bytecode import PYCACHE_KINDS, pycache_dir

    return [pycache_dir(kind, _pycache_root(job)) for kind in PYCACHE_KINDS]


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
    if not job.script:
        from autoloop.errors import AutoloopError

        raise AutoloopError("the train command names no .py file, so the harness cannot rebuild the model: use a "
                            "command like 'python train.py', or run with --no-verify")
    RunFolder(source_dir.parent).fresh(source_dir)
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
                rewarm_bytecode(harness, job.integrity_python or job.python or sys.executable, _pycache_root(job))
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
    in the run folder `run_dir` (autoloop.measure.run_folder: training writes only its out/).

    `on_start(pid, pgid, start_time)`: called at each process start, training's first,
    then the evaluation's model process. `should_abort()`: polled while a process runs;
    once true the run stops and the job ends "aborted". `runner`: the function that runs the
    training process (default autoloop.measure.runner.run_training). Exceptions of the
    worker's own (a full disk, a training command that cannot start, a broken dataset)
    propagate; anything wrong with what the trial wrote is the trial's `invalid`."""
    from autoloop.base.redact import register_files

    project_dir, run_dir = Path(project_dir), Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    register_files(job.hidden)  # the project's secret files: their values never reach a log
    abort = _Abort(should_abort)
    if job.kind == "verify":
        return _verify_job(job, project_dir, run_dir, on_start, abort)
    return _train_job(job, project_dir, run_dir, on_start, abort, runner or run_training)


class CheckpointWatch:
    """When the run's checkpoint file appeared and last changed, seen from outside the trial
    (the runner calls `poll` several times a second), and the training process's CPU time
    meanwhile: the feed records both, and the budget's tail rule (autoloop.trust.budget)
    judges training after the last tick by them. Looks at the file with lstat only, never
    through a link."""

    def __init__(self, folder: RunFolder, feed):
        self.paths = (folder.checkpoint, folder.checkpoint.with_name(folder.checkpoint.name + ".tmp"))
        self.feed = feed
        self.seen: dict[Path, tuple] = {}

    def poll(self) -> None:
        self.feed.sample_cpu()
        for path in self.paths:
            try:
                info = path.lstat()
            except OSError:
                continue
            key = (info.st_ino, info.st_size, info.st_mtime_ns)
            if self.seen.get(path) != key:
                self.seen[path] = key
                self.feed.mark_checkpoint(info.st_size)


def _train_job(job: MeasureJob, project_dir: Path, run_dir: Path, on_start: OnStart | None, abort: _Abort,
               runner: Callable[..., RunOutcome]) -> JobResult:
    from autoloop.measure.limits import TrialLimits
    from autoloop.measure.probe import around_training
    from autoloop.measure.sandbox import SandboxPaths, project_files

    limits = TrialLimits.from_dict(job.limits)
    folder = RunFolder(run_dir)
    folder.prepare_training()
    data_dir = Path(job.data_dir)
    env = contract_env(job, folder)
    # Training imports the harness it is measured by, not whichever autoloop the
    # interpreter would find first (autoloop.trust.import_root).
    env["PYTHONPATH"] = trusted_python_path(env, _cache_root(job))
    python = job.python or sys.executable
    feed = None
    readonly = project_files(project_dir)  # what git tracks: never an untracked .env, the db or .git
    sandbox = None
    watch = None
    if job.compile_seed and Path(job.compile_seed).is_dir():
        # The run's trusted compile cache (filled by the baseline, the user's own code):
        # copied in, so this run starts warm and whatever it writes dies with its folder.
        copy_regular_files(Path(job.compile_seed), folder.compile)
    if job.harness_mode:
        from autoloop.harness.data import make_meta_only_view
        from autoloop.harness.feed import FeedServer
        from autoloop.measure.sandbox import detect
        from autoloop.trust.bytecode import pycache_dir, pycache_env, warm_pycache

        sandbox = detect(job.sandbox)
        feed = FeedServer(data_dir, folder.feed / "feed.sock", seed=job.seed, memory_budget=limits.feed_bytes)
        watch = CheckpointWatch(folder, feed)
        env["AUTOLOOP_FEED"] = None
        readonly.append(folder.feed)
        if job.external_eval:
            view = make_meta_only_view(data_dir, folder.fresh(folder.data))
            env.update({"AUTOLOOP_DATA_DIR": str(view), "AUTOLOOP_EVAL": "external"})
            readonly.append(view)
        else:
            readonly.append(data_dir)  # --no-verify: training reads its data itself, wherever it lies
        # Training reads bytecode from a prefix only a trusted warm-up writes (before the
        # snapshot: the warm-up is what an honest run finds, not a change).
        env.update(pycache_env("train", _pycache_root(job)))
        warm_pycache("train", python, _pycache_root(job))
        readonly.append(pycache_dir("train", _pycache_root(job)))
    else:
        readonly.append(data_dir)
    before = _snapshot(job) if job.harness_mode else None
    from autoloop.measure.stop_watch import StopWatch

    stop = StopWatch.from_job(job, folder.progress)  # a clear loser's run ends early (loop.stops)

    def started(pid: int, pgid: int, start_time: int | None) -> None:
        if feed is not None:
            feed.mark_spawn(pid=pid)  # the root of the tree whose CPU the start-up rule reads
        if on_start is not None:
            on_start(pid, pgid, start_time)

    sandbox_paths = SandboxPaths(
        writable=(folder.out, folder.compile), readonly=tuple(readonly),
        # The data splits stay out of reach: batches come from the feed only.
        hidden=tuple(Path(p) for p in job.hidden) + ((data_dir,) if job.external_eval else ()),
    )
    speed = around_training(step_mode=job.max_steps is not None)  # the machine's speed (autoloop.decide.confound)
    try:
        if feed is not None:
            feed.start()
            env["AUTOLOOP_FEED"] = str(feed.address)
        outcome = runner(
            job.train_argv, cwd=project_dir, env=env, log_path=folder.log,
            deadline_seconds=job.time_budget + job.grace_seconds, on_start=started,
            should_abort=stop.wrap(abort) if stop is not None else abort,
            sandbox=sandbox, sandbox_paths=sandbox_paths, **({"on_poll": watch.poll} if watch is not None else {}),
            limits=limits, watched=folder.writable(),
        )
    finally:
        if feed is not None:
            if watch is not None:
                watch.poll()
            feed.mark_exit()
            feed.close()
    summary = feed.summary() if feed is not None else None
    out = JobResult(outcome.status, outcome.reason, outcome.metric,
                    outcome.metric_source if outcome.metric is not None else None,
                    fields=_fields(outcome), result=outcome.result, device=device_name(outcome.result, env))
    out.fields["machine_speed"] = speed.end()

    def ended(status: str, reason: str | None) -> JobResult:
        out.status, out.reason = status, reason
        if status != "ok":
            out.metric = out.metric_source = out.heldout = None
        if status == "ok" and job.compile_seed and job.role == "baseline" and not Path(job.compile_seed).exists():
            copy_regular_files(folder.compile, Path(job.compile_seed))  # the user's own code filled it
        shutil.rmtree(folder.compile, ignore_errors=True)  # nothing a trial wrote outlives its run
        return out

    stopped = stop is not None and stop.stopped and outcome.status == "aborted" and not abort()
    if outcome.status == "aborted" and not stopped:
        return ended("aborted", "interrupted by the user")
    if job.harness_mode:
        problem, out.pause, out.repaired = _integrity_problem(job, before, outcome, summary)
        if problem:
            return ended("invalid", problem)
    over = outcome.limit or _feed_over_budget(summary)
    if over:
        folder.discard_outputs()  # its junk: nothing of a trial over a limit is read or kept
        return ended("invalid", over)
    if stopped:
        out.fields["stopped_at"] = stop.reached
        return ended("stopped", stop.why)
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
                                        max_steps=job.max_steps, startup_reference=job.startup_reference,
                                        # the baseline's first run is the reference (the user's code, compiled cold)
                                        judge_startup=job.role != "baseline" or job.startup_reference is not None)
        out.fields["budget"] = figures
        if problem:
            return ended("invalid", problem)
    if job.external_eval and outcome.metric_source != MetricSource.REPORTED.value:
        if not folder.has_checkpoint():
            return ended("invalid", (
                "wrote a result JSON but no checkpoint, so the harness cannot evaluate it: save the trained model "
                "to $AUTOLOOP_CHECKPOINT with autoloop.harness.save_checkpoint"))
        evaluated = _evaluate(job, project_dir, folder, outcome.result or {}, verify=job.verify,
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


def _feed_over_budget(summary: dict | None) -> str | None:
    """The data feed refused a stream for its memory budget: the trial's request, its fault."""
    from autoloop.measure.limits import LIMIT_PREFIX

    over = (summary or {}).get("over_budget")
    return LIMIT_PREFIX + str(over.get("reason") or "asked the data feed for more than its budget") if over else None


def _evaluate(job: MeasureJob, project_dir: Path, folder: RunFolder, result: dict, *, verify: bool,
              on_start: OnStart | None, abort: _Abort, checkpoint: Path | None = None):
    """val_bpb (and, with verify, held-out) of the run's checkpoint, by the harness's scorer
    in a process of its own, the model in another (autoloop.measure.evaluation)."""
    from autoloop.measure.limits import TrialLimits
    from autoloop.measure.sandbox import detect
    from autoloop.trust.bytecode import pycache_env, warm_pycache
    from autoloop.measure.evaluation import evaluate_checkpoint

    script = write_sources(job, folder.source)
    device = "cpu" if str(result.get("device", "cpu")).lower() == "cpu" else "cuda"
    splits = ["val", "heldout"] if verify else ["val"]
    python = job.python or sys.executable
    warm_pycache("eval", python, _pycache_root(job))
    checkpoint = Path(checkpoint) if checkpoint is not None else folder.checkpoint
    out_dir = folder.evaluation(verify)
    if out_dir.exists():
        RunFolder(folder.root).fresh(out_dir)
        out_dir.rmdir()
    return evaluate_checkpoint(
        python=python, project_dir=project_dir, source_dir=folder.source,
        script=script.relative_to(folder.source).as_posix(),
        checkpoint_base=checkpoint.parent.parent, checkpoint=f"{checkpoint.parent.name}/{checkpoint.name}",
        data_dir=Path(job.data_dir), device=device, splits=splits, out_dir=out_dir, sandbox=detect(job.sandbox),
        deadline_seconds=max(EVAL_DEADLINE_FLOOR_SECONDS, job.grace_seconds), on_start=on_start, should_abort=abort,
        env=dict(job.env or {}) or None, hidden=[Path(p) for p in job.hidden],
        pycache=pycache_env("eval", _pycache_root(job)), cache=_cache_root(job),
        limits=TrialLimits.from_dict(job.limits),
        probe_power=job.probe_power, probe_noise=job.probe_noise, probe_factor=job.probe_factor,
    )


def _verify_job(job: MeasureJob, project_dir: Path, run_dir: Path, on_start: OnStart | None,
                abort: _Abort) -> JobResult:
    """Held-out (and val again, with its causality probes) for a run's existing checkpoint;
    val and its probes only when the job does not `verify` (the --no-verify re-check)."""
    folder = RunFolder(run_dir)
    checkpoint = Path(job.checkpoint) if job.checkpoint else folder.checkpoint
    result = job.result or {}
    if not RunFolder(checkpoint.parent.parent).has_checkpoint():
        return JobResult("invalid", f"the checkpoint of its run at seed {job.seed} is gone, so it cannot be verified",
                         result=result)
    evaluated = _evaluate(job, project_dir, folder, result, verify=job.verify, on_start=on_start, abort=abort,
                          checkpoint=checkpoint)
    fields = {"eval_seconds": evaluated.seconds, "probe_power": (evaluated.causality or {}).get("power")}
    if not evaluated.ok:
        status = "aborted" if evaluated.status == "aborted" or abort() else "invalid"
        return JobResult(status, evaluated.reason, heldout=evaluated.heldout_bpb, fields=fields, result=result,
                         device=device_name(result, job.env))
    source = MetricSource.VERIFIED.value if job.verify else MetricSource.HARNESS.value
    return JobResult("ok", None, metric=evaluated.val_bpb, metric_source=source,
                     heldout=evaluated.heldout_bpb, fields=fields, result=result, device=device_name(result, job.env))


# ---------------------------------------------------------------------------------------
# python -m autoloop.measure.worker JOB_JSON --control-fd N
# ---------------------------------------------------------------------------------------


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
    bytecode.mark_warmed(tuple(key) for key in keys if isinstance(key, list) and len(key) == 4)


class ControlChannel:
    """The worker's side of its pipes to the slot (autoloop.measure.executors.local): process
    starts and the result go out as JSON lines on the control descriptor; "abort" (or the
    end of stdin: the slot is gone) comes in on stdin. Nothing travels through a file the
    trial's training could write."""

    def __init__(self, fd: int):
        self.out = os.fdopen(fd, "w", buffering=1)
        self.aborted = False

    def send(self, **message) -> None:
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()

    def should_abort(self) -> bool:
        import select

        while not self.aborted:
            ready, _, _ = select.select([sys.stdin], [], [], 0)
            if not ready:
                break
            line = sys.stdin.readline()
            if not line or line.strip() == "abort":
                self.aborted = True
        return self.aborted


def main(argv: list[str] | None = None) -> int:
    """Run the job in JOB_JSON and send its JobResult on the control descriptor; exit 0 when sent.

    The job file names project_dir and run_dir. Each process start is sent as
    {"started": [pid, pgid, start_time]}, the result as {"result": {...}}. A line "abort"
    on stdin, or stdin closing, stops the run. A failure of the worker itself (an
    exception: a full disk, a broken dataset) sends no result: the traceback goes to
    stderr and the exit code is 1."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m autoloop.measure.worker")
    parser.add_argument("job", type=Path)
    parser.add_argument("--control-fd", type=int, required=True)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    job = MeasureJob.from_json(args.job.read_text())
    if not job.project_dir or not job.run_dir:
        print(f"{args.job}: the job names no project_dir or run_dir", file=sys.stderr)
        return 2
    channel = ControlChannel(args.control_fd)
    _inherit_warm_pycache()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _terminate)

    def on_start(pid: int, pgid: int, start_time: int | None) -> None:
        channel.send(started=[pid, pgid, start_time])

    try:
        result = run_job(job, project_dir=job.project_dir, run_dir=job.run_dir, on_start=on_start,
                         should_abort=channel.should_abort)
    except Exception:
        traceback.print_exc()
        return 1
    channel.send(result=result.to_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main())
