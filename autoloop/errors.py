"""The one exception type for errors a user can cause.

Its message is a single line that names the problem and the fix; the CLI prints it
without a traceback and exits non-zero.
"""


class AutoloopError(Exception):
    """A problem the user can fix; str(error) is one line naming the problem and the fix."""
