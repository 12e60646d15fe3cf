"""One running loop per git working tree: an exclusive `flock` on `<git dir>/autoloop.lock`.

Per working tree, not per tag and not per project folder: a controller checks commits out
in its working tree, so two loops in one tree (two tags, or two project folders of one
repository) would train each other's code. The lock lives in the tree's own git dir
(`.git` for the main tree, `.git/worktrees/<name>` for a linked one), which git never
tracks, so `git worktree add` gives a second loop a place of its own.

The kernel releases the lock when the holder dies, however it dies, so a stale lock file
never blocks a restart. The holder's pid, process start time, tag and project folder are
written into the file for the refusal message and for `autoloop status` (`holder`): a
recorded pid counts as the holder only while that process, with that start time, lives.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import time
from pathlib import Path

from autoloop.errors import AutoloopError

LOCK_NAME = "autoloop.lock"


def lock_path(folder: Path | str) -> Path | None:
    """The lock file of the git working tree holding `folder`, or None outside git."""
    try:
        out = subprocess.run(["git", "rev-parse", "--absolute-git-dir"], cwd=str(folder), capture_output=True, text=True)
    except OSError:
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return Path(out.stdout.strip()) / LOCK_NAME


def _read(path: Path) -> dict | None:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    try:
        info = json.loads(text)
    except ValueError:
        return None
    return info if isinstance(info, dict) and isinstance(info.get("pid"), int) else None


def holder(folder: Path | str) -> dict | None:
    """{pid, start_time, tag, folder, since} of the controller running in `folder`'s working
    tree, or None when no controller runs there."""
    from autoloop.base.processes import process_start_time

    path = lock_path(folder)
    info = _read(path) if path is not None else None
    if info is None:
        return None
    start = process_start_time(info["pid"])
    if start is None or (info.get("start_time") is not None and start != info["start_time"]):
        return None  # the holder died (the kernel released its lock); its pid may be reused
    return info


def describe(info: dict | None) -> str:
    """"run 't' (pid 123, since 09:40:01 UTC)" for a holder; "" for none."""
    if not info:
        return ""
    where = f" in {info['folder']}" if info.get("folder") else ""
    since = f", since {info['since']}" if info.get("since") else ""
    return f"run '{info.get('tag', '?')}' (pid {info['pid']}{since}){where}"


class RunLock:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd: int | None = None

    @classmethod
    def for_folder(cls, folder: Path | str) -> "RunLock":
        path = lock_path(folder)
        if path is None:
            raise AutoloopError(f"{folder} is not in a git working tree: run `git init && git add -A && git commit -m init` first")
        return cls(path)

    def acquire(self, tag: str, folder: Path | str | None = None) -> "RunLock":
        from autoloop.base.processes import process_start_time

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            info = _read(self.path)
            running = describe(info) if info else "another autoloop run (which one is not recorded yet)"
            stop = f"`autoloop stop --tag {info['tag']}`" if info and info.get("tag") else "`autoloop stop`"
            raise AutoloopError(
                f"this working tree already has a running loop: {running}; `autoloop status` shows it. One loop per "
                f"working tree: stop it with {stop} or wait for it to finish, or run in another clone or "
                f"`git worktree add` (requested: run '{tag}')"
            ) from None
        pid = os.getpid()
        info = {"pid": pid, "start_time": process_start_time(pid), "tag": tag,
                "folder": str(Path(folder).resolve()) if folder is not None else None,
                "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return self

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # no stale holder for `autoloop status` to show
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
