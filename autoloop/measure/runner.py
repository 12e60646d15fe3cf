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

import math
import os
import re
import secrets
import select
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoloop.errors import AutoloopError
from autoloop.base.environment import allowed_environment
from autoloop.base.processes import (  # noqa: F401 - the process half of a run, re-exported for its users
    KILL_WAIT_SECONDS,
    kill_process_group,
    proc_stat,
    process_group_alive,
    process_start_time,
    signal_group,
    stop_group,
    wait_group_gone,
)
from autoloop.base.status import RunOutcome
from autoloop.measure.sandbox import SandboxPaths, SandboxPolicy

if TYPE_CHECKING:
    from autoloop.measure.limits import TrialLimits

TRIAL_MARKER = "AUTOLOOP_TRIAL_MARKER"
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
ERROR_TAIL_LINES = 40
# Only the end of a log matters for the summary block, the FAIL line and the error tail.
MAX_LOG_READ_BYTES = 2 * 1024 * 1024
MAX_REASON_CHARS = 500

# autoresearch's summary keys -> (our key, scale)
REPORTED_KEY_MAP = {
    "peak_vram_mb": ("peak_memory_mb", 1),
    "num_params_M": ("num_params", 1_000_000),
    "total_tokens_M": ("total_tokens", 1_000_000),
}


def gpu_busy_report() -> list[str]:
    """`pid, process_name, used_memory` lines for processes on the GPU, per nvidia-smi;
    empty when nvidia-smi is missing or fails."""
    from autoloop.envinfo import nvidia_smi_query

    return nvidia_smi_query("--query-compute-apps=pid,process_name,used_memory")


def child_environment(extra: dict[str, Any]) -> dict[str, str]:
    """A child process's environment (see `autoloop.base.environment.allowed_environment`)."""
    return allowed_environment(extra)


# ---------------------------------------------------------------------------------------
# No process of a trial outlives it
# ---------------------------------------------------------------------------------------

_subreaper_lock = threading.Lock()
_subreaper_users = 0


