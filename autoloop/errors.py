"""The one exception type for errors a user can cause.

Its message is a single line that names the problem and the fix; the CLI prints it
without a traceback and exits non-zero.
"""


class AutoloopError(Exception):
    """A problem the user can fix; str(error) is one line naming the problem and the fix."""


class NotFound(AutoloopError):
    """A run or a trial the user named is not in the database (the page answers 404)."""


# A full disk is nobody's proposal's fault: it is recognised wherever it surfaces (an
# OSError from our own writes, a message in a training log or in git's or SQLite's
# errors) so that it is reported as what it is and pauses the run.
_DISK_FULL_TEXT = ("no space left on device", "[errno 28]", "database or disk is full", "disk quota exceeded")


class DiskFull(AutoloopError):
    """The disk is full; str(error) is one line naming what failed on it."""


def disk_full_what(exc: BaseException) -> str:
    """What failed on the full disk, in a few words, for a pause reason."""
    if isinstance(exc, OSError) and not isinstance(exc, AutoloopError):
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        return f"{exc.strerror or exc}{where}"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    line = next((line for line in lines if is_disk_full(line)), lines[0] if lines else type(exc).__name__)
    return line[:200]


def is_disk_full(what) -> bool:
    """True for an exception (or text) that says the disk is full: ENOSPC/EDQUOT, SQLite's
    "database or disk is full", or git's "No space left on device" on stderr."""
    import errno

    if what is None:
        return False
    if isinstance(what, BaseException):
        if isinstance(what, DiskFull):
            return True
        if isinstance(what, OSError) and what.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = " ".join(str(part) for part in (what, getattr(what, "stderr", None) or "") if part)
        cause = what.__cause__ or what.__context__
        return any(marker in text.lower() for marker in _DISK_FULL_TEXT) or (cause is not what and is_disk_full(cause))
    return any(marker in str(what).lower() for marker in _DISK_FULL_TEXT)
