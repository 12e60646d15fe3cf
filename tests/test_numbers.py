"""One sign convention and one set of numbers (issue 35, item 4), checked against a run
whose every figure is known.

The run is written through the Store into a real experiments.db, in a real git repo,
the way a CPU night on a machine that has a GPU leaves it (values chosen by hand):

    1 baseline keep     seeds 1337, 1338, 1339: 3.400, 3.410, 3.408 (mean 3.406), 300 + 290 + 310 s
    2 proposal keep     seeds 1337, 1338: 3.430, 3.420 (mean 3.425, selected), 300 s each,
                        the incumbent measured again for it at 1337, 1338 (300 s each),
                        paired mean difference -0.0200: kept;
                        re-measured at the reserve seeds 1001337, 1001338: 3.4800, 3.4814
                        (mean 3.4807: +0.0747 bpb, 2.19% higher than the baseline), 300 s each
    3 proposal discard  seed 1337: 3.500, 300 s, paired difference +0.0900

So: the best is *worse* than the baseline once re-measured (+0.0747, 2.19% higher), and
every command must say so with the same figures and signs; the baseline's time is its three
runs (15.0 min), trial 2's its six (30.0 min), the night's 3,000 s (0.83 CPU hours: every
run trained on the CPU, though the machine has a GPU); the baseline is not a keep.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from typer.testing import CliRunner

from conftest import make_repo

TAG = "known"
BASE_SEED = 1337
RESERVE = [BASE_SEED + 1_000_000, BASE_SEED + 1_000_001]
GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}

BASELINE_MEAN = (3.400 + 3.410 + 3.408) / 3  # 3.406
RESERVE_MEAN = (3.4800 + 3.4814) / 2  # 3.4807
DELTA = RESERVE_MEAN - BASELINE_MEAN  # +0.0747: the best is worse
RELATIVE = DELTA / BASELINE_MEAN  # +2.19%
SECONDS = 900 + 600 + 600 + 600 + 300  # baseline, trial 2's own, its incumbent runs, its reserve, trial 3


def _commit(repo, text: str) -> str:
    (repo / "train.py").write_text(text)
    subprocess.run(["git", "commit", "-qam", text.strip()], cwd=repo, check=True, env=GIT_ENV)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture
def known_run(tmp_path):
    from autoloop.store import Store

    repo = make_repo(tmp_path / "repo", "LR = 0.02\n")
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()
    kept = _commit(repo, "LR = 0.03\n")
    store = Store(repo / "experiments.db")
    run = store.create_run(TAG, branch=f"autoloop/{TAG}", base_commit=base, best_commit=kept, gpu="NVIDIA H100",
                           status="finished", config={"seed": BASE_SEED, "reserve_seeds": 2, "time_budget": 300})

    def runs(trial, rows, role, for_trial=None):
        for seed, metric, wall in rows:
            store.add_measurement(trial["id"], metric, seed=seed, role=role, status="ok", device="cpu",
                                  wall_seconds=wall, training_seconds=wall - 20, num_steps=60,
                                  for_trial_id=for_trial["id"] if for_trial else None)

    b = store.new_trial(run["id"], "baseline", description="baseline", trial_commit=base)
    runs(b, [(1337, 3.400, 300.0), (1338, 3.410, 290.0), (1339, 3.408, 310.0)], "baseline")
    # The row holds its last run's figures (seed 1339's), as the controller writes it, and its first seed.
    store.update_trial(b["id"], status="keep", metric=BASELINE_MEAN, metric_sd=0.003, n_runs=3, seed=1337,
                       metric_source="verified", wall_seconds=310.0, training_seconds=290.0, num_steps=60,
                       tier="baseline")
    t2 = store.new_trial(run["id"], "proposal", description="LR 0.03", parent_commit=base, trial_commit=kept,
                         diff="-LR = 0.02\n+LR = 0.03\n")
    runs(t2, [(1337, 3.430, 300.0), (1338, 3.420, 300.0)], "candidate")
    runs(b, [(1337, 3.450, 300.0), (1338, 3.440, 300.0)], "incumbent", for_trial=t2)
    store.update_trial(t2["id"], status="keep", metric=3.425, metric_sd=0.005, n_runs=2, metric_source="verified",
                       wall_seconds=300.0, best_before=BASELINE_MEAN, delta=3.425 - BASELINE_MEAN, tier="adopted",
                       decision={"mean_diff": -0.02, "se": 0.004, "n": 2, "low": -0.03, "high": -0.01},
                       reason="keep: -0.0200 against the incumbent")
    runs(t2, [(RESERVE[0], 3.4800, 300.0), (RESERVE[1], 3.4814, 300.0)], "reserve")
    t3 = store.new_trial(run["id"], "proposal", description="LR 0.1", parent_commit=kept)
    runs(t3, [(1337, 3.500, 300.0)], "candidate")
    store.update_trial(t3["id"], status="discard", metric=3.5, n_runs=1, metric_source="verified", wall_seconds=300.0,
                       best_before=3.425, decision={"mean_diff": 0.09, "n": 1})
    store.close()
    return repo


def cli(repo, *args):
    from autoloop.cli import app

    result = CliRunner().invoke(app, [*args, "--repo", str(repo)])
    assert result.exit_code == 0, result.output
    return result.output


def test_best_says_the_re_measured_best_is_higher_than_the_baseline(known_run):
    out = cli(known_run, "best")
    assert f"{DELTA:+.4f} bpb ({RELATIVE * 100:.2f}% higher" in out, out
    assert "better" not in out.replace("better than it is", ""), out  # no signed number called "better"
    info = json.loads(cli(known_run, "best", "--json"))
    assert info["delta"] == pytest.approx(DELTA)
    assert info["relative"] == pytest.approx(RELATIVE)


def test_finalize_states_the_same_change_as_best(known_run):
    cli(known_run, "finalize")
    message = subprocess.run(["git", "log", "-1", "--format=%B", f"final/{TAG}"], cwd=known_run, check=True,
                             capture_output=True, text=True).stdout
    first = message.splitlines()[0]
    assert f"{BASELINE_MEAN:.4f} -> {RESERVE_MEAN:.4f}" in first, message
    assert f"{DELTA:+.4f} bpb ({RELATIVE * 100:.2f}% higher" in first, message
    assert "better" not in message, message


def test_the_report_and_the_page_show_the_same_change_and_cpu_hours(known_run, tmp_path):
    from autoloop.review.report import report_data, render_html
    from autoloop.serve.queries import summary
    from autoloop.store import Store

    store = Store(known_run / "experiments.db")
    try:
        run = store.get_run(TAG)
        data = report_data(store, run)
        page = summary(store, run)
    finally:
        store.close()
    head = data["headline"]
    assert head["compute"] == "CPU" and page["headline"]["compute"] == "CPU"
    assert head["compute_hours"] == pytest.approx(SECONDS / 3600)
    assert page["headline"]["compute_hours"] == pytest.approx(SECONDS / 3600)
    for change in (head["change"], page["headline"]["change"], page["best"]["change"]):
        assert change["delta"] == pytest.approx(DELTA) and change["relative"] == pytest.approx(RELATIVE)
        assert change["best"] == pytest.approx(RESERVE_MEAN) and change["baseline"] == pytest.approx(BASELINE_MEAN)
    html = render_html(data)
    assert "CPU hours" in html and f"{SECONDS / 3600:.2f}" in html and "GPU hours" not in html
    assert f"{RELATIVE * 100:.2f}% higher" in html, html
    assert head["kept"] == 1  # the baseline is not a keep


def test_log_minutes_count_every_run_of_a_trial(known_run):
    rows = json.loads(cli(known_run, "log", "--json"))
    minutes = {r["number"]: r["minutes"] for r in rows}
    assert minutes == {1: 15.0, 2: 30.0, 3: 5.0}
    assert sum(minutes.values()) == pytest.approx(SECONDS / 60)  # the log adds up to the report's hours
    from autoloop.serve.queries import trials_page
    from autoloop.store import Store

    store = Store(known_run / "experiments.db")
    try:
        page = trials_page(store, store.get_run(TAG))
    finally:
        store.close()
    assert {r["number"]: r["minutes"] for r in page["rows"]} == minutes  # the page's table says the same
    text = cli(known_run, "log")
    assert re.search(r"^\s+1 baseline\s+keep\s.*\s15\.0\s", text, re.M), text
    deltas = {r["number"]: r["delta"] for r in rows}
    assert deltas[2] == pytest.approx(-0.02) and deltas[3] == pytest.approx(0.09)  # negative: lower


def test_show_labels_the_row_s_times_with_their_own_seed(known_run):
    out = cli(known_run, "show", "1", "--no-diff")
    run_section = out.split("\nrun\n")[1]
    seed_line = next(line for line in run_section.splitlines() if line.strip().startswith("seed"))
    assert "1339" in seed_line and "1337" not in seed_line, seed_line  # 310 s wall is seed 1339's run
    assert "the last of 3 runs" in seed_line, seed_line  # its own three, not the two made for trial 2
    assert "wall 310.0 s" in run_section and "training 290.0 s" in run_section, run_section


def test_status_counts_the_baseline_apart_from_the_keeps(known_run):
    out = cli(known_run, "status")
    assert "1 baseline, 1 discard, 1 keep" in out, out
    assert f"{DELTA:+.4f} bpb ({RELATIVE * 100:.2f}% higher" in out, out


def test_change_text_reads_one_way():
    from autoloop.decide.figures import baseline_to_best, change_text, pair_text

    assert change_text(-0.0747, 3.406) == "-0.0747 bpb (2.19% lower)"
    assert change_text(0.0747, 3.406) == "+0.0747 bpb (2.19% higher)"
    assert change_text(0.00001, 3.406) == "+0.0000 bpb (level)"
    pair = baseline_to_best(3.406, 3.425, {"baseline_metric": 3.406, "value": 3.4807, "gain": -0.0747,
                                          "interval": [-0.1, -0.05], "n": 4, "source": "reserve"})
    assert pair["delta"] == pytest.approx(0.0747) and (pair["low"], pair["high"]) == (0.05, 0.1)
    assert pair_text(pair) == ("baseline 3.4060 -> best 3.4807 re-measured at 4 fresh seeds: "
                               "+0.0747 bpb (2.19% higher; 95% interval +0.0500 to +0.1000)")
    selected = baseline_to_best(3.406, 3.331, None)
    assert selected["source"] == "selection" and pair_text(selected).endswith("-0.0750 bpb (2.20% lower)")


def test_status_says_steps_left_in_step_mode(known_run):
    """A 60-step run at step 12: '48 steps left', not the script's seconds (which only report)."""
    from autoloop.measure.run_folder import RunFolder
    from autoloop.store import Store

    folder = RunFolder(known_run / ".autoloop" / TAG / "runs" / "4")
    folder.progress.parent.mkdir(parents=True)
    folder.progress.write_text(json.dumps({"step": 12, "loss": 3.25, "training_seconds": 24.0,
                                           "seconds_left": 276.0}) + "\n")
    store = Store(known_run / "experiments.db")
    try:
        run = store.get_run(TAG)
        store.update_run(run["id"], config={**run["config"], "max_steps": 60})
        store.new_trial(run["id"], "proposal", description="LR 0.04", log_path=str(folder.log))
    finally:
        store.close()
    out = cli(known_run, "status")
    assert "step 12/60" in out and "48 steps left" in out, out
    assert "276" not in out, out


