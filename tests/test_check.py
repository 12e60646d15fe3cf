"""Tests of `autoloop check` (autoloop/check.py), on the CPU with the real train.py.

Broken copies of train.py are text substitutions of the real one, the same edit a
buggy proposal would make. The LR range test's divergence detection is tested on a
toy whose divergence point is known (its loss blows up above a set learning rate).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from autoloop import check as C
from autoloop.check.run import plan_budget
from autoloop import harness as H
from tests.conftest import make_repo

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN_PY = REPO_ROOT / "train.py"
CPU = torch.device("cpu")

# The loss line of GPT.forward, and two bugs a proposal could put there.
LOSS_LINE = ("        return softcapped_cross_entropy(x.flatten(0, 1), self.lm_head.weight, targets.reshape(-1), cap, "
             "vocab)\n")
SHIFTED = ("        return softcapped_cross_entropy(x[:, :-1].flatten(0, 1), self.lm_head.weight, "
           "targets[:, 1:].reshape(-1), cap, vocab)  # BUG: one position too far\n")
DETACHED = ("        return softcapped_cross_entropy(x.detach().flatten(0, 1), self.lm_head.weight.detach(), "
            "targets.reshape(-1), cap, vocab)  # BUG\n")
# A subtler detach: only the lm_head gets gradients; no exception, the blocks never learn.
HEAD_LINE = "        x = norm(x)\n"
HEAD_DETACHED = "        x = norm(x).detach()  # BUG\n"


def broken_copy(tmp_path: Path, name: str, old: str, new: str) -> Path:
    text = TRAIN_PY.read_text()
    assert text.count(old) == 1, f"train.py should contain {old!r} once"
    path = tmp_path / name
    path.write_text(text.replace(old, new))
    return path


@pytest.fixture(autouse=True)
def _threads():
    # One thread: on a busy 2-core machine a second one only spin-waits (many times slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def train_module():
    return H.import_train_module(TRAIN_PY)


# ---------------------------------------------------------------------------- overfit


def test_the_real_script_overfits_one_batch(train_module, embedded_dataset):
    part = C.overfit_one_batch(train_module, embedded_dataset, CPU)
    assert part["status"] == "ok", part
    assert part["initial_loss"] > 5.0 and part["final_loss"] < C.OVERFIT_TARGET
    assert part["steps"] <= C.OVERFIT_STEPS


@pytest.mark.parametrize("name,old,new", [
    ("targets_shifted", LOSS_LINE, SHIFTED),
    ("loss_detached", LOSS_LINE, DETACHED),
    ("head_detached", HEAD_LINE, HEAD_DETACHED),
])
def test_a_broken_script_cannot_overfit(tmp_path, embedded_dataset, name, old, new):
    module = H.import_train_module(broken_copy(tmp_path, f"train_{name}.py", old, new))
    part = C.overfit_one_batch(module, embedded_dataset, CPU)
    assert part["status"] == "fail", part
    assert part["message"].startswith(C.OVERFIT_MESSAGE)
    assert "\n" not in part["message"]


# ---------------------------------------------------------------------------- LR range test


class Cliff:
    """A train.py-shaped toy with a known divergence point: after a first step at 5.5 the
    loss holds at 2 (+-1% noise) while the LR is at most LIMIT, and doubles every step
    once it is above.

    The LR starts at ETA, so the range test must report a divergence just above the
    multiplier LIMIT / ETA (the smoothed loss lags a few steps behind).
    """

    ETA = 0.1
    LIMIT = 1.0
    MATRIX_LR = ETA

    @staticmethod
    def model_config(vocab_size=None, seq_len=None):
        return {"dim": 4}

    @staticmethod
    def build_model(config, device="cpu"):
        return torch.nn.Linear(config["dim"], 1, bias=False)

    @classmethod
    def build_optimizers(cls, model):
        opt = torch.optim.SGD(model.parameters(), lr=cls.ETA)
        for group in opt.param_groups:
            group["initial_lr"], group["name"] = group["lr"], "weights"
        return [opt]

    @classmethod
    def make_train_step(cls, model, optimizers, batches, *, grad_accum=1, **_):
        noise = torch.Generator().manual_seed(0)
        state = {"loss": None}

        def step():
            lr = optimizers[0].param_groups[0]["lr"]
            jitter = 1 + 0.01 * torch.randn((), generator=noise).item()
            if state["loss"] is None:
                state["loss"] = 5.5  # the first step: an untrained model's loss
            else:
                state["loss"] = state["loss"] * 2 if lr > cls.LIMIT else 2.0 * jitter
            return state["loss"], 1.0

        return step


def test_lr_range_test_finds_a_known_divergence_point(tmp_path, embedded_dataset):
    part = C.lr_range_test(Cliff, embedded_dataset, CPU, steps=200, low=0.1, high=100.0, out_dir=tmp_path)
    assert part["diverged_multiplier"] is not None
    # The first multiplier above the cliff, to within a step or two of the sweep (x1.035 each).
    assert Cliff.LIMIT / Cliff.ETA < part["diverged_multiplier"] < 1.1 * Cliff.LIMIT / Cliff.ETA, part["diverged_multiplier"]
    m = part["suggested_multiplier"]
    assert m == pytest.approx(part["diverged_multiplier"] / C.SUGGEST_BELOW)
    assert part["current_lrs"] == {"weights": Cliff.ETA}
    assert part["suggested_lrs"]["weights"] == pytest.approx(Cliff.ETA * m)
    assert part["suggested_constants"] == {"MATRIX_LR": pytest.approx(Cliff.ETA * m)}
    assert Path(part["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lr_range_test_on_the_real_script(tmp_path, train_module, embedded_dataset):
    part = C.lr_range_test(train_module, embedded_dataset, CPU, steps=12, out_dir=tmp_path)
    assert part["steps"] <= 12 and part["tokens_per_step"] == train_module.TOTAL_BATCH_TOKENS
    assert part["tokens_per_second"] > 0
    # Trained as train.py trains here (eager on a CPU, SDPA's own pick: its fused kernel), and said so.
    assert part["compiled"] is False and part["compile_error"] is None and part["warmup_seconds"] >= 0
    assert part["attention_kernel"] == "sdpa default" and part["attention_kernel_ran"] == "flash"
    groups = set(part["current_lrs"])
    assert {"embedding", "lm_head"} <= groups and any(g.startswith("matrix") for g in groups)
    assert set(part["suggested_constants"]) >= {"MATRIX_LR", "EMBEDDING_LR", "UNEMBEDDING_LR"}
    png = Path(part["plot"])
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    multipliers = [p["multiplier"] for p in part["points"]]
    assert multipliers == sorted(multipliers) and multipliers[0] == pytest.approx(C.LR_RANGE[0])


class FakeClock:
    """Seconds that pass only when a toy step says so: the check's time limits are tested by
    counting steps, which no load on the machine changes."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SlowCliff(Cliff):
    """The Cliff, each step STEP_SECONDS on its class's FakeClock (1/16 s: exact in binary)."""

    STEP_SECONDS = 0.0625
    clock: FakeClock

    @classmethod
    def make_train_step(cls, model, optimizers, batches, **kwargs):
        step = super().make_train_step(model, optimizers, batches, **kwargs)

        def slow():
            cls.clock.advance(cls.STEP_SECONDS)
            return step()

        return slow


