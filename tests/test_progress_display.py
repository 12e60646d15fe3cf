"""What `autoloop run` shows while a trial trains: step, loss, tokens/s and what is left,
from train.py's own progress lines, read as data.

A real run through the real controller, runner and sandbox of a small train script that
trains a few seconds and writes progress lines; only the training is fake. Not a terminal
(the CLI's output captured, as `nohup autoloop run > night.log` writes it): plain lines,
none wrapped at 80 columns. A terminal (rich forced to one, writing to a buffer): the live
status line carries the same figures.
"""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console
from typer.testing import CliRunner

import autoloop.cli.display as display_mod
from autoloop.cli import app
from autoloop.cli.display import Display, progress_words
from conftest import FAKE_TRAIN, make_repo

STEPS = 40
PLAIN = re.compile(rf"^  trial \d+: step (\d+)/{STEPS} \| loss \d+\.\d{{4}} \| 1,234 tok/s \| (\d+) steps left "
                   r"\(~\d+ s\) \| \d+ s elapsed$")


def _stepwise_repo(tmp_path, seconds: float):
    """The fake train script, training step by step for `seconds`, its progress lines
    with a tokens/s figure as train.py writes them."""
    source = FAKE_TRAIN.read_text()
    old = '"training_seconds": point["seconds"]}'
    assert old in source
    source = (source.replace(old, '"training_seconds": point["seconds"], "tokens_per_second": 1234.4}')
              .replace("STEPWISE = False", "STEPWISE = True").replace("SLEEP = 0.0", f"SLEEP = {seconds}"))
    return make_repo(tmp_path / "repo", source)


def test_progress_words_read_what_is_known_and_say_what_is_left():
    record = {"step": 30, "loss": 3.14159, "tokens_per_second": 12345.6, "training_seconds": 15.0}
    assert progress_words(record, max_steps=120, time_budget=None) == [
        "step 30/120", "loss 3.1416", "12,346 tok/s", "90 steps left (~45 s)"]
    # Time mode: the budget less train.py's own training seconds.
    assert progress_words(record, max_steps=None, time_budget=300) == [
        "step 30", "loss 3.1416", "12,346 tok/s", "4.8 min left"]
    # A step past the budget leaves nothing, never a negative count; missing figures are left out.
    assert progress_words({"step": 130}, max_steps=120, time_budget=None) == ["step 130/120", "0 steps left"]
    assert progress_words({"loss": 2.5}, max_steps=None, time_budget=None) == ["loss 2.5000"]


@pytest.mark.slow
def test_a_run_not_on_a_terminal_prints_plain_progress_lines_never_wrapped(tmp_path, monkeypatch, one_run_per_trial):
    """Before: one line per run and nothing while it trained, and every line longer than 80
    columns broken in two (rich's width when the output is not a terminal)."""
    repo = _stepwise_repo(tmp_path, seconds=5.0)
    monkeypatch.setattr(display_mod, "PLAIN_EVERY", 1.0)
    result = CliRunner().invoke(app, ["run", "--repo", str(repo), "--tag", "plain", "--no-verify", "--max-trials", "1",
                                      "--max-steps", str(STEPS), "--grace-seconds", "60"],
                                env={"COLUMNS": "80"}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    progress = [PLAIN.match(line) for line in lines if line.startswith("  trial ")]
    assert len(progress) >= 2, result.output  # a run of 5 s, a line at most every second
    assert all(progress), result.output  # every one whole: step, loss, tok/s, steps left, on one line
    for match in progress:
        step, left = int(match.group(1)), int(match.group(2))
        assert 1 <= step <= STEPS and left == STEPS - step
    assert all(len(match.group(0)) > 80 for match in progress)  # each longer than 80 columns, and not cut there
    # The run's 84-character line is whole, and nothing is a wrapped line's second half.
    assert "trial 1 [baseline] baseline: the unmodified training script | baseline at seed 1337" in lines, lines
    assert not [line for line in lines if line.startswith(("seed 1337", "1337", "elapsed", "left"))], lines


def test_progress_lines_are_throttled_when_not_a_terminal(tmp_path):
    """A night's log gets at most one progress line every `plain_every` seconds, whatever the
    train script writes (here a progress line per poll), and never the same step twice."""
    import json
    from types import SimpleNamespace

    progress = tmp_path / "progress.jsonl"
    config = SimpleNamespace(max_steps=STEPS, time_budget=300.0)

    def printed(every: float) -> list[str]:
        buffer = io.StringIO()
        display = Display(Console(file=buffer, width=80), plain_every=every)
        progress.write_text("")
        display.trial_started({"number": 3, "kind": "proposal", "description": "x"}, None, config)
        for step in (1, 2, 2, 3):
            with progress.open("a") as handle:
                handle.write(json.dumps({"step": step, "loss": 2.0, "training_seconds": step * 0.5,
                                         "tokens_per_second": 1234.4}) + "\n")
            display._last_poll = 0.0  # as if a second had passed since the last poll
            display.poll(progress)
            display.poll(progress)
        return [line for line in buffer.getvalue().splitlines() if PLAIN.match(line)]

    assert [PLAIN.match(line).group(1) for line in printed(60.0)] == ["1"]
    assert [PLAIN.match(line).group(1) for line in printed(0.0)] == ["1", "2", "3"]


@pytest.mark.slow
def test_a_terminal_shows_the_figures_in_its_live_status_line(tmp_path, monkeypatch, one_run_per_trial):
    from autoloop.config import resolve
    from autoloop.loop.controller import Controller

    repo = _stepwise_repo(tmp_path, seconds=4.0)
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=200, color_system="standard")
    config = resolve(repo, {"tag": "tty", "max_trials": 1, "max_steps": STEPS, "grace_seconds": 60, "verify": False})
    Controller(config, repo, display=Display(console)).run()
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buffer.getvalue())
    shown = re.findall(rf"step (\d+)/{STEPS} \| loss \d+\.\d{{4}} \| 1,234 tok/s \| (\d+) steps left", screen)
    assert shown, screen
    assert all(int(step) + int(left) == STEPS for step, left in shown)
    assert not PLAIN.search(screen)  # on a terminal the status line, not the plain lines


