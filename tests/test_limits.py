"""Per-trial limits (autoloop.measure.limits): the watchdog's readings with known answers,
and real processes over each limit through the real runner."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from autoloop.loop.disk import failed_for_full_disk
from autoloop.measure.limits import (
    LIMIT_PREFIX,
    MIB,
    ResourceWatch,
    TrialLimits,
    cgroup_v2_available,
    folder_usage,
    private_tmpfs_bytes,
    resident_bytes,
    trial_processes,
)
from autoloop.measure.logpipe import LOG_HEAD_KEEP_BYTES, LOG_TAIL_KEEP_BYTES
from autoloop.measure.sandbox import detect
from tests.conftest import needs_bwrap
from tests.test_runner import SUCCESS, run_script

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")


def _limits(**kw) -> TrialLimits:
    return TrialLimits(**{"memory_bytes": 8192 * MIB, **kw})


# ---------------------------------------------------------------------- readings


def test_folder_usage_counts_bytes_and_entries_without_following_links(tmp_path):
    root = tmp_path / "out"
    (root / "sub").mkdir(parents=True)
    for name in ("a", "b", "sub/c"):
        (root / name).write_bytes(b"x" * 8192)
    big = tmp_path / "outside.bin"
    big.write_bytes(b"y" * 4 * MIB)
    (root / "link").symlink_to(big)
    sub, link = (root / "sub").lstat(), (root / "link").lstat()
    expected = 3 * 8192 + max(sub.st_size, sub.st_blocks * 512) + max(link.st_size, link.st_blocks * 512)
    assert folder_usage(root) == (expected, 5)  # 3 files, a folder, a link: the 4 MiB behind it not counted
    os.truncate(root / "a", 2**30)  # sparse: no block on disk, but what the trial wrote is its size
    assert folder_usage(root)[0] >= 2**30
    for i in range(50):
        (root / f"f{i}").touch()
    assert folder_usage(root, stop_at_files=10)[1] == 11  # the walk stops once past the limit
    assert folder_usage(tmp_path / "missing") == (0, 0)


def test_trial_processes_are_the_tree_of_the_process_started():
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & sleep 30 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while len(trial_processes(proc.pid)) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        found = trial_processes(proc.pid)
        assert len(found) == 4 and proc.pid in found  # sh and its three sleeps
        assert os.getpid() not in found
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_resident_bytes_sees_memory_a_process_touched():
    child = subprocess.Popen(["python3", "-c", "import sys,time; b = bytearray(200 * 2**20); print(1, flush=True); "
                              "time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        assert 200 * MIB <= resident_bytes(child.pid) < 260 * MIB
    finally:
        child.kill()
        child.wait()
    assert resident_bytes(child.pid) == 0  # gone


def test_a_disk_limit_is_never_more_than_half_the_free_space_and_says_the_trial_filled_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    watch = ResourceWatch(_limits(disk_bytes=1024 * MIB), {"out/": out}, free_bytes=20 * MIB)
    (out / "a").write_bytes(b"x" * 8 * MIB)
    assert watch.check() is None and watch.peak["disk"] >= 8 * MIB
    (out / "b").write_bytes(b"x" * 4 * MIB)
    watch._next_disk = 0  # the disk is walked at most once a second
    reason = watch.check()
    assert reason.startswith(LIMIT_PREFIX) and "out/ grew to 12 MiB" in reason and "the trial filled the disk" in reason
    roomy = ResourceWatch(_limits(disk_bytes=10 * MIB), {"out/": out}, free_bytes=2**40)
    assert "out/ grew to 12 MiB, past the 10 MiB a trial may write (trial-disk-mb)" in roomy.check()


def test_cgroup_v2_is_said_when_it_is_not_there(tmp_path):
    assert "no cgroup v2" in cgroup_v2_available(tmp_path)
    (tmp_path / "cgroup.controllers").write_text("cpu io hugetlb\n")
    assert cgroup_v2_available(tmp_path).endswith("lacks memory, pids")
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids\n")
    assert cgroup_v2_available(tmp_path) is None


def test_a_trial_over_its_limits_is_not_a_full_disk_that_pauses_the_run():
    tail = "OSError: [Errno 28] No space left on device"
    over = {"status": "invalid", "reason": LIMIT_PREFIX + "out/ grew to 9 GiB", "error_tail": tail}
    assert failed_for_full_disk(over) is None
    assert failed_for_full_disk({"status": "crash", "reason": "x", "error_tail": tail}) == tail
    assert failed_for_full_disk({"status": "invalid", "reason": "a bad figure", "error_tail": tail}) == tail


# ---------------------------------------------------------------------- real processes through the runner


def _over(tmp_path, source: str, limits: TrialLimits, **kwargs):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    started = time.monotonic()
    outcome = run_script(tmp_path, source, deadline=60, limits=limits, watched={"out/": out},
                         extra_env={"OUT": str(out)}, **kwargs)
    return outcome, time.monotonic() - started


def test_an_honest_run_within_its_limits_is_ok_and_its_peaks_are_recorded(tmp_path):
    outcome, _ = _over(tmp_path, SUCCESS, _limits())
    assert outcome.status == "ok" and outcome.limit is None
    assert outcome.resources["processes"] >= 1 and outcome.resources["memory"] > 0


def test_memory_past_the_limit_ends_the_trial_invalid_at_once(tmp_path):
    source = "import time\nb = bytearray(400 * 2**20)\nprint('held', flush=True)\ntime.sleep(50)\n"
    outcome, took = _over(tmp_path, source, _limits(memory_bytes=100 * MIB))
    assert outcome.status == "invalid" and outcome.limit == outcome.reason, outcome.reason
    assert "past the 100 MiB a trial may hold (trial-memory-mb)" in outcome.reason
    assert took < 20


def test_pages_shared_by_forked_workers_count_once(tmp_path):
    """A process of 150 MB and three forked children that share its pages: RSS says ~600 MB,
    over a 400 MB limit; what they hold together (PSS) is ~150 MB, so the run is ok."""
    source = ("import os, time, json\n"
              "b = bytearray(150 * 2**20)\n"
              "kids = []\n"
              "for _ in range(3):\n"
              "    pid = os.fork()\n"
              "    if pid == 0:\n"
              "        time.sleep(30); os._exit(0)\n"
              "    kids.append(pid)\n"
              "time.sleep(2)\n"
              "json.dump({'val_bpb': 1.0}, open(os.environ['AUTOLOOP_RESULT'], 'w'))\n")
    outcome, _ = _over(tmp_path, source, _limits(memory_bytes=400 * MIB))
    assert outcome.status == "ok", outcome.reason
    assert 150 * MIB <= outcome.resources["memory"] < 400 * MIB and outcome.resources["processes"] == 4


def test_processes_past_the_limit_end_the_trial_invalid(tmp_path):
    source = ("import subprocess, time\n"
              "kids = [subprocess.Popen(['sleep', '60']) for _ in range(30)]\n"
              "time.sleep(50)\n")
    outcome, took = _over(tmp_path, source, _limits(processes=10))
    assert outcome.status == "invalid", outcome.reason
    assert "past the 10 a trial may run (trial-processes)" in outcome.reason and took < 20


def test_a_log_past_its_cap_ends_the_trial_and_keeps_its_head_and_tail(tmp_path):
    source = ("print('first line', flush=True)\n"
              "for i in range(40_000):\n"
              "    print('spam ' * 20, i)\n"
              "print('last line', flush=True)\n"
              "import time; time.sleep(50)\n")
    outcome, took = _over(tmp_path, source, _limits(log_bytes=1 * MIB))
    assert outcome.status == "invalid" and "train.log grew past 1 MiB" in outcome.reason
    assert "(trial-log-mb)" in outcome.reason and took < 20
    log = (tmp_path / "logs" / "trial.log").read_text()
    assert len(log) < LOG_HEAD_KEEP_BYTES + LOG_TAIL_KEEP_BYTES + 4096
    assert "first line" in log and "bytes cut here" in log and "last line" not in log  # killed on the way
    head, tail = log.split("bytes cut here")
    # whole lines only: the kill can land mid-line, and the pipe ends a cut line with a newline
    last = [int(m[1]) for m in re.finditer(r"^(?:spam ){20} (\d+)$", tail, re.M)][-1]
    assert last * len("spam " * 20) > 1 * MIB  # the tail is the end of what it printed, past the cap
    assert tail.rstrip().splitlines()[-1].startswith("# autoloop") and "invalid" in tail.splitlines()[-1]


@pytest.mark.parametrize("then", ["sleeps", "exits"])
def test_out_past_its_disk_limit_ends_the_trial_invalid(tmp_path, then):
    """Watched while it runs, and checked once more after it exited (a burst just before the end)."""
    source = ("import os, time\n"
              "for i in range(20):\n"
              "    open(os.path.join(os.environ['OUT'], f'junk{i}'), 'wb').write(b'x' * 2**20)\n"
              + ("time.sleep(50)\n" if then == "sleeps" else ""))
    outcome, _ = _over(tmp_path, source, _limits(disk_bytes=8 * MIB))
    assert outcome.status == "invalid", outcome.reason
    assert "out/ grew to" in outcome.reason and "past the 8 MiB a trial may write (trial-disk-mb)" in outcome.reason


def test_too_many_files_end_the_trial_invalid(tmp_path):
    source = ("import os, time\n"
              "for i in range(300):\n"
              "    open(os.path.join(os.environ['OUT'], f'f{i}'), 'w').close()\n"
              "time.sleep(50)\n")
    outcome, _ = _over(tmp_path, source, _limits(files=100))
    assert outcome.status == "invalid" and "out/ holds more than 100 files" in outcome.reason, outcome.reason


@needs_bwrap
def test_the_sandboxs_tmp_is_memory_and_counts_against_the_limit(tmp_path):
    source = ("import time\n"
              "open('/tmp/fill', 'wb').write(b'x' * 300 * 2**20)\n"
              "time.sleep(50)\n")
    outcome, took = _over(tmp_path, source, _limits(memory_bytes=150 * MIB), sandbox=detect("auto"))
    assert outcome.status == "invalid" and "(trial-memory-mb)" in outcome.reason, outcome.reason
    assert took < 20


# ---------------------------------------------------------------------- a disk the trial filled, through the loop


@pytest.fixture
def small_disk(tmp_path):
    """A filesystem of 96 MB of its own (a tmpfs mounted for the test: needs root)."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("needs a small filesystem of its own (mount -t tmpfs, as root)")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.usefixtures("one_run_per_trial")
