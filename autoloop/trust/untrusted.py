"""Reading what a trial wrote: without following links, within limits, as data to validate.

A training run writes into one folder (its run's `out/`); everything there is the
trial's: a file may be a symbolic link to the user's `.env`, a FIFO that blocks the
reader, a sparse file of a terabyte, a JSON object nested a million deep, a number no
database takes. Trusted code reads such files only through this module:

* `open_beneath(base, relative)` walks from a folder the controller created, one path
  component at a time with O_NOFOLLOW (a link anywhere on the way is refused, also an
  `out` folder swapped for a link by an unsandboxed trial), and opens only regular files
  (O_NONBLOCK, so a FIFO cannot block; fstat checks the type);
* `read_bytes` / `read_tail` read at most a cap;
* `read_json_object` parses capped bytes into a dict and `clean_result` validates the
  result JSON's figures (finite, in range, of the right type) and caps its texts;
* `text` decodes anything with replacement and caps it;
* `tail_text`, `tail_lines`, `progress_records`, `last_progress` read a log's or a
  progress file's end for `status`, `show` and `autoloop serve`: a bad file reads as
  nothing there (they never raise), and a progress line counts only if it is a JSON
  object of at most MAX_PROGRESS_LINE characters, only its known fields with finite
  numbers of a sane size kept.

A problem is an `UntrustedFile` exception with a one-line reason naming the file: the
trial's failure (`invalid`), never the controller's.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

MAX_RESULT_BYTES = 4 << 20
MAX_TEXT_CHARS = 300
MAX_CURVE_POINTS = 4096
MAX_INT = 2**53  # what a float and SQLite's INTEGER both hold exactly
MAX_FLOAT = 1e18
MAX_JSON_DEPTH = 20
MAX_NESTED_CHARS = 8192  # a small structure outside the contract (a script's own notes) is kept, as JSON


class UntrustedFile(Exception):
    """A file the trial wrote cannot be used (a link, not a regular file, too big, malformed)."""


def open_beneath(base: Path | str, relative: Path | str) -> int:
    """A read-only descriptor of `base/relative`, refusing links and non-regular files on
    the way; the caller closes it."""
    parts = [p for p in Path(relative).parts if p not in ("", ".")]
    if not parts or any(p == ".." for p in parts) or Path(relative).is_absolute():
        raise UntrustedFile(f"{relative}: not a plain relative path")
    flags_dir = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(str(base), flags_dir)
    except OSError as exc:
        raise UntrustedFile(f"{base}: cannot be opened ({exc.strerror})") from None
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, flags_dir, dir_fd=fd)
            except OSError as exc:
                why = "a symbolic link" if exc.errno in (errno.ELOOP, errno.ENOTDIR) else exc.strerror
                raise UntrustedFile(f"{Path(relative)}: {part} is {why}") from None
            os.close(fd)
            fd = nxt
        try:
            leaf = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except FileNotFoundError:
            raise
        except OSError as exc:
            why = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
            raise UntrustedFile(f"{Path(relative)} is {why}: a trial's output must be a regular file") from None
    finally:
        os.close(fd)
    info = os.fstat(leaf)
    if not stat.S_ISREG(info.st_mode):
        os.close(leaf)
        raise UntrustedFile(f"{Path(relative)} is not a regular file: a trial's output must be one")
    return leaf


def read_bytes(base: Path | str, relative: Path | str, max_bytes: int) -> bytes:
    """The whole file, at most `max_bytes` (more is an UntrustedFile)."""
    fd = open_beneath(base, relative)
    try:
        if os.fstat(fd).st_size > max_bytes:
            raise UntrustedFile(f"{Path(relative)} is larger than the {max_bytes >> 10} KB allowed")
        data = os.read(fd, max_bytes + 1)
        chunks = [data]
        while data and sum(map(len, chunks)) <= max_bytes:
            data = os.read(fd, max_bytes + 1)
            chunks.append(data)
        blob = b"".join(chunks)
        if len(blob) > max_bytes:
            raise UntrustedFile(f"{Path(relative)} is larger than the {max_bytes >> 10} KB allowed")
        return blob
    finally:
        os.close(fd)


def read_tail(base: Path | str, relative: Path | str, max_bytes: int) -> bytes:
    """At most the last `max_bytes` of the file."""
    fd = open_beneath(base, relative)
    try:
        size = os.fstat(fd).st_size
        os.lseek(fd, max(0, size - max_bytes), os.SEEK_SET)
        return os.read(fd, max_bytes)
    finally:
        os.close(fd)


def text(data: bytes | str | None, limit: int = MAX_TEXT_CHARS) -> str | None:
    """Untrusted bytes or text as one capped str (invalid UTF-8 replaced)."""
    if data is None:
        return None
    value = data.decode("utf-8", "replace") if isinstance(data, (bytes, bytearray)) else str(data)
    value = value.replace("\x00", "")
    return value if len(value) <= limit else value[: limit - 3] + "..."


def _depth(value: Any, limit: int) -> int:
    stack, deepest = [(value, 1)], 1
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def read_json_object(base: Path | str, relative: Path | str, max_bytes: int = MAX_RESULT_BYTES) -> dict:
    """A JSON object the trial wrote (NaN and Infinity are read as floats, for `clean_result`)."""
    raw = read_bytes(base, relative, max_bytes)
    try:
        value = json.loads(raw.decode("utf-8", "replace"))
    except (ValueError, RecursionError) as exc:
        raise UntrustedFile(f"{Path(relative)} is not valid JSON ({text(str(exc), 120)})") from None
    if not isinstance(value, dict):
        raise UntrustedFile(f"{Path(relative)} is not a JSON object")
    if _depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise UntrustedFile(f"{Path(relative)} is nested deeper than {MAX_JSON_DEPTH} levels")
    return value


# The result JSON's figures (the train-script contract): name -> integer?
NUMBERS = {
    "val_bpb": False, "training_seconds": False, "total_seconds": False, "compile_seconds": False,
    "eval_seconds": False, "peak_memory_mb": False, "mfu_percent": False, "total_tokens": True, "num_steps": True,
    "num_params": True, "tokens_per_second": False, "ms_per_step": False, "flops_per_token": False,
    "executed_flops_per_token": False, "model_tflops": False, "executed_tflops": False, "hfu_percent": False,
    "depth": True, "model_dim": True, "batch_tokens": True, "seed": True,
}
CURVE_KEYS = ("step", "seconds", "loss", "lr", "grad_norm", "progress")


def check_number(name: str, value: Any, *, integer: bool = False) -> float | int | None:
    """`value` as a finite number in range (None stays None); an UntrustedFile otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UntrustedFile(f"result JSON: {name} = {text(repr(value), 60)} is not a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise UntrustedFile(f"result JSON: {name} = {value} is not a finite number")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise UntrustedFile(f"result JSON: {name} = {value} is not a whole number")
        if not -MAX_INT <= value <= MAX_INT:
            raise UntrustedFile(f"result JSON: {name} = {text(repr(value), 40)} is out of range")
        return int(value)
    if not -MAX_FLOAT <= value <= MAX_FLOAT:
        raise UntrustedFile(f"result JSON: {name} = {text(repr(value), 40)} is out of range")
    return float(value)


def clean_result(result: dict) -> dict:
    """The result JSON with its contract figures checked (finite, in range, of their type),
    its curve checked and capped, its other scalars kept as capped text or checked
    numbers, small structures (MAX_NESTED_CHARS as JSON) kept as they are, and anything
    else dropped. Raises UntrustedFile on a bad contract figure."""
    clean: dict[str, Any] = {}
    for key, value in list(result.items())[:200]:
        name = text(str(key), 60)
        if name == "val_bpb" and isinstance(value, float) and not math.isfinite(value):
            clean[name] = value  # a diverged run's own number: the runner calls that a crash
        elif name in NUMBERS:
            clean[name] = check_number(name, value, integer=NUMBERS[name])
        elif name == "curve":
            clean["curve"] = clean_curve(value)
        elif isinstance(value, bool) or value is None:
            clean[name] = value
        elif isinstance(value, (int, float)):
            try:
                clean[name] = check_number(name, value, integer=isinstance(value, int))
            except UntrustedFile:
                continue  # a figure outside the contract: not worth failing the run for
        elif isinstance(value, str):
            clean[name] = text(value)
        elif isinstance(value, (dict, list)):
            try:
                encoded = json.dumps(value, allow_nan=False)
            except (TypeError, ValueError):
                continue  # non-finite numbers inside: not a figure anyone reads
            if len(encoded) <= MAX_NESTED_CHARS:
                clean[name] = value
    return clean


def clean_curve(points: Any) -> list[dict]:
    if not isinstance(points, list):
        raise UntrustedFile("result JSON: curve is not a list")
    curve = []
    for point in points[:MAX_CURVE_POINTS]:
        if not isinstance(point, dict):
            continue
        row = {}
        for key in CURVE_KEYS:
            value = point.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                    and abs(value) <= MAX_FLOAT:
                row[key] = value
        if "loss" in row:
            curve.append(row)
    return curve


# ---------------------------------------------------------------------------------------
# Logs and progress files, for the review and the live page (never raise)
# ---------------------------------------------------------------------------------------

MAX_PROGRESS_LINE = 4096  # a progress line is ~200 characters; longer ones are not progress
PROGRESS_TAIL_BYTES = 256 * 1024  # ~1,200 progress lines: a whole run at LOG_EVERY = 10
# Numeric fields of a progress line (train.py's ProgressWriter records) worth showing.
PROGRESS_FIELDS = ("step", "progress", "loss", "lr", "grad_norm", "tokens_per_second", "training_seconds",
                   "seconds_left", "mfu_percent")
_PROGRESS_LIMIT = 1e15  # larger numbers are not steps, losses or seconds


def tail_text(path: str | Path, max_bytes: int = 65536) -> str | None:
    """The last `max_bytes` of a regular file as text (a line cut by the cap dropped), or
    None when the path is missing, a link, not a regular file, or unreadable."""
    path = Path(path)
    try:
        fd = open_beneath(path.parent, path.name)
    except (OSError, ValueError, UntrustedFile):
        return None
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - max_bytes)
        data = os.pread(fd, min(size, max_bytes), start) if size else b""
    except OSError:
        return None
    finally:
        os.close(fd)
    value = data.decode("utf-8", errors="replace")
    if start > 0:
        cut = value.find("\n")
        value = value[cut + 1:] if cut >= 0 else ""  # the first line is probably cut
    return value


