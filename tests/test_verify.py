"""Verification: no trial is kept on a number the harness did not check.

Two halves:

* fast unit tests of the pieces with small real objects: the causality check on tiny
  hand-written models, the budget rules on RunOutcomes, the fingerprint snapshots on a
  copy of the harness and a real prepared dataset, the overfitting watch;
* end-to-end tests (marked slow) with the REAL train.py and the real Controller and
  Verifier: each case changes a copy of train.py the way a proposal would and runs one
  trial. The repository's train.py runs at its own CPU scale (2 layers of width 64, 2048
  tokens a step), so a 40-step trial takes seconds. The baseline (one trained and
  verified trial) is run once per module and the whole repository (git, db, trial
  folders) is copied for each case.

The harness-tampering case runs its controller, trial and verifier against a copy of the
autoloop package (PYTHONPATH for the subprocesses, `Verifier(harness_dir=...)` for the
controller), so the trial can really rewrite a harness file without touching the
installed one.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import FAKE_TRAIN, REPO_ROOT, copy_run, make_repo
from torch import nn

from autoloop.trust import integrity
from autoloop.config import Config
from autoloop.loop.controller import Controller
from autoloop.harness.causality import check_causality
from autoloop.decide.overfit import overfitting_signal, watch
from autoloop.proposers.proposal import Edit, Proposal
from autoloop.proposers.base import ProposerChain
from autoloop.review.queries import log_rows, run_status
from autoloop.review.text import format_log, format_status
from autoloop.base.status import RunOutcome
from autoloop.store import Kind, Status, Store

STEPS = 40
TAG = "v"
MODEL_ATTENTION = "is_causal=True, enable_gqa=self.n_kv_head != self.n_head"
VOCAB = 32


# ---------------------------------------------------------------------------------------
# causality check, on tiny models
# ---------------------------------------------------------------------------------------


class PrefixMean(nn.Module):
    """Causal: position t sees the running mean of embeddings 0..t."""

    def __init__(self, peek: int = 0, mix_batch: bool = False, noise: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)
        self.peek, self.mix_batch, self.noise = peek, mix_batch, noise

    def forward(self, idx):
        x = self.emb(idx)
        h = x.cumsum(1) / torch.arange(1, idx.size(1) + 1).view(1, -1, 1)
        if self.peek:  # the bug the check exists for: position t also sees t + peek
            h = h + 0.5 * torch.roll(x, -self.peek, dims=1)
        if self.mix_batch:  # statistics over the batch: sequence b sees the others
            h = h + x.mean(0, keepdim=True)
        if self.noise:
            h = h + 0.1 * torch.randn_like(h)
        return self.head(h)


def _batch(seed=1, batch=3, length=24):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_causal_model_passes_with_zero_leak():
    report = check_causality(PrefixMean(), _batch(), VOCAB, seed=3)
    assert report.ok and report.reason is None
    assert report.max_leak <= report.tolerance and report.max_batch_leak <= report.tolerance
    assert report.max_allowed_change > 0.01  # the perturbation did move the later positions
    assert 0 in report.cuts and 22 in report.cuts


def test_peeking_one_token_ahead_is_a_leak():
    report = check_causality(PrefixMean(peek=1), _batch(), VOCAB, seed=3)
    assert not report.ok
    assert report.reason.startswith("leaks future tokens") and report.max_leak > 0.01


def test_mixing_across_the_batch_is_a_leak():
    report = check_causality(PrefixMean(mix_batch=True), _batch(), VOCAB, seed=3)
    assert not report.ok and report.reason.startswith("leaks across the batch")


def test_nondeterministic_outputs_cannot_be_checked():
    report = check_causality(PrefixMean(noise=True), _batch(), VOCAB, seed=3)
    assert not report.ok and "not deterministic" in report.reason


def test_sdpa_attention_causal_flag_is_what_decides():
    """The real bug class: the same attention with is_causal True passes, False fails."""

    class Attn(nn.Module):
        def __init__(self, causal):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.qkv, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, 48), nn.Linear(16, VOCAB)
            self.causal = causal

        def forward(self, idx):
            q, k, v = self.qkv(self.emb(idx)).unsqueeze(1).chunk(3, dim=-1)
            return self.head(F.scaled_dot_product_attention(q, k, v, is_causal=self.causal).squeeze(1))

    assert check_causality(Attn(True), _batch(), VOCAB).ok
    assert not check_causality(Attn(False), _batch(), VOCAB).ok


# ---------------------------------------------------------------------------------------
# budget rules
# ---------------------------------------------------------------------------------------


def _outcome(wall=10.0, **result):
    return RunOutcome(status="ok", returncode=0, result=result, metric=1.0, metric_source="harness", reason=None,
                      error_tail="", wall_seconds=wall, pid=1, pgid=1)


def test_step_budget_allows_one_step_of_slack():
    config = Config(max_steps=20)
    assert integrity.budget_problem(config, _outcome(num_steps=21)) is None
    problem = integrity.budget_problem(config, _outcome(num_steps=40))
    assert problem == "trained 40 steps, over its budget of 20 (+1 allowed)"


def test_time_budget_allows_one_step_and_two_percent():
    config = Config(time_budget=100)
    honest = {"training_seconds": 101.5, "num_steps": 103, "compile_seconds": 5, "eval_seconds": 3}  # 1 s steps
    assert integrity.budget_problem(config, _outcome(wall=125, **honest)) is None
    over = {**honest, "training_seconds": 200.0}
    assert "over its 100 s budget" in integrity.budget_problem(config, _outcome(wall=230, **over))


def test_step_slack_cannot_be_bought_with_few_long_steps():
    # 4 steps (1 timed) would make "one step" the whole run; the slack is capped at 25%.
    problem = integrity.budget_problem(Config(time_budget=100), _outcome(wall=200, training_seconds=190, num_steps=4))
    assert problem is not None and "allowed 127.0 s" in problem


def test_wall_clock_catches_a_script_that_underreports_its_training():
    config = Config(time_budget=100)
    # Claims 100 s of training, 5 s compile, 3 s eval, but ran 260 s: ~150 s unexplained.
    lie = {"training_seconds": 100.0, "num_steps": 1000, "compile_seconds": 5, "eval_seconds": 3}
    problem = integrity.budget_problem(config, _outcome(wall=260, **lie))
    assert "by the controller's clock" in problem and "trained longer than it says" in problem
    # Start-up within the allowance (30 s + 10% of the budget) is fine.
    assert integrity.budget_problem(config, _outcome(wall=145, **lie)) is None


def test_other_dataset_and_inconsistent_tokens_are_problems():
    config = Config(max_steps=10)
    assert "another dataset" in integrity.budget_problem(
        config, _outcome(num_steps=10, data_fingerprint="b" * 64), data_fingerprint="a" * 64)
    assert "another harness" in integrity.budget_problem(
        config, _outcome(num_steps=10, harness_fingerprint="b" * 64), harness_fingerprint="a" * 64)
    assert "more than its 10 steps" in integrity.budget_problem(
        config, _outcome(num_steps=10, total_tokens=5000, batch_tokens=100))
    assert integrity.budget_problem(config, _outcome(num_steps=10, total_tokens=1000, batch_tokens=100)) is None


# ---------------------------------------------------------------------------------------
# fingerprints
# ---------------------------------------------------------------------------------------


def test_snapshot_names_changed_harness_and_data_files(tmp_path, embedded_dataset):
    harness = tmp_path / "harness"
    shutil.copytree(REPO_ROOT / "autoloop" / "harness", harness, ignore=shutil.ignore_patterns("__pycache__"))
    data = tmp_path / "data"
    shutil.copytree(embedded_dataset.path, data)
    before = integrity.take_snapshot(harness, data)
    assert integrity.changes(before, integrity.take_snapshot(harness, data)) == []
    with open(harness / "metric.py", "a") as handle:
        handle.write("\n# tampered\n")
    (harness / "extra.py").write_text("x = 1\n")
    with open(data / "val.bin", "r+b") as handle:
        handle.write(b"\x01\x00")
    found = integrity.changes(before, integrity.take_snapshot(harness, data))
    assert found == ["harness file extra.py added", "harness file metric.py modified", "data file val.bin changed"]
    assert integrity.dataset_problems(data) == ["data split val.bin no longer matches its prepared hash"]


def test_snapshot_covers_harness_bytecode_and_its_prefixes(tmp_path, embedded_dataset):
    import sys

    harness = tmp_path / "harness"
    shutil.copytree(REPO_ROOT / "autoloop" / "harness", harness, ignore=shutil.ignore_patterns("__pycache__"))
    prefix = tmp_path / "pycache-eval"
    tag = sys.implementation.cache_tag
    integrity.precompile_harness(harness)
    assert (harness / "__pycache__" / f"metric.{tag}.pyc").exists()
    assert integrity.bytecode_problems(harness) == []  # what precompile wrote is the sources' code
    before = integrity.take_snapshot(harness, embedded_dataset.path, pycache_prefixes=[prefix])
    integrity.precompile_harness(harness)  # current bytecode is left alone: an honest import adds nothing
    assert integrity.changes(before, integrity.take_snapshot(harness, embedded_dataset.path,
                                                             pycache_prefixes=[prefix])) == []

    # Another module's code under metric's name, and a file in the evaluator's prefix.
    data = (harness / "__pycache__" / f"clock.{tag}.pyc").read_bytes()
    (harness / "__pycache__" / f"metric.{tag}.pyc").write_bytes(data)
    # PYTHONPYCACHEPREFIX mirrors the source folder's absolute path (no __pycache__ level).
    mirrored = prefix / harness.resolve().relative_to(harness.resolve().anchor)
    mirrored.mkdir(parents=True)
    (mirrored / f"metric.{tag}.pyc").write_bytes(data)
    (harness / "__pycache__" / f"clock.{tag}.pyc").unlink()  # deleting bytecode is harmless
    found = integrity.changes(before, integrity.take_snapshot(harness, embedded_dataset.path, pycache_prefixes=[prefix]))
    assert sorted(found) == [f"harness bytecode {prefix}:metric.{tag}.pyc added",
                             f"harness bytecode __pycache__/metric.{tag}.pyc modified"]
    assert integrity.bytecode_problems(harness) == [f"harness bytecode __pycache__/metric.{tag}.pyc does not match metric.py"]
    assert "delete the named files" in integrity.describe_pause(found, "t")


def test_large_splits_are_watched_by_size_and_mtime(tmp_path, embedded_dataset, monkeypatch):
    data = tmp_path / "data"
    shutil.copytree(embedded_dataset.path, data)
    monkeypatch.setattr(integrity, "FULL_HASH_MAX_BYTES", 2 * 2**20)  # train.bin (19 MB) is now "large"
    before = integrity.data_signature(data)
    assert before["train"].startswith("stat:") and not before["val"].startswith("stat:")
    with open(data / "train.bin", "ab") as handle:
        handle.write(b"\x00\x00")
    assert integrity.data_signature(data)["train"] != before["train"]


# ---------------------------------------------------------------------------------------
# overfitting watch
# ---------------------------------------------------------------------------------------


def _kept(*pairs):
    return [{"number": i + 1, "metric": val, "heldout_metric": held} for i, (val, held) in enumerate(pairs)]


def test_overfitting_flag_needs_three_keeps_without_heldout_progress():
    healthy = _kept((1.00, 1.10), (0.98, 1.08), (0.97, 1.07), (0.96, 1.06))
    assert overfitting_signal(healthy) is None
    stalled = _kept((1.00, 1.10), (0.98, 1.08), (0.97, 1.09), (0.96, 1.08), (0.95, 1.12))
    signal = overfitting_signal(stalled)
    assert signal["trials"] == [3, 4, 5] and signal["heldout_best_before"] == 1.08
    assert "improved val_bpb 0.980000 -> 0.950000" in signal["message"]
    assert overfitting_signal(stalled[:4]) is None  # two flat keeps are not enough
    one_better = _kept((1.00, 1.10), (0.98, 1.08), (0.97, 1.09), (0.96, 1.07), (0.95, 1.12))
    assert overfitting_signal(one_better) is None
    # Unverified keeps (no held-out value) are left out of the chain.
    assert overfitting_signal(_kept((1.0, None), (0.9, None), (0.8, None), (0.7, None))) is None


def test_overfitting_is_flagged_once_and_shown_in_status(tmp_path):
    store = Store(tmp_path / "experiments.db")
    run = store.create_run(TAG, branch=f"autoloop/{TAG}")
    pairs = [(1.00, 1.10), (0.98, 1.08), (0.97, 1.09), (0.96, 1.08), (0.95, 1.12), (0.94, 1.13)]
    flagged = []
    for val, held in pairs:
        trial = store.new_trial(run["id"], Kind.PROPOSAL, metric=val, heldout_metric=held, metric_source="verified")
        store.update_trial(trial["id"], status=Status.KEEP)
        flagged.append(watch(store.trials(run["id"], status=Status.KEEP)) is not None)
    assert flagged == [False, False, False, False, True, False]  # raised once, not again while it stays up
    info = run_status(store, store.get_run(TAG), tmp_path)
    assert info["overfitting"].startswith("overfitting watch: the last 3 keeps (trials 4, 5, 6)")
    assert info["best_metric_source"] == "verified"
    assert "overfitting watch" in format_status(info)
    store.close()


# ---------------------------------------------------------------------------------------
# scripts that cannot be verified (the fake script: instant)
# ---------------------------------------------------------------------------------------


def test_reported_only_script_runs_and_is_shown_unverified(tmp_path):
    source = FAKE_TRAIN.read_text().replace('MODE = "ok"', 'MODE = "reported"')
    repo = make_repo(tmp_path / "repo", source)
    summary = Controller(Config(tag=TAG, max_trials=1, time_budget=30, proposers=["ideas"]), repo).run()
    assert summary.kept == 1
    store = Store(repo / "experiments.db")
    run = store.get_run(TAG)
    (trial,) = store.trials(run["id"])
    assert trial["status"] == "keep" and trial["metric_source"] == "reported"
    assert trial["heldout_metric"] is None and trial["verify_seconds"] is None
    log = format_log(run, log_rows(store, run))
    assert "*" in log and "unverified" in log
    assert "unverified (reported)" in format_status(run_status(store, run, repo))
    store.close()


def test_result_json_without_checkpoint_is_invalid_not_trusted(tmp_path):
    repo = make_repo(tmp_path / "repo", FAKE_TRAIN.read_text())  # writes a result JSON, saves no model
    summary = Controller(Config(tag=TAG, max_trials=1, time_budget=30, proposers=["ideas"]), repo).run()
    assert summary.kept == 0
    store = Store(repo / "experiments.db")
    (trial,) = store.trials(store.get_run(TAG)["id"])
    assert trial["status"] == "invalid" and "no checkpoint" in trial["reason"]
    store.close()


# ---------------------------------------------------------------------------------------
# end to end with the real train.py
# ---------------------------------------------------------------------------------------

def train_source() -> str:
    """The repository's train.py as it is: its CPU scale (2 layers of width 64, 2048 tokens a
    step) is small enough for a 40-step trial in seconds."""
    return (REPO_ROOT / "train.py").read_text()


def edited(source: str, old: str, new: str) -> str:
    """`source` with `old` (which must occur exactly once) replaced: a proposal's edit."""
    assert source.count(old) == 1, f"train.py no longer contains {old!r} exactly once"
    return source.replace(old, new)