def test_a_disk_the_trial_filled_is_its_fault_and_the_run_goes_on(small_disk):
    """A trial writes into its out/ until the disk is full: `invalid` naming the disk it
    filled, its out/ deleted, its idea done (not back in the queue), the run not paused,
    the next idea trained. (A disk that fills for other reasons still pauses the run:
    tests/test_crash_safety.py.)"""
    from autoloop.store import Store
    from tests.conftest import FAKE_TRAIN, make_repo
    from tests.test_controller import run_loop, seed

    repo = make_repo(small_disk / "repo", FAKE_TRAIN.read_text())
    seed(repo, "fills the disk", "MODE='fill'")
    seed(repo, "next idea", "LR=0.012", priority=-1)
    summary = run_loop(repo, max_trials=3)
    assert not summary.paused, summary.stop_reason
    with Store(repo / "experiments.db") as store:
        run = store.get_run("t")
        rows = store.trials(run["id"])
        ideas = {i["text"]: i["status"] for i in store.ideas()}
    assert [r["status"] for r in rows][:2] == ["keep", "invalid"] and len(rows) == 3, [(r["status"], r["reason"]) for r in rows]
    assert rows[1]["reason"].startswith(LIMIT_PREFIX) and "the trial filled the disk" in rows[1]["reason"]
    assert rows[2]["status"] in ("keep", "discard") and ideas == {"fills the disk": "done", "next idea": "done"}
    assert run["status"] != "paused"
    assert not list((repo / ".autoloop" / "t" / "trials" / str(rows[1]["number"])).rglob("ckpt*"))  # its junk deleted


@needs_bwrap
def test_a_sandbox_being_built_is_never_read_as_the_hosts_disk(tmp_path):
    """While bubblewrap builds its namespace, /proc/<pid>/root/tmp names one folder then
    another; reading its device and its usage through the path asked about two, and the
    host's whole disk (40 GB here) was counted as the trial's /tmp: an honest trial judged
    `invalid` over its memory limit, about one start in eight (CI, issue 31). Polled as
    fast as it can go over 60 sandbox starts, a sandbox that holds nothing reads as ~0."""
    policy = detect("auto")
    worst = 0
    for _ in range(60):
        argv, env = policy.wrap(["/bin/true"], env=dict(os.environ), cwd=tmp_path)
        process = subprocess.Popen(argv, env=env, cwd=tmp_path, start_new_session=True)
        while process.poll() is None:
            inner = [p for p in trial_processes(process.pid) if p != process.pid][:1]
            if inner:
                worst = max(worst, private_tmpfs_bytes(inner[0]))
    assert worst < 64 * MIB, worst
