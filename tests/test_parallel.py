"""Several workers: the local executor with pretend devices, both search modes, a worker
killed mid-trial, and recovery of a controller that died with two trials running.

Real git repositories, real SQLite files, real worker and training processes; the fake
training script (tests/fakes/fake_train.py) stands in for a GPU run, and on this CPU
machine `--workers N` gives N pretend devices. One training run per trial (the strict
rule): these tests are about scheduling, not about the decision rule.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import FAKE_TRAIN, make_repo

from autoloop.gitops import GitRepo
from autoloop.base.processes import process_group_alive
from autoloop.store import Store

from test_controller import assert_consistent, run_loop, seed, trials

pytestmark = pytest.mark.usefixtures("one_run_per_trial")

TAG = "t"


def fake_source(**constants) -> str:
    """The fake training script with its constants a few lines apart, so edits to two of
    them merge cleanly (as separate hyperparameters in a real train.py would)."""
    source = FAKE_TRAIN.read_text().replace("RECORD_WORKER = False", "RECORD_WORKER = True")
    for name, value in constants.items():
        line = next(line for line in source.splitlines() if line.startswith(f"{name} = ") and "#" in line)
        source = source.replace(line + "\n", f"\n# {name.lower()}\n{name} = {value!r}  # set by the test\n\n")
    return source


@pytest.fixture
def wide_repo(tmp_path) -> Path:
    """WIDTH 128 and LR 0.02: both WIDTH=64 and LR=0.01 are improvements, on separate lines."""
    return make_repo(tmp_path / "repo", fake_source(WIDTH=128, LR=0.02, SLEEP=0.0))


@pytest.fixture(params=["local", "ray"])
def executor(request) -> str:
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return request.param


def overlapping(a: dict, b: dict) -> bool:
    return a["started_at"] < b["finished_at"] and b["started_at"] < a["finished_at"]


def test_workers_train_at_once_each_on_its_own_device_and_folder(wide_repo, executor):
    for k, lr in enumerate((0.03, 0.04, 0.05, 0.06)):
        seed(wide_repo, f"lr {lr}", f"LR={lr}", "SLEEP=1.5")
    summary = run_loop(wide_repo, executor=executor, workers=2, max_trials=5)
    assert summary.stop_reason == "reached --max-trials 5", summary
    rows = trials(wide_repo)
    assert [r["status"] for r in rows] == ["keep"] + ["discard"] * 4
    proposals = rows[1:]
    names = {"local": {"w0", "w1"}, "ray": {"ray-w0", "ray-w1"}}[executor]
    assert {r["worker"] for r in proposals} == names
    devices = {}
    for row in proposals:
        seen = row["result"]["worker"]
        if executor == "local":
            k = int(row["worker"][1:])
            assert seen["CUDA_VISIBLE_DEVICES"] == str(k)  # pinned to its own (pretend) device
            assert Path(seen["cwd"]) == wide_repo / ".autoloop" / TAG / "workers" / row["worker"]
        else:  # Ray pins the GPU it granted the worker's actor; the project is a folder on the node
            assert seen["CUDA_VISIBLE_DEVICES"] in ("0", "1") and not Path(seen["cwd"]).is_relative_to(wide_repo)
        devices.setdefault(row["worker"], set()).add(seen["CUDA_VISIBLE_DEVICES"])
    assert all(len(d) == 1 for d in devices.values()) and len(set.union(*devices.values())) == 2
    # Two trials trained at the same time, on different workers.
    assert any(overlapping(a, b) for a in proposals for b in proposals if a["worker"] != b["worker"])
    # status and the report count trials per worker.
    from autoloop.review.report import report_data
    from autoloop.review.queries import run_status
    from autoloop.review.text import format_status

    store = Store(wide_repo / "experiments.db")
    try:
        run = store.get_run(TAG)
        status = format_status(run_status(store, run, wide_repo))
        per_worker = {w["worker"]: w["trials"] for w in report_data(store, run)["workers"]}
    finally:
        store.close()
    counts = {name: sum(r["worker"] == name for r in rows) for name in names}
    assert per_worker == counts and sum(counts.values()) == len(rows)  # the baseline ran on a worker too
    assert "workers: " in status and all(f"{name} {n} trials" in status for name, n in counts.items())
    assert_consistent(wide_repo)
    store = Store(wide_repo / "experiments.db")
    assert store.live_processes() == []  # every worker process ended and was recorded so
    store.close()


def test_shared_incumbent_rebases_a_keep_that_a_newer_best_overtook(wide_repo, executor):
    seed(wide_repo, "lr 0.01", "LR=0.01")
    seed(wide_repo, "width 64", "WIDTH=64", "SLEEP=4.0")  # slower: still training when the first is kept
    summary = run_loop(wide_repo, executor=executor, workers=2, max_trials=4)
    rows = trials(wide_repo)
    by_description = {r["description"]: r for r in rows}
    fast, slow = by_description["lr 0.01"], by_description["width 64"]
    assert overlapping(fast, slow) and fast["status"] == "keep"
    assert slow["status"] == "discard" and f"trial {fast['number']} was kept while it trained" in slow["reason"]
    assert "re-queued on the new best" in slow["reason"]
    rebased = [r for r in rows if r["derived_from"] == slow["id"]]
    assert len(rebased) == 1 and "re-based from trial" in rebased[0]["description"]
    assert rebased[0]["parent_commit"] == fast["trial_commit"] and rebased[0]["status"] == "keep"
    source = GitRepo.open(wide_repo).show_file(rebased[0]["trial_commit"], "train.py")
    assert "LR = 0.01" in source and "WIDTH = 64" in source  # both edits, neither lost
    assert summary.best_metric == pytest.approx(1.0)
    assert_consistent(wide_repo)


def test_an_edit_another_worker_kept_first_is_not_tried_again(wide_repo):
    # Two workers given the same change at once (a search proposes what is best next, twice):
    # the one kept first makes the other's re-based edit empty. On the old code it became an
    # `invalid` trial, "the proposal changes nothing", which no trial had earned.
    import difflib

    from autoloop.config import resolve
    from autoloop.proposers.seeding import seed_idea

    seed(wide_repo, "lr 0.01", "LR=0.01", "SLEEP=1.0")
    # The same change again, written as a patch: the same --set twice is refused as a
    # duplicate when seeded (autoloop.store.Store.add_idea), as a search's second pick is not.
    source = (wide_repo / "train.py").read_text()
    changed = source.replace("LR = 0.02", "LR = 0.01", 1).replace("SLEEP = 0.0", "SLEEP = 1.0", 1)
    patch = wide_repo.parent / "again.diff"
    patch.write_text("".join(difflib.unified_diff(source.splitlines(True), changed.splitlines(True),
                                                  "a/train.py", "b/train.py")))
    seed_idea(resolve(wide_repo, {}), wide_repo, "lr 0.01 again", sets=[], patch=patch)
    run_loop(wide_repo, executor="local", workers=2, max_trials=4)
    rows = trials(wide_repo)
    assert [r["status"] for r in rows if r["status"] not in ("keep", "discard")] == [], \
        [(r["number"], r["status"], r["reason"]) for r in rows]
    first, second = sorted(rows[1:3], key=lambda r: r["status"] != "keep")  # either may finish first
    assert overlapping(first, second) and first["status"] == "keep" and second["status"] == "discard"
    # Its reason says so at once: the edit is not re-queued, so nothing promises a retry.
    assert "not re-queued: the current best already has its change" in second["reason"], second["reason"]
    assert not (second["decision"] or {}).get("requeued")
    assert not any(r["derived_from"] == second["id"] for r in rows)


def test_islands_advance_their_own_lineages_and_migrate(wide_repo, executor):
    seed(wide_repo, "lr 0.01", "LR=0.01", "SLEEP=0.3")  # the better island
    seed(wide_repo, "lr 0.05", "LR=0.05", "SLEEP=0.3")
    seed(wide_repo, "lr 0.015", "LR=0.015", "SLEEP=0.3")
    seed(wide_repo, "lr 0.03", "LR=0.03", "SLEEP=0.3")
    run_loop(wide_repo, executor=executor, workers=2, max_trials=5, search_mode="islands", migrate_every=2)
    store = Store(wide_repo / "experiments.db")
    run = store.get_run(TAG)
    rows = store.trials(run["id"])
    events = [e for e in store.events(run["id"]) if e["kind"] == "migration"]
    store.close()
    proposals = rows[1:]
    assert {r["lineage"] for r in proposals} == {r["worker"] for r in proposals} and rows[0]["lineage"] == "main"
    assert len({r["lineage"] for r in proposals}) == 2
    repo = GitRepo.open(wide_repo)
    islands = run["islands"]
    for lineage, trial_id in islands.items():
        incumbent = next(r for r in rows if r["id"] == trial_id)
        assert repo.branch_commit(f"autoloop/{TAG}-{lineage}") == incumbent["trial_commit"]
    for row in proposals:  # each proposal started from its own lineage's incumbent of the time
        earlier = [r for r in rows if r["number"] < row["number"] and r["status"] == "keep"
                   and r["lineage"] in (row["lineage"], "main")]
        assert row["parent_commit"] in {r["trial_commit"] for r in earlier} | {
            r["trial_commit"] for r in rows if r["status"] == "keep"}
    best = min((r for r in rows if r["status"] == "keep"), key=lambda r: r["metric"])
    assert run["best_commit"] == best["trial_commit"]
    assert events, "the better lineage's incumbent migrated to the other"
    assert len(set(islands.values())) == 1  # after the migration both lineages hold the best


def _kill_the_worker_of(pidfile: Path, done: threading.Event, killed: list) -> None:
    """Wait until the victim trial's training writes its pid file, then SIGKILL the worker
    running it (its parent: the local worker process, or the Ray actor)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not done.is_set():
        time.sleep(0.2)
        try:
            pids = json.loads(pidfile.read_text())
        except (OSError, ValueError):
            continue
        time.sleep(0.5)
        os.kill(pids["ppid"], signal.SIGKILL)
        killed.append(pids)
        return


