"""FLOPs per token in three conventions, and the utilisation (MFU) they give.

Fixed code, so a proposal cannot make its model look cheaper: the counts read the model's
parameters and config (n_layer, n_head, n_embd, seq_len, vocab_size), whatever it is.

  flops_per_token / mfu_percent: 6 per matmul weight of the real vocabulary + causal
    attention at (T + 1) / 2 query-key pairs per token (the masked half is no model work).
  flops_per_token_palm / mfu_percent_palm: PaLM's 6N + 12 L H Q T (N every matmul
    parameter, padding rows included; attention over all T keys), as nanochat and
    autoresearch report MFU. At T = 2048 it is ~1.2x the first at train.py's CUDA shape.
  executed_flops_per_token / hfu_percent: what the hardware executes (padding rows, the
    math kernel's masked half, the orthogonalising optimizer's iterations).
"""

from __future__ import annotations

import torch
from torch import nn

from autoloop.harness.hardware import gpu_peak_flops


def _matmul_params(model):
    """Parameters used as matmul weights: all but embedding tables (a lookup is no FLOPs)."""
    lookups = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in lookups)


def _padding_params(model):
    """lm_head weights of the padding rows (computed, never a prediction)."""
    head = getattr(model, "lm_head", None)
    vocab = model.config.get("vocab_size")
    if head is None or vocab is None or head.weight.size(0) <= vocab:
        return 0
    return (head.weight.size(0) - vocab) * head.weight.size(1)


def _attention_pairs(seq_len, causal=True):
    """Mean query-key pairs scored per token: (T + 1) / 2 for causal attention, T if all are."""
    return (seq_len + 1) / 2 if causal else seq_len


def flops_per_token(model):
    """Model FLOPs per trained token (forward + backward): what mfu_percent counts.

    6 per matmul weight (2 forward, 4 backward) for every parameter except embedding
    lookups and the lm_head's padding rows, plus attention scores and the weighted sum
    over the query-key pairs a causal model needs: 2 matmuls x 2 FLOPs x 3 (fwd + bwd) =
    12 per pair per head dimension, with (T + 1) / 2 pairs per query on average, not T.
    """
    cfg = model.config
    head_dim = cfg["n_embd"] // cfg["n_head"]
    matmul = _matmul_params(model) - _padding_params(model)
    return int(6 * matmul + 12 * cfg["n_layer"] * cfg["n_head"] * head_dim * _attention_pairs(cfg["seq_len"]))


def flops_per_token_palm(model):
    """PaLM's 6N + 12 L H Q T (Chowdhery et al. 2022, appendix B), what mfu_percent_palm counts.

    N: every matmul parameter (padding rows included, as nanochat counts them); attention
    over all T keys. nanochat's and autoresearch's MFU use it, so theirs compare with this one.
    """
    cfg = model.config
    head_dim = cfg["n_embd"] // cfg["n_head"]
    return int(6 * _matmul_params(model) + 12 * cfg["n_layer"] * cfg["n_head"] * head_dim * cfg["seq_len"])


def executed_flops_per_token(model, kernel=None, muon=None, ns_steps=0, tokens_per_step=None):
    """FLOPs per token the hardware executes: the model FLOPs plus the work that is not model work.

    The lm_head's padding rows are computed; the math SDPA kernel (`kernel` "math") scores
    all T x T pairs and masks afterwards (flash, cuDNN and efficient kernels skip the
    masked tiles); `muon`, an optimizer whose param groups each hold same-shape matrices,
    runs `ns_steps` Polar Express (Newton-Schulz) iterations per matrix once per optimizer
    step, so their FLOPs are spread over the step's `tokens_per_step` tokens.
    """
    cfg = model.config
    head_dim = cfg["n_embd"] // cfg["n_head"]
    flops = flops_per_token(model) + 6 * _padding_params(model)
    if kernel == "math":
        wasted = _attention_pairs(cfg["seq_len"], causal=False) - _attention_pairs(cfg["seq_len"])
        flops += 12 * cfg["n_layer"] * cfg["n_head"] * head_dim * wasted
    if muon is not None and tokens_per_step:
        for group in muon.param_groups:
            rows, cols = group["params"][0].shape
            small, big = min(rows, cols), max(rows, cols)
            # Per iteration: A = X X^T (2 s^2 b), A @ A (2 s^3), B @ X (2 s^2 b).
            per_matrix = ns_steps * (4 * small * small * big + 2 * small**3)
            flops += len(group["params"]) * per_matrix / tokens_per_step
    return int(flops)


def peak_flops(device):
    """The GPU's dense bf16 peak FLOP/s (the harness's table); None on a CPU or an unknown GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return gpu_peak_flops(torch.cuda.get_device_name(device))


def mfu_figures(tokens_per_second, flops_tok, palm_tok, executed_tok, peak):
    """Utilisation from tokens/s and FLOPs per token, in both MFU conventions.

    mfu_percent: flops_per_token (causal pairs); mfu_percent_palm: flops_per_token_palm
    (6N + 12 L H Q T); hfu_percent: executed_flops_per_token; each 100 x FLOP/s / peak,
    None without a peak (a CPU, an unknown GPU). model_tflops and executed_tflops are the
    achieved FLOP/s / 1e12, peak or not. All None without a throughput.
    """
    tps = tokens_per_second or 0.0

    def percent(per_token):
        return 100 * per_token * tps / peak if tps and peak else None

    return {"mfu_percent": percent(flops_tok), "mfu_percent_palm": percent(palm_tok), "hfu_percent": percent(executed_tok),
            "model_tflops": flops_tok * tps / 1e12 if tps else None,
            "executed_tflops": executed_tok * tps / 1e12 if tps else None}


# The conventions as the result JSON names them (its "mfu_conventions").
MFU_CONVENTIONS = {"mfu_percent": "6N + 12*L*H*Q*(T+1)/2 (model FLOPs, causal pairs; train.py)",
                   "mfu_percent_palm": "6N + 12*L*H*Q*T (PaLM; nanochat and autoresearch report this)"}


class Utilisation:
    """A model's FLOPs per token in the three conventions, on one device, and what a
    throughput makes of them: train.py's progress lines and result JSON read it.

    kernel: the attention kernel that ran; muon, ns_steps, tokens_per_step: as for
    executed_flops_per_token.
    """

    def __init__(self, model, device, *, kernel=None, muon=None, ns_steps=0, tokens_per_step=None):
        self.flops_per_token = flops_per_token(model)
        self.flops_per_token_palm = flops_per_token_palm(model)
        self.executed_flops_per_token = executed_flops_per_token(model, kernel, muon, ns_steps, tokens_per_step)
        self.peak = peak_flops(device)

    def figures(self, tokens_per_second):
        """mfu_figures at this throughput (None: unknown)."""
        return mfu_figures(tokens_per_second, self.flops_per_token, self.flops_per_token_palm,
                           self.executed_flops_per_token, self.peak)

    def result(self, tokens_per_second):
        """The result JSON's FLOP and utilisation keys."""
        return {**self.figures(tokens_per_second), "mfu_conventions": MFU_CONVENTIONS,
                "flops_per_token": self.flops_per_token,  # model FLOPs: causal attention, no embedding lookups
                "flops_per_token_palm": self.flops_per_token_palm,  # 6N + 12 L H Q T
                # + padding rows, masked attention the kernel computes, Muon
                "executed_flops_per_token": self.executed_flops_per_token}
