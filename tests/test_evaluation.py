"""Evaluation outside training: the sealed worker, the bytecode defence, the figure rules.

* known-answer tests of the rules (held-out guard, identical val/held-out, the seal);
* the worker (python -m autoloop.harness.evaluate, run by evaluation.evaluate_checkpoint
  through the runner) on a REAL checkpoint: the repository's train.py at its CPU scale
  (as in tests/test_verify.py), trained a few steps in step mode in tmp_path once per
  module; each attack is a copy of that train.py with the attack added, as a proposal
  would write it;
* the poisoned-.pyc attack against a copy of the autoloop package in tmp_path, so the
  installed harness is never touched.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, needs_bwrap
from test_verify import edited, train_source

from autoloop.trust import integrity
from autoloop.decide.heldout import HELDOUT_Z, heldout_guard, heldout_threshold, suspicious_identity
from autoloop.trust.bytecode import pycache_dir, pycache_env
from autoloop.measure.evaluation import evaluate_checkpoint
from autoloop.measure.judge import judge
from autoloop.measure.runner import run_training

STEPS = 4
SEED = 1


# ---------------------------------------------------------------------------------------
# rules with known answers
# ---------------------------------------------------------------------------------------


def test_heldout_guard_passes_honest_and_refuses_val_fitting():
    # Honest: both splits improve by about the same; the gap (0.005) is noise.
    assert heldout_guard(-0.050, -0.045, pair_sd=0.01, n=3) is None
    # Held-out improving a little more than val: noise and the splits' difference.
    assert heldout_guard(-0.050, -0.055, pair_sd=0.01, n=3) is None
    # The attack: val 3.95 -> 3.38 (-0.57) while held-out got worse (+0.10).
    reason = heldout_guard(-0.57, 0.10, pair_sd=0.01, n=3)
    assert reason is not None
    assert reason.startswith("held-out bpb got worse by 0.1000 while val bpb improved by 0.5700: a gap of 0.6700 bpb")
    assert "0.0733 the noise and the splits' difference explain" in reason  # 2 x sqrt(2/3) x 0.01 + 0.1 x 0.57
    # No held-out figure: nothing to guard.
    assert heldout_guard(-0.57, None, pair_sd=0.01, n=3) is None


def test_heldout_guard_refuses_a_candidate_that_gains_more_on_heldout_than_on_val():
    """Issue 31's attack: trained on 65% rebuilt held-out text, val -0.12 and held-out -0.27
    (a gap of -0.15) at the night's noise (paired SD 0.001): refused, and the reason says why."""
    reason = heldout_guard(-0.12, -0.27, pair_sd=0.001, n=1)
    assert reason is not None and reason.startswith("gains more on held-out than on val: trained on held-out text?")
    assert "held-out bpb improved by 0.2700 while val bpb improved by 0.1200: a gap of 0.1500 bpb" in reason
    # The allowance on this side: 2 x sqrt(2) x 0.001 + 0.1 x the larger gain (0.27) = 0.0298.
    assert "more than the 0.0298 the noise" in reason
    # Just inside and just outside the boundary, on the held-out side.
    limit = heldout_threshold(0.01, 2) + 0.1 * 0.2
    assert heldout_guard(-0.2 + limit * 0.99, -0.2, 0.01, 2) is None
    assert heldout_guard(-0.2 + limit * 1.01, -0.2, 0.01, 2) is not None
    # The old guard's blind spot: held-out gained 0.06 more than val at one seed and paired SD 0.01.
    assert heldout_guard(-0.02, -0.08, pair_sd=0.01, n=1) is not None


