"""`autoloop prepare`: local sources, the Hub path (against a local fake Hub), listing, CLI.

No test touches the network: local sources are files the test writes, and Hub downloads
go to tests/fakes/hub_server.py through HF_ENDPOINT (huggingface_hub's own download code
runs unchanged against it).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import socket
import subprocess
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from autoloop import harness as H
from autoloop import prepare as P
from autoloop.errors import AutoloopError

REPO_ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("fake_hub_server", REPO_ROOT / "tests" / "fakes" / "hub_server.py")
hub_server = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hub_server)

# Multi-byte characters on purpose: BPE learns tokens that are partial UTF-8 sequences.
WORDS = (
    "the cat sat on a mat and the dog ran to the park while birds sang naïve café déjà vu "
    "你好 世界 数据 模型 🎉 🚀 données über straße loop train model value"
).split()


def make_docs(n: int, seed: int, words: int = 60) -> list[str]:
    rng = random.Random(seed)
    return [f"doc {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(words // 2, words))) + "." for i in range(n)]


def write_parquet(path: Path, texts: list, **columns) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts, **columns}), path, row_group_size=64)
    return path


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    return path


@pytest.fixture
def corpus(tmp_path) -> Path:
    """A folder with all three local formats, ~400 documents."""
    root = tmp_path / "corpus"
    write_jsonl(root / "a.jsonl", make_docs(150, 1))
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "b.txt").write_text("\n<|endoftext|>\n".join(make_docs(150, 2)), encoding="utf-8")
    write_parquet(root / "c.parquet", make_docs(100, 3))
    (root / ".hidden.txt").write_text("never read")
    (root / "notes.md").write_text("not a supported suffix: ignored in a folder")
    return root


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    # Prepared datasets are named by their source: a cache per test keeps tests independent.
    monkeypatch.setenv("AUTOLOOP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("AUTOLOOP_HUB_DIR", raising=False)
    # A test that reached for the Hub by mistake gets "connection refused", never the internet.
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")


def one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------- documents


def test_txt_documents_split_at_separators_and_blank_lines(tmp_path):
    stories = make_docs(40, 7)
    long_text = "\n\n".join(" ".join(make_docs(3, 100 + i)) for i in range(60))  # ~60 paragraphs, no separator
    path = tmp_path / "t.txt"
    path.write_bytes(("\n<|endoftext|>\n".join(stories) + "<|endoftext|>" + long_text).encode())
    results = [list(P.txt_documents(path, block_size=size)) for size in (7, 1000, P.TXT_READ_BLOCK)]
    assert results[0] == results[1] == results[2], "documents must not depend on the read block size"
    docs = results[0]
    assert [d.decode() for d in docs[:40]] == stories
    tail = docs[40:]
    assert len(tail) > 5 and all(len(d) <= 4 * P.TXT_DOC_BYTES for d in tail)
    assert all(len(d) >= P.TXT_DOC_BYTES for d in tail[:-1])
    # Cuts only at blank lines: no text is lost or changed, only boundaries are added.
    assert b"\n\n".join(tail) == long_text.encode().strip()


def test_txt_without_blank_lines_is_cut_at_line_ends(tmp_path):
    path = tmp_path / "lines.txt"
    lines = [f"line {i} " + "x" * 50 for i in range(3000)]
    path.write_text("\n".join(lines))
    docs = list(P.txt_documents(path, block_size=4096))
    assert len(docs) > 3 and b"\n".join(docs) == "\n".join(lines).encode()


def test_local_formats_are_read_and_split_by_document_hash(corpus):
    source = P.local_source(corpus)
    assert [Path(f[0]).name for f in source.recipe["files"]] == ["a.jsonl", "c.parquet", "b.txt"]
    splits = {s: list(source.documents(s)) for s in H.constants.SPLITS}
    everything = set(make_docs(150, 1) + make_docs(150, 2) + make_docs(100, 3))
    assert {d.decode() for docs in splits.values() for d in docs} == everything
    assert sum(len(v) for v in splits.values()) == 400
    assert 0 < len(splits["val"]) < 50 and 0 < len(splits["heldout"]) < 50
    for split, docs in splits.items():
        assert all(P.split_of_document(d) == split for d in docs)


# ---------------------------------------------------------------------- bad input


def test_unknown_dataset_name_is_one_clear_line():
    with pytest.raises(AutoloopError) as err:
        P.prepare_dataset("no-such-dataset", tokenizer="byte")
    assert "unknown dataset 'no-such-dataset'" in one_line(err) and "climbmix" in str(err.value)


def test_empty_folder_is_one_clear_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(AutoloopError) as err:
        P.prepare_dataset(str(tmp_path / "empty"), tokenizer="byte")
    assert "has no .txt, .jsonl or .parquet files" in one_line(err)


def test_file_without_text_column_or_field_is_one_clear_line(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    bad_parquet = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"body": ["a", "b"]}), bad_parquet)
    with pytest.raises(AutoloopError) as err:
        P.prepare_dataset(str(bad_parquet), tokenizer="byte")
    assert 'no "text" column' in one_line(err) and "body" in str(err.value)

    bad_jsonl = tmp_path / "j" / "bad.jsonl"
    bad_jsonl.parent.mkdir()
    bad_jsonl.write_text(json.dumps({"content": "a"}) + "\n")
    with pytest.raises(AutoloopError) as err:
        P.prepare_dataset(str(bad_jsonl), tokenizer="byte")
    assert 'bad.jsonl:1 has no "text" field (it has content)' in one_line(err)

    other = tmp_path / "data.csv"
    other.write_text("text\nhello\n")
    with pytest.raises(AutoloopError) as err:
        P.prepare_dataset(str(other), tokenizer="byte")
    assert "give .txt, .jsonl or .parquet files" in one_line(err)


def test_failed_preparation_leaves_the_previous_one_intact(tmp_path, corpus):
    before = P.prepare_dataset(str(corpus), tokenizer="byte", name="keep-me").dataset
    broken = tmp_path / "broken"
    texts = make_docs(300, 5)
    write_jsonl(broken / "a.jsonl", texts)
    with open(broken / "a.jsonl", "a") as handle:
        handle.write("{not json\n")
    with pytest.raises(AutoloopError) as err:
        P.prepare_dataset(str(broken), tokenizer="byte", name="keep-me")
    assert "a.jsonl:301 is not valid JSON" in one_line(err)
    after = H.load_dataset(before.path, prepare=False)
    assert after.fingerprint == before.fingerprint and H.verify_dataset(after) == []
    assert not [p for p in P.prepared_root().iterdir() if p.name.startswith(".keep-me")], "no temporary folder left"


def test_too_little_text_says_what_to_do(tmp_path):
    write_jsonl(tmp_path / "tiny.jsonl", ["just one document"])
    with pytest.raises(AutoloopError) as err:
        P.prepare_dataset(str(tmp_path / "tiny.jsonl"), tokenizer="byte")
    assert "has no documents: give it more documents" in one_line(err)


def test_option_errors(corpus):
    with pytest.raises(AutoloopError, match="--vocab-size 100 is out of range"):
        P.prepare_dataset(str(corpus), vocab_size=100)
    with pytest.raises(AutoloopError, match="--vocab-size applies to the BPE tokenizer only"):
        P.prepare_dataset(str(corpus), tokenizer="byte", vocab_size=512)
    with pytest.raises(AutoloopError, match="--shards applies to named Hub datasets only"):
        P.prepare_dataset(str(corpus), tokenizer="byte", shards=3)
    with pytest.raises(AutoloopError, match="is not a valid dataset name"):
        P.prepare_dataset(str(corpus), tokenizer="byte", name="../escape")


def test_missing_optional_package_names_the_extra(corpus, monkeypatch):
    monkeypatch.setitem(sys.modules, "rustbpe", None)  # makes `import rustbpe` fail
    with pytest.raises(AutoloopError) as err:
        P.prepare_dataset(str(corpus), tokenizer="bpe")
    assert "pip install -e '.[bpe]'" in one_line(err)


# ---------------------------------------------------------------------- preparing and comparability


def test_byte_and_bpe_preparations_count_the_same_bytes(corpus):
    pytest.importorskip("rustbpe")
    pytest.importorskip("tiktoken")
    byte = P.prepare_dataset(str(corpus), tokenizer="byte").dataset
    bpe = P.prepare_dataset(str(corpus), tokenizer="bpe", vocab_size=600).dataset
    assert byte.name == "corpus-byte" and bpe.name == "corpus-bpe600"
    assert bpe.meta["tokenizer"]["type"] == "bpe" and bpe.vocab_size <= 600
    for split in H.constants.SPLITS:
        b, t = byte.meta["splits"][split], bpe.meta["splits"][split]
        # Same documents, same raw bytes: only the model's quality can move val_bpb.
        assert b["documents"] == t["documents"] and b["bytes"] == t["bytes"]
        assert t["tokens"] < b["tokens"]
        # The text behind the tokens is the same text, byte for byte.
        assert bpe.tokenizer.decode(bpe.split(split)) == byte.tokenizer.decode(byte.split(split))
    # BOS-aligned packing without padding: every document starts with BOS, nothing else is added.
    val = np.asarray(bpe.split("val"))
    assert val[0] == bpe.bos_id and (val == bpe.bos_id).sum() == bpe.meta["splits"]["val"]["documents"]
    assert bpe.token_bytes[bpe.bos_id] == 0
    # The metric's denominator over a fixed evaluation window is the raw length of its text.
    windows = H.metric.evaluation_windows(val, "cpu", max_tokens=1024)
    targets = windows[:, 1:].reshape(-1)
    assert int(bpe.token_bytes[targets].sum()) == len(bpe.tokenizer.decode(targets))
    # Partial UTF-8 tokens were learned, and they count their raw bytes.
    partial = [i for i, tok in enumerate(bpe.tokenizer.tokens) if len(tok) > 1 and not _valid_utf8(tok)]
    assert partial and all(bpe.token_bytes[i] == len(bpe.tokenizer.tokens[i]) for i in partial)


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_identical_preparation_is_reused_and_force_rebuilds(corpus):
    first = P.prepare_dataset(str(corpus), tokenizer="byte", name="reuse")
    again = P.prepare_dataset(str(corpus), tokenizer="byte", name="reuse")
    assert not first.reused and again.reused and again.dataset.fingerprint == first.dataset.fingerprint
    forced = P.prepare_dataset(str(corpus), tokenizer="byte", name="reuse", force=True)
    assert not forced.reused and forced.dataset.fingerprint == first.dataset.fingerprint
    (corpus / "a.jsonl").write_text(json.dumps({"text": "changed"}) + "\n" + (corpus / "a.jsonl").read_text())
    changed = P.prepare_dataset(str(corpus), tokenizer="byte", name="reuse")
    assert not changed.reused and changed.dataset.fingerprint != first.dataset.fingerprint


def test_bpe_dataset_loads_and_trains_without_tiktoken(corpus, monkeypatch):
    pytest.importorskip("rustbpe")
    pytest.importorskip("tiktoken")
    path = P.prepare_dataset(str(corpus), tokenizer="bpe", vocab_size=400, name="no-tiktoken").dataset.path
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    ds = H.load_dataset(path, prepare=False)
    x, y = next(H.TokenLoader(ds, "train", 2, 16))
    assert x.max() < ds.vocab_size and ds.token_bytes.shape == (ds.vocab_size,)
    assert ds.tokenizer.decode(ds.split("val")[:50])  # decoding needs no tiktoken either
    with pytest.raises(H.HarnessError, match=r"pip install -e '\.\[bpe\]'"):
        ds.tokenizer.encode(b"needs tiktoken")


def test_tampered_tokenizer_file_is_reported_as_corrupt(corpus):
    pytest.importorskip("rustbpe")
    pytest.importorskip("tiktoken")
    path = P.prepare_dataset(str(corpus), tokenizer="bpe", vocab_size=300, name="tamper").dataset.path
    vocab = path / "tokenizer.tiktoken"
    vocab.write_bytes(vocab.read_bytes()[:-20])
    with pytest.raises(H.HarnessError) as err:
        H.load_dataset(path, prepare=False)
    assert "is corrupt" in one_line(err) and "tokenizer.tiktoken" in str(err.value)


# ---------------------------------------------------------------------- Hub downloads (fake Hub)

CLIMBMIX = "karpathy/climbmix-400b-shuffle"


def shard_bytes(tmp_path: Path, name: str, seed: int, n: int = 40) -> bytes:
    return write_parquet(tmp_path / "shards" / name, make_docs(n, seed)).read_bytes()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A fake Hub with climbmix's first three shards and its two pinned shards."""
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with hub_server.FakeHub() as fake:
        for i, name in enumerate(["shard_00000.parquet", "shard_00001.parquet", "shard_00002.parquet"]):
            fake.add(CLIMBMIX, name, shard_bytes(tmp_path, name, seed=10 + i))
        fake.add(CLIMBMIX, "shard_06541.parquet", shard_bytes(tmp_path, "shard_06541.parquet", seed=98))
        fake.add(CLIMBMIX, "shard_06542.parquet", shard_bytes(tmp_path, "shard_06542.parquet", seed=99))
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        yield fake


