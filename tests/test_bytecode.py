"""The trusted bytecode warm-up (autoloop.trust.bytecode.warm_pycache) fills what its
children import, once, and says when it cannot.

No child may write bytecode (PYTHONDONTWRITEBYTECODE, read-only prefixes), so a module
missing from a prefix is compiled from source by every training run and evaluation that
imports it. Until this test, the warm-up called a function that no longer existed: it failed
silently on every call, was retried on every call (two imports of torch per measured run),
and left torch._dynamo, which every training run imports, out of the prefix.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autoloop.trust import bytecode
from autoloop.trust.bytecode import pycache_dir, warm_pycache


@pytest.fixture
def fresh_state(monkeypatch):
    """This process's memory of warmed and failed prefixes, emptied for the test."""
    monkeypatch.setattr(bytecode, "_warmed", set())
    monkeypatch.setattr(bytecode, "_failed", set(), raising=False)


def _compiled(prefix: Path, package: Path) -> set[str]:
    mirrored = prefix / package.resolve().relative_to(package.resolve().anchor)
    return {p.name.split(".")[0] for p in mirrored.rglob("*.pyc")}


def test_the_warm_up_fills_every_harness_module_and_what_training_imports(tmp_path, fresh_state, capsys):
    import autoloop.harness
    import torch

    warm_pycache("train", sys.executable, tmp_path)
    warm_pycache("eval", sys.executable, tmp_path)
    assert "warm-up" not in capsys.readouterr().err
    harness = Path(autoloop.harness.__file__).parent
    modules = {p.stem for p in harness.glob("*.py")} - {"__main__"}
    for kind in ("train", "eval"):
        assert modules <= _compiled(pycache_dir(kind, tmp_path), harness), kind
    dynamo = _compiled(pycache_dir("train", tmp_path), Path(torch.__file__).parent / "_dynamo")
    assert {"eval_frame", "convert_frame"} <= dynamo
    profiler = _compiled(pycache_dir("train", tmp_path), Path(torch.__file__).parent / "profiler")
    assert "profiler" in profiler


def test_a_filled_prefix_is_not_filled_again_by_the_next_process(tmp_path, fresh_state, monkeypatch):
    assert warm_pycache("eval", sys.executable, tmp_path) > 0
    monkeypatch.setattr(bytecode, "_warmed", set())  # as a new `autoloop` process starts
    assert warm_pycache("eval", sys.executable, tmp_path) == 0.0
    # Another harness (an upgrade, an edited source) fills it again.
    monkeypatch.setattr(bytecode, "_warmed", set())
    monkeypatch.setattr(bytecode, "_sources_stamp", lambda directory: [["metric.py", 1, 2]])
    assert warm_pycache("eval", sys.executable, tmp_path) > 0


def test_a_failing_warm_up_is_said_once_and_not_retried(tmp_path, fresh_state, capsys):
    python = tmp_path / "python"
    calls = tmp_path / "calls"
    python.write_text(f"#!/bin/sh\necho x >> {calls}\necho 'ModuleNotFoundError: No module named torch'\nexit 1\n")
    python.chmod(0o755)
    for _ in range(3):
        warm_pycache("train", str(python), tmp_path / "cache")
    err = capsys.readouterr().err
    assert err.count("warm-up") == 1 and "No module named torch" in err, err
    assert calls.read_text().count("x") == 1
    assert not (pycache_dir("train", tmp_path / "cache") / bytecode.STAMP).exists()
    warm_pycache("train", str(python), tmp_path / "cache", force=True)
    assert calls.read_text().count("x") == 2