def _contract_env(mp, cache: Path) -> None:
    mp.setenv("AUTOLOOP_CACHE_DIR", str(cache))
    mp.setenv("AUTOLOOP_COMPILE_CACHE", str(cache / "compile"))
    for name in ("AUTOLOOP_TIME_BUDGET", "AUTOLOOP_MAX_STEPS", "AUTOLOOP_SEED", "AUTOLOOP_RESULT",
                 "AUTOLOOP_CHECKPOINT", "AUTOLOOP_PROGRESS", "AUTOLOOP_DATA_DIR", "AUTOLOOP_FAULT"):
        mp.delenv(name, raising=False)
    # One thread per process: on a shared two-core machine two threads per process make
    # each step several times slower; results are the same within 1e-6.
    mp.setenv("OMP_NUM_THREADS", "1")


def _config(**overrides) -> Config:
    # One run per trial (the strict rule, no drift checks): these cases test what is
    # verified, not how many runs a decision takes (tests/test_decision_loop.py does). The
    # baseline at two seeds, the least that measures the noise the held-out guard needs.
    return Config(**{"tag": TAG, "max_steps": STEPS, "time_budget": 60, "grace_seconds": 300, "max_trials": 1,
                     "proposers": ["ideas"], "decision_rule": "strict", "baseline_seeds": 2, "drift_every": 0,
                     **overrides})