def test_heldout_threshold_is_two_standard_errors_of_the_gap():
    assert heldout_threshold(0.01, 2) == pytest.approx(HELDOUT_Z * 0.01)  # sqrt(2/2) = 1
    assert heldout_threshold(0.02, 8) == pytest.approx(HELDOUT_Z * 0.02 * 0.5)
    # Just inside and just outside the boundary.
    # The guard allows that plus a tenth of the val gain (val and held-out are different text).
    limit = heldout_threshold(0.01, 2) + 0.1 * 0.1
    assert heldout_guard(-0.1, -0.1 + limit * 0.99, 0.01, 2) is None
    assert heldout_guard(-0.1, -0.1 + limit * 1.01, 0.01, 2) is not None
    # No noise estimate: the floor (1e-3) and the share of the gain.
    assert heldout_threshold(None, 3) == pytest.approx(1e-3)
    assert heldout_guard(-0.05, -0.0455, None, 3) is None and heldout_guard(-0.05, -0.04, None, 3) is not None
    # Measured on the CPU: a 0.305 bpb LR fix gained 0.287 on held-out, with no noise estimate (strict rule).
    assert heldout_guard(-0.3050, -0.2869, None, 1) is None


def test_heldout_guard_needs_a_measured_noise_for_an_honest_gain_at_one_seed():
    """The real CPU night of docs/decisions.md: TOTAL_BATCH_TOKENS x2 gained 0.232 bpb on
    val at one seed, and an honest change's held-out gain at one seed differs from its val
    gain by 0.01-0.05 bpb. With no noise measured (strict's single baseline run, before
    verification gave every rule `baseline_seeds`) the guard allows only its floor and a
    tenth of the gain, and refused it; with the noise that night measured (paired SD 0.019)
    it passes: allowed 2 x sqrt(2) x 0.019 + 0.0232 = 0.0769 > the gap 0.042."""
    refused = heldout_guard(-0.232, -0.190, None, 1)
    assert refused is not None and "paired SD unknown" in refused
    assert heldout_threshold(0.019, 1) + 0.1 * 0.232 == pytest.approx(0.07694, abs=1e-5)
    assert heldout_guard(-0.232, -0.190, 0.019, 1) is None
    # A change that fits val at held-out's expense is refused at that same noise.
    assert heldout_guard(-0.232, 0.02, 0.019, 1) is not None


def test_heldout_guard_refuses_few_honest_candidates():
    """Honest candidates whose val and held-out deltas are independent draws around the
    same true effect (the least favourable case: correlation only lowers the rate) are
    refused at the two-sided normal tail beyond 2 SD: 2 x 2.28% = 4.55%. The true effect is a small
    loss, so no val gain adds its share to the allowance and the noise term alone is
    measured (with a gain the rate is lower still)."""
    rng = random.Random(12)
    pair_sd, n, trials = 0.01, 3, 20000
    se = pair_sd / math.sqrt(n)
    refused = sum(
        heldout_guard(0.05 + rng.gauss(0, se), 0.05 + rng.gauss(0, se), pair_sd, n) is not None for _ in range(trials)
    )
    expected = math.erfc(HELDOUT_Z / math.sqrt(2))  # P(|Z| > 2) = 0.0455
    assert expected == pytest.approx(0.0455, abs=1e-4)
    assert abs(refused / trials - expected) < 4 * math.sqrt(expected * (1 - expected) / trials), refused / trials


@pytest.mark.parametrize("df", [2, 6])
def test_heldout_guard_with_an_estimated_noise_refuses_at_the_t_tail(df):
    """The 4.55% above is for a known noise. The loop's noise is estimated: at the start of
    a night from the baseline's three runs (2 degrees of freedom). Under the same least
    favourable model the guard then refuses an honest candidate when |Z| > 2 s_hat / sigma,
    that is when a t with df degrees of freedom exceeds 2 in size: at 2 df
    P = 2 (1/2 - 1/sqrt(6)) = 18.4%, at 6 df 9.2%. (The two deltas are correlated in practice, same model and seeds,
    which lowers both rates.)"""
    from autoloop.decide.rule import t_cdf

    rng = random.Random(13 + df)
    pair_sd, n, trials = 0.01, 3, 20000
    se = pair_sd / math.sqrt(n)
    refused = 0
    for _ in range(trials):
        estimated = pair_sd * math.sqrt(sum(rng.gauss(0, 1) ** 2 for _ in range(df)) / df)  # chi2 with df
        refused += heldout_guard(0.05 + rng.gauss(0, se), 0.05 + rng.gauss(0, se), estimated, n) is not None
    expected = 2 * (1 - t_cdf(2.0, df))
    if df == 2:
        assert expected == pytest.approx(1 - 2 / math.sqrt(6))
    assert abs(refused / trials - expected) < 4 * math.sqrt(expected * (1 - expected) / trials), refused / trials


