"""Tests of train.py, on the CPU.

Tests about the script run it for real, as a subprocess with the contract's AUTOLOOP_*
environment (that is how the controller runs it); unit tests import it by path the way
the harness does. One shared tiny step-mode run (`trained_run`) feeds the tests of its
outputs. Variants of the script (an absurd learning rate, the CUDA code path forced on
the CPU) are copies of train.py with constants replaced by text substitution: the same
edit a proposal would make.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from autoloop import harness as H

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN_PY = REPO_ROOT / "train.py"
REQUIRED_KEYS = (
    "val_bpb", "training_seconds", "total_seconds", "compile_seconds", "eval_seconds", "num_steps",
    "total_tokens", "num_params", "mfu_percent", "peak_memory_mb", "device", "data_fingerprint",
    "harness_fingerprint", "seed", "curve",
)


# ---------------------------------------------------------------------------- helpers


def train_env(cache: Path, **extra) -> dict:
    """The environment of a trial: this process's, minus any AUTOLOOP_* setting, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOLOOP_")}
    env["AUTOLOOP_CACHE_DIR"] = str(cache)
    env["AUTOLOOP_COMPILE_CACHE"] = str(cache / "compile")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", os.environ.get("AUTOLOOP_TEST_THREADS", "2"))
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU tests, also on a GPU machine: the CPU scale, deterministic
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_train(script: Path, cache: Path, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script)], check=False, cwd=REPO_ROOT, env=train_env(cache, **env),
        capture_output=True, text=True, timeout=timeout,
    )


def variant(tmp_path: Path, name: str, replacements: dict[str, str]) -> Path:
    """A copy of train.py with `NAME = ...` lines (at module level) replaced."""
    text = TRAIN_PY.read_text()
    for const, value in replacements.items():
        text, count = re.subn(rf"^{const} = .*$", f"{const} = {value}", text, flags=re.MULTILINE)
        assert count == 1, f"train.py should define {const} on exactly one top-level line"
    path = tmp_path / name
    path.write_text(text)
    return path


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def train_module():
    return H.import_train_module(TRAIN_PY)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # The in-process unit tests use tiny tensors: a second thread only adds OpenMP
    # spin-waiting, which on a busy 2-core machine slows them down many times over.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, session_cache, embedded_dataset):
    """One tiny step-mode training run whose outputs several tests inspect."""
    out = tmp_path_factory.mktemp("trained_run")
    proc = run_train(
        TRAIN_PY, session_cache, AUTOLOOP_MAX_STEPS=20, AUTOLOOP_SEED=7,
        AUTOLOOP_RESULT=out / "result.json", AUTOLOOP_CHECKPOINT=out / "model.pt", AUTOLOOP_PROGRESS=out / "progress.jsonl",
    )
    assert proc.returncode == 0, explain(proc)
    return {"proc": proc, "dir": out, "result": json.loads((out / "result.json").read_text())}


# ---------------------------------------------------------------------------- the shared run


def test_result_json_and_summary_block_agree(trained_run):
    result, stdout = trained_run["result"], trained_run["proc"].stdout
    missing = [k for k in REQUIRED_KEYS if k not in result]
    assert not missing, f"result JSON lacks {missing}"
    summary = H.parse_summary(stdout)
    assert summary["val_bpb"] == pytest.approx(result["val_bpb"], abs=1e-6)
    for key in ("num_steps", "total_tokens", "num_params", "seed", "device", "data_fingerprint", "harness_fingerprint"):
        assert summary[key] == result[key], key
    assert result["num_steps"] == 20 and result["seed"] == 7
    assert result["device"] == "cpu" and result["mfu_percent"] is None
    assert result["harness_fingerprint"] == H.harness_fingerprint()
    assert result["total_tokens"] == 20 * result["batch_tokens"]
    assert result["peak_memory_mb"] > 0 and result["eval_seconds"] > 0
    assert result["total_seconds"] >= result["training_seconds"] + result["compile_seconds"] + result["eval_seconds"]


