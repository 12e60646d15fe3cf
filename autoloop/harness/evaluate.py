"""The scorer of a split evaluation: the harness's val_bpb of a trial's model, computed by a
process that runs no code of the trial.

    python -m autoloop.harness.evaluate --data-dir DIR --device cpu|cuda --splits val[,heldout] \
        --channel-fd N --region-fd R --verdict-fd V

Under the controller every trial's metric comes from here (training runs with
AUTOLOOP_EVAL=external and never evaluates). The trial's model runs in another process,
autoloop.harness.model_server, sandboxed with no data file and nothing writable that
outlives it; the controller's side (autoloop.measure.evaluation) starts both and connects
them (autoloop.harness.channel). This process:

1. holds the splits: it loads the dataset and builds the fixed evaluation windows of each
   split it is asked for (val; held-out too for a keep candidate);
2. plans the batches (autoloop.harness.scoring): the scored batches, the same as
   `evaluate_bpb`'s, and causality probes of the same shape made of the same windows,
   all in one order drawn from the operating system's randomness;
3. sends each batch's tokens to the model process and reads its outputs back, checking
   every header and every value (a frame out of order, a width that is not the
   vocabulary's, NaN or inf: the trial's failure);
4. computes the loss itself (float32 rows: numpy on a CPU, autoloop.harness.logits, so this
   process never imports torch there; the metric's `target_nats` on a GPU), compares each
   probe with its scored window, and writes the verdict JSON to the verdict descriptor (a
   pipe the controller's side owns: nothing the model process can reach).

The verdict is `{"ok", "reason", "stage", "val_bpb", "heldout_bpb", "causality",
"splits", "device", "arithmetic" (numpy or torch), "model", "batches", "seconds" {startup,
ready, score, total}, "harness_fingerprint"}`; exit 0 whenever a verdict was written, pass
or fail; 2 when the data itself is broken (the controller reports that, not the trial).
Only numpy and the standard library are used on a CPU, torch too on a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import sys
import time
from pathlib import Path

import numpy as np

from autoloop.harness.channel import BFLOAT16, Channel, ChannelError, ModelFailed, Region
from autoloop.harness.constants import FP32_TOLERANCE, LOW_PRECISION_TOLERANCE
from autoloop.harness.data import load_dataset
from autoloop.harness.errors import HarnessError
from autoloop.harness.fingerprint import compute_harness_fingerprint
from autoloop.harness.logits import NumpyLogits
from autoloop.harness.probe_power import MAX_PROBE_FACTOR, peek_fraction_from_losses, power_record, probe_plan
from autoloop.harness.scoring import Causality, make_plan
from autoloop.harness.windows import evaluation_windows

# val and held-out bpb equal to this many significant digits are not two measurements.
IDENTITY_DIGITS = 9
SPLIT_CHOICES = ("val", "heldout")
BATCH_SIZE = {"cpu": 16, "cuda": 32}  # as evaluate_bpb's
# How long the scorer waits for the model process's answer to one batch (the controller's
# deadline for the whole evaluation is the hard bound).
BATCH_TIMEOUT_SECONDS = 900.0


def suspicious_identity(val_bpb: float | None, heldout_bpb: float | None) -> str | None:
    """A reason when val and held-out bpb agree to IDENTITY_DIGITS significant digits.

    The two splits are different text: their bpb differ in the 2nd or 3rd digit for any
    real model. Equality to 9 digits means one number was produced for both."""
    if val_bpb is None or heldout_bpb is None:
        return None
    if not (math.isfinite(val_bpb) and math.isfinite(heldout_bpb)):
        return None
    if f"{val_bpb:.{IDENTITY_DIGITS}g}" != f"{heldout_bpb:.{IDENTITY_DIGITS}g}":
        return None
    return (f"val_bpb and held-out bpb are identical to {IDENTITY_DIGITS} digits ({val_bpb:.{IDENTITY_DIGITS}g}): "
            "two different splits never score the same, so the evaluation was not the harness's")


def _process_age() -> float | None:
    """Seconds since this process was created (interpreter start-up and imports), Linux only."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class _Failed(Exception):
    """The trial's model failed the evaluation (a reason for the verdict)."""


def _outputs(channel: Channel, region: Region, batch_id: int, b: int, t: int, vocab_size: int, logits):
    """The model's (B*T, vocab) outputs for the batch just sent, in float32, checked."""
    rows, next_row, width_seen = [], 0, None
    while True:
        head = channel.expect_chunk(batch_id, next_row, b * t, vocab_size, region.size)
        if head is None:
            break
        n, width, dtype = head
        if width_seen is not None and width != width_seen:
            raise ChannelError("the model's outputs changed width within a batch")
        width_seen = width
        # Copied out before the acknowledgement: the model process may write the region again.
        rows.append(logits.read(region.map, n, width, dtype == BFLOAT16, vocab_size))
        channel.ack()
        next_row += n
    out = logits.join(rows)
    if not logits.all_finite(out):
        raise _Failed("the model's outputs contain NaN or infinite values")
    return out


