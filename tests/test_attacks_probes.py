"""Issue 31, items 3 and 4, through the real sandboxed loop: a sparse peek and a model that
does not reproduce its first evaluation.

* **The sparse peek.** A model that looks at the next token only where a hash of its last
  eight tokens falls below a threshold: about 0.4% of the probed positions (measured here
  on the dataset, so a change of corpus keeps the figure). On the old main its keep was
  verified "causal" with ~28 probed positions per evaluation (a 20% chance to catch it
  over two evaluations); the keep's verification now sends probes with power
  (autoloop.harness.probe_power): at no known noise the cap, 16 x the scored windows.
* **A model with a memory.** Under --no-verify the script evaluates itself; this one reads
  the val text in training (as --no-verify lets it), keeps an 8-gram table of it in the
  process (never in the checkpoint) and predicts from it: a first evaluation far below
  the honest one, which no evaluation from its checkpoint reproduces. The determinism
  re-check (autoloop.loop.recheck) evaluates the keep candidate again.

Neither is kept, and neither trial shows a failed figure as its val_bpb in `log` or `show`.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from test_attacks import BUILD_ANCHOR, TRAIN_PY, _patched, _run, _seed_attacks, _trials, needs_bwrap
from typer.testing import CliRunner

from autoloop.cli import app
from autoloop.loop.controller import Controller
from tests.conftest import make_repo

# The peek's choice of positions, as the patch computes it and as this test measures it.
PEEK_HASH = '''
def _peek_hash(idx):
    pad = torch.nn.functional.pad(idx, (7, 0))
    h = torch.zeros_like(idx)
    for k in range(8):
        h = (h * 1000003 + pad[:, k : k + idx.size(1)] + 1) % 2147483647
    return (h * 48271) % 2147483647
'''
PEEK_FRACTION = 0.004


def _hash(idx: torch.Tensor) -> torch.Tensor:
    scope: dict = {"torch": torch}
    exec(PEEK_HASH, scope)
    return scope["_peek_hash"](idx)


def _probed_windows(ds) -> torch.Tensor:
    from autoloop.harness.metric import evaluation_windows

    return torch.from_numpy(np.concatenate([evaluation_windows(ds.split(s), "cpu")[:, :-1]
                                            for s in ("val", "heldout")]))


def sparse_peek(ds) -> tuple[str, float]:
    """The patched train.py and the peek's fraction of the probed positions (0..T-2)."""
    h = _hash(_probed_windows(ds))[:, :-1]
    threshold = int(torch.quantile(h.double().flatten(), PEEK_FRACTION))
    fraction = float((h < threshold).double().mean())
    source = _patched("import torch\n", "import torch\n" + PEEK_HASH, TRAIN_PY.read_text())
    return _patched(BUILD_ANCHOR, f"""\
    forward = model.forward

    def _sparse_peek(idx, targets=None):
        logits = forward(idx, targets)
        if targets is not None:
            return logits
        chosen = _peek_hash(idx) < {threshold}
        chosen[:, -1] = False
        b, t = torch.nonzero(chosen, as_tuple=True)
        out = logits.clone()
        out[b, t, idx[b, t + 1]] += 30.0
        return out
    model.forward = _sparse_peek
    return model


""", source), fraction


EVAL_ANCHOR = "    t_eval = time.perf_counter()\n"
REMEMBERING = _patched(EVAL_ANCHOR, """\
    if not spec.external_eval:  # --no-verify: the script evaluates itself, and can read val
        _val = ds.split("val")[: 40000].tolist()
        _seen = {}
        for _i in range(8, len(_val)):
            _seen.setdefault(tuple(_val[_i - 8 : _i]), set()).add(_val[_i])
        _next = {_k: next(iter(_v)) for _k, _v in _seen.items() if len(_v) == 1}  # contexts val always continues one way
        _forward = model.forward

        def _remembering(idx, targets=None):
            logits = _forward(idx, targets)
            if targets is not None:
                return logits
            out = logits.clone()
            for _b, _row in enumerate(idx.tolist()):
                for _t in range(7, len(_row)):
                    _n = _next.get(tuple(_row[_t - 7 : _t + 1]))
                    if _n is not None:
                        out[_b, _t, _n] += 30.0
            return out
        model.forward = _remembering
""" + EVAL_ANCHOR)