@pytest.mark.parametrize("line, shown", [
    ('{"step": 5, "loss": "1e999999", "tokens_per_second": 1e300}', ["step 5/10", "5 steps left"]),
    ('{"step": 5, "loss": NaN, "tokens_per_second": {"__import__": "os"}}', ["step 5/10", "5 steps left"]),
    ('{"step": 5, "loss": 2.0, "junk": "' + "x" * 5000 + '"}', []),  # longer than a progress line: not one
    ("step 5 loss 2.0", []),
])
def test_a_progress_line_is_data_its_figures_checked(line, shown):
    """What a trial writes as progress is never evaluated, and a figure that is not a sane
    finite number (or a line longer than a progress line) shows as nothing."""
    from autoloop.trust.untrusted import progress_record

    assert progress_words(progress_record(line) or {}, max_steps=10, time_budget=None) == shown


def test_several_workers_each_get_plain_lines_named_by_worker_and_trial(tmp_path):
    """With several trials training at once (`--workers`), each trial's figures come as its
    own plain lines, naming the worker and the trial, each throttled on its own."""
    import json
    from types import SimpleNamespace

    from autoloop.loop.run import SharedDisplay

    buffer = io.StringIO()
    shared = SharedDisplay(Display(Console(file=buffer, width=80), plain_every=60.0))
    config = SimpleNamespace(max_steps=STEPS, time_budget=300.0)
    trials = [{"id": 10 + n, "number": n, "kind": "proposal", "description": f"idea {n}", "worker": f"gpu{n}"}
              for n in (2, 3)]
    paths = {t["id"]: tmp_path / f"progress-{t['number']}.jsonl" for t in trials}
    for trial in trials:
        shared.trial_started(trial, None, config, seed=1337, role="candidate")
    for step in (5, 6):
        for trial in trials:
            with paths[trial["id"]].open("a") as handle:
                handle.write(json.dumps({"step": step + trial["number"], "loss": 2.0, "training_seconds": 1.0,
                                         "tokens_per_second": 1234.4}) + "\n")
            shared.poll(paths[trial["id"]], trial)
    shared.poll(paths[10 + 2], None)  # a caller that does not say which trial: nothing to name, nothing printed
    lines = [line for line in buffer.getvalue().splitlines() if "tok/s" in line]
    assert [re.sub(r" \| \d+ s elapsed$", "", line) for line in lines] == [
        f"  [gpu2] trial 2: step 7/{STEPS} | loss 2.0000 | 1,234 tok/s | {STEPS - 7} steps left (~5 s)",
        f"  [gpu3] trial 3: step 8/{STEPS} | loss 2.0000 | 1,234 tok/s | {STEPS - 8} steps left (~4 s)",
    ]