def tail_lines(path: str | Path, count: int, max_bytes: int = 65536, max_line: int = 2000) -> list[str] | None:
    """The last `count` lines of a file read by `tail_text`, each cut to `max_line`
    characters; None when the file cannot be read safely."""
    value = tail_text(path, max_bytes)
    if value is None:
        return None
    lines = value.splitlines()[-count:] if count > 0 else []
    return [line if len(line) <= max_line else line[:max_line - 1] + "\u2026" for line in lines]


def _progress_number(value) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if abs(value) <= _PROGRESS_LIMIT else None


def progress_record(line: str) -> dict | None:
    """One progress line as {field: number} for the known fields, or None when the line is
    not a JSON object of a sane size."""
    line = line.strip()
    if not line or len(line) > MAX_PROGRESS_LINE or not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    out = {}
    for name in PROGRESS_FIELDS:
        value = _progress_number(record.get(name))
        if value is not None:
            out[name] = value
    if "step" in out:
        out["step"] = int(out["step"])
    return out or None


def progress_records(path: str | Path, max_bytes: int = PROGRESS_TAIL_BYTES) -> list[dict]:
    """The readable progress records at the end of a progress file, oldest first."""
    value = tail_text(path, max_bytes)
    if not value:
        return []
    return [r for r in (progress_record(line) for line in value.splitlines()) if r is not None]


def last_progress(path: str | Path | None) -> dict | None:
    """The last readable progress record of a file (reads only its last 4 KB)."""
    if path is None:
        return None
    records = progress_records(path, 4096)
    return records[-1] if records else None
