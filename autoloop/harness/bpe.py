"""Byte-level BPE tokenizer, harness side: load and encode only (training is in autoloop.prepare).

A prepared BPE dataset holds its vocabulary in `tokenizer.tiktoken` (tiktoken's own
format: one `base64(token bytes) rank` line per token, ranks 0..n-1) and records in
meta.json `{"type": "bpe", "file", "sha256", "pattern", "bos_token", "vocab_size"}`.
Token id = rank; BOS is one extra special token with id n, so `vocab_size` = n + 1.

Rules the metric relies on:
- `token_bytes()[i]` is the length of token i's *raw bytes* from the vocabulary file,
  never the length of its decoded-then-re-encoded text: a token that is a partial UTF-8
  sequence (b"\\xe4\\xbd", the first two bytes of a CJK character) counts 2 bytes, not the
  3 bytes of the U+FFFD that decoding it would give. BOS counts 0.
- Encoding is lossless for any bytes: `decode(encode(b)) == b`. Valid UTF-8 goes through
  tiktoken (which only takes `str`); bytes that are not valid UTF-8 become their
  single-byte tokens, so no text is replaced before it is counted. Hence the token bytes
  of a document always sum to the document's length in bytes, with either tokenizer.

Only the standard library and numpy are imported here: a BPE dataset's token arrays,
`token_bytes` and `decode` work on a bare GPU image without tiktoken, which is imported
lazily by `encode` (the only thing that needs it).
"""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from autoloop.harness.errors import HarnessError

TOKENIZER_FILE = "tokenizer.tiktoken"
BOS_TOKEN = "<|bos|>"
# GPT-4's split pattern with numbers in groups of at most two digits (autoresearch's choice,
# which suits small vocabularies).
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
# Lone surrogates U+DC80..U+DCFF are how `surrogateescape` marks bytes that are not UTF-8.
_ESCAPED_BYTES = re.compile("[\udc80-\udcff]+")


def _need_tiktoken():
    try:
        import tiktoken
    except ImportError:
        raise HarnessError(
            "encoding text with a BPE tokenizer needs tiktoken: pip install -e '.[bpe]' "
            "(training on an already prepared dataset does not)"
        ) from None
    return tiktoken


