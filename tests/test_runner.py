"""Tests for autoloop.measure.runner with small fake training scripts that implement the contract."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from autoloop.base.processes import proc_stat
from autoloop.measure import reaper, runner
from autoloop.base.processes import kill_process_group, process_group_alive, process_start_time
from autoloop.measure.judge import parse_summary_block
from autoloop.measure.runner import run_training

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")

SUCCESS = """
import json, os
result = {"val_bpb": 1.234, "training_seconds": 0.1, "num_steps": 3, "num_params": 1000,
          "curve": [{"step": 1, "seconds": 0.1, "loss": 2.0, "lr": 0.001, "grad_norm": 1.0}]}
print("step 1 loss 2.0")
with open(os.environ["AUTOLOOP_RESULT"], "w") as f:
    json.dump(result, f)
print("---")
print("val_bpb: 9.999")  # the result JSON wins over the printed block
"""

REPORTED_ONLY = """
print("step 00953 | loss 3.21")
print("---")
print("val_bpb:          0.997900")
print("training_seconds: 300.1")
print("peak_vram_mb:     45060.2")
print("mfu_percent:      39.80")
print("total_tokens_M:   499.6")
print("num_steps:        953")
print("num_params_M:     50.3")
print("depth:            8")
"""

TRACEBACK = """
print("step 1 loss 2.0")
def f():
    raise ValueError("shapes (4, 8) and (9, 8) do not match")
f()
"""

FAIL_NAN = """
import sys
print("step 5 loss nan")
print("FAIL: loss is nan")
print("cleanup done")
sys.exit(1)
"""

NO_METRIC = """
print("training done, forgot to evaluate")
"""

NAN_METRIC = """
import json, os
with open(os.environ["AUTOLOOP_RESULT"], "w") as f:
    f.write('{"val_bpb": NaN, "num_steps": 3}')
"""

HANG_IGNORING_TERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("hanging", flush=True)
time.sleep(60)
"""

HANG = """
import time
print("hanging", flush=True)
time.sleep(60)
"""

GRANDCHILD = """
import json, os, subprocess, sys
code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
child = subprocess.Popen([sys.executable, "-c", code])
with open(os.environ["GRANDCHILD_PID_FILE"], "w") as f:
    f.write(str(child.pid))
with open(os.environ["AUTOLOOP_RESULT"], "w") as f:
    json.dump({"val_bpb": 1.5}, f)
# exit without waiting: the grandchild (same process group) lives on
"""

DUMP_ENV = """
import json, os
with open(os.environ["ENV_DUMP"], "w") as f:
    json.dump(dict(os.environ), f)
with open(os.environ["AUTOLOOP_RESULT"], "w") as f:
    json.dump({"val_bpb": 1.0}, f)
"""


def alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def run_script(tmp_path: Path, source: str, *, deadline: float = 15, extra_env: dict | None = None, **kwargs):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    env = {"AUTOLOOP_RESULT": str(tmp_path / "result.json"), "AUTOLOOP_SEED": "1", **(extra_env or {})}
    started: list[tuple] = []
    outcome = run_training(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        log_path=tmp_path / "logs" / "trial.log",
        deadline_seconds=deadline,
        kill_grace_seconds=kwargs.pop("kill_grace_seconds", 0.5),
        on_start=lambda pid, pgid, start: started.append((pid, pgid, start)),
        poll_interval=0.05,
        **kwargs,
    )
    assert started == [(outcome.pid, outcome.pgid, outcome.start_time)]
    assert outcome.pid == outcome.pgid and outcome.start_time is not None
    assert not process_group_alive(outcome.pgid)
    return outcome


def test_success_via_result_json(tmp_path: Path):
    outcome = run_script(tmp_path, SUCCESS)
    assert outcome.status == "ok" and outcome.returncode == 0 and outcome.reason is None
    assert (outcome.metric, outcome.metric_source) == (1.234, "harness")
    assert outcome.result["curve"][0]["loss"] == 2.0
    assert "step 1 loss 2.0" in outcome.error_tail
    log = (tmp_path / "logs" / "trial.log").read_text()
    assert log.startswith("# autoloop ") and "step 1 loss 2.0" in log and "ok, exit 0" in log