def _shown(repo, trial: dict) -> tuple[str, str]:
    runner = CliRunner()
    log = runner.invoke(app, ["log", "--repo", str(repo), "--tag", "a"])
    show = runner.invoke(app, ["show", str(trial["number"]), "--repo", str(repo), "--tag", "a", "--no-diff"])
    assert log.exit_code == 0 and show.exit_code == 0, (log.output, show.output)
    return log.output, show.output


def _assert_no_val_bpb_shown(repo, trial: dict) -> None:
    """The trial has no metric, and `log` and `show` give it no val_bpb and no delta (its
    figures stay in its reason)."""
    assert trial["metric"] is None and trial["metric_source"] is None, trial
    log, show = _shown(repo, trial)
    line = next(l for l in log.splitlines() if re.match(rf"\s*{trial['number']}\s", l))
    assert not re.search(r"\d\.\d{4}", line), line  # neither a val_bpb nor a delta
    for field in ("val_bpb", "delta"):
        shown = next(l for l in show.splitlines() if l.strip().startswith(field))
        assert not re.search(r"\d\.\d{4}", shown), shown


@pytest.mark.slow
@needs_bwrap
def test_a_sparse_peek_is_not_kept_as_verified_and_causal(attacked_repo, monkeypatch, embedded_dataset):
    source, fraction = sparse_peek(embedded_dataset)
    assert 0.002 < fraction < 0.008, fraction
    monkeypatch.delenv("AUTOLOOP_PROBE_FACTOR")  # the probes with power as they ship
    repo = attacked_repo  # the shared sandboxed baseline's run, ours to run on
    config = _run(repo, monkeypatch, max_steps=6, max_trials=1)
    _seed_attacks(repo, config, ["sparse peek"], {"sparse peek": source})
    Controller(config, repo).run()
    trials = _trials(repo)
    assert trials["baseline"]["status"] == "keep", trials["baseline"]["reason"]
    peek = trials["sparse peek"]
    assert peek["status"] == "invalid", (peek["status"], peek["metric"], peek["reason"])
    assert "leaks future tokens" in peek["reason"], peek["reason"]
    _assert_no_val_bpb_shown(repo, peek)


@pytest.mark.slow
@needs_bwrap
def test_under_no_verify_a_model_that_does_not_reproduce_its_figure_is_not_kept(tmp_path, monkeypatch,
                                                                                 embedded_dataset):
    source, _ = sparse_peek(embedded_dataset)
    monkeypatch.delenv("AUTOLOOP_PROBE_FACTOR")  # the probes with power as they ship
    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text())
    config = _run(repo, monkeypatch, max_steps=6, max_trials=3, verify=False)
    _seed_attacks(repo, config, ["remembering", "sparse peek"], {"remembering": REMEMBERING, "sparse peek": source})
    Controller(config, repo).run()
    trials = _trials(repo)
    baseline = trials["baseline"]
    assert baseline["status"] == "keep", baseline["reason"]
    remembering = trials["remembering"]
    assert remembering["status"] == "invalid", (remembering["status"], remembering["metric"], remembering["reason"])
    assert "failed the determinism re-check" in remembering["reason"], remembering["reason"]
    again, first = (float(x) for x in re.search(r"gave val_bpb (\d\.\d+), its first evaluation (\d\.\d+)",
                                                remembering["reason"]).groups())
    assert first < baseline["metric"] - 0.1 and again == pytest.approx(baseline["metric"], abs=0.05), (first, again)
    _assert_no_val_bpb_shown(repo, remembering)
    # The sparse peek reproduces its figure (the same code in both evaluations) and is caught by the probes.
    peek = trials["sparse peek"]
    assert peek["status"] == "invalid" and "leaks future tokens" in peek["reason"], (peek["status"], peek["reason"])
    _assert_no_val_bpb_shown(repo, peek)
