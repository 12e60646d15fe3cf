"""The scorer's arithmetic on the model's outputs, in torch, on the trial's GPU: the outputs
go to the device once and the loss is the metric's own (`target_nats`, float32). The same
interface as autoloop.harness.logits's numpy version, which a CPU evaluation runs instead.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from autoloop.harness.metric import counted_sums, target_nats


class TorchLogits:
    name = "torch"

    def __init__(self, token_bytes: np.ndarray, device: torch.device):
        self.device = device
        self.token_bytes = torch.as_tensor(np.asarray(token_bytes), dtype=torch.int64, device=device)

    def read(self, buffer, n: int, width: int, bf16: bool, vocab_size: int) -> torch.Tensor:
        # Copied out before the acknowledgement (the model process may write the region
        # again), straight onto the device: one copy, host to device on a GPU.
        element = torch.bfloat16 if bf16 else torch.float32
        view = torch.frombuffer(buffer, dtype=element, count=n * width).view(n, width)[:, :vocab_size]
        return view.to(self.device, copy=True).float()  # every loss is computed in float32

    def join(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(blocks)

    def all_finite(self, out: torch.Tensor) -> bool:
        return bool(torch.isfinite(out).all())

    def logsumexp(self, out: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(out, dim=-1)

    def scored(self, out: torch.Tensor, targets: np.ndarray, lse: torch.Tensor) -> tuple[float, int, np.ndarray]:
        y = torch.from_numpy(targets.astype(np.int64)).to(self.device)
        per_target = target_nats(out, y, out.size(-1))
        nats, nbytes = counted_sums(per_target, y, self.token_bytes)
        bits = (per_target[self.token_bytes[y.reshape(-1)] > 0] / math.log(2)).cpu().numpy().astype(np.float64)
        return nats, nbytes, bits

    def witness(self, rows: torch.Tensor, ids: np.ndarray, lse: torch.Tensor) -> np.ndarray:
        picked = torch.gather(rows, 1, torch.as_tensor(ids, device=rows.device))
        return (picked - lse.reshape(-1, 1)).double().cpu().numpy()
