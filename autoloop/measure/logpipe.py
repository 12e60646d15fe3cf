"""A trial's output through a pipe we own, and a child that dies with its parent.

A thread drains the pipe into the log file, every line stripped of control characters and
redacted (autoloop.base.text, autoloop.base.redact), and keeps in memory only the head and
the tail the outcome rules read: the log file is never read back. Unsandboxed, the command
starts behind a two-line shim that asks the kernel to kill it when its parent dies
(PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path


# Only the end of a log matters for the summary block, the FAIL line and the error tail.
MAX_LOG_READ_BYTES = 2 * 1024 * 1024

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
                    pass
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
