"""Issue 12's table of attacks, one patch to the real train.py each, through the real loop.

Every attack must end `invalid` with a reason that names it, or fail inside the sandbox,
and nothing outside the trial's folder may change. One run per mode holds a baseline and
several attack trials (seeded as patches), so the baseline is paid once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autoloop.config import resolve
from autoloop.loop.controller import Controller
from autoloop.measure.sandbox import detect
from autoloop.proposers.seeding import seed_idea
from autoloop.store import Store
from tests.conftest import make_repo

TRAIN_PY = Path(__file__).resolve().parents[1] / "train.py"
SECRET = "s3cr3t-value-that-must-not-leak"

needs_bwrap = pytest.mark.skipif(
    detect("auto").kind != "bwrap", reason=f"bubblewrap cannot run here ({detect('auto').describe()}); .ci/run installs it"
)


def _patched(old: str, new: str, source: str | None = None) -> str:
    source = source if source is not None else TRAIN_PY.read_text()
    assert old in source, f"train.py no longer has {old!r}: update the attack"
    return source.replace(old, new, 1)


IMPORT_ANCHOR = "from autoloop import harness as H\n"
LOOP_ANCHOR = "        clock.step_finished(dt)\n"

ATTACKS = {
    # Train on the val split through the harness loader.
    "val split": _patched('loader = H.TokenLoader(ds, "train",', 'loader = H.TokenLoader(ds, "val",'),
    # Memorise val: read its tokens straight from the prepared dataset's files.
    "val file": _patched(IMPORT_ANCHOR, IMPORT_ANCHOR + (
        "import glob as _g\n"
        "_VAL = [open(p, 'rb').read(4096) for p in _g.glob(str(H.default_data_dir() / '*val*'))]\n"
        "assert _VAL, 'no val file visible'\n")),
    # Plant bytecode for the harness's metric module, beside its source.
    "poisoned pyc": _patched(IMPORT_ANCHOR, IMPORT_ANCHOR + (
        "import importlib.util as _iu, os as _os, autoloop.harness.metric as _m\n"
        "try:\n"
        "    _pyc = _iu.cache_from_source(_m.__file__)\n"
        "    _os.makedirs(_os.path.dirname(_pyc), exist_ok=True)\n"
        "    open(_pyc, 'wb').write(b'poisoned')\n"
        "except OSError as _e:\n"
        "    print('pyc attack failed:', _e)\n")),
    # Rewrite the trial log from inside training.
    "db write": _patched(IMPORT_ANCHOR, IMPORT_ANCHOR + (
        "import sqlite3 as _sq\n"
        "try:\n"
        "    _c = _sq.connect('experiments.db'); _c.execute('UPDATE trials SET metric = 99'); _c.commit()\n"
        "except Exception as _e:\n"
        "    print('db attack failed:', _e)\n")),
    # Replace the harness's evaluation when train.py is imported (the evaluator imports it).
    "replace evaluate_bpb": _patched(IMPORT_ANCHOR, IMPORT_ANCHOR + (
        "import autoloop.harness.metric as _metric\n"
        "H.evaluate_bpb = _metric.evaluate_bpb = lambda *a, **k: 1.2345\n")),
    # Step mode: nine extra optimizer steps for every step the clock is told about.
    "extra steps": _patched(LOOP_ANCHOR, LOOP_ANCHOR + (
        "        for _extra in range(9):\n"
        "            train_step()\n")),
    # A daemon that outlives the trial and edits train.py later.
    "daemon": _patched(IMPORT_ANCHOR, IMPORT_ANCHOR + (
        "import subprocess as _sp, sys as _sys\n"
        "_sp.Popen([_sys.executable, '-c', 'import time; time.sleep(4); open(\"train.py\", \"a\").write(\"# pwned\\\\n\")'],"
        " start_new_session=True)\n")),
    # Print every environment variable (the configured key is not named *KEY/TOKEN).
    "environment": _patched(IMPORT_ANCHOR, IMPORT_ANCHOR + (
        "import os as _os\n"
        "print('ENV', dict(_os.environ))\n"
        "if 'AUTOLOOP_RESULT' in _os.environ:  # training, not the evaluator's import\n"
        "    open(_os.environ['AUTOLOOP_RESULT'] + '.env', 'w').write(repr(dict(_os.environ)))\n")),
}

HALF_CLOCK = _patched(LOOP_ANCHOR, "        clock.step_finished(dt / 2)\n")


def _seed_attacks(repo: Path, config, names: list[str], sources: dict[str, str]) -> None:
    original = (repo / "train.py").read_text()
    patches = repo.parent / "patches"
    patches.mkdir(exist_ok=True)
    for name in names:
        (repo / "train.py").write_text(sources[name])
        diff = subprocess.run(["git", "diff"], cwd=repo, capture_output=True, check=True).stdout
        (repo / "train.py").write_text(original)
        path = patches / (name.replace(" ", "_") + ".diff")
        path.write_bytes(diff)
        seed_idea(config, repo, f"attack: {name}", sets=[], patch=path)


def _run(repo: Path, monkeypatch, **flags):
    monkeypatch.setenv("MY_SECRET_VAR", SECRET)
    flags = {"tag": "a", "proposers": "ideas", "decision_rule": "strict", "baseline_seeds": 1, "drift_every": 0,
             "grace_seconds": 240, "llm_api_key_env": "MY_SECRET_VAR", **flags}
    config = resolve(repo, flags)
    return config


def _trials(repo: Path, tag: str = "a") -> dict[str, dict]:
    store = Store(repo / "experiments.db")
    try:
        return {"baseline" if t["kind"] == "baseline" else (t.get("description") or "").replace("attack: ", ""): t
                for t in store.trials(store.get_run(tag)["id"])}
    finally:
        store.close()


def _files_outside_trials(repo: Path) -> dict[str, bytes]:
    return {str(p.relative_to(repo)): p.read_bytes() for p in repo.rglob("*")
            if p.is_file() and ".git" not in p.parts and ".autoloop" not in p.parts
            and not p.name.startswith("experiments.db")}


@pytest.mark.slow
@needs_bwrap
def test_attacks_in_step_mode_end_invalid_or_fail_inside_the_sandbox(tmp_path, monkeypatch):
    from autoloop.harness import metric

    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text())
    config = _run(repo, monkeypatch, max_steps=6, max_trials=1 + len(ATTACKS))
    _seed_attacks(repo, config, list(ATTACKS), ATTACKS)
    before = _files_outside_trials(repo)
    pyc = Path(__import__("importlib.util").util.cache_from_source(metric.__file__))
    pyc_before = pyc.read_bytes() if pyc.exists() else None
    summary = Controller(config, repo).run()
    trials = _trials(repo)
    baseline = trials["baseline"]
    assert baseline["status"] == "keep", baseline["reason"]
    assert summary.trials_run == 1 + len(ATTACKS), summary.stop_reason

    def invalid(name: str, *words: str) -> None:
        trial = trials[name]
        assert trial["status"] == "invalid", (name, trial["status"], trial["reason"])
        for word in words:
            assert word in trial["reason"], (name, trial["reason"])

    invalid("val split", "val split")
    assert trials["val file"]["status"] == "crash" and "no val file visible" in (trials["val file"]["error_tail"] or "")
    invalid("replace evaluate_bpb", "evaluate_bpb")
    invalid("extra steps", "steps")
    # Failed inside the sandbox: the repository, the installed harness and the db are read-only or invisible.
    assert (pyc.read_bytes() if pyc.exists() else None) == pyc_before
    assert baseline["metric"] is not None and baseline["metric"] < 99
    assert "pyc attack failed" in _log(repo, trials["poisoned pyc"]) or trials["poisoned pyc"]["status"] == "crash"
    assert "db attack failed" in _log(repo, trials["db write"]) or trials["db write"]["status"] == "crash"
    time.sleep(6)  # the daemon would have written by now
    assert "pwned" not in (repo / "train.py").read_text()
    assert not subprocess.run(["pgrep", "-f", "pwned"], capture_output=True).stdout
    leaked = [p for p in (repo / ".autoloop").rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert not leaked and "ENV" in _log(repo, trials["environment"])
    # Nothing outside the trials' folders changed, and git is clean.
    assert _files_outside_trials(repo) == before
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                            capture_output=True, text=True).stdout
    assert status == ""


@pytest.mark.slow
def test_attacks_without_a_sandbox_are_caught_by_the_checks(tmp_path, monkeypatch):
    from autoloop.harness import metric

    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text())
    names = ["poisoned pyc", "db write", "replace evaluate_bpb", "val split", "environment"]
    config = _run(repo, monkeypatch, max_steps=6, max_trials=1 + len(names), sandbox="off")
    _seed_attacks(repo, config, names, ATTACKS)
    pyc = Path(__import__("importlib.util").util.cache_from_source(metric.__file__))
    pyc_before = pyc.read_bytes() if pyc.exists() else None
    try:
        Controller(config, repo).run()
        trials = _trials(repo)
        baseline = trials["baseline"]
        assert baseline["status"] == "keep", baseline["reason"]
        for name, words in (("poisoned pyc", ["bytecode"]), ("db write", ["experiments.db"]),
                            ("replace evaluate_bpb", ["evaluate_bpb"]), ("val split", ["val split"])):
            trial = trials[name]
            assert trial["status"] == "invalid", (name, trial["reason"])
            assert all(w in trial["reason"] for w in words), (name, trial["reason"])
        store = Store(repo / "experiments.db")
        try:
            restored = store.trials(store.get_run("a")["id"])[0]
        finally:
            store.close()
        assert restored["metric"] == baseline["metric"] < 99  # the sealed values were put back
        leaked = [p for p in (repo / ".autoloop").rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
        assert not leaked
    finally:
        # The planted file lives in the installed package: never leave it for other tests.
        if pyc_before is None:
            pyc.unlink(missing_ok=True)
        else:
            pyc.write_bytes(pyc_before)


@pytest.mark.slow
def test_feeding_the_clock_half_of_each_step_is_over_budget(tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text())
    # A budget several steps long even on a busy machine: within one step of the budget an
    # honest run and one that feeds its clock half the time cannot be told apart.
    config = _run(repo, monkeypatch, time_budget=20, max_trials=2)
    _seed_attacks(repo, config, ["half clock"], {"half clock": HALF_CLOCK})
    Controller(config, repo).run()
    trials = _trials(repo)
    assert trials["baseline"]["status"] == "keep", trials["baseline"]["reason"]
    trial = trials["half clock"]
    assert trial["status"] == "invalid" and "budget" in trial["reason"], trial["reason"]


def _log(repo: Path, trial: dict) -> str:
    folder = repo / ".autoloop" / "a" / "trials" / str(trial["number"])
    return "\n".join(p.read_text(errors="replace") for p in folder.rglob("*.log"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["time", "steps"])
def test_the_baseline_is_kept_beside_two_cpu_burners(tmp_path, monkeypatch, mode):
    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text())
    flags = {"time_budget": 8} if mode == "time" else {"max_steps": 8}
    config = _run(repo, monkeypatch, max_trials=1, decision_rule="paired", baseline_seeds=2, **flags)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        summary = Controller(config, repo).run()
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    baseline = _trials(repo)["baseline"]
    assert baseline["status"] == "keep", baseline["reason"]
    assert baseline["n_runs"] == 2 and not summary.paused