@pytest.fixture
def slow_cliff():
    return type("SlowCliff", (SlowCliff,), {"clock": FakeClock()})


@pytest.mark.parametrize("max_seconds,planned", [
    (2.5, 40),  # 3 probe steps (0.1875 s), then (2.5 - 0.1875) / 0.0625 = 37 more
    (0.5, C.LR_MIN_STEPS),  # 8 would fit: never fewer than LR_MIN_STEPS are planned ...
    (100.0, C.LR_STEPS["cpu"]),  # 1600 would fit: never more than LR_STEPS
])
def test_lr_range_test_plans_its_steps_to_fit_its_time_limit(embedded_dataset, slow_cliff, max_seconds, planned):
    part = C.lr_range_test(slow_cliff, embedded_dataset, CPU, low=0.01, high=0.5, max_seconds=max_seconds,
                           clock=slow_cliff.clock)  # 0.5 x ETA: no divergence
    assert part["diverged_multiplier"] is None and part["planned_steps"] == planned
    assert part["seconds_per_step"] == SlowCliff.STEP_SECONDS
    if planned * SlowCliff.STEP_SECONDS <= max_seconds:  # it fits: the whole range is swept
        assert not part["truncated"] and part["steps"] == planned
        assert part["points"][-1]["multiplier"] == pytest.approx(0.5)
        assert part["sweep_seconds"] == planned * SlowCliff.STEP_SECONDS
    else:  # ... and the deadline stops those: the first step past 0.5 s is the 9th
        assert part["truncated"] and part["steps"] == 9
        assert "stopped at the 0.5 s limit after 9 of 30 steps" in part["message"]


