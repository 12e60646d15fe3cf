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
from autoloop import harness as H
from tests.conftest import make_repo

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN_PY = REPO_ROOT / "train.py"
CPU = torch.device("cpu")

# The loss line of GPT.forward, and two bugs a proposal could put there.
LOSS_LINE = "        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))\n"
SHIFTED = ("        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), "
           "targets[:, 1:].reshape(-1))  # BUG: one position too far\n")
DETACHED = "        return F.cross_entropy(logits.detach().view(-1, logits.size(-1)), targets.reshape(-1))  # BUG\n"
# A subtler detach: only the lm_head gets gradients; no exception, the blocks never learn.
HEAD_LINE = "        logits = self.lm_head(norm(x)).float()\n"
HEAD_DETACHED = "        logits = self.lm_head(norm(x).detach()).float()  # BUG\n"


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
    groups = set(part["current_lrs"])
    assert {"embedding", "lm_head"} <= groups and any(g.startswith("matrix") for g in groups)
    assert set(part["suggested_constants"]) >= {"MATRIX_LR", "EMBEDDING_LR", "UNEMBEDDING_LR"}
    png = Path(part["plot"])
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    multipliers = [p["multiplier"] for p in part["points"]]
    assert multipliers == sorted(multipliers) and multipliers[0] == pytest.approx(C.LR_RANGE[0])


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


# ---------------------------------------------------------------------------- device


def test_attention_kernel_in_use_on_cpu(tmp_path, train_module, embedded_dataset):
    assert C.sdpa_kernel_in_use(train_module, embedded_dataset, CPU) == "flash"  # the CPU's fused kernel
    math_copy = tmp_path / "train_math.py"
    math_copy.write_text(TRAIN_PY.read_text().replace('ATTENTION_BACKEND = "auto"', 'ATTENTION_BACKEND = "math"'))
    assert C.sdpa_kernel_in_use(H.import_train_module(math_copy), embedded_dataset, CPU) == "math"


def test_attention_kernels_timed_side_by_side(train_module):
    config = dict(train_module.model_config(), seq_len=64)
    times = train_module.time_attention_kernels(config, 2, CPU, torch.float32, repeats=2)
    assert set(times) == {"flash", "cudnn", "efficient", "math"}
    assert isinstance(times["flash"], float) and isinstance(times["math"], float)
    assert isinstance(times["cudnn"], str)  # not on a CPU: the error, not a silent fallback
    assert train_module.choose_attention_kernel(config, 2, CPU, torch.float32) is None  # "auto" on a CPU
    assert train_module.choose_attention_kernel(config, 2, CPU, torch.float32, backend="math") == "math"


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
    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text().replace(LOSS_LINE, SHIFTED))
    result = _cli(["--parts", "overfit"], monkeypatch, repo)
    assert result.exit_code == 1, result.output
    assert C.OVERFIT_MESSAGE in result.output


def test_check_command_rejects_an_unknown_part(tmp_path, monkeypatch):
    result = _cli(["--parts", "overfit,vibes"], monkeypatch, make_repo(tmp_path / "repo", TRAIN_PY.read_text()))
    assert result.exit_code == 1 and "unknown check part vibes" in result.output


# ---------------------------------------------------------------------------- slow


@pytest.mark.slow
def test_whole_check_on_this_cpu_within_two_minutes(tmp_path, session_cache, embedded_dataset):
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
    assert wall < 120, f"autoloop check took {wall:.0f} s on this CPU (load {os.getloadavg()[0]:.1f})"


@pytest.mark.slow
def test_gpu_check_dry_run_end_to_end_on_this_cpu(tmp_path, session_cache, embedded_dataset):
    """bench/gpu_check.sh --dry-run: every step runs on the CPU; only CUDA-only parts are skipped."""
    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text())
    shutil.copytree(REPO_ROOT / "autoloop", repo / "autoloop", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "bench").mkdir()
    shutil.copy(REPO_ROOT / "bench" / "gpu_check.sh", repo / "bench" / "gpu_check.sh")
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "harness"], cwd=repo, check=True)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_TRIAL_SECONDS": "5", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PYTHONPATH", None)  # the clone's own autoloop
    proc = subprocess.run(["bash", str(repo / "bench" / "gpu_check.sh"), "--dry-run", str(out)], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "dry_run.txt").exists()
    steps = (out / "steps.txt").read_text()
    for name in ("env", "check", "trial"):
        assert f"{name}: rc=0" in steps, steps + proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["overfit"].startswith("overfits one batch") and summary["sdpa_kernel_in_use"] == "flash"
    # The loop ran its one trial to an end (on a loaded CPU a 5 s baseline may still be
    # judged otherwise than keep: what this tests is the script, not the loop).
    assert summary["trial"] and summary["trial"][0]["status"] != "running", summary
    assert (out / "lr_range.png").read_bytes()[:4] == b"\x89PNG"
