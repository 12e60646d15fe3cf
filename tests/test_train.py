"""Tests of train.py, on the CPU.

Tests about the script run it for real, as a subprocess with the contract's AUTOLOOP_*
environment (that is how the controller runs it); unit tests import it by path the way
the harness does. One shared tiny step-mode run (`trained_run`) feeds the tests of its
outputs. Variants of the script (an absurd learning rate, the CUDA code path forced on
the CPU) are copies of train.py with constants replaced by text substitution: the same
edit a proposal would make.
"""

from __future__ import annotations

import gc
import itertools
import json
import shutil
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
from autoloop.harness import compile as compile_module
from tests.conftest import TEST_THREADS

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
    # A session fixture's run comes before the autouse fixture sets the test threads.
    env.setdefault("OMP_NUM_THREADS", TEST_THREADS)
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
        PYTHONPROFILEIMPORTTIME=1,  # what it imported, on stderr
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


def test_an_eager_run_never_imports_the_compiler(trained_run):
    """torch.optim's optimizers (their methods) and torch.profiler's start import torch._dynamo
    and inductor on first use: 1.6 CPU s of every eager run's start-up, for nothing. train.py's
    optimizers and the harness's kernel detection do without them."""
    imported = {line.rsplit("|", 1)[1].strip() for line in trained_run["proc"].stderr.splitlines()
                if line.startswith("import time:")}
    assert "torch" in imported  # the import log is there to read
    assert not {name for name in imported if name.split(".")[:2] in (["torch", "_dynamo"], ["torch", "_inductor"])}


def test_the_checkpoint_is_written_before_the_scripts_own_evaluation(trained_run):
    """The harness times the checkpoint's last write against the last step (the tail rule,
    autoloop/trust/budget.py). Written after the script evaluated itself (--no-verify), an
    honest evaluation counted as work after the clock (a GPU's, 8M tokens, is 16 steps' tokens
    against the 3 steps it allows), and on a slow CPU the remembering attack's table was
    refused for that, not by the determinism re-check that is there for it."""
    out, result = trained_run["dir"], trained_run["result"]
    assert result["val_bpb"] is not None and result["eval_seconds"] > 0  # it did evaluate itself
    written = (out / "result.json").stat().st_mtime - (out / "model.pt").stat().st_mtime
    # Less a tick of the kernel's coarse file clock; written after, it would be milliseconds.
    assert written >= result["eval_seconds"] - 0.05, (written, result["eval_seconds"])


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
    # A record for every step the curve keeps (the early stop's calibration is made from the
    # curves, so the worker must see the same points), the printed line every LOG_EVERY steps.
    assert [r["step"] for r in records] == [p["step"] for p in curve]
    assert [r["loss"] for r in records] == [p["loss"] for p in curve]
    assert all("loss" in r and "tokens_per_second" in r for r in records)
    printed = re.findall(r"^step (\d+) \(", trained_run["proc"].stdout, flags=re.MULTILINE)
    assert [int(s) for s in printed] == [1, 11, 20]


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


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 512, 128), (2, 128, 512), (4, 128, 128)])
def test_compiled_bf16_muon_step_matches_the_eager_one(train_module, shape, tmp_path, monkeypatch):
    """Muon's step as the GPU runs it (compiled, bf16, 0-D hyperparameter tensors). On torch
    2.13's CPU inductor, transposing a tall matrix into the iteration made every call NaN;
    the CUDA-path test (below) caught it one step into training."""
    m = train_module
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("torch.compile needs a C compiler")
    # Not inductor's default, /tmp/torchinductor_<user>, which no test may leave behind (160 MB).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    params = [torch.randn(shape[1:]) for _ in range(shape[0])]
    grads, buffer = torch.randn(shape) * 1e-3, torch.randn(shape) * 1e-3
    hyper = (0.85, 0.08, 0.992)
    old, m.MUON_DTYPE = m.MUON_DTYPE, torch.bfloat16
    try:
        eager = [p.clone() for p in params]
        m.muon_update(eager, grads.clone(), buffer.clone(), *hyper)
        compiled = [p.clone() for p in params]
        step = torch.compile(m.muon_update, dynamic=False, fullgraph=True)
        step(compiled, grads.clone(), buffer.clone(), *(torch.tensor(h) for h in hyper))
    finally:
        m.MUON_DTYPE = old
    for c, e, p in zip(compiled, eager, params):
        assert torch.isfinite(c).all()
        # The same update up to bf16 rounding: far closer than the update itself (lr 0.08).
        assert (c - e).abs().max().item() < 0.1 * (e - p).abs().max().item()


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
    """torch.compile (model and Muon), bf16 embeddings and stream, bf16 Muon and meta-device
    init, exercised without a GPU; compiled in the warm-up, and not once more in training."""
    script = variant(tmp_path, "train_gpu_path.py", CUDA_PATH)
    path, ckpt = tmp_path / "r.json", tmp_path / "m.pt"
    proc = run_train(script, session_cache, timeout=900, AUTOLOOP_MAX_STEPS=5, AUTOLOOP_RESULT=path,
                     AUTOLOOP_CHECKPOINT=ckpt)
    assert proc.returncode == 0, explain(proc)
    result = json.loads(path.read_text())
    assert math.isfinite(result["val_bpb"]) and result["val_bpb"] < 8.0
    assert result["compiled"] is True and result["compile_error"] is None and "WARNING" not in proc.stdout
    assert result["warmup_seconds"] > 0 and result["compile_seconds"] > 0
    assert result["graphs_compiled_in_training"] == 0  # LR, momentum, weight decay change: no recompile
    assert result["attention_kernel_ran"] == "flash"
    # The checkpoint of a compiled model loads into the plain model (prefix stripped).
    model = H.load_trained_model(script, ckpt, device="cpu")
    assert H.evaluate_bpb(model, embedded_dataset, "val", device="cpu") == pytest.approx(result["val_bpb"], rel=1e-5)


