"""Probes with power: the arithmetic (autoloop.harness.probe_power) with known answers, and
the scorer's probes against models with a KNOWN peek fraction.

The evaluations run the real harness code path in one process: the scorer's `evaluate`
(autoloop.harness.evaluate) on the embedded dataset, the model process's `serve`
(autoloop.harness.model_server) in a thread, the real channel and shared region between
them. The model is a causal bigram table plus a next-token peek at the positions whose
context (the last eight tokens) hashes below a threshold that covers a fraction f of the
probed positions: the same positions at every evaluation, as a proposal's peek would
choose them. Its f on the probed positions is measured exactly,
so the detection rate has a known expected value: 1 - (1 - f)^n for n tested positions.
"""

from __future__ import annotations

import math
import os
import socket
import threading

import numpy as np
import pytest
import torch

from autoloop.harness import probe_power as P
from autoloop.harness.channel import Channel, Region, make_region
from autoloop.harness.evaluate import evaluate
from autoloop.harness.metric import evaluation_windows
from autoloop.harness.model_server import serve

# ---------------------------------------------------------------------------------------
# the arithmetic
# ---------------------------------------------------------------------------------------


def test_probes_needed_is_the_geometric_bound():
    # ln(0.05) / ln(1 - f): 2995 at f = 0.001, 299 at 0.01, about 3 / f.
    assert P.probes_needed(0.001) == 2995 and P.probes_needed(0.01) == 299
    for f in (0.001, 0.01, 0.05):
        n = P.probes_needed(f)
        assert P.detection_power(f, n) >= 0.95 > P.detection_power(f, n - 1)
    assert P.probes_needed(1.0) == 1
    with pytest.raises(ValueError, match="0 < f <= 1"):
        P.probes_needed(0.0)


def test_the_smallest_peek_that_matters():
    # Issue 31's figures: noise 0.001 bpb, a byte-level vocabulary (8 bits a peek, 1 byte a
    # token): a peek gains at most 8 bits where it looks, so gaining 0.001 bpb takes at
    # least 0.0125% of positions, and 95% of those are caught by 23,965 probes.
    f = P.peek_fraction_floor(0.001, 1.0, P.bits_per_peek(256))
    assert f == pytest.approx(1.25e-4)
    assert P.probes_needed(f) == 23965
    # The plan caps that at MAX_PROBE_FACTOR x the scored rows and says what is left.
    rows, f_min = P.probe_plan(0.001, 1.0, 256, scored_rows=256)
    assert rows == P.MAX_PROBE_FACTOR * 256 and f_min == pytest.approx(1.25e-4)
    assert P.detection_power(f_min, rows) == pytest.approx(1 - (1 - 1.25e-4) ** 4096)
    # A GPU-scale run (32k vocabulary, ~4 bytes a token, 8192 scored windows): affordable.
    rows, f_min = P.probe_plan(0.001, 4.0, 32768, scored_rows=8192)
    assert f_min == pytest.approx(0.004 / 15) and rows == P.probes_needed(f_min) < 16 * 8192
    # No noise known (deterministic step mode): every gain matters, the cap.
    assert P.probe_plan(None, 1.0, 256, scored_rows=10) == (160, None)
    with pytest.raises(ValueError, match="positive noise"):
        P.peek_fraction_floor(0.0, 1.0, 8.0)


def test_the_sharper_bound_from_the_models_own_losses():
    # Losses of 10 positions in bits; the adversary peeks where they are highest. Gaining
    # 20 bits over 100 bytes (0.2 bpb) takes the two worst positions (12 + 9 >= 20): 2 / 10.
    bits = np.array([1, 2, 12, 3, 9, 1, 1, 2, 3, 4], dtype=float)
    assert P.peek_fraction_from_losses(bits, 100, 0.2) == pytest.approx(0.2)
    assert P.peek_fraction_from_losses(bits, 100, 0.05) == pytest.approx(0.1)  # 12 >= 5
    assert P.peek_fraction_from_losses(bits, 100, 10.0) == 1.0  # more than every loss together


# ---------------------------------------------------------------------------------------
# known peek fractions through the scorer
# ---------------------------------------------------------------------------------------

def _context_hash(idx: torch.Tensor) -> torch.Tensor:
    """A hash of each position's last eight tokens (fewer at the start of a row)."""
    padded = torch.nn.functional.pad(idx, (7, 0))
    h = torch.zeros_like(idx)
    for k in range(8):
        h = (h * 1_000_003 + padded[:, k : k + idx.size(1)] + 1) % 2_147_483_647
    return (h * 48_271) % 2_147_483_647


