"""The causality check: a language model's output at position t may depend only on tokens 0..t.

A model that sees future tokens predicts them almost for free and reports a wonderful
val_bpb, so the verifier runs this check before a trial is kept. It is a perturbation
test on the model as the trial built it (proposal code, in eval mode):

* determinism: the same batch twice must give the same outputs, otherwise no difference
  below could be blamed on a leak (dropout left on, random noise in eval);
* future tokens: for several cut positions t (always 0 and T-2, plus random ones), the
  tokens after t are replaced by different ones; the outputs at positions 0..t must not
  change. One cut at t catches any leak from a position after t into a position at or
  before t, so 0 and T-2 catch a "peek at the next token" at the first and the last
  position, and the random cuts sample the middle;
* batch independence: replacing the other sequences of the batch must not change a
  sequence's outputs. The evaluation set is consecutive windows of one split, so a model
  that mixes information across the batch can read the next window: future text.

Outputs are compared as log-probabilities (float32): a change that shifts every logit of a
position by the same amount changes no prediction and is not a leak. The tolerance suits
the arithmetic: float32 on a CPU gives (measured) differences of 0 or ~1e-6 for a causal
model, so 1e-4; under bf16 autocast the same kernels compute each position's row the
same way whatever the masked future holds, but bf16 rounding is ~4e-3, so 2e-2. A real
leak moves log-probabilities by far more (0.1 to 10 with `is_causal=False`).

What it cannot see: a leak that switches on only for inputs the check does not draw (a
deliberately adversarial model); see docs/verification.md.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass

import torch

from autoloop.harness.constants import FP32_TOLERANCE, LOW_PRECISION_TOLERANCE

# Cuts at random positions, on top of the first and the last one.
RANDOM_CUTS = 3


def tolerance_for(autocast_dtype: torch.dtype | None) -> float:
    """The comparison tolerance for outputs computed in float32 or under autocast."""
    return FP32_TOLERANCE if autocast_dtype in (None, torch.float32) else LOW_PRECISION_TOLERANCE


@dataclass
class CausalityReport:
    ok: bool
    reason: str | None
    tolerance: float
    cuts: list[int]
    # Largest change at positions that must not change (future tokens, other sequences).
    max_leak: float = 0.0
    max_batch_leak: float = 0.0
    max_nondeterminism: float = 0.0
    # Largest change at positions that may change: shows the check moved the model at all.
    max_allowed_change: float = 0.0
    seconds: float = 0.0
    worst_cut: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _different_tokens(tokens: torch.Tensor, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """Tokens that differ from `tokens` at every position (uniformly among the others)."""
    offset = torch.randint(1, vocab_size, tokens.shape, generator=generator).to(tokens.device)
    return (tokens + offset) % vocab_size


@torch.no_grad()
def check_causality(
    model,
    tokens: torch.Tensor,
    vocab_size: int,
    *,
    seed: int = 0,
    autocast_dtype: torch.dtype | None = None,
    tolerance: float | None = None,
    random_cuts: int = RANDOM_CUTS,
) -> CausalityReport:
    """Check that `model(tokens) -> (B, T, vocab) logits` does not look ahead or across the batch.

    `tokens` is a (B, T) batch of real token ids on the model's device, B >= 2 (the batch
    check replaces sequences 1..B-1 and watches sequence 0). Replacement tokens are drawn
    from a generator seeded with `seed`, so a verdict can be reproduced.
    """
    started = time.perf_counter()
    if tokens.ndim != 2 or tokens.size(0) < 2 or tokens.size(1) < 2:
        raise ValueError(f"check_causality needs a (B >= 2, T >= 2) batch of token ids, got shape {tuple(tokens.shape)}")
    tol = tolerance_for(autocast_dtype) if tolerance is None else tolerance
    device = tokens.device
    length = tokens.size(1)
    generator = torch.Generator().manual_seed(seed)
    autocast = (
        torch.autocast(device_type=device.type, dtype=autocast_dtype)
        if autocast_dtype is not None else contextlib.nullcontext()
    )
    was_training = model.training
    model.eval()

    def log_probs(x: torch.Tensor) -> torch.Tensor:
        with autocast:
            logits = model(x)
        if not isinstance(logits, torch.Tensor) or logits.shape[:2] != x.shape:
            raise ValueError(
                f"model(idx) must return (B, T, vocab) logits; got {type(logits).__name__} "
                f"{tuple(getattr(logits, 'shape', ()))} for input {tuple(x.shape)}"
            )
        return torch.log_softmax(logits.float(), dim=-1)

    cuts = {0, length - 2}
    if length > 3 and random_cuts > 0:
        cuts.update(torch.randint(1, length - 2, (random_cuts,), generator=generator).tolist())
    report = CausalityReport(ok=True, reason=None, tolerance=tol, cuts=sorted(cuts))
    try:
        base = log_probs(tokens)
        report.max_nondeterminism = float((log_probs(tokens) - base).abs().max())
        if report.max_nondeterminism > tol:
            report.ok = False
            report.reason = (
                f"outputs are not deterministic in eval mode (the same batch twice differs by up to "
                f"{report.max_nondeterminism:.3g}, tolerance {tol:g}), so causality cannot be checked"
            )
            return report
        for cut in report.cuts:
            changed = tokens.clone()
            changed[:, cut + 1:] = _different_tokens(tokens[:, cut + 1:], vocab_size, generator)
            out = log_probs(changed)
            leak = float((out[:, : cut + 1] - base[:, : cut + 1]).abs().max())
            report.max_allowed_change = max(report.max_allowed_change, float((out[:, cut + 1:] - base[:, cut + 1:]).abs().max()))
            if leak > report.max_leak:
                report.max_leak, report.worst_cut = leak, cut
            del out
        if report.max_leak > tol:
            report.ok = False
            report.reason = (
                f"leaks future tokens: changing the tokens after position {report.worst_cut} changed the outputs at "
                f"positions 0..{report.worst_cut} by up to {report.max_leak:.3g} (tolerance {tol:g})"
            )
            return report
        others = tokens.clone()
        others[1:] = _different_tokens(tokens[1:], vocab_size, generator)
        report.max_batch_leak = float((log_probs(others)[0] - base[0]).abs().max())
        if report.max_batch_leak > tol:
            report.ok = False
            report.reason = (
                f"leaks across the batch: changing the other sequences changed a sequence's outputs by up to "
                f"{report.max_batch_leak:.3g} (tolerance {tol:g}); consecutive evaluation windows are future text"
            )
        return report
    finally:
        model.train(was_training)
        report.seconds = time.perf_counter() - started
