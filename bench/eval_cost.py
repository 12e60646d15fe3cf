"""What evaluating every trial in a separate process costs, against evaluating in-process.

    python bench/eval_cost.py                    # CPU scale, 3 repeats
    python bench/eval_cost.py --repeats 5 --trial-seconds 300

Under the controller train.py no longer evaluates (AUTOLOOP_EVAL=external); a separate
process (python -m autoloop.harness.evaluate, run by autoloop.trust.evaluation.evaluate_checkpoint
through the runner) rebuilds the model from train.py and the checkpoint and evaluates it.
The evaluation itself moves from one process to the other; what is added per trial is the
second process: interpreter start-up and imports (torch), the seal, rebuilding the model
(import train.py, build, load the checkpoint) and writing the verdict.

Measured here, at the CPU scale (the real train.py's CPU model, freshly initialised: eval
cost does not depend on the weights):
* in-process: `evaluate_bpb` on val in this process, as train.py does it;
* separate: `evaluate_checkpoint` (val only, as for every trial), wall time from spawn to
  exit, with the worker's own breakdown (startup = process age when the worker starts,
  from /proc; seal; import = rebuild; val); and once more as a keep candidate (causality,
  val and held-out).
Estimated for the GPU scale from measured parts:
* start-up, imports and seal: as measured (the same interpreter and libraries), plus
  --cuda-init-seconds for the CUDA context (an assumption: not measurable without a GPU);
* rebuild: measured here with the GPU-scale model (train.py's CUDA constants) built and
  loaded on the CPU (on a GPU the weights are materialised there instead: about as fast);
* evaluation: EVAL_TOKENS["cuda"] x forward FLOPs per token / (bf16 peak x --gpu-mfu),
  the peak of --gpu (autoloop.harness.gpu_peak_flops). It moves out of the training
  process, so it is not an added cost; it is printed so the total is visible.
The one-off cost of filling the evaluator's bytecode cache (once per controller start) is
printed separately.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def gpu_scale_source(source: str) -> str:
    """train.py with its CPU block disabled, so model_config() gives the CUDA-scale model."""
    return re.sub(r'^if DEVICE_TYPE == "cpu":', "if False:", source, count=1, flags=re.M)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-py", type=Path, default=ROOT / "train.py", help="the training script to measure")
    parser.add_argument("--repeats", type=int, default=3, help="separate evaluations to time (the median is shown)")
    parser.add_argument("--trial-seconds", type=float, default=300.0, help="the trial length the share is of")
    parser.add_argument("--gpu", default="NVIDIA H100 80GB HBM3", help="GPU whose bf16 peak the estimate uses")
    parser.add_argument("--gpu-mfu", type=float, default=0.3, help="assumed model FLOPs utilisation of the evaluation")
    parser.add_argument("--cuda-init-seconds", type=float, default=1.5, help="assumed CUDA context start-up")
    args = parser.parse_args()

    import torch

    from autoloop import harness as H
    from autoloop.trust.bytecode import warm_eval_cache
    from autoloop.trust.evaluation import evaluate_checkpoint
    from autoloop.harness.constants import EVAL_TOKENS

    ds = H.load_dataset()
    with tempfile.TemporaryDirectory(prefix="autoloop-evalcost-") as tmp:
        tmp = Path(tmp)
        cache = tmp / "cache"
        source_dir = tmp / "source"
        source_dir.mkdir()
        (source_dir / "train.py").write_text(args.train_py.read_text())
        module = H.import_train_module(source_dir / "train.py")
        config = module.model_config(vocab_size=ds.vocab_size, seq_len=H.seq_len("cpu"))
        model = module.build_model(config, device="cpu")
        checkpoint = tmp / "checkpoint.pt"
        H.save_checkpoint(checkpoint, model, config)
        params = sum(p.numel() for p in model.parameters())

        in_process = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            H.evaluate_bpb(model, ds, "val", device="cpu", batch_size=getattr(module, "EVAL_BATCH_SIZE", None))
            in_process.append(time.perf_counter() - started)
        in_process_s = statistics.median(in_process)

        started = time.perf_counter()
        warm_eval_cache(sys.executable, cache)
        warm_s = time.perf_counter() - started

        def separate(**kwargs):
            result = evaluate_checkpoint(
                python=sys.executable, repo_dir=tmp, source_dir=source_dir, checkpoint=checkpoint,
                data_dir=ds.path, device="cpu", out_dir=tmp / "out", deadline_seconds=600, cache_root=cache, **kwargs)
            if not result.ok:
                sys.exit(f"the evaluation failed: {result.reason}")
            return result

        runs = [separate(splits=("val",)) for _ in range(args.repeats)]
        keep = separate(splits=("val", "heldout"), causality=True)

        def part(name: str) -> float:
            return statistics.median(float(r.fields["seconds"].get(name) or 0.0) for r in runs)

        wall = statistics.median(r.seconds for r in runs)
        startup, seal, rebuild, val = part("startup"), part("seal"), part("import"), part("val")
        other = max(0.0, wall - startup - seal - rebuild - val)  # verdict writing, exit, runner polling
        added_cpu = wall - in_process_s

        # GPU scale: the same process costs, the GPU model's rebuild, the evaluation from FLOPs.
        gpu_dir = tmp / "gpu"
        gpu_dir.mkdir()
        (gpu_dir / "train.py").write_text(gpu_scale_source(args.train_py.read_text()))
        gpu_module = H.import_train_module(gpu_dir / "train.py")
        gpu_config = gpu_module.model_config(vocab_size=ds.vocab_size, seq_len=H.seq_len("cuda"))
        with torch.device("meta"):
            gpu_meta = gpu_module.GPT(gpu_config)
        gpu_params = sum(p.numel() for p in gpu_meta.parameters())
        fwd_flops = gpu_module.flops_per_token(gpu_meta) / 3  # train FLOPs = forward + 2 x backward
        state = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in gpu_meta.state_dict().items()}
        gpu_ckpt = gpu_dir / "checkpoint.pt"
        torch.save({"format": "autoloop-checkpoint/1", "config": gpu_config, "state_dict": state}, gpu_ckpt)
        del state
        started = time.perf_counter()
        H.load_trained_model(gpu_dir / "train.py", gpu_ckpt, "cpu")
        gpu_rebuild = time.perf_counter() - started
        peak = H.gpu_peak_flops(args.gpu) or 989e12
        gpu_eval = EVAL_TOKENS["cuda"] * fwd_flops / (peak * args.gpu_mfu)
        added_gpu = startup + seal + other + gpu_rebuild + args.cuda_init_seconds

    share = 100 / args.trial_seconds
    print(f"train.py: {args.train_py}  (CPU model {params:,} parameters; GPU model {gpu_params:,})")
    print(f"median of {args.repeats}; shares are of a {args.trial_seconds:g} s trial\n")
    print("CPU scale (measured)")
    print(f"  in-process val evaluation            {in_process_s:7.2f} s")
    print(f"  separate evaluation, wall            {wall:7.2f} s   (val only, every trial)")
    print(f"    start-up + imports                 {startup:7.2f} s")
    print(f"    seal                               {seal:7.2f} s")
    print(f"    rebuild (import train.py, load)    {rebuild:7.2f} s")
    print(f"    val evaluation                     {val:7.2f} s")
    print(f"    verdict, exit, runner              {other:7.2f} s")
    print(f"  added per trial (separate - in-proc) {added_cpu:7.2f} s   {added_cpu * share:5.2f} %")
    print(f"  keep candidate (causality+val+held)  {keep.seconds:7.2f} s   {keep.seconds * share:5.2f} %")
    print(f"  one-off: fill the evaluator's bytecode cache {warm_s:.2f} s per controller start\n")
    print(f"GPU scale (estimated: {args.gpu}, MFU {args.gpu_mfu:g}, CUDA init {args.cuda_init_seconds:g} s assumed)")
    print(f"  start-up + imports + seal + exit     {startup + seal + other:7.2f} s   (as measured)")
    print(f"  CUDA context                         {args.cuda_init_seconds:7.2f} s   (assumed)")
    print(f"  rebuild of the GPU model (on CPU)    {gpu_rebuild:7.2f} s")
    print(f"  val evaluation ({EVAL_TOKENS['cuda']:,} tokens)     {gpu_eval:7.2f} s   (moves out of training: not added)")
    print(f"  added per trial                      {added_gpu:7.2f} s   {added_gpu * share:5.2f} %")
    print(f"  keep candidate extra (held-out)      {gpu_eval:7.2f} s   {gpu_eval * share:5.2f} %")


if __name__ == "__main__":
    main()
