"""`autoloop run --notify CMD`: the user's command gets each event as JSON on stdin, in the
background, with a bounded time; a failing, slow or flooded command never stops or slows
the loop, and its failure is logged once. Real commands, a real Controller over the fake
training script."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import FAKE_TRAIN, make_repo

from autoloop.loop.notify import Notifier
from autoloop.store import Store

from test_controller import run_loop, seed


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(predicate, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not predicate():
        time.sleep(0.02)
    assert predicate()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_each_event_arrives_as_json_on_stdin_and_in_the_environment(tmp_path):
    out, env_out = tmp_path / "events.jsonl", tmp_path / "env.txt"
    # Shell metacharacters in a description (an LLM wrote it) must stay data.
    nasty = f"; touch {tmp_path}/PWNED1; `touch {tmp_path}/PWNED2` $(touch {tmp_path}/PWNED3)"
    notifier = Notifier(f'cat >> {out}; printf "%s|%s\\n" "$AUTOLOOP_EVENT" "$AUTOLOOP_MESSAGE" >> {env_out}',
                        timeout=10, tag="nov29")
    base = {"kind": "proposal", "status": "keep", "metric": 1.5, "delta": -0.01, "description": "lr 0.03",
            "trial_commit": "abc", "best_before": 1.51}
    notifier.trial_finished({**base, "number": 2, "decision": {"action": "keep", "confirmed": True}})
    notifier.trial_finished({**base, "number": 3, "decision": {"action": "keep"}, "description": nasty})
    notifier.trial_finished({**base, "number": 1, "kind": "baseline"})  # the start, not news
    notifier.trial_finished({**base, "number": 4, "status": "discard"})
    notifier.event("drift", "a small shift")  # logged, not notified
    notifier.event("paused", "the disk is full")
    notifier.worker_lost("gpu1", {"number": 5}, "worker gpu1 lost: its process was killed")
    notifier.run_ended(SimpleNamespace(paused=False, stop_reason="reached --max-trials 5", trials_run=5, kept=2,
                                       best_metric=1.5, baseline_metric=1.6, best_commit="abc", statuses={"keep": 2}))
    assert notifier.close() is None
    events = _lines(out)
    assert [e["event"] for e in events] == ["confirmed", "keep", "paused", "worker_lost", "end"]
    assert all(e["run"] == "nov29" and e["text"] == e["message"] for e in events)
    assert events[0]["trial"] == 2 and events[0]["metric"] == 1.5 and events[0]["delta"] == -0.01
    assert events[1]["description"] == nasty
    assert events[2]["reason"] == "the disk is full" and events[3]["worker"] == "gpu1"
    assert events[4]["reason"] == "reached --max-trials 5" and events[4]["best_metric"] == 1.5
    assert "baseline 1.6000 -> best 1.5000" in events[4]["message"]
    lines = env_out.read_text().splitlines()
    assert lines[0].startswith("confirmed|autoloop nov29: trial 2 kept, gain confirmed: lr 0.03")
    assert not any((tmp_path / f"PWNED{i}").exists() for i in (1, 2, 3))
    assert notifier.sent == 5 and notifier.failures == 0


def test_a_slow_command_is_killed_at_its_timeout_and_never_slows_the_caller(tmp_path):
    pids = tmp_path / "pids"
    failures = []
    notifier = Notifier(f"echo $$ >> {pids}; exec sleep 60", timeout=0.5, on_failure=failures.append)
    start = time.monotonic()
    for i in range(5):
        notifier.emit("keep", f"event {i}")
    assert time.monotonic() - start < 0.2  # the loop only enqueues
    _wait(lambda: notifier.failures >= 2, 10)
    said = notifier.close(drain_seconds=3)
    assert len(failures) == 1 and "still running after 0.5 s (notify_timeout), killed" in failures[0]
    assert "the run goes on" in failures[0]
    assert said is not None and "notifications failed" in said
    for pid in map(int, pids.read_text().split()):
        assert not _alive(pid), pid


def test_a_failing_command_is_logged_once_and_counted(tmp_path):
    failures = []
    notifier = Notifier("echo 'webhook said 500' >&2; exit 3", timeout=5, on_failure=failures.append)
    for i in range(3):
        notifier.emit("keep", f"event {i}")
    _wait(lambda: notifier.failures == 3, 10)
    assert failures == ["notify command failed on a 'keep' event (exit status 3: webhook said 500); the run goes on, "
                        "and later failures are only counted"]
    assert notifier.close() == "notify: 3 notifications failed"
    missing = Notifier("/no/such/notifier", timeout=5, on_failure=failures.append)
    missing.emit("end", "x")
    _wait(lambda: missing.failures == 1, 10)
    assert "exit status 127" in failures[-1]
    missing.close()


def test_a_flood_is_dropped_not_queued_without_end(tmp_path):
    notifier = Notifier("exec sleep 60", timeout=30)
    start = time.monotonic()
    for i in range(300):
        notifier.emit("keep", f"event {i}")
    assert time.monotonic() - start < 0.5
    assert notifier.dropped >= 300 - 101
    start = time.monotonic()
    said = notifier.close(drain_seconds=1)
    assert time.monotonic() - start < 4  # bounded, and the command in flight is killed
    assert "dropped" in said


def test_no_command_does_nothing():
    notifier = Notifier(None)
    notifier.emit("keep", "x")
    notifier.trial_finished({"status": "keep", "kind": "proposal", "number": 2})
    assert notifier.close() is None and notifier._thread is None


@pytest.mark.usefixtures("one_run_per_trial")
def test_a_run_notifies_its_keeps_and_its_end_and_keeps_no_secret(fake_repo, tmp_path):
    events = tmp_path / "events.jsonl"
    seed(fake_repo, "lower lr", "LR=0.01")
    seed(fake_repo, "wider", "WIDTH=128")
    summary = run_loop(fake_repo, notify=f'cat >> {events}  # "$WEBHOOK_SECRET" stays a name', max_trials=3)
    assert summary.trials_run == 3
    got = _lines(events)
    assert [(e["event"], e.get("trial")) for e in got] == [("keep", 2), ("end", None)]
    assert got[0]["description"] == "lower lr" and got[1]["reason"] == "reached --max-trials 3"
    with Store(fake_repo / "experiments.db") as store:
        run = store.get_run("t")
        assert run["config"]["notify"] is None  # the command may hold a webhook's secret
        assert store.events(run["id"], kind="notify_failed") == []


@pytest.mark.usefixtures("one_run_per_trial")
def test_a_failing_notify_command_changes_nothing_in_the_run(tmp_path):
    results = {}
    for name, command in (("quiet", None), ("failing", "exit 1")):
        repo = make_repo(tmp_path / name, FAKE_TRAIN.read_text())
        seed(repo, "lower lr", "LR=0.01")
        seed(repo, "wider", "WIDTH=128")
        summary = run_loop(repo, notify=command, max_trials=3)
        with Store(repo / "experiments.db") as store:
            run = store.get_run("t")
            results[name] = ([(t["number"], t["status"], t["metric"]) for t in store.trials(run["id"])],
                             [e["message"] for e in store.events(run["id"], kind="notify_failed")])
        assert summary.trials_run == 3
    assert results["failing"][0] == results["quiet"][0]
    assert len(results["failing"][1]) == 1 and "exit status 1" in results["failing"][1][0]
    assert results["quiet"][1] == []


@pytest.mark.slow
@pytest.mark.usefixtures("one_run_per_trial")
def test_lost_workers_and_the_pause_are_notified(tmp_path):
    from test_parallel import fake_source

    events = tmp_path / "events.jsonl"
    repo = make_repo(tmp_path / "repo", fake_source(MODE="kill_worker"))
    summary = run_loop(repo, executor="local", workers=2, max_trials=10, notify=f"cat >> {events}")
    assert summary.paused
    got = _lines(events)
    kinds = [e["event"] for e in got]
    assert kinds.count("worker_lost") == 3 and kinds[-1] == "paused" and "end" not in kinds
    lost = [e for e in got if e["event"] == "worker_lost"]
    assert {e["worker"] for e in lost} <= {"w0", "w1"} and all("lost" in e["reason"] for e in lost)
    assert "3 trials in a row lost their worker" in got[-1]["reason"]
