"""Shared fixtures.

Every test runs with the harness cache pointed at one session-wide temporary folder
(the embedded corpus is prepared there once, in about a second), so no test reads or
writes the user's ~/.cache and no test downloads anything.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

_CONTRACT_VARS = (
    "AUTOLOOP_TIME_BUDGET", "AUTOLOOP_MAX_STEPS", "AUTOLOOP_SEED", "AUTOLOOP_RESULT",
    "AUTOLOOP_CHECKPOINT", "AUTOLOOP_PROGRESS", "AUTOLOOP_DATA_DIR", "AUTOLOOP_FAULT",
)


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("autoloop-cache")


@pytest.fixture(autouse=True)
def _isolated_cache(session_cache, monkeypatch):
    monkeypatch.setenv("AUTOLOOP_CACHE_DIR", str(session_cache))
    monkeypatch.setenv("AUTOLOOP_COMPILE_CACHE", str(session_cache / "compile"))
    for name in _CONTRACT_VARS:
        monkeypatch.delenv(name, raising=False)
    # Each torch-using test subprocess gets one thread: the machine has two cores and
    # tests may run beside each other.
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("AUTOLOOP_TEST_THREADS", "2"))


@pytest.fixture(scope="session")
def embedded_dataset(session_cache):
    """The embedded default corpus, prepared once per test session."""
    from autoloop import harness as H
    from autoloop.harness.contract import embedded_dataset_name

    path = session_cache / "data" / embedded_dataset_name()
    if (path / "meta.json").exists():
        return H.load_dataset(path, prepare=False)
    return H.prepare_embedded(path)