def test_reported_block_maps_autoresearch_keys(tmp_path: Path):
    outcome = run_script(tmp_path, REPORTED_ONLY)
    assert outcome.status == "ok"
    assert (outcome.metric, outcome.metric_source) == (0.9979, "reported")
    r = outcome.result
    assert r["peak_memory_mb"] == 45060.2 and "peak_vram_mb" not in r
    assert r["num_params"] == 50_300_000 and r["total_tokens"] == 499_600_000
    assert r["num_steps"] == 953 and r["depth"] == 8 and r["mfu_percent"] == 39.8


def test_stale_result_from_an_earlier_run_is_not_used(tmp_path: Path):
    (tmp_path / "result.json").write_text(json.dumps({"val_bpb": 0.5}))
    outcome = run_script(tmp_path, NO_METRIC)
    assert outcome.status == "crash"
    assert outcome.reason == "finished without a val_bpb metric"


def test_crash_reason_is_the_exception_line(tmp_path: Path):
    outcome = run_script(tmp_path, TRACEBACK)
    assert outcome.status == "crash" and outcome.returncode == 1
    assert outcome.reason == "ValueError: shapes (4, 8) and (9, 8) do not match"
    assert "Traceback (most recent call last)" in outcome.error_tail
    assert outcome.metric is None and outcome.metric_source is None


BARE_ASSERT = """
print("step 1 loss 2.0")
def attention(cfg):
    assert cfg["n_embd"] % cfg["n_head"] == 0 and cfg["n_head"] % cfg["n_kv_head"] == 0
attention({"n_embd": 128, "n_head": 2, "n_kv_head": 3})
"""


def test_a_bare_assertion_error_is_named_by_its_source_line(tmp_path: Path):
    """A failed assert without a message prints only "AssertionError": the reason adds the
    line the traceback shows, so the morning review says what broke."""
    outcome = run_script(tmp_path, BARE_ASSERT)
    assert outcome.status == "crash"
    assert outcome.reason == ('AssertionError: assert cfg["n_embd"] % cfg["n_head"] == 0 and '
                              'cfg["n_head"] % cfg["n_kv_head"] == 0 (train.py line 4)'), outcome.reason
    # An exception with its own message keeps it as it is.
    assert run_script(tmp_path, TRACEBACK).reason == "ValueError: shapes (4, 8) and (9, 8) do not match"


def test_fail_line_is_the_reason(tmp_path: Path):
    outcome = run_script(tmp_path, FAIL_NAN)
    assert (outcome.status, outcome.returncode, outcome.reason) == ("crash", 1, "FAIL: loss is nan")


def test_nan_metric_is_a_crash(tmp_path: Path):
    outcome = run_script(tmp_path, NAN_METRIC)
    assert (outcome.status, outcome.reason, outcome.metric) == ("crash", "val_bpb is nan", None)


def test_timeout_kills_a_process_that_ignores_sigterm(tmp_path: Path):
    start = time.monotonic()
    outcome = run_script(tmp_path, HANG_IGNORING_TERM, deadline=1.0, kill_grace_seconds=0.3)
    elapsed = time.monotonic() - start
    assert outcome.status == "timeout" and outcome.returncode == -signal.SIGKILL
    assert outcome.reason == "killed at the 1 s deadline"
    assert 1.0 <= outcome.wall_seconds < 5.0 and elapsed < 8.0  # generous: CI boxes are slow
    assert not alive(outcome.pid)


def test_should_abort_stops_with_sigterm(tmp_path: Path):
    asked = time.monotonic() + 0.5
    outcome = run_script(tmp_path, HANG, should_abort=lambda: time.monotonic() > asked)
    assert outcome.status == "aborted" and outcome.returncode == -signal.SIGTERM
    assert outcome.wall_seconds < 5.0


