#!/usr/bin/env bash
# Every GPU figure autoloop cares about, in under 8 minutes, written to one folder.
#
#   bench/gpu_check.sh [--dry-run] [OUT_DIR]
#
# Steps, each under its own `timeout` (a step that hangs costs its limit, not the check):
#   1. env       the GPU, driver, torch / CUDA / Triton versions, a C compiler    (30 s)
#   2. check     `autoloop check --hours 8`: overfit one batch, LR range test, budget plan,
#                device health (attention kernels timed side by side, torch.compile probe,
#                a short real run: tokens/s, MFU, executed TFLOP/s, peak memory)  (300 s)
#   3. trial     one 60-second loop trial in a temporary clone of this repository's HEAD:
#                `autoloop run --tag gpucheck --time-budget 60 --max-trials 1`   (240 s)
#   4. summary   the figures of steps 2 and 3 in summary.json
# --dry-run (automatic without CUDA) runs the same steps on the CPU: `autoloop check` then
# checks what it can there and skips what needs CUDA; nvidia-smi is skipped.
# GPU_CHECK_TRIAL_SECONDS overrides the trial's budget (tests use a short one).
set -uo pipefail

dry=0
if [[ "${1:-}" == "--dry-run" ]]; then dry=1; shift; fi
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$repo/.autoloop/gpu_check/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
python="${PYTHON:-python}"
trial_seconds="${GPU_CHECK_TRIAL_SECONDS:-60}"
if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  dry=1
fi
[[ $dry == 1 ]] && echo "dry run: no CUDA (or --dry-run); CUDA-only steps are skipped" | tee "$out/dry_run.txt"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
start_all=$SECONDS
declare -A status

step() {  # step NAME LIMIT_SECONDS COMMAND...: run it under timeout, log to NAME.log, time it
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  status[$name]="rc=$rc seconds=$((SECONDS - t0))"
  [[ $rc == 124 || $rc == 137 ]] && status[$name]+=" TIMED OUT"
  echo "   ${status[$name]}"
  tail -n 25 "$out/$name.log" | sed 's/^/   | /'
}

env_report() {
  if [[ $dry == 0 ]]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv || true
  else
    echo "nvidia-smi: skipped (dry run)"
  fi
  "$python" - <<'PY'
import json, shutil, sys, torch
info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "cc": shutil.which("cc") or shutil.which("gcc"),
        "cxx": shutil.which("c++") or shutil.which("g++")}
try:
    import triton
    info["triton"] = triton.__version__
except Exception as exc:
    info["triton"] = f"not importable ({type(exc).__name__})"
if torch.cuda.is_available():
    from autoloop.harness import gpu_peak_flops
    name = torch.cuda.get_device_name(0)
    info.update(gpu=name, gpu_peak_tflops=(gpu_peak_flops(name) or 0) / 1e12,
                memory_gb=torch.cuda.get_device_properties(0).total_memory / 2**30)
print(json.dumps(info, indent=1))
PY
}

loop_trial() {
  local clone
  clone="$(mktemp -d)/repo"
  git clone -q "$repo" "$clone" || return 1
  git -C "$clone" config user.email gpucheck@localhost && git -C "$clone" config user.name gpucheck
  (cd "$clone" && "$python" -m autoloop run --tag gpucheck --time-budget "$trial_seconds" --max-trials 1) ; local rc=$?
  (cd "$clone" && "$python" -m autoloop log --json) > "$out/trial_log.json" 2>/dev/null
  find "$clone/.autoloop" -name 'result*.json' -exec cp {} "$out/trial_result.json" \; 2>/dev/null
  rm -rf "$(dirname "$clone")"
  return $rc
}

# `timeout` runs programs, not shell functions: export them (and what they read) to a bash.
export -f env_report loop_trial
export dry repo out python trial_seconds
step env 30 bash -c env_report
step check 300 "$python" -m autoloop check --repo "$repo" --hours 8 --json
cp "$repo/.autoloop/check/check.json" "$out/check.json" 2>/dev/null
cp "$repo/.autoloop/check/lr_range.png" "$out/lr_range.png" 2>/dev/null
step trial 240 bash -c loop_trial

{
  for name in env check trial; do echo "$name: ${status[$name]}"; done
  echo "total: $((SECONDS - start_all)) s"
} > "$out/steps.txt"

"$python" - "$out" <<'PY' > "$out/summary.json"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None
check = load("check.json") or {}
device = check.get("device") or {}
run = device.get("short_run") or {}
trials = load("trial_log.json") or []
summary = {
    "steps": (out / "steps.txt").read_text().splitlines(),
    "overfit": (check.get("overfit") or {}).get("message"),
    "lr": (check.get("lr") or {}).get("message"),
    "budget": (check.get("budget") or {}).get("message"),
    "sdpa_kernel_in_use": device.get("sdpa_kernel_in_use"), "attention_ms": device.get("kernel_ms"),
    "compile": (device.get("compile") or {}).get("message"),
    "short_run": {k: run.get(k) for k in ("tokens_per_second", "mfu_percent", "hfu_percent", "model_tflops",
                                          "executed_tflops", "peak_memory_mb", "compile_seconds", "attention_kernel", "compiled")},
    "trial": [{k: t.get(k) for k in ("number", "status", "metric", "reason", "mfu", "peak_memory_mb")} for t in trials]
             if isinstance(trials, list) else trials,
}
print(json.dumps(summary, indent=1, default=str))
PY
cat "$out/steps.txt"
echo "figures: $out/summary.json (and check.json, lr_range.png, *.log)"
