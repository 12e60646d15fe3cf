"""The `agent` proposer end to end: a fake coding-agent command (a real subprocess that
edits, commits, branches and tries to push in its clone) drives the real controller
over the fake training script; the real repository's refs are only ever moved by the
controller."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autoloop.config import resolve
from autoloop.loop.controller import Controller
from autoloop.errors import AutoloopError
from autoloop.proposers.seeding import seed_idea
from autoloop.store import Store
from conftest import FAKE_TRAIN, make_repo


# The loop's mechanics (git, db, processes, recovery), one training run per trial.
pytestmark = pytest.mark.usefixtures("one_run_per_trial")


FAKE_AGENT = Path(__file__).resolve().parent / "fakes" / "fake_agent.py"
AGENT = f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE_AGENT))}"
PROGRAM = "# program.md (test)\nLower val_bpb. Edit train.py only.\n"


@pytest.fixture
def repo(tmp_path) -> Path:
    return make_repo(tmp_path / "repo", FAKE_TRAIN.read_text(), {"program.md": PROGRAM})


def run_agent(repo: Path, **flags):
    flags = {"tag": "t", "time_budget": 5, "grace_seconds": 20, "verify": False, "proposers": "agent",
             "agent_command": AGENT, **flags}
    return Controller(resolve(repo, flags), repo).run()


def rows(repo: Path) -> list[dict]:
    with Store(repo / "experiments.db") as store:
        return store.trials(store.get_run("t")["id"])


def git(repo: Path, *args: str, check: bool = True) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=check, capture_output=True, text=True).stdout.strip()


def refs(repo: Path) -> dict[str, str]:
    lines = git(repo, "for-each-ref", "--format=%(refname) %(objectname)").splitlines()
    return dict(line.split() for line in lines)


def test_the_agents_diff_is_the_proposal_and_the_real_refs_are_untouched(repo, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_AGENT_MODE", "edit")
    monkeypatch.setenv("FAKE_AGENT_OUT", str(tmp_path / "prompt.txt"))
    before = refs(repo)
    summary = run_agent(repo, max_trials=2, agent_command=f"{AGENT} @{{prompt_file}}")
    assert summary.stop_reason == "reached --max-trials 2"
    trial = rows(repo)[1]
    assert (trial["proposer"], trial["model"], trial["status"]) == ("agent", "agent:" + Path(sys.executable).name, "keep")
    assert trial["description"] == "lower the learning rate (agent)"
    assert trial["metric"] == pytest.approx(1.0)
    # What it committed in its clone and what it left uncommitted are both in the trial.
    assert "-LR = 0.02" in trial["diff"] and "+WIDTH = 64  # kept by the agent;" in trial["diff"]
    assert "__pycache__" not in trial["diff"]
    # The real repo: only the controller's own refs changed; the agent's commit, branch
    # and tag exist nowhere but in its deleted clone.
    after = refs(repo)
    ours = {r for r in after if r == "refs/heads/autoloop/t" or r.startswith("refs/autoloop/t/")}
    assert {r: s for r, s in after.items() if r not in ours} == before
    assert not any("agent" in r for r in after)
    transcript = next((repo / ".autoloop" / "t" / "transcripts").glob("*-agent.log")).read_text()
    agent_commit = next(line.split()[1] for line in transcript.splitlines() if line.startswith("COMMIT "))
    assert subprocess.run(["git", "cat-file", "-e", agent_commit], cwd=repo).returncode != 0
    assert "push: 128" in transcript  # no remote to push to
    assert not (repo / "__pycache__").exists() and git(repo, "status", "--porcelain") == ""
    # The prompt was rendered from the same context as the LLM's, program.md first.
    prompt = (tmp_path / "prompt.txt").read_text()
    assert prompt.startswith(PROGRAM.rstrip()) and "| 1 | baseline | running |" in prompt
    assert "DESCRIPTION:" in prompt and "Do NOT run training" in prompt
    with Store(repo / "experiments.db") as store:
        (record,) = list(store.db.query("SELECT * FROM proposals"))
        assert record["trial_id"] == trial["id"] and record["latency_seconds"] > 0 and record["cost_usd"] is None
        assert any(e["trial_id"] == trial["id"] for e in store.events(kind="transcript"))


def test_an_agent_edit_to_a_protected_file_is_invalid_and_nothing_is_committed(repo, monkeypatch):
    monkeypatch.setenv("FAKE_AGENT_MODE", "protected")
    base = git(repo, "rev-parse", "HEAD")
    run_agent(repo, max_trials=2)
    trial = rows(repo)[1]
    assert trial["status"] == "invalid" and "edits protected file program.md" in trial["reason"]
    assert trial["trial_commit"] is None and git(repo, "rev-parse", "autoloop/t") == base
    assert (repo / "program.md").read_text() == PROGRAM


def test_a_missing_agent_command_is_a_clear_error_before_anything_runs(repo):
    with pytest.raises(AutoloopError, match="'no-such-agent' was not found on PATH"):
        run_agent(repo, agent_command="no-such-agent -p")
    assert not (repo / "experiments.db").exists()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_an_agent_that_hangs_is_killed_with_its_children_and_the_chain_falls_back(repo, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_AGENT_MODE", "sleep")
    monkeypatch.setenv("FAKE_AGENT_OUT", str(tmp_path / "prompt.txt"))
    seed_idea(resolve(repo, {}), repo, "wider", sets=["WIDTH=128"], patch=None)
    started = time.monotonic()
    summary = run_agent(repo, max_trials=2, proposers="agent,ideas", agent_timeout=1.5)
    assert time.monotonic() - started < 60
    assert summary.stop_reason == "reached --max-trials 2" and rows(repo)[1]["proposer"] == "human"
    child = int((tmp_path / "prompt.txt.pid").read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)
    with Store(repo / "experiments.db") as store:
        (record,) = list(store.db.query("SELECT * FROM proposals"))
        assert record["error"] == "agent timed out after 1.5 s" and record["trial_id"] is None
        assert "timed out" in store.events(kind="proposer_unavailable")[0]["message"]


def test_an_agent_that_fails_or_changes_nothing_lets_the_chain_fall_back(repo, monkeypatch):
    seed_idea(resolve(repo, {}), repo, "wider", sets=["WIDTH=128"], patch=None)
    seed_idea(resolve(repo, {}), repo, "narrower", sets=["WIDTH=32"], patch=None)
    monkeypatch.setenv("FAKE_AGENT_MODE", "fail")
    run_agent(repo, max_trials=2, proposers="agent,ideas")
    monkeypatch.setenv("FAKE_AGENT_MODE", "nothing")
    run_agent(repo, max_trials=1, proposers="agent,ideas")
    assert [t["proposer"] for t in rows(repo)[1:]] == ["human", "human"]
    with Store(repo / "experiments.db") as store:
        errors = [r["error"] for r in store.db.query("SELECT error FROM proposals ORDER BY id")]
    assert errors[0].startswith("agent exited with status 3: error: the model is overloaded")
    assert "the agent changed nothing" in errors


def test_an_agent_that_fails_is_an_outage_until_it_answers_again(repo, monkeypatch):
    """An agent that exits non-zero is an outage where the user looks (status, report, page
    read the same events) until its next answer, which ends it (`proposer_back`); an agent
    that answers without an edit is no outage."""
    from autoloop.review.queries import outage_info

    seed_idea(resolve(repo, {}), repo, "wider", sets=["WIDTH=128"], patch=None)
    monkeypatch.setenv("FAKE_AGENT_MODE", "fail")
    run_agent(repo, max_trials=2, proposers="agent,ideas")
    with Store(repo / "experiments.db") as store:
        (outage,) = outage_info(store, store.get_run("t"))
    assert outage["proposer"] == "agent" and outage["until"] is None and "status 3" in outage["error"]
    assert outage["line"].startswith("agent unavailable since ")
    monkeypatch.setenv("FAKE_AGENT_MODE", "nothing")
    run_agent(repo, max_trials=1, proposers="agent,ideas")
    monkeypatch.setenv("FAKE_AGENT_MODE", "edit")
    run_agent(repo, max_trials=1)
    with Store(repo / "experiments.db") as store:
        (outage,) = outage_info(store, store.get_run("t"))
        unavailable = store.events(kind="proposer_unavailable")
    assert outage["until"] is not None and outage["failures"] == 1  # ended by the answer; "nothing" was no failure
    assert len(unavailable) == 1


def test_an_agent_crash_gets_one_repair_started_from_the_crashed_commit(repo, monkeypatch):
    monkeypatch.setenv("FAKE_AGENT_MODE", "crash")
    run_agent(repo, max_trials=3)
    crashed, repaired = rows(repo)[1:]
    assert crashed["status"] == "crash"
    assert (repaired["kind"], repaired["derived_from"], repaired["status"]) == ("repair", crashed["id"], "keep")
    assert repaired["description"] == f"repair of trial {crashed['number']}: restore the mode"
    assert repaired["metric"] == pytest.approx(1.0)  # LR from the crashed change survived


def test_an_agent_outliving_a_killed_controller_is_ended_and_its_clone_deleted_at_restart(repo, tmp_path):
    import os
    import signal

    from autoloop.base.processes import process_group_alive

    env = {**os.environ, "FAKE_AGENT_MODE": "sleep", "FAKE_AGENT_OUT": str(tmp_path / "prompt.txt")}
    argv = ["autoloop", "run", "--tag", "t", "--time-budget", "5", "--no-verify", "--proposers", "agent",
            "--agent-command", AGENT]
    proc = subprocess.Popen(argv, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        live = []
        while time.monotonic() < deadline and not (live and (tmp_path / "prompt.txt.pid").exists()):
            time.sleep(0.2)
            if (repo / "experiments.db").exists():
                with Store(repo / "experiments.db") as store:
                    live = [p for p in store.live_processes() if p["pid"]]
        assert live, "the agent was never recorded"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    (agent,) = live
    child = int((tmp_path / "prompt.txt.pid").read_text())
    clone = Path(agent["path"])
    assert agent["what"] == "agent" and agent["pgid"] == agent["pid"] and agent["pid_start_time"]
    assert process_group_alive(agent["pgid"]) and _alive(child), "the agent outlives its controller"
    assert (clone / "work" / "train.py").exists()

    restarted = subprocess.run([*argv, "--max-trials", "0"], cwd=repo, env=env, capture_output=True, text=True,
                               timeout=120)
    assert restarted.returncode == 0, restarted.stderr
    assert not process_group_alive(agent["pgid"]) and not _alive(child)
    assert not clone.exists()
    with Store(repo / "experiments.db") as store:
        assert store.live_processes() == []
        assert any("agent" in e["message"] for e in store.events(kind="recovered"))


def test_an_agent_works_in_the_project_folder_of_its_clone(tmp_path, monkeypatch):
    fake = FAKE_TRAIN.read_text()
    top = make_repo(tmp_path / "big", fake.replace("LR = 0.02", "LR = 0.5"), {"sub/train.py": fake, "sub/program.md": PROGRAM})
    sub = top / "sub"
    monkeypatch.setenv("FAKE_AGENT_MODE", "edit")
    run_agent(sub, max_trials=2)
    trial = rows(sub)[1]
    assert trial["status"] == "keep" and trial["metric"] == pytest.approx(1.0), trial["reason"]
    assert git(top, "diff", "--name-only", trial["parent_commit"], trial["trial_commit"]) == "sub/train.py"
    assert "LR = 0.5" in (top / "train.py").read_text()
