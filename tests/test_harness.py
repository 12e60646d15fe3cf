import importlib
import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from autoloop import harness as H
from autoloop.harness.contract import embedded_dataset_name
from autoloop.harness.metric import evaluation_windows


class Bigram(torch.nn.Module):
    """A real (tiny) model implementing the harness interface: idx -> logits."""

    def __init__(self, vocab: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g))

    def forward(self, idx):
        return self.table[idx]


def test_embedded_corpus_is_split_and_fingerprinted(embedded_dataset):
    ds = embedded_dataset
    splits = ds.meta["splits"]
    assert set(splits) == {"train", "val", "heldout"}
    assert splits["train"]["tokens"] > 10 * splits["val"]["tokens"] > 0
    assert splits["heldout"]["tokens"] > 100_000
    assert len({splits[s]["sha256"] for s in splits}) == 3
    assert ds.name == embedded_dataset_name()
    assert H.verify_dataset(ds) == []
    # Documents are disjoint between splits: each starts with BOS, and no val document
    # appears in train.
    val = bytes(ds.split("val")[ds.split("val") < 256].astype(np.uint8))
    train = bytes(ds.split("train")[ds.split("train") < 256].astype(np.uint8))
    first_val_doc = val[:2000]
    assert first_val_doc not in train


def test_preparation_is_deterministic(tmp_path, embedded_dataset):
    again = H.prepare_embedded(tmp_path / "again")
    assert again.fingerprint == embedded_dataset.fingerprint


def test_bpb_is_mean_loss_over_ln2_for_bytes(embedded_dataset):
    model = Bigram(embedded_dataset.vocab_size)
    windows = torch.from_numpy(evaluation_windows(embedded_dataset.split("val"), "cpu", max_tokens=2048))
    x, y = windows[:, :-1], windows[:, 1:]
    bpb = H.bpb_on_batches(model, [(x, y)], embedded_dataset.token_bytes)
    logits = model(x)
    losses = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none")
    counted = y.reshape(-1) != embedded_dataset.bos_id
    assert bpb == pytest.approx(losses[counted].mean().item() / math.log(2), rel=1e-5)


def test_bpb_counts_raw_bytes_of_multibyte_tokens():
    # Token 3 stands for 3 raw bytes (e.g. a partial UTF-8 sequence), token 0 is BOS.
    token_bytes = np.array([0, 1, 1, 3])
    model = Bigram(4, seed=1)
    x = torch.tensor([[0, 1, 3, 2, 3]])
    y = torch.tensor([[1, 3, 2, 3, 0]])
    losses = F.cross_entropy(model(x)[0], y[0], reduction="none")
    expected = (losses[:4].sum() / (math.log(2) * (1 + 3 + 1 + 3))).item()
    assert H.bpb_on_batches(model, [(x, y)], token_bytes) == pytest.approx(expected, rel=1e-6)


def test_evaluate_bpb_uses_fixed_windows(embedded_dataset):
    model = Bigram(embedded_dataset.vocab_size)
    a = H.evaluate_bpb(model, embedded_dataset, "val", device="cpu", batch_size=7)
    b = H.evaluate_bpb(model, embedded_dataset, "val", device="cpu", batch_size=16)
    assert a == pytest.approx(b, rel=1e-6)
    assert H.evaluate_bpb(model, embedded_dataset, "heldout", device="cpu") != pytest.approx(a, rel=1e-4)


def test_loader_windows_are_shifted_and_seeded(embedded_dataset):
    a = H.TokenLoader(embedded_dataset, "train", 4, 32, seed=3)
    b = H.TokenLoader(embedded_dataset, "train", 4, 32, seed=3)
    (xa, ya), (xb, _) = next(a), next(b)
    assert torch.equal(xa, xb) and xa.dtype == torch.int64 and xa.shape == (4, 32)
    assert torch.equal(xa[:, 1:], ya[:, :-1])
    seq = H.TokenLoader(embedded_dataset, "val", 2, 16, sequential=True)
    x, _ = next(seq)
    assert torch.equal(x[0], torch.from_numpy(embedded_dataset.split("val")[:16].astype(np.int64)))


def test_clock_time_and_step_modes():
    clock = H.TrainingClock(time_budget=1.0, warmup_steps=2)
    for _ in range(2):
        clock.step_finished(10.0)
    assert clock.compile_seconds == 20.0 and clock.training_seconds == 0 and not clock.done
    clock.step_finished(0.6)
    assert clock.progress == pytest.approx(0.6) and not clock.done
    clock.step_finished(0.6)
    assert clock.done and clock.progress == 1.0
    steps = H.TrainingClock(max_steps=3)
    for _ in range(3):
        assert not steps.done
        steps.step_finished(0.1)
    assert steps.done