@pytest.mark.slow
def test_the_live_page_shows_the_same_numbers_and_whole_trial_ticks(known_run):
    """The page in a real browser: the change and the hours as `best` and the report say
    them, and the progress chart's trial axis at whole trials only (uPlot draws its ticks on
    a canvas: the test records what it writes there)."""
    from browser_support import Browser, chromium
    from serve_support import Server

    if chromium() is None:
        pytest.skip("no chromium installed (.ci/run installs Debian's chromium)")
    pytest.importorskip("websockets")
    record = ("window.__texts = []; const fill = CanvasRenderingContext2D.prototype.fillText;"
              "CanvasRenderingContext2D.prototype.fillText = function (t, ...rest) {"
              " window.__texts.push(String(t)); return fill.call(this, t, ...rest); };")
    with Server(known_run) as server, Browser("about:blank") as browser:
        browser.call("Page.addScriptToEvaluateOnNewDocument", source=record)
        browser.navigate(server.link)
        browser.wait_for("document.querySelector('#stats .stat') !== null && document.querySelector('#progress canvas')"
                         " !== null && window.__texts.length > 0", 20)
        stats = browser.evaluate("document.querySelector('#stats').textContent")
        texts = browser.evaluate("window.__texts")
    assert f"{RELATIVE * 100:.2f}% higher" in stats and f"{DELTA:+.4f} bpb" in stats, stats
    assert f"{SECONDS / 3600:.2f} CPU hours" in stats and "GPU" not in stats, stats
    assert f"{BASELINE_MEAN:.4f} → {RESERVE_MEAN:.4f}" in stats, stats
    trial_ticks = [t for t in texts if re.fullmatch(r"\d+(\.\d{1,2})?", t)]  # the y axis has three decimals
    assert trial_ticks and all(t.isdigit() for t in trial_ticks), texts