class HashPeek(torch.nn.Module):
    """A causal bigram model that, where the hash of its last eight tokens falls below a
    threshold, adds 30 to the logit of the NEXT token (a peek). The threshold is the
    `fraction` quantile of the hashes of `windows`' positions (the probed ones), so the
    peek covers about that fraction of them; 0 and 1 peek nowhere and everywhere."""

    def __init__(self, vocab_size: int, fraction: float, windows: torch.Tensor | None = None):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(vocab_size, vocab_size, generator=generator))
        if fraction <= 0 or fraction >= 1 or windows is None:
            self.threshold = 0 if fraction <= 0 else 2_147_483_647
        else:
            hashes = _context_hash(windows)[:, :-1].double().flatten()
            self.threshold = int(torch.quantile(hashes, fraction))

    def peeked(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) True where the model peeks (the last position has no next token to see)."""
        chosen = _context_hash(idx) < self.threshold
        chosen[:, -1] = False
        return chosen

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.table[idx].clone()
        b, t = torch.nonzero(self.peeked(idx), as_tuple=True)
        logits[b, t, idx[b, t + 1]] += 30.0
        return logits


def _evaluate_in_process(model, data_dir, *, seed: int, noise: float | None, splits=("val", "heldout"),
                         power: bool = True, factor: int = P.MAX_PROBE_FACTOR, arithmetic: str | None = None) -> dict:
    """One evaluation through the scorer, the channel and the model server's loop."""
    a, b = socket.socketpair()
    region_fd = make_region()
    scorer_region, model_region = Region(region_fd), Region(os.dup(region_fd))
    os.close(region_fd)
    model_channel, scorer_channel = Channel(a.fileno()), Channel(b.fileno(), timeout=120)

    def model_side():
        model_channel.ready(model.table.size(0), model.table.numel())
        serve(model, model_channel, model_region, torch.device("cpu"), model.table.size(0))

    thread = threading.Thread(target=model_side, daemon=True)
    thread.start()
    try:
        return evaluate(scorer_channel, scorer_region, data_dir=data_dir, device_name="cpu", splits=splits,
                        seed=seed, power=power, probe_noise=noise, probe_factor=factor, arithmetic=arithmetic)
    finally:
        thread.join(30)
        a.close()
        b.close()


def _probed_windows(ds, splits) -> torch.Tensor:
    return torch.from_numpy(np.concatenate([evaluation_windows(ds.split(s), "cpu")[:, :-1] for s in splits]))


def _fraction_on_probed_positions(model: HashPeek, ds, splits) -> float:
    """f as the probes draw it: positions 0..T-2 of every evaluation window."""
    return float(model.peeked(_probed_windows(ds, splits))[:, :-1].double().mean())


def _binomial_bounds(k: int, p: float, alpha: float = 1e-3) -> tuple[int, int]:
    """The counts outside which Binomial(k, p) falls with probability < alpha on each side."""
    pmf = [math.comb(k, i) * p**i * (1 - p) ** (k - i) for i in range(k + 1)]
    low = next(i for i in range(k + 1) if sum(pmf[: i + 1]) >= alpha)
    high = next(i for i in range(k, -1, -1) if sum(pmf[i:]) >= alpha)
    return low, high


