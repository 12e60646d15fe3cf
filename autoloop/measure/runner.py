"""Run one training process and read its outcome.

The training command runs in its own session and process group (`start_new_session=True`,
so pgid == pid), stdin from /dev/null, stdout and stderr into a pipe that a thread of ours
drains into the log file (`LogPipe`: every line stripped of control characters and
redacted, autoloop.base.text and autoloop.base.redact; the log is never read back, the
outcome rules read what the pipe brought). Unsandboxed, the
command starts behind a two-line shim that makes the kernel kill it when its parent dies
(PR_SET_PDEATHSIG), so no training outlives a dead worker or controller.
Everything the training started - dataloader workers, compile workers, a stray shell - is
in that group, so the runner stops work by signalling the group, never one pid:

* at the deadline or when `should_abort()` says so: SIGTERM to the group, up to
  `kill_grace_seconds` for it to exit, then SIGKILL;
* after the main process exits on its own: SIGKILL to the group at once, so no grandchild
  (which might ignore SIGTERM) keeps holding the GPU into the next trial.

The main process is not reaped until the group is gone: while it is an unreaped zombie its
pid, which is also the group id, cannot be reused, so signalling the group can never hit an
unrelated process. A process group counts as gone when only zombies are left in it (an
orphaned grandchild that was killed may wait a moment for init to reap it).

The child's environment comes from an allow-list (`autoloop.base.environment.allowed_environment`:
PATH, locale, thread and GPU settings, ...; never a secret, whatever its name), plus
PYTHONUNBUFFERED=1, plus the AUTOLOOP_* contract variables the caller passes, plus a
per-trial marker (AUTOLOOP_TRIAL_MARKER).

With a `SandboxPolicy` of kind "bwrap" the command runs inside bubblewrap
(autoloop/measure/sandbox.py). The group recorded and signalled is bubblewrap's: killing it kills
bubblewrap's inner process (PID 1 of the trial's namespace, through --die-with-parent),
and with it the kernel kills every process in the namespace, `setsid` daemons included. A
SIGTERM therefore ends a sandboxed trial at once, without a grace period inside.

Unsandboxed, a process that left the group (a `setsid` daemon) could outlive the trial, so
for the length of the trial this process is a child subreaper (orphans of the trial become
its children, not init's). After every trial, sandboxed or not, each process whose
/proc/<pid>/environ carries the trial's marker is SIGKILLed (until none is left), and the
zombies of the trial that became our children are reaped; a process that exec'd itself
with a scrubbed environment escapes this sweep, which is why the sandbox is the default.

The result comes from the result JSON (`AUTOLOOP_RESULT`, metric source "harness") if the
script wrote one, else from the final `---` block of `key: value` lines in the log (metric
source "reported"; autoresearch's `peak_vram_mb`, `num_params_M` and `total_tokens_M`
are mapped to `peak_memory_mb`, `num_params` and `total_tokens`).

Crash recovery (a controller that died mid-trial) uses `kill_process_group` with the pid,
pgid and start time the controller stored when the trial started.
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoloop.errors import AutoloopError
from autoloop.base.environment import allowed_environment
from autoloop.base.processes import KILL_WAIT_SECONDS, process_start_time, signal_group, stop_group, wait_group_gone
from autoloop.base.status import RunOutcome
from autoloop.measure.judge import judge
from autoloop.measure.logpipe import LogPipe, die_with_parent
from autoloop.measure.reaper import TRIAL_MARKER, ChildSubreaper, ExitWatch, sweep_trial_processes
from autoloop.measure.sandbox import SandboxPaths, SandboxPolicy

if TYPE_CHECKING:
    from autoloop.measure.limits import TrialLimits


def gpu_busy_report() -> list[str]:
    """`pid, process_name, used_memory` lines for processes on the GPU, per nvidia-smi;
    empty when nvidia-smi is missing or fails."""
    from autoloop.envinfo import nvidia_smi_query

    return nvidia_smi_query("--query-compute-apps=pid,process_name,used_memory")


def child_environment(extra: dict[str, Any]) -> dict[str, str]:
    """A child process's environment (see `autoloop.base.environment.allowed_environment`)."""
    return allowed_environment(extra)


# ---------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------