def test_suspicious_identity_at_nine_digits():
    assert suspicious_identity(1.2345, 1.2345).startswith("val_bpb and held-out bpb are identical to 9 digits (1.2345)")
    assert suspicious_identity(2.123456789, 2.1234567891) is not None  # same to 9 significant digits
    assert suspicious_identity(2.12345678, 2.12345679) is None  # differ in the 9th
    assert suspicious_identity(2.5, None) is None and suspicious_identity(None, None) is None
    assert suspicious_identity(float("nan"), float("nan")) is None


def test_pycache_env_separates_training_and_evaluation(tmp_path):
    train, evaluation = pycache_env("train", tmp_path), pycache_env("eval", tmp_path)
    assert train["PYTHONPYCACHEPREFIX"] != evaluation["PYTHONPYCACHEPREFIX"]
    assert evaluation["PYTHONPYCACHEPREFIX"] == str(pycache_dir("eval", tmp_path))
    assert evaluation["PYTHONDONTWRITEBYTECODE"] == "1"  # the evaluator runs trial code: it writes none
    assert train["PYTHONDONTWRITEBYTECODE"] == "1"  # read-only: only the trusted warm-up writes it
    with pytest.raises(ValueError):
        pycache_env("other", tmp_path)


def test_external_eval_outcome_is_ok_without_a_metric(tmp_path):
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"val_bpb": None, "num_steps": 3}))
    ok = judge("---\nval_bpb: null\n", stopped=None, returncode=0, result_path=result, deadline_seconds=10,
                external_eval=True)
    assert ok.status == "ok" and ok.metric is None and ok.metric_source == "harness"
    # The trial's own number is never the metric under external evaluation.
    result.write_text(json.dumps({"val_bpb": 0.5}))
    claimed = judge("", stopped=None, returncode=0, result_path=result, deadline_seconds=10, external_eval=True)
    assert claimed.status == "ok" and claimed.metric is None and claimed.result["val_bpb"] == 0.5
    # Without the env, the same JSON is a crash as before; a crash stays a crash.
    result.write_text(json.dumps({"val_bpb": None}))
    assert judge("", stopped=None, returncode=0, result_path=result, deadline_seconds=10).status == "crash"
    assert judge("", stopped=None, returncode=1, result_path=result, deadline_seconds=10,
                  external_eval=True).status == "crash"


def test_runspec_reads_the_eval_mode(monkeypatch):
    from autoloop.harness import HarnessError, RunSpec

    monkeypatch.delenv("AUTOLOOP_EVAL", raising=False)
    assert RunSpec.from_env().external_eval is False
    monkeypatch.setenv("AUTOLOOP_EVAL", "external")
    assert RunSpec.from_env().external_eval is True
    monkeypatch.setenv("AUTOLOOP_EVAL", "sometimes")
    with pytest.raises(HarnessError, match="AUTOLOOP_EVAL='sometimes' is not one of internal, external"):
        RunSpec.from_env()


# ---------------------------------------------------------------------------------------
# the split evaluation on a real checkpoint
# ---------------------------------------------------------------------------------------


def _train(folder: Path, source: str, data_dir: Path, *, external: bool = False):
    """Train `source` (a train.py) STEPS steps in step mode through the runner; its outputs in folder/out."""
    (folder / "out").mkdir(parents=True, exist_ok=True)
    (folder / "train.py").write_text(source)
    env = {"AUTOLOOP_MAX_STEPS": STEPS, "AUTOLOOP_SEED": SEED, "AUTOLOOP_RESULT": folder / "out" / "result.json",
           "AUTOLOOP_CHECKPOINT": folder / "out" / "checkpoint.pt", "AUTOLOOP_DATA_DIR": data_dir,
           "OMP_NUM_THREADS": 1, "AUTOLOOP_EVAL": "external" if external else None}
    outcome = run_training([sys.executable, "train.py"], cwd=folder, env=env, log_path=folder / "train.log",
                           deadline_seconds=300)
    return outcome