def test_curve_and_progress_are_recorded(trained_run):
    curve = trained_run["result"]["curve"]
    assert [p["step"] for p in curve] == list(range(1, 21))  # short runs keep every step
    for point in curve:
        assert set(point) == {"step", "seconds", "loss", "lr", "grad_norm"}
        assert math.isfinite(point["loss"]) and point["grad_norm"] > 0
    assert curve[-1]["seconds"] == pytest.approx(trained_run["result"]["training_seconds"], abs=1e-3)
    # It learns: byte-level loss starts near ln(257) = 5.55 nats and drops fast.
    assert curve[0]["loss"] > 5.0 and np.mean([p["loss"] for p in curve[-5:]]) < 3.5
    lines = (trained_run["dir"] / "progress.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records[0]["step"] == 1 and records[-1]["step"] == 20
    assert all("loss" in r and "tokens_per_second" in r for r in records)


def test_checkpoint_rebuilds_the_same_val_bpb(trained_run, embedded_dataset):
    model = H.load_trained_model(TRAIN_PY, trained_run["dir"] / "model.pt", device="cpu")
    bpb = H.evaluate_bpb(model, embedded_dataset, "val", device="cpu")
    assert bpb == pytest.approx(trained_run["result"]["val_bpb"], rel=1e-5)
    assert bpb < 5.0  # well below the untrained model's log2(257) = 8 bits


# ---------------------------------------------------------------------------- script behaviour


def test_step_mode_is_deterministic(tmp_path, session_cache, embedded_dataset):
    results = []
    for i in range(2):
        path = tmp_path / f"r{i}.json"
        proc = run_train(TRAIN_PY, session_cache, AUTOLOOP_MAX_STEPS=5, AUTOLOOP_SEED=3, AUTOLOOP_RESULT=path)
        assert proc.returncode == 0, explain(proc)
        results.append(json.loads(path.read_text()))
    assert results[0]["val_bpb"] == results[1]["val_bpb"]
    assert [p["loss"] for p in results[0]["curve"]] == [p["loss"] for p in results[1]["curve"]]


def test_time_budget_is_respected(tmp_path, session_cache, embedded_dataset):
    path = tmp_path / "r.json"
    proc = run_train(TRAIN_PY, session_cache, AUTOLOOP_TIME_BUDGET=3, AUTOLOOP_RESULT=path)
    assert proc.returncode == 0, explain(proc)
    result = json.loads(path.read_text())
    seconds = result["training_seconds"]
    # The clock stops after the step that crosses the budget: over by less than that step.
    curve = result["curve"]
    last_step = curve[-1]["seconds"] - curve[-2]["seconds"]
    assert curve[-1]["step"] == curve[-2]["step"] + 1 == result["num_steps"]
    assert 3.0 <= seconds <= 3.0 + last_step + 1e-3  # curve seconds are rounded to 0.1 ms
    assert result["num_steps"] > H.UNTIMED_WARMUP_STEPS
    assert result["compile_seconds"] > 0


def test_absurd_learning_rate_fails_loudly(tmp_path, session_cache, embedded_dataset):
    lrs = {name: f"1e6 * {value}" for name, value in
           (("MATRIX_LR", "0.04"), ("EMBEDDING_LR", "0.6"), ("UNEMBEDDING_LR", "0.004"))}
    script = variant(tmp_path, "train_huge_lr.py", lrs)
    result = tmp_path / "r.json"
    proc = run_train(script, session_cache, AUTOLOOP_MAX_STEPS=40, AUTOLOOP_RESULT=result)
    assert proc.returncode == 1, explain(proc)
    fail_lines = [line for line in proc.stdout.splitlines() if line.startswith("FAIL: ")]
    assert len(fail_lines) == 1 and ("nan" in fail_lines[0] or "exploded" in fail_lines[0]), explain(proc)
    assert not result.exists()


def test_bad_environment_is_one_error_line(session_cache):
    proc = run_train(TRAIN_PY, session_cache, AUTOLOOP_MAX_STEPS="many")
    assert proc.returncode == 2, explain(proc)
    assert proc.stdout.strip().startswith("ERROR: AUTOLOOP_MAX_STEPS='many'")
    assert len(proc.stdout.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------- units


def test_import_is_cheap_and_exposes_the_interface(train_module, tmp_path, monkeypatch):
    # Importing (as the verifier does) must not load data, train or compile.
    cache = tmp_path / "cache"
    monkeypatch.setenv("AUTOLOOP_CACHE_DIR", str(cache))
    copy = tmp_path / "train_copy.py"
    copy.write_text(TRAIN_PY.read_text() + "\n# a fresh module\n")
    start = time.perf_counter()
    module = H.import_train_module(copy)
    assert time.perf_counter() - start < 2.0 and not cache.exists()
    assert module.build_model is not train_module.build_model
    for name in ("build_model", "model_config", "muon_orthogonalize", "build_optimizers", "lr_multiplier", "main"):
        assert callable(getattr(train_module, name)), name
    config = train_module.model_config()
    assert all(isinstance(v, (int, float, bool)) for v in config.values()), config
    assert json.loads(json.dumps(config)) == config


def test_model_contract_causal_logits(train_module):
    cfg = dict(train_module.model_config(), n_layer=2, n_embd=64, n_head=2, n_kv_head=1, seq_len=32)
    torch.manual_seed(0)
    model = train_module.build_model(cfg, device="cpu")
    # Zero-initialised output projections make each block the identity at first; give
    # them weights so the check below covers attention too.
    with torch.no_grad():
        for block in model.blocks:
            block.attn.c_proj.weight.normal_(0, 0.05)
            block.mlp.c_proj.weight.normal_(0, 0.05)
    idx = torch.randint(0, cfg["vocab_size"], (2, 32))
    logits = model(idx)
    assert logits.shape == (2, 32, cfg["vocab_size"]) and logits.dtype == torch.float32
    assert logits.abs().max() <= cfg["logit_softcap"]
    changed = idx.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % cfg["vocab_size"]
    other = model(changed)
    assert torch.equal(logits[:, :20], other[:, :20])  # causal: the past ignores the future
    assert not torch.allclose(logits[:, 20:], other[:, 20:])
    loss = model(idx, targets=idx)
    assert loss.ndim == 0 and math.isfinite(loss.item())


def test_fresh_model_blocks_start_as_identity(train_module):
    cfg = dict(train_module.model_config(), n_layer=2, n_embd=64, n_head=2, n_kv_head=2, seq_len=16)
    model = train_module.build_model(cfg)
    for block in model.blocks:
        assert not block.attn.c_proj.weight.any() and not block.mlp.c_proj.weight.any()
        assert block.attn.c_q.weight.std().item() == pytest.approx(64**-0.5, rel=0.2)


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (3, 48, 96)])
def test_muon_orthogonalize_pushes_singular_values_to_one(train_module, shape):
    torch.manual_seed(0)
    G = torch.randn(*shape) * 0.01  # the scale must not matter
    X = train_module.muon_orthogonalize(G, dtype=torch.float32)
    assert X.shape == G.shape and X.dtype == torch.float32
    s = torch.linalg.svdvals(X)
    assert s.min().item() > 0.5 and s.max().item() < 1.5, s
    # ... and keeps the singular vectors: close to the exact polar factor U V^T.
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    assert torch.nn.functional.cosine_similarity(X.flatten(), (U @ Vh).flatten(), dim=0) > 0.95
    s16 = torch.linalg.svdvals(train_module.muon_orthogonalize(G, dtype=torch.bfloat16).float())
    assert s16.min().item() > 0.5 and s16.max().item() < 1.5


