"""The fixed evaluation set of a split: its first `eval_tokens(device)` targets in
consecutive, non-overlapping windows of the harness's context length (the metric's
contract, autoloop.harness.metric). numpy only: the scorer of a CPU evaluation
(autoloop.harness.evaluate) builds them without importing torch.
"""

from __future__ import annotations

import numpy as np

from autoloop.harness.constants import eval_tokens, seq_len


def evaluation_windows(tokens: np.ndarray, device_type: str, max_tokens: int | None = None) -> np.ndarray:
    """The fixed evaluation windows of a split: (n_windows, seq_len + 1) token ids."""
    length = seq_len(device_type)
    budget = min(max_tokens or eval_tokens(device_type), len(tokens) - 1)
    n_windows = budget // length
    if n_windows < 1:
        raise ValueError(f"split of {len(tokens)} tokens is shorter than one evaluation window of {length + 1}")
    starts = np.arange(n_windows) * length
    return np.stack([tokens[s : s + length + 1] for s in starts]).astype(np.int64)