def test_hub_download_pins_val_and_heldout_and_resumes(hub, tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("AUTOLOOP_HUB_DIR", str(tmp_path / "big-disk"))
    reporter = P.Reporter()
    ds = P.prepare_dataset("climbmix", shards=2, tokenizer="byte", reporter=reporter).dataset
    assert sorted(hub.gets()) == ["shard_00000.parquet", "shard_00001.parquet", "shard_06541.parquet", "shard_06542.parquet"]
    assert ds.name == "climbmix-byte"
    val_docs = ds.tokenizer.decode(ds.split("val")).decode()
    assert all(doc in val_docs for doc in make_docs(40, 99)) and "doc 98-" not in val_docs
    held = ds.tokenizer.decode(ds.split("heldout")).decode()
    assert all(doc in held for doc in make_docs(40, 98))
    assert ds.meta["recipe"]["source"]["revision"] == hub_server.COMMIT
    assert any("downloading shard_06542.parquet" in m for m in reporter.messages)

    # More shards later: only the new one is fetched, from the pinned revision.
    hub.requests.clear()
    P.prepare_dataset("climbmix", shards=3, tokenizer="byte")
    assert hub.gets() == ["shard_00002.parquet"]
    # Everything there: no request at all, and the identical preparation is reused.
    hub.requests.clear()
    assert P.prepare_dataset("climbmix", shards=3, tokenizer="byte").reused
    assert hub.requests == []
    listing = {d.repo_id: d for d in P.list_downloads()}
    assert listing[CLIMBMIX].files == 5 and listing[CLIMBMIX].revision == hub_server.COMMIT
    assert listing[CLIMBMIX].path == tmp_path / "big-disk" / CLIMBMIX


def test_hub_missing_file_then_resume_fetches_only_what_is_missing(hub, tmp_path):
    pytest.importorskip("huggingface_hub")
    content = hub.files[CLIMBMIX].pop("shard_00001.parquet")
    with pytest.raises(AutoloopError) as err:
        P.prepare_dataset("climbmix", shards=2, tokenizer="byte")
    assert f"{CLIMBMIX} has no file shard_00001.parquet" in one_line(err)
    hub.add(CLIMBMIX, "shard_00001.parquet", content)
    hub.requests.clear()
    P.prepare_dataset("climbmix", shards=2, tokenizer="byte")
    # shard_00000 came in the failed run and is kept; the rest is fetched now.
    assert sorted(hub.gets()) == ["shard_00001.parquet", "shard_06541.parquet", "shard_06542.parquet"]


def test_hub_dropped_connection_is_retried_within_the_run(hub):
    pytest.importorskip("huggingface_hub")
    hub.faults["shard_00000.parquet"] = "drop"
    P.prepare_dataset("climbmix", shards=1, tokenizer="byte")
    # huggingface_hub resumes (with a Range request once it holds part of the body; this
    # file is smaller than its first chunk, so it starts over) and the file ends up whole.
    assert hub.gets().count("shard_00000.parquet") == 2
    local = P.hub_dir() / CLIMBMIX / "shard_00000.parquet"
    assert local.read_bytes() == hub.files[CLIMBMIX]["shard_00000.parquet"]


def test_hub_truncated_local_shard_is_fetched_again(hub):
    pytest.importorskip("huggingface_hub")
    P.prepare_dataset("climbmix", shards=1, tokenizer="byte")
    local = P.hub_dir() / CLIMBMIX / "shard_00000.parquet"
    local.write_bytes(local.read_bytes()[:100])  # a partial copy
    hub.requests.clear()
    reporter = P.Reporter()
    P.prepare_dataset("climbmix", shards=1, tokenizer="byte", reporter=reporter)
    assert hub.gets() == ["shard_00000.parquet"]
    assert any("is incomplete or corrupt" in m for m in reporter.messages)
    assert local.read_bytes() == hub.files[CLIMBMIX]["shard_00000.parquet"]


@pytest.mark.parametrize("fault, expected", [("corrupt", "is unusable (not a readable parquet file"), ("short", "Consistency check failed")])
def test_hub_bad_download_is_one_line_and_damages_nothing(hub, corpus, fault, expected):
    pytest.importorskip("huggingface_hub")
    before = P.prepare_dataset(str(corpus), tokenizer="byte", name="climbmix-byte").dataset
    hub.faults["shard_06542.parquet"] = fault
    with pytest.raises(AutoloopError) as err:
        P.prepare_dataset("climbmix", shards=1, tokenizer="byte")
    assert expected in one_line(err) and "shard_06542.parquet" in str(err.value)
    assert not (P.hub_dir() / CLIMBMIX / "shard_06542.parquet").exists()
    assert H.load_dataset(before.path, prepare=False).fingerprint == before.fingerprint


def test_no_network_is_one_line_and_cached_files_still_prepare(hub, monkeypatch):
    pytest.importorskip("huggingface_hub")
    pytest.importorskip("rustbpe")
    before = P.prepare_dataset("climbmix", shards=1, tokenizer="byte").dataset
    with socket.socket() as s:  # a port with nothing listening: connection refused, as offline
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", closed)
    started = time.perf_counter()
    with pytest.raises(AutoloopError) as err:
        P.prepare_dataset("climbmix", shards=2, tokenizer="byte")
    message = one_line(err)
    assert "cannot download shard_00001.parquet" in message and "check the network connection" in message
    assert "already downloaded are kept" in message and time.perf_counter() - started < 10
    assert H.load_dataset(before.path, prepare=False).fingerprint == before.fingerprint
    # Already downloaded files need no network: another tokenizer prepares offline.
    ds = P.prepare_dataset("climbmix", shards=1, tokenizer="bpe", vocab_size=300).dataset
    assert ds.name == "climbmix-bpe300"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(AutoloopError, match="HF_HUB_OFFLINE is set"):
        P.prepare_dataset("climbmix", shards=2, tokenizer="byte")


def test_unknown_repository_is_one_line(hub, monkeypatch):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setitem(P.DATASETS, "ghost", P.HubDataset(
        key="ghost", repo_id="nobody/ghost", description="", format="parquet", val_file="v.parquet",
        heldout_file="h.parquet", default_shards=1, train_files=("t.parquet",)))
    with pytest.raises(AutoloopError) as err:
        P.prepare_dataset("ghost", tokenizer="byte")
    assert "dataset repository nobody/ghost was not found" in one_line(err)


def test_tinystories_layout_splits_its_valid_file_between_val_and_heldout(hub, monkeypatch):
    pytest.importorskip("huggingface_hub")
    train, valid = make_docs(200, 20), make_docs(200, 21)
    hub.add("roneneldan/TinyStories", "TinyStoriesV2-GPT4-train.txt", "\n<|endoftext|>\n".join(train).encode())
    hub.add("roneneldan/TinyStories", "TinyStoriesV2-GPT4-valid.txt", "\n<|endoftext|>\n".join(valid).encode())
    ds = P.prepare_dataset("roneneldan/TinyStories", tokenizer="byte").dataset
    assert ds.name == "tinystories-byte"
    splits = ds.meta["splits"]
    assert splits["train"]["documents"] == 200
    assert splits["val"]["documents"] + splits["heldout"]["documents"] == 200
    assert 60 < splits["val"]["documents"] < 140
    val_text = ds.tokenizer.decode(ds.split("val")).decode()
    assert not any(doc in val_text for doc in train)
    assert hub.gets().count("TinyStoriesV2-GPT4-valid.txt") == 1


# ---------------------------------------------------------------------- listing and lookup


def test_list_and_resolve_data_dir(corpus, monkeypatch):
    ds = P.prepare_dataset(str(corpus), tokenizer="byte", name="listed").dataset
    (P.prepared_root() / "half-written").mkdir(parents=True, exist_ok=True)
    infos = {info.name: info for info in P.list_prepared()}
    listed = infos["listed"]
    assert listed.problem is None and listed.fingerprint == ds.fingerprint and listed.tokenizer == "byte"
    assert listed.tokens == {s: ds.meta["splits"][s]["tokens"] for s in H.constants.SPLITS}
    assert listed.disk_bytes > sum(listed.tokens.values())
    assert "no meta.json" in infos["half-written"].problem

    assert P.resolve_data_dir("listed") == ds.path
    assert P.resolve_data_dir(str(ds.path)) == ds.path
    assert P.resolve_data_dir(H.contract.embedded_dataset_name()) == P.prepared_root() / H.contract.embedded_dataset_name()
    with pytest.raises(AutoloopError) as err:
        P.resolve_data_dir("nope")
    assert "no prepared dataset named 'nope'" in one_line(err) and "autoloop prepare --list" in str(err.value)
    with pytest.raises(AutoloopError, match="holds no prepared dataset"):
        P.resolve_data_dir(str(corpus))
    with pytest.raises(AutoloopError, match="is not prepared yet: run `autoloop prepare --dataset tinystories`"):
        P.resolve_data_dir("tinystories")


def test_resolve_hub_key_to_its_single_preparation(hub):
    pytest.importorskip("huggingface_hub")
    ds = P.prepare_dataset("climbmix", shards=1, tokenizer="byte").dataset
    assert P.resolve_data_dir("climbmix") == P.resolve_data_dir("karpathy/climbmix-400b-shuffle") == ds.path
    P.prepare_dataset("climbmix", shards=1, tokenizer="byte", name="climbmix-again")
    with pytest.raises(AutoloopError, match=r"is prepared more than once \(climbmix-again, climbmix-byte\)"):
        P.resolve_data_dir("climbmix")


# ---------------------------------------------------------------------- CLI


@pytest.fixture
def cli():
    typer = pytest.importorskip("typer")
    from typer.testing import CliRunner

    from autoloop.cli.prepare import prepare

    app = typer.Typer()
    app.command("prepare")(prepare)

    @app.callback()
    def main() -> None:
        """autoloop (test app)."""

    runner = CliRunner()
    return lambda *args: runner.invoke(app, ["prepare", *args])


def test_cli_prepare_list_and_errors(cli, corpus):
    result = cli("--dataset", str(corpus), "--tokenizer", "byte", "--name", "from-cli")
    assert result.exit_code == 0, result.output
    assert "prepared: from-cli" in result.stdout and 'dataset = "from-cli"' in result.stdout
    fingerprint = H.load_dataset(P.prepared_root() / "from-cli", prepare=False).fingerprint

    result = cli("--list")
    assert result.exit_code == 0 and "from-cli" in result.stdout and fingerprint[:12] in result.stdout

    for args, expected in [
        (["--dataset", "no-such-thing"], "unknown dataset 'no-such-thing'"),
        ([], "nothing to prepare"),
        (["--dataset", str(corpus), "--tokenizer", "byte", "--vocab-size", "512"], "--vocab-size applies to the BPE tokenizer only"),
    ]:
        result = cli(*args)
        assert result.exit_code == 1
        assert result.stderr.startswith("error: ") and expected in result.stderr and result.stderr.count("\n") == 1


def test_cli_every_option_has_full_sentence_help():
    import typer

    from autoloop.cli.prepare import prepare

    app = typer.Typer()
    app.command("prepare")(prepare)
    command = typer.main.get_command(app)
    for param in command.params:
        if param.name == "help":
            continue
        assert param.help and param.help[0].isupper() and param.help.rstrip().endswith("."), param.name


# ---------------------------------------------------------------------- the real train.py


def byte_entropy(data: bytes) -> float:
    counts = np.array(list(Counter(data).values()), dtype=np.float64)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def stdlib_files(byte_cap: int) -> list[Path]:
    """This interpreter's standard library .py files, in path order, up to `byte_cap` bytes:
    real text that needs no download (it is not the embedded corpus, which is generated)."""
    chosen, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        size = path.stat().st_size
        if total + size > byte_cap:
            break
        chosen.append(path)
        total += size
    return chosen


@pytest.mark.slow
def test_train_py_trains_on_a_bpe_prepared_local_dataset(tmp_path):
    pytest.importorskip("rustbpe")
    pytest.importorskip("tiktoken")
    train_py = REPO_ROOT / "train.py"
    if not train_py.exists():
        pytest.skip("train.py is not written yet")
    # ~3 MB of real text (this interpreter's standard library) as a .jsonl the test writes.
    files = stdlib_files(byte_cap=3 * 2**20)
    write_jsonl(tmp_path / "src" / "stdlib.jsonl", [path.read_text(errors="replace") for path in files])
    ds = P.prepare_dataset(str(tmp_path / "src"), tokenizer="bpe", vocab_size=2048, name="stdlib-bpe").dataset
    result_path = tmp_path / "result.json"
    env = {
        **os.environ,
        "AUTOLOOP_TIME_BUDGET": "20",
        "AUTOLOOP_DATA_DIR": str(ds.path),
        "AUTOLOOP_RESULT": str(result_path),
        "AUTOLOOP_CHECKPOINT": str(tmp_path / "model.pt"),
        "CUDA_VISIBLE_DEVICES": "",
    }
    run = subprocess.run([sys.executable, str(train_py)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(result_path.read_text())
    val_text = ds.tokenizer.decode(ds.split("val"))
    assert math.isfinite(result["val_bpb"]) and 0 < result["val_bpb"] < byte_entropy(val_text)
    assert result["data_fingerprint"] == ds.fingerprint