def test_schedules(train_module):
    m = train_module
    assert m.lr_multiplier(0.0) == pytest.approx(1.0 if m.WARMUP_RATIO == 0 else 0.0, abs=1e-6)
    assert m.lr_multiplier(1.0) == pytest.approx(m.FINAL_LR_FRAC)
    values = [m.lr_multiplier(p) for p in np.linspace(max(m.WARMUP_RATIO, 1e-3), 1, 50)]
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(values))  # no increase after warm-up
    assert m.weight_decay_at(0.0) == m.WEIGHT_DECAY and m.weight_decay_at(1.0) == 0.0
    assert m.muon_momentum_at(0) == m.MUON_MOMENTUM_START and m.muon_momentum_at(10**6) == m.MUON_MOMENTUM


def test_overfits_a_single_batch(train_module):
    """Model + optimizers + schedule can drive the loss on one fixed batch to ~0."""
    m = train_module
    torch.manual_seed(0)
    cfg = dict(m.model_config(), n_layer=2, n_embd=64, n_head=2, n_kv_head=2, seq_len=32)
    model = m.build_model(cfg, device="cpu")
    optimizers = m.build_optimizers(model)
    # Random tokens with distinct first tokens: every context is unique, so zero loss is
    # reachable (real text repeats short contexts such as indentation across windows).
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    tokens[:, 0] = torch.arange(4)
    x, y = tokens[:, :-1], tokens[:, 1:]
    losses, steps = [], 150
    for step in range(steps):
        for opt in optimizers:  # the script's own schedule, as in its training loop
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * m.lr_multiplier(step / steps)
        loss = model(x, targets=y)
        loss.backward()
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[0] > 5.0
    assert losses[-1] < 0.01, losses[-10:]


# ---------------------------------------------------------------------------- slow


@pytest.mark.slow
def test_cuda_code_path_runs_on_cpu(tmp_path, session_cache, embedded_dataset):
    """torch.compile, bf16 autocast, bf16 Muon and meta-device init, exercised without a GPU."""
    script = variant(tmp_path, "train_gpu_path.py", {
        "COMPILE": "True", "AUTOCAST_DTYPE": "torch.bfloat16", "MUON_DTYPE": "torch.bfloat16", "INIT_ON_META": "True",
    })
    path, ckpt = tmp_path / "r.json", tmp_path / "m.pt"
    proc = run_train(script, session_cache, timeout=900, AUTOLOOP_MAX_STEPS=5, AUTOLOOP_RESULT=path,
                     AUTOLOOP_CHECKPOINT=ckpt)
    assert proc.returncode == 0, explain(proc)
    result = json.loads(path.read_text())
    assert math.isfinite(result["val_bpb"]) and result["val_bpb"] < 8.0
    assert result["compile_seconds"] > 0
    # The checkpoint of a compiled model loads into the plain model (prefix stripped).
    model = H.load_trained_model(script, ckpt, device="cpu")
    assert H.evaluate_bpb(model, embedded_dataset, "val", device="cpu") == pytest.approx(result["val_bpb"], rel=1e-5)


@pytest.mark.slow
def test_thirty_second_run_learns(tmp_path, session_cache, embedded_dataset):
    val = np.asarray(embedded_dataset.split("val"))
    counts = np.bincount(val[val < 256], minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    unigram_bits = float(-(p * np.log2(p)).sum())  # ~4.7 bits for Python source
    path = tmp_path / "r.json"
    start = time.monotonic()
    proc = run_train(TRAIN_PY, session_cache, timeout=180, AUTOLOOP_TIME_BUDGET=30, AUTOLOOP_RESULT=path)
    wall = time.monotonic() - start
    assert proc.returncode == 0, explain(proc)
    result = json.loads(path.read_text())
    assert wall < 90, f"a 30 s budget took {wall:.0f} s of wall time"
    # ~2.5 on an idle 2-core machine; a heavily shared one gets fewer steps in its 30 s.
    assert result["val_bpb"] < unigram_bits - 1.0, (
        f"val_bpb {result['val_bpb']:.3f} vs unigram entropy {unigram_bits:.3f} bits after "
        f"{result['num_steps']} steps at {result['tokens_per_second']:.0f} tokens/s"
    )


# ---------------------------------------------------------------------------- FLOPs and MFU


def _small_model(module, **overrides):
    cfg = dict(module.model_config(), n_layer=2, n_embd=64, n_head=2, n_kv_head=1, seq_len=32, mlp_ratio=4, vocab_size=257)
    cfg.update(overrides)
    return module.build_model(cfg, device="cpu")


def test_flops_per_token_against_a_hand_count(train_module):
    model = _small_model(train_module)
    # Matmul weights per layer: c_q 64x64, c_k and c_v 64x32 (one kv head of 32), c_proj
    # 64x64, c_fc 64x256, mlp c_proj 256x64; plus the lm_head 257x64; the embedding
    # table is a lookup, not a matmul.
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 64 * 256
    n = 2 * per_layer + 257 * 64
    # Attention: each of 2 heads x 2 layers scores query-key pairs (2 FLOPs x head_dim 32)
    # and sums values (the same), x3 for forward + backward; a causal model scores query t
    # against t keys: sum(1..32) = 528 pairs per 32 tokens.
    pairs_per_token = sum(range(1, 33)) / 32
    attention = 3 * 2 * 2 * 2 * 2 * 32 * pairs_per_token
    assert train_module.flops_per_token(model) == int(6 * n + attention) == 664704


def test_flops_exclude_every_embedding_lookup(train_module):
    model = _small_model(train_module)
    before = train_module.flops_per_token(model)
    model.value_embeds = torch.nn.Embedding(257, 64)  # e.g. a proposal's value embeddings
    assert train_module.flops_per_token(model) == before


def test_executed_flops_add_the_math_kernels_masked_half_and_muon(train_module):
    model = _small_model(train_module)
    model_flops = train_module.flops_per_token(model)
    assert train_module.executed_flops_per_token(model) == model_flops  # flash & co skip masked tiles
    masked = 3 * 2 * 2 * 2 * 2 * 32 * (32 - 33 / 2)  # the pairs above the diagonal, per token
    assert train_module.executed_flops_per_token(model, kernel="math") == int(model_flops + masked)
    optimizers = train_module.build_optimizers(model)
    muon = [g for g in optimizers[0].param_groups]
    ns = 0
    for g in muon:
        rows, cols = g["params"][0].shape
        s, b = min(rows, cols), max(rows, cols)
        ns += len(g["params"]) * train_module.MUON_NS_STEPS * (4 * s * s * b + 2 * s**3)
    tokens = 4096
    assert train_module.executed_flops_per_token(model, optimizers, tokens) == int(model_flops + ns / tokens)


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA GH200 480GB", 989e12), ("NVIDIA H20", 148e12),
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 NVL", 835e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("Some Future GPU", None),
])
def test_gpu_peak_table_tells_variants_apart(name, peak):
    assert H.gpu_peak_flops(name) == peak


def test_result_reports_model_and_executed_flops(trained_run):
    result = trained_run["result"]
    assert result["executed_flops_per_token"] >= result["flops_per_token"] > 0
    assert result["model_tflops"] == pytest.approx(result["flops_per_token"] * result["tokens_per_second"] / 1e12)
    assert result["executed_tflops"] >= result["model_tflops"]
    assert result["hfu_percent"] is None and result["attention_kernel"] == "sdpa default" and result["compiled"] is False


@pytest.mark.slow
def test_a_failing_torch_compile_trains_eager_with_the_same_result(tmp_path, session_cache, embedded_dataset):
    """No C compiler (CXX points nowhere): one WARNING line, then exactly the eager run."""
    script = variant(tmp_path, "train_compiled.py", {"COMPILE": "True"})
    runs = {}
    for name, path, extra in (("compiled", script, {"CXX": "/nonexistent/c++", "CC": "/nonexistent/cc"}),
                              ("eager", TRAIN_PY, {})):
        out = tmp_path / f"{name}.json"
        proc = run_train(path, session_cache, timeout=900, AUTOLOOP_MAX_STEPS=5, AUTOLOOP_SEED=4, AUTOLOOP_RESULT=out,
                         **extra)
        assert proc.returncode == 0, explain(proc)
        runs[name] = (proc, json.loads(out.read_text()))
    proc, result = runs["compiled"]
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("WARNING: torch.compile does not work here")]
    assert len(warnings) == 1 and result["compiled"] is False, explain(proc)
    assert result["val_bpb"] == runs["eager"][1]["val_bpb"]
