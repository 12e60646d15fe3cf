"""A run that kept nothing: `ablate`, `finalize` and `best` say so in one line, with what to
try, and exit 0; `best` never suggests finalize then; `autoloop run` ends with the same line.

Real runs of the fake train script (instant; val_bpb a known function of its constants:
LR 0.5 is worse than the default 0.02, LR 0.01 better) through the real controller."""

from __future__ import annotations

import json
import subprocess

import pytest

from typer.testing import CliRunner

from autoloop.cli import app

runner = CliRunner()


def cli(repo, *args):
    return runner.invoke(app, [*args, "--repo", str(repo)], catch_exceptions=False)


def _branches(repo) -> str:
    return subprocess.run(["git", "branch"], cwd=repo, capture_output=True, text=True, check=True).stdout


def _run(repo, tag: str, lr: str) -> str:
    assert cli(repo, "seed", f"lr {lr}", "--set", f"LR={lr}").exit_code == 0
    result = cli(repo, "run", "--tag", tag, "--no-verify", "--proposers", "ideas", "--max-trials", "2",
                 "--time-budget", "5")
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.slow
def test_ablate_finalize_and_best_say_in_one_line_why_not_and_what_to_try(fake_repo, one_run_per_trial):
    """Before: ablate and finalize printed an error and exited 1 (the README's next steps
    failed right after its first command), and best ended with "`autoloop finalize` makes
    a clean branch of them" for a best that was the baseline."""
    output = _run(fake_repo, "flat", "0.5")
    last = output.strip().splitlines()[-1]
    assert last.startswith("run 'flat' kept no change over its baseline, so there is nothing to ablate or finalize: "
                           "1 change tried (1 discard), none adopted over the baseline; the closest was trial 2 "
                           "(`autoloop show 2`). Next: `autoloop run --tag flat --max-trials 10` resumes it"), output
    for command, what in (("ablate", "nothing to ablate"), ("finalize", "nothing to finalize (no branch was made)"),
                          ("best", "no gain to report and nothing to finalize")):
        result = cli(fake_repo, command, "--tag", "flat")
        assert result.exit_code == 0, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1, result.output
        assert lines[0].startswith(f"run 'flat' kept no change over its baseline, so there is {what}: 1 change "
                                   "tried (1 discard)"), result.output
        assert "`autoloop run --tag flat --max-trials 10`" in lines[0] and "`autoloop seed`" in lines[0]
        assert "`autoloop finalize`" not in lines[0]
        as_json = json.loads(cli(fake_repo, command, "--tag", "flat", "--json").output)
        assert as_json["nothing_kept"] == lines[0]
    assert "final/" not in _branches(fake_repo)  # finalize made no branch
    # `best --json` keeps its figures (the baseline is the best) beside the line.
    best = json.loads(cli(fake_repo, "best", "--tag", "flat", "--json").output)
    assert best["best_trial"] == 1 and best["kept"] == 0


@pytest.mark.slow
def test_a_run_that_kept_a_change_gets_no_such_line(fake_repo, one_run_per_trial):
    output = _run(fake_repo, "up", "0.01")
    assert "kept no change" not in output
    best = cli(fake_repo, "best", "--tag", "up", "--no-remeasure")
    assert best.exit_code == 0 and "kept no change" not in best.output and "`autoloop finalize`" in best.output
    finalize = cli(fake_repo, "finalize", "--tag", "up", "--no-remeasure")
    assert finalize.exit_code == 0 and finalize.output.startswith("branch final/up at "), finalize.output
