"""One controller per run: an exclusive `flock` on `.autoloop/<tag>.lock`.

The kernel releases the lock when the holder dies, however it dies, so a stale lock
file never blocks a restart; the pid written into the file is only for the message.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from autoloop.errors import AutoloopError


class RunLock:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd: int | None = None

    def acquire(self, tag: str) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise AutoloopError(
                f"another autoloop controller (pid {holder}) is already running tag '{tag}': "
                f"stop it with `autoloop stop --tag {tag}` or wait for it to finish"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
