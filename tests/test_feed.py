"""Tests of the harness's data feed: a real FeedServer on a real unix socket, real clients.

In-process tests point AUTOLOOP_FEED at a server in the same process (the client and the
server only share the socket); the train.py tests run the real script as a subprocess
with the contract's environment, as the controller will. `run_with_feed` is shared with
tests/test_budget.py.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from autoloop import harness as H
from autoloop.trust.budget import check_budget, refusal_problem
from autoloop.harness import feed as F
from autoloop.harness.data import WITHHELD_MARKER, read_windows
from test_train import TRAIN_PY, explain, run_train


def run_with_feed(script: Path, cache: Path, data_dir: Path, run_dir: Path, *, meta_only: bool = False,
                  timeout: float = 300, **env) -> tuple[subprocess.CompletedProcess, dict, dict | None]:
    """Run a train script as the controller does: its batches from a FeedServer. -> (proc, summary, result)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    visible = H.make_meta_only_view(data_dir, run_dir / "data") if meta_only else data_dir
    result_path = run_dir / "result.json"
    with H.FeedServer(data_dir, run_dir / "feed.sock", seed=int(env.get("AUTOLOOP_SEED", 0))) as feed:
        feed.mark_spawn()
        proc = run_train(script, cache, timeout=timeout, AUTOLOOP_FEED=feed.address, AUTOLOOP_DATA_DIR=visible,
                         AUTOLOOP_RESULT=result_path, **env)
        feed.mark_exit()
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    return proc, feed.summary(), result


@pytest.fixture
def feed(embedded_dataset, tmp_path, monkeypatch):
    """A running FeedServer on the embedded corpus, and AUTOLOOP_FEED pointing at it."""
    with H.FeedServer(embedded_dataset.path, tmp_path / "feed.sock", seed=3) as server:
        monkeypatch.setenv("AUTOLOOP_FEED", str(server.address))
        yield server
    monkeypatch.delenv("AUTOLOOP_FEED", raising=False)


def draw(loader, n):
    return [next(loader) for _ in range(n)]


def wait_for(predicate, timeout=5.0):
    # Ticks have no reply: the server records them a moment after the send returns.
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


# ---------------------------------------------------------------------------- batches


@pytest.mark.parametrize("sequential", [False, True])
def test_feed_serves_the_memmap_batches_bit_for_bit(embedded_dataset, feed, monkeypatch, sequential):
    via_feed = {seed: draw(H.TokenLoader(embedded_dataset, "train", 4, 32, seed=seed, sequential=sequential), 6)
                for seed in (3, 11)}
    monkeypatch.delenv("AUTOLOOP_FEED")
    for seed, batches in via_feed.items():
        direct = draw(H.TokenLoader(embedded_dataset, "train", 4, 32, seed=seed, sequential=sequential), 6)
        for (x, y), (xd, yd) in zip(batches, direct):
            assert x.dtype == xd.dtype == torch.int64 and x.shape == (4, 32)
            assert torch.equal(x, xd) and torch.equal(y, yd)
    summary = feed.summary()
    assert summary["batches"] == 12 and summary["tokens"] == 12 * 4 * 32
    assert [s["seed"] for s in summary["streams"]] == [3, 11] and summary["foreign_seeds"] == [11]
    assert 0 <= summary["first_connect"] <= summary["first_request"] <= summary["first_batch"] <= summary["last_batch"]


def test_val_and_heldout_are_refused_and_recorded(embedded_dataset, feed):
    for split in ("val", "heldout"):
        with pytest.raises(H.HarnessError) as err:
            H.TokenLoader(embedded_dataset, split, 2, 16)
        message = str(err.value)
        assert f"the {split} split is not available to training under autoloop" in message
        assert "val_bpb is computed by the harness's evaluator" in message and "\n" not in message
    summary = feed.summary()
    assert [r["split"] for r in summary["refused"]] == ["val", "heldout"] and summary["refused_count"] == 2
    assert summary["batches"] == 0 and summary["refused"][0]["pid"] == os.getpid()
    problem, _ = check_budget(summary, {}, time_budget=20, max_steps=None)
    assert "asked the harness's data feed for the heldout and val split" in problem


def test_clock_ticks_reach_the_feed_in_order(embedded_dataset, feed):
    loader = H.TokenLoader(embedded_dataset, "train", 2, 16, seed=3)
    clock = H.TrainingClock(time_budget=10.0)
    next(loader)
    for _ in range(5):
        next(loader)
        next(loader)
        clock.step_finished(0.01)
    assert wait_for(lambda: feed.summary()["ticks"] == 5)
    summary = feed.summary()
    assert summary["tick_batches"] == [3, 5, 7, 9, 11] and summary["last_tick_steps"] == 5
    assert summary["tick_times"] == sorted(summary["tick_times"])
    assert [t for t, *_ in summary["last_ticks"]] == summary["tick_times"][-3:]
    json.dumps(summary)  # JSON-able as it is