class OneProposal:
    """A proposer that offers one proposal, then nothing (a real Proposer)."""

    name = "test"

    def __init__(self, proposal: Proposal):
        self.proposal = proposal

    def propose(self, ctx):
        proposal, self.proposal = self.proposal, None
        return proposal


def run_proposal(repo: Path, description: str, new_source: str, verifier="default", **config) -> dict:
    chain = ProposerChain([OneProposal(Proposal(description, [Edit(path="train.py", content=new_source)]))])
    kwargs = {} if verifier == "default" else {"verifier": verifier}
    summary = Controller(_config(**config), repo, chain=chain, **kwargs).run()
    store = Store(repo / "experiments.db")
    try:
        trials = store.trials(store.get_run(TAG)["id"])
        return {"summary": summary, "trial": trials[-1], "baseline": trials[0], "run": store.get_run(TAG)}
    finally:
        store.close()


@pytest.fixture(scope="module")
def baseline_repo(tmp_path_factory, session_cache):
    with pytest.MonkeyPatch.context() as mp:
        _contract_env(mp, session_cache)
        repo = make_repo(tmp_path_factory.mktemp("verify") / "repo", train_source())
        summary = Controller(_config(), repo).run()
        assert summary.kept == 1, summary
    return repo


@pytest.fixture
def repo(baseline_repo, tmp_path, session_cache, monkeypatch) -> Path:
    """A copy of the repository with its verified baseline: git, db and trial folders."""
    _contract_env(monkeypatch, session_cache)
    return copy_run(baseline_repo, tmp_path / "repo")


