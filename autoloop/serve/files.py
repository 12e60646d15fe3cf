"""Reading files that trial code could have written: progress lines, training logs.

Everything under a trial's run folder (`.autoloop/<tag>/trials/<n>/runs/<k>/`) is
writable by the trial's own code, so trusted code reads it as hostile input:

* **No links, no special files.** The file is opened with `O_NOFOLLOW` (a symlink to
  `~/.ssh/id_rsa` is refused, not read) and `O_NONBLOCK` (opening a FIFO the trial made
  returns at once instead of hanging the reader), then `fstat` on the open descriptor
  must say "regular file" (a FIFO, a socket or a device is refused). The check is on the
  descriptor, so a swap between check and read cannot slip another file in.
* **A capped read from the end.** At most `max_bytes` are read, with `pread` at the end of
  the file, so a 50 GB progress file costs what a small one does; a line cut by the cap
  is dropped.
* **Text with replacement.** Bytes are decoded as UTF-8 with `errors="replace"`.
* **Defensive parsing.** A progress line counts only if it is a JSON object of at most
  `MAX_LINE` characters; only known fields with finite numbers of a sane size are kept
  (`progress_record`), everything else is ignored. Nothing read here is ever a reason
  for the reader to fail: a bad file reads as nothing.

`autoloop status`, `autoloop show` and `autoloop serve` read through `read_tail`.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

MAX_LINE = 4096  # a progress line is ~200 characters; longer ones are not progress
PROGRESS_TAIL_BYTES = 256 * 1024  # ~1,200 progress lines: a whole run at LOG_EVERY = 10
# Numeric fields of a progress line (train.py's ProgressWriter records) worth showing.
PROGRESS_FIELDS = ("step", "progress", "loss", "lr", "grad_norm", "tokens_per_second", "training_seconds",
                   "seconds_left", "mfu_percent")
_LIMIT = 1e15  # larger numbers are not steps, losses or seconds


def read_tail(path: str | Path, max_bytes: int = 65536) -> str | None:
    """The last `max_bytes` of a regular file as text (module docstring), or None when
    the path is missing, a link, not a regular file, or unreadable."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except (OSError, ValueError):  # ELOOP (a symlink), ENOENT, EACCES, a NUL in the path
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        size = info.st_size
        start = max(0, size - max_bytes)
        data = os.pread(fd, min(size, max_bytes), start) if size else b""
    except OSError:
        return None
    finally:
        os.close(fd)
    text = data.decode("utf-8", errors="replace")
    if start > 0:
        cut = text.find("\n")
        text = text[cut + 1:] if cut >= 0 else ""  # the first line is probably cut
    return text


def tail_lines(path: str | Path, count: int, max_bytes: int = 65536, max_line: int = 2000) -> list[str] | None:
    """The last `count` lines of a file read by `read_tail`, each cut to `max_line`
    characters; None when the file cannot be read safely."""
    text = read_tail(path, max_bytes)
    if text is None:
        return None
    lines = text.splitlines()[-count:] if count > 0 else []
    return [line if len(line) <= max_line else line[:max_line - 1] + "…" for line in lines]


def _number(value) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if abs(value) > _LIMIT:
        return None
    return value


def progress_record(line: str) -> dict | None:
    """One progress line as {field: number} for the known fields, or None when the line
    is not a JSON object of a sane size (module docstring)."""
    line = line.strip()
    if not line or len(line) > MAX_LINE or not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    out = {}
    for name in PROGRESS_FIELDS:
        value = _number(record.get(name))
        if value is not None:
            out[name] = value
    if "step" in out:
        out["step"] = int(out["step"])
    return out or None


def progress_records(path: str | Path, max_bytes: int = PROGRESS_TAIL_BYTES) -> list[dict]:
    """The readable progress records at the end of a progress file, oldest first."""
    text = read_tail(path, max_bytes)
    if not text:
        return []
    return [r for r in (progress_record(line) for line in text.splitlines()) if r is not None]


def last_progress(path: str | Path) -> dict | None:
    """The last readable progress record of a file (reads only its last 4 KB)."""
    records = progress_records(path, 4096)
    return records[-1] if records else None


def thin(points: list, limit: int) -> list:
    """At most `limit` points, evenly spaced, the first and the last kept."""
    if limit < 2 or len(points) <= limit:
        return list(points)
    step = (len(points) - 1) / (limit - 1)
    return [points[round(i * step)] for i in range(limit)]


def stamp(path: str | Path) -> tuple[int, int] | None:
    """(size, mtime in ns) of a file without following a link: what changed-detection
    compares; None when absent."""
    try:
        info = os.lstat(path)
    except (OSError, ValueError):
        return None
    return info.st_size, info.st_mtime_ns