@pytest.fixture(scope="module")
def trained(tmp_path_factory, embedded_dataset):
    """The real train.py (tiny CPU scale), trained with in-process evaluation: checkpoint + val_bpb."""
    folder = tmp_path_factory.mktemp("trained")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("AUTOLOOP_EVAL", raising=False)
        outcome = _train(folder / "run", train_source(), embedded_dataset.path)
    assert outcome.status == "ok", outcome.reason
    return {"folder": folder / "run", "outcome": outcome, "val_bpb": outcome.metric,
            "data_dir": embedded_dataset.path, "cache": folder / "cache"}


@pytest.fixture(scope="module")
def fresh(tmp_path_factory, embedded_dataset):
    """A checkpoint of the real (tiny) train.py's freshly initialised model, and its val_bpb
    evaluated here, in-process, as train.py evaluates: seconds instead of a training run."""
    from autoloop import harness as H

    folder = tmp_path_factory.mktemp("fresh")
    (folder / "train.py").write_text(train_source())
    module = H.import_train_module(folder / "train.py")
    config = module.model_config(vocab_size=embedded_dataset.vocab_size, seq_len=H.seq_len("cpu"))
    model = module.build_model(config, device="cpu")
    H.save_checkpoint(folder / "out" / "checkpoint.pt", model, config)
    val = H.evaluate_bpb(model, embedded_dataset, "val", device="cpu", batch_size=16)
    return {"folder": folder, "val_bpb": val, "data_dir": embedded_dataset.path, "cache": folder / "cache"}


def _evaluate(trained, tmp_path, source: str | None = None, **kwargs):
    """evaluate_checkpoint on the trained checkpoint with `source` as the trial's train.py."""
    from autoloop.trust.bytecode import warm_pycache

    source_dir = tmp_path / "source"
    source_dir.mkdir(parents=True, exist_ok=True)
    (source_dir / "train.py").write_text(source if source is not None else train_source())
    warm_pycache("eval", sys.executable, trained["cache"])
    options = {"splits": ("val",), "hidden": [tmp_path / ".git", tmp_path / ".autoloop"], **kwargs}
    return evaluate_checkpoint(
        python=sys.executable, project_dir=tmp_path, source_dir=source_dir, script="train.py",
        checkpoint_base=trained["folder"], checkpoint="out/checkpoint.pt", data_dir=trained["data_dir"],
        device="cpu", out_dir=tmp_path / "out", deadline_seconds=300, env={"OMP_NUM_THREADS": 1},
        pycache=pycache_env("eval", trained["cache"]), **options,
    )


class RecordingSandbox:
    """A real sandbox policy of kind "none" (argv unchanged) that records what it was asked."""

    kind = "none"

    def __init__(self):
        self.calls = []

    def wrap(self, argv, *, env, cwd, writable, readonly, hidden):
        self.calls.append({"argv": list(argv), "env": dict(env), "cwd": cwd, "writable": list(writable),
                           "readonly": list(readonly), "hidden": list(hidden)})
        return argv, env