class BPETokenizer:
    """A trained byte-level BPE vocabulary plus BOS, encoding through tiktoken."""

    name = "bpe"

    def __init__(self, tokens: Sequence[bytes], pattern: str = SPLIT_PATTERN, bos_token: str = BOS_TOKEN):
        tokens = [bytes(t) for t in tokens]
        if len(set(tokens)) != len(tokens) or any(not t for t in tokens):
            raise ValueError("BPE tokens must be distinct and non-empty")
        index = {token: i for i, token in enumerate(tokens)}
        missing = [b for b in range(256) if bytes([b]) not in index]
        if missing:
            # Without every single byte some text could not be encoded at all.
            raise ValueError(f"BPE vocabulary lacks {len(missing)} of the 256 single-byte tokens")
        self.tokens = tokens
        self.pattern = pattern
        self.bos_token = bos_token
        self.vocab_size = len(tokens) + 1
        self.bos_id = len(tokens)
        self._byte_ids = np.array([index[bytes([b])] for b in range(256)], dtype=np.int64)
        self._encoding = None
        self._file = self._serialize()
        self._sha256 = hashlib.sha256(self._file).hexdigest()

    # ------------------------------------------------------------------ persistence

    @classmethod
    def from_ranks(cls, ranks: dict[bytes, int], pattern: str = SPLIT_PATTERN, bos_token: str = BOS_TOKEN) -> "BPETokenizer":
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise ValueError("BPE ranks must be exactly 0..n-1")
        return cls([token for token, _ in sorted(ranks.items(), key=lambda item: item[1])], pattern, bos_token)

    def _serialize(self) -> bytes:
        return b"".join(base64.b64encode(token) + b" %d\n" % rank for rank, token in enumerate(self.tokens))

    def file_bytes(self) -> bytes:
        """The contents of `tokenizer.tiktoken`, for write_dataset's extra files."""
        return self._file

    def spec(self) -> dict:
        return {
            "type": "bpe",
            "file": TOKENIZER_FILE,
            "sha256": self._sha256,
            "pattern": self.pattern,
            "bos_token": self.bos_token,
            "vocab_size": self.vocab_size,
        }

    # ------------------------------------------------------------------ the Tokenizer interface

    def token_bytes(self) -> np.ndarray:
        return np.array([len(t) for t in self.tokens] + [0], dtype=np.int32)

    def decode(self, ids) -> bytes:
        """Raw bytes of the tokens, BOS dropped; never goes through str."""
        return b"".join(self.tokens[int(i)] for i in ids if int(i) != self.bos_id)

    def _tiktoken(self):
        if self._encoding is None:
            tiktoken = _need_tiktoken()
            self._encoding = tiktoken.Encoding(
                name=f"autoloop-bpe-{self._sha256[:12]}",
                pat_str=self.pattern,
                mergeable_ranks={token: rank for rank, token in enumerate(self.tokens)},
                special_tokens={self.bos_token: self.bos_id},
            )
        return self._encoding

    def _encode_escaped(self, data: bytes) -> np.ndarray:
        # Text that is not valid UTF-8: tiktoken would replace the bad bytes with U+FFFD
        # (3 bytes), changing what is counted. Valid runs go through tiktoken; each byte
        # that is not UTF-8 becomes its own single-byte token.
        text = data.decode("utf-8", errors="surrogateescape")
        encoding = self._tiktoken()
        parts: list[np.ndarray] = []
        position = 0
        for match in _ESCAPED_BYTES.finditer(text):
            if match.start() > position:
                parts.append(np.asarray(encoding.encode_ordinary(text[position : match.start()]), dtype=np.int64))
            raw = match.group().encode("utf-8", errors="surrogateescape")
            parts.append(self._byte_ids[np.frombuffer(raw, dtype=np.uint8)])
            position = match.end()
        if position < len(text):
            parts.append(np.asarray(encoding.encode_ordinary(text[position:]), dtype=np.int64))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def encode(self, data: bytes | str) -> np.ndarray:
        """Token ids of one document (BOS not added: write_dataset adds it)."""
        if isinstance(data, str):
            data = data.encode("utf-8")  # as ByteTokenizer does: the same str gives the same bytes
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return self._encode_escaped(data)
        return np.asarray(self._tiktoken().encode_ordinary(text), dtype=np.int64)

    def encode_batch(self, documents: Iterable[bytes | str], num_threads: int = 4) -> list[np.ndarray]:
        """encode() over many documents, with tiktoken's threads for the UTF-8 ones."""
        documents = [d.encode("utf-8") if isinstance(d, str) else d for d in documents]
        texts, positions, out = [], [], [None] * len(documents)
        for i, data in enumerate(documents):
            try:
                texts.append(data.decode("utf-8"))
                positions.append(i)
            except UnicodeDecodeError:
                out[i] = self._encode_escaped(data)
        encoding = self._tiktoken()
        if num_threads > 1:
            encoded = encoding.encode_ordinary_batch(texts, num_threads=num_threads)
        else:
            # tiktoken's batch call starts a thread pool per call: pure overhead for one thread.
            encoded = [encoding.encode_ordinary(text) for text in texts]
        for i, ids in zip(positions, encoded):
            out[i] = np.asarray(ids, dtype=np.int64)
        return out


# ---------------------------------------------------------------------- loading from a dataset


def _corrupt(data_dir: Path, what: str) -> HarnessError:
    return HarnessError(
        f"data cache {data_dir} is corrupt ({what}): delete it with `rm -rf {data_dir}` and prepare it again "
        "with `autoloop prepare`"
    )


def parse_tiktoken_file(content: bytes) -> dict[bytes, int]:
    """`base64 rank` lines -> {token bytes: rank}."""
    ranks = {}
    for line in content.splitlines():
        if not line:
            continue
        token, rank = line.split()
        ranks[base64.b64decode(token, validate=True)] = int(rank)
    return ranks


def load_bpe_tokenizer(spec: dict, data_dir: Path) -> BPETokenizer:
    data_dir = Path(data_dir)
    path = data_dir / spec.get("file", TOKENIZER_FILE)
    try:
        content = path.read_bytes()
    except FileNotFoundError:
        raise _corrupt(data_dir, f"{path.name} is missing") from None
    except OSError as exc:
        raise _corrupt(data_dir, f"{path.name} is unreadable: {exc.strerror}") from None
    if hashlib.sha256(content).hexdigest() != spec.get("sha256"):
        raise _corrupt(data_dir, f"{path.name} does not match the sha256 in meta.json")
    try:
        tokenizer = BPETokenizer.from_ranks(
            parse_tiktoken_file(content), spec.get("pattern", SPLIT_PATTERN), spec.get("bos_token", BOS_TOKEN)
        )
    except (ValueError, TypeError) as exc:
        raise _corrupt(data_dir, f"{path.name}: {exc}") from None
    if tokenizer.vocab_size != spec.get("vocab_size"):
        raise _corrupt(data_dir, f"{path.name} has {tokenizer.vocab_size} tokens, meta.json says {spec.get('vocab_size')}")
    return tokenizer