def test_lr_range_test_stops_at_its_time_limit_and_says_so(embedded_dataset, slow_cliff):
    # 50 steps asked for at 1/16 s each, 0.5 s allowed: the 9th step ends past it.
    part = C.lr_range_test(slow_cliff, embedded_dataset, CPU, steps=50, low=0.01, high=0.5, max_seconds=0.5,
                           clock=slow_cliff.clock)
    assert part["truncated"] and part["steps"] == 9 and part["planned_steps"] == 50
    assert "stopped at the 0.5 s limit after 9 of 50 steps" in part["message"]
    assert part["message"].startswith(f"no divergence up to x{part['points'][-1]['multiplier']:.3g}")
    assert part["sweep_seconds"] == pytest.approx(9 * SlowCliff.STEP_SECONDS, abs=0.005)  # rounded to 0.01 s




def test_a_sweep_cut_short_below_the_divergence_suggests_nothing(embedded_dataset, slow_cliff):
    # The Cliff diverges at x{LIMIT/ETA}; a sweep the deadline stops well below it only shows
    # the divergence is higher: no suggestion, no warning, nothing for the search to try
    # (a busy machine's check once "suggested" x0.22 after no divergence up to x4.5).
    part = C.lr_range_test(slow_cliff, embedded_dataset, CPU, steps=50, low=0.1, high=100.0, max_seconds=0.5,
                           clock=slow_cliff.clock)
    assert part["truncated"] and part["diverged_multiplier"] is None
    assert part["suggested_multiplier"] is None and part["suggested_constants"] == {}, part
    assert part["status"] == "ok" and "nothing against the current LRs" in part["message"], part["message"]
    # A whole sweep to x80 without a divergence (this cliff is at x10,000) bounds the peak
    # from below: x80 / 20 = x4 or more, far enough from x1 to be worth a look.
    high_cliff = type("HighCliff", (Cliff,), {"LIMIT": 1000.0})
    part = C.lr_range_test(high_cliff, embedded_dataset, CPU, steps=30, low=0.01, high=80.0)
    assert part["diverged_multiplier"] is None and not part["truncated"], part["message"]
    assert part["suggested_multiplier"] == pytest.approx(80.0 / C.SUGGEST_BELOW), part["message"]
    assert part["status"] == "warn" and "suggested peak x4 or more" in part["message"], part["message"]


TOY_TRAIN = '''"""A train.py-shaped toy: its 25th step reads the check's partial results."""
import json, pathlib, torch

TOTAL_BATCH_TOKENS, DEVICE_BATCH_SIZE = 2 * 256, 2

def model_config(vocab_size=None, seq_len=None):
    return {"dim": 4}

def build_model(config, device="cpu"):
    return torch.nn.Linear(config["dim"], 1, bias=False)

def build_optimizers(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.param_groups[0]["initial_lr"] = 0.1
    return [opt]

def make_train_step(model, optimizers, batches, **kwargs):
    state = {"step": 0}

    def step():
        state["step"] += 1
        if state["step"] == 25:
            check = json.loads(pathlib.Path(".autoloop/check/check.json").read_text())
            pathlib.Path("seen.json").write_text(json.dumps({"complete": check["complete"], "lr": check.get("lr")}))
        return 2.0 - 0.001 * state["step"], 1.0  # a loss that falls: no divergence

    return step
'''


def test_check_writes_its_partial_results_as_it_goes(tmp_path, monkeypatch, embedded_dataset):
    repo = make_repo(tmp_path / "repo", TOY_TRAIN)
    monkeypatch.chdir(repo)
    result = C.run_check(repo, parts=("lr",), data_dir=embedded_dataset.path, lr_steps=40, say=lambda line: None)
    seen = json.loads((repo / "seen.json").read_text())
    assert seen["complete"] is False and seen["lr"]["status"] == "running"  # mid-sweep, on disk already
    assert seen["lr"]["steps"] == 20 and len(seen["lr"]["points"]) == 20
    final = json.loads((repo / ".autoloop" / "check" / "check.json").read_text())
    assert final["complete"] is True and final["lr"]["steps"] == 40 == result["lr"]["steps"]