def test_split_evaluation_gives_exactly_the_in_process_val_bpb(fresh, tmp_path):
    sandbox = RecordingSandbox()
    result = _evaluate(fresh, tmp_path, sandbox=sandbox)
    assert result.ok and result.status == "ok", result.reason
    # The same batches and the same float32 outputs; the scorer's arithmetic is numpy's on a
    # CPU (its process never imports torch), so the sums agree to rounding: 1e-6 bpb, the
    # determinism re-check's tolerance for a script's own figure (measure.measurer).
    assert result.fields["arithmetic"] == "numpy"
    assert result.val_bpb == pytest.approx(fresh["val_bpb"], abs=1e-6)
    assert result.causality["ok"] and result.causality["probes"] >= 16
    model, scorer = sandbox.calls
    assert "autoloop.harness.model_server" in model["argv"] and "autoloop.harness.evaluate" in scorer["argv"]
    assert model["argv"][:2] != ["bwrap"]
    # Nothing is writable to either; the model process sees no data, the scorer runs from our folder.
    assert model["writable"] == [] and scorer["writable"] == []
    assert fresh["data_dir"] in model["hidden"] and fresh["data_dir"] in scorer["readonly"]
    assert tmp_path / ".git" in model["hidden"] and tmp_path / ".autoloop" in scorer["hidden"]
    assert scorer["cwd"] == tmp_path / "out" and model["cwd"] == tmp_path / "source"
    assert pycache_dir("eval", fresh["cache"]) in model["readonly"]
    for call in (model, scorer):
        assert call["env"]["PYTHONDONTWRITEBYTECODE"] == "1" and "AUTOLOOP_DATA_DIR" not in call["env"]
        first = Path(call["env"]["PYTHONPATH"].split(os.pathsep)[0])  # autoloop's own import root, nothing else
        assert first.parent.name == "pylib" and sorted(p.name for p in first.iterdir()) == ["autoloop"]
    verdict = json.loads((tmp_path / "out" / "verdict.json").read_text())
    assert verdict["ok"] and verdict["causality"]["schedule_seed"] is not None
    assert "[model]" in (tmp_path / "out" / "eval.log").read_text() or "[scorer]" in (tmp_path / "out" / "eval.log").read_text()


@pytest.mark.slow
def test_split_evaluation_of_a_trained_checkpoint_with_held_out(trained, tmp_path):
    result = _evaluate(trained, tmp_path, splits=("val", "heldout"))
    assert result.ok and result.status == "ok", result.reason
    assert result.val_bpb == pytest.approx(trained["val_bpb"], abs=1e-6)
    assert result.heldout_bpb is not None and abs(result.heldout_bpb - result.val_bpb) > 1e-4
    assert result.causality["ok"] is True
    assert set(result.fields["seconds"]) >= {"startup", "load", "ready", "score", "total"}
    assert result.seconds > 0


# The end of train.py's build_model, where an attack wraps the model it returns.
PEEK = ("    return model\n\n\n", """\
    forward = model.forward

    def peek(idx, targets=None):
        logits = forward(idx, targets)
        if targets is not None or CONDITION:
            return logits
        out = logits.clone()
        for b in range(idx.size(0)):
            out[b, torch.arange(idx.size(1) - 1), idx[b, 1:]] += 30.0
        return out
    model.forward = peek
    return model


""")


@pytest.mark.parametrize("condition", ["False", "any('causal' in f.function for f in __import__('inspect').stack())"],
                         ids=["always", "unless-checked"])
def test_a_model_that_looks_at_the_next_token_is_caught_by_the_probes(fresh, tmp_path, condition):
    attack = edited(train_source(), PEEK[0], PEEK[1].replace("CONDITION", condition))
    result = _evaluate(fresh, tmp_path, attack)
    assert not result.ok and result.status == "failed"
    assert result.reason.startswith("leaks future tokens"), result.reason
    assert result.fields["stage"] == "causality" and result.val_bpb < 0.2  # what it would have scored


def test_bf16_outputs_travel_as_bf16_and_score_as_their_float32_values(fresh, tmp_path):
    """A GPU's autocast makes bf16 logits: they cross the region as bf16 (half the bytes of
    float32) and score exactly as the same values sent as float32."""
    scores = {}
    for name, cast in (("bf16", "logits.to(torch.bfloat16)"), ("float32", "logits.to(torch.bfloat16).float()")):
        source = edited(train_source(), PEEK[0], f"""\
    forward = model.forward

    def rounded(idx, targets=None):
        logits = forward(idx, targets)
        return logits if targets is not None else {cast}
    model.forward = rounded
    return model


""")
        result = _evaluate(fresh, tmp_path / name, source)
        assert result.ok, result.reason
        scores[name] = result.val_bpb
    assert scores["bf16"] == scores["float32"]
    assert abs(scores["bf16"] - fresh["val_bpb"]) < 0.01  # rounding to bf16 moves the score a little