@pytest.mark.slow
def test_thirty_second_run_learns(tmp_path, session_cache, embedded_dataset):
    val = np.asarray(embedded_dataset.split("val"))
    counts = np.bincount(val[val < 256], minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    unigram_bits = float(-(p * np.log2(p)).sum())  # ~4.3 bits for the embedded corpus
    path = tmp_path / "r.json"
    start = time.monotonic()
    proc = run_train(TRAIN_PY, session_cache, timeout=180, AUTOLOOP_TIME_BUDGET=30, AUTOLOOP_RESULT=path)
    wall = time.monotonic() - start
    assert proc.returncode == 0, explain(proc)
    result = json.loads(path.read_text())
    assert wall < 90, f"a 30 s budget took {wall:.0f} s of wall time"
    # ~2.5 on an idle 2-core machine; a heavily shared one gets fewer steps in its 30 s. The
    # embedded language's unigram entropy is lower than Python source's (4.3 bits, not 4.7)
    # and a model gets below it more slowly: after 21 steps 0.73 bits below (Python: 1.05).
    assert result["val_bpb"] < unigram_bits - 0.6, (
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
    assert H.flops_per_token(model) == int(6 * n + attention) == 664704


def test_flops_exclude_every_embedding_lookup(train_module):
    model = _small_model(train_module)
    before = H.flops_per_token(model)
    model.value_embeds = torch.nn.Embedding(257, 64)  # e.g. a proposal's value embeddings
    assert H.flops_per_token(model) == before


def test_executed_flops_add_padding_the_math_kernels_masked_half_and_muon(train_module):
    model = _small_model(train_module)
    model_flops = H.flops_per_token(model)
    padding = 6 * (320 - 257) * 64  # the lm_head's padding rows (257 -> 320) are computed
    assert H.executed_flops_per_token(model) == model_flops + padding  # flash & co skip masked tiles
    masked = 3 * 2 * 2 * 2 * 2 * 32 * (32 - 33 / 2)  # the pairs above the diagonal, per token
    assert H.executed_flops_per_token(model, kernel="math") == int(model_flops + padding + masked)
    optimizers = train_module.build_optimizers(model)
    muon = [g for g in optimizers[0].param_groups]
    ns = 0
    for g in muon:
        rows, cols = g["params"][0].shape
        s, b = min(rows, cols), max(rows, cols)
        ns += len(g["params"]) * train_module.MUON_NS_STEPS * (4 * s * s * b + 2 * s**3)
    tokens = 4096
    assert H.executed_flops_per_token(model, muon=optimizers[0], ns_steps=train_module.MUON_NS_STEPS,
                                      tokens_per_step=tokens) == int(model_flops + padding + ns / tokens)


def test_palm_flops_convention_against_a_hand_count(train_module):
    # nanochat's / autoresearch's 6N + 12 L H Q T: N every matmul weight, the lm_head's 320
    # padded rows included; attention over all T = 32 keys (not the causal 33 / 2).
    model = _small_model(train_module)
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 64 * 256
    n = 2 * per_layer + 320 * 64
    assert H.flops_per_token_palm(model) == 6 * n + 12 * 2 * 2 * 32 * 32
    # At the CUDA shape (T = 2048, head_dim 128) the two conventions differ by ~1.2x.
    big = train_module.GPT(dict(train_module.model_config(), seq_len=2048, n_layer=8, n_embd=512, n_head=4, n_kv_head=4))
    ratio = H.flops_per_token_palm(big) / H.flops_per_token(big)
    assert 1.15 < ratio < 1.3, ratio


def test_mfu_in_both_conventions_on_known_flop_counts(train_module):
    m = train_module
    # 1M tokens/s at 300M (train.py's count) and 375M (PaLM's) FLOPs a token, 400M executed,
    # on a 1 PFLOP/s peak: 30%, 37.5% and 40%, and 300 / 400 TFLOP/s achieved.
    figures = H.mfu_figures(1e6, 300e6, 375e6, 400e6, 1e15)
    assert figures == pytest.approx({"mfu_percent": 30.0, "mfu_percent_palm": 37.5, "hfu_percent": 40.0,
                                     "model_tflops": 300.0, "executed_tflops": 400.0})
    # No peak (a CPU, a GPU not in the table): no percentages, the achieved TFLOP/s still.
    cpu = H.mfu_figures(1e6, 300e6, 375e6, 400e6, None)
    assert cpu["mfu_percent"] is cpu["mfu_percent_palm"] is cpu["hfu_percent"] is None and cpu["model_tflops"] == 300.0
    assert set(H.mfu_figures(None, 300e6, 375e6, 400e6, 1e15).values()) == {None}  # no throughput measured
    assert H.peak_flops(CPU_DEVICE) is None
    # docs/gpu.md's figures: the default CUDA model (8 x 512, T = 2048) at autoresearch's 1.665M
    # tokens/s on an H100 is 34.0% by train.py's count and 42.5% by PaLM's.
    cfg = dict(m.model_config(), seq_len=2048, n_layer=8, n_embd=512, n_head=4, n_kv_head=4)
    with torch.device("meta"):  # shapes only: no memory
        big = m.GPT(cfg)
    flops, palm = H.flops_per_token(big), H.flops_per_token_palm(big)
    assert (round(flops / 1e6, 1), round(palm / 1e6, 1)) == (202.1, 252.6)
    h100 = H.mfu_figures(1.665e6, flops, palm, flops, H.gpu_peak_flops("NVIDIA H100 80GB HBM3"))
    assert (round(h100["mfu_percent"], 1), round(h100["mfu_percent_palm"], 1)) == (34.0, 42.5)


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
    assert result["flops_per_token_palm"] > result["flops_per_token"] and result["mfu_percent_palm"] is None
    assert set(result["mfu_conventions"]) == {"mfu_percent", "mfu_percent_palm"}
    assert result["attention_kernel_ran"] == "flash"  # the CPU's fused kernel, seen by the profiler


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


# ---------------------------------------------------------------------------- the CUDA path on the CPU (issue 20)

# train.py's "Device and scale" switches as they are on CUDA, for a copy run on the CPU.
CUDA_PATH = {"COMPILE": "True", "AUTOCAST_DTYPE": "torch.bfloat16", "EMBEDDING_DTYPE": "torch.bfloat16",
             "MUON_DTYPE": "torch.bfloat16", "INIT_ON_META": "True"}
NO_COMPILER = {"CXX": "/nonexistent/c++", "CC": "/nonexistent/cc"}


def _tiny(module, **overrides):
    return {**module.model_config(), "n_layer": 2, "n_embd": 64, "n_head": 2, "n_kv_head": 2, "seq_len": 32, **overrides}


def test_padded_vocabulary_never_reaches_the_logits_or_the_loss(train_module):
    m = train_module
    torch.manual_seed(0)
    model = m.build_model(_tiny(m))
    assert model.wte.weight.shape[0] == model.lm_head.weight.shape[0] == 320  # 257 padded to a multiple of 64
    idx = torch.randint(0, 257, (2, 32))
    logits, loss = model(idx), model(idx, targets=idx)
    assert logits.shape == (2, 32, 257)
    with torch.no_grad():
        model.lm_head.weight[257:] = 1e3  # padding rows that would dominate any softmax they were part of
    assert torch.equal(model(idx), logits) and torch.equal(model(idx, targets=idx), loss)
    model(idx, targets=idx).backward()
    assert not model.lm_head.weight.grad[257:].any()  # no gradient either: they stay what they are


def test_chunked_loss_equals_the_plain_loss_and_its_gradients(train_module, monkeypatch):
    m = train_module
    torch.manual_seed(0)
    x = torch.randn(300, 16, requires_grad=True)
    weight = torch.randn(320, 16, requires_grad=True)
    y = torch.randint(0, 257, (300,))
    # The definition: cross-entropy of the soft-capped logits over the 257 real columns.
    reference = torch.nn.functional.cross_entropy(15.0 * torch.tanh((x @ weight[:257].T) / 15.0), y)
    plain = m.softcapped_cross_entropy(x, weight, y, 15.0, 257, chunk_bytes=10**12)
    (gx, gw) = torch.autograd.grad(0.5 * reference, (x, weight))
    for rows in (1, 64, 299):  # one row per chunk, uneven chunks, one short last chunk
        chunked = m.softcapped_cross_entropy(x, weight, y, 15.0, 257, chunk_bytes=4 * 257 * rows)
        assert chunked.item() == pytest.approx(reference.item(), rel=1e-6) and plain.item() == pytest.approx(reference.item(), rel=1e-6)
        cx, cw = torch.autograd.grad(0.5 * chunked, (x, weight))  # backward scales by the incoming gradient
        torch.testing.assert_close(cx, gx, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(cw, gw, rtol=1e-4, atol=1e-7)
        assert not cw[257:].any()
    # Through the model: GPT.forward's loss is this one, chunked at LOSS_CHUNK_BYTES.
    model = m.build_model(_tiny(m))
    idx = torch.randint(0, 257, (4, 32))
    plain_loss = model(idx, targets=idx)
    plain_grads = torch.autograd.grad(plain_loss, list(model.parameters()))
    monkeypatch.setattr(m, "LOSS_CHUNK_BYTES", 4 * 257 * 16)  # 16 rows a chunk: 8 chunks
    chunked_loss = model(idx, targets=idx)
    assert chunked_loss.item() == pytest.approx(plain_loss.item(), rel=1e-6)
    for a, b in zip(plain_grads, torch.autograd.grad(chunked_loss, list(model.parameters()))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # no gradient wanted: none is computed, the value is the same
        assert m.softcapped_cross_entropy(x, weight, y, 15.0, 257, chunk_bytes=4 * 257 * 64).item() == pytest.approx(
            reference.item(), rel=1e-6)


def _raised(exc, cause=None):
    """`exc` as raised, `from cause` (a real chain, as torch builds them)."""
    try:
        raise exc from cause
    except BaseException as raised:
        return raised


def test_is_compile_error_tells_compiler_failures_from_the_codes_errors(train_module):
    from torch._dynamo.exc import BackendCompilerFailed, InternalTorchDynamoError, TorchRuntimeError, Unsupported
    from torch._inductor.exc import CppCompileError, InductorError, InvalidCxxCompiler, TritonMissing

    is_compile_error = H.is_compile_error
    # The compiler's own failures (the chains torch 2.13 raises: see the slow tests for real ones).
    assert is_compile_error(InductorError(InvalidCxxCompiler("/nonexistent/c++"), None))
    assert is_compile_error(BackendCompilerFailed("inductor", TritonMissing(None), None))
    assert is_compile_error(_raised(InductorError(CppCompileError(["c++"], "error: boom"), None)))
    assert is_compile_error(InternalTorchDynamoError("dynamo bug"))
    assert is_compile_error(Unsupported("cannot trace this call"))  # fullgraph: untraceable, eager runs it
    # The code's errors: dynamo ran it on fake tensors and it raised (a shape bug, a pinned
    # kernel that cannot run these shapes): TorchRuntimeError <- Unsupported <- RuntimeError.
    shape_bug = RuntimeError("a and b must have same reduction dim, but got [64, 64] X [65, 4].")
    traced = _raised(TorchRuntimeError("RuntimeError when making fake tensor call"),
                     _raised(Unsupported("RuntimeError when making fake tensor call"), shape_bug))
    assert not is_compile_error(traced)
    assert not is_compile_error(shape_bug) and not is_compile_error(ValueError("x")) and not is_compile_error(AssertionError())


def test_auto_kernel_pick_leaves_flash_only_for_a_clearly_faster_one(train_module, capsys):
    pick = H.pick_attention_kernel
    assert pick({"flash": 1.00, "cudnn": 0.97, "efficient": 1.2}, 0.05) == "flash"  # 3% is noise between trials
    assert pick({"flash": 1.00, "cudnn": 0.90, "efficient": 1.2}, 0.05) == "cudnn"
    assert pick({"flash": "No available kernel", "cudnn": 0.9, "efficient": 0.8}, 0.05) == "efficient"
    assert pick({"flash": "x", "cudnn": "y", "efficient": "z"}, 0.05) == "math"
    assert "WARNING: no fused attention kernel" in capsys.readouterr().out


def test_attention_kernels_are_timed_in_the_models_layout(train_module):
    cfg = _tiny(train_module, n_kv_head=1)  # grouped-query: enable_gqa, as the model calls it
    times = H.time_attention_kernels(cfg, 2, CPU_DEVICE, torch.float32, kernels=("flash", "math", "cudnn"), repeats=3)
    assert isinstance(times["flash"], float) and isinstance(times["math"], float) and isinstance(times["cudnn"], str)


CPU_DEVICE = torch.device("cpu")


def _steps(module, model, optimizers, n, seed=5):
    gen = torch.Generator().manual_seed(seed)
    batches = iter([(t[:, :-1], t[:, 1:]) for t in (torch.randint(0, 257, (2, 33), generator=gen) for _ in range(n + 1))])
    step = module.make_train_step(model, optimizers, batches)
    return [step()[0] for _ in range(n)]


def test_warm_up_leaves_model_and_optimizers_as_they_were(train_module):
    m = train_module
    runs = []
    for warm in (False, True):
        torch.manual_seed(0)
        model = m.build_model(_tiny(m))
        optimizers = m.build_optimizers(model)
        if warm:
            seconds, ran = H.warm_up(model, optimizers, m.make_train_step, batch_size=2, steps=2)
            assert seconds > 0 and ran == "flash" and all(not opt.state for opt in optimizers)
        runs.append((_steps(m, model, optimizers, 3), [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]  # the same losses, bit for bit ...
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))  # ... and the same weights


def test_prepare_training_eager_is_the_plain_setup(train_module):
    m = train_module
    training = m.prepare_training(_tiny(m), CPU_DEVICE, seed=3, batch_size=2, compile_model=False)
    assert training["compiled"] is False and training["compile_error"] is None and training["kernel_ran"] == "flash"
    assert training["train_model"] is training["model"]
    torch.manual_seed(3)
    plain = m.build_model(_tiny(m))
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), training["model"].parameters()))


@pytest.mark.parametrize("kernel,ran", [(None, "flash"), ("flash", "flash"), ("math", "math")])
def test_the_kernel_that_ran_is_the_one_pinned(train_module, kernel, ran):
    # Seen by the profiler in the warm-up (the CPU has a fused "flash" kernel and math);
    # None leaves the choice to SDPA, which takes the fused one.
    training = train_module.prepare_training(_tiny(train_module), CPU_DEVICE, seed=0, batch_size=2, kernel=kernel,
                                             compile_model=False)
    assert training["kernel_ran"] == ran
    assert {a.kernel for a in training["model"].modules() if hasattr(a, "kernel")} == {kernel}


def test_muon_takes_its_hyperparameters_as_floats_or_0d_tensors_alike(train_module):
    m = train_module
    torch.manual_seed(0)
    params = [torch.randn(64, 32) for _ in range(3)]
    grads = torch.randn(3, 64, 32)
    results = []
    for hyper in ((0.9, 0.02, 0.99), tuple(torch.tensor(v) for v in (0.9, 0.02, 0.99))):
        ps, buf = [p.clone() for p in params], torch.full((3, 64, 32), 0.1)
        m.muon_update(ps, grads.clone(), buf, *hyper)
        results.append((ps, buf))
    for a, b in zip(results[0][0] + [results[0][1]], results[1][0] + [results[1][1]]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_residual_stream_embeddings_and_rotary_are_bf16_on_the_cuda_path(tmp_path):
    from torch.overrides import TorchFunctionMode

    m = H.import_train_module(variant(tmp_path, "train_cuda_dtypes.py", CUDA_PATH))
    model = m.build_model(_tiny(m, n_kv_head=1), device="cpu")
    assert model.wte.weight.dtype == model.cos.dtype == model.sin.dtype == torch.bfloat16
    assert model.blocks[0].attn.c_q.weight.dtype == torch.float32  # fp32 master weights for the optimizers
    seen = {"block_in": set(), "block_out": set(), "sdpa": set()}

    def record(module, args, out):  # returns None: the output stays as it is
        seen["block_in"].add(args[0].dtype)
        seen["block_out"].add(out.dtype)

    for block in model.blocks:
        block.register_forward_hook(record)

    class SdpaDtypes(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.scaled_dot_product_attention:
                seen["sdpa"].update(a.dtype for a in args[:3])
            return func(*args, **(kwargs or {}))

    idx = torch.randint(0, 257, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16), SdpaDtypes():  # as make_train_step runs it
        loss = model(idx, targets=idx)
    assert seen == {"block_in": {torch.bfloat16}, "block_out": {torch.bfloat16}, "sdpa": {torch.bfloat16}}
    assert loss.dtype == torch.float32
    loss.backward()
    assert model.wte.weight.grad.dtype == torch.bfloat16 and model.lm_head.weight.grad.dtype == torch.float32
    logits = model(idx)  # without autocast too (the harness evaluates a CPU model so): bf16 inside, fp32 out
    assert logits.dtype == torch.float32 and logits.shape == (2, 32, 257)
    # The CPU path is fp32 throughout.
    cpu = H.import_train_module(TRAIN_PY).build_model(_tiny(m))
    assert cpu.wte.weight.dtype == cpu.cos.dtype == torch.float32


@pytest.mark.slow
def test_compiled_muon_step_does_not_recompile_as_the_schedule_changes(train_module, tmp_path, monkeypatch):
    """One compiled graph per shape group; LR, momentum and weight decay are 0-D tensors,
    so a schedule that changes them every step compiles nothing more. And far fewer ops."""
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    m = train_module
    torch._dynamo.reset()
    counters.clear()
    ops, updated = {}, {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = m.build_model(_tiny(m))
        muon = m.build_optimizers(model, compiled=compiled)[0]
        gen = torch.Generator().manual_seed(1)
        for step in range(6):
            for group in muon.param_groups:
                group["lr"], group["momentum"], group["weight_decay"] = 0.01 * (step + 1), 0.85 + 0.02 * step, 0.2 - 0.03 * step
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            if step == 1:
                graphs_after_first_step = counters["stats"]["unique_graphs"]
            if step == 5:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    muon.step()
                ops[compiled] = [e.name for e in prof.events() if e.name.startswith("aten::") and _top_level_op(e)]
            else:
                muon.step()
        updated[compiled] = [p.detach().clone() for p in model.blocks.parameters()]
    groups = len(muon.param_groups)
    assert groups == 3  # 64x64, 256x64, 64x256
    assert graphs_after_first_step == groups  # compiled at the first step: one graph per shape ...
    assert counters["stats"]["unique_graphs"] == groups  # ... and nothing after, whatever the schedule did
    for a, b in zip(updated[False], updated[True]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # Launches: eager dispatches every elementwise op of every parameter; compiled, only the
    # Polar Express matmuls remain separate (extern kernels, 3 per iteration per group), the
    # rest is fused.
    eager, fused = ops[False], ops[True]
    assert fused.count("aten::bmm") == 3 * m.MUON_NS_STEPS * groups
    assert not {"aten::mul_", "aten::sub_", "aten::lerp_"} & set(fused)
    assert len(fused) < len(eager) / 3, (len(fused), len(eager))


def _top_level_op(event):
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


KERNEL_PROBE = """
import json, sys, torch
from torch._dynamo.utils import counters
from autoloop import harness as H
m = H.import_train_module(sys.argv[1])
cfg = dict(m.model_config(), n_layer=1, n_embd=64, n_head=2, n_kv_head=2, seq_len=64)
t = m.prepare_training(cfg, torch.device("cpu"), seed=0, batch_size=2, kernel=sys.argv[2], compile_model=True)
print(json.dumps({"compiled": t["compiled"], "ran": t["kernel_ran"], "cache_hits": counters["inductor"]["fxgraph_cache_hit"]}))
"""


@pytest.mark.slow
def test_two_processes_sharing_a_compile_cache_each_run_the_kernel_they_pinned(tmp_path, session_cache):
    """Issue 20, item 3: the pin is inside forward, so it is part of the compiled graph and
    of its cache key. With the pin outside, the second process ran the first one's kernel."""
    env = train_env(session_cache, TORCHINDUCTOR_CACHE_DIR=tmp_path / "shared-inductor", OMP_NUM_THREADS=1)
    out = {}
    for kernel in ("flash", "math"):
        proc = subprocess.run([sys.executable, "-c", KERNEL_PROBE, str(TRAIN_PY), kernel], capture_output=True, text=True,
                              env=env, timeout=900, cwd=REPO_ROOT)
        assert proc.returncode == 0, explain(proc)
        out[kernel] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["flash"] == {**out["flash"], "compiled": True, "ran": "flash"}
    assert out["math"]["compiled"] is True and out["math"]["ran"] == "math", out
    assert out["math"]["cache_hits"] > 0  # it did read the shared cache (Muon's graphs are the same)


@pytest.mark.slow
def test_chunked_loss_compiles_in_one_graph(train_module, tmp_path, monkeypatch):
    """At a large vocabulary the compiled model's loss is the chunked one: it must trace
    whole (fullgraph: no break) and give eager's value and gradients."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    m = train_module
    torch.manual_seed(0)
    x, weight = torch.randn(300, 16, requires_grad=True), torch.randn(320, 16, requires_grad=True)
    y = torch.randint(0, 257, (300,))

    def loss(x, weight, y):
        return m.softcapped_cross_entropy(x, weight, y, 15.0, 257, chunk_bytes=4 * 257 * 64)  # 5 chunks

    eager = loss(x, weight, y)
    compiled = torch.compile(loss, fullgraph=True, dynamic=False)(x, weight, y)
    assert compiled.item() == pytest.approx(eager.item(), rel=1e-6)
    for a, b in zip(torch.autograd.grad(eager, (x, weight)), torch.autograd.grad(compiled, (x, weight))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


MEMORY_PROBE = """
import json, sys, torch
from autoloop import harness as H
m = H.import_train_module(sys.argv[1])
torch.manual_seed(0)
x = torch.randn(4096, 64, requires_grad=True)  # 4096 tokens' hidden states
weight = torch.randn(16384, 64, requires_grad=True)  # a 16k lm_head (16000 real rows, 384 padding)
y = torch.randint(0, 16000, (4096,))

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

def loss(n):
    return m.softcapped_cross_entropy(x[:n], weight, y[:n], 15.0, 16000, chunk_bytes=int(sys.argv[2]))

loss(8).backward()  # first-call allocations out of the way
x.grad = weight.grad = None
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
before = kib("VmRSS")
loss(4096).backward()
print(json.dumps({"peak_growth_mb": (kib("VmHWM") - before) / 1024}))
"""


@pytest.mark.slow
def test_large_vocabulary_loss_stays_within_its_memory_bound(tmp_path, session_cache):
    """16k vocabulary, 4096 tokens: the fp32 logits alone are 250 MiB, and the plain loss
    holds several copies. Chunked at 8 MiB, the peak is a few chunks plus the gradients."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to measure a peak")
    chunk = 8 * 2**20
    growth = {}
    for name, chunk_bytes in (("chunked", chunk), ("plain", 2**40)):
        # Big blocks straight from mmap: freed memory leaves the RSS, so the peak is the allocations'.
        env = train_env(session_cache, OMP_NUM_THREADS=1, MALLOC_MMAP_THRESHOLD_=131072)
        proc = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(TRAIN_PY), str(chunk_bytes)], capture_output=True,
                              text=True, env=env, timeout=300, cwd=REPO_ROOT)
        assert proc.returncode == 0, explain(proc)
        growth[name] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_growth_mb"]
    # The bound: ~4 chunk-sized buffers at a time (measured ~31 MiB of 8 MiB chunks), plus
    # dW and the weight's gradient (2 x 16384 x 64 x 4 B) and dx and x's (2 x 4096 x 64 x 4 B).
    gradients_mb = (2 * 16384 * 64 * 4 + 2 * 4096 * 64 * 4) / 2**20
    bound_mb = 5 * chunk / 2**20 + gradients_mb
    assert growth["chunked"] < bound_mb, growth
    assert growth["plain"] > 10 * bound_mb, growth  # what the bound protects from: the test can fail


def test_the_warm_up_ends_before_the_loader_says_hello_to_the_feed(tmp_path, monkeypatch, session_cache,
                                                                    embedded_dataset):
    """Issue 20, item 1, as an order of events: main() builds, warms up (where torch.compile
    compiles, and finds out whether it works) and only then opens its one loader; the feed
    sees its hello after the warm-up has ended, and serves exactly the batches training
    draws (the warm-up drew none)."""
    m = H.import_train_module(variant(tmp_path, "train_order.py", {}))  # a fresh module: main() sets its globals
    events = []
    real_warm_up, real_loader = compile_module.warm_up, H.TokenLoader

    def warm_up(*args, **kwargs):
        out = real_warm_up(*args, **kwargs)
        events.append(("warm-up ended", time.monotonic()))  # the feed's clock
        return out

    class Loader(real_loader):
        def __init__(self, *args, **kwargs):
            events.append(("loader opened", time.monotonic()))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(compile_module, "warm_up", warm_up)  # compile_or_eager calls it
    monkeypatch.setattr(H, "TokenLoader", Loader)
    for key in [k for k in os.environ if k.startswith("AUTOLOOP_")]:
        monkeypatch.delenv(key)
    with H.FeedServer(embedded_dataset.path, tmp_path / "feed.sock", seed=0) as feed:
        env = {"AUTOLOOP_FEED": feed.address, "AUTOLOOP_DATA_DIR": embedded_dataset.path, "AUTOLOOP_MAX_STEPS": 3,
               "AUTOLOOP_SEED": 0, "AUTOLOOP_EVAL": "external", "AUTOLOOP_CACHE_DIR": session_cache,
               "AUTOLOOP_RESULT": tmp_path / "result.json"}
        for key, value in env.items():
            monkeypatch.setenv(key, str(value))
        gc_was_enabled = gc.isenabled()
        try:
            m.main()
        finally:
            if gc_was_enabled:
                gc.enable()
        summary = feed.summary()
    assert [name for name, _ in events] == ["warm-up ended", "loader opened"]
    assert len(summary["streams"]) == 1
    assert summary["started_at"] + summary["first_request"] >= events[0][1]  # the hello came after the warm-up
    grad_accum = m.TOTAL_BATCH_TOKENS // (m.DEVICE_BATCH_SIZE * H.seq_len("cpu"))
    assert summary["batches"] == 3 * grad_accum + 1  # 3 steps' micro-batches, and the one fetched ahead
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["num_steps"] == 3 and result["warmup_seconds"] > 0 and result["val_bpb"] is None


@pytest.mark.slow
def test_a_failing_compile_under_the_feed_is_a_valid_baseline(tmp_path, session_cache, embedded_dataset):
    """Issue 20, item 1: the eager restart used to open a second loader stream and draw its
    first batch again, one batch more than the warm-up may draw: every such trial was
    rejected. Now compile is decided on random tokens before the feed serves anything."""
    from autoloop.trust.budget import check_budget
    from tests.test_feed import run_with_feed

    script = variant(tmp_path, "train_no_compiler.py", {"COMPILE": "True"})
    proc, summary, result = run_with_feed(script, session_cache, embedded_dataset.path, tmp_path / "run", meta_only=True,
                                          timeout=900, AUTOLOOP_TIME_BUDGET=4, AUTOLOOP_SEED=2, OMP_NUM_THREADS=1,
                                          AUTOLOOP_EVAL="external",
                                          **NO_COMPILER)
    assert proc.returncode == 0, explain(proc)
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("WARNING: torch.compile does not work here (")]
    assert len(warnings) == 1 and "training eager" in warnings[0] and "InvalidCxxCompiler" in warnings[0], explain(proc)
    assert result["compiled"] is False and "InvalidCxxCompiler" in result["compile_error"]
    assert len(summary["streams"]) == 1  # one loader, opened once compile was decided
    problem, figures = check_budget(summary, result, time_budget=4, max_steps=None)
    assert problem is None, (problem, figures)
    assert figures["warmup_batches"] <= figures["warmup_batches_allowed"]


@pytest.mark.slow
@pytest.mark.parametrize("name,edit,error", [
    # A proposal's shape bug: the MLP's output projection one input too wide.
    ("shape_bug", {"        self.c_proj = Linear(hidden, cfg[\"n_embd\"], bias=False)\n":
                   "        self.c_proj = Linear(hidden + 1, cfg[\"n_embd\"], bias=False)\n"},
     "mat1 and mat2 shapes cannot be multiplied"),
    # A pinned kernel that cannot run here (the efficient kernel has no CPU implementation).
    ("pinned_kernel", {'ATTENTION_BACKEND = "auto"': 'ATTENTION_BACKEND = "efficient"'}, "No viable backend for scaled_dot_product_attention"),
])
def test_the_codes_own_error_under_compile_is_reported_as_itself(tmp_path, session_cache, name, edit, error):
    script = variant(tmp_path, f"train_{name}.py", {"COMPILE": "True"})
    text = script.read_text()
    for old, new in edit.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    script.write_text(text)
    proc = run_train(script, session_cache, timeout=900, AUTOLOOP_MAX_STEPS=2, OMP_NUM_THREADS=1)
    assert proc.returncode == 1, explain(proc)
    assert "torch.compile does not work here" not in proc.stdout, explain(proc)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: ") and error in last, explain(proc)  # eager's own error ...
    assert str(script) in proc.stderr.split("Traceback")[-1], explain(proc)  # ... with a traceback into the code


# ---------------------------------------------------------------------------- on a GPU (skipped without CUDA)
# What the CPU tests above cannot show: the real CUDA path. docs/gpu.md lists these as not
# yet run on a GPU; bench/gpu_check.sh measures the speed figures.

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the CUDA path as it runs there")


def cuda_env(cache: Path, **extra) -> dict:
    env = train_env(cache, **extra)
    env.pop("CUDA_VISIBLE_DEVICES")  # train_env hides the GPU for the CPU tests
    return env


@pytest.mark.cuda
@pytest.mark.slow
@needs_cuda
def test_on_cuda_a_run_compiles_in_the_warm_up_only_and_runs_the_kernel_it_asked_for(tmp_path, session_cache,
                                                                                      embedded_dataset):
    path = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(TRAIN_PY)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env=cuda_env(session_cache, AUTOLOOP_MAX_STEPS=10, AUTOLOOP_RESULT=path,
                                       TORCHINDUCTOR_CACHE_DIR=tmp_path / "inductor"))
    assert proc.returncode == 0, explain(proc)
    result = json.loads(path.read_text())
    assert result["compiled"] is True and result["compile_error"] is None, result["compile_error"]
    assert result["graphs_compiled_in_training"] == 0  # the schedule changes LR, momentum, decay: no recompile
    assert result["attention_kernel"] in ("flash", "cudnn", "efficient")  # "auto" picks a fused kernel ...
    assert result["attention_kernel_ran"] == result["attention_kernel"]  # ... and that one ran
    assert result["peak_memory_mb"] > 0 and result["device"] == torch.cuda.get_device_name(0)
    if H.gpu_peak_flops(result["device"]):
        ratio = result["flops_per_token_palm"] / result["flops_per_token"]
        assert result["mfu_percent_palm"] == pytest.approx(ratio * result["mfu_percent"], rel=1e-9)
        assert 0 < result["mfu_percent"] < 100 and result["hfu_percent"] >= result["mfu_percent"]


