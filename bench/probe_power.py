"""Probes with power: the plan's figures, and what a keep's verification costs with them.

    python bench/probe_power.py                       # the table, and the CPU cost (1 repeat)
    python bench/probe_power.py --noise 0.002 --repeats 3
    python bench/probe_power.py --no-measure          # the arithmetic only

Prints, for the CPU scale (this machine's default dataset) and the GPU scale (the stated
vocabulary and bytes per token, an estimate), what autoloop.harness.probe_power plans at
the given paired noise: the smallest peeked fraction worth the noise (f_min), the probes
that catch it with probability 95%, the probes sent (capped), and the power they give.
Then, measured on the CPU with the real train.py's CPU model (freshly initialised: the
cost does not depend on the weights), a keep's verification evaluation (val and held-out)
with the default probes and with probes with power, and the --no-verify re-check (val,
probes with power).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def plan_line(label: str, noise: float, bytes_per_token: float, vocab: int, scored: int) -> str:
    from autoloop.harness import probe_power as P

    sent, f_min = P.probe_plan(noise, bytes_per_token, vocab, scored)
    needed = P.probes_needed(f_min)
    return (f"{label:<44} f_min {f_min:8.4%}  needed {needed:>7,}  sent {sent:>7,} ({sent / scored:5.2f} x scored)  "
            f"power {P.detection_power(f_min, sent):6.1%}  95% from f = {1 - 0.05 ** (1 / sent):.4%}  "
            f"at f = 0.1%: {P.detection_power(0.001, sent):6.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--noise", type=float, default=0.001, help="the run's paired noise, bpb")
    parser.add_argument("--gpu-vocab", type=int, default=32768, help="the vocabulary at the GPU scale")
    parser.add_argument("--gpu-bytes-per-token", type=float, default=4.0, help="bytes per token at the GPU scale")
    parser.add_argument("--repeats", type=int, default=1, help="evaluations timed per setting (the median is shown)")
    parser.add_argument("--no-measure", action="store_true", help="print the arithmetic only")
    args = parser.parse_args()

    import numpy as np

    from autoloop import harness as H
    from autoloop.harness.constants import EVAL_TOKENS, seq_len
    from autoloop.harness.metric import evaluation_windows

    ds = H.load_dataset()
    table = np.asarray(ds.token_bytes)
    windows = {s: evaluation_windows(ds.split(s), "cpu") for s in ("val", "heldout")}
    targets = np.concatenate([w[:, 1:].reshape(-1) for w in windows.values()])
    bpt = float(table[targets][table[targets] > 0].mean())
    cpu_rows = sum(len(w) for w in windows.values())
    gpu_rows = 2 * EVAL_TOKENS["cuda"] // seq_len("cuda")
    print(f"paired noise {args.noise} bpb; CPU: vocabulary {ds.vocab_size}, {bpt:.2f} bytes a token, "
          f"{cpu_rows} scored windows (val + held-out)")
    print(plan_line("CPU, a keep's verification (val + held-out)", args.noise, bpt, ds.vocab_size, cpu_rows))
    print(plan_line("CPU, --no-verify's re-check (val)", args.noise, bpt, ds.vocab_size, cpu_rows // 2))
    print(plan_line(f"GPU estimate (V {args.gpu_vocab}, {args.gpu_bytes_per_token} B/token)", args.noise,
                    args.gpu_bytes_per_token, args.gpu_vocab, gpu_rows))
    if args.no_measure:
        return

    from autoloop.trust.bytecode import pycache_env, warm_pycache
    from autoloop.measure.evaluation import evaluate_checkpoint

    with tempfile.TemporaryDirectory(prefix="autoloop-probepower-") as tmp:
        tmp = Path(tmp)
        cache = tmp / "cache"
        source_dir = tmp / "source"
        source_dir.mkdir()
        (source_dir / "train.py").write_text((ROOT / "train.py").read_text())
        module = H.import_train_module(source_dir / "train.py")
        config = module.model_config(vocab_size=ds.vocab_size, seq_len=seq_len("cpu"))
        model = module.build_model(config, device="cpu")
        H.save_checkpoint(tmp / "run" / "out" / "checkpoint.pt", model, config)
        warm_pycache("eval", sys.executable, cache)
        counter = [0]

        def timed(**kwargs) -> tuple[float, dict]:
            seconds, power = [], {}
            for _ in range(args.repeats):
                counter[0] += 1
                result = evaluate_checkpoint(
                    python=sys.executable, project_dir=tmp, source_dir=source_dir, script="train.py",
                    checkpoint_base=tmp / "run", checkpoint="out/checkpoint.pt", data_dir=ds.path, device="cpu",
                    out_dir=tmp / f"out{counter[0]}", deadline_seconds=1800, pycache=pycache_env("eval", cache),
                    cache=cache, **kwargs)
                if not result.ok:
                    sys.exit(f"the evaluation failed: {result.reason}")
                seconds.append(result.seconds)
                power = (result.causality or {}).get("power") or {}
            return statistics.median(seconds), power

        plain, plain_power = timed(splits=("val", "heldout"))
        strong, strong_power = timed(splits=("val", "heldout"), probe_power=True, probe_noise=args.noise)
        recheck, recheck_power = timed(splits=("val",), probe_power=True, probe_noise=args.noise)
        print(f"measured on this CPU (median of {args.repeats}):")
        print(f"  a keep's verification, default probes:   {plain:6.1f} s  ({plain_power.get('tested_positions')} "
              "positions tested)")
        print(f"  a keep's verification, probes with power: {strong:6.1f} s  "
              f"({strong_power.get('tested_positions')} positions, power {strong_power.get('power') or 0:.1%}): "
              f"+{strong - plain:.1f} s per verified run")
        print(f"  --no-verify's re-check (val, with power): {recheck:6.1f} s  "
              f"({recheck_power.get('tested_positions')} positions, power {recheck_power.get('power') or 0:.1%})")


if __name__ == "__main__":
    main()