def test_device_batch_size_is_measured_and_suggested(train_module, embedded_dataset):
    part = C.device_batch_sweep(train_module, embedded_dataset, CPU, steps=1)
    sizes = [row["device_batch_size"] for row in part["candidates"]]
    # The current one first, then half it: twice it (16) is more than a step's 8 sequences.
    assert sizes == [8, 4]
    assert all(row["tokens_per_second"] > 0 for row in part["candidates"]), part
    assert part["suggested"] in sizes and part["suggested_constants"] == {"DEVICE_BATCH_SIZE": part["suggested"]}
    assert part["message"].startswith("DEVICE_BATCH_SIZE ")
    limited = C.device_batch_sweep(train_module, embedded_dataset, CPU, steps=1, max_seconds=0.0)
    assert [row.get("skipped", "") for row in limited["candidates"]][1:] == ["the 0 s limit was reached"]


class BatchToy(Cliff):
    """A train.py-shaped toy whose optimizer step costs, on its FakeClock, 1/64 s per
    micro-step plus 1/1024 s per sequence: fewer, larger micro-steps are faster. At 16 x 256
    tokens a step: 8 sequences -> 0.046875 s, 16 -> 0.03125 s (50% faster), 4 -> 0.078125 s.
    A micro-batch of OOM_AT sequences or more runs out of memory, as CUDA says it."""

    TOTAL_BATCH_TOKENS, DEVICE_BATCH_SIZE = 16 * 256, 8
    OOM_AT = 10**9
    SECONDS: dict[int, float] | None = None  # {micro-batch: seconds a step} instead of the formula
    clock: FakeClock

    @classmethod
    def make_train_step(cls, model, optimizers, batches, *, grad_accum=1, **_):
        batch = cls.TOTAL_BATCH_TOKENS // (256 * grad_accum)

        def step():
            if batch >= cls.OOM_AT:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
            cls.clock.advance(cls.SECONDS[batch] if cls.SECONDS else grad_accum * (1 / 64 + batch / 1024))
            return 2.0, 1.0

        return step


def batch_toy(**attributes):
    return type("BatchToy", (BatchToy,), {"clock": FakeClock(), **attributes})


def test_device_batch_size_suggestion_on_known_step_times(embedded_dataset):
    toy = batch_toy()
    part = C.device_batch_sweep(toy, embedded_dataset, CPU, steps=2, clock=toy.clock)
    rows = {row["device_batch_size"]: row for row in part["candidates"]}
    assert list(rows) == [8, 16, 4]
    assert {b: row["seconds_per_step"] for b, row in rows.items()} == {8: 0.0469, 16: 0.0312, 4: 0.0781}
    assert rows[16]["tokens_per_second"] == 4096 / 0.03125 == 131072.0
    assert part["suggested"] == 16 and part["gain_percent"] == 50.0
    assert part["message"].startswith("DEVICE_BATCH_SIZE 16 is 50% faster than 8 (8: 87,381 tok/s, 16: 131,072 tok/s")
    # 16 faster by 2%, within the timing noise: keep 8, and suggest nothing else either.
    close = batch_toy(SECONDS={8: 0.05, 16: 0.049, 4: 0.08})
    kept = C.device_batch_sweep(close, embedded_dataset, CPU, steps=2, clock=close.clock)
    assert kept["message"].startswith("DEVICE_BATCH_SIZE 8 is the one to keep") and kept["gain_percent"] == 2.0
    assert kept["suggested"] == 8 and kept["suggested_constants"] == {"DEVICE_BATCH_SIZE": 8}


def test_device_batch_sweep_is_bounded_by_counts_not_by_the_machines_speed(embedded_dataset):
    # The first candidate's 3 steps take 0.140625 s on the clock: past a 0.1 s limit, the
    # other two are never set up.
    toy = batch_toy()
    part = C.device_batch_sweep(toy, embedded_dataset, CPU, steps=2, max_seconds=0.1, clock=toy.clock)
    assert [row.get("skipped") for row in part["candidates"]] == [None, "the 0.1 s limit was reached",
                                                                   "the 0.1 s limit was reached"]
    assert part["suggested"] == 8 and toy.clock.now == 3 * 0.046875
    # Out of memory at 16: reported as such, and nothing larger is tried.
    oom = batch_toy(OOM_AT=16)
    part = C.device_batch_sweep(oom, embedded_dataset, CPU, candidates=[8, 16, 32, 4], steps=2, clock=oom.clock)
    assert [row.get("error") or row.get("skipped") or row["tokens_per_second"] for row in part["candidates"]] == [
        87381.3, "out of memory", "larger than 16, which ran out of memory", 52428.8]  # 4096 / 0.046875, / 0.078125
    assert part["suggested"] == 8


