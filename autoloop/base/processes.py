"""Process groups: started, watched and killed, and only ours.

Every child autoloop starts (a training run, an evaluation's two processes, a check, a
coding agent, a notify command) leads a process group of its own, so one signal reaches
everything it started. `kill_group` ends a child we hold; `kill_process_group` ends one a
dead controller left, and only when the recorded pid and start time prove it is ours.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from autoloop.errors import AutoloopError

# How long to wait for a SIGKILLed group to disappear; only a process stuck in the kernel
# (e.g. in a GPU driver call) takes longer, and waiting forever would hang the loop.
KILL_WAIT_SECONDS = 10.0


def proc_stat(pid: int | str) -> list[str] | None:
    """Fields 3.. of /proc/<pid>/stat (state first), or None if unreadable.

    The command name (field 2) may contain spaces and parentheses, so split after the
    last ')'.
    """
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return data[data.rindex(")") + 2 :].split()


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (/proc/<pid>/stat field 22), or None
    if there is no such process (or no /proc). Together with the pid it identifies a
    process even after the pid number has been recycled."""
    fields = proc_stat(pid)
    return int(fields[19]) if fields else None


def process_group_alive(pgid: int) -> bool:
    """True if any process other than a zombie is in process group `pgid`."""
    if pgid <= 0:
        return False
    if os.path.isdir("/proc/self"):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                fields = proc_stat(entry.name)
                if fields and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                    return True
        return False
    # No /proc (not Linux): zombies count as alive here.
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def wait_group_gone(pgid: int, timeout: float, before_check: Callable[[], None] | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if before_check is not None:
            before_check()
        if not process_group_alive(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def stop_group(pgid: int, grace: float, before_check: Callable[[], None] | None = None) -> bool:
    """SIGTERM, up to `grace` seconds, then SIGKILL. True if the group is gone."""
    signal_group(pgid, signal.SIGTERM)
    if wait_group_gone(pgid, grace, before_check):
        return True
    signal_group(pgid, signal.SIGKILL)
    return wait_group_gone(pgid, KILL_WAIT_SECONDS, before_check)


def kill_process_group(
    pgid: int,
    *,
    expected_pid: int | None = None,
    expected_start_time: int | None = None,
    grace: float = 5,
) -> bool:
    """Kill a training process group left behind by a controller that died.

    Kills only what is provably ours: if the recorded pid exists but has a different start
    time (or none was recorded), the pid may be someone else's: nothing is killed. If the recorded leader is gone, the group is killed only if processes are still
    in it (orphaned grandchildren; the kernel does not hand out a pid that is still in use
    as a group id). SIGTERM, `grace` seconds, SIGKILL, then waits for the group to vanish.
    Returns True if it signalled a live group.
    """
    if pgid <= 1 or pgid == os.getpgrp():
        raise ValueError(f"refusing to kill process group {pgid}")
    if expected_pid is not None:
        start_time = process_start_time(expected_pid)
        if start_time is not None and start_time != expected_start_time:
            # A leader that is alive but not the one recorded (a recycled pid, or one we were
            # never told the start time of): the group is someone else's.
            return False
    if not process_group_alive(pgid):
        return False
    try:
        stop_group(pgid, grace)
    except PermissionError:
        raise AutoloopError(
            f"cannot kill process group {pgid} (permission denied): kill it yourself "
            f"(`kill -- -{pgid}`) and rerun"
        ) from None
    return True


def kill_group(proc: subprocess.Popen, *, grace: float = 0.0, reap_seconds: float = 5.0) -> None:
    """End a child we started in its own process group, and everything it started: SIGTERM
    and up to `grace` seconds to go (when grace > 0), then SIGKILL; then reap it (its pipes
    drained), never waiting more than `reap_seconds`."""
    for sig, wait in (((signal.SIGTERM, grace),) if grace > 0 else ()) + ((signal.SIGKILL, reap_seconds),):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.communicate(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except (OSError, ValueError):  # pipes already closed by another reader
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue
