"""The model process of a split evaluation: the trial's model, and nothing to score it with.

    python -m autoloop.harness.model_server --train-py SOURCE/train.py --device cpu|cuda \
        --checkpoint-fd N --channel-fd M --region-fd R

This process runs the trial's code (its train.py is imported to rebuild the model), so
everything in it is untrusted, this module included once train.py has been imported. It
is started sandboxed with no data file visible and nothing writable that outlives it
(the controller's side, autoloop.measure.evaluation); it reads its checkpoint from an
inherited descriptor (never a path the trial could have planted), receives token windows
over the channel (autoloop.harness.channel) and writes its outputs (logits, a (B, T,
vocabulary) tensor per batch: float32, or bf16 as a GPU's autocast made them) into the
shared region. It
never sees which positions are scored, which split a window came from, or which batches
are causality probes: the scorer (autoloop.harness.evaluate) decides all of that.

Under CUDA the forward runs under bf16 autocast, as in training; outputs are sent as
float32 in chunks of rows so that a large vocabulary never needs more host memory than
the region.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback

import numpy as np
import torch

from autoloop.harness.channel import BFLOAT16, FLOAT32, Channel, ChannelError, Region
from autoloop.harness.checkpoint import build_from_checkpoint, read_checkpoint


def _last_line(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def serve(model, channel: Channel, region: Region, device: torch.device, vocab_size: int = 0) -> None:
    """Answer batches until the scorer says goodbye. Only the vocabulary's columns are sent
    (a padded lm_head's extra columns are never scored), as bf16 when the model's logits
    are bf16 (under autocast on a GPU) and as float32 otherwise."""
    autocast = (torch.autocast(device_type="cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())
    staging = {FLOAT32: torch.frombuffer(region.map, dtype=torch.float32),  # the region, as a flat tensor
               BFLOAT16: torch.frombuffer(region.map, dtype=torch.bfloat16)}
    while True:
        request = channel.next_request()
        if request is None:
            return
        batch_id, b, t, raw = request
        tokens = np.frombuffer(raw, dtype=np.int32)
        if tokens.size != b * t:
            raise ChannelError(f"a batch of {b} x {t} came with {tokens.size} tokens")
        idx = torch.from_numpy(tokens.astype(np.int64).reshape(b, t)).to(device)
        try:
            with torch.no_grad(), autocast:
                logits = model(idx)
            if not isinstance(logits, torch.Tensor) or logits.ndim != 3 or tuple(logits.shape[:2]) != (b, t):
                raise ValueError(f"model(idx) must return (B, T, vocab) logits; got {type(logits).__name__} "
                                 f"{tuple(getattr(logits, 'shape', ()))} for input {(b, t)}")
            rows = logits.reshape(b * t, logits.size(-1))
            if 0 < vocab_size <= rows.size(1):
                rows = rows[:, :vocab_size]
        except Exception as exc:  # noqa: BLE001 - the trial's forward may raise anything
            channel.error(f"the model's forward failed: {_last_line(exc)}")
            continue
        width = rows.size(1)
        dtype = BFLOAT16 if rows.dtype == torch.bfloat16 else FLOAT32
        flat = staging[dtype]
        per_chunk = max(1, flat.numel() // max(width, 1))
        for row0 in range(0, b * t, per_chunk):
            n = min(per_chunk, b * t - row0)
            flat[: n * width].view(n, width).copy_(rows[row0 : row0 + n])
            channel.chunk(batch_id, row0, n, width, dtype)
        channel.done(batch_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoloop.harness.model_server", description=__doc__.splitlines()[0])
    parser.add_argument("--train-py", required=True, help="the trial's train.py (a copy from its commit)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the device the trial trained on")
    parser.add_argument("--checkpoint-fd", type=int, required=True, help="an inherited descriptor of the checkpoint")
    parser.add_argument("--channel-fd", type=int, required=True, help="this process's end of the channel")
    parser.add_argument("--region-fd", type=int, required=True, help="the shared output region")
    args = parser.parse_args(argv)
    channel = Channel(args.channel_fd)
    region = Region(args.region_fd)
    device = torch.device(args.device)
    try:
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("the trial trained on CUDA but the evaluation's model process sees no CUDA device")
        with os.fdopen(args.checkpoint_fd, "rb", closefd=True) as handle:
            checkpoint = read_checkpoint(handle, "the trial's checkpoint")
        model = build_from_checkpoint(args.train_py, checkpoint, device)
        params = sum(p.numel() for p in model.parameters())
    except Exception as exc:  # noqa: BLE001 - importing train.py and build_model run the trial's code
        channel.error(f"cannot rebuild the model from train.py and its checkpoint: {_last_line(exc)}")
        return 0
    vocab_size = int(checkpoint["config"].get("vocab_size") or 0)
    channel.ready(vocab_size, params)
    try:
        serve(model, channel, region, device, vocab_size)
    except ChannelError as exc:
        print(f"model process: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.stdout.flush()
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip torch's teardown: the scorer has what it needs
