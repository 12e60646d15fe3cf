"""Tokenizers behind one small interface.

The metric needs, for every token id, the number of *raw bytes* of text it stands for
(`token_bytes`): bits per byte is then comparable across tokenizers, and a token that is
a partial UTF-8 sequence still counts its own bytes (never decode-then-encode). Special
tokens (BOS) stand for no text: their byte length is 0 and the metric leaves them out.

A prepared dataset records its tokenizer in meta.json (`{"type": "byte"}`, ...);
`load_tokenizer` rebuilds it from that record: the byte tokenizer here, BPE from
autoloop.harness.bpe (imported only for a BPE dataset: its packages are optional).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from autoloop.harness.errors import HarnessError


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    bos_id: int

    def encode(self, data: bytes) -> np.ndarray: ...

    def decode(self, ids) -> bytes: ...

    def token_bytes(self) -> np.ndarray: ...

    def spec(self) -> dict: ...


class ByteTokenizer:
    """Token id = byte value (0..255), plus BOS = 256 to mark document starts."""

    name = "byte"
    vocab_size = 257
    bos_id = 256

    def encode(self, data: bytes | str) -> np.ndarray:
        if isinstance(data, str):
            data = data.encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> bytes:
        return bytes(int(i) for i in ids if int(i) < 256)

    def token_bytes(self) -> np.ndarray:
        lengths = np.ones(self.vocab_size, dtype=np.int32)
        lengths[self.bos_id] = 0
        return lengths

    def spec(self) -> dict:
        return {"type": "byte"}


TOKENIZER_LOADERS: dict[str, Callable[[dict, Path], Tokenizer]] = {
    "byte": lambda spec, data_dir: ByteTokenizer(),
}


def load_tokenizer(spec: dict, data_dir: Path) -> Tokenizer:
    kind = spec.get("type")
    if kind == "bpe":
        # Imported here: optional, so the byte path needs no extra packages.
        from autoloop.harness.bpe import load_bpe_tokenizer

        return load_bpe_tokenizer(spec, data_dir)
    try:
        loader = TOKENIZER_LOADERS[kind]
    except KeyError:
        raise HarnessError(
            f"dataset at {data_dir} uses an unknown tokenizer {kind!r}: upgrade autoloop or prepare the dataset again"
        ) from None
    return loader(spec, data_dir)