@pytest.mark.slow
@pytest.mark.parametrize("fraction, evaluations", [(0.01, 40), (0.001, 24)])
def test_a_sparse_peek_is_caught_at_the_stated_power(embedded_dataset, fraction, evaluations):
    """The noise is set so that the smallest peek worth it is at the model's own f (about
    `fraction`): the plan then sends ln(0.05)/ln(1-f) probes or more, the verdict states a power >= 95%,
    and over seeded evaluations the detections follow Binomial(k, 1 - (1 - f)^n) for the
    model's exact f: a plan that tested fewer positions, or placed them where the peek is
    not, falls below the lower bound."""
    ds = embedded_dataset
    splits = ("val", "heldout")
    model = HashPeek(ds.vocab_size, fraction, _probed_windows(ds, splits))
    f = _fraction_on_probed_positions(model, ds, splits)
    assert 0.7 * fraction < f < 1.3 * fraction, f  # repeated contexts make it only about the fraction asked for
    targets = np.concatenate([evaluation_windows(ds.split(s), "cpu")[:, 1:].reshape(-1) for s in splits])
    table = np.asarray(ds.token_bytes)
    bytes_per_token = table[targets][table[targets] > 0].mean()
    noise = f * P.bits_per_peek(ds.vocab_size) / bytes_per_token  # f_min == the model's own f
    caught, tested = 0, []
    for seed in range(evaluations):
        verdict = _evaluate_in_process(model, ds.path, seed=1000 + seed, noise=noise)
        power = verdict["causality"]["power"]
        assert power["f_min"] == pytest.approx(f) and power["power"] >= 0.95, power
        tested.append(power["tested_positions"])
        caught += verdict["stage"] == "causality" and verdict["reason"].startswith("leaks future tokens")
    n = min(tested)
    assert n >= P.probes_needed(f)
    expected = 1 - (1 - f) ** n
    assert expected >= 0.95
    print(f"peek at f = {f:.5f}: {caught} of {evaluations} evaluations caught it, {n} positions tested each, "
          f"expected rate {expected:.3f}")  # pytest -s shows the figures
    low, high = _binomial_bounds(evaluations, expected)
    assert low <= caught <= high, (caught, evaluations, expected, f, n)
    assert caught >= 0.8 * evaluations


def test_an_honest_causal_model_is_never_flagged(embedded_dataset):
    """The same model without its peek, at the plan for f = 0.01 (about 300 tested
    positions an evaluation): every comparison is exact, nothing is flagged."""
    model = HashPeek(embedded_dataset.vocab_size, 0.0)
    noise = 0.01 * P.bits_per_peek(embedded_dataset.vocab_size)  # a byte-level corpus: 1 byte a token
    for seed in range(4):
        verdict = _evaluate_in_process(model, embedded_dataset.path, seed=seed, noise=noise, splits=("val",))
        assert verdict["ok"], verdict["reason"]
        assert verdict["causality"]["power"]["tested_positions"] >= P.probes_needed(0.01) * 0.99
        assert verdict["causality"]["max_leak"] == 0.0


def test_a_peek_at_every_position_is_caught_by_the_default_probes(embedded_dataset):
    """With no power asked for (every trial's own evaluation) the probes still test their
    positions, and a peek everywhere is caught at once; the verdict says what they tested."""
    model = HashPeek(embedded_dataset.vocab_size, 1.0)
    verdict = _evaluate_in_process(model, embedded_dataset.path, seed=5, noise=None, splits=("val",), power=False)
    assert verdict["stage"] == "causality" and verdict["reason"].startswith("leaks future tokens"), verdict["reason"]
    power = verdict["causality"]["power"]
    assert power["f_min"] is None and power["power"] is None  # no noise given: nothing claimed
    assert power["tested_positions"] == verdict["causality"]["tested_positions"] > 0


@pytest.mark.parametrize("fraction", [0.0, 0.05])
def test_the_cpu_scorers_numpy_arithmetic_gives_the_verdict_torch_gives(embedded_dataset, fraction):
    """A CPU evaluation's scorer computes with numpy (so its process never imports torch), a
    GPU's with torch: on one model, seed and plan the two give the same figures to float32
    rounding, the same probes and the same verdict, honest or caught peeking."""
    ds = embedded_dataset
    splits = ("val", "heldout")
    model = HashPeek(ds.vocab_size, fraction, _probed_windows(ds, splits))
    ours, torchs = (_evaluate_in_process(model, ds.path, seed=7, noise=0.01, factor=1, arithmetic=name)
                    for name in ("numpy", "torch"))
    assert (ours["arithmetic"], torchs["arithmetic"]) == ("numpy", "torch")
    for split in ("val_bpb", "heldout_bpb"):
        assert ours[split] == pytest.approx(torchs[split], abs=1e-6), split
    assert (ours["ok"], ours["stage"], ours["batches"]) == (torchs["ok"], torchs["stage"], torchs["batches"])
    mine, theirs = ours["causality"], torchs["causality"]
    assert (mine["probes"], mine["tested_positions"]) == (theirs["probes"], theirs["tested_positions"])
    assert mine["max_leak"] == pytest.approx(theirs["max_leak"], rel=1e-4, abs=1e-5)
    # The sharper power bound reads every scored target's loss: the same losses.
    assert mine["power"]["f_min_losses"] == pytest.approx(theirs["power"]["f_min_losses"], rel=1e-4)
    assert ours["ok"] if fraction == 0 else ours["stage"] == "causality"


