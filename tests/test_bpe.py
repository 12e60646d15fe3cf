"""The harness's BPE tokenizer: raw-byte accounting, lossless encoding, persistence."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from autoloop import harness as H
from autoloop.harness.bpe import BPETokenizer, load_bpe_tokenizer
from autoloop.harness.tokenizer import load_tokenizer

NI = "你".encode()  # b"\xe4\xbd\xa0"


def small_vocab() -> BPETokenizer:
    """All 256 bytes, then merges; one of them is a partial UTF-8 sequence (2 of 你's 3 bytes)."""
    return BPETokenizer([bytes([b]) for b in range(256)] + [b"th", b"the", NI[:2], b" the"])


def test_partial_utf8_token_counts_its_raw_bytes():
    pytest.importorskip("tiktoken")
    tok = small_vocab()
    partial = tok.tokens.index(NI[:2])
    ids = tok.encode("你")
    assert list(ids) == [partial, NI[2]]
    lengths = tok.token_bytes()
    assert lengths[partial] == 2 and lengths[NI[2]] == 1 and lengths[tok.bos_id] == 0
    # Decode-then-encode would count the U+FFFD that a partial sequence decodes to: 3 bytes
    # for the first token and 3 for the lone continuation byte, 6 for a 3-byte character.
    decoded_then_encoded = sum(len(tok.tokens[i].decode("utf-8", errors="replace").encode()) for i in ids)
    assert decoded_then_encoded == 6 and int(lengths[ids].sum()) == len(NI) == 3


def test_bpb_of_a_partial_utf8_tokenization_uses_raw_bytes():
    pytest.importorskip("tiktoken")
    tok = small_vocab()
    text = "the 你 the 你你".encode()
    ids = np.concatenate([[tok.bos_id], tok.encode(text)])
    x, y = torch.tensor(ids[:-1])[None], torch.tensor(ids[1:])[None]

    class Uniform(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(tok.vocab_size))

        def forward(self, idx):
            return self.bias.expand(*idx.shape, tok.vocab_size)

    bpb = H.bpb_on_batches(Uniform(), [(x, y)], tok.token_bytes())
    # A uniform model pays log2(V) bits per token; the bytes are the text's own length.
    assert bpb == pytest.approx(len(ids[1:]) * math.log2(tok.vocab_size) / len(text), rel=1e-6)


def test_encoding_is_lossless_for_any_bytes():
    pytest.importorskip("tiktoken")
    tok = small_vocab()
    rng = random.Random(0)
    samples = [
        bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))) for _ in range(50)
    ] + ["the théâtre 你好 🎉".encode(), NI[:2] + b"the" + NI[1:], b"\xff\xfe the", b""]
    for data in samples:
        ids = tok.encode(data)
        assert tok.decode(ids) == data
        assert int(tok.token_bytes()[ids].sum()) == len(data)
    batch = tok.encode_batch(samples)
    assert all(np.array_equal(a, tok.encode(d)) for a, d in zip(batch, samples))


def test_bos_in_the_text_is_just_text():
    pytest.importorskip("tiktoken")
    tok = small_vocab()
    ids = tok.encode("<|bos|>")
    assert tok.bos_id not in ids and tok.decode(ids) == b"<|bos|>"


def test_round_trip_through_the_dataset_file(tmp_path):
    tok = small_vocab()
    (tmp_path / "tokenizer.tiktoken").write_bytes(tok.file_bytes())
    spec = tok.spec()
    assert spec["vocab_size"] == 261 and tok.bos_id == 260
    again = load_tokenizer(spec, tmp_path)
    assert isinstance(again, BPETokenizer) and again.tokens == tok.tokens and again.spec() == spec
    (tmp_path / "tokenizer.tiktoken").write_bytes(tok.file_bytes().replace(b" 257\n", b" 300\n"))
    with pytest.raises(H.HarnessError, match="is corrupt"):
        load_bpe_tokenizer(spec, tmp_path)


def test_vocabulary_must_cover_every_byte():
    with pytest.raises(ValueError, match="lacks 1 of the 256 single-byte tokens"):
        BPETokenizer([bytes([b]) for b in range(255)])
