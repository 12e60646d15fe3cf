"""The scorer's arithmetic on the model's outputs, in numpy: what a CPU evaluation runs.

The scorer (autoloop.harness.evaluate) reads each batch of outputs from the shared region,
takes the log-sum-exp of every row once, the loss of every scored target, and the
log-probabilities of the causality probes' witnesses. On a CPU it does that here, with
numpy alone, so its process never imports torch: 0.2 s of start-up instead of 2.6 s of CPU
and 190 MB per evaluation, twice a keep candidate's run (issue 32). On a GPU the same
arithmetic runs on the device (autoloop.harness.logits_torch, the metric's own
`target_nats`).

The two agree to float32 rounding (tests/test_probe_power.py compares their verdicts on
one model): every row is read as float32 (bf16 widened exactly, as torch's `.float()`
does), the exponentials are summed in float64 and the nats of a batch too.
"""

from __future__ import annotations

import numpy as np


def widen_bf16(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) as the float32 values they are: the top half of a float32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


class NumpyLogits:
    """The CPU scorer's arithmetic; arrays are numpy, float32 rows of the vocabulary's width."""

    name = "numpy"

    def __init__(self, token_bytes: np.ndarray):
        self.token_bytes = np.asarray(token_bytes, dtype=np.int64)

    def read(self, buffer, n: int, width: int, bf16: bool, vocab_size: int) -> np.ndarray:
        """A copy of the region's n x width outputs, float32, cut to the vocabulary."""
        raw = np.frombuffer(buffer, dtype=np.uint16 if bf16 else np.float32, count=n * width)
        columns = raw.reshape(n, width)[:, :vocab_size]
        return widen_bf16(columns) if bf16 else columns.copy()  # one copy, contiguous

    def join(self, blocks: list[np.ndarray]) -> np.ndarray:
        return blocks[0] if len(blocks) == 1 else np.concatenate(blocks)

    def all_finite(self, out: np.ndarray) -> bool:
        return bool(np.isfinite(out).all())

    def logsumexp(self, out: np.ndarray) -> np.ndarray:
        top = out.max(axis=1)
        total = np.exp(out - top[:, None]).sum(axis=1, dtype=np.float64)
        return (top + np.log(total)).astype(np.float32)

    def scored(self, out: np.ndarray, targets: np.ndarray, lse: np.ndarray) -> tuple[float, int, np.ndarray]:
        """(nats, bytes, bits of each counted target) of a scored batch; special tokens
        (0 bytes) are left out of all three, as in metric.counted_sums."""
        y = targets.reshape(-1).astype(np.int64)
        nats = lse - out[np.arange(len(y)), y]
        nbytes = self.token_bytes[y]
        counted = nbytes > 0
        kept = nats[counted]
        bits = (kept / np.float32(np.log(2))).astype(np.float64)
        return float(kept.sum(dtype=np.float64)), int(nbytes[counted].sum()), bits

    def witness(self, rows: np.ndarray, ids: np.ndarray, lse: np.ndarray) -> np.ndarray:
        """log-probabilities of `ids` (P, k) under the output rows (P, vocab), float64."""
        picked = np.take_along_axis(rows, ids, axis=1)
        return (picked - lse.reshape(-1, 1)).astype(np.float64)