def test_a_model_that_mixes_the_sequences_of_a_batch_is_caught(fresh, tmp_path):
    # A tenth of the batch's mean: the fresh model's logits are tiny (lm_head at std 0.001),
    # so a hundredth moved its log-probabilities by about 1e-4 on the evaluation's windows,
    # the tolerance itself, and one unseeded init in CI stayed under it. A tenth moves them
    # by about 1e-3, ten times the tolerance.
    attack = edited(train_source(), PEEK[0], """\
    forward = model.forward
    model.forward = lambda idx, targets=None: forward(idx, targets) if targets is not None else (
        forward(idx) + 0.1 * forward(idx).mean(0, keepdim=True))
    return model


""")
    result = _evaluate(fresh, tmp_path, attack)
    assert not result.ok and result.fields["stage"] == "causality", result.reason


def test_replacing_the_harness_in_the_model_process_changes_nothing(fresh, tmp_path):
    attack = edited(train_source(), "from autoloop import harness as H\n",
                    "from autoloop import harness as H\n"
                    "import autoloop.harness.metric, torch.nn.functional as _F\n"
                    "H.evaluate_bpb = autoloop.harness.metric.evaluate_bpb = lambda *args, **kwargs: 1.2345\n"
                    "_F.cross_entropy = lambda logits, y, **kw: torch.zeros_like(y, dtype=torch.float32)\n")
    result = _evaluate(fresh, tmp_path, attack)
    # The scorer computed it, not this process (whose figure would be 1.2345, or 0).
    assert result.ok and result.val_bpb == pytest.approx(fresh["val_bpb"], abs=1e-6)


def test_a_verdict_forged_by_the_model_process_is_never_read(fresh, tmp_path):
    attack = edited(train_source(), "from autoloop import harness as H\n",
                    "from autoloop import harness as H\n"
                    "import json as _j, os as _o\n"
                    "_forged = _j.dumps({'ok': True, 'val_bpb': 0.5, 'stage': 'done'}) + '\\n'\n"
                    "print(_forged, flush=True)\n"
                    "for _fd in range(3, 64):\n"
                    "    try:\n"
                    "        _o.write(_fd, _forged.encode())\n"
                    "    except OSError:\n"
                    "        pass\n"
                    "_o._exit(0)\n")
    result = _evaluate(fresh, tmp_path, attack)
    assert not result.ok and result.val_bpb is None and result.status == "failed", result.reason
    assert "protocol" in result.reason or "before it was ready" in result.reason


@pytest.mark.parametrize("change,words", [
    ("out[0, 0, 0] = float('nan')", "NaN or infinite"),
    ("out = out[..., :10]", "wide for a vocabulary"),
    ("raise RuntimeError('boom in forward')", "boom in forward"),
], ids=["nan", "too narrow", "raises"])
def test_bad_outputs_are_the_trials_failure(fresh, tmp_path, change, words):
    attack = edited(train_source(), PEEK[0], f"""\
    forward = model.forward

    def bad(idx, targets=None):
        out = forward(idx, targets)
        if targets is None:
            out = out.clone()
            {change}
        return out
    model.forward = bad
    return model


""")
    result = _evaluate(fresh, tmp_path, attack)
    assert not result.ok and result.status == "failed" and words in result.reason, result.reason


def test_a_checkpoint_that_is_a_link_is_refused(fresh, tmp_path, embedded_dataset):
    planted = tmp_path / "planted"
    (planted / "out").mkdir(parents=True)
    (planted / "out" / "checkpoint.pt").symlink_to(embedded_dataset.path / "heldout.bin")
    result = _evaluate({**fresh, "folder": planted}, tmp_path)
    assert not result.ok and "cannot be read safely" in result.reason and "symbolic link" in result.reason