def test_a_worker_killed_mid_trial_interrupts_its_trial_and_the_idea_runs_again(wide_repo, executor, tmp_path):
    pidfile = tmp_path / "victim.json"
    seed(wide_repo, "victim", "LR=0.03", "SLEEP=6.0", f"PIDFILE={str(pidfile)!r}")
    seed(wide_repo, "bystander", "LR=0.04", "SLEEP=2.0")
    done, killed = threading.Event(), []
    killer = threading.Thread(target=_kill_the_worker_of, args=(pidfile, done, killed), daemon=True)
    killer.start()
    try:
        run_loop(wide_repo, executor=executor, workers=2, max_trials=4)
    finally:
        done.set()
        killer.join()
    assert killed, "the victim never trained"
    rows = trials(wide_repo)
    victims = [r for r in rows if r["description"] == "victim"]
    assert victims[0]["status"] == "interrupted" and "lost" in victims[0]["reason"], victims[0]["reason"]
    assert len(victims) == 2 and victims[1]["status"] == "discard"  # its idea went back to the queue and ran
    assert [r["status"] for r in rows if r["description"] == "bystander"] == ["discard"]
    assert not _alive(killed[0]["pid"])  # its training did not outlive its worker
    assert_consistent(wide_repo)


def test_workers_that_keep_dying_pause_the_run(tmp_path):
    repo = make_repo(tmp_path / "repo", fake_source(MODE="kill_worker"))
    summary = run_loop(repo, executor="local", workers=2, max_trials=10)
    assert summary.paused and "3 trials in a row lost their worker" in summary.stop_reason
    rows = trials(repo)
    assert [r["status"] for r in rows] == ["interrupted"] * 3 and all("lost" in r["reason"] for r in rows)
    store = Store(repo / "experiments.db")
    assert store.live_processes() == []
    store.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


