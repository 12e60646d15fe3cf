"""The README's first command works for a new user: in a fresh clone and a fresh virtual
environment it ends with the baseline and three trials, none of them invalid (or
crashed, timed out, interrupted) for a reason the user did not cause.

The work is bench/readme_first_command.py's (it prints the same figures by hand); this
test runs it and asserts on what the db says. The command is parsed out of README.md's
first ```bash block, so the README and the test cannot drift. Nothing is downloaded:
the fresh environment reuses this interpreter's packages (torch ...) and pip runs with
--no-index and without build isolation (see the bench's docstring).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("readme_first_command", ROOT / "bench" / "readme_first_command.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_first_bash_block_is_the_install_and_a_short_run():
    bench = _bench()
    command = bench.readme_first_command((ROOT / "README.md").read_text())
    lines = [line for line in command.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(lines) == 1 and lines[0].startswith("pip install ")
    assert "autoloop run" in lines[0] and f"--max-trials {bench.EXPECTED_TRIALS}" in lines[0]


def test_problems_name_what_the_user_did_not_cause():
    bench = _bench()
    good = [{"number": 1, "kind": "baseline", "status": "keep", "metric": 1.9, "reason": None}] + [
        {"number": n, "kind": "proposal", "status": s, "metric": 2.0, "reason": None}
        for n, s in ((2, "discard"), (3, "keep"), (4, "discard"))]
    assert bench.problems(good) == []
    bad = good[:3] + [{"number": 4, "kind": "proposal", "status": "invalid", "metric": None, "reason": "x changed"}]
    assert bench.problems(bad) == ["trial 4 is invalid: x changed"]
    assert bench.problems(good[:2]) == ["2 trials, expected the baseline and 3 more"]


@pytest.mark.slow
def test_the_readme_first_command_in_a_fresh_clone_and_venv_beside_two_cpu_burners(tmp_path):
    if shutil.which("git") is None or shutil.which("bash") is None:
        pytest.skip("needs git and bash")
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                      capture_output=True, text=True).stdout.strip():
        # `git clone` takes what is committed; say so rather than test something else.
        print("note: uncommitted changes in the checkout are not in the clone")
    figures = _bench().run(ROOT, tmp_path, burners=2)
    statuses = [(t["number"], t["kind"], t["status"], t["reason"]) for t in figures["trials"]]
    assert figures["problems"] == [], (statuses, figures["output_tail"])
    assert figures["command_exit"] == 0
