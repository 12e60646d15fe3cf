"""The CLI: thin over the library; the one expensive boundary (training) is patched."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import autoloop.measure.executors.serial as measure_mod
from autoloop.cli import app
from autoloop.base.status import RunOutcome

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
    assert env["AUTOLOOP_RESULT"].endswith(".autoloop/cli/trials/2/runs/1/out/result.json")
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


# ---------------------------------------------------------------------------- the first hour (issue 22)


def _files_left(repo: Path) -> list[str]:
    return sorted(p.name for p in repo.iterdir() if p.name in ("experiments.db", ".autoloop"))


@pytest.mark.parametrize("args, message", [
    (("--max-trials", "-1"), "error: --max-trials -1 must be at least 0"),
    (("--time-budget", "-5"), "error: --time-budget -5 must be more than 0"),
    (("--time-budget", "0"), "error: --time-budget 0 must be more than 0"),
    (("--baseline-seeds", "0"), "error: --baseline-seeds 0 must be at least 1"),
    (("--max-runs", "0"), "error: --max-runs 0 must be at least 1"),
    (("--workers", "-2"), "error: --workers -2 must be at least 0"),
    (("--keep-margin", "-1"), "error: --keep-margin -1 must be at least 0"),
    (("--hours", "0"), "error: --hours 0 must be more than 0"),
    (("--max-steps", "-3"), "error: --max-steps -3 must be at least 1"),
])
def test_a_bad_number_is_refused_before_the_run_starts(fake_repo, args, message):
    result = runner.invoke(app, ["run", "--repo", str(fake_repo), "--no-verify", *args])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [result.output.strip()]  # one line: no header, no traceback
    assert result.output.startswith(message) and "give e.g." in result.output
    assert _files_left(fake_repo) == []  # nothing ran, nothing was written


def test_a_bad_number_in_pyproject_or_the_environment_is_refused_too(fake_repo, monkeypatch):
    monkeypatch.setenv("AUTOLOOP_MAX_TRIALS", "-1")
    result = runner.invoke(app, ["run", "--repo", str(fake_repo)])
    assert result.exit_code == 1 and result.output.startswith("error: AUTOLOOP_MAX_TRIALS=-1 in the environment must be")
    monkeypatch.delenv("AUTOLOOP_MAX_TRIALS")
    (fake_repo / "pyproject.toml").write_text("[tool.autoloop]\ntime-budget = -5\n")
    result = runner.invoke(app, ["run", "--repo", str(fake_repo)])
    assert result.exit_code == 1 and "[tool.autoloop]: time-budget = -5 must be more than 0" in result.output
    assert _files_left(fake_repo) == []


def _crash_without_training(monkeypatch):
    monkeypatch.setattr(measure_mod, "run_training", lambda *a, **k: RunOutcome(
        status="crash", returncode=1, result=None, metric=None, metric_source=None, reason="boom",
        error_tail="boom", wall_seconds=0.1, pid=0, pgid=0))


def test_max_trials_0_on_a_new_tag_is_refused_and_makes_no_empty_default_run(fake_repo, monkeypatch):
    from autoloop.store import Store

    result = runner.invoke(app, ["run", "--repo", str(fake_repo), "--no-verify", "--tag", "new", "--max-trials", "0"])
    assert result.exit_code == 1 and result.output.strip().splitlines() == [result.output.strip()]
    assert "--max-trials 0 only recovers an existing run" in result.output and "no run 'new'" in result.output
    assert _files_left(fake_repo) == []  # no db, no run folder
    _crash_without_training(monkeypatch)
    assert invoke(fake_repo, "run", "--tag", "known", "--no-verify", "--no-check", "--max-trials", "1").exit_code == 0
    result = runner.invoke(app, ["run", "--repo", str(fake_repo), "--no-verify", "--tag", "new", "--max-trials", "0"])
    assert result.exit_code == 1 and "no run 'new'" in result.output
    with Store(fake_repo / "experiments.db") as store:
        assert [r["tag"] for r in store.runs()] == ["known"]  # the default run is still the one with trials
    # On an existing run it recovers and stops, as before.
    assert invoke(fake_repo, "run", "--tag", "known", "--no-verify", "--max-trials", "0").exit_code == 0


def test_best_and_report_of_a_run_that_stopped_before_its_baseline_say_one_line(fake_repo):
    from autoloop.store import RunStatus, Store

    with Store(fake_repo / "experiments.db") as store:
        store.create_run("empty", base_commit=None, best_commit=None, status=RunStatus.STOPPED)
    for command in ("best", "report"):
        result = runner.invoke(app, [command, "--repo", str(fake_repo)])
        assert result.exit_code == 1 and result.output.strip().splitlines() == [result.output.strip()], result.output
        assert "run 'empty' has no trials: it stopped before its baseline" in result.output
        assert "autoloop run --tag empty" in result.output and "Traceback" not in result.output


def test_run_in_a_repository_without_commits_leaves_nothing_behind(tmp_path):
    import subprocess

    repo = tmp_path / "fresh"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / "train.py").write_text("print('hi')\n")
    result = runner.invoke(app, ["run", "--repo", str(repo), "--no-verify", "--max-trials", "1"])
    assert result.exit_code == 1
    assert result.output.strip().startswith("error: ") and "has no commits yet" in result.output
    assert len(result.output.strip().splitlines()) == 1  # no header before the error
    assert _files_left(repo) == []


def test_a_failing_run_prints_no_header_before_its_error(fake_repo):
    result = runner.invoke(app, ["run", "--repo", str(fake_repo), "--train-command", "python missing.py"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [result.output.strip()] and "autoloop run '" not in result.output
    assert "set train-command in [tool.autoloop]" in result.output  # the README's hyphenated key


def test_help_keeps_the_install_extras_in_brackets():
    result = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    assert "pipinstall-e'.[ray]'" in result.output.replace("\n", " ").replace(" ", "")


def test_a_text_only_idea_says_it_waits_when_nothing_reads_text(fake_repo, monkeypatch):
    monkeypatch.delenv("AUTOLOOP_LLM_MODEL", raising=False)
    monkeypatch.delenv("AUTOLOOP_AGENT_COMMAND", raising=False)
    result = invoke(fake_repo, "seed", "try SwiGLU in the MLP")
    assert result.exit_code == 0
    lines = result.output.strip().splitlines()
    assert lines[0] == "seeded idea 1: try SwiGLU in the MLP"
    assert lines[1].startswith("idea 1 is text only: it waits until a proposer that reads text is configured")
    assert "--llm-model" in lines[1] and "--agent-command" in lines[1] and len(lines) == 2
    ideas = invoke(fake_repo, "ideas")
    assert "waiting: text only, and no proposer that reads text is configured" in ideas.output
    # An idea with an edit is read by the `ideas` proposer itself: no note, no wait.
    result = invoke(fake_repo, "seed", "lower lr", "--set", "LR=0.01")
    assert result.output.strip().splitlines() == ["seeded idea 2: lower lr"]
    ideas = invoke(fake_repo, "ideas").output.splitlines()
    assert sum("waiting:" in line for line in ideas) == 1
    # With an LLM configured the text idea will be read: neither says it waits.
    monkeypatch.setenv("AUTOLOOP_LLM_MODEL", "gpt-4.1")
    result = invoke(fake_repo, "seed", "try rotary embeddings")
    assert result.output.strip().splitlines() == ["seeded idea 3: try rotary embeddings"]
    assert "waiting:" not in invoke(fake_repo, "ideas").output


def test_progress_lines_say_the_seed_and_whose_code_runs(fake_repo):
    """`trial 1 [baseline] ...` printed three times told nothing apart: each run's line
    says its seed and role, and the incumbent re-measured for a candidate says so."""
    assert invoke(fake_repo, "seed", "better lr", "--set", "LR=0.012").exit_code == 0
    result = runner.invoke(app, ["run", "--repo", str(fake_repo), "--tag", "p", "--no-verify", "--proposers", "ideas",
                                 "--max-trials", "2", "--time-budget", "5", "--grace-seconds", "20"],
                           env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    starts = [line for line in result.output.splitlines() if re.match(r"trial \d+ \[", line)]
    assert starts[:3] == [f"trial 1 [baseline] baseline: the unmodified training script | baseline at seed {s}"
                          for s in (1337, 1338, 1339)]
    assert "trial 2 [proposal] better lr | candidate at seed 1337" in starts
    assert "trial 2 [proposal] better lr | the incumbent (trial 1) at seed 1337, to pair with it" in starts, result.output
    assert len(starts) == len(set(starts))  # no two runs print the same line


def test_a_misspelt_constant_gets_a_did_you_mean(tmp_path):
    from conftest import make_repo

    repo = make_repo(tmp_path / "real", (Path(__file__).resolve().parents[1] / "train.py").read_text())
    result = runner.invoke(app, ["seed", "x", "--repo", str(repo), "--set", "MATRIXLR=0.02"])
    assert result.exit_code == 1
    assert result.output.strip() == "error: --set MATRIXLR: train.py has no UPPER_CASE constant MATRIXLR: did you mean MATRIX_LR?"
    result = runner.invoke(app, ["seed", "x", "--repo", str(repo), "--set", "matrix_lr=0.02"])
    assert result.output.strip().endswith("did you mean MATRIX_LR?")
    result = runner.invoke(app, ["seed", "x", "--repo", str(repo), "--set", "ZZZZ=1"])
    assert "autoloop search-plan" in result.output and len(result.output.split(",")) < 12  # not all 33 constants


def test_check_plans_for_the_runs_own_budget(fake_repo, monkeypatch):
    """`autoloop check` stored its result "on run 'demo'" but planned for 300 s, not the
    run's 20 s. The expensive part (training) is faked; the test asserts what it was given."""
    import autoloop.check as check_mod
    from autoloop.store import Store

    seen = []

    def fake_run_check(repo, *, time_budget, max_steps, hours, parts, data_dir, say):
        seen.append({"time_budget": time_budget, "max_steps": max_steps, "hours": hours})
        return {"ok": True, "seconds": 1.0}

    monkeypatch.setattr(check_mod, "run_check", fake_run_check)
    with Store(fake_repo / "experiments.db") as store:
        store.create_run("demo", config={"time_budget": 20.0, "max_steps": None, "hours": 2.0})
    result = invoke(fake_repo, "check", "--parts", "budget")
    assert result.exit_code == 0, result.output
    assert seen[-1] == {"time_budget": 20.0, "max_steps": None, "hours": 2.0}
    assert "planning for run 'demo': 20 s per trial" in result.output and "on run 'demo'" in result.output
    invoke(fake_repo, "check", "--parts", "budget", "--time-budget", "60")
    assert seen[-1]["time_budget"] == 60.0


def test_version_is_the_packages_and_pyprojects():
    import re

    from autoloop import __version__

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"autoloop {__version__}"
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, flags=re.M).group(1) == __version__
