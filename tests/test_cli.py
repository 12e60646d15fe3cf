"""The CLI: thin over the library; the one expensive boundary (training) is patched."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import autoloop.measure.executors.serial as measure_mod
from autoloop.cli import app
from autoloop.measure.runner import RunOutcome

README = Path(__file__).resolve().parents[1] / "README.md"
runner = CliRunner()


def invoke(repo, *args):
    return runner.invoke(app, [*args[:1], "--repo", str(repo), *args[1:]] if args else [], catch_exceptions=False)


def command_names():
    import typer.main

    return sorted(typer.main.get_command(app).commands)


def test_every_command_has_help_and_is_in_the_readme():
    readme = README.read_text()
    for name in command_names():
        result = runner.invoke(app, [name, "--help"])
        assert result.exit_code == 0, name
        assert re.search(rf"autoloop {name}\b", readme), f"`autoloop {name}` is not documented in README.md"


def test_run_passes_the_contract_to_training_and_records_it(fake_repo, monkeypatch):
    calls = []

    def fake_run_training(command, *, cwd, env, log_path, deadline_seconds, on_start=None, should_abort=None, **_):
        calls.append({"command": command, "cwd": cwd, "env": env, "deadline": deadline_seconds})
        if on_start:
            on_start(0, 0, None)  # nothing to kill: pid/pgid 0 are never signalled
        result = {"val_bpb": 1.5 - 0.1 * len(calls), "training_seconds": 1.0, "num_steps": 3}
        Path(env["AUTOLOOP_RESULT"]).write_text(json.dumps(result))
        return RunOutcome(status="ok", returncode=0, result=result, metric=result["val_bpb"], metric_source="harness",
                          reason=None, error_tail="", wall_seconds=1.0, pid=0, pgid=0)

    monkeypatch.setattr(measure_mod, "run_training", fake_run_training)
    assert invoke(fake_repo, "seed", "lower lr", "--set", "LR=0.01").exit_code == 0
    result = invoke(fake_repo, "run", "--tag", "cli", "--time-budget", "7", "--max-steps", "3", "--seed", "5",
                    "--no-verify", "--proposers", "ideas", "--decision-rule", "strict")
    assert result.exit_code == 0, result.output
    assert len(calls) == 2
    call = calls[1]
    assert call["command"][1:] == ["train.py"] and Path(call["cwd"]) == fake_repo.resolve()
    env = call["env"]
    assert env["AUTOLOOP_TIME_BUDGET"] == "7.0" and env["AUTOLOOP_MAX_STEPS"] == "3" and env["AUTOLOOP_SEED"] == "5"
    assert env["AUTOLOOP_RESULT"].endswith(".autoloop/cli/trials/2/runs/1/result.json")
    assert call["deadline"] == pytest.approx(7 + 180)
    log = invoke(fake_repo, "log", "--json")
    rows = json.loads(log.output)
    assert [(r["number"], r["status"]) for r in rows] == [(1, "keep"), (2, "keep")]
    status = invoke(fake_repo, "status")
    assert "best: val_bpb 1.300000 (trial 2" in status.output and "nothing running" in status.output
    ideas = invoke(fake_repo, "ideas")
    assert "done" in ideas.output and "LR=0.01" in ideas.output


@pytest.mark.parametrize(
    "args, message",
    [
        (("seed", "x", "--set", "NOPE=1"), "has no UPPER_CASE constant NOPE"),
        (("log",), "no trial database"),
        (("stop",), "no trial database"),
        (("run", "--max-trials", "1", "--train-command", "python missing.py"), "missing.py does not exist"),
    ],
)
def test_user_errors_are_one_line_without_traceback(fake_repo, args, message):
    result = runner.invoke(app, [args[0], "--repo", str(fake_repo), *args[1:]])
    assert result.exit_code == 1
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert lines[-1].startswith("error: ") and message in lines[-1]
    assert "Traceback" not in result.output


def test_unknown_tag_lists_known_runs(fake_repo, monkeypatch):
    monkeypatch.setattr(measure_mod, "run_training", lambda *a, **k: RunOutcome(
        status="crash", returncode=1, result=None, metric=None, metric_source=None, reason="boom",
        error_tail="boom", wall_seconds=0.1, pid=0, pgid=0))
    invoke(fake_repo, "run", "--tag", "known", "--no-verify", "--proposers", "ideas")
    result = runner.invoke(app, ["log", "--repo", str(fake_repo), "--tag", "other"])
    assert result.exit_code == 1 and "no run tagged 'other'" in result.output and "runs: known" in result.output