def _branch_tip(repo: Path) -> str:
    from autoloop.gitops import GitRepo

    return GitRepo.open(repo).branch_commit(f"autoloop/{TAG}")


@pytest.mark.slow
def test_baseline_is_verified_with_heldout_and_timing(baseline_repo):
    store = Store(baseline_repo / "experiments.db")
    run_row = store.get_run(TAG)
    (base,) = store.trials(run_row["id"])
    base_runs = [m for m in store.measurements(base["id"]) if m["role"] == "baseline"]
    store.close()
    assert base["kind"] == "baseline" and base["status"] == "keep" and base["metric_source"] == "verified"
    # Under the controller training never sees val: the number is the harness's alone.
    assert base["result"]["val_bpb"] is None and 0.5 < base["metric"] < 8
    assert 0.5 < base["heldout_metric"] < 8 and base["verify_seconds"] > 0
    # Strict decides on one run, but with verification its baseline runs at two seeds (and
    # each is verified), so the held-out guard has a measured noise, never a missing one
    # taken as zero (it refused honest gains: docs/decisions.md, "A real CPU night").
    assert base["n_runs"] == 2 and len(base_runs) == 2 and all(m["verified"] for m in base_runs), base_runs
    assert run_row["noise_pair_sd"] is not None and run_row["noise_pair_sd"] > 0
    run = baseline_repo / ".autoloop" / TAG / "trials" / "1" / "runs" / "1"
    assert any((run / "verify").glob("*.json")) and (run / "source" / "train.py").exists()


