"""No process of a trial outlives it.

For the length of an unsandboxed trial this process is a child subreaper (orphans of the
trial become its children, not init's); after every trial each process whose
/proc/<pid>/environ carries the trial's marker is SIGKILLed (until none is left) and the
zombies of the trial that became our children are reaped. A process that exec'd itself
with a scrubbed environment escapes this sweep, which is why the sandbox is the default.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time

from autoloop.base.processes import KILL_WAIT_SECONDS, proc_stat

TRIAL_MARKER = "AUTOLOOP_TRIAL_MARKER"
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


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


class ChildSubreaper:
    """This process is a child subreaper while at least one unsandboxed trial runs (trials
    may run in threads side by side); afterwards orphans go to init again, as for any
    program. A sandboxed trial needs none: its PID namespace dies with it, and bubblewrap's
    inner process, orphaned at the end, would only become our zombie."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def __enter__(self) -> "ChildSubreaper":
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


class ExitWatch:
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
