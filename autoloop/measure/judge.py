"""The outcome rules: what a finished training process's exit, result JSON and printed summary
block make of it (ok, crash, timeout, aborted, invalid), and a crash's one-line reason."""

from __future__ import annotations

import math
import re
import signal
from pathlib import Path
from typing import Any

from autoloop.base.status import RunOutcome

ERROR_TAIL_LINES = 40
MAX_REASON_CHARS = 500

# autoresearch's summary keys -> (our key, scale)
REPORTED_KEY_MAP = {
    "peak_vram_mb": ("peak_memory_mb", 1),
    "num_params_M": ("num_params", 1_000_000),
    "total_tokens_M": ("total_tokens", 1_000_000),
}


def judge(
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