@pytest.mark.slow
def test_non_causal_attention_is_rejected_though_far_better(repo):
    source = (repo / "train.py").read_text()
    leaky = edited(source, MODEL_ATTENTION, MODEL_ATTENTION.replace("True", "False"))
    out = run_proposal(repo, "full attention (sees the future)", leaky)
    trial, base = out["trial"], out["baseline"]
    # The scorer's number for it is far better (its verdict says so) ...
    (verdict,) = (repo / ".autoloop" / TAG / "trials" / str(trial["number"])).rglob("verdict.json")
    assert json.loads(verdict.read_text())["val_bpb"] < base["metric"] - 0.1
    # ... and it is never kept, nor recorded as a metric anywhere a decision or a brief reads it.
    assert trial["status"] == "invalid" and "leaks future tokens" in trial["reason"] and trial["metric"] is None
    assert trial["metric_source"] is None  # the scorer's probes caught it at its first evaluation
    assert out["run"]["best_commit"] == base["trial_commit"] == _branch_tip(repo)
    assert not list((repo / ".autoloop" / TAG / "trials" / str(trial["number"])).rglob("checkpoint.pt"))


@pytest.mark.slow
def test_verifier_reads_train_py_from_the_commit_not_the_worktree(repo):
    source = (repo / "train.py").read_text()
    leaky = edited(source, MODEL_ATTENTION, MODEL_ATTENTION.replace("True", "False"))
    covered = edited(leaky, "    H.finish(spec, result)\n",
                     "    H.finish(spec, result)\n"
                     "    # cover the tracks: leave a causal train.py in the working tree (if it may)\n"
                     "    try:\n"
                     "        text = open(__file__).read()\n"
                     "        open(__file__, 'w').write(text.replace('is_causal=' + 'False', 'is_causal=' + 'True'))\n"
                     "    except OSError:\n"
                     "        pass\n")
    trial = run_proposal(repo, "full attention, tracks covered", covered)["trial"]
    assert trial["status"] == "invalid" and "leaks future tokens" in trial["reason"]
    (snapshot,) = (repo / ".autoloop" / TAG / "trials" / str(trial["number"])).rglob("source/train.py")
    assert "is_causal=False" in snapshot.read_text()