def test_exception_in_on_start_kills_the_group(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(HANG))
    seen: list[int] = []

    def on_start(pid: int, pgid: int, start: int | None) -> None:
        seen.append(pgid)
        raise RuntimeError("db is gone")

    with pytest.raises(RuntimeError, match="db is gone"):
        run_training([sys.executable, str(script)], cwd=tmp_path, env={}, log_path=tmp_path / "t.log",
                     deadline_seconds=10, on_start=on_start)
    assert seen and not process_group_alive(seen[0])


def test_no_grandchild_survives(tmp_path: Path):
    pid_file = tmp_path / "grandchild.pid"
    outcome = run_script(tmp_path, GRANDCHILD, extra_env={"GRANDCHILD_PID_FILE": str(pid_file)})
    assert outcome.status == "ok" and outcome.metric == 1.5
    grandchild = int(pid_file.read_text())
    assert not alive(grandchild)
    assert not process_group_alive(outcome.pgid)


def test_environment_is_an_allow_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("DB_PASSWORD", "hunter2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws")
    # A key under a name no deny-list would catch (llm-api-key-env = "MY_LLM_VAR").
    monkeypatch.setenv("MY_LLM_VAR", "sk-unlabelled")
    monkeypatch.setenv("NVIDIA_API_KEY", "nv-secret")  # an allowed family, a secret's name
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")  # prevents crashes on some CPUs: must pass
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    dump = tmp_path / "env.json"
    outcome = run_script(tmp_path, DUMP_ENV, extra_env={"AUTOLOOP_TIME_BUDGET": 2, "CUSTOM_FOR_THIS_RUN": "x",
                                                        "ENV_DUMP": str(dump)})
    assert outcome.status == "ok", outcome.reason
    child_env = json.loads(dump.read_text())
    for name in ("OPENAI_API_KEY", "HF_TOKEN", "DB_PASSWORD", "AWS_SECRET_ACCESS_KEY", "MY_LLM_VAR", "NVIDIA_API_KEY"):
        assert name not in child_env
    assert "sk-unlabelled" not in json.dumps(child_env)
    del child_env["ENV_DUMP"]
    assert (child_env["OPENBLAS_CORETYPE"], child_env["OMP_NUM_THREADS"], child_env["LC_ALL"]) == ("Haswell", "1", "C.UTF-8")
    assert child_env["PATH"] == os.environ["PATH"]
    # What the caller sets on purpose always passes.
    assert child_env["AUTOLOOP_TIME_BUDGET"] == "2" and child_env["AUTOLOOP_SEED"] == "1"
    assert child_env["CUSTOM_FOR_THIS_RUN"] == "x"
    assert child_env["PYTHONUNBUFFERED"] == "1"
    assert len(child_env[runner.TRIAL_MARKER]) == 24


DAEMON = """
import json, os, subprocess, sys
# A daemon in its own session: out of the trial's process group, so killing the group
# misses it; it sleeps with a unique argument the test looks for.
subprocess.Popen(["setsid", sys.executable, "-c", "import time; time.sleep(600)", os.environ["DAEMON_TAG"]],
                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
import time; time.sleep(0.5)  # setsid has forked and exec'd by now
with open(os.environ["AUTOLOOP_RESULT"], "w") as f:
    json.dump({"val_bpb": 1.5}, f)
"""


