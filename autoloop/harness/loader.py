"""The training loader: endless (x, y) batches of one split, from the memory map or the data feed.

Its own module so that the dataset (autoloop.harness.data) and the feed
(autoloop.harness.feed), which serves windows the data module samples, do not import each
other.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from autoloop.harness.data import ENV_FEED, Dataset, WindowSampler, check_window_fits, read_windows
from autoloop.harness.feed import feed_client


class TokenLoader:
    """Endless (x, y) batches of packed windows from one split.

    Windows start where WindowSampler says (seeded random, or sequential). The split is
    memory-mapped: only the windows drawn are read. Under the controller (AUTOLOOP_FEED
    set) the train split comes from the harness's data feed instead, which serves the
    same windows and counts them; other splits are refused there. On CUDA the batch goes
    through pinned memory with a non-blocking copy, so it overlaps the previous step.
    """

    def __init__(
        self,
        ds: Dataset,
        split: str,
        batch_size: int,
        seq_len: int,
        device: torch.device | str = "cpu",
        *,
        seed: int = 0,
        sequential: bool = False,
    ):
        self.batch_size, self.seq_len = batch_size, seq_len
        self.device = torch.device(device)
        self.sequential = sequential
        self._pin = self.device.type == "cuda"
        self._stream = None
        if os.environ.get(ENV_FEED):
            self.tokens = None
            self._stream = feed_client().open_stream(
                split, batch_size, seq_len, seed=seed, sequential=sequential, device_type=self.device.type
            )
            return
        self.tokens = ds.split(split)
        check_window_fits(len(self.tokens), seq_len, split, ds.path)
        self.sampler = WindowSampler(len(self.tokens), batch_size, seq_len, seed=seed, sequential=sequential)

    def __iter__(self) -> "TokenLoader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._stream is not None:
            windows = self._stream.next_windows()
        else:
            windows = read_windows(self.tokens, self.sampler.starts(), self.seq_len)
        batch = torch.from_numpy(windows.astype(np.int64))
        if self._pin:
            batch = batch.pin_memory()
        batch = batch.to(self.device, non_blocking=True)
        return batch[:, :-1], batch[:, 1:]
