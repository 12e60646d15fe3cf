"""Shared fixtures.

Every test runs with the harness cache pointed at one session-wide temporary folder
(the embedded corpus is prepared there once, in a few seconds, from a fixed key), so no
test reads or writes the user's ~/.cache and no test downloads anything.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

_PARALLEL = "PYTEST_XDIST_WORKER" in os.environ
# The threads a torch-using test subprocess gets: the machine's two cores, or one when two test
# processes run beside each other (`pytest -n 2`), where a second thread only spin-waits for a
# core the other worker holds (a 20-step train.py: 9 CPU seconds at one thread beside two
# CPU burners, 20 at two; 70 in CI beside the README test).
TEST_THREADS = os.environ.get("AUTOLOOP_TEST_THREADS", "1" if _PARALLEL else "2")

# The files that take longest, run first under `pytest -n 2` (whole files go to a worker):
# started late, one of them would leave the other worker idle at the end. Longest first, as
# measured by `.ci/run` with --durations=0 on a clean clone (2026-12-06: test_readme.py 540 s,
# test_attacks_budget.py 490, the next ones 260 to 100); a file not listed runs after these,
# in its usual order.
LONGEST_FILES = ("test_readme.py", "test_attacks_budget.py", "test_check.py", "test_train.py", "test_crash_safety.py",
                 "test_executor_equivalence.py", "test_attacks_startup.py", "test_attacks_workers.py",
                 "test_parallel.py", "test_attacks.py", "test_review.py", "test_agent.py", "test_controller.py",
                 "test_verify.py", "test_attacks_probes.py", "test_attacks_trust.py", "test_run_check.py",
                 "test_llm_outage.py")


def pytest_collection_modifyitems(config, items):
    if not _PARALLEL:
        return
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


# `AUTOLOOP_TEST_CPU_LOG=FILE`: each test's wall time, the CPU seconds it and every process
# it started used, and the free disk before, after its call and after it, one JSON line a test
# (bench/suite_cpu.py sums them: which tests keep a core busy and which wait, and the disk).
# Off by default. A sandboxed process's CPU never reaches getrusage (its
# pid namespace's init reaps it), so where this process may make a cgroup v1 cpuacct group
# (root, as in CI here) it moves itself into one of its own, which every descendant inherits,
# and reads the group's counter; elsewhere getrusage (`cpu_source` says which).
_CPU_LOG = os.environ.get("AUTOLOOP_TEST_CPU_LOG")
_CPUACCT = Path("/sys/fs/cgroup/cpuacct")
_cpu_group: list = []  # [the group's folder or None], decided once a process


def _cpu_seconds() -> tuple[float, str]:
    import resource

    if not _cpu_group:
        group = _CPUACCT / f"autoloop-tests-{os.getpid()}"
        try:
            group.mkdir(exist_ok=True)
            (group / "cgroup.procs").write_text(str(os.getpid()))
            _cpu_group.append(group)
            import atexit

            atexit.register(_leave_cpu_group, group)
        except OSError:
            _cpu_group.append(None)
    if _cpu_group[0] is not None:
        return int((_cpu_group[0] / "cpuacct.usage").read_text()) / 1e9, "cgroup"
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime, "rusage"


def _leave_cpu_group(group: Path) -> None:
    try:  # back to the root group; the folder goes once nothing is left in it
        (_CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
        group.rmdir()
    except OSError:
        pass


def _tests_disk(config) -> Path:
    """Where the tests' temporary folders are, for the free disk there."""
    import tempfile

    base = config.option.basetemp
    return Path(base).parent if base else Path(tempfile.gettempdir())


def _free_gb(path: Path) -> float | None:
    import shutil

    try:
        return shutil.disk_usage(path).free / 1e9
    except OSError:
        return None


# What the whole suite needs on disk, with room to spare: it held 1.5 GB at most as
# bench/suite_cpu.py reads it from the log (a clean clone, 2026-12-07, .ci/run), 9 GB before
# pyproject.toml's retention policy removed a passing test's folder when it ends (a test's
# project holds ~100 MB of bytecode).
SUITE_DISK_GB = 2


def pytest_report_header(config):
    # A full disk fails hundreds of tests at once, each with "No space left on device":
    # the header says how much there was before the first of them.
    where = _tests_disk(config)
    free = _free_gb(where)
    if free is None:
        return None
    low = "  TOO LITTLE: the tests will fail" if free < SUITE_DISK_GB else ""
    return f"disk: {free:.1f} GB free under {where}, the suite needs about {SUITE_DISK_GB} GB{low}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield
    if _CPU_LOG:  # before teardown removes the test's folder: what the test itself filled
        item.stash[_FREE_AFTER_CALL] = _free_gb(_tests_disk(item.config))