TOY_RESULT_TRAIN = '''"""A train.py-shaped toy for the short run: writes the result JSON it is given (TOY_RESULT)."""
import json, os
result = {**json.loads(os.environ["TOY_RESULT"]), "training_seconds": float(os.environ["AUTOLOOP_TIME_BUDGET"])}
open(os.environ["AUTOLOOP_RESULT"], "w").write(json.dumps(result))
'''
# What train.py's result JSON holds after a run on an H100 at autoresearch's speed.
GPU_RESULT = {"tokens_per_second": 1.665e6, "mfu_percent": 34.03, "mfu_percent_palm": 42.53, "peak_memory_mb": 40000.0,
              "attention_kernel": "flash", "attention_kernel_ran": "flash", "compiled": True, "compile_error": None,
              "graphs_compiled_in_training": 0, "warmup_seconds": 41.0, "device": "NVIDIA H100 80GB HBM3",
              "batch_tokens": 2**19, "num_params": 25_329_664}


@pytest.mark.parametrize("changes,status,says", [
    ({}, "ok", "1.5 s run: 1,665,000 tokens/s, MFU 34.0% (42.5% as nanochat counts), peak memory 40,000 MB, "
               "attention ran flash"),
    ({"attention_kernel_ran": "math"}, "warn", "attention ran math (WARNING: flash was asked for)"),
    ({"attention_kernel": "sdpa default", "attention_kernel_ran": "efficient"}, "ok", "attention ran efficient"),
    ({"graphs_compiled_in_training": 3}, "warn", "(WARNING: 3 graphs compiled during training: recompiles)"),
    ({"compiled": False, "compile_error": "InductorError: no C compiler"}, "ok", "(torch.compile failed: it ran eager)"),
])
def test_short_run_reports_both_mfus_and_the_kernel_that_ran(tmp_path, changes, status, says):
    (tmp_path / "train.py").write_text(TOY_RESULT_TRAIN)
    part = C.short_run(tmp_path, sys.executable, 1.5, env={"TOY_RESULT": json.dumps({**GPU_RESULT, **changes})})
    assert part["status"] == status and says in part["message"] and "\n" not in part["message"], part
    assert part["mfu_percent_palm"] == 42.53 and part["warmup_seconds"] == 41.0 and part["training_seconds"] == 1.5
    assert part["attention_kernel_ran"] == changes.get("attention_kernel_ran", "flash")


def test_a_script_that_cannot_train_fails_the_lr_part_in_one_line(tmp_path, embedded_dataset):
    shape_bug = ("        self.c_proj = Linear(hidden, cfg[\"n_embd\"], bias=False)\n",
                 "        self.c_proj = Linear(hidden + 1, cfg[\"n_embd\"], bias=False)  # BUG\n")
    repo = make_repo(tmp_path / "repo", broken_copy(tmp_path, "train_bug.py", *shape_bug).read_text())
    result = C.run_check(repo, parts=("overfit", "lr"), data_dir=embedded_dataset.path, say=lambda line: None)
    assert result["overfit"]["status"] == "fail" and not result["ok"]
    assert result["lr"]["status"] == "skipped"  # after the overfit part failed
    result = C.run_check(repo, parts=("lr",), data_dir=embedded_dataset.path, say=lambda line: None)
    assert result["lr"]["status"] == "fail" and "mat1 and mat2 shapes cannot be multiplied" in result["lr"]["message"]
    assert result["lr"]["message"].startswith("the LR range test could not train: RuntimeError: ")
    assert "\n" not in result["lr"]["message"] and not result["ok"]


# ---------------------------------------------------------------------------- budget plan


def test_budget_plan_arithmetic():
    plan = C.budget_plan(tokens_per_second=1000.0, tokens_per_step=100, matmul_params=1000, time_budget=10.0,
                         hours=1.0, overhead_seconds=10.0, warmup_steps=5)
    assert plan["steps"] == 100 and plan["tokens"] == 10_000 and plan["tokens_per_param"] == 10
    assert plan["flops"] == 6 * 1000 * 10_000
    # Compute-optimal at C = 6 N D with D = 20 N: N = sqrt(C / 120).
    assert plan["compute_optimal_params"] == int((6e7 / 120) ** 0.5)
    assert plan["runs_in_hours"] == 3600 // 20 and plan["status"] == "ok" and plan["warnings"] == []