def arithmetic_for(device_name: str, token_bytes: np.ndarray, choice: str | None = None):
    """numpy on a CPU (the scorer then never imports torch), torch on the trial's GPU.
    `choice` ("numpy" or "torch") forces one: the tests compare the two on one model."""
    if choice == "numpy" or (choice is None and device_name != "cuda"):
        return NumpyLogits(token_bytes)
    import torch

    from autoloop.harness.logits_torch import TorchLogits

    on_gpu = device_name == "cuda" and torch.cuda.is_available()
    if choice is None and not on_gpu:
        return NumpyLogits(token_bytes)
    return TorchLogits(token_bytes, torch.device("cuda" if on_gpu else "cpu"))


def evaluate(channel: Channel, region: Region, *, data_dir: Path | None, device_name: str,
             splits: tuple[str, ...] = ("val",), seed: int | None = None, probe_batches: int | None = None,
             power: bool = False, probe_noise: float | None = None, probe_factor: int = MAX_PROBE_FACTOR,
             arithmetic: str | None = None) -> dict:
    """Run the plan against the model process; returns the verdict (never raises for a trial's fault).

    `power`: as many probes as catch a next-token peek worth `probe_noise` bpb (the run's
    paired noise; None: unknown, so the most the cap allows) with probability 95%
    (autoloop.harness.probe_power), at most `probe_factor` x the scored windows; otherwise
    the default share. `arithmetic`: "numpy" or "torch" instead of the device's (arithmetic_for)."""
    seconds: dict[str, float | None] = {"startup": _process_age()}
    verdict: dict = {
        "ok": False, "reason": None, "stage": "load", "val_bpb": None, "heldout_bpb": None, "causality": None,
        "splits": list(splits), "device": device_name, "model": None, "batches": 0, "seconds": seconds,
        "harness_fingerprint": compute_harness_fingerprint(),
    }
    started = time.perf_counter()
    ds = load_dataset(data_dir)
    windows = {split: evaluation_windows(ds.split(split), device_name) for split in splits}
    vocab = ds.vocab_size
    seed = secrets.randbits(63) if seed is None else seed
    table = np.asarray(ds.token_bytes)
    logits = arithmetic_for(device_name, table, arithmetic)
    verdict["arithmetic"] = logits.name
    targets = np.concatenate([w[:, 1:].reshape(-1) for w in windows.values()])
    counted = table[targets] > 0
    bytes_per_token = float(table[targets][counted].sum()) / max(int(counted.sum()), 1)
    probe_rows, f_min = (probe_plan(probe_noise, bytes_per_token, vocab, sum(len(w) for w in windows.values()),
                                    factor=probe_factor) if power else (None, None))
    plan = make_plan(windows, BATCH_SIZE["cuda" if device_name == "cuda" else "cpu"], vocab, seed,
                     probe_batches=probe_batches, probe_rows=probe_rows)
    causality = Causality(LOW_PRECISION_TOLERANCE if device_name == "cuda" else FP32_TOLERANCE)
    totals = {split: [0.0, 0] for split in splits}
    target_bits: list[np.ndarray] = []  # every counted target's loss, for the power's sharper bound
    seconds["load"] = time.perf_counter() - started

    verdict["stage"] = "ready"
    started = time.perf_counter()
    try:
        verdict["model"] = channel.wait_ready()
    except ModelFailed as exc:
        verdict["reason"] = str(exc)[:500]
        return verdict
    except ChannelError as exc:
        verdict["reason"] = f"the model process ended before it was ready ({exc}; see its log)"
        return verdict
    seconds["ready"] = time.perf_counter() - started

    verdict["stage"] = "score"
    started = time.perf_counter()
    length = next(iter(windows.values())).shape[1] - 1
    try:
        for batch_id, batch in enumerate(plan.batches):
            b, t = batch.tokens.shape
            channel.request(batch_id, batch.tokens)
            out = _outputs(channel, region, batch_id, b, t, vocab, logits)
            verdict["batches"] = batch_id + 1
            lse = logits.logsumexp(out)  # once per batch: thousands of probe rows read it
            if batch.kind == "scored":
                nats, nbytes, bits = logits.scored(out, batch.targets, lse)
                totals[batch.split][0] += nats
                totals[batch.split][1] += nbytes
                target_bits.append(bits)
                for k in range(b):
                    for row in plan.by_source.get((batch.split, batch.first + k), ()):
                        at = slice(k * t + row.lo, k * t + row.cut + 1)
                        row.base = logits.witness(out[at], row.witnesses, lse[at])
                        causality.record(row)
            else:
                for k, row in enumerate(batch.rows):
                    at = slice(k * t + row.lo, k * t + row.cut + 1)
                    row.probe = logits.witness(out[at], row.witnesses, lse[at])
                    causality.record(row)
    except ModelFailed as exc:
        verdict["reason"] = str(exc)[:500]
        return verdict
    except _Failed as exc:
        verdict["reason"] = str(exc)
        return verdict
    except ChannelError as exc:
        verdict["reason"] = f"the model process broke the evaluation's protocol: {exc} (see its log)"
        return verdict
    finally:
        channel.bye()
    seconds["score"] = time.perf_counter() - started
    verdict["causality"] = causality.as_dict(plan.seed, length)
    bits = np.concatenate(target_bits) if target_bits else np.zeros(0)
    f_losses = (peek_fraction_from_losses(bits, sum(n for _, n in totals.values()), probe_noise)
                if probe_noise is not None and probe_noise > 0 else None)
    verdict["causality"]["power"] = power_record(noise_bpb=probe_noise, bytes_per_token=bytes_per_token,
                                                 vocab_size=vocab, tested=causality.tested, f_min=f_min,
                                                 f_losses=f_losses)
    for split, (nats, nbytes) in totals.items():
        if nbytes == 0:
            raise HarnessError(f"the {split} evaluation set has no bytes to score: prepare the dataset again")
        verdict["val_bpb" if split == "val" else "heldout_bpb"] = nats / (math.log(2) * nbytes)
    if not causality.ok:
        verdict["stage"], verdict["reason"] = "causality", causality.reason(length)
        return verdict
    identical = suspicious_identity(verdict["val_bpb"], verdict["heldout_bpb"])
    if identical:
        verdict["reason"] = identical
        return verdict
    verdict["ok"], verdict["stage"] = True, "done"
    return verdict