def test_clock_without_feed_does_not_connect(monkeypatch):
    monkeypatch.delenv("AUTOLOOP_FEED", raising=False)
    clock = H.TrainingClock(max_steps=2)
    clock.step_finished(0.1)
    assert clock._feed is None and clock.steps == 1


def test_unreachable_feed_is_one_clear_line(embedded_dataset, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOLOOP_FEED", str(tmp_path / "nobody.sock"))
    with pytest.raises(H.HarnessError) as err:
        H.TokenLoader(embedded_dataset, "train", 2, 16)
    assert "cannot reach the harness's data feed" in str(err.value) and "\n" not in str(err.value)


def test_a_socket_path_longer_than_unix_allows_stays_in_the_run_folder(embedded_dataset, tmp_path, monkeypatch):
    run_dir = tmp_path / ("a-long-run-folder-name-" * 6)
    address = run_dir / "feed.sock"
    assert len(os.fsencode(address)) > 108
    with H.FeedServer(embedded_dataset.path, address) as server:
        assert server.address == address and address.is_socket()
        monkeypatch.setenv("AUTOLOOP_FEED", str(server.address))
        x, _ = next(H.TokenLoader(embedded_dataset, "train", 2, 16))
        assert x.shape == (2, 16) and server.summary()["batches"] == 1
    assert not address.exists()  # removed on close


def test_a_garbage_client_is_dropped_and_others_are_served(embedded_dataset, feed):
    bad = socket.socket(socket.AF_UNIX)
    bad.connect(str(feed.address))
    bad.sendall(struct.pack(">IB", 2**30, 1))  # a 1 GiB "hello"
    assert bad.recv(1) == b""  # the server hung up
    bad.close()
    rogue = F.FeedClient(str(feed.address))
    kind, data = rogue.request(F._frame(F.NEXT, struct.pack(">I", 7)))
    assert kind == F.ERROR and b"no such stream" in data
    with pytest.raises(H.HarnessError, match="outside what the data feed serves"):
        rogue.open_stream("train", 2**20, 2**10)
    x, _ = next(H.TokenLoader(embedded_dataset, "train", 2, 16))
    assert x.shape == (2, 16)
    summary = feed.summary()
    assert summary["error_count"] == 1 and "1073741824 bytes" in summary["errors"][0] and summary["batches"] == 1


# ---------------------------------------------------------------------------- the meta-only view


def test_meta_only_view_opens_as_the_dataset_without_its_splits(embedded_dataset, tmp_path, monkeypatch):
    view = H.make_meta_only_view(embedded_dataset.path, tmp_path / "view")
    assert not list(view.glob("*.bin")) and (view / WITHHELD_MARKER).exists()
    ds = H.load_dataset(view, prepare=False)
    assert ds.withheld and not embedded_dataset.withheld
    assert (ds.fingerprint, ds.vocab_size, ds.bos_id) == (embedded_dataset.fingerprint, embedded_dataset.vocab_size,
                                                          embedded_dataset.bos_id)
    assert np.array_equal(ds.token_bytes, embedded_dataset.token_bytes)
    assert np.array_equal(ds.tokenizer.encode(b"def f(): pass"), embedded_dataset.tokenizer.encode(b"def f(): pass"))
    for split in ("val", "heldout"):
        with pytest.raises(H.HarnessError, match=f"the {split} split is not available to training under autoloop"):
            ds.split(split)
    with pytest.raises(H.HarnessError, match="served to training by the harness's data feed"):
        ds.split("train")
    with pytest.raises(H.HarnessError, match="the val split is not available"):
        H.evaluate_bpb(torch.nn.Identity(), ds, "val")
    # ...and under the feed the view trains like the full folder.
    with H.FeedServer(embedded_dataset.path, tmp_path / "feed.sock", seed=5) as server:
        monkeypatch.setenv("AUTOLOOP_FEED", str(server.address))
        x, _ = next(H.TokenLoader(ds, "train", 2, 16, seed=5))
    monkeypatch.delenv("AUTOLOOP_FEED")
    xd, _ = next(H.TokenLoader(embedded_dataset, "train", 2, 16, seed=5))
    assert torch.equal(x, xd)
    with pytest.raises(H.HarnessError, match="meta-only view"):
        H.FeedServer(view, tmp_path / "other.sock")


# ---------------------------------------------------------------------------- train.py through the feed


def test_train_py_asking_for_val_fails_with_the_rule_and_the_feed_records_it(session_cache, embedded_dataset, tmp_path):
    # Issue 12's first attack: train on the val split. In the meta-only view there is no
    # val file to open, and the feed refuses the split and records the request.
    script = tmp_path / "train_on_val.py"
    text = TRAIN_PY.read_text()
    assert text.count('H.TokenLoader(ds, "train",') == 1
    script.write_text(text.replace('H.TokenLoader(ds, "train",', 'H.TokenLoader(ds, "val",'))
    proc, summary, result = run_with_feed(script, session_cache, embedded_dataset.path, tmp_path / "run", meta_only=True,
                                          AUTOLOOP_MAX_STEPS=2, OMP_NUM_THREADS=1)
    assert proc.returncode == 2 and result is None
    assert "ERROR: the val split is not available to training under autoloop" in proc.stdout
    assert summary["refused_count"] == 1 and summary["batches"] == 0
    assert refusal_problem(summary).startswith("asked the harness's data feed for the val split")


@pytest.mark.slow
def test_train_py_through_the_feed_gives_the_same_result(session_cache, embedded_dataset, tmp_path):
    env = {"AUTOLOOP_MAX_STEPS": 6, "AUTOLOOP_SEED": 4, "OMP_NUM_THREADS": 1}
    proc, summary, fed = run_with_feed(TRAIN_PY, session_cache, embedded_dataset.path, tmp_path / "fed", **env)
    assert proc.returncode == 0, explain(proc)
    direct = run_train(TRAIN_PY, session_cache, AUTOLOOP_RESULT=tmp_path / "direct.json", **env)
    assert direct.returncode == 0, explain(direct)
    plain = json.loads((tmp_path / "direct.json").read_text())
    assert fed["val_bpb"] == plain["val_bpb"]  # same batches, same model, bit for bit
    assert [p["loss"] for p in fed["curve"]] == [p["loss"] for p in plain["curve"]]
    micro = fed["batch_tokens"] // (summary["streams"][0]["batch_size"] * summary["streams"][0]["seq_len"])
    assert summary["ticks"] == 6 and summary["batches"] == 6 * micro + 1  # +1: the loader's prefetch
    assert summary["tokens"] == fed["total_tokens"] + fed["batch_tokens"] // micro
    problem, figures = check_budget(summary, fed, time_budget=None, max_steps=6, spawned_at=None)
    assert problem is None, figures
    assert figures["startup_seconds"] > 0 and figures["wall_seconds"] > figures["startup_seconds"]


def test_the_feed_reads_the_ticking_process_cpu_time_itself(tmp_path, embedded_dataset):
    """Issue 23, item 4: each tick records the CPU seconds of the process that sent it (its pid
    from the socket's peer credentials, its CPU from /proc): work shows, waiting does not."""
    script = tmp_path / "ticker.py"
    script.write_text(
        "import time\n"
        "from autoloop.harness.feed import active_feed\n"
        "feed = active_feed()\n"
        "feed.tick(1)\n"
        "time.sleep(0.6)\n"                                   # a step slowed by the machine: no CPU
        "feed.tick(2)\n"
        "end = time.process_time() + 0.6\n"
        "while time.process_time() < end:\n"                  # a step that works: CPU
        "    pass\n"
        "feed.tick(3)\n"
        "time.sleep(0.2)\n")
    with H.FeedServer(embedded_dataset.path, tmp_path / "feed.sock", seed=0) as feed:
        env = {**os.environ, "AUTOLOOP_FEED": str(feed.address)}
        subprocess.run([__import__("sys").executable, str(script)], env=env, check=True, timeout=60)
        time.sleep(0.2)
        summary = feed.summary()
    cpu = summary["tick_cpu"]
    assert len(cpu) == 3 and None not in cpu, cpu
    waited, worked = cpu[1] - cpu[0], cpu[2] - cpu[1]
    assert waited < 0.15 and worked > 0.45, cpu
    assert [t[2] for t in summary["last_ticks"]] == cpu


# ---------------------------------------------------------------------------- the feed's memory (issue 31, item 6)


def _old_sequential_starts(n_tokens: int, batch_size: int, seq_len: int, batches: int) -> list[list[int]]:
    """The walk as it was written before it became one array: a Python int per window."""
    last_start, position, out = n_tokens - (seq_len + 1), 0, []
    for _ in range(batches):
        starts = []
        for _ in range(batch_size):
            if position > last_start:
                position = 0
            starts.append(position)
            position += seq_len
        out.append(starts)
    return out


@pytest.mark.parametrize("n_tokens,batch_size,seq_len", [(1000, 7, 16), (50, 5, 16), (18, 3, 16), (4097, 64, 32)])
def test_the_sequential_walk_as_one_array_is_the_old_walk(n_tokens, batch_size, seq_len):
    sampler = H.WindowSampler(n_tokens, batch_size, seq_len, sequential=True)
    new = [sampler.starts().tolist() for _ in range(9)]
    assert new == _old_sequential_starts(n_tokens, batch_size, seq_len, 9)


def test_windows_gathered_in_one_array_are_the_stacked_slices(embedded_dataset):
    tokens = embedded_dataset._memmap("train")
    starts = np.array([0, 5, len(tokens) - 33, 17, 5])
    windows = read_windows(tokens, starts, 32)
    assert windows.flags.c_contiguous and windows.dtype == tokens.dtype and windows.shape == (5, 33)
    assert np.array_equal(windows, np.stack([tokens[s:s + 33] for s in starts]))


_FEED_CLIENT = """
import sys
from autoloop.harness.feed import FeedClient
client = FeedClient(sys.argv[1])
try:
    stream = client.open_stream("train", int(sys.argv[2]), int(sys.argv[3]))
    for _ in range(2):
        stream.next_windows()
    print("served")
except Exception as exc:
    print("refused:", exc)
client.close()
"""


def _peak_rss_growth_mb(run) -> float:
    """How far this process's peak RSS rose above its RSS while `run()` ran (VmHWM, reset first)."""
    def status(field):
        return next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith(field + ":"))

    before = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    run()
    return (status("VmHWM") - before) / 1024


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_the_feed_holds_at_most_its_budget_and_refuses_a_request_over_it(embedded_dataset, tmp_path):
    """A client in another process asks for 2^19 windows (2 x 26 MB with their starts: within
    a 64 MiB budget) and then for 2^21 (210 MB: refused). The feed's process grows by less
    than the budget; on the old feed (a Python list per window, no budget) the first request
    alone grew it by more, and the second was served."""
    import sys

    budget = 64 * 2**20
    itemsize = embedded_dataset._memmap("train").dtype.itemsize
    assert F.stream_bytes(2**19, 12, itemsize) <= budget < F.stream_bytes(2**21, 12, itemsize)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with H.FeedServer(embedded_dataset.path, tmp_path / "feed.sock", memory_budget=budget) as server:
        said = {}

        def ask(batch_size):
            said[batch_size] = subprocess.run([sys.executable, "-c", _FEED_CLIENT, str(server.address),
                                               str(batch_size), "12"], env=env, capture_output=True, text=True,
                                              timeout=120).stdout

        grew = {n: _peak_rss_growth_mb(lambda n=n: ask(n)) for n in (2**19, 2**21)}
        assert wait_for(lambda: server.summary()["connections"] == 2 and not server._conns)
        summary = server.summary()
    assert said[2**19].strip() == "served", said
    assert said[2**21].startswith("refused:") and "past the feed's 64 MiB budget" in said[2**21], said
    assert "feed-memory-mb" in said[2**21]
    assert grew[2**19] < budget / 2**20, grew
    assert grew[2**21] < 8, grew  # refused before anything was drawn
    assert summary["batches"] == 2 and summary["memory_peak"] == F.stream_bytes(2**19, 12, itemsize)
    over = summary["over_budget"]
    assert (over["batch_size"], over["seq_len"], over["held"]) == (2**21, 12, 0), over  # the first stream was let go
    assert summary["over_budget_count"] == 1 and summary["memory_budget"] == budget


def test_the_budget_counts_every_stream_of_the_trial_together(embedded_dataset, tmp_path):
    """Streams add up, across connections too; a closed connection gives its share back."""
    itemsize = embedded_dataset._memmap("train").dtype.itemsize
    one = F.stream_bytes(1000, 16, itemsize)
    with H.FeedServer(embedded_dataset.path, tmp_path / "b.sock", memory_budget=2 * one) as server:
        first, second = F.FeedClient(str(server.address)), F.FeedClient(str(server.address))
        first.open_stream("train", 1000, 16)
        second.open_stream("train", 1000, 16)
        with pytest.raises(H.HarnessError, match="already held"):
            second.open_stream("train", 1000, 16)
        first.close()
        assert wait_for(lambda: len(server._conns) == 1)
        second.open_stream("train", 1000, 16).next_windows()  # the first connection's share is free again
        second.close()
        summary = server.summary()
    assert summary["over_budget"]["held"] == 2 * one and summary["over_budget_count"] == 1
    assert len(summary["streams"]) == 3