def test_the_numpy_arithmetic_on_known_outputs():
    """Uniform outputs cost ln(V) nats a target; a sure prediction costs 0; bf16 outputs widen
    to the float32 values torch's `.float()` gives; special tokens (0 bytes) are not counted."""
    from autoloop.harness.logits import NumpyLogits, widen_bf16

    vocab = 5
    token_bytes = np.array([0, 1, 2, 1, 3])
    logits = NumpyLogits(token_bytes)
    out = np.zeros((4, vocab), dtype=np.float32)
    out[3, 2] = 1e4  # row 3 is sure of token 2 (and no exponential overflows)
    lse = logits.logsumexp(out)
    nats, nbytes, bits = logits.scored(out, np.array([1, 0, 4, 2]), lse)
    assert nbytes == 1 + 3 + 2 and nats == pytest.approx(2 * math.log(vocab), rel=1e-6)
    assert bits == pytest.approx([math.log2(vocab), math.log2(vocab), 0.0], abs=1e-6)
    assert logits.witness(out, np.array([[1, 2]] * 4), lse)[:, 1] == pytest.approx([-math.log(vocab)] * 3 + [0.0], abs=1e-5)
    values = torch.tensor([1.0, -2.5, 3.14159, 1e-3, 65504.0, -1e30]).to(torch.bfloat16)
    widened = widen_bf16(values.view(torch.int16).numpy().view(np.uint16))
    assert widened.tolist() == values.float().tolist()
    buffer = bytearray(values.view(torch.int16).numpy().tobytes())
    assert logits.read(buffer, 2, 3, True, 2).tolist() == values.float().view(2, 3)[:, :2].tolist()


def test_the_probe_factor_caps_the_plan():
    """The run's `probe-factor` setting is the cap: at no known noise exactly factor x the
    scored rows, at a known one never more; the setting's default is the harness's cap."""
    from autoloop.config import Config

    assert P.probe_plan(None, 1.0, 256, scored_rows=10, factor=2) == (20, None)
    rows, f_min = P.probe_plan(0.001, 1.0, 256, scored_rows=256, factor=1)
    assert rows == 256 and f_min == pytest.approx(1.25e-4)  # 23,965 needed, 256 allowed
    assert P.probe_plan(0.5, 1.0, 256, scored_rows=256, factor=1)[0] == P.probes_needed(0.5 / 8) < 256
    with pytest.raises(ValueError, match="probe factor"):
        P.probe_plan(None, 1.0, 256, scored_rows=10, factor=0)
    assert Config().probe_factor == P.MAX_PROBE_FACTOR


def test_the_scorer_sends_the_probes_its_factor_allows(embedded_dataset):
    """Through the scorer: factor x the scored windows of probe rows, each testing one
    position, and the default probes (2% of the batches) besides."""
    model = HashPeek(embedded_dataset.vocab_size, 0.0)
    tested = {}
    for factor in (1, 2):
        verdict = _evaluate_in_process(model, embedded_dataset.path, seed=3, noise=None, splits=("val",), factor=factor)
        assert verdict["ok"], verdict["reason"]
        tested[factor] = verdict["causality"]["power"]["tested_positions"]
    windows = len(evaluation_windows(embedded_dataset.split("val"), "cpu"))
    for factor, n in tested.items():
        assert factor * windows <= n < factor * windows + 32, (tested, windows)


def test_the_scorers_probe_noise_option_names_a_bad_figure(capsys):
    from autoloop.harness.evaluate import _noise, main

    assert _noise("unknown") is None and _noise("0.002") == 0.002
    for bad in ("abc", "-0.1", "nan"):
        with pytest.raises(SystemExit):
            main(["--channel-fd", "0", "--region-fd", "0", "--verdict-fd", "0", "--probe-noise", bad])
        assert f"--probe-noise takes a bpb figure >= 0 or 'unknown', not '{bad}'" in capsys.readouterr().err
    for bad in ("0", "-2", "1.5", "many"):
        with pytest.raises(SystemExit):
            main(["--channel-fd", "0", "--region-fd", "0", "--verdict-fd", "0", "--probe-factor", bad])
        assert f"--probe-factor takes a whole number >= 1, not '{bad}'" in capsys.readouterr().err
