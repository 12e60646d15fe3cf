#!/usr/bin/env bash
# Every GPU figure autoloop cares about, in under 10 minutes, each written as soon as it is measured.
#
#   bench/gpu_check.sh [--dry-run] [OUT_DIR]
#
# Steps, each under its own `timeout` and all under one total limit (GPU_CHECK_TOTAL_SECONDS,
# 570 s): a step that hangs costs its limit, a step that no longer fits is skipped with a line.
#   env          GPU, driver, torch / CUDA / Triton versions, C compilers                    (20 s)
#   kernels      SDPA kernels available at the model's shapes, timed (fwd+bwd, median of 30),
#                and the one ATTENTION_BACKEND="auto" picks                                   (40 s)
#   train_cold   a 60 s train.py with an empty compile cache, TORCH_LOGS=recompiles: tokens/s,
#                both MFUs, peak memory, warm-up (compile) seconds, the kernel that ran     (200 s)
#   train_warm   the same with the cache the cold run filled                                (120 s)
#   profile      one compiled step under torch.profiler: the attention kernel that ran and the
#                CUDA kernel launches per optimizer step                                      (60 s)
#   check        `autoloop check --parts overfit,lr,budget` (what runs before a night): its time (150 s)
#   trial_serial one loop trial, serial executor (a 20 s baseline, one run)                  (110 s)
#   trial_workers the same with --workers 1 (the local executor: a worktree and a worker)     (110 s)
#   batch        DEVICE_BATCH_SIZE by measurement (autoloop.check.device_batch_sweep)         (90 s)
# After every step summary.json is rewritten from what exists and the step's figures are appended
# to figures.txt. --dry-run (automatic without CUDA) runs the same steps at CPU scale, skipping
# what needs CUDA with a line that says so; there each step gets twice its limit (840 s in all).
# GPU_CHECK_TRAIN_SECONDS (60; 8 without CUDA) and GPU_CHECK_TRIAL_SECONDS (20; 5) override budgets.
set -uo pipefail

dry=0
if [[ "${1:-}" == "--dry-run" ]]; then dry=1; shift; fi
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$repo/.autoloop/gpu_check/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
python="${PYTHON:-python}"
if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  dry=1
fi
if [[ $dry == 1 ]]; then
  echo "dry run: no CUDA (or --dry-run); the steps run at CPU scale and CUDA-only steps are skipped" | tee "$out/dry_run.txt"
  train_seconds="${GPU_CHECK_TRAIN_SECONDS:-8}"
  trial_seconds="${GPU_CHECK_TRIAL_SECONDS:-5}"
  # A shared CPU may be many times slower than an idle one: the same steps get twice the time.
  scale=2
  total_limit="${GPU_CHECK_TOTAL_SECONDS:-840}"
else
  train_seconds="${GPU_CHECK_TRAIN_SECONDS:-60}"
  trial_seconds="${GPU_CHECK_TRIAL_SECONDS:-20}"
  scale=1
  total_limit="${GPU_CHECK_TOTAL_SECONDS:-570}"
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export GPU_CHECK_OUT="$out" GPU_CHECK_REPO="$repo"
cache="$out/compile-cache"  # this check's own compile cache: the cold run starts from nothing
start_all=$SECONDS
: > "$out/steps.txt"
: > "$out/figures.txt"