@needs_bwrap
def test_the_sandboxed_model_process_sees_no_data_and_writes_nothing_that_stays(fresh, tmp_path):
    from autoloop.measure.sandbox import detect

    attack = edited(train_source(), "from autoloop import harness as H\n",
                    "from autoloop import harness as H\n"
                    "import glob as _g, os as _o\n"
                    f"_found = _g.glob({str(fresh['data_dir'])!r} + '/*.bin') + _g.glob(_o.path.expanduser('~/.cache/*'))\n"
                    "print('DATA FILES SEEN:', _found, flush=True)\n"
                    f"for _where in ({str(tmp_path)!r}, {str(fresh['folder'])!r}, {str(tmp_path / 'source')!r}):\n"
                    "    try:\n"
                    "        open(_where + '/left-behind', 'w').write('x')\n"
                    "        print('WROTE', _where, flush=True)\n"
                    "    except OSError as _e:\n"
                    "        print('cannot write', _where, _e, flush=True)\n")
    result = _evaluate(fresh, tmp_path, attack, sandbox=detect("auto"))
    assert result.ok, result.reason
    log = (tmp_path / "out" / "eval.log").read_text()
    assert "DATA FILES SEEN: []" in log, log
    # Its /tmp is a private tmpfs that dies with it: what it wrote there is nowhere outside.
    assert not (tmp_path / "left-behind").exists() and not (fresh["folder"] / "left-behind").exists()
    # What it sees of ours (its source folder) is read-only.
    assert f"cannot write {tmp_path / 'source'}" in log and not (tmp_path / "source" / "left-behind").exists()


@pytest.mark.slow
def test_external_eval_train_py_writes_checkpoint_and_null_val_bpb(trained, tmp_path):
    outcome = _train(tmp_path / "run", train_source(), trained["data_dir"], external=True)
    assert outcome.status == "ok" and outcome.metric is None and outcome.metric_source == "harness"
    result = json.loads((tmp_path / "run" / "out" / "result.json").read_text())
    assert result["val_bpb"] is None and result["num_steps"] == STEPS
    log = (tmp_path / "run" / "train.log").read_text()
    assert "val_bpb: n/a (evaluated by the harness" in log and "val_bpb:" in log.split("---")[-1]
    # The same seed and steps: the separate evaluation gives the in-process number.
    evaluation = _evaluate({**trained, "folder": tmp_path / "run"}, tmp_path / "eval")
    assert evaluation.ok and evaluation.val_bpb == pytest.approx(trained["val_bpb"], abs=1e-5)


POISON_SCRIPT = r'''
"""A training run's attack: a poisoned harness .pyc with the real metric.py's mtime and size."""
import pathlib, py_compile, sys, tempfile

source = pathlib.Path(sys.argv[1])
text = source.read_text()
poisoned = text.replace("return total_nats / (math.log(2) * total_bytes)",
                        "return total_nats / (math.log(2) * total_bytes) - 1.0")
poisoned = poisoned.replace("    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction=\"none\")",
                            "    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction=\"none\") * 0.5")
assert poisoned != text
copy = pathlib.Path(tempfile.mkdtemp()) / "metric.py"
copy.write_text(poisoned)
target = source.parent / "__pycache__" / f"metric.{sys.implementation.cache_tag}.pyc"
target.parent.mkdir(exist_ok=True)
py_compile.compile(str(copy), cfile=str(target), doraise=True)
data = bytearray(target.read_bytes())
stat = source.stat()
data[8:12] = (int(stat.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
data[12:16] = (stat.st_size & 0xFFFFFFFF).to_bytes(4, "little")
target.write_bytes(bytes(data))
'''