_FREE_AFTER_CALL = pytest.StashKey[float | None]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _CPU_LOG:
        yield
        return
    import json
    import time

    start, (cpu, _), free = time.time(), _cpu_seconds(), _free_gb(_tests_disk(item.config))
    yield
    after, source = _cpu_seconds()
    line = json.dumps({"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                       "start": start, "end": time.time(), "cpu": after - cpu, "cpu_source": source,
                       "disk_free_gb": [free, item.stash.get(_FREE_AFTER_CALL, None),
                                        _free_gb(_tests_disk(item.config))]})
    with open(_CPU_LOG, "a") as log:  # one write a line, appended: workers share the file
        log.write(line + "\n")


_CONTRACT_VARS = (
    "AUTOLOOP_TIME_BUDGET", "AUTOLOOP_MAX_STEPS", "AUTOLOOP_SEED", "AUTOLOOP_RESULT",
    "AUTOLOOP_CHECKPOINT", "AUTOLOOP_PROGRESS", "AUTOLOOP_DATA_DIR", "AUTOLOOP_FAULT", "AUTOLOOP_EVAL", "AUTOLOOP_FEED",
)


# The embedded corpus is generated from the key in the cache folder; tests use this one, so
# their corpus, and every figure a test compares, is the same in every session. Only the
# tests of the key's creation make a random one.
TEST_CORPUS_KEY = bytes(range(32))


def write_test_corpus_key(cache: Path) -> Path:
    """Put the tests' fixed corpus key into the cache folder `cache` (before anything prepares the corpus)."""
    from autoloop.harness.corpus_key import corpus_key_path, write_key

    return write_key(corpus_key_path(cache), TEST_CORPUS_KEY)


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("autoloop-cache")
    write_test_corpus_key(cache)
    return cache


@pytest.fixture(scope="session", autouse=True)
def _pairs_regardless_of_machine_speed():
    """The tests' fake train.py trains for a fraction of a second, so the speed probe around
    it (autoloop/measure/probe.py) reads whatever the other processes on a shared machine
    did in that moment, and a pair could turn confounded by chance. Tests pair regardless
    (`pair-speed-tolerance = none`), set before the session's and modules' fixtures run
    their loops; the tests of the pairing fake the probe and delete the setting."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOLOOP_PAIR_SPEED_TOLERANCE", "none")
        yield


@pytest.fixture(autouse=True)
def _isolated_cache(session_cache, monkeypatch):
    set_test_environment(monkeypatch, session_cache)


def set_test_environment(monkeypatch, cache: Path) -> None:
    """What every test runs under (set with `monkeypatch`, a MonkeyPatch), with `cache` as
    the harness cache: also for a session fixture's loop, which runs before this autouse
    fixture would set it."""
    monkeypatch.setenv("AUTOLOOP_CACHE_DIR", str(cache))
    monkeypatch.setenv("AUTOLOOP_COMPILE_CACHE", str(cache / "compile"))
    for name in _CONTRACT_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", TEST_THREADS)
    # `autoloop run` checks train.py before a new run (half a minute on a CPU); the tests of
    # that check turn it back on, the others are about other things.
    monkeypatch.setenv("AUTOLOOP_CHECK", "0")
    # A night that ends by its limit re-measures its best at fresh seeds (autoloop.loop.reserve):
    # runs most tests do not count on; the tests of the reserve turn it back on.
    monkeypatch.setenv("AUTOLOOP_RESERVE_SEEDS", "0")
    # A keep's verification probes for a sparse peek with power, at most 16 x the scored
    # windows: on a CPU about 40 s a keep, ten times a 6-step run. Tests of other things
    # probe at 1 x; the tests of the power (tests/test_attacks_probes.py, test_probe_power.py)
    # use the default.
    monkeypatch.setenv("AUTOLOOP_PROBE_FACTOR", "1")


@pytest.fixture(scope="session")
def sandboxed_baseline(tmp_path_factory, session_cache) -> Path:
    """The attack tests' baseline, paid once a session (each xdist worker that needs it):
    the real train.py's baseline through the sandboxed, verified loop in step mode, with
    the attack tests' settings (tests.test_attacks.baseline_run). Read-only: a test takes
    its copy from `attacked_repo`."""
    from tests.test_attacks import baseline_run

    with pytest.MonkeyPatch.context() as mp:  # what the autouse fixtures set per test
        set_test_environment(mp, session_cache)
        return baseline_run(tmp_path_factory.mktemp("sandboxed-baseline"), mp)


@pytest.fixture
def attacked_repo(sandboxed_baseline, tmp_path) -> Path:
    """A private copy of the shared sandboxed baseline's run (tag "a", one trial: the baseline,
    kept) at tmp_path/"repo": a test seeds its attacks and runs the loop on from there."""
    return copy_run(sandboxed_baseline, tmp_path / "repo")


@pytest.fixture
def one_run_per_trial(monkeypatch):
    """For tests of the loop's mechanics (git, db, processes, recovery), written for one
    training run per trial: the strict rule gives that, with one baseline seed (verified,
    the baseline would run at three), and no drift checks. The paired rule's several runs
    per trial are tested in tests/test_decision_loop.py."""
    monkeypatch.setenv("AUTOLOOP_DECISION_RULE", "strict")
    monkeypatch.setenv("AUTOLOOP_BASELINE_SEEDS", "1")
    monkeypatch.setenv("AUTOLOOP_DRIFT_EVERY", "0")


@pytest.fixture(scope="session")
def embedded_dataset(session_cache):
    """The embedded default corpus, prepared once per test session."""
    from autoloop import harness as H
    from autoloop.harness.contract import embedded_dataset_name

    path = session_cache / "data" / embedded_dataset_name()
    if (path / "meta.json").exists():
        return H.load_dataset(path, prepare=False)
    # A session fixture runs before the autouse one that points the cache at the session's:
    # the key must come from there too, never from the user's cache.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOLOOP_CACHE_DIR", str(session_cache))
        return H.prepare_embedded(path)


FAKE_TRAIN = Path(__file__).resolve().parent / "fakes" / "fake_train.py"


def _sandbox_policy():
    from autoloop.measure.sandbox import detect

    return detect("auto")


SANDBOX = _sandbox_policy()  # what this machine's sandbox is (bubblewrap, or why not)
# The one mark of a test that runs trials in the real sandbox.
needs_bwrap = pytest.mark.skipif(
    SANDBOX.kind != "bwrap", reason=f"bubblewrap cannot run here ({SANDBOX.describe()}); .ci/run installs it"
)


def make_repo(path: Path, train_source: str, extra_files: dict[str, str] | None = None) -> Path:
    """A real git repository with a train.py, committed, and nothing else of autoloop's."""
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    (path / "train.py").write_text(train_source)
    (path / ".gitignore").write_text(".autoloop/\nexperiments.db*\n__pycache__/\n")
    for name, content in (extra_files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(content)
    env = {**os.environ, "GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "t@example.com"}
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "init"]):
        subprocess.run(["git", *args], cwd=path, check=True, env=env)
    return path