summarise() {  # rebuild summary.json from every file the steps wrote; append the step's figures
  "$python" - "$out" "${1:-}" <<'PY'
import json, pathlib, sys
out, step = pathlib.Path(sys.argv[1]), sys.argv[2]

def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None

def train(name):
    r = load(f"{name}.json")
    if not r:
        return None
    keys = ("tokens_per_second", "mfu_percent", "mfu_percent_palm", "hfu_percent", "model_tflops", "peak_memory_mb",
            "warmup_seconds", "compile_seconds", "training_seconds", "total_seconds", "num_steps", "val_bpb", "compiled",
            "compile_error", "attention_kernel", "attention_kernel_ran", "graphs_compiled_in_training", "device",
            "device_batch_size")
    fig = {k: r.get(k) for k in keys}
    log = out / f"{name}.log"
    if log.exists():
        fig["recompile_log_lines"] = sum("Recompiling function" in line for line in log.read_text(errors="replace").splitlines())
    return fig

check = load("check.json") or {}
trials = {}
for name in ("trial_serial", "trial_workers"):
    rows = load(f"{name}_log.json")
    if isinstance(rows, list):
        wall = load(f"{name}_wall.json") or {}
        trials[name] = {"wall_seconds": wall.get("seconds"),
                        "trials": [{k: t.get(k) for k in ("number", "kind", "status", "metric", "reason", "minutes")} for t in rows]}
summary = {
    "steps": (out / "steps.txt").read_text().splitlines(),
    "env": load("env.json"),
    "kernels": load("kernels.json"),
    "train_cold": train("train_cold"),
    "train_warm": train("train_warm"),
    "profile": load("profile.json"),
    "check": {"seconds": (load("check_wall.json") or {}).get("seconds"), "complete": check.get("complete"),
              **{p: (check.get(p) or {}).get("message") for p in ("overfit", "lr", "budget")}},
    "trials": trials,
    "batch": load("batch.json"),
}
# Flat figures the old summary had (tests and scripts read them).
summary["overfit"] = summary["check"]["overfit"]
kernels = summary["kernels"] or {}
summary["sdpa_kernel_in_use"] = (summary["profile"] or {}).get("kernel_ran") or kernels.get("auto_pick")
summary["trial"] = (trials.get("trial_serial") or {}).get("trials", [])
(out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))

lines = []
def add(label, value):
    if value is not None:
        lines.append(f"{label}: {value}")
part = {"env": lambda: [add(k, v) for k, v in (summary["env"] or {}).items()],
        "kernels": lambda: [add("kernel ms (fwd+bwd, median)", kernels.get("ms")),
                            add("kernels unavailable", sorted(kernels.get("unavailable") or {}) or None),
                            add("auto picks", kernels.get("auto_pick"))],
        "profile": lambda: [add(k, v) for k, v in (summary["profile"] or {}).items()],
        "check": lambda: [add(k, v) for k, v in summary["check"].items()],
        "batch": lambda: add("batch", (summary["batch"] or {}).get("message"))}
if step in ("train_cold", "train_warm"):
    for k, v in (summary[step] or {}).items():
        add(f"{step} {k}", v)
elif step in ("trial_serial", "trial_workers"):
    add(step, trials.get(step))
elif step in part:
    part[step]()
with open(out / "figures.txt", "a") as f:
    for line in lines:
        f.write(line + "\n")
print("\n".join(f"   = {line}" for line in lines))
PY
}

step() {  # step NAME LIMIT COMMAND...: under timeout (within the total limit), logged to NAME.log, timed
  local name=$1 limit=$(($2 * scale)); shift 2
  local left=$((total_limit - (SECONDS - start_all)))
  if (( left < 15 )); then skip "$name" "the ${total_limit} s total limit is reached"; return; fi
  (( limit > left )) && limit=$left
  local t0=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local line="$name: rc=$rc seconds=$((SECONDS - t0))"
  [[ $rc == 124 || $rc == 137 ]] && line+=" TIMED OUT"
  echo "$line" >> "$out/steps.txt"
  echo "   $line"
  tail -n 12 "$out/$name.log" | grep -v '^USDT' | sed 's/^/   | /'
  summarise "$name"
}

skip() {  # skip NAME REASON
  echo "$1: skipped ($2)" >> "$out/steps.txt"
  echo "== $1: skipped ($2)"
}

env_report() {
  if [[ $dry == 0 ]]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv || true
  else
    echo "nvidia-smi: skipped (no CUDA)"
  fi
  "$python" - <<'PY'
import json, os, shutil, sys, torch
info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "cc": shutil.which("cc") or shutil.which("gcc"),
        "cxx": shutil.which("c++") or shutil.which("g++"), "cpus": os.cpu_count()}
try:
    import triton
    info["triton"] = triton.__version__
except Exception as exc:
    info["triton"] = f"not importable ({type(exc).__name__})"
if torch.cuda.is_available():
    from autoloop.harness import gpu_peak_flops
    name = torch.cuda.get_device_name(0)
    info.update(gpu=name, gpu_peak_bf16_tflops=(gpu_peak_flops(name) or 0) / 1e12,
                memory_gb=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                cudnn=torch.backends.cudnn.version())