def parse_splits(text: str) -> tuple[str, ...]:
    splits = tuple(part.strip() for part in text.split(",") if part.strip())
    bad = [s for s in splits if s not in SPLIT_CHOICES]
    if not splits or bad or len(set(splits)) != len(splits):
        raise argparse.ArgumentTypeError(f"--splits takes val and/or heldout, comma-separated, not {text!r}")
    return splits


def _noise(text: str) -> float | None:
    if text == "unknown":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"--probe-noise takes a bpb figure >= 0 or 'unknown', not {text!r}")
    return value


def _factor(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--probe-factor takes a whole number >= 1, not {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoloop.harness.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=None, help="the prepared dataset; the default one if omitted")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the device the trial trained on")
    parser.add_argument("--splits", type=parse_splits, default=("val",), help="splits to evaluate: val or val,heldout")
    parser.add_argument("--channel-fd", type=int, required=True, help="this process's end of the channel")
    parser.add_argument("--region-fd", type=int, required=True, help="the shared output region")
    parser.add_argument("--verdict-fd", type=int, required=True, help="where the verdict JSON goes")
    parser.add_argument("--probe-batches", type=int, default=None, help="causality probe batches (default: harness's)")
    parser.add_argument("--probe-noise", type=_noise, default=False,
                        help="probes with power: enough to catch a next-token peek worth this many bpb (the run's "
                             "paired noise, or 'unknown' for the most the cap allows) with probability 95%%")
    parser.add_argument("--probe-factor", type=_factor, default=MAX_PROBE_FACTOR,
                        help="with --probe-noise: probe rows at most this many times the scored windows (the cap)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    channel = Channel(args.channel_fd, timeout=BATCH_TIMEOUT_SECONDS)
    region = Region(args.region_fd)
    try:
        verdict = evaluate(channel, region, data_dir=args.data_dir, device_name=args.device, splits=args.splits,
                           probe_batches=args.probe_batches, power=args.probe_noise is not False,
                           probe_noise=args.probe_noise if args.probe_noise is not False else None,
                           probe_factor=args.probe_factor)
    except HarnessError as exc:  # the data, not the trial: say so and let the controller report it
        print(f"ERROR: {exc}", flush=True)
        return 2
    verdict["seconds"]["total"] = time.perf_counter() - started
    with os.fdopen(args.verdict_fd, "w") as out:
        out.write(json.dumps(verdict, default=float) + "\n")
    figures = ", ".join(f"{k} {verdict[k]:.6f}" for k in ("val_bpb", "heldout_bpb") if verdict[k] is not None)
    print(f"evaluation {'passed' if verdict['ok'] else 'failed'} at stage {verdict['stage']}: "
          f"{verdict['reason'] or 'ok'}" + (f" ({figures})" if figures else ""), flush=True)
    return 0


if __name__ == "__main__":
    _code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_code)