def processes_with_argument(tag: str) -> list[int]:
    """Live processes whose command line contains `tag`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if tag.encode() in cmdline and alive(int(entry)):
                found.append(int(entry))
    return found


def our_zombies() -> set[int]:
    return {int(e) for e in os.listdir("/proc") if e.isdigit() and (s := proc_stat(e)) and s[0] == "Z"
            and int(s[1]) == os.getpid()}


def test_a_setsid_daemon_does_not_outlive_the_trial(tmp_path: Path):
    tag = f"daemon-{os.getpid()}-{time.monotonic_ns()}"
    zombies = our_zombies()
    outcome = run_script(tmp_path, DAEMON, extra_env={"DAEMON_TAG": tag})
    assert outcome.status == "ok", outcome.error_tail
    assert processes_with_argument(tag) == []
    assert "left the group" in (tmp_path / "logs" / "trial.log").read_text()
    # The daemon became our child (we were its subreaper) and was reaped: no zombie is left.
    assert our_zombies() <= zombies
    # And we are a subreaper only while a trial runs.
    assert not reaper._subreaper_users


def test_a_setsid_daemon_is_killed_at_the_deadline_too(tmp_path: Path):
    tag = f"daemon-{os.getpid()}-{time.monotonic_ns()}"
    source = DAEMON.replace("with open", "time.sleep(60)\nwith open")
    outcome = run_script(tmp_path, source, deadline=2.0, extra_env={"DAEMON_TAG": tag})
    assert outcome.status == "timeout"
    assert processes_with_argument(tag) == []


def test_log_is_appended_and_only_this_run_is_judged(tmp_path: Path):
    run_script(tmp_path, FAIL_NAN)
    outcome = run_script(tmp_path, SUCCESS)
    assert outcome.status == "ok" and "FAIL" not in outcome.error_tail
    log = (tmp_path / "logs" / "trial.log").read_text()
    assert log.count("# autoloop ") == 4  # header and footer of each run


def test_kill_process_group_of_a_detached_group():
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while len([p for p in os.listdir("/proc") if p.isdigit() and _pgrp(p) == proc.pid]) < 2:
            assert time.monotonic() < deadline, "grandchild did not start"
            time.sleep(0.02)
        start = process_start_time(proc.pid)
        # A recorded start time that does not match means the pid was recycled: hands off.
        assert not kill_process_group(proc.pid, expected_pid=proc.pid, expected_start_time=start + 1, grace=0.5)
        assert process_group_alive(proc.pid)
        assert kill_process_group(proc.pid, expected_pid=proc.pid, expected_start_time=start, grace=0.5)
        assert not process_group_alive(proc.pid)
        # Nothing left: nothing to do.
        assert not kill_process_group(proc.pid, expected_pid=proc.pid, expected_start_time=start)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    with pytest.raises(ValueError):
        kill_process_group(os.getpgrp())


def _pgrp(pid: str) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError):
        return None


def test_parse_summary_block_uses_the_last_block():
    text = "---\nval_bpb: 2.0\nstep 5\n---\nval_bpb: 1.5\nnote: fine print\n# trailing\n"
    assert parse_summary_block(text) == {"val_bpb": 1.5, "note": "fine print"}
    assert parse_summary_block("no block here\n") is None


def test_gpu_busy_report_without_nvidia_smi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert runner.gpu_busy_report() == []


def test_missing_command_is_a_clear_error(tmp_path: Path):
    from autoloop.errors import AutoloopError

    with pytest.raises(AutoloopError, match="cannot start the training command"):
        run_training([str(tmp_path / "no-such-python")], cwd=tmp_path, env={}, log_path=tmp_path / "t.log",
                     deadline_seconds=5)


def test_a_process_that_is_not_a_training_script_gets_no_contract_verdict_in_its_log(tmp_path: Path):
    """The evaluator's log ended with "evaluation passed" and then "crash, exit 0: finished
    without a val_bpb metric" (issue 22): the train-script contract judged a process that
    is not a training script. With contract=False the closing line is its exit and time."""
    script = tmp_path / "evaluator.py"
    script.write_text("print('evaluation passed at stage done: ok (val_bpb 4.051032)')\n")
    log = tmp_path / "eval.log"
    runner.run_training([sys.executable, str(script)], cwd=tmp_path, env={}, log_path=log, deadline_seconds=60,
                        contract=False)
    lines = log.read_text().splitlines()
    assert lines[-2] == "evaluation passed at stage done: ok (val_bpb 4.051032)"
    assert re.fullmatch(r"# autoloop \S+: exit 0, \d+\.\d s", lines[-1]), lines[-1]
    # A training script is still judged by the contract.
    runner.run_training([sys.executable, str(script)], cwd=tmp_path, env={}, log_path=tmp_path / "train.log",
                        deadline_seconds=60)
    assert "crash, exit 0" in (tmp_path / "train.log").read_text().splitlines()[-1]