def bench_module(name: str):
    """bench/`name`.py imported as a module (the benches are scripts, not a package); bench/
    is on the path while it loads, for a bench that imports a helper beside it by name."""
    import importlib.util

    bench = REPO_ROOT / "bench"
    spec = importlib.util.spec_from_file_location(name, bench / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(bench))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(bench))
    return module


def copy_run(source: Path, target: Path) -> Path:
    """A private copy of a run's folder `source` at `target` (the repository with .git,
    experiments.db, .autoloop/) for a test that writes to it or runs the loop on in it: the
    one way the tests pay for a run once and copy it per test. The paths the db holds into
    `source` (logs, checkpoints) are pointed into the copy, so nothing reads the original."""
    import shutil
    import sqlite3

    shutil.copytree(source, target, symlinks=True)
    db = target / "experiments.db"
    if db.exists():
        conn = sqlite3.connect(db)
        try:
            for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
                for column in conn.execute(f"PRAGMA table_info({table})").fetchall():
                    if column[2].upper() == "TEXT" and column[1].endswith("_path"):
                        conn.execute(f"UPDATE {table} SET {column[1]} = replace({column[1]}, ?, ?)",
                                     (str(source), str(target)))
            conn.commit()
        finally:
            conn.close()
    return target


@pytest.fixture
def fake_repo(tmp_path) -> Path:
    """A git repo whose train.py is the fake training script (instant, scriptable)."""
    return make_repo(tmp_path / "repo", FAKE_TRAIN.read_text())


def ray_temp_dir(tmp_path_factory, name: str) -> Path:
    """A folder for Ray's temp files and state inside this test session's temporary
    folder; Ray's unix socket paths must stay short (about 100 bytes with its own
    suffixes), so a base folder too deep for that falls back to a short one in /tmp."""
    import tempfile

    base = tmp_path_factory.getbasetemp()
    if len(str(base / name)) <= 40:
        path = base / name
        path.mkdir(exist_ok=True)
        return path
    return Path(tempfile.mkdtemp(prefix=name, dir="/tmp"))


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A local Ray cluster with two pretend GPUs (`ray.init(num_cpus=2, num_gpus=2)`), its
    temp files inside the session's temporary folder; shut down after the module."""
    ray = pytest.importorskip("ray")
    import shutil

    temp = ray_temp_dir(tmp_path_factory, "ray")
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, _temp_dir=str(temp), log_to_driver=False)
    try:
        yield temp
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(temp, ignore_errors=True)