def run_training(
    command: list[str],
    *,
    cwd: str | Path,
    env: dict[str, Any],
    log_path: str | Path,
    deadline_seconds: float,
    kill_grace_seconds: float = 10,
    on_start: Callable[[int, int, int | None], None] | None = None,
    should_abort: Callable[[], bool] | None = None,
    poll_interval: float = 0.2,
    sandbox: SandboxPolicy | None = None,
    sandbox_paths: SandboxPaths | None = None,
    marker: str | None = None,
    on_poll: Callable[[], None] | None = None,
    pass_fds: tuple[int, ...] = (),
    contract: bool = True,
    limits: "TrialLimits | None" = None,
    watched: dict[str, Path] | None = None,
) -> RunOutcome:
    """Run `command` until it exits, the deadline passes or `should_abort()` is true.

    `env` holds the AUTOLOOP_* contract variables to add. If it names AUTOLOOP_RESULT, a
    file already at that path is deleted first: it cannot be this run's result.
    `on_start(pid, pgid, start_time)` is called right after the spawn so the caller can
    record the group before waiting; if it (or `should_abort`) raises, or the caller is
    interrupted (KeyboardInterrupt), the group is SIGKILLed and the exception propagates.
    The deadline counts from the spawn and covers start-up, compile, training and eval.

    `sandbox` (kind "bwrap") runs the command inside bubblewrap with `sandbox_paths`;
    without paths, the working folder is read-only and the folders of AUTOLOOP_RESULT,
    AUTOLOOP_CHECKPOINT and AUTOLOOP_PROGRESS are writable. pid and pgid are then
    bubblewrap's. Kinds "none" and "off" (and None) run the command as it is.

    `marker` (default: a random one) is the value of AUTOLOOP_TRIAL_MARKER in the child's
    environment; a caller that records it can sweep the trial's processes after a crash of
    its own (`sweep_trial_processes`).

    `contract=False`: the command is not a training script (the evaluator): the log's
    closing line gives its exit and time, not a verdict by the train-script contract (a
    passed evaluation followed by "crash: finished without a val_bpb metric" misleads).

    `limits` (autoloop.measure.limits): the trial's memory, processes, log and the disk of
    the `watched` folders ({"out/": path, ...}) are watched at every poll and after the
    run; a trial over one is SIGKILLed at once and ends "invalid" with the limit named
    (`RunOutcome.limit`), its log cut to a head and a tail. None: no limit.
    """
    log_path = Path(log_path)
    result_path = Path(env["AUTOLOOP_RESULT"]) if env.get("AUTOLOOP_RESULT") else None
    if result_path is not None:
        result_path.unlink(missing_ok=True)

    marker = marker or secrets.token_hex(12)
    argv = [str(part) for part in command]
    child_env = allowed_environment({**env, TRIAL_MARKER: marker})
    if not argv or (shutil.which(argv[0], path=child_env.get("PATH")) is None
                    and not (os.sep in argv[0] and os.access(Path(cwd) / argv[0], os.X_OK))):
        raise AutoloopError(
            f"cannot start the training command {shlex.join(map(str, command))} in {cwd} ({argv[:1] or ['nothing']} "
            "is not an executable on PATH): check the train command and the working directory"
        )
    sandboxed = sandbox is not None and sandbox.kind == "bwrap"
    if sandboxed:
        paths = sandbox_paths if sandbox_paths is not None else _default_paths(cwd, env)
        argv, child_env = sandbox.wrap(
            argv, env=child_env, cwd=cwd, writable=paths.writable, readonly=paths.readonly, hidden=paths.hidden,
        )
    else:
        argv = die_with_parent(argv)

    log = LogPipe(log_path, max_bytes=limits.log_bytes if limits is not None else None)
    resources = None
    if limits is not None:
        from autoloop.measure.limits import ResourceWatch

        resources = ResourceWatch(limits, watched or {}, log_over=lambda: log.over)
    where = f" [sandbox: {sandbox.kind}]" if sandbox is not None else ""
    log.write(f"# autoloop {_now()}: {shlex.join(map(str, command))}{where}")
    started = time.monotonic()
    reaper = ChildSubreaper(enabled=not sandboxed).__enter__()
    try:
        proc = subprocess.Popen(
            argv,
            cwd=str(cwd),
            env=child_env,
            stdin=subprocess.DEVNULL,
            stdout=log.write_fd,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=tuple(pass_fds),
        )
    except OSError as error:
        reaper.__exit__()
        log.close()
        raise AutoloopError(
            f"cannot start the training command {shlex.join(map(str, command))} in {cwd} ({error}): "
            "check the train command and the working directory"
        ) from error
    log.start()
    pid = pgid = proc.pid  # a new session makes the child its group's leader
    start_time = process_start_time(pid)
    watch = ExitWatch(proc)
    # Where zombies cannot be told apart (no /proc), reap the leader as soon as it exits
    # so that the group can be seen to vanish.
    reap = None if os.path.isdir("/proc/self") else proc.poll

    stopped: str | None = None
    over: str | None = None
    if resources is not None:
        resources.attach(pid)
    try:
        if on_start is not None:
            on_start(pid, pgid, start_time)
        deadline = started + deadline_seconds
        while not watch.exited():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stopped = "timeout"
                break
            if should_abort is not None and should_abort():
                stopped = "aborted"
                break
            if resources is not None:
                over = resources.check()
                if over is not None:
                    stopped = "limit"
                    break
            if on_poll is not None:
                on_poll()
            watch.wait(min(poll_interval, remaining))
        if on_poll is not None:
            on_poll()
        if stopped == "limit":  # memory or processes still growing: no grace
            signal_group(pgid, signal.SIGKILL)
            group_gone = wait_group_gone(pgid, KILL_WAIT_SECONDS, reap)
        elif stopped is not None:
            group_gone = stop_group(pgid, kill_grace_seconds, reap)
        else:
            # The main process is done; anything left in its group is a leftover.
            signal_group(pgid, signal.SIGKILL)
            group_gone = wait_group_gone(pgid, KILL_WAIT_SECONDS, reap)
        returncode = proc.wait()
        survivors = sweep_trial_processes(marker, pgid)
    except BaseException:
        signal_group(pgid, signal.SIGKILL)
        proc.wait()
        sweep_trial_processes(marker, pgid)
        log.close()
        raise
    finally:
        watch.close()
        reaper.__exit__()
    wall_seconds = time.monotonic() - started
    log.finish()
    if resources is not None and over is None:
        over = resources.final()  # what it wrote after the last look
        if over is not None and stopped is None:
            stopped = "limit"
    if stopped == "limit":
        resources.discard()  # its junk, before we write a line more: it may have filled the disk

    outcome = judge(
        log.text(),
        stopped=stopped,
        returncode=returncode,
        result_path=result_path,
        deadline_seconds=deadline_seconds,
        sandboxed=sandboxed,
        external_eval=str(env.get("AUTOLOOP_EVAL") or "").strip().lower() == "external",
        limit=over if stopped == "limit" else None,
    )
    outcome.wall_seconds = wall_seconds
    if resources is not None:
        outcome.resources = dict(resources.peak)
    outcome.pid, outcome.pgid, outcome.start_time = pid, pgid, start_time

    footer = f"# autoloop {_now()}: {outcome.status}, exit {returncode}, {wall_seconds:.1f} s"
    if outcome.reason:
        footer += f": {outcome.reason}"
    if not contract and stopped is None:  # not a training script (the evaluator): its own lines say how it went
        footer = f"# autoloop {_now()}: exit {returncode}, {wall_seconds:.1f} s"
    if not group_gone:
        footer += f" (processes of group {pgid} survived SIGKILL)"
    if survivors:
        footer += f" (killed {len(survivors)} process(es) that had left the group: {' '.join(map(str, survivors))})"
    log.write(footer)
    log.cut()
    log.close()
    return outcome


def _default_paths(cwd: str | Path, env: dict[str, Any]) -> SandboxPaths:
    """Without explicit paths: the working folder's tracked files read-only, the contract's
    output folders writable."""
    from autoloop.measure.sandbox import project_files

    outputs = [Path(str(env[name])).parent for name in ("AUTOLOOP_RESULT", "AUTOLOOP_CHECKPOINT", "AUTOLOOP_PROGRESS")
               if env.get(name)]
    return SandboxPaths(writable=tuple(outputs), readonly=tuple(project_files(cwd)))


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
