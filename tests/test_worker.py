"""The worker half of a measurement (autoloop.measure.worker) and its job/result (autoloop.measure.job).

With the fake training script: the JSON round-trip, `python -m autoloop.measure.worker` as the
local executor runs it (result file, pids.json, a worker killed mid-job, the ABORT file),
the harness path (feed, sandbox, integrity snapshots) in a worker process, and the
controller's side: the device recorded, a lost worker interrupting its trial.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAKE_TRAIN, REPO_ROOT, make_repo

from autoloop.config import resolve
from autoloop.loop.controller import Controller
from autoloop.measure.executors.serial import SerialSlot
from autoloop.measure.job import JobResult, MeasureJob
from autoloop.measure.runner import kill_process_group, process_group_alive, process_start_time
from autoloop.proposers.seeding import seed_idea
from autoloop.store import Store
from autoloop.measure.worker import run_job


def _job(repo: Path, run_dir: Path, **overrides) -> MeasureJob:
    fields = dict(
        kind="train", commit="0" * 40, seed=3, role="candidate", tag="w", script="train.py",
        sources={"train.py": (repo / "train.py").read_text()}, train_argv=[sys.executable, "train.py"],
        time_budget=5.0, grace_seconds=60.0, data_dir=str(repo / "no-data"), harness_mode=False,
        external_eval=False, sandbox="off", project_dir=str(repo), run_dir=str(run_dir),
    )
    fields.update(overrides)
    return MeasureJob(**fields)


def _repo(tmp_path: Path, **constants) -> Path:
    source = FAKE_TRAIN.read_text()
    for name, value in constants.items():
        source = "\n".join(f"{name} = {value!r}" if line.startswith(f"{name} = ") else line
                           for line in source.splitlines()) + "\n"
    return make_repo(tmp_path / "repo", source)


def _spawn(job: MeasureJob, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    job_file, result_file = tmp_path / "job.json", tmp_path / "result.json"
    job_file.write_text(job.to_json())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "autoloop.measure.worker", str(job_file), str(result_file)], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return proc, result_file


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        assert proc.poll() is None, proc.stdout.read().decode()
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear")


def test_job_and_result_survive_json():
    job = MeasureJob(kind="verify", commit="abc", seed=7, sources={"train.py": "x = 1\n"},
                     train_argv=["python", "train.py"], max_steps=40, env={"CUDA_VISIBLE_DEVICES": "1"},
                     checkpoint="/runs/1/checkpoint.pt", result={"device": "cuda", "curve": [{"step": 1}]},
                     hidden=["/repo/.git"])
    assert MeasureJob.from_json(job.to_json()) == job
    assert json.loads(job.to_json())["checkpoint"] == "/runs/1/checkpoint.pt"  # plain types only
    result = JobResult("ok", metric=1.25, metric_source="verified", heldout=1.3, device="NVIDIA H100",
                       fields={"budget": {"steps": 40}, "wall_seconds": 2.0}, result={"curve": [1, 2]},
                       files={"train.log": b"\x00log\xff", "eval/eval.json": b"{}"}, repaired=["/x.pyc"])
    again = JobResult.from_json(result.to_json())
    assert again == result and again.files["train.log"] == b"\x00log\xff"
    # a newer worker's extra keys are ignored; a missing key takes its default
    data = json.loads(result.to_json()) | {"from_the_future": 1}
    del data["pause"]
    assert JobResult.from_dict(data).pause is None
    with pytest.raises(ValueError):
        JobResult("exploded")
    with pytest.raises(ValueError):
        MeasureJob(kind="dance", commit="x", seed=0)


def test_worker_process_writes_its_result_and_pids(tmp_path):
    repo = _repo(tmp_path)
    run_dir = tmp_path / "run"
    proc, result_file = _spawn(_job(repo, run_dir), tmp_path)
    assert proc.wait(timeout=120) == 0, proc.stdout.read().decode()
    result = JobResult.from_json(result_file.read_text())
    assert result.status == "ok" and result.metric == pytest.approx(1.0 + (-1.69897 + 2.0) ** 2, abs=1e-4)
    assert result.metric_source == "harness" and result.device == "cpu"
    assert result.fields["num_steps"] == 10 and result.result["curve"]  # the curve travels in the result
    assert "curve" not in result.fields["result"]
    pids = json.loads((run_dir / "pids.json").read_text())
    assert set(pids) == {"pid", "pgid", "start_time"} and pids["pid"] == pids["pgid"] > 0
    assert (run_dir / "train.log").exists() and (run_dir / "result.json").exists()
    assert not list(tmp_path.glob(".result.json.*.tmp"))


def test_a_killed_worker_leaves_no_result_and_its_pids_let_the_parent_clean_up(tmp_path):
    repo = _repo(tmp_path, MODE="hang")
    run_dir = tmp_path / "run"
    proc, result_file = _spawn(_job(repo, run_dir), tmp_path)
    pids = _wait_for(run_dir / "pids.json", proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert not result_file.exists()  # the parent calls the job lost
    assert process_start_time(pids["pid"]) == pids["start_time"]
    assert kill_process_group(pids["pgid"], expected_pid=pids["pid"], expected_start_time=pids["start_time"], grace=1)
    assert not process_group_alive(pids["pgid"])


def test_the_abort_file_stops_the_run(tmp_path):
    repo = _repo(tmp_path, MODE="hang")
    run_dir = tmp_path / "run"
    proc, result_file = _spawn(_job(repo, run_dir), tmp_path)
    pids = _wait_for(run_dir / "pids.json", proc)
    started = time.monotonic()
    (run_dir / "ABORT").touch()
    assert proc.wait(timeout=60) == 0, proc.stdout.read().decode()
    assert time.monotonic() - started < 30
    result = JobResult.from_json(result_file.read_text())
    assert result.status == "aborted" and result.metric is None
    assert not process_group_alive(pids["pgid"])


def test_sigterm_ends_the_worker_and_its_training(tmp_path):
    repo = _repo(tmp_path, MODE="hang")
    run_dir = tmp_path / "run"
    proc, result_file = _spawn(_job(repo, run_dir), tmp_path)
    pids = _wait_for(run_dir / "pids.json", proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) != 0
    assert not result_file.exists() and not process_group_alive(pids["pgid"])


def test_worker_process_in_harness_mode(tmp_path, embedded_dataset):
    """The feed, the trusted warm-up, the snapshots and the sandbox, in a worker process."""
    repo = _repo(tmp_path)
    run_dir = tmp_path / "run"
    job = _job(repo, run_dir, harness_mode=True, sandbox="auto", data_dir=str(embedded_dataset.path),
               data_fingerprint=embedded_dataset.fingerprint, max_steps=10,
               hidden=[str(repo / ".git"), str(repo / ".autoloop"), str(repo / "experiments.db")])
    proc, result_file = _spawn(job, tmp_path)
    assert proc.wait(timeout=300) == 0, proc.stdout.read().decode()
    result = JobResult.from_json(result_file.read_text())
    assert result.status == "ok", result.reason
    assert result.pause is None and result.repaired == []
    assert "budget" in result.fields  # judged on the feed's figures
    assert not (run_dir / "feed.sock").exists()
    from autoloop.measure.sandbox import detect

    assert f"[sandbox: {detect().kind}]" in (run_dir / "train.log").read_text()


def test_a_verify_job_without_its_checkpoint_is_invalid(tmp_path):
    repo = _repo(tmp_path)
    run_dir = tmp_path / "run"
    job = _job(repo, run_dir, kind="verify", verify=True, checkpoint=str(run_dir / "checkpoint.pt"))
    result = run_job(job, project_dir=repo, run_dir=run_dir)
    assert result.status == "invalid" and "is gone" in result.reason


# ---------------------------------------------------------------------------- the controller's side


def _run(repo: Path, slot_class=None, **flags):
    flags = {"tag": "t", "time_budget": 5, "grace_seconds": 20, "proposers": "ideas", "decision_rule": "strict",
             "drift_every": 0, **flags}
    controller = Controller(resolve(repo, flags), repo, verifier=None)
    if slot_class is not None:
        controller.bind_slot(slot_class(controller))
    return controller.run()


def _rows(repo: Path):
    store = Store(repo / "experiments.db")
    try:
        run = store.get_run("t")
        trials = store.trials(run["id"])
        return trials, {t["id"]: store.measurements(t["id"]) for t in trials}, store.ideas()
    finally:
        store.close()


def test_the_serial_slot_records_the_device(fake_repo):
    seed_idea(resolve(fake_repo, {}), fake_repo, "lower lr", sets=["LR=0.01"], patch=None)
    summary = _run(fake_repo, max_trials=2)
    assert summary.kept == 2
    trials, measurements, _ = _rows(fake_repo)
    assert [m["device"] for t in trials for m in measurements[t["id"]]] == ["cpu", "cpu"]


def test_a_lost_worker_interrupts_its_trial_and_requeues_its_idea(fake_repo):
    seed_idea(resolve(fake_repo, {}), fake_repo, "lower lr", sets=["LR=0.01"], patch=None)

    class Flaky(SerialSlot):
        name = "flaky"
        runs = 0

        def run(self, job, run_dir, on_start=None, should_abort=None):
            Flaky.runs += 1
            if Flaky.runs == 2:  # the first proposal's run
                return JobResult.lost("the worker process was killed (SIGKILL)", worker=self.name)
            return super().run(job, run_dir, on_start, should_abort)

    summary = _run(fake_repo, Flaky, max_trials=2)
    trials, measurements, ideas = _rows(fake_repo)
    assert [t["status"] for t in trials] == ["keep", "interrupted"] and summary.kept == 1
    assert "killed (SIGKILL)" in trials[1]["reason"]
    (lost,) = measurements[trials[1]["id"]]
    assert lost["status"] == "lost" and lost["metric"] is None and "SIGKILL" in lost["reason"]
    assert ideas[0]["status"] == "pending"  # it runs again
