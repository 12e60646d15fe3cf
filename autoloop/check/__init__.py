"""`autoloop check`: what an experienced person does before trusting a long run.

Four parts, each a dict with `status` ("ok" | "warn" | "fail" | "skipped" |
"unsupported"), a one-line `message` and its figures:

* overfit: train a fresh model on one fixed small batch until the loss is near zero.
  The loss is measured by the check itself, from the model's logits against the batch's
  true next tokens (the same contract the harness evaluates), so a script that trains on
  misaligned targets or a detached loss fails even when its own reported loss falls.
  A model that cannot memorise 512 tokens has a bug, not too little data; the other
  parts are then `skipped` (they would measure the bug).
* lr: the learning-rate range test. All parameter groups are scaled together by a
  multiplier swept exponentially over up to a few hundred steps at the training batch,
  through the model as train.py trains it (compiled and warmed up where train.py
  compiles: `prepare_training`); the smoothed loss detects the divergence (the point is
  where the raw loss crossed), and the suggested multiplier sits a factor SUGGEST_BELOW
  below it. Bounded in wall time: the first steps time a step, and the sweep is planned
  to fit LR_SECONDS (never fewer than LR_MIN_STEPS steps; a deadline stops a slower one).
  A PNG plot is written beside the JSON.
* budget: tokens/s, what the budget buys (steps, tokens, tokens per parameter against
  the compute-optimal ~20 with FLOPs ~ 6 N D), MFU and memory headroom on a GPU, and how
  many training runs fit in --hours; warnings where the plan is clearly off. The
  throughput is train.py's own where the device part ran it, else the range test's,
  which is compiled where training is (`throughput_source` says which).
* device: which SDPA kernel the model's attention runs, the usable kernels timed side
  by side at the model's shapes, whether torch.compile works here (probed in a child
  process: a missing compiler or Triton is one line, and train.py then trains eager),
  DEVICE_BATCH_SIZE by measurement (tokens/s and peak memory of a few candidates at the
  same tokens per step, within BATCH_SWEEP_SECONDS; the fastest that fits is suggested),
  and on CUDA a short real run of train.py for tokens/s, MFU and peak memory.

overfit, lr and the kernel timings need train.py's importable functions (`model_config`,
`build_model`, `build_optimizers`, `make_train_step`); a script without them (a
third-party train.py) gets "not supported by this script" for those, found by reading
its source, never by importing it (such a script may train at import).

Everything runs in this process except the compile probe and the short run. The
result is written to `.autoloop/check/check.json` (and the plot beside it) after every
part and every few range-test steps (`complete` false until the end), so a check cut
short still leaves what it measured; when the repository has a run, the whole result is
stored in `runs.check_result`.

One module per part (training: what the check trains with; overfit; lr_range; budget;
device) and run, the whole check; this package exposes what the CLI, the loop's pre-run
check and the benches call.
"""

from autoloop.check.budget import budget_plan
from autoloop.check.device import (BATCH_SWEEP_SECONDS, compile_probe, device_batch_sweep, device_health, sdpa_kernel_in_use,
                                   short_run)
from autoloop.check.lr_range import LR_MIN_STEPS, LR_RANGE, LR_SECONDS, LR_STEPS, SUGGEST_BELOW, lr_range_test, plot_lr_range
from autoloop.check.overfit import OVERFIT_MESSAGE, OVERFIT_STEPS, OVERFIT_TARGET, overfit_one_batch
from autoloop.check.run import PARTS, run_check, store_result
from autoloop.check.training import REQUIRED, choose_kernel, fresh_model, missing_interface, training_setup

__all__ = ["BATCH_SWEEP_SECONDS", "LR_MIN_STEPS", "LR_RANGE", "LR_SECONDS", "LR_STEPS", "OVERFIT_MESSAGE", "OVERFIT_STEPS",
           "OVERFIT_TARGET", "PARTS", "REQUIRED", "SUGGEST_BELOW", "budget_plan", "choose_kernel", "compile_probe",
           "device_batch_sweep", "device_health", "fresh_model", "lr_range_test", "missing_interface", "overfit_one_batch",
           "plot_lr_range", "run_check", "sdpa_kernel_in_use", "short_run", "store_result", "training_setup"]