@pytest.mark.slow
def test_controller_killed_with_two_trials_running_recovers_both(wide_repo):
    # Long enough to be caught in flight, and no longer: recovery tries both ideas again.
    seed(wide_repo, "first", "LR=0.03", "SLEEP=12.0")
    seed(wide_repo, "second", "LR=0.04", "SLEEP=12.0")
    seed(wide_repo, "third", "LR=0.01", "SLEEP=0.1")
    args = ["autoloop", "run", "--tag", TAG, "--time-budget", "60", "--grace-seconds", "30", "--no-verify",
            "--no-sandbox", "--proposers", "ideas", "--workers", "2", "--decision-rule", "strict", "--drift-every", "0"]
    proc = subprocess.Popen(args, cwd=wide_repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    running = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(running) < 2:
        time.sleep(0.3)
        if (wide_repo / "experiments.db").exists():
            store = Store(wide_repo / "experiments.db")
            run = store.get_run(TAG)
            running = [t for t in store.running_trials(run["id"]) if t.get("pgid")] if run else []
            workers = store.live_processes(run["id"]) if run else []
            store.close()
    assert len(running) == 2, proc.stderr.read() if proc.poll() is not None else "two trials never ran at once"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = [t["pgid"] for t in running] + [w["pgid"] for w in workers]
    assert any(process_group_alive(g) for g in left)  # the dead controller left its workers behind
    final = subprocess.run(args + ["--max-trials", "3"], cwd=wide_repo, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stdout + final.stderr
    assert not any(process_group_alive(g) for g in left)  # recovery ended them
    rows = trials(wide_repo)
    first = [r for r in rows if r["description"] == "first"]
    assert first[0]["status"] == "interrupted" and "recovered" in first[0]["reason"]
    assert {r["description"] for r in rows[:3] if r["status"] == "interrupted"} == {"first", "second"}
    assert "third" in {r["description"] for r in rows}
    store = Store(wide_repo / "experiments.db")
    assert store.live_processes() == []
    store.close()
    assert_consistent(wide_repo)


def test_mixed_devices_are_refused_unless_allowed(wide_repo):
    from autoloop.errors import AutoloopError
    from autoloop.measure.executors import Executor, check_devices

    class Slot:
        def __init__(self, name, device):
            self.name, self.device = name, device

        def close(self):
            pass

    executor = Executor("local", [Slot("w0", "NVIDIA H100 80GB HBM3"), Slot("w1", "NVIDIA A100-SXM4-40GB")])
    with pytest.raises(AutoloopError, match="different devices .* --allow-mixed-devices"):
        check_devices(executor, allow_mixed=False)
    check_devices(executor, allow_mixed=True)
    check_devices(Executor("local", [Slot("w0", "cpu"), Slot("w1", "cpu")]), allow_mixed=False)


def test_local_executor_without_a_gpu_needs_workers(wide_repo, monkeypatch):
    from autoloop.errors import AutoloopError
    from autoloop.measure.executors import local

    monkeypatch.setattr(local, "visible_gpus", lambda: [])  # what nvidia-smi says on a machine without one

    with pytest.raises(AutoloopError, match="found no GPU .* --workers N"):
        run_loop(wide_repo, executor="local", workers=0, max_trials=1)


def test_with_mixed_devices_a_candidate_pairs_with_the_incumbent_on_its_own_kind(tmp_path):
    """The incumbent's runs a comparison uses are those on the candidate's kind of device
    (runs recorded before devices were, NULL, pair with any)."""
    from autoloop.config import Config
    from autoloop.loop.controller import Controller
    from autoloop.store import Kind

    store = Store(tmp_path / "experiments.db")
    run = store.create_run("mix", branch="autoloop/mix", repo=str(tmp_path), base_commit="0" * 40, best_commit="0" * 40)
    incumbent = store.new_trial(run["id"], Kind.BASELINE)
    for seed, metric, device in ((1, 3.0, "NVIDIA H100 80GB HBM3"), (2, 3.1, "NVIDIA H100 80GB HBM3"),
                                 (1, 3.4, "NVIDIA A100-SXM4-40GB"), (3, 3.2, None)):
        store.add_measurement(incumbent["id"], metric, seed=seed, role="baseline", status="ok", device=device)
    controller = Controller(Config(tag="mix"), tmp_path, verifier=None)
    controller.store = store
    try:
        assert controller.incumbent_runs(incumbent, "NVIDIA A100-SXM4-40GB") == {1: 3.4, 3: 3.2}
        assert controller.incumbent_runs(incumbent, "NVIDIA H100 80GB HBM3") == {1: 3.0, 2: 3.1, 3: 3.2}
        assert controller.incumbent_runs(incumbent) == {1: 3.0, 2: 3.1, 3: 3.2}  # one kind: the first run per seed
    finally:
        store.close()


def test_a_requeued_edit_survives_the_end_of_the_invocation(wide_repo):
    seed(wide_repo, "lr 0.01", "LR=0.01")
    seed(wide_repo, "width 64", "WIDTH=64", "SLEEP=4.0")
    run_loop(wide_repo, executor="local", workers=2, max_trials=3)  # stops before the re-based edit runs
    slow = next(r for r in trials(wide_repo) if r["description"] == "width 64")
    assert slow["status"] == "discard" and slow["decision"]["requeued"] is True
    assert not any(r["derived_from"] == slow["id"] for r in trials(wide_repo))
    run_loop(wide_repo, executor="local", workers=2, max_trials=1)
    (rebased,) = [r for r in trials(wide_repo) if r["derived_from"] == slow["id"]]
    assert "re-based from trial" in rebased["description"] and rebased["status"] == "keep"