def test_budget_plan_warns_when_clearly_off():
    big = C.budget_plan(tokens_per_second=1000.0, tokens_per_step=100, matmul_params=100_000, time_budget=10.0)
    assert big["status"] == "warn" and "tokens per parameter" in big["warnings"][0]
    short = C.budget_plan(tokens_per_second=1000.0, tokens_per_step=100, matmul_params=100, time_budget=10.0,
                          warmup_steps=300)
    assert any("too few to get past warm-up (300 steps)" in w for w in short["warnings"])
    full = C.budget_plan(tokens_per_second=1.0, tokens_per_step=1, matmul_params=None, time_budget=100.0,
                         peak_memory_mb=79_000, memory_total_mb=80_000)
    assert full["memory_headroom_percent"] == pytest.approx(1.2, abs=0.1) and "DEVICE_BATCH_SIZE" in full["message"]
    steps = C.budget_plan(tokens_per_second=1000.0, tokens_per_step=100, matmul_params=10, time_budget=300.0, max_steps=50)
    assert steps["steps"] == 50 and steps["training_seconds"] == 5.0
    assert C.budget_plan(tokens_per_second=None, tokens_per_step=100, matmul_params=10, time_budget=1)["status"] == "skipped"


def test_budget_plan_says_where_its_throughput_comes_from(tmp_path, embedded_dataset):
    compiled = H.import_train_module(broken_copy(tmp_path, "train_compiles.py", "\nCOMPILE = DEVICE_TYPE == \"cuda\"",
                                                 "\nCOMPILE = True"))
    lr = {"tokens_per_second": 1e6, "tokens_per_step": 4096, "compiled": True}  # ~20 tokens per parameter in 10 s
    plan = plan_budget(compiled, embedded_dataset, CPU, lr, None, time_budget=10.0, max_steps=None, hours=None)
    assert plan["throughput_source"] == "the LR range test (compiled, as training)" and plan["status"] == "ok", plan
    assert plan["message"].startswith("from the LR range test (compiled, as training): 1,000,000 tokens/s")
    eager = plan_budget(compiled, embedded_dataset, CPU, {**lr, "compiled": False}, None, time_budget=10.0, max_steps=None,
                    hours=None)
    assert eager["status"] == "warn" and "measured eager while train.py trains compiled" in eager["message"]
    run = {"short_run": {"tokens_per_second": 3e6, "batch_tokens": 4096, "compiled": True}}
    assert plan_budget(compiled, embedded_dataset, CPU, lr, run, time_budget=10.0, max_steps=None,
                   hours=None)["throughput_source"] == "a short run of train.py (compiled)"


# ---------------------------------------------------------------------------- device


def test_attention_kernel_in_use_on_cpu(tmp_path, train_module, embedded_dataset):
    assert C.sdpa_kernel_in_use(train_module, embedded_dataset, CPU) == "flash"  # the CPU's fused kernel
    math_copy = tmp_path / "train_math.py"
    math_copy.write_text(TRAIN_PY.read_text().replace('ATTENTION_BACKEND = "auto"', 'ATTENTION_BACKEND = "math"'))
    assert C.sdpa_kernel_in_use(H.import_train_module(math_copy), embedded_dataset, CPU) == "math"


def test_attention_kernels_timed_side_by_side(train_module):
    config = dict(train_module.model_config(), seq_len=64)
    times = H.time_attention_kernels(config, 2, CPU, torch.float32, repeats=2)
    assert set(times) == {"flash", "cudnn", "efficient", "math"}
    assert isinstance(times["flash"], float) and isinstance(times["math"], float)
    assert isinstance(times["cudnn"], str)  # not on a CPU: the error, not a silent fallback
    assert H.choose_attention_kernel(config, 2, CPU, torch.float32) is None  # "auto" on a CPU
    assert H.choose_attention_kernel(config, 2, CPU, torch.float32, backend="math") == "math"
    assert C.choose_kernel(train_module, config, 2, CPU) is None  # train.py's ATTENTION_BACKEND, "auto"