@pytest.mark.cuda
@needs_cuda
def test_on_cuda_the_large_vocabulary_loss_stays_within_its_memory_bound(train_module):
    """32k vocabulary, 32k tokens, bf16 hidden states as on the CUDA path: 4 GiB of fp32
    logits a copy unchunked; chunked at 256 MiB, a few chunks plus the gradients."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    n, vocab, dim, chunk = 32768, 32000, 512, 256 * 2**20
    x = torch.randn(n, dim, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    weight = torch.randn(vocab, dim, device=device, generator=gen).mul_(0.02).requires_grad_()
    y = torch.randint(0, vocab, (n,), device=device, generator=gen)
    growth, values = {}, {}
    for name, chunk_bytes in (("chunked", chunk), ("plain", 2**40)):
        x.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = train_module.softcapped_cross_entropy(x, weight, y, 15.0, vocab, chunk_bytes=chunk_bytes)
        loss.backward()
        torch.cuda.synchronize()
        growth[name] = (torch.cuda.max_memory_allocated() - before) / 2**20
        values[name] = (loss.item(), x.grad.float().norm().item(), weight.grad.norm().item())
    gradients_mb = (2 * vocab * dim * 4 + 2 * n * dim * 2) / 2**20
    # ~4 chunk-sized fp32 buffers at a time (the CPU test measures it); 6 leaves the allocator its rounding.
    assert growth["chunked"] < 6 * chunk / 2**20 + gradients_mb, growth
    assert growth["plain"] > 2 * n * vocab * 4 / 2**20, growth  # what the bound protects from: 2+ fp32 copies
    assert values["chunked"] == pytest.approx(values["plain"], rel=2e-2)  # bf16 matmuls: the same to bf16's precision