@pytest.mark.slow
def test_poisoned_harness_pyc_is_named_and_never_read(trained, tmp_path, monkeypatch):
    site = tmp_path / "site"
    shutil.copytree(REPO_ROOT / "autoloop", site / "autoloop", ignore=shutil.ignore_patterns("__pycache__"))
    harness = site / "autoloop" / "harness"
    monkeypatch.setenv("PYTHONPATH", str(site))  # the attack, the worker and the warm-up import the copy
    prefixes = [pycache_dir(kind, trained["cache"]) for kind in ("train", "eval")]
    before = integrity.take_snapshot(harness, trained["data_dir"], pycache_prefixes=prefixes)

    (tmp_path / "attack.py").write_text(POISON_SCRIPT)
    outcome = run_training([sys.executable, "attack.py", str(harness / "metric.py")], cwd=tmp_path,
                           env=pycache_env("train", trained["cache"]), log_path=tmp_path / "attack.log",
                           deadline_seconds=120)
    assert outcome.returncode == 0, outcome.reason
    pyc = f"__pycache__/metric.{sys.implementation.cache_tag}.pyc"
    assert (harness / pyc).exists()

    # The snapshot around the training run names it; a run starting later refuses it.
    found = integrity.changes(before, integrity.take_snapshot(harness, trained["data_dir"], pycache_prefixes=prefixes))
    assert found == [f"harness bytecode {pyc} added"]
    assert integrity.bytecode_problems(harness) == [f"harness bytecode {pyc} does not match metric.py"]

    # The scorer (bytecode prefix) never reads it: the honest number.
    result = _evaluate(trained, tmp_path / "eval")
    assert result.ok, result.reason
    assert result.val_bpb == pytest.approx(trained["val_bpb"], abs=1e-6)

    # Control: without the prefix Python does read it, so the defence is what made the difference.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    env.update({"PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"})
    code = ("import sys, autoloop.harness as H; m = H.load_trained_model(sys.argv[1], sys.argv[2]); "
            "print(H.evaluate_bpb(m, H.load_dataset(sys.argv[3]), 'val', batch_size=16))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "eval" / "source" / "train.py"),
                           str(trained["folder"] / "out" / "checkpoint.pt"), str(trained["data_dir"])], env=env,
                          cwd=tmp_path, check=True, capture_output=True, text=True, timeout=300)
    assert float(done.stdout.split()[-1]) < trained["val_bpb"] - 0.5


def test_snapshot_names_an_added_pth_file(tmp_path, embedded_dataset):
    site_packages = tmp_path / "site-packages"
    site_packages.mkdir()
    (site_packages / "existing.pth").write_text("/some/path\n")
    harness = REPO_ROOT / "autoloop" / "harness"
    before = integrity.take_snapshot(harness, embedded_dataset.path, hook_dirs=[site_packages])
    (site_packages / "zz_evil.pth").write_text("import os; os.environ['X'] = '1'\n")
    (site_packages / "existing.pth").write_text("/other/path\n")
    after = integrity.take_snapshot(harness, embedded_dataset.path, hook_dirs=[site_packages])
    assert integrity.changes(before, after) == [
        f"import hook {site_packages / 'existing.pth'} modified", f"import hook {site_packages / 'zz_evil.pth'} added"]
    assert str(site_packages) not in " ".join(str(d) for d in integrity.site_dirs())  # defaults: the real ones
    assert any(str(d).endswith("site-packages") for d in integrity.site_dirs())


# The model process runs the trial's code: its memory, processes and log are the trial's (issue 31, item 6).
@pytest.mark.parametrize("attack,limit,words", [
    ("    import sys\n    for _ in range(20_000):\n        print('spam ' * 40, file=sys.stderr)\n",
     {"log_bytes": 2**20}, ("train.log grew past 1 MiB", "(trial-log-mb)")),
    ("    global _HOARD\n    _HOARD = bytearray(1536 * 2**20)\n",
     {"memory_bytes": 2**30}, ("past the 1.0 GiB a trial may hold", "(trial-memory-mb)")),
])
def test_a_model_over_the_trials_limits_fails_its_evaluation_with_the_limit_named(fresh, tmp_path, attack, limit,
                                                                                 words):
    from autoloop.measure.limits import LIMIT_PREFIX, TrialLimits

    source = edited(train_source(), PEEK[0], attack + PEEK[0])
    result = _evaluate(fresh, tmp_path, source, limits=TrialLimits(**{"memory_bytes": 8 * 2**30, **limit}))
    assert not result.ok and result.reason.startswith(LIMIT_PREFIX), result.reason
    assert all(word in result.reason for word in words) and "its model, under evaluation" in result.reason
    assert (tmp_path / "out").exists() and sum(p.stat().st_size for p in (tmp_path / "out").rglob("*")) < 2**20
