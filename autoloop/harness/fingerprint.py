"""Fingerprints: what a trial's number was measured with.

The harness fingerprint hashes the harness's own source files, so a trial row says which
evaluation code produced its metric; the data fingerprints hash the token arrays.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

HARNESS_DIR = Path(__file__).resolve().parent


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def compute_harness_fingerprint(directory: Path = HARNESS_DIR) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*.py")):
        digest.update(path.relative_to(directory).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


@lru_cache(maxsize=1)
def harness_fingerprint() -> str:
    """sha256 over the harness source files (cached: it cannot change within a process)."""
    return compute_harness_fingerprint()
