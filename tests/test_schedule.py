"""The proposal scheduler over the sources (`schedule = "yield"`, autoloop/loop/sources.py):
the bandit's allocation on a known yield sequence, a model's constant-only answer tried as
the search's point, and the search's re-tune after a model's structural keep, through the
real controller over the fake training script and the fake OpenAI-compatible server."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from autoloop.config import resolve
from autoloop.errors import AutoloopError
from autoloop.loop.controller import Controller
from autoloop.loop.sources import Outcome, shares, turn_order, yields
from autoloop.proposers.search import POINT_PREFIX, RETUNE_PREFIX
from autoloop.store import Store
from conftest import FAKE_TRAIN, bench_module, make_repo
from fakes.fake_openai import FakeOpenAI, edit_answer

LR_LINE = "LR = 0.02  # learning rate; range 0.0001..1 log"
# A structural edit of the fake script's objective: the best learning rate moves from 0.01
# to 10**-1.5 (0.0316) and the floor drops by 0.05, so the edit helps at LR 0.02 (1.0906 ->
# 0.9896) and LR x2 on it helps again (0.9604).
OBJECTIVE = "    value = 1.0 + (math.log10(LR) + 2.0) ** 2 + 0.1 * (math.log2(WIDTH) - 6.0) ** 2"
STRUCTURAL = "    value = 0.95 + (math.log10(LR) + 1.5) ** 2 + 0.1 * (math.log2(WIDTH) - 6.0) ** 2"


def simulate(gain_per_minute: dict[str, float], turns: int, floor: float) -> dict[str, int]:
    """Turns of the bandit where each source, when picked, wins its fixed gain in one minute."""
    history: list[Outcome] = []
    for _ in range(turns):
        share = shares(yields(history, list(gain_per_minute), window=10_000, prior=0), floor)
        counts = {n: sum(1 for o in history if o.source == n) for n in gain_per_minute}
        first = turn_order(share, counts)[0]
        history.append(Outcome(first, gain_per_minute[first], 1.0))
    return {n: sum(1 for o in history if o.source == n) for n in gain_per_minute}


def test_shares_follow_yield_per_gpu_minute_with_a_floor_for_each_source():
    # 3:1:0 bpb per minute, floor 0.1 of 3 sources: 0.1 + 0.7 x (3/4, 1/4, 0).
    assert shares({"llm": 0.003, "search": 0.001, "agent": 0.0}, 0.1) == pytest.approx(
        {"llm": 0.625, "search": 0.275, "agent": 0.1})
    # A source not yet tried counts as the best known one; nothing yielded: equal shares.
    assert shares({"llm": None, "search": 0.002}, 0.1) == pytest.approx({"llm": 0.5, "search": 0.5})
    assert shares({"llm": 0.0, "search": 0.0}, 0.1) == {"llm": 0.5, "search": 0.5}
    # Yield is gain over the minutes of the source's last `window` outcomes.
    history = [Outcome("llm", 0.02, 4.0), Outcome("llm", 0.0, 6.0), Outcome("search", 0.01, 2.0),
               Outcome("search", 0.0, 3.0), Outcome("search", 0.0, 5.0)]
    assert yields(history, ["llm", "search", "agent"], prior=0) == pytest.approx(
        {"llm": 0.002, "search": 0.001, "agent": None})
    assert yields(history, ["search"], window=2) == {"search": 0.0}
    # Shrunk by 2 pseudo-trials of the mean length (4 min) at the pooled yield (0.03 / 20 min):
    # (0.02 + 0.0015 x 8) / (10 + 8) and (0.01 + 0.0015 x 8) / (10 + 8).
    assert yields(history, ["llm", "search"]) == pytest.approx({"llm": 0.032 / 18, "search": 0.022 / 18})


def test_one_failure_does_not_send_a_source_to_the_floor():
    # The model failed once (a minute); the search won 0.003 in each of 5 minutes. Pooled:
    # 0.015 / 6 min; 2 pseudo-minutes each: model 0.005 / 3, search 0.020 / 7.
    history = [Outcome("llm", 0.0, 1.0)] + [Outcome("search", 0.003, 1.0)] * 5
    llm, search = 0.005 / 3, 0.020 / 7
    assert shares(yields(history, ["llm", "search"]), 0.1) == pytest.approx(
        {"llm": 0.1 + 0.8 * llm / (llm + search), "search": 0.1 + 0.8 * search / (llm + search)})
    assert shares(yields(history, ["llm", "search"], prior=0), 0.1) == pytest.approx({"llm": 0.1, "search": 0.9})


def test_the_bandit_gives_each_source_its_share_of_turns_on_a_fixed_yield_sequence():
    # 200 turns at 3:1:0 bpb a minute: 0.625, 0.275 and the floor 0.1 of the turns, to within one.
    counts = simulate({"llm": 0.003, "search": 0.001, "agent": 0.0}, 200, 0.1)
    assert abs(counts["llm"] - 125) <= 1 and abs(counts["search"] - 55) <= 1 and abs(counts["agent"] - 20) <= 1
    # A source that never yields keeps exactly its floor; without a floor it would starve.
    counts = simulate({"llm": 0.0, "search": 0.002}, 100, 0.1)
    assert counts == {"llm": 10, "search": 90}
    assert simulate({"llm": 0.0, "search": 0.002}, 100, 0.0)["llm"] == 1  # tried once (optimism), then never


def test_schedule_settings_are_checked(tmp_path):
    assert resolve(tmp_path, {"schedule": "yield"}).schedule == "yield"
    with pytest.raises(AutoloopError, match="schedule"):
        resolve(tmp_path, {"schedule": "bandit"})
    with pytest.raises(AutoloopError, match="schedule-floor"):
        resolve(tmp_path, {"schedule_floor": 0.9})


@pytest.fixture
def repo(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    return make_repo(tmp_path / "repo", FAKE_TRAIN.read_text(), {"program.md": "# program\nLower val_bpb.\n"})


def night(repo: Path, server: FakeOpenAI, **flags):
    flags = {"tag": "t", "time_budget": 5, "grace_seconds": 20, "verify": False, "proposers": "llm,search",
             "llm_model": "fake-model", "llm_base_url": server.base_url, "llm_retries": 0, "schedule": "yield",
             "check": False, **flags}
    Controller(resolve(repo, flags), repo, verifier=None).run()
    with Store(repo / "experiments.db") as store:
        run = store.get_run("t")
        calls = [dict(r) for r in store.db.query("SELECT * FROM proposals ORDER BY id")]
        return store.trials(run["id"]), calls


def test_a_models_constant_only_answer_is_tried_as_the_searchs_point(repo):
    answer = edit_answer(LR_LINE, "LR = 0.01  # learning rate; range 0.0001..1 log", "lower the learning rate")
    with FakeOpenAI([answer]) as server:
        trials, calls = night(repo, server, max_trials=2)
    trial = trials[1]
    assert trial["proposer"] == "search" and trial["status"] == "keep"
    assert trial["description"] == f"{POINT_PREFIX} llm: LR 0.02 -> 0.01 (lower the learning rate)"
    assert [(e["path"], e["sets"]) for e in trial["edits"]["edits"]] == [("train.py", {"LR": 0.01})]
    assert trial["metric"] == pytest.approx(1.0)  # the fake script's optimum: the point was tried as given
    # The model's call is still accounted, on the trial that used its answer.
    assert [c["trial_id"] for c in calls if c["proposer"] == "llm"][:1] == [trial["id"]]


def test_the_search_re_tunes_the_learning_rates_after_a_models_structural_keep(repo):
    later = edit_answer("WIDTH = 64  # model width; power of two", "WIDTH = 32  # model width; power of two", "narrower")
    with FakeOpenAI([edit_answer(OBJECTIVE, STRUCTURAL, "a better objective"), later]) as server:
        trials, _ = night(repo, server, max_trials=4)
    structural, down, up = trials[1], trials[2], trials[3]
    assert (structural["proposer"], structural["status"]) == ("llm", "keep")
    assert structural["metric"] == pytest.approx(0.95 + (-1.69897 + 1.5) ** 2, abs=1e-4)
    # Half a step each way, down first: /1.41 moves away from the new optimum (0.0316), x1.41 towards it.
    assert down["proposer"] == "search" and down["parent_commit"] == structural["trial_commit"]
    assert down["description"] == f"{RETUNE_PREFIX} 2's change: every learning rate /1.41 (LR 0.02 -> 0.0141)"
    assert down["status"] == "discard" and down["metric"] == pytest.approx(0.95 + (-1.85078 + 1.5) ** 2, abs=1e-4)
    assert up["parent_commit"] == structural["trial_commit"]
    assert up["description"] == f"{RETUNE_PREFIX} 2's change: every learning rate x1.41 (LR 0.02 -> 0.0283)"
    assert up["status"] == "keep" and up["metric"] == pytest.approx(0.95 + (-1.54821 + 1.5) ** 2, abs=1e-4)


def test_the_re_tune_ends_after_the_learning_rates_half_a_step_each_way(repo):
    """A change that leaves the rates' optimum where it was: both re-tunes lose, and the
    next turn is the bandit's. The earlier re-tune went on to each constant the diff named
    (here WIDTH x2, then /2) before the bandit had a turn, 4 trials in all."""
    stays = "    value = 0.95 + (math.log10(LR) + 1.69897) ** 2 + 0.1 * (math.log2(WIDTH) - 6.0) ** 2"
    later = edit_answer("WIDTH = 64  # model width; power of two", "WIDTH = 32  # model width; power of two", "narrower")
    with FakeOpenAI([edit_answer(OBJECTIVE, stays, "a better objective"), later]) as server:
        trials, _ = night(repo, server, max_trials=5)
    assert (trials[1]["proposer"], trials[1]["status"]) == ("llm", "keep")
    retunes = [t for t in trials if (t["description"] or "").startswith(RETUNE_PREFIX)]
    assert [t["number"] for t in retunes] == [3, 4]
    assert [t["status"] for t in retunes] == ["discard", "discard"]
    assert [t["edits"]["edits"][0]["sets"] for t in retunes] == [{"LR": 0.0141}, {"LR": 0.0283}]
    assert not trials[4]["description"].startswith(RETUNE_PREFIX)


def test_without_the_scheduler_the_model_answers_again_after_its_structural_keep(repo):
    later = edit_answer("WIDTH = 64  # model width; power of two", "WIDTH = 32  # model width; power of two", "narrower")
    with FakeOpenAI([edit_answer(OBJECTIVE, STRUCTURAL, "a better objective"), later]) as server:
        trials, _ = night(repo, server, max_trials=3, schedule="chain")
    assert [t["proposer"] for t in trials[1:]] == ["llm", "llm"]


def _arms_verdict():
    return bench_module("arms_verdict")


def _night(scheduler: float, model: float, search: float) -> list[dict]:
    return [{"rule": arm, "val": {"gain": gain, "gain_se": 0.01}}
            for arm, gain in (("scheduler", scheduler), ("model-only", model), ("search-only", search))]


def test_the_pre_registered_verdict_on_nights_with_a_known_answer():
    """bench/arms_verdict.py: the better arm is fixed over all nights (not picked per night),
    and the verdict is the mean difference against its standard error over the nights."""
    v = _arms_verdict().verdict([_night(0.30, 0.20, 0.25), _night(0.28, 0.24, 0.10), _night(0.26, 0.22, 0.20)])
    # model-only's mean 0.22 beats search-only's 0.183: the better arm on every night, though
    # search-only beat it on the first.
    assert v["better"] == "model-only"
    assert v["diffs"] == pytest.approx([0.10, 0.04, 0.04])
    assert v["mean"] == pytest.approx(0.06) and v["se"] == pytest.approx(0.02)  # sd 0.0346 / sqrt(3)
    assert v["met"]
    # Ahead on average but by less than one standard error over the nights: not met.
    v = _arms_verdict().verdict([_night(0.30, 0.20, 0.0), _night(0.20, 0.22, 0.0), _night(0.25, 0.24, 0.0)])
    assert v["mean"] == pytest.approx(0.03) and v["se"] == pytest.approx(0.0360555, rel=1e-4) and not v["met"]
    # One night has no night-to-night spread: no verdict, whatever its difference.
    v = _arms_verdict().verdict([_night(0.50, 0.20, 0.10)])
    assert v["se"] is None and not v["met"] and "no verdict" in _arms_verdict().describe(v)
    with pytest.raises(SystemExit, match="no search-only arm"):
        _arms_verdict().verdict([_night(0.3, 0.2, 0.1)[:2]])


def test_a_bench_night_reads_the_corpus_of_a_fixed_key_in_its_own_cache(tmp_path):
    """bench/night.py: the third check's first night trained on another corpus than the
    second check's (the machine's random key), so nights of two machines did not compare.
    A night now reads the tests' key from a cache in its work folder, and a kept folder of
    another key is refused rather than mixed."""
    from autoloop.harness.corpus_key import corpus_key
    from conftest import TEST_CORPUS_KEY

    night_bench = bench_module("night")
    cache = night_bench.use_corpus(tmp_path / "w", night_bench.tests_corpus_key())
    assert cache == tmp_path / "w" / "cache" and Path(os.environ["AUTOLOOP_CACHE_DIR"]) == cache
    assert corpus_key(cache, create=False) == TEST_CORPUS_KEY
    assert night_bench.use_corpus(tmp_path / "w", TEST_CORPUS_KEY.hex()) == cache  # the same night, resumed
    with pytest.raises(SystemExit, match="another corpus key"):
        night_bench.use_corpus(tmp_path / "w", "11" * 32)
    with pytest.raises(SystemExit, match="64 hex digits"):
        night_bench.use_corpus(tmp_path / "v", "abc")


def test_the_benchs_scripted_model_grinds_without_repeating_itself():
    """bench/night.py's scripted model, once its structural list is spent, grinds the
    learning rates but never answers a change it answered from the same value (the brief
    lists what was tried): its first version repeated two answers for ever once its grid
    was spent, and its model-only night never ended."""
    import re

    night_bench = bench_module("night")
    model = night_bench.ScriptedModel()
    model.used = set(range(len(night_bench.STRUCTURAL_EDITS)))
    source = "MATRIX_LR = 0.04  # m\nEMBEDDING_LR = 0.6  # e\nUNEMBEDDING_LR = 0.004  # u\n"
    body = {"messages": [{"role": "user", "content": source}]}  # every answer discarded: the file stays
    answers = [model(body) for _ in range(3 * len(night_bench.GRIND_FACTORS) + 2)]
    changes = [re.findall(r"^\+?(\w+_LR = [0-9.e+-]+)", a, re.M) for a in answers[:-2]]
    assert len({tuple(c) for c in changes}) == len(changes) == 3 * len(night_bench.GRIND_FACTORS)
    assert answers[-2:] == ["I have nothing more to propose."] * 2
    # A kept change moves the incumbent: the same factors are new answers from the new value.
    body = {"messages": [{"role": "user", "content": source.replace("0.04", "0.06")}]}
    assert "MATRIX_LR" in model(body)


def test_the_bench_counts_a_nights_compute_by_each_runs_model_flops(tmp_path):
    """bench/night.py --budget flops: the arms of the first check ran 40 runs each, but a
    run of a model the search had grown cost several of the baseline's (search-only's night
    took twice the scheduler's wall time). Counted by compute, a run of twice the batch is 2
    baseline runs, an early-stopped run its fraction of that, and a wider model its harness
    FLOPs (real train.py variants in a real git repository and store)."""
    from autoloop import harness as H

    night_bench = bench_module("night")
    train = (Path(__file__).resolve().parents[1] / "train.py").read_text()
    batch, width = "    TOTAL_BATCH_TOKENS = 8 * 256", "    MODEL_DIM = 64"
    assert batch in train and width in train
    variants = {"baseline": train, "batch x2": train.replace(batch, "    TOTAL_BATCH_TOKENS = 16 * 256"),
                "width x2": train.replace(width, "    MODEL_DIM = 128")}
    repo = make_repo(tmp_path / "repo", train)

    commits = {}
    for name, source in variants.items():
        (repo / "train.py").write_text(source)
        subprocess.run(["git", "commit", "-qam", name, "--allow-empty"], cwd=repo, check=True)
        commits[name] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, check=True, capture_output=True,
                                       text=True).stdout.strip()
    steps = 60
    with Store(repo / "experiments.db") as store:
        run = store.create_run("night")
        base = store.new_trial(run["id"], "baseline", trial_commit=commits["baseline"], status="keep")
        store.add_measurement(base["id"], 3.0, seed=1, num_steps=steps, status="ok")
        doubled = store.new_trial(run["id"], "proposal", trial_commit=commits["batch x2"], status="discard")
        for seed in (1, 2):
            store.add_measurement(doubled["id"], 3.1, seed=seed, num_steps=steps, status="ok")
        stopped = store.new_trial(run["id"], "proposal", trial_commit=commits["batch x2"], status="discard",
                                  stopped_at=0.3)
        store.add_measurement(stopped["id"], None, seed=1, status="stopped")
        # A proposal that never trained (a duplicate: invalid before any commit) costs nothing.
        store.new_trial(run["id"], "proposal", status="invalid", reason="the proposal changes nothing")
        assert night_bench.runs_spent(store, run["id"], steps) == pytest.approx(1 + 2 + 0.3)
        # The baseline's run is 1, each run at twice the batch is 2, the stopped one 0.3 of 2.
        assert night_bench.compute_spent(store, run["id"], steps, repo) == pytest.approx(1 + 2 * 2 + 0.3 * 2)
        wide = store.new_trial(run["id"], "proposal", trial_commit=commits["width x2"], status="discard")
        store.add_measurement(wide["id"], 3.2, seed=1, num_steps=steps, status="ok")
        spent = night_bench.compute_spent(store, run["id"], steps, repo)
    # The wider model's cost is the harness's own FLOPs count of the two models built.
    module = H.import_train_module(repo / "train.py")  # the width x2 commit is checked out
    wide_flops = H.flops_per_token(module.build_model(module.model_config(), device="meta"))
    (repo / "train.py").write_text(train)
    base_flops = H.flops_per_token(H.import_train_module(repo / "train.py").build_model(device="meta"))
    assert wide_flops > 2.5 * base_flops
    assert spent == pytest.approx(5.6 + wide_flops / base_flops)
