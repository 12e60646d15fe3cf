from autoloop.errors import AutoloopError


class HarnessError(AutoloopError):
    """A harness problem the user can fix (missing or corrupt data, unwritable cache)."""
