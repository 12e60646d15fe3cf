"""The controller's side of a split evaluation: two processes, one channel, one verdict.

`evaluate_checkpoint` measures a trained run's checkpoint (autoloop.harness.evaluate has the
scorer's half, autoloop.harness.model_server the model's, autoloop.harness.channel the
protocol). It is the only place that starts them, and it owns every channel they use:

* the **model process** runs the trial's code: sandboxed with no data file and no writable
  folder (what it writes in its private /tmp dies with it), its working folder the
  commit's files copied into a fresh folder, its checkpoint an inherited read-only
  descriptor opened here without following links (autoloop.trust.untrusted), never a path;
* the **scorer** runs harness code only: it sees the data read-only, writes nothing, runs
  from a folder of ours with autoloop's own import root first on its path (a module the
  trial's files could shadow is never on it), and writes its verdict into a pipe whose
  reading end only this process holds;
* both are connected by a socket pair and a shared memory region created here, log
  through pipes drained here into `eval.log` in a fresh folder this function creates
  (redacted; never read back), start in process groups of their own, die with their
  parent, and are killed at the deadline, on abort and when the scorer is done.

So nothing the trial's code could have written (its run folder, a link planted there, a
cache) is followed, bound, executed or trusted here, and the number comes from a process
that never ran its code.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoloop.trust.import_root import trusted_python_path

EVAL_LOG = "eval.log"
VERDICT_FILE = "verdict.json"
MAX_VERDICT_BYTES = 1 << 20


@dataclass
class EvalResult:
    """One evaluation of a checkpoint.

    ok: the verdict passed. reason: one line when not. status: "ok", "failed" (a verdict
    that failed: the trial's fault), "timeout", "crash" (no verdict), "aborted", or
    "data" (the scorer says the dataset is broken: not the trial's fault).
    fields: the verdict JSON (stage, seconds, causality, ...)."""

    ok: bool
    reason: str | None
    status: str
    val_bpb: float | None = None
    heldout_bpb: float | None = None
    causality: dict | None = None
    seconds: float = 0.0  # wall seconds, spawn to the scorer's exit
    fields: dict = field(default_factory=dict)
    log_path: Path | None = None


class _Child:
    """A process in its own group, logging through a pipe of ours, dying with us."""

    def __init__(self, argv: list[str], *, cwd: Path, env: dict[str, str], log_path: Path, prefix: str,
                 pass_fds: tuple[int, ...], sandbox, readonly: list[Path], hidden: list[Path],
                 max_log_bytes: int | None = None):
        import subprocess

        from autoloop.measure.logpipe import LogPipe, die_with_parent

        if sandbox is not None:  # kinds "none" and "off" leave the command as it is
            argv, env = sandbox.wrap(argv, env=env, cwd=cwd, writable=[], readonly=readonly, hidden=hidden)
        if sandbox is None or sandbox.kind != "bwrap":
            argv = die_with_parent(argv)
        self.log = LogPipe(log_path, prefix=prefix, max_bytes=max_log_bytes)
        try:
            self.proc = subprocess.Popen(argv, cwd=str(cwd), env=env, stdin=subprocess.DEVNULL, stdout=self.log.write_fd,
                                         stderr=subprocess.STDOUT, start_new_session=True, pass_fds=pass_fds)
        except OSError:
            self.log.close()
            raise
        self.log.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        self.kill()
        self.proc.wait()
        self.log.finish()
        self.log.cut()  # a log over its cap: its head and tail (autoloop.measure.logpipe.LogPipe)
        self.log.close()


def evaluate_checkpoint(
    *,
    python: str,
    project_dir: Path,
    source_dir: Path,
    script: str,
    checkpoint_base: Path,
    checkpoint: str,
    data_dir: Path,
    device: str,
    out_dir: Path,
    splits: tuple[str, ...] | list[str] = ("val",),
    sandbox=None,
    deadline_seconds: float,
    on_start: Callable[[int, int, int | None], None] | None = None,
    should_abort: Callable[[], bool] | None = None,
    env: dict[str, Any] | None = None,
    hidden: list[Path] | tuple[Path, ...] = (),
    pycache: dict[str, str | None] | None = None,
    cache: Path | None = None,
    probe_batches: int | None = None,
    limits=None,
    probe_power: bool = False,
    probe_noise: float | None = None,
    probe_factor: int | None = None,
) -> EvalResult:
    """Evaluate `checkpoint_base/checkpoint` (the trial's output, opened without following
    links) with the model of `source_dir/script`, by the harness, in two processes.

    `out_dir`: a folder this call creates for the evaluation's log and verdict (it must not
    exist: nothing an earlier stage wrote is reused). `hidden`: what neither process may see
    (the project's .git, .autoloop, the db, secret files); the model process also does not
    see `data_dir`. `env`: extra environment for both (the slot's CUDA_VISIBLE_DEVICES).
    `pycache`: the bytecode settings (read-only prefix, no writing) for both. `limits`
    (autoloop.measure.limits.TrialLimits): the model process runs the trial's code, so its
    memory, processes and log are the trial's, watched as in training; over one, the
    evaluation fails with the limit named. `probe_power`: as many causality probes as catch
    a next-token peek worth `probe_noise` bpb (None: unknown) with probability 95%
    (autoloop.harness.probe_power), at most `probe_factor` x the scored windows (None: the
    harness's cap): a keep's verification."""
    from autoloop.harness.channel import make_region
    from autoloop.base.processes import process_start_time
    from autoloop.base.environment import allowed_environment
    from autoloop.trust.untrusted import UntrustedFile, open_beneath

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=False)
    log_path = out_dir / EVAL_LOG
    device = "cpu" if device == "cpu" else "cuda"
    splits = tuple(splits)
    if (Path(source_dir) / "autoloop").exists():
        return EvalResult(False, "the trial's files include a folder named autoloop/, which would be imported instead "
                                 "of the installed harness: an editable file may not be named autoloop/...",
                          "failed", log_path=log_path)
    try:
        checkpoint_fd = open_beneath(checkpoint_base, checkpoint)
    except FileNotFoundError:
        return EvalResult(False, "the run saved no checkpoint, so its model cannot be evaluated: save it to "
                                 "$AUTOLOOP_CHECKPOINT with autoloop.harness.save_checkpoint", "failed", log_path=log_path)
    except UntrustedFile as exc:
        return EvalResult(False, f"the checkpoint cannot be read safely: {exc}", "failed", log_path=log_path)

    base_env = allowed_environment({**(env or {}), **(pycache or {}), "PYTHONDONTWRITEBYTECODE": "1"})
    for name in ("AUTOLOOP_RESULT", "AUTOLOOP_CHECKPOINT", "AUTOLOOP_PROGRESS", "AUTOLOOP_EVAL", "AUTOLOOP_FEED",
                 "AUTOLOOP_DATA_DIR", "AUTOLOOP_COMPILE_CACHE"):
        base_env.pop(name, None)
    base_env["PYTHONPATH"] = trusted_python_path(base_env, cache)
    prefix = Path((pycache or {}).get("PYTHONPYCACHEPREFIX") or out_dir)
    region = make_region()
    model_end, scorer_end = socket.socketpair()
    verdict_read, verdict_write = os.pipe()
    model = scorer = None
    started = time.monotonic()
    try:
        model = _Child(
            [python, "-m", "autoloop.harness.model_server", "--train-py", str(Path(source_dir) / script),
             "--device", device, "--checkpoint-fd", str(checkpoint_fd), "--channel-fd", str(model_end.fileno()),
             "--region-fd", str(region)],
            cwd=Path(source_dir), env=dict(base_env), log_path=log_path, prefix="[model] ",
            pass_fds=(checkpoint_fd, model_end.fileno(), region), sandbox=sandbox,
            readonly=[Path(source_dir), prefix], hidden=[*hidden, Path(data_dir), *_dataset_roots(data_dir)],
            max_log_bytes=limits.log_bytes if limits is not None else None,
        )
        if on_start is not None:
            on_start(model.pid, model.pid, process_start_time(model.pid))
        command = [python, "-m", "autoloop.harness.evaluate", "--data-dir", str(data_dir), "--device", device,
                   "--splits", ",".join(splits), "--channel-fd", str(scorer_end.fileno()), "--region-fd", str(region),
                   "--verdict-fd", str(verdict_write)]
        if probe_batches is not None:
            command += ["--probe-batches", str(probe_batches)]
        if probe_power:
            command += ["--probe-noise", "unknown" if probe_noise is None else repr(float(probe_noise))]
            if probe_factor is not None:
                command += ["--probe-factor", str(int(probe_factor))]
        scorer = _Child(command, cwd=out_dir, env=dict(base_env), log_path=log_path, prefix="[scorer] ",
                        pass_fds=(scorer_end.fileno(), region, verdict_write), sandbox=sandbox,
                        readonly=[Path(data_dir), out_dir, prefix], hidden=list(hidden))
    except OSError as exc:
        for child in (model, scorer):
            if child is not None:
                child.close()
        return EvalResult(False, f"the evaluation could not start ({exc})", "crash", log_path=log_path)
    finally:
        for fd in (checkpoint_fd, region, verdict_write):
            os.close(fd)
        model_end.close()
        scorer_end.close()

    verdict_text: list[bytes] = []
    reader = threading.Thread(target=_read_capped, args=(verdict_read, verdict_text), daemon=True)
    reader.start()
    stopped = over = None
    watch = None
    if limits is not None:
        from autoloop.measure.limits import ResourceWatch

        watch = ResourceWatch(limits, {}, log_over=lambda: model.log.over)
        watch.attach(model.pid)
    next_look = 0.0
    try:
        deadline = started + deadline_seconds
        while scorer.proc.poll() is None:
            if time.monotonic() >= deadline:
                stopped = "timeout"
                break
            if should_abort is not None and should_abort():
                stopped = "aborted"
                break
            if watch is not None and time.monotonic() >= next_look:
                next_look = time.monotonic() + 0.2  # as often as the runner looks at training
                over = watch.check()
                if over is not None:
                    stopped = "limit"
                    break
            time.sleep(0.05)
    finally:
        scorer.close()
        model.close()
        reader.join(5)
    seconds = time.monotonic() - started

    def result(ok: bool, reason: str | None, status: str, verdict: dict | None = None) -> EvalResult:
        verdict = verdict or {}
        return EvalResult(ok, reason, status, val_bpb=_number(verdict.get("val_bpb")),
                          heldout_bpb=_number(verdict.get("heldout_bpb")), causality=verdict.get("causality"),
                          seconds=seconds, fields=verdict, log_path=log_path)

    if stopped == "aborted":
        return result(False, "the evaluation was interrupted", "aborted")
    if stopped == "limit":
        return result(False, f"{over} (its model, under evaluation)", "failed")
    if stopped == "timeout":
        return result(False, f"the evaluation did not finish within {deadline_seconds:.0f} s (see {log_path})", "timeout")
    code = scorer.proc.returncode
    if code == 2:
        return result(False, f"the evaluation found the dataset broken (see {log_path})", "data")
    try:
        verdict = json.loads(b"".join(verdict_text).decode("utf-8", "replace"))
        if not isinstance(verdict, dict):
            raise ValueError("not an object")
    except ValueError:
        return result(False, f"the evaluation crashed (exit {code}; see {log_path})", "crash")
    (out_dir / VERDICT_FILE).write_text(json.dumps(verdict, indent=1))
    if not verdict.get("ok"):
        return result(False, verdict.get("reason") or "the evaluation failed without a reason", "failed", verdict)
    return result(True, None, "ok", verdict)


def _read_capped(fd: int, out: list[bytes]) -> None:
    total = 0
    try:
        while total <= MAX_VERDICT_BYTES:
            block = os.read(fd, 65536)
            if not block:
                break
            out.append(block)
            total += len(block)
    finally:
        os.close(fd)


def _number(value: Any) -> float | None:
    import math

    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _dataset_roots(data_dir: Path) -> list[Path]:
    """Where prepared datasets live (all of them, not only this run's), hidden from the model."""
    from autoloop.harness.contract import cache_root

    roots = [cache_root() / "data"]
    parent = Path(data_dir).resolve().parent
    if parent != Path("/") and parent.name == "data":
        roots.append(parent)
    return [p for p in roots if p.exists()]
