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
    from autoloop.trust.integrity import VIA_IMPORT_ROOT, harness_mirrors

    harness = Path(autoloop.harness.__file__).parent
    modules = {p.stem for p in harness.glob("*.py")} - {"__main__"}
    for kind in ("train", "eval"):
        # Where the children import it from: through the import root (autoloop.trust.import_root).
        mirror = harness_mirrors(harness, pycache_dir(kind, tmp_path))[VIA_IMPORT_ROOT]
        assert modules <= {p.name.split(".")[0] for p in mirror.glob("*.pyc")}, kind
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


def test_a_new_projects_prefix_is_a_copy_of_the_users_template_never_of_another_project(
        tmp_path, fresh_state, monkeypatch):
    """The second project of the same harness and torch copies the template in the user's
    cache instead of importing torch to fill its own; the template holds only what a
    trusted warm-up wrote (a file planted in the first project's prefix, as an unsandboxed
    trial could, reaches no other project); each project's files are its own."""
    monkeypatch.setenv("AUTOLOOP_CACHE_DIR", str(tmp_path / "user-cache"))
    spawned = []
    real = bytecode._run_warm_up
    monkeypatch.setattr(bytecode, "_run_warm_up", lambda *a: spawned.append(a[3]) or real(*a))
    first, second = tmp_path / "one" / ".autoloop", tmp_path / "two" / ".autoloop"
    warm_pycache("eval", sys.executable, first)
    assert len(spawned) == 1 and spawned[0].parent == tmp_path / "user-cache" / "pycache-templates"
    planted = pycache_dir("eval", first) / "planted.pyc"
    planted.write_bytes(b"poison")
    monkeypatch.setattr(bytecode, "_warmed", set())  # as a new `autoloop` process starts
    warm_pycache("eval", sys.executable, second)
    assert len(spawned) == 1  # no warm-up process: copied
    one, two = pycache_dir("eval", first), pycache_dir("eval", second)
    files = {p.relative_to(one) for p in one.rglob("*") if p.is_file()} - {Path("planted.pyc")}
    assert files == {p.relative_to(two) for p in two.rglob("*") if p.is_file()}
    assert len(files) > 100 and not (two / "planted.pyc").exists()
    assert bytecode._read_stamp(two) == bytecode._read_stamp(one) is not None
    sample = next(p for p in sorted(files) if p.suffix == ".pyc")
    assert (one / sample).read_bytes() == (two / sample).read_bytes()
    assert (one / sample).stat().st_ino != (two / sample).stat().st_ino
    # `force` (planted bytecode was removed) runs the warm-up into the prefix itself.
    warm_pycache("eval", sys.executable, second, force=True)
    assert spawned[-1] == two


def test_the_user_cache_keeps_two_templates_per_kind(tmp_path, fresh_state, monkeypatch):
    monkeypatch.setenv("AUTOLOOP_CACHE_DIR", str(tmp_path / "user-cache"))
    for version in range(3):  # three harness versions, one after another
        monkeypatch.setattr(bytecode, "_sources_stamp", lambda directory, v=version: [["metric.py", v, v]])
        monkeypatch.setattr(bytecode, "_warmed", set())
        warm_pycache("eval", sys.executable, tmp_path / f"project-{version}")
    templates = sorted((tmp_path / "user-cache" / "pycache-templates").iterdir())
    assert len(templates) == bytecode.TEMPLATES_KEPT == 2
    assert sorted(bytecode._read_stamp(t)["harness"][0][1] for t in templates) == [1, 2]  # the oldest went


def test_the_snapshot_watches_the_harness_bytecode_where_children_import_it_from(tmp_path, fresh_state):
    """Every child imports the harness through the import root (autoloop.trust.import_root),
    so its bytecode sits in each prefix under the root's path, not the package's: a .pyc
    planted there (an unsandboxed trial can write the prefixes) is a change the integrity
    snapshot sees, and the one removal puts back what the warm-up wrote."""
    from autoloop.trust import integrity

    harness = integrity.harness_dir()
    warm_pycache("train", sys.executable, tmp_path)
    prefixes = [pycache_dir(kind, tmp_path) for kind in bytecode.PYCACHE_KINDS]
    mirror = integrity.harness_mirrors(harness, prefixes[0])[integrity.VIA_IMPORT_ROOT]
    assert (mirror / "metric.cpython-311.pyc").exists() or list(mirror.glob("metric.*.pyc")), mirror
    before = integrity.take_snapshot(harness, tmp_path, pycache_prefixes=prefixes)
    planted = next(mirror.glob("metric.*.pyc"))
    original = planted.read_bytes()
    planted.write_bytes(b"poisoned")
    after = integrity.take_snapshot(harness, tmp_path, pycache_prefixes=prefixes)
    changed = [label for label, digest in after.bytecode.items() if before.bytecode.get(label) != digest]
    assert changed == [f"{prefixes[0]}{integrity.VIA_IMPORT_ROOT}:{planted.name}"]
    assert integrity.remove_planted_bytecode(harness, before, after) == [planted]
    assert not planted.exists() and original[:4] == __import__("importlib.util").util.MAGIC_NUMBER