def test_summary_block_round_trip():
    result = {"val_bpb": 1.2345678, "num_steps": 12, "device": "cpu", "mfu_percent": None, "curve": [{"step": 1}]}
    text = "noise\n---\nnot: this\n" + H.summary_block(result)
    parsed = H.parse_summary(text)
    assert parsed == {"val_bpb": 1.234568, "num_steps": 12, "device": "cpu", "mfu_percent": None}


def test_runspec_reads_contract_env(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOLOOP_TIME_BUDGET", "30")
    monkeypatch.setenv("AUTOLOOP_MAX_STEPS", "7")
    monkeypatch.setenv("AUTOLOOP_RESULT", str(tmp_path / "r.json"))
    spec = H.RunSpec.from_env()
    assert spec.time_budget == 30.0 and spec.max_steps == 7 and spec.result_path == tmp_path / "r.json"
    monkeypatch.setenv("AUTOLOOP_MAX_STEPS", "many")
    with pytest.raises(H.HarnessError, match="AUTOLOOP_MAX_STEPS='many' is not a valid int"):
        H.RunSpec.from_env()


def test_missing_named_dataset_is_one_clear_line(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOLOOP_DATA_DIR", str(tmp_path / "nope"))
    with pytest.raises(H.HarnessError) as err:
        H.load_dataset()
    assert "no prepared dataset" in str(err.value) and "autoloop prepare" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("damage", ["truncate", "meta", "missing"])
def test_corrupt_cache_is_one_clear_line(tmp_path, embedded_dataset, damage):
    import shutil

    copy = tmp_path / "ds"
    shutil.copytree(embedded_dataset.path, copy)
    if damage == "truncate":
        with open(copy / "val.bin", "r+b") as f:
            f.truncate(100)
    elif damage == "meta":
        (copy / "meta.json").write_text("{not json")
    else:
        (copy / "token_bytes.npy").unlink()
    with pytest.raises(H.HarnessError) as err:
        H.load_dataset(copy)
    message = str(err.value)
    assert "is corrupt" in message and f"rm -rf {copy}" in message and "\n" not in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_cache_folder_non_root(monkeypatch, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    monkeypatch.setenv("AUTOLOOP_CACHE_DIR", str(locked))
    with pytest.raises(H.HarnessError, match="cannot write the data cache"):
        H.load_dataset()


def test_unwritable_cache_folder(monkeypatch, tmp_path):
    # A regular file where a folder is needed fails even for root.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("AUTOLOOP_CACHE_DIR", str(blocker))
    with pytest.raises(H.HarnessError) as err:
        H.load_dataset()
    assert "cannot write the data cache" in str(err.value) and "AUTOLOOP_CACHE_DIR" in str(err.value)


def test_harness_fingerprint_tracks_source(tmp_path):
    import shutil

    copy = tmp_path / "harness"
    from autoloop.harness.fingerprint import HARNESS_DIR

    shutil.copytree(HARNESS_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = H.compute_harness_fingerprint(copy)
    assert before == H.harness_fingerprint()
    (copy / "metric.py").write_text((copy / "metric.py").read_text() + "\n# edited\n")
    assert H.compute_harness_fingerprint(copy) != before


def test_gpu_peak_table():
    assert H.gpu_peak_flops("NVIDIA H200") == 989e12
    assert H.gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert H.gpu_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert H.gpu_peak_flops("Some Future GPU") is None
    assert H.gpu_peak_flops(None) is None


# ---------------------------------------------------------------------------- train.py's infrastructure (issue 32)


def test_one_kernel_table_reads_profiler_events_and_dispatched_ops_alike():
    # The names the profiler gives (train.py's warm-up) and the ones a dispatch mode sees
    # (`autoloop check`): each fused kernel is named from either.
    assert H.kernel_from_op_names(["aten::_flash_attention_forward", "aten::mm"]) == "flash"
    assert H.kernel_from_op_names(["aten._scaled_dot_product_flash_attention_for_cpu.default"]) == "flash"
    assert H.kernel_from_op_names(["aten._scaled_dot_product_cudnn_attention.default"]) == "cudnn"
    assert H.kernel_from_op_names(["aten::_efficient_attention_forward"]) == "efficient"
    assert H.kernel_from_op_names(["aten._scaled_dot_product_attention_math.default"]) == "math"
    # Eager math is a softmax; compiled math is fused away, so attention that ran is math.
    assert H.kernel_from_op_names(["aten.bmm.default", "aten._softmax.default"], none_found="none") == "math"
    assert H.kernel_from_op_names(["aten.mm.default"]) == "math"
    assert H.kernel_from_op_names(["aten.mm.default"], none_found="none found") == "none found"


def test_an_unknown_kernel_name_is_one_line_that_names_the_choices():
    with pytest.raises(ValueError, match="unknown attention kernel 'fast': use one of flash, cudnn, efficient, math or auto"):
        H.choose_attention_kernel({}, 1, "cpu", None, backend="fast")
    assert H.choose_attention_kernel({}, 1, "cpu", None, backend="cudnn") == "cudnn"  # named: never timed


def test_the_loss_curve_thins_to_at_most_its_points_and_keeps_the_last_step():
    curve = H.LossCurve(4)
    for step in range(20):
        curve.add(step, seconds=step * 0.5, loss=10.0 - step, lr=1.0, grad_norm=1.0, last=step == 19)
    # 5 points at stride 1 -> every other, stride 2; steps 0, 2, 4 at stride 2 -> thinned to
    # stride 4: recorded 0-based steps 0, 4, 8, ... then the last (19) as step 20.
    assert [p["step"] for p in curve.points] == [1, 9, 17, 20]
    assert curve.points[-1] == {"step": 20, "seconds": 9.5, "loss": -9.0, "lr": 1.0, "grad_norm": 1.0}


def test_the_loss_curve_says_which_steps_it_kept_and_a_quiet_progress_step_is_a_record_only(tmp_path, capsys):
    # train.py writes a progress record for each step the curve keeps (the early stop's
    # calibration is made from these points), printing a line only every LOG_EVERY steps.
    curve = H.LossCurve(4)
    kept = [curve.add(step, seconds=0.0, loss=1.0, lr=1.0, grad_norm=1.0, last=step == 19) for step in range(20)]
    assert [k for k, was in enumerate(kept) if was] == [0, 1, 2, 3, 4, 6, 8, 12, 16, 19]
    writer = H.ProgressWriter(tmp_path / "progress.jsonl")
    writer.step(3, 0.15, 2.5, 1.0, 1.0, 1.0, 0.25, 100.0, None, echo=False)
    assert capsys.readouterr().out == ""
    (record,) = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert record["step"] == 4 and record["loss"] == 2.5


def test_a_progress_step_is_one_record_and_the_progress_line_as_train_py_printed_it(tmp_path, capsys):
    writer = H.ProgressWriter(tmp_path / "progress.jsonl")
    writer.step(9, 0.123456, 2.345678, 0.5, 0.987654, 3.14159, 0.25, 16384.0, 12.345)
    writer.step(10, 0.2, 2.0, 0.5, 1.0, 3.5, 0.25, 16384.0, None)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["step 00010 ( 12.3%) | loss 2.3457 | lr x0.500 | grad norm 0.988 | 250 ms | 16,384 tok/s | mfu 12.3%",
                     "step 00011 ( 20.0%) | loss 2.0000 | lr x0.500 | grad norm 1.000 | 250 ms | 16,384 tok/s"]
    records = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert records[0] == {"step": 10, "progress": 0.1235, "loss": 2.34568, "lr": 0.5, "grad_norm": 0.98765,
                          "tokens_per_second": 16384.0, "training_seconds": 3.142, "mfu_percent": 12.345}


def test_utilisation_gives_the_result_its_flop_keys_in_every_convention():
    class Tiny(torch.nn.Module):  # a 2-layer shape, 64 wide, one head of 64, T = 8, vocab 10 padded to 16
        def __init__(self):
            super().__init__()
            self.config = {"n_layer": 2, "n_embd": 64, "n_head": 1, "n_kv_head": 1, "seq_len": 8, "vocab_size": 10}
            self.wte = torch.nn.Embedding(16, 64)
            self.w = torch.nn.Linear(64, 64, bias=False)
            self.lm_head = torch.nn.Linear(64, 16, bias=False)

    u = H.Utilisation(Tiny(), "cpu")
    # 6 x (64*64 + 10*64 real head rows) + 12 x 2 layers x 1 head x 64 x (8 + 1) / 2 pairs
    assert u.flops_per_token == 6 * (64 * 64 + 10 * 64) + 12 * 2 * 64 * 4.5 == 35328
    assert u.flops_per_token_palm == 6 * (64 * 64 + 16 * 64) + 12 * 2 * 64 * 8
    assert u.executed_flops_per_token == u.flops_per_token + 6 * 6 * 64
    result = u.result(1000.0)
    assert result["model_tflops"] == pytest.approx(35328 * 1000 / 1e12) and result["mfu_percent"] is None  # a CPU
    assert set(result) == {"mfu_percent", "mfu_percent_palm", "hfu_percent", "model_tflops", "executed_tflops",
                           "mfu_conventions", "flops_per_token", "flops_per_token_palm", "executed_flops_per_token"}


def test_every_public_name_of_the_harness_resolves_and_the_package_alone_imports_no_torch():
    """The package imports its names on first use (the CPU scorer must not import torch):
    each name in the table is where it says, and importing the package costs nothing."""
    import subprocess
    import sys

    import autoloop.harness as H

    for name in H.__all__:
        assert getattr(H, name) is getattr(importlib.import_module(f"autoloop.harness.{H._HOME[name]}"), name)
    assert H.metric.evaluation_windows is H.windows.evaluation_windows
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        H.no_such_name
    # The scorer's own module too: a CPU evaluation's scorer starts in 0.2 s instead of 2.6.
    code = "import sys, autoloop.harness, autoloop.harness.data, autoloop.harness.evaluate; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
