"""The Ray executor (autoloop/measure/executors/ray.py) on a local Ray cluster with pretend GPUs.

One cluster for the module (`num_cpus=2, num_gpus=2`: Ray hands out GPU ids, there is no
GPU behind them), two slots. Jobs run the fake training script (tests/fakes/fake_train.py)
through the real `autoloop.measure.worker.run_job` on the "node" (an actor process with its own
cache folder), without the harness's feed and evaluator (harness_mode off), so a job
takes a second. Nothing is downloaded: the node's datasets come from the embedded
corpus or from local files the test writes.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from autoloop.measure.executors import ray as R  # noqa: E402
from autoloop.measure.job import MeasureJob  # noqa: E402
from conftest import FAKE_TRAIN, ray_temp_dir, write_test_corpus_key  # noqa: E402

CHECKPOINT_BYTES = b"pretend checkpoint \x00\x01\x02"


def fake_source(mode: str = "ok", lr: float = 0.02) -> str:
    """fake_train.py, which also saves a (pretend) checkpoint after a finished run."""
    text = FAKE_TRAIN.read_text().replace('MODE = "ok"', f'MODE = "{mode}"').replace("LR = 0.02", f"LR = {lr}")
    return text.replace(
        'if __name__ == "__main__":\n    main()',
        'if __name__ == "__main__":\n    main()\n'
        '    if os.environ.get("AUTOLOOP_CHECKPOINT"):\n'
        f'        open(os.environ["AUTOLOOP_CHECKPOINT"], "wb").write({CHECKPOINT_BYTES!r})\n',
    )


def make_job(ds, **changes) -> MeasureJob:
    fields = dict(
        kind="train", commit="c0ffee", seed=3, sources={"train.py": fake_source()},
        train_argv=[sys.executable, "train.py"], time_budget=30.0, grace_seconds=30.0,
        data_dir=str(ds.path), data_fingerprint=ds.fingerprint, harness_mode=False, external_eval=False,
        sandbox="off",
    )
    fields.update(changes)
    return MeasureJob(**fields)


@pytest.fixture(scope="module")
def node_cache():
    path = Path(tempfile.mkdtemp(prefix="autoloop-node-cache-"))
    write_test_corpus_key(path)  # the controller's key copied to the node: the same embedded corpus
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def executor(node_cache, tmp_path_factory):
    # Ray's unix sockets live under its temp folder: pytest's tmp_path is too long for them.
    temp = str(ray_temp_dir(tmp_path_factory, "rayx"))
    ex = R.RayExecutor(workers=2, temp_dir=temp, num_cpus=2, num_gpus=2, node_cache_dir=node_cache,
                       node_env={"OMP_NUM_THREADS": "1"}, work_dir=temp)
    try:
        yield ex
    finally:
        ex.close()
        shutil.rmtree(temp, ignore_errors=True)


def run_in_thread(slot, job, run_dir, should_abort=None):
    """slot.run in a thread; returns (thread, box with "result", event set by on_start)."""
    box: dict = {}
    started = threading.Event()

    def go():
        box["result"] = slot.run(job, run_dir, on_start=lambda *a: (box.setdefault("on_start", a), started.set()),
                                 should_abort=should_abort)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread, box, started


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def wait_dead(pid: int, seconds: float = 15) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.2)
    return False


# ---------------------------------------------------------------------------- on the cluster


def test_executor_has_one_slot_per_gpu(executor):
    assert [s.name for s in executor.slots] == ["ray-w0", "ray-w1"]
    assert all(s.project_dir is None and s.device_env == {} for s in executor.slots)
    gpus = {tuple(s.actor_info()["gpu_ids"]) for s in executor.slots}
    assert gpus == {("0",), ("1",)}  # each actor holds its own GPU
    assert "2 worker(s)" in executor.describe()


def test_slot_runs_a_job_and_sends_back_its_files(executor, embedded_dataset, tmp_path):
    slot = executor.slots[0]
    slot.prepare("c0ffee")  # nothing to check out: the job carries the files
    run_dir = tmp_path / "runs" / "1"
    calls = []
    result = slot.run(make_job(embedded_dataset), run_dir, on_start=lambda *a: calls.append(a))
    assert result.status == "ok", result.reason
    assert result.metric == pytest.approx(1.0 + (math.log10(0.02) + 2.0) ** 2)
    assert result.worker == "ray-w0" and result.device == "cpu"  # pretend GPUs: no CUDA device behind them
    assert calls == [(None, None, None)]  # a remote pid means nothing here
    assert (run_dir / "out" / "checkpoint.pt").read_bytes() == CHECKPOINT_BYTES
    assert '"val_bpb"' in (run_dir / "out" / "result.json").read_text()
    assert "val_bpb:" in (run_dir / "train.log").read_text()
    assert '"step": 1' in (run_dir / "out" / "progress.jsonl").read_text()
    assert result.files == {}  # written into run_dir already
    # The node's paths do not leak into what the controller records.
    assert "autoloop-ray-w0-" not in repr(result)


def test_both_slots_run_side_by_side(executor, embedded_dataset, tmp_path):
    job = make_job(embedded_dataset, sources={"train.py": fake_source().replace("SLEEP = 0.0", "SLEEP = 8.0")})
    runs = [run_in_thread(slot, job, tmp_path / slot.name) for slot in executor.slots]
    for _, _, started in runs:
        assert started.wait(30)
    # both train at once (each sleeps long enough that a busy machine's late start still overlaps)
    assert all(thread.is_alive() for thread, _, _ in runs)
    for thread, _, _ in runs:
        thread.join(60)
    assert [box["result"].status for _, box, _ in runs] == ["ok", "ok"]
    assert [box["result"].worker for _, box, _ in runs] == ["ray-w0", "ray-w1"]


def test_the_controller_measures_on_a_ray_slot(executor, fake_repo):
    """A whole run of the loop (baseline, one proposal) with its trials measured on the cluster."""
    from autoloop.config import resolve
    from autoloop.loop.controller import Controller
    from autoloop.proposers.seeding import seed_idea
    from autoloop.store import Store

    seed_idea(resolve(fake_repo, {}), fake_repo, "lower lr", sets=["LR=0.01"], patch=None)
    flags = {"tag": "t", "time_budget": 5, "grace_seconds": 20, "proposers": "ideas", "decision_rule": "strict",
             "drift_every": 0, "max_trials": 2}
    controller = Controller(resolve(fake_repo, flags), fake_repo, verifier=None)
    controller.bind_slot(executor.slots[1])
    assert controller.run().kept == 2
    store = Store(fake_repo / "experiments.db")
    try:
        trials = store.trials(store.get_run("t")["id"])
        runs = [m for t in trials for m in store.measurements(t["id"])]
    finally:
        store.close()
    assert [m["status"] for m in runs] == ["ok", "ok"] and [m["device"] for m in runs] == ["cpu", "cpu"]
    assert runs[1]["metric"] < runs[0]["metric"]  # LR 0.01 is the fake's optimum
    for m in runs:
        log = Path(m["log_path"])
        assert "val_bpb:" in log.read_text() and (log.parent / "out" / "result.json").exists()


def test_the_commits_other_files_reach_the_node_with_the_repo(executor, embedded_dataset, tmp_path):
    from conftest import make_repo

    train = "import helper\n" + fake_source().replace("LR = 0.02", "LR = helper.LR")
    repo = make_repo(tmp_path / "repo", train, {"helper.py": "LR = 0.01\n"})
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    job = make_job(embedded_dataset, commit=head, sources={"train.py": train})  # helper.py is not editable
    slot = executor.slots[0]
    try:
        slot.repo_dir = repo
        result = slot.run(job, tmp_path / "run")
    finally:
        slot.repo_dir = None
    assert result.status == "ok", result.reason
    assert result.metric == pytest.approx(1.0)  # LR 0.01 came from helper.py
    without = slot.run(job, tmp_path / "run2")
    assert without.status == "crash" and "helper" in (without.fields.get("error_tail") or "")


def test_data_fingerprint_mismatch_fails_clearly(executor, embedded_dataset, tmp_path):
    wrong = "f" * 64
    result = executor.slots[1].run(make_job(embedded_dataset, data_fingerprint=wrong), tmp_path / "run")
    assert result.status == "crash"
    assert "data fingerprint mismatch" in result.reason
    assert embedded_dataset.fingerprint[:16] in result.reason and wrong[:16] in result.reason
    assert "corpus.key" in result.reason  # the embedded corpus: the fix is the controller's key
    assert not (tmp_path / "run" / "out" / "result.json").exists()  # it never trained


def test_worker_killed_mid_trial_is_lost_and_the_slot_recovers(executor, embedded_dataset, tmp_path):
    slot = executor.slots[1]
    thread, box, started = run_in_thread(slot, make_job(embedded_dataset, sources={"train.py": fake_source("hang")}),
                                         tmp_path / "a")
    assert started.wait(60), "the remote training never started"
    training = slot.last_state["processes"][0]["pid"]
    info = slot.actor_info()
    actor_pid, scratch = info["pid"], Path(info["scratch"])
    assert scratch.is_dir() and info["guard_pid"] and alive(info["guard_pid"])
    os.kill(actor_pid, signal.SIGKILL)
    thread.join(60)
    result = box["result"]
    assert result.status == "lost" and result.reason.startswith("worker lost:"), result.reason
    assert result.worker == "ray-w1"
    assert wait_dead(training), "the lost worker's training is still running"
    # Its guardian outlived it (Ray kills an ending actor's children) and removed the node's
    # scratch folder, the run folder of the lost job in it.
    assert wait_dead(info["guard_pid"]), "the guardian is still waiting"
    assert not scratch.exists(), sorted(p.name for p in scratch.rglob("*"))
    again = slot.run(make_job(embedded_dataset), tmp_path / "b")
    assert again.status == "ok", again.reason
    assert slot.actor_info()["pid"] != actor_pid


def test_a_closed_slot_leaves_nothing_on_the_node(executor, embedded_dataset, tmp_path):
    """ray.kill (a slot's close, and a slot replacing its actor) ends the actor the way Ray
    ends one, killing its children: the guardian is not one of them, and removes the scratch."""
    slot = executor.slots[0]
    assert slot.run(make_job(embedded_dataset), tmp_path / "a").status == "ok"
    info = slot.actor_info()
    scratch = Path(info["scratch"])
    assert scratch.is_dir() and alive(info["guard_pid"])
    slot.close()
    assert wait_dead(info["pid"]) and wait_dead(info["guard_pid"]), "the actor or its guardian is still running"
    assert not scratch.exists(), sorted(p.name for p in scratch.rglob("*"))
    assert slot.run(make_job(embedded_dataset), tmp_path / "b").status == "ok"  # a new actor


def test_abort_stops_the_remote_training(executor, embedded_dataset, tmp_path):
    slot = executor.slots[0]
    asked = threading.Event()
    thread, box, started = run_in_thread(slot, make_job(embedded_dataset, sources={"train.py": fake_source("hang")}),
                                         tmp_path / "a", should_abort=asked.is_set)
    assert started.wait(60)
    training = slot.last_state["processes"][0]["pid"]
    # What the node writes while it trains reaches the controller's run folder as it comes.
    progress = tmp_path / "a" / "out" / "progress.jsonl"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and '"step": 1' not in (progress.read_text() if progress.exists() else ""):
        time.sleep(0.2)
    assert '"step": 1' in progress.read_text()
    t0 = time.monotonic()
    asked.set()
    thread.join(60)
    assert box["result"].status == "aborted"
    assert time.monotonic() - t0 < 30
    assert not alive(training)
    assert (tmp_path / "a" / "train.log").exists()  # what it wrote before it was stopped comes back
    assert slot.run(make_job(embedded_dataset), tmp_path / "b").status == "ok"


def test_verify_job_ships_the_checkpoint(executor, embedded_dataset, tmp_path):
    # The checkpoint is not a real model, so the harness's evaluator rejects it: what matters
    # is that the node had it (a missing one says "is gone") and that it is not sent back.
    run_dir = tmp_path / "run"
    (run_dir / "out").mkdir(parents=True)
    (run_dir / "out" / "checkpoint.pt").write_bytes(CHECKPOINT_BYTES)
    (run_dir / "train.log").write_text("the training's log\n")
    job = make_job(embedded_dataset, kind="verify", checkpoint=str(run_dir / "out" / "checkpoint.pt"),
                   result={"device": "cpu"}, harness_mode=True, external_eval=True, verify=True)
    result = executor.slots[0].run(job, run_dir)
    assert result.status == "invalid", result.reason
    assert "is gone" not in result.reason and "checkpoint" in result.reason
    assert "autoloop-ray-" not in result.reason  # the node's paths never reach what the controller records
    assert (run_dir / "verify").is_dir()
    assert (run_dir / "out" / "checkpoint.pt").read_bytes() == CHECKPOINT_BYTES
    assert (run_dir / "train.log").read_text() == "the training's log\n"  # the run's own files stay


# ---------------------------------------------------------------------------- the dataset on a node (no Ray)


def _local_dataset(tmp_path, monkeypatch, name="tiny"):
    from autoloop.prepare import prepare_dataset

    text = "\n<|endoftext|>\n".join(f"document {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 7) for i in range(400))
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "t.txt").write_text(text)
    monkeypatch.setenv("AUTOLOOP_CACHE_DIR", str(tmp_path / "controller"))
    return prepare_dataset(str(tmp_path / "corpus"), tokenizer="byte", name=name).dataset


def test_node_prepares_a_missing_dataset_from_the_controllers_recipe(tmp_path, monkeypatch):
    ds = _local_dataset(tmp_path, monkeypatch)
    spec = R.dataset_spec(make_job(ds, dataset="tiny"))
    spec["controller_dir"] = None  # a node that does not see the controller's disk
    monkeypatch.setenv("AUTOLOOP_CACHE_DIR", str(tmp_path / "node"))
    path, problem = R.ensure_node_dataset(spec, set())
    assert problem is None
    assert path == tmp_path / "node" / "data" / "tiny"
    from autoloop.harness.data import load_dataset

    assert load_dataset(path, prepare=False).fingerprint == ds.fingerprint


def test_node_with_other_data_under_the_same_name_is_refused(tmp_path, monkeypatch):
    ds = _local_dataset(tmp_path, monkeypatch)
    spec = R.dataset_spec(make_job(ds, dataset="tiny"))
    spec["controller_dir"] = None
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "t.txt").write_text("\n<|endoftext|>\n".join(f"other text {i} " * 9 for i in range(400)))
    monkeypatch.setenv("AUTOLOOP_CACHE_DIR", str(tmp_path / "node"))
    from autoloop.prepare import prepare_dataset

    other = prepare_dataset(str(tmp_path / "other"), tokenizer="byte", name="tiny").dataset
    path, problem = R.ensure_node_dataset(spec, set())
    assert path is None
    assert other.fingerprint[:16] in problem and ds.fingerprint[:16] in problem
    assert "autoloop prepare --dataset" in problem and "--name tiny --force" in problem


def test_node_without_the_local_source_files_says_what_to_do(tmp_path, monkeypatch):
    ds = _local_dataset(tmp_path, monkeypatch)
    spec = R.dataset_spec(make_job(ds, dataset="tiny"))
    spec["controller_dir"] = None
    shutil.rmtree(tmp_path / "corpus")
    monkeypatch.setenv("AUTOLOOP_CACHE_DIR", str(tmp_path / "node"))
    path, problem = R.ensure_node_dataset(spec, set())
    assert path is None and "which this node does not have" in problem


def test_temp_dir_too_long_for_rays_sockets_is_one_line():
    with pytest.raises(R.AutoloopError, match="too long"):
        R.check_temp_dir("/tmp/" + "x" * 80)


def test_slot_count_is_one_per_gpu_capped_and_refuses_no_gpu():
    assert R.slot_count(4, None) == 4 and R.slot_count(4, 2) == 2 and R.slot_count(2, 8) == 2
    assert R.slot_count(0, 3) == 3  # CPU workers, asked for
    with pytest.raises(R.AutoloopError, match="has no GPU"):
        R.slot_count(0, None)
