"""What the split evaluation costs per trial, against evaluating in the training process.

    python bench/eval_cost.py                    # CPU scale, 3 repeats
    python bench/eval_cost.py --repeats 5 --trial-seconds 300

Under the controller train.py no longer evaluates (AUTOLOOP_EVAL=external). Two processes
do (autoloop.measure.evaluation): the model process imports the trial's train.py, rebuilds
the model and runs its forward on the windows it is sent; the scorer holds the data,
computes the loss and mixes causality probes among the scored batches. What is added per
trial, against train.py evaluating itself, is: the two processes' start-up and imports
(they start together, so they overlap), the model's rebuild, moving its outputs through
the shared region (the model writes its logits, float32 or a GPU's bf16, the scorer copies
them out), and the probe batches.

Measured here, at the CPU scale (the real train.py's CPU model, freshly initialised: the
cost does not depend on the weights):
* in-process: `evaluate_bpb` on val in this process, as train.py does it;
* split: `evaluate_checkpoint` (val only, as for every trial), spawn to the scorer's exit,
  with the scorer's own breakdown (startup, load, waiting for the model, scoring); and once
  more as a keep candidate (val and held-out);
* the channel: bytes moved per second through a shared region, model side and scorer side
  (numpy copies of the same sizes as a GPU batch's logits).
Estimated for the GPU scale from measured parts and stated bandwidths:
* start-up: as measured, plus --cuda-init-seconds for each process's CUDA context (the two
  start together; counted once);
* outputs: EVAL_TOKENS["cuda"] x the vocabulary x 2 bytes (bf16 logits as autocast made
  them; the padded lm_head's extra columns are not sent), moved device -> host in
  the model process (into the region) and host -> device in the scorer (out of the region,
  straight onto its device) at --pcie-gb-s; the measured host rate is the CPU path's;
* probes: their share of the forward passes (scoring.py: 2% of the batches, at least 2),
  the forward at --gpu-mfu of the GPU's bf16 peak.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def region_rate(total_bytes: int, repeats: int = 3) -> float:
    """Bytes per second through a shared region: a writer's copy in, a reader's copy out."""
    import numpy as np

    from autoloop.harness.channel import Region, make_region

    fd = make_region(total_bytes)
    region = Region(fd)
    source = np.random.default_rng(0).standard_normal(total_bytes // 4, dtype=np.float32)
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        view = np.frombuffer(region.map, dtype=np.float32, count=source.size)
        view[:] = source  # the model's write
        out = view.copy()  # the scorer's copy out
        best = min(best, time.perf_counter() - started)
        del view, out
    region.close()
    import os

    os.close(fd)
    return total_bytes / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-py", type=Path, default=ROOT / "train.py", help="the training script to measure")
    parser.add_argument("--repeats", type=int, default=3, help="split evaluations to time (the median is shown)")
    parser.add_argument("--trial-seconds", type=float, default=300.0, help="the trial length the share is of")
    parser.add_argument("--gpu", default="NVIDIA H100 80GB HBM3", help="GPU whose bf16 peak the estimate uses")
    parser.add_argument("--gpu-mfu", type=float, default=0.3, help="assumed model FLOPs utilisation of the forward")
    parser.add_argument("--cuda-init-seconds", type=float, default=1.5, help="assumed CUDA context start-up")
    parser.add_argument("--pcie-gb-s", type=float, default=20.0, help="assumed host<->device copy rate, GB/s")
    parser.add_argument("--vocab", type=int, default=257,
                        help="the vocabulary at the GPU scale: the columns sent (a padded lm_head's extra ones are not)")
    args = parser.parse_args()

    from autoloop import harness as H
    from autoloop.harness.constants import EVAL_TOKENS, seq_len
    from autoloop.harness.scoring import MIN_PROBE_BATCHES, PROBE_SHARE
    from autoloop.trust.bytecode import pycache_env, warm_pycache
    from autoloop.measure.evaluation import evaluate_checkpoint

    ds = H.load_dataset()
    with tempfile.TemporaryDirectory(prefix="autoloop-evalcost-") as tmp:
        tmp = Path(tmp)
        cache = tmp / "cache"
        source_dir = tmp / "source"
        source_dir.mkdir()
        (source_dir / "train.py").write_text(args.train_py.read_text())
        module = H.import_train_module(source_dir / "train.py")
        config = module.model_config(vocab_size=ds.vocab_size, seq_len=seq_len("cpu"))
        model = module.build_model(config, device="cpu")
        run = tmp / "run"
        H.save_checkpoint(run / "out" / "checkpoint.pt", model, config)
        params = sum(p.numel() for p in model.parameters())

        in_process = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            H.evaluate_bpb(model, ds, "val", device="cpu", batch_size=16)
            in_process.append(time.perf_counter() - started)
        in_process_s = statistics.median(in_process)

        started = time.perf_counter()
        warm_pycache("eval", sys.executable, cache)
        warm_s = time.perf_counter() - started

        def split(n: int, **kwargs):
            result = evaluate_checkpoint(
                python=sys.executable, project_dir=tmp, source_dir=source_dir, script="train.py",
                checkpoint_base=run, checkpoint="out/checkpoint.pt", data_dir=ds.path, device="cpu",
                out_dir=tmp / f"out{n}", deadline_seconds=600, pycache=pycache_env("eval", cache), cache=cache,
                **kwargs)
            if not result.ok:
                sys.exit(f"the evaluation failed: {result.reason}")
            return result

        runs = [split(k, splits=("val",)) for k in range(args.repeats)]
        keep = split(99, splits=("val", "heldout"))

        def part(name: str) -> float:
            return statistics.median(float(r.fields["seconds"].get(name) or 0.0) for r in runs)

        wall = statistics.median(r.seconds for r in runs)
        startup, load, ready, score = part("startup"), part("load"), part("ready"), part("score")
        batches = statistics.median(r.fields["batches"] for r in runs)
        probes = statistics.median(r.fields["causality"]["probes"] for r in runs)
        added_cpu = wall - in_process_s

        # GPU scale, from the measured parts.
        gpu_tokens = EVAL_TOKENS["cuda"]
        gpu_batch = 32 * seq_len("cuda")
        # bf16 under autocast: the model process sends its logits as they are (2 bytes each).
        per_batch_bytes = gpu_batch * args.vocab * 2
        rate = region_rate(min(per_batch_bytes, 256 << 20))
        out_bytes = gpu_tokens * args.vocab * 2
        scored = math.ceil(gpu_tokens / gpu_batch)
        probe_batches = max(MIN_PROBE_BATCHES, math.ceil(PROBE_SHARE * scored))
        # Model: device -> region; scorer: region -> device (autoloop.harness.evaluate copies
        # straight onto its device): two PCIe crossings, no host-side copy on the GPU path.
        transfer = 2 * out_bytes / (args.pcie_gb_s * 1e9)
        with __import__("torch").device("meta"):
            gpu_model = _gpu_module(args.train_py, tmp).GPT(_gpu_config(args.train_py, tmp, ds))
        fwd_flops = H.flops_per_token(gpu_model) / 3  # train = fwd + 2 x bwd
        peak = H.gpu_peak_flops(args.gpu) or 989e12
        forward = gpu_tokens * fwd_flops / (peak * args.gpu_mfu)
        probe_cost = forward * probe_batches / scored
        added_gpu = startup + args.cuda_init_seconds + transfer + probe_cost

    share = 100 / args.trial_seconds
    print(f"train.py: {args.train_py}  (CPU model {params:,} parameters)")
    print(f"median of {args.repeats}; shares are of a {args.trial_seconds:g} s trial\n")
    print("CPU scale (measured)")
    print(f"  in-process val evaluation                 {in_process_s:7.2f} s")
    print(f"  split evaluation, spawn to verdict        {wall:7.2f} s   (val only, every trial)")
    print(f"    scorer start-up + imports               {startup:7.2f} s")
    print(f"    scorer loads the data                   {load:7.2f} s")
    print(f"    waiting for the model process to build  {ready:7.2f} s   (started together: overlaps)")
    print(f"    scoring {batches:.0f} batches ({probes:.0f} probed windows) {score:7.2f} s")
    print(f"  added per trial (split - in-process)      {added_cpu:7.2f} s   {added_cpu * share:5.2f} %")
    print(f"  keep candidate (val and held-out)         {keep.seconds:7.2f} s   {keep.seconds * share:5.2f} %")
    print(f"  the shared region, host copies in and out {rate / 1e9:7.2f} GB/s (measured)")
    print(f"  one-off: fill the evaluator's bytecode prefix {warm_s:.2f} s per project\n")
    print(f"GPU scale (estimated: {args.gpu}, MFU {args.gpu_mfu:g}, CUDA init {args.cuda_init_seconds:g} s, "
          f"PCIe {args.pcie_gb_s:g} GB/s, {args.vocab} columns of bf16)")
    print(f"  start-up + imports (measured) + CUDA init {startup + args.cuda_init_seconds:7.2f} s")
    print(f"  outputs: {out_bytes / 1e9:.1f} GB device->host->region->device {transfer:7.2f} s")
    print(f"  probes: {probe_batches} of {scored} batches' forward        {probe_cost:7.2f} s   "
          f"(the forward itself, {forward:.2f} s, moves out of training)")
    print(f"  added per trial                           {added_gpu:7.2f} s   {added_gpu * share:5.2f} %")
    print(f"  added per trial (split - in-proc)  {added_gpu:.2f} s")  # read by bench/trust_cost.py
    print(f"  added per trial (CPU) {added_cpu:.2f} s")


def _gpu_module(train_py: Path, tmp: Path):
    """train.py with its CPU block disabled, so model_config() gives the CUDA-scale model."""
    import re

    from autoloop import harness as H

    folder = tmp / "gpu"
    folder.mkdir(exist_ok=True)
    (folder / "train.py").write_text(re.sub(r'^if DEVICE_TYPE == "cpu":', "if False:", train_py.read_text(), count=1,
                                            flags=re.M))
    return H.import_train_module(folder / "train.py")


def _gpu_config(train_py: Path, tmp: Path, ds) -> dict:
    from autoloop.harness.constants import seq_len

    return _gpu_module(train_py, tmp).model_config(vocab_size=ds.vocab_size, seq_len=seq_len("cuda"))


if __name__ == "__main__":
    main()