def test_compile_probe_reports_a_missing_compiler_in_one_line():
    part = C.compile_probe("cpu", env={"CXX": "/nonexistent/c++", "CC": "/nonexistent/cc"}, timeout=600)
    assert part["status"] == "fail" and part["works"] is False
    assert part["message"].startswith("torch.compile does not work here (")
    assert "falls back to eager" in part["message"] and "\n" not in part["message"]
    assert "compiler" in part["error"].lower()


# ---------------------------------------------------------------------------- a third-party script


THIRD_PARTY = '''"""A third-party train.py: trains at import, prints autoresearch's block."""
raise SystemExit("imported: a check must never import a script like this one")
'''


def test_a_third_party_script_is_not_supported_and_never_imported(tmp_path, embedded_dataset):
    repo = make_repo(tmp_path / "repo", THIRD_PARTY)
    assert C.missing_interface(repo / "train.py") == list(C.REQUIRED)
    said = []
    result = C.run_check(repo, parts=("overfit", "lr"), data_dir=embedded_dataset.path, say=said.append)
    for part in ("overfit", "lr"):
        assert result[part]["status"] == "unsupported"
        assert result[part]["message"].startswith("not supported by this script: train.py does not define model_config")
    assert result["ok"] and len([line for line in said if "note:" not in line]) == 2
    assert json.loads((repo / ".autoloop" / "check" / "check.json").read_text())["overfit"]["status"] == "unsupported"


# ---------------------------------------------------------------------------- the command


def _cli(args, monkeypatch, repo):
    from autoloop.cli import app

    monkeypatch.chdir(repo)
    return CliRunner().invoke(app, ["check", *args])


def test_check_command_prints_its_parts_and_stores_them_on_the_run(tmp_path, monkeypatch, embedded_dataset):
    from autoloop.store import Store

    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text())
    store = Store(repo / "experiments.db")
    store.create_run("night")
    store.close()
    result = _cli(["--parts", "overfit,budget", "--hours", "8", "--time-budget", "60"], monkeypatch, repo)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(line.strip().startswith("overfit: [ok]") for line in lines), result.output
    assert any(line.strip().startswith("budget:") for line in lines), result.output
    assert "on run 'night'" in result.output
    stored = Store(repo / "experiments.db").get_run("night")["check_result"]
    assert stored["overfit"]["status"] == "ok" and stored["hours"] == 8 and stored["time_budget"] == 60


def test_check_command_fails_on_a_broken_script(tmp_path, monkeypatch, embedded_dataset):
    """And stops there: a range test or a budget plan of a script with a bug would measure the bug."""
    from autoloop.check.run import BROKEN_SCRIPT_SKIPS

    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text().replace(LOSS_LINE, SHIFTED))
    result = _cli(["--parts", "overfit,lr,budget"], monkeypatch, repo)
    assert result.exit_code == 1, result.output
    assert C.OVERFIT_MESSAGE in result.output
    for part in ("lr", "budget"):
        assert f"{part:>8}: [skipped] {BROKEN_SCRIPT_SKIPS}" in result.output, result.output
    saved = json.loads((repo / ".autoloop" / "check" / "check.json").read_text())
    assert saved["ok"] is False and saved["lr"]["status"] == saved["budget"]["status"] == "skipped"
    assert not (repo / ".autoloop" / "check" / "lr_range.png").exists()


def test_check_command_rejects_an_unknown_part(tmp_path, monkeypatch):
    result = _cli(["--parts", "overfit,vibes"], monkeypatch, make_repo(tmp_path / "repo", TRAIN_PY.read_text()))
    assert result.exit_code == 1 and "unknown check part vibes" in result.output


# ---------------------------------------------------------------------------- slow


@pytest.mark.slow
def test_lr_range_test_trains_compiled_where_train_py_does(tmp_path, embedded_dataset, monkeypatch):
    """The CUDA path forced on (compiled, bf16): the sweep runs through the compiled model,
    so its tokens/s (and the budget plan from it) is the compiled throughput."""
    from tests.test_train import CUDA_PATH, variant

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    module = H.import_train_module(variant(tmp_path, "train_cuda_path.py", CUDA_PATH))
    # No time limit: this is about what the sweep trains, and a busy machine's compiled CPU
    # steps (a recompile or two as the LRs move) once ran past the 45 s one after 2 steps.
    part = C.lr_range_test(module, embedded_dataset, CPU, steps=8, max_seconds=900)
    assert not part["truncated"], part["message"]
    assert part["compiled"] is True and part["compile_error"] is None, part
    assert part["warmup_seconds"] > 0 and part["tokens_per_second"] > 0 and part["steps"] == 8
    assert part["attention_kernel_ran"] == "flash"  # seen in the compiled warm-up