out = os.environ["GPU_CHECK_OUT"]
open(f"{out}/env.json", "w").write(json.dumps(info, indent=1))
print(json.dumps(info, indent=1))
PY
}

kernels_report() {
  "$python" - <<'PY'
import json, os, torch
from autoloop import harness as H
m = H.import_train_module(os.path.join(os.environ["GPU_CHECK_REPO"], "train.py"))
device = torch.device(m.DEVICE_TYPE)
cfg = m.model_config(seq_len=H.seq_len(device.type))
cuda = device.type == "cuda"
times = H.time_attention_kernels(cfg, m.DEVICE_BATCH_SIZE, device, m.EMBEDDING_DTYPE, repeats=30 if cuda else 3)
pick = H.choose_attention_kernel(cfg, m.DEVICE_BATCH_SIZE, device, m.EMBEDDING_DTYPE, "auto", m.ATTENTION_AUTO_MARGIN)
report = {"shape": {"batch": m.DEVICE_BATCH_SIZE, "heads": cfg["n_head"], "kv_heads": cfg["n_kv_head"],
                    "seq_len": cfg["seq_len"], "head_dim": cfg["n_embd"] // cfg["n_head"], "dtype": str(m.EMBEDDING_DTYPE)},
          "available": {k: isinstance(v, float) for k, v in times.items()},
          "ms": {k: round(1000 * v, 3) for k, v in times.items() if isinstance(v, float)},
          "unavailable": {k: v[:100] for k, v in times.items() if not isinstance(v, float)},
          "auto_pick": pick or "sdpa default (a CPU)", "margin": m.ATTENTION_AUTO_MARGIN, "backend": m.ATTENTION_BACKEND}
open(os.path.join(os.environ["GPU_CHECK_OUT"], "kernels.json"), "w").write(json.dumps(report, indent=1))
print(json.dumps(report, indent=1))
PY
}

train_run() {  # train_run NAME: a train.py run of $train_seconds with this check's compile cache
  env -u TORCHINDUCTOR_CACHE_DIR -u TRITON_CACHE_DIR AUTOLOOP_COMPILE_CACHE="$cache" TORCH_LOGS=recompiles \
    AUTOLOOP_TIME_BUDGET="$train_seconds" AUTOLOOP_RESULT="$out/$1.json" "$python" "$repo/train.py"
}

profile_report() {
  env -u TORCHINDUCTOR_CACHE_DIR -u TRITON_CACHE_DIR AUTOLOOP_COMPILE_CACHE="$cache" "$python" - <<'PY'
import collections, json, os, time, torch
from torch.profiler import ProfilerActivity, profile
from autoloop import harness as H
m = H.import_train_module(os.path.join(os.environ["GPU_CHECK_REPO"], "train.py"))
H.configure_compile_cache(H.RunSpec.from_env())
device = torch.device(m.DEVICE_TYPE)
cuda = device.type == "cuda"
cfg = m.model_config(seq_len=H.seq_len(device.type))
kernel = H.choose_attention_kernel(cfg, m.DEVICE_BATCH_SIZE, device, m.EMBEDDING_DTYPE, m.ATTENTION_BACKEND,
                                   m.ATTENTION_AUTO_MARGIN)
t = m.prepare_training(cfg, device, seed=0, kernel=kernel)
seq = cfg["seq_len"]
grad_accum = max(1, m.TOTAL_BATCH_TOKENS // (m.DEVICE_BATCH_SIZE * seq))
tokens = torch.randint(0, cfg["vocab_size"], (m.DEVICE_BATCH_SIZE, seq + 1)).to(device)
batches = iter(lambda: (tokens[:, :-1], tokens[:, 1:]), None)
step = m.make_train_step(t["model"], t["optimizers"], batches, grad_accum=grad_accum, train_model=t["train_model"])
step()
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
with profile(activities=activities) as prof:
    step()
events = prof.events()
report = {"compiled": t["compiled"], "kernel_asked": kernel or "sdpa default", "kernel_ran": H.kernel_from_op_names(e.name for e in events),
          "aten_ops_dispatched_per_step": sum(1 for e in events if e.name.startswith("aten::") and
                                              not (e.cpu_parent and e.cpu_parent.name.startswith("aten::")))}
if cuda:
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    report["cuda_kernel_launches_per_step"] = len(gpu)
    report["attention_cuda_kernels"] = sorted({e.name[:90] for e in gpu if any(s in e.name.lower() for s in
                                               ("flash", "fmha", "attention", "cudnn", "sdpa", "mha"))})[:8]
    by_time = collections.Counter()
    for e in gpu:
        by_time[e.name[:70]] += e.device_time_total
    report["top_cuda_kernels_us"] = {k: round(v) for k, v in by_time.most_common(8)}
else:
    report["cuda_kernel_launches_per_step"] = "skipped (no CUDA)"
open(os.path.join(os.environ["GPU_CHECK_OUT"], "profile.json"), "w").write(json.dumps(report, indent=1))
print(json.dumps(report, indent=1))
PY
}

check_report() {
  local t0=$SECONDS
  env -u TORCHINDUCTOR_CACHE_DIR -u TRITON_CACHE_DIR AUTOLOOP_COMPILE_CACHE="$cache" \
    "$python" -m autoloop check --repo "$repo" --parts overfit,lr,budget --hours 8 --time-budget 300; local rc=$?
  echo "{\"seconds\": $((SECONDS - t0))}" > "$out/check_wall.json"
  cp "$repo/.autoloop/check/check.json" "$out/check.json" 2>/dev/null
  cp "$repo/.autoloop/check/lr_range.png" "$out/lr_range.png" 2>/dev/null
  return $rc
}

batch_report() {
  "$python" - <<'PY'
import json, os, torch
from autoloop import check as C
from autoloop import harness as H
m = H.import_train_module(os.path.join(os.environ["GPU_CHECK_REPO"], "train.py"))
H.configure_compile_cache(H.RunSpec.from_env())
device = torch.device(m.DEVICE_TYPE)
path = os.path.join(os.environ["GPU_CHECK_OUT"], "batch.json")
write = lambda part: open(path, "w").write(json.dumps(part, indent=1))  # after every candidate: a kill keeps them
part = C.device_batch_sweep(m, H.load_dataset(), device, max_seconds=60 if device.type == "cuda" else 10, on_progress=write)
write(part)
print(json.dumps(part, indent=1))
PY
}

loop_trial() {  # loop_trial NAME [run options...]: one baseline trial in a temporary clone of HEAD
  local name=$1; shift
  local clone t0=$SECONDS
  clone="$(mktemp -d)/repo"
  git clone -q "$repo" "$clone" || return 1
  git -C "$clone" config user.email gpucheck@localhost && git -C "$clone" config user.name gpucheck
  # One run per trial (the strict rule, one baseline seed, no drift re-measurement): the
  # figure is the loop's overhead.
  (cd "$clone" && AUTOLOOP_DECISION_RULE=strict AUTOLOOP_BASELINE_SEEDS=1 AUTOLOOP_DRIFT_EVERY=0 AUTOLOOP_COMPILE_CACHE="$cache" \
    "$python" -m autoloop run --tag gpucheck --time-budget "$trial_seconds" --max-trials 1 --no-check "$@"); local rc=$?
  echo "{\"seconds\": $((SECONDS - t0))}" > "$out/${name}_wall.json"
  (cd "$clone" && "$python" -m autoloop log --json) > "$out/${name}_log.json" 2>/dev/null
  rm -rf "$(dirname "$clone")"
  return $rc
}

# `timeout` runs programs, not shell functions: export them (and what they read) to a bash.
export -f env_report kernels_report train_run profile_report check_report batch_report loop_trial
export dry repo out python cache train_seconds trial_seconds

step env 20 bash -c env_report
step kernels 40 bash -c kernels_report
step train_cold 200 bash -c "train_run train_cold"
if [[ $dry == 0 ]]; then
  step train_warm 120 bash -c "train_run train_warm"
else
  skip train_warm "no CUDA: train.py compiles nothing on a CPU, so cold and warm are the same run"
fi
step profile 60 bash -c profile_report
step check 150 bash -c check_report
step trial_serial 110 bash -c "loop_trial trial_serial"
step trial_workers 110 bash -c "loop_trial trial_workers --workers 1"
step batch 90 bash -c batch_report

echo "total: $((SECONDS - start_all)) s" >> "$out/steps.txt"
summarise final > /dev/null
cat "$out/steps.txt"
echo "figures: $out/figures.txt and $out/summary.json (and the JSON files and *.log of each step)"
