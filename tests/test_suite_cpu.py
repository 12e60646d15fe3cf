"""bench/suite_cpu.py and the per-test CPU log it reads (tests/conftest.py, opt-in with
AUTOLOOP_TEST_CPU_LOG): a test that waits shows CPU far below its wall time, a test whose
child burns CPU shows it, and the summary's figures on rows with a known answer."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, bench_module, needs_bwrap


def _bench():
    return bench_module("suite_cpu")


def test_the_summary_of_rows_with_a_known_answer():
    bench = _bench()
    rows = [{"test": "tests/test_a.py::one", "worker": "gw0", "start": 100.0, "end": 110.0, "cpu": 10.0},
            {"test": "tests/test_a.py::two", "worker": "gw1", "start": 100.0, "end": 104.0, "cpu": 1.0},
            {"test": "tests/test_b.py::three", "worker": "gw1", "start": 104.0, "end": 110.0, "cpu": 0.0}]
    s = bench.summary(rows, cores=2)
    assert (s["tests"], s["workers"], s["span_seconds"], s["wall_seconds"], s["cpu_seconds"]) == (3, 2, 10.0, 20.0, 11.0)
    assert s["busy"] == 11.0 / 20.0
    assert bench.by_file(rows) == [("tests/test_a.py", 14.0, 11.0, 2), ("tests/test_b.py", 6.0, 0.0, 1)]


def test_the_disk_the_suite_held_is_the_free_disk_it_took_at_its_lowest():
    bench = _bench()
    rows = [{"test": "a", "worker": "gw0", "start": 5.0, "end": 6.0, "cpu": 0.0, "disk_free_gb": [9.0, 8.5, 8.9]},
            {"test": "b", "worker": "gw1", "start": 1.0, "end": 7.0, "cpu": 0.0, "disk_free_gb": [10.0, 7.5, None]},
            {"test": "c", "worker": "gw0", "start": 7.0, "end": 8.0, "cpu": 0.0}]  # a log from before the field
    assert bench.disk(rows) == {"free_at_start_gb": 10.0, "least_free_gb": 7.5, "held_at_most_gb": 2.5}
    assert bench.disk(rows[2:]) is None


def test_a_comparison_tells_the_machines_pace_from_the_work_that_changed():
    bench = _bench()

    def rows(cpus: dict) -> list[dict]:
        return [{"test": t, "worker": "gw0", "start": 0.0, "end": 1.0, "cpu": c} for t, c in cpus.items()]

    same = {f"t{k}": 4.0 + k for k in range(9)}  # unchanged work, 1.2x the CPU on a slower machine
    old = rows({**same, "cut": 50.0, "gone": 10.0, "tiny": 1.0})
    new = rows({**{t: 1.2 * c for t, c in same.items()}, "cut": 30.0, "added": 6.0, "tiny": 2.5})
    c = bench.compare(old, new)
    assert c["pace"] == pytest.approx(1.2) and c["tests_compared"] == 10  # "tiny" is under MIN_CPU
    assert c["new_cpu_at_old_pace"] == pytest.approx(sum(same.values()) + 30.0 / 1.2 + 6.0 / 1.2 + 2.5 / 1.2)
    excess = {t: e for t, _, _, e in c["changes"]}
    assert [t for t, *_ in c["changes"][:3]] == ["cut", "gone", "added"]
    assert excess["cut"] == pytest.approx(30.0 - 60.0) and excess["gone"] == pytest.approx(-12.0)
    assert excess["added"] == pytest.approx(6.0) and excess["t3"] == pytest.approx(0.0)


@needs_bwrap
def test_the_log_tells_a_test_that_waits_from_one_whose_children_compute(tmp_path):
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_runtest_call, pytest_runtest_protocol  # noqa: F401\n")
    (tmp_path / "test_two.py").write_text(
        "import subprocess, sys, time\n\n"
        "def test_waits():\n    time.sleep(0.5)\n\n"
        "BURN = [sys.executable, '-c', 'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.5: pass']\n\n"
        "def test_computes():\n    subprocess.run(BURN, check=True)\n\n"
        "def test_computes_in_a_pid_namespace():  # as a sandboxed training does\n"
        "    subprocess.run(['bwrap', '--ro-bind', '/', '/', '--dev', '/dev', '--proc', '/proc', '--unshare-pid', *BURN], check=True)\n")
    log = tmp_path / "cpu.jsonl"
    env = {**os.environ, "AUTOLOOP_TEST_CPU_LOG": str(log), "PYTHONPATH": str(REPO_ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(tmp_path / "test_two.py")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["test"].split("::")[-1]: r for r in _bench().load(log)}
    waits, computes, sandboxed = rows["test_waits"], rows["test_computes"], rows["test_computes_in_a_pid_namespace"]
    assert waits["end"] - waits["start"] >= 0.5 and waits["cpu"] < 0.25
    assert computes["cpu"] >= 0.45
    assert all(len(r["disk_free_gb"]) == 3 and all(gb > 0 for gb in r["disk_free_gb"]) for r in rows.values())
    if sandboxed["cpu_source"] == "cgroup":  # getrusage cannot see it (the header says so)
        assert sandboxed["cpu"] >= 0.45