@pytest.mark.slow
def test_whole_check_on_this_cpu_keeps_to_its_limits(tmp_path, session_cache, embedded_dataset):
    """The whole command, as a person runs it. Its time is bounded by the parts' own limits
    (asserted here; a loaded machine makes every step slower, not the sweep longer than
    its limit): ~60 s on an idle 2-core CPU."""
    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text())
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CUDA_VISIBLE_DEVICES": ""}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "autoloop", "check", "--hours", "8"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for part in ("overfit", "lr", "device", "budget"):
        assert f"{part}: [" in proc.stdout, proc.stdout
    result = json.loads((repo / ".autoloop" / "check" / "check.json").read_text())
    assert result["overfit"]["status"] == "ok" and Path(result["lr"]["plot"]).exists()
    lr, batch = result["lr"], result["device"]["batch_size"]
    took = f"autoloop check took {wall:.0f} s on this CPU (load {os.getloadavg()[0]:.1f}): {lr['message']}"
    assert C.LR_MIN_STEPS <= lr["planned_steps"] <= C.LR_STEPS["cpu"] and lr["max_seconds"] == C.LR_SECONDS["cpu"], took
    # The deadline is looked at after every step: past it by at most a step (a few, for a slow one).
    assert lr["sweep_seconds"] <= C.LR_SECONDS["cpu"] + 5 * lr["seconds_per_step"], took
    assert lr["truncated"] or lr["steps"] == lr["planned_steps"] or lr["diverged_multiplier"] is not None, took
    # Each batch candidate starts only within the sweep's limit; the rest are skipped and say why.
    assert all("tokens_per_second" in row or row.get("skipped") == f"the {C.BATCH_SWEEP_SECONDS['cpu']:g} s limit was reached"
               for row in batch["candidates"]), batch


@pytest.mark.slow
def test_gpu_check_dry_run_end_to_end_on_this_cpu(tmp_path, session_cache, embedded_dataset):
    """bench/gpu_check.sh --dry-run: every step runs on the CPU; only CUDA-only parts are skipped, each with a line."""
    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text())
    shutil.copytree(REPO_ROOT / "autoloop", repo / "autoloop", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "bench").mkdir()
    shutil.copy(REPO_ROOT / "bench" / "gpu_check.sh", repo / "bench" / "gpu_check.sh")
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "harness"], cwd=repo, check=True)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_TRIAL_SECONDS": "4", "GPU_CHECK_TRAIN_SECONDS": "3",
           "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PYTHONPATH", None)  # the clone's own autoloop
    proc = subprocess.run(["bash", str(repo / "bench" / "gpu_check.sh"), "--dry-run", str(out)], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "dry_run.txt").exists()
    steps = (out / "steps.txt").read_text()
    for name in ("env", "kernels", "train_cold", "profile", "check", "trial_serial", "trial_workers", "batch"):
        assert f"{name}: rc=0" in steps, steps + proc.stdout
    assert "train_warm: skipped (no CUDA" in steps
    summary = json.loads((out / "summary.json").read_text())
    assert summary["overfit"].startswith("overfits one batch") and summary["sdpa_kernel_in_use"] == "flash"
    assert summary["train_cold"]["attention_kernel_ran"] == "flash" and summary["train_cold"]["tokens_per_second"] > 0
    assert summary["profile"]["cuda_kernel_launches_per_step"] == "skipped (no CUDA)"
    assert summary["check"]["seconds"] > 0 and summary["kernels"]["available"]["flash"] is True
    # Each loop ran its one trial to an end (on a loaded CPU a short baseline may still be
    # judged otherwise than keep: what this tests is the script, not the loop).
    for name in ("trial_serial", "trial_workers"):
        trials = summary["trials"][name]["trials"]
        assert trials and trials[0]["status"] != "running", summary["trials"]
    figures = (out / "figures.txt").read_text()
    assert "train_cold tokens_per_second: " in figures and "kernel_ran: flash" in figures
    assert (out / "lr_range.png").read_bytes()[:4] == b"\x89PNG"
