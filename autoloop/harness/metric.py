"""The metric (contract): bits per byte on a fixed evaluation set.

    val_bpb = sum of cross-entropy (nats) over the evaluated targets
              / (ln 2 * sum of the raw byte lengths of those targets)

The model only supplies logits (`model(idx) -> (B, T, width)`, width >= the vocabulary:
columns past it, a padded output layer, are dropped); the loss is computed here, in
float32. Under the controller the model runs in a process of its own and this arithmetic
runs in the scorer (autoloop.harness.evaluate), so a proposal cannot change how its own
score is computed; `evaluate_bpb` is the same arithmetic in one process, for train.py run
by hand and for `autoloop check`. Targets
whose byte length is 0 (BOS and other special tokens) stand for no text and are left
out of both sums. The evaluation set is the first `eval_tokens(device)` targets of the
split in consecutive, non-overlapping windows of the harness's context length: fixed
for a given dataset and device type.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from autoloop.harness.windows import evaluation_windows  # noqa: F401 (metric.evaluation_windows, as before)


def target_nats(logits: torch.Tensor, y: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """Cross-entropy in nats of each target in `y` under `logits` (..., width), in float32.

    Columns past `vocab_size` (a padded output layer) are not part of the distribution:
    no token has them, so they are dropped before the softmax."""
    logits = logits.float()
    if vocab_size is not None and logits.size(-1) > vocab_size:
        logits = logits[..., :vocab_size]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none")


def counted_sums(nats: torch.Tensor, y: torch.Tensor, token_bytes: torch.Tensor) -> tuple[float, int]:
    """Summed nats and summed raw bytes over the targets y (special tokens excluded)."""
    nbytes = token_bytes[y.reshape(-1)]
    counted = nbytes > 0
    return float(nats[counted].sum().item()), int(nbytes[counted].sum().item())


@torch.no_grad()
def loss_and_bytes(model, x: torch.Tensor, y: torch.Tensor, token_bytes: torch.Tensor) -> tuple[float, int]:
    """Summed nats and summed raw bytes over the targets y (special tokens excluded)."""
    logits = model(x)
    return counted_sums(target_nats(logits, y, int(token_bytes.numel())), y, token_bytes)


def bpb_on_batches(model, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], token_bytes, *, autocast_dtype=None) -> float:
    """Bits per byte of `model` over (x, y) batches; the building block of evaluate_bpb."""
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    table = torch.as_tensor(np.asarray(token_bytes), dtype=torch.int64, device=device)
    autocast = (
        torch.autocast(device_type=device.type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    )
    was_training = model.training
    model.eval()
    total_nats, total_bytes = 0.0, 0
    try:
        with autocast:
            for x, y in batches:
                nats, nbytes = loss_and_bytes(model, x.to(device), y.to(device), table)
                total_nats += nats
                total_bytes += nbytes
    finally:
        model.train(was_training)
    if total_bytes == 0:
        raise ValueError("the evaluation set has no bytes to score")
    return total_nats / (math.log(2) * total_bytes)


def evaluate_bpb(model, ds, split: str = "val", *, device=None, batch_size: int | None = None, max_tokens: int | None = None) -> float:
    """val_bpb (or held-out bpb) of `model` on the dataset's fixed evaluation set."""
    if device is None:
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    windows = torch.from_numpy(evaluation_windows(ds.split(split), device.type, max_tokens))
    batch_size = batch_size or (32 if device.type == "cuda" else 16)
    batches = ((w[:, :-1], w[:, 1:]) for w in windows.split(batch_size))
    # bf16 autocast on CUDA, as in training; the loss itself is taken in float32.
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    return bpb_on_batches(model, batches, ds.token_bytes, autocast_dtype=autocast_dtype)