def test_status_shows_the_final_re_measurement_as_running(known_run):
    """The reserve runs belong to a kept trial, so no trial is `running` while they train:
    status says what is (the controller holds the tree, the re-measurement has started)."""
    from autoloop.loop.lock import RunLock
    from autoloop.store import Store

    store = Store(known_run / "experiments.db")
    try:
        run = store.get_run(TAG)
        store.update_run(run["id"], status="active")
        best = store.get_trial(run["id"], 2)
        store.add_event(run["id"], "reserve_start", "re-measuring the best (trial 2) at 2 fresh seeds",
                        trial_id=best["id"])
    finally:
        store.close()
    from autoloop.serve.queries import live

    with RunLock.for_folder(known_run).acquire(TAG, known_run):
        out = cli(known_run, "status")
        store = Store(known_run / "experiments.db")
        try:
            page = live(store, store.get_run(TAG), known_run)
        finally:
            store.close()
    assert page["running"] == [] and page["remeasuring"] == {"trial": 2, "done": 2, "of": 2}, page
    assert "running: re-measuring the best (trial 2) at fresh seeds" in out and "2 of 2 runs done" in out, out
    assert "nothing running" not in out
    assert "nothing running" in cli(known_run, "status")  # the controller is gone: nothing is



def test_the_end_of_a_run_says_what_best_says(known_run):
    """The last lines of `autoloop run`, from the controller's summary of the known run:
    the same pair, signs and percent as `best`, the baseline counted apart."""
    from autoloop.cli import end_lines
    from autoloop.loop.controller import RunSummary
    from autoloop.loop.reserve import headline_of
    from autoloop.decide.figures import status_counts
    from autoloop.store import Store

    store = Store(known_run / "experiments.db")
    try:
        run = store.get_run(TAG)
        trials = store.trials(run["id"])
        summary = RunSummary(TAG, trials_run=3, stop_reason="reached --max-trials 3", best_metric=3.425,
                             baseline_metric=BASELINE_MEAN, best_commit=run["best_commit"],
                             statuses={"keep": 2, "discard": 1}, counts=status_counts(trials),
                             headline=headline_of(store, run))
    finally:
        store.close()
    out = "\n".join(text for text, _ in end_lines(summary, TAG))
    assert (f"baseline {BASELINE_MEAN:.4f} -> best {RESERVE_MEAN:.4f} re-measured at 2 fresh seeds: "
            f"{DELTA:+.4f} bpb ({RELATIVE * 100:.2f}% higher") in out, out
    assert "the run has 1 baseline, 1 discard, 1 keep" in out and "better" not in out, out
