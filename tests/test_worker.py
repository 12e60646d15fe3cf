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
from autoloop.base.processes import kill_process_group, process_group_alive
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


class _Spawned:
    """`python -m autoloop.measure.worker JOB --control-fd N` as the local executor runs it:
    process starts and the result come through the control pipe, "abort" goes to stdin."""

    def __init__(self, job: MeasureJob, tmp_path: Path):
        import threading

        job_file = tmp_path / "job.json"
        job_file.write_text(job.to_json())
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
        read, write = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-m", "autoloop.measure.worker", str(job_file), "--control-fd",
                                      str(write)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, pass_fds=(write,))
        os.close(write)
        self.messages: list[dict] = []
        self.reader = threading.Thread(target=self._read, args=(read,), daemon=True)
        self.reader.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd) as handle:
            for line in handle:
                self.messages.append(json.loads(line))

    @property
    def result(self) -> JobResult | None:
        self.reader.join(10)
        found = [m["result"] for m in self.messages if "result" in m]
        return JobResult.from_dict(found[-1]) if found else None

    def started(self, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            starts = [m["started"] for m in self.messages if "started" in m]
            if starts:
                pid, pgid, start_time = starts[0]
                return {"pid": pid, "pgid": pgid, "start_time": start_time}
            assert self.proc.poll() is None, self.proc.stdout.read().decode()
            time.sleep(0.05)
        raise AssertionError("the worker told no process start")


def _spawn(job: MeasureJob, tmp_path: Path) -> _Spawned:
    return _Spawned(job, tmp_path)


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


def test_worker_process_sends_its_result_and_pids_through_its_pipe(tmp_path):
    repo = _repo(tmp_path)
    run_dir = tmp_path / "run"
    worker = _spawn(_job(repo, run_dir), tmp_path)
    assert worker.proc.wait(timeout=120) == 0, worker.proc.stdout.read().decode()
    result = worker.result
    assert result.status == "ok" and result.metric == pytest.approx(1.0 + (-1.69897 + 2.0) ** 2, abs=1e-4)
    assert result.metric_source == "harness" and result.device == "cpu"
    assert result.fields["num_steps"] == 10 and result.result["curve"]  # the curve travels in the result
    assert "curve" not in result.fields["result"]
    pids = worker.started()
    assert set(pids) == {"pid", "pgid", "start_time"} and pids["pid"] == pids["pgid"] > 0
    assert (run_dir / "train.log").exists() and (run_dir / "out" / "result.json").exists()
    # No control file in the run folder, where an unsandboxed training could write one.
    assert not (run_dir / "pids.json").exists() and not list(run_dir.glob("*result*.json"))


def test_a_killed_worker_leaves_no_result_and_its_pids_let_the_parent_clean_up(tmp_path):
    repo = _repo(tmp_path, MODE="hang")
    run_dir = tmp_path / "run"
    worker = _spawn(_job(repo, run_dir), tmp_path)
    pids = worker.started()
    os.kill(worker.proc.pid, signal.SIGKILL)
    worker.proc.wait(timeout=30)
    assert worker.result is None  # the parent calls the job lost
    # ... and its training died with it (PR_SET_PDEATHSIG), so there is nothing left to kill.
    deadline = time.monotonic() + 10
    while process_group_alive(pids["pgid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_group_alive(pids["pgid"])
    assert not kill_process_group(pids["pgid"], expected_pid=pids["pid"], expected_start_time=pids["start_time"],
                                  grace=1)


def test_abort_on_stdin_stops_the_run(tmp_path):
    repo = _repo(tmp_path, MODE="hang")
    run_dir = tmp_path / "run"
    worker = _spawn(_job(repo, run_dir), tmp_path)
    pids = worker.started()
    started = time.monotonic()
    worker.proc.stdin.write(b"abort\n")
    worker.proc.stdin.flush()
    assert worker.proc.wait(timeout=60) == 0, worker.proc.stdout.read().decode()
    assert time.monotonic() - started < 30
    result = worker.result
    assert result.status == "aborted" and result.metric is None
    assert not process_group_alive(pids["pgid"])


def test_a_worker_whose_parent_is_gone_stops(tmp_path):
    """The slot's end of stdin closing (the controller died) is an abort too."""
    repo = _repo(tmp_path, MODE="hang")
    worker = _spawn(_job(repo, tmp_path / "run"), tmp_path)
    pids = worker.started()
    worker.proc.stdin.close()
    assert worker.proc.wait(timeout=60) == 0
    assert worker.result.status == "aborted" and not process_group_alive(pids["pgid"])


def test_sigterm_ends_the_worker_and_its_training(tmp_path):
    repo = _repo(tmp_path, MODE="hang")
    run_dir = tmp_path / "run"
    worker = _spawn(_job(repo, run_dir), tmp_path)
    pids = worker.started()
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(timeout=60) != 0
    assert worker.result is None and not process_group_alive(pids["pgid"])


def test_worker_process_in_harness_mode(tmp_path, embedded_dataset):
    """The feed, the trusted warm-up, the snapshots and the sandbox, in a worker process."""
    repo = _repo(tmp_path)
    run_dir = tmp_path / "run"
    job = _job(repo, run_dir, harness_mode=True, sandbox="auto", data_dir=str(embedded_dataset.path),
               data_fingerprint=embedded_dataset.fingerprint, max_steps=10,
               hidden=[str(repo / ".git"), str(repo / ".autoloop"), str(repo / "experiments.db")])
    worker = _spawn(job, tmp_path)
    assert worker.proc.wait(timeout=300) == 0, worker.proc.stdout.read().decode()
    result = worker.result
    assert result.status == "ok", result.reason
    assert result.pause is None and result.repaired == []
    assert "budget" in result.fields  # judged on the feed's figures
    assert not (run_dir / "feed" / "feed.sock").exists()
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


def _slot_judging(verdict):
    """A serial slot whose n-th run (counted from 1) comes back as `verdict(result, n)`
    returns it, or the real result when that gives None: a budget verdict without the
    machine that would cause it."""

    class Judged(SerialSlot):
        runs = 0

        def run(self, job, run_dir, on_start=None, should_abort=None):
            Judged.runs += 1
            result = super().run(job, run_dir, on_start, should_abort)
            return verdict(result, Judged.runs) or result

    return Judged


def _tail_verdict(result: JobResult, reason: str) -> JobResult:
    """The run as the budget's tail rule fails it (the verdict a busy host can cause)."""
    from autoloop.trust.budget import TAIL_RULE

    return JobResult("invalid", reason, fields={**result.fields, "budget": {"rule": TAIL_RULE}},
                     result=result.result, device=result.device, worker=result.worker)


def test_a_run_only_a_stall_failed_is_measured_again_and_kept(fake_repo):
    """An honest run that one stalled step made fail the tail rule: measured again at the
    same seed, that run decides; the first stays on record, and the run says so."""
    seed_idea(resolve(fake_repo, {}), fake_repo, "lower lr", sets=["LR=0.01"], patch=None)
    stalled = _slot_judging(lambda result, n: _tail_verdict(result, "its last step took 4.59 s") if n == 2 else None)
    summary = _run(fake_repo, stalled, max_trials=2)
    trials, measurements, _ = _rows(fake_repo)
    assert [t["status"] for t in trials] == ["keep", "keep"] and summary.kept == 2, [t["reason"] for t in trials]
    first, again = measurements[trials[1]["id"]]
    assert (first["status"], first["seed"], first["metric"]) == ("invalid", again["seed"], None)
    assert "4.59 s" in first["reason"] and again["status"] == "ok" and again["metric"] == trials[1]["metric"]
    store = Store(fake_repo / "experiments.db")
    try:
        events = [e for e in store.events(store.get_run("t")["id"]) if e["kind"] == "remeasured"]
    finally:
        store.close()
    assert len(events) == 1 and "measuring it once more" in events[0]["message"]


def test_a_run_that_fails_the_tail_rule_twice_is_invalid_and_says_both(fake_repo):
    """Training the budget does not see happens at every run: the second run fails too,
    and the trial is invalid with both runs' reasons; a third run is never asked for."""
    seed_idea(resolve(fake_repo, {}), fake_repo, "lower lr", sets=["LR=0.01"], patch=None)
    hoarder = _slot_judging(lambda result, n: _tail_verdict(result, f"its last step took {n}.0 s") if n > 1 else None)
    _run(fake_repo, hoarder, max_trials=2)
    trials, measurements, _ = _rows(fake_repo)
    assert [t["status"] for t in trials] == ["keep", "invalid"]
    assert trials[1]["reason"].startswith("its last step took 3.0 s (and so did its first run at this seed: "
                                          "its last step took 2.0 s)"), trials[1]["reason"]
    assert [m["status"] for m in measurements[trials[1]["id"]]] == ["invalid", "invalid"] and hoarder.runs == 3


def test_a_failure_of_another_budget_rule_is_not_measured_again(fake_repo):
    seed_idea(resolve(fake_repo, {}), fake_repo, "lower lr", sets=["LR=0.01"], patch=None)
    half_clock = _slot_judging(lambda result, n: JobResult(
        "invalid", "drew training batches for 40.0 s after warm-up, over its 20 s budget",
        fields={**result.fields, "budget": {}}, result=result.result) if n == 2 else None)
    _run(fake_repo, half_clock, max_trials=2)
    trials, measurements, _ = _rows(fake_repo)
    assert [t["status"] for t in trials] == ["keep", "invalid"] and half_clock.runs == 2
    assert len(measurements[trials[1]["id"]]) == 1


def test_two_workers_measuring_one_trial_get_two_run_folders(tmp_path):
    """The incumbent re-measured for two candidates at once: both runs were given runs/<k>
    with the same k (1 + the runs recorded), and the second emptied the folder the first
    was training in (its feed socket gone: a crash, a lost worker). Each gets its own now,
    and a folder a dead controller left is kept, not reused."""
    import threading

    from autoloop.measure.measurer import Measurer

    class Host:  # the two things run_dir reads of its MeasureHost
        class store:
            @staticmethod
            def measurements(trial_id):
                time.sleep(0.05)  # a db read: the other thread runs meanwhile
                return [{"id": 1}, {"id": 2}]

        @staticmethod
        def trial_dir(number):
            return tmp_path / "trials" / str(number)

    left = tmp_path / "trials" / "1" / "runs" / "3"
    left.mkdir(parents=True)
    (left / "train.log").write_text("a run the controller did not live to record")
    measurer = Measurer(Host())
    got = []
    threads = [threading.Thread(target=lambda: got.append(measurer.run_dir({"id": 7, "number": 1}))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.name for p in got) == ["4", "5"]
    assert (left / "train.log").read_text().startswith("a run the controller")