def _set_child_subreaper(on: bool) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class _ChildSubreaper:
    """This process is a child subreaper while at least one unsandboxed trial runs (trials
    may run in threads side by side); afterwards orphans go to init again, as for any
    program. A sandboxed trial needs none: its PID namespace dies with it, and bubblewrap's
    inner process, orphaned at the end, would only become our zombie."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def __enter__(self) -> "_ChildSubreaper":
        global _subreaper_users
        if not self.enabled:
            return self
        with _subreaper_lock:
            if _subreaper_users == 0:
                _set_child_subreaper(True)
            _subreaper_users += 1
        return self

    def __exit__(self, *exc: object) -> None:
        global _subreaper_users
        if not self.enabled:
            return
        with _subreaper_lock:
            _subreaper_users -= 1
            if _subreaper_users == 0:
                _set_child_subreaper(False)


def _marked_pids(needle: bytes) -> list[int]:
    """Live processes whose initial environment holds `needle` (a zombie's reads empty)."""
    pids = []
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as handle:
                environ = handle.read()
        except OSError:
            continue  # gone, or another user's
        if needle in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def _reap_adopted(pgid: int, pids: set[int]) -> None:
    """Reap the zombies that became our children during the trial: those of its group and
    the marked ones we killed. Only these pids, so no other child's status is stolen."""
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        fields = proc_stat(pid)
        if fields and int(fields[1]) == me and fields[0] == "Z" and (int(fields[2]) == pgid or pid in pids):
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def sweep_trial_processes(marker: str, pgid: int, timeout: float = KILL_WAIT_SECONDS) -> list[int]:
    """SIGKILL every process that carries the trial's marker until none is left (a process
    may fork while we look), then reap those that are our zombies. Returns the pids killed.
    Call it after the trial's main process was reaped."""
    needle = f"{TRIAL_MARKER}={marker}".encode()
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    if os.path.isdir("/proc/self"):
        while True:
            found = _marked_pids(needle)
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except (ProcessLookupError, PermissionError):
                    pass
            if not found or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        _reap_adopted(pgid, killed)
    return sorted(killed)


class _ExitWatch:
    """Detects that the child exited without reaping it (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.fd: int | None = None
        if hasattr(os, "pidfd_open"):
            try:
                # Readable once the process exits: lets wait() wake at once instead of
                # at the next poll tick.
                self.fd = os.pidfd_open(proc.pid)
            except OSError:
                self.fd = None

    def exited(self) -> bool:
        if not hasattr(os, "waitid"):
            return self.proc.poll() is not None  # reaps; acceptable where waitid is missing
        try:
            info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True  # already reaped
        return info is not None

    def wait(self, timeout: float) -> bool:
        if timeout > 0:
            if self.fd is not None:
                select.select([self.fd], [], [], timeout)
            else:
                time.sleep(timeout)
        return self.exited()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# ---------------------------------------------------------------------------------------
# Logs through a pipe we own; the child dies with its parent
# ---------------------------------------------------------------------------------------

# How much of a log the runner keeps in memory (for the summary block, the FAIL line and
# the error tail): the log file itself is never read back.
MAX_LOG_MEMORY_BYTES = MAX_LOG_READ_BYTES
MAX_LOG_LINE_BYTES = 64 * 1024


def open_log(path: Path) -> int:
    """A descriptor appending to `path` (created if missing), never through a link: the log
    lives in a folder the controller created, but an unsandboxed trial could plant one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(str(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


# What a log cut at its cap keeps: its first and last bytes (the start-up and the end).
LOG_HEAD_KEEP_BYTES = 64 * 1024
LOG_TAIL_KEEP_BYTES = 256 * 1024


class LogPipe:
    """A child's stdout and stderr: a pipe whose reading end a thread of ours drains into
    the log file, line by line, every line stripped of control characters
    (autoloop.base.text), redacted (autoloop.base.redact) and capped; the last
    MAX_LOG_MEMORY_BYTES stay in memory for the outcome rules, so the log is written but
    never read back (a trial cannot swap the file we would read).

    `max_bytes`: the child's lines stop reaching the file past it (`over` turns true; the
    pipe is still drained, so the child never blocks before the runner kills it), and
    `cut()` leaves the file as its head, a line saying where it was cut, and its tail."""

    def __init__(self, path: Path, *, prefix: str = "", max_bytes: int | None = None):
        from autoloop.base.redact import redact
        from autoloop.base.text import strip_controls

        self.path = Path(path)
        self.prefix = prefix.encode()
        self._clean = lambda text: redact(strip_controls(text))
        self._fd = open_log(self.path)
        self.read_fd, self.write_fd = os.pipe()
        os.set_inheritable(self.write_fd, True)
        self._memory = bytearray()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.max_bytes = max_bytes
        self.written = 0  # the child's bytes that reached the file
        self.dropped = 0  # the child's bytes past max_bytes
        self.unwritten = 0  # the child's bytes the file did not take (a full disk)
        self._head = bytearray()

    def write(self, line: str) -> None:
        """A line of our own (header, footer), cleaned like the child's."""
        self._emit(line.encode() + b"\n", ours=True)

    def _emit(self, data: bytes, ours: bool = False) -> None:
        clean = self._clean(data.decode("utf-8", "replace")).encode()
        if not ours:
            clean = self.prefix + clean
            if self.max_bytes is not None and (self.dropped or self.written + len(clean) > self.max_bytes):
                self.dropped += len(clean)
            else:
                self.written += len(clean)
                try:
                    os.write(self._fd, clean)
                except OSError:  # a full disk (the trial's own doing, perhaps): keep draining, keep the tail
                    self.unwritten += len(clean)
        else:
            os.write(self._fd, clean)
        if len(self._head) < LOG_HEAD_KEEP_BYTES:
            self._head += clean[: LOG_HEAD_KEEP_BYTES - len(self._head)]
        with self._lock:
            self._memory += clean
            if len(self._memory) > MAX_LOG_MEMORY_BYTES:
                del self._memory[: len(self._memory) - MAX_LOG_MEMORY_BYTES]

    def start(self) -> None:
        """After the child is spawned: our copy of the writing end is closed, so the pipe
        ends when the child (and whatever inherited it) is gone."""
        os.close(self.write_fd)
        self.write_fd = -1
        self._thread = threading.Thread(target=self._drain, name="autoloop-log", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        pending = b""
        try:
            while True:
                block = os.read(self.read_fd, 65536)
                if not block:
                    break
                pending += block
                while b"\n" in pending or len(pending) > MAX_LOG_LINE_BYTES:
                    cut = pending.find(b"\n")
                    cut = cut + 1 if 0 <= cut < MAX_LOG_LINE_BYTES else MAX_LOG_LINE_BYTES
                    self._emit(pending[:cut] if pending[:cut].endswith(b"\n") else pending[:cut] + b"\n")
                    pending = pending[cut:]
            if pending:
                self._emit(pending + b"\n")
        except OSError:
            pass

    @property
    def over(self) -> bool:
        """The child printed more than max_bytes."""
        return self.dropped > 0

    def cut(self) -> None:
        """Leave the log as its head, a line saying where and why it was cut, and its tail
        (from memory: the file is never read back). A no-op unless the log went over."""
        if not self.over:
            return
        with self._lock:
            tail = bytes(self._memory[-LOG_TAIL_KEEP_BYTES:])
        tail = tail[tail.find(b"\n") + 1:] if b"\n" in tail else tail  # from a line's start
        total = self.written + self.dropped
        note = (f"# autoloop: {max(0, total - len(self._head) - len(tail))} bytes cut here: the log grew past "
                f"{self.max_bytes} bytes (trial-log-mb); its head and its tail are kept\n").encode()
        os.ftruncate(self._fd, 0)
        os.write(self._fd, bytes(self._head) + (b"" if self._head.endswith(b"\n") else b"\n") + note + tail)

    def finish(self, timeout: float = 5.0) -> None:
        """Wait for the pipe to drain (a process that escaped and holds it is abandoned after
        `timeout`; the sweep kills it)."""
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        self.finish()
        for fd in (self.read_fd, self._fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.read_fd = self._fd = -1

    def text(self) -> str:
        with self._lock:
            return bytes(self._memory).decode("utf-8", "replace")


# Run by the interpreter in front of an unsandboxed command: the kernel kills the command
# when its parent (the worker, the controller) dies, so no training outlives a dead worker.
# (Sandboxed, bubblewrap's --die-with-parent does the same for the whole namespace.)
DIE_WITH_PARENT_SHIM = (
    "import ctypes,os,signal,sys\n"
    "libc=ctypes.CDLL(None,use_errno=True)\n"
    "libc.prctl(1,signal.SIGKILL,0,0,0)\n"  # PR_SET_PDEATHSIG
    "os.getppid()!=int(sys.argv[1]) and os._exit(137)\n"  # the parent died before the line above
    "os.execvp(sys.argv[2],sys.argv[2:])\n"
)


def die_with_parent(argv: list[str]) -> list[str]:
    """`argv` behind the shim above (Linux); unchanged elsewhere."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-S", "-c", DIE_WITH_PARENT_SHIM, str(os.getpid()), *argv]


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
    reaper = _ChildSubreaper(enabled=not sandboxed).__enter__()
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
    watch = _ExitWatch(proc)
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

    outcome = _judge(
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


def _judge(
    text: str,
    *,
    stopped: str | None,
    returncode: int,
    result_path: Path | None,
    deadline_seconds: float,
    sandboxed: bool = False,
    external_eval: bool = False,
    limit: str | None = None,
) -> RunOutcome:
    """Apply the outcome rules to what the process left behind.

    `external_eval` (the run's env asked for AUTOLOOP_EVAL=external): the harness evaluates
    the checkpoint in another process, so exit 0 with a result JSON is "ok" with metric
    None and metric_source "harness" (the contract was followed; the evaluation supplies
    the number). A val_bpb the trial wrote anyway is left in `result` but is never the
    metric. A script with only a printed block keeps today's rules ("reported").
    """
    lines = text.splitlines()
    error_tail = "\n".join(lines[-ERROR_TAIL_LINES:])

    result: dict[str, Any] | None = None
    source: str | None = None
    result_problem: str | None = None
    if result_path is not None:
        from autoloop.trust.untrusted import UntrustedFile, clean_result, read_json_object

        try:
            result, source = clean_result(read_json_object(result_path.parent, result_path.name)), "harness"
        except FileNotFoundError:
            pass
        except UntrustedFile as error:
            result_problem = str(error)
        except OSError as error:
            result_problem = f"result JSON {result_path.name} is unreadable: {error.strerror}"
    if result_problem is not None and stopped is None and returncode == 0:
        return RunOutcome(status="invalid", returncode=returncode, result=None, metric=None, metric_source=None,
                          reason=_one_line(result_problem), error_tail=error_tail, wall_seconds=0.0, pid=0, pgid=0)
    if result is None:
        result = parse_summary_block(text)
        source = "reported" if result is not None else None

    raw_metric = result.get("val_bpb") if result is not None else None
    metric = _as_float(raw_metric)
    finite = metric is not None and math.isfinite(metric)

    def outcome(status: str, reason: str | None) -> RunOutcome:
        return RunOutcome(
            status=status,
            returncode=returncode,
            result=result,
            metric=metric if finite else None,
            metric_source=source if finite else None,
            reason=_one_line(reason) if reason else None,
            error_tail=error_tail,
            wall_seconds=0.0,
            pid=0,
            pgid=0,
        )

    if stopped == "limit":
        over = outcome("invalid", limit)
        over.limit = over.reason
        return over
    if stopped == "timeout":
        return outcome("timeout", f"killed at the {deadline_seconds:g} s deadline")
    if stopped == "aborted":
        return outcome("aborted", "aborted before it finished")
    if returncode != 0:
        return outcome("crash", _crash_reason(lines, returncode, sandboxed))
    if external_eval and source == "harness":
        # Whatever val_bpb the trial wrote is its own claim: the evaluation process decides.
        ok = outcome("ok", None)
        ok.metric, ok.metric_source = None, "harness"
        return ok
    if metric is None:
        reason = "finished without a val_bpb metric"
        if result_problem:
            reason += f" ({result_problem})"
        return outcome("crash", reason)
    if not finite:
        return outcome("crash", f"val_bpb is {metric}")
    return outcome("ok", None)


def _crash_reason(lines: list[str], returncode: int, sandboxed: bool = False) -> str:
    """The last `FAIL: ...` line; else, for a signal death, its name; else the last
    non-empty line (the exception line of a traceback). bubblewrap reports a command
    killed by signal N as exit 128 + N."""
    for line in reversed(lines):
        if line.strip().startswith("FAIL:"):
            return line.strip()
    signum = -returncode if returncode < 0 else (returncode - 128 if sandboxed and 128 < returncode <= 192 else 0)
    if signum:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return f"killed by {name}"
    for index in range(len(lines) - 1, -1, -1):
        if lines[index].strip():
            return _with_source(lines, index)
    return f"exited with code {returncode} and no output"


_BARE_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*:?$")  # `AssertionError`: a traceback's last line, no message
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+)')
_CARETS = re.compile(r"^[\s^~]+$")


def _with_source(lines: list[str], index: int) -> str:
    """The exception line at `index`; a bare one (a failed `assert` without a message says
    only "AssertionError") with the source line the traceback shows for it, so the morning
    review says what broke: `AssertionError: assert n_head % n_kv_head == 0 (train.py line 200)`."""
    last = lines[index].strip()
    if not _BARE_EXCEPTION.match(last):
        return last
    for frame in range(index - 1, max(index - 20, -1), -1):
        found = _FRAME.match(lines[frame])
        if found:
            source = " ".join(line.strip() for line in lines[frame + 1:index] if line.strip() and not _CARETS.match(line))
            if not source:
                break
            return f"{last.rstrip(':')}: {source[:300]} ({Path(found['file']).name} line {found['line']})"
    return last


def parse_summary_block(text: str) -> dict[str, Any] | None:
    """Parse the `key: value` lines after the last line that is exactly `---`.

    Numbers become int or float (nan and inf included), other values stay strings;
    autoresearch's keys are mapped (see REPORTED_KEY_MAP). None if there is no block.
    """
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == "---"]
    if not starts:
        return None
    block: dict[str, Any] = {}
    for line in lines[starts[-1] + 1 :]:
        # Linear in the line (a lazy value before `\s*$` backtracked quadratically on a run of spaces).
        match = re.match(r"^\s*([A-Za-z_][A-Za-z0-9_.]*)\s*:(.*)$", line)
        if match:
            block[match.group(1)] = _parse_scalar(match.group(2).strip())
    for key, (ours, scale) in REPORTED_KEY_MAP.items():
        if key in block:
            value = block.pop(key)
            if isinstance(value, (int, float)) and scale != 1:
                value = int(round(value * scale)) if math.isfinite(value) else value
            block.setdefault(ours, value)
    return block or None


def _parse_scalar(raw: str) -> Any:
    if re.fullmatch(r"[+-]?\d+", raw) and len(raw) <= 19:  # longer: a float (int() refuses past 4,300 digits)
        return int(raw)
    try:
        return float(raw)
    except ValueError:
        return raw


def _as_float(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= MAX_REASON_CHARS else line[: MAX_REASON_CHARS - 3] + "..."


def _default_paths(cwd: str | Path, env: dict[str, Any]) -> SandboxPaths:
    """Without explicit paths: the working folder's tracked files read-only, the contract's
    output folders writable."""
    from autoloop.measure.sandbox import project_files

    outputs = [Path(str(env[name])).parent for name in ("AUTOLOOP_RESULT", "AUTOLOOP_CHECKPOINT", "AUTOLOOP_PROGRESS")
               if env.get(name)]
    return SandboxPaths(writable=tuple(outputs), readonly=tuple(project_files(cwd)))


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
