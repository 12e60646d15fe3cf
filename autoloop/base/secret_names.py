"""The names of files that hold secrets by convention (`.env`, keys, credentials).

A module of its own, importing nothing of autoloop's: the sandbox (which leaves such files
out of what a trial sees, even when git tracks them) and redaction (which reads their
values to redact them) both need it, and neither may import the other for it.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

# Files of a project that hold secrets by convention; the sandbox hides them from trials too.
SECRET_FILE_PATTERNS = (".env", ".env.*", "*.env", ".envrc", ".netrc", ".npmrc", ".pypirc", ".git-credentials",
                        "*.pem", "*.key", "id_rsa*", "id_ecdsa*", "id_ed25519*", "credentials", "credentials.*",
                        "secrets.*", ".secrets")


def is_secret_file(path: Path | str) -> bool:
    """Whether the file's name is one that holds secrets by convention (SECRET_FILE_PATTERNS)."""
    return any(fnmatch.fnmatch(Path(path).name, pattern) for pattern in SECRET_FILE_PATTERNS)