@pytest.mark.slow
def test_honest_better_learning_rate_is_verified_and_kept(repo, embedded_dataset):
    from autoloop.harness.metric import evaluation_windows
    from autoloop.proposers.seeding import seed_idea

    config = _config(probe_factor=1)
    # At 40 steps of the CPU scale the lm_head's rate x4 gains about 0.09 bpb at seed 1337 and
    # 0.05 at 1338: more than the two baseline seeds differ (0.06), so the kept figure is also
    # below the baseline's mean.
    seed_idea(config, repo, "quadruple the lm_head learning rate", sets=["UNEMBEDDING_LR=0.016"], patch=None)
    summary = Controller(config, repo).run()
    store = Store(repo / "experiments.db")
    run = store.get_run(TAG)
    base, trial = store.trials(run["id"])
    reserve = [m for m in store.measurements(trial["id"]) if m["role"] == "reserve"]
    probes = [e["message"] for e in store.events(run["id"], kind="probes")]
    store.close()
    # The keep's probes with power, capped by the run's probe-factor: 1 x the scored windows
    # of val and held-out, and the default probes (16 x, the default, would be 16 times more).
    windows = sum(len(evaluation_windows(embedded_dataset.split(s), "cpu")) for s in ("val", "heldout"))
    tested = [int(re.search(r"probes tested (\d+) positions", m).group(1)) for m in probes]
    assert len(tested) == 1 and windows <= tested[0] < windows + 32, (probes, windows)
    assert summary.kept == 2 and trial["status"] == "keep", trial["reason"]
    assert trial["metric_source"] == "verified" and trial["metric"] < base["metric"]
    assert trial["result"]["val_bpb"] is None
    assert trial["heldout_metric"] is not None and trial["verify_seconds"] > 0
    # The night ended by its limit, so its best was re-measured at fresh seeds, verified:
    # each reserve run's held-out bpb is recorded, and so the headline has one.
    assert len(reserve) == 2 and all(m["verified"] == 1 and m["heldout_metric"] is not None for m in reserve), reserve
    assert summary.headline["heldout"] == pytest.approx(sum(m["heldout_metric"] for m in reserve) / 2)
    assert run["best_commit"] == trial["trial_commit"] == _branch_tip(repo)
    assert "UNEMBEDDING_LR = 0.016" in (repo / "train.py").read_text()

