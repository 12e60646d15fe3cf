"""The BPE tokenizer learned from a sample of the train split, and documents encoded with it in threads.

(autoloop.prepare: the rules of a preparation.)
"""

from __future__ import annotations

import os
import time
from typing import Iterable, Iterator

import numpy as np

from autoloop.errors import AutoloopError
from autoloop.harness.tokenizer import ByteTokenizer
from autoloop.prepare.common import DEFAULT_VOCAB_SIZE, ENCODE_BATCH_BYTES, ENCODE_BATCH_DOCS, MAX_VOCAB_SIZE, MIN_VOCAB_SIZE, Reporter, SAMPLE_DOC_CHARS, TOKENIZER_SAMPLE_CHARS, format_count, need


def _training_sample(docs: Iterable[bytes], limit: int, counter: list[int], advance) -> Iterator[str]:
    for doc in docs:
        if counter[0] >= limit:
            return
        text = doc.decode("utf-8", errors="replace")[:SAMPLE_DOC_CHARS]
        counter[0] += len(text)
        advance(len(text))
        yield text


def train_bpe(documents: Iterable[bytes], vocab_size: int = DEFAULT_VOCAB_SIZE, sample_chars: int = TOKENIZER_SAMPLE_CHARS,
              reporter: Reporter | None = None):
    """Learn a BPE vocabulary (vocab_size tokens including BOS) from the first sample_chars of documents."""
    from autoloop.harness.bpe import SPLIT_PATTERN, BPETokenizer

    reporter = reporter or Reporter()
    check_vocab_size(vocab_size)
    rustbpe = need("rustbpe", "bpe", "training a BPE tokenizer (or use --tokenizer byte)")
    need("tiktoken", "bpe", "a BPE tokenizer (or use --tokenizer byte)")
    trainer = rustbpe.Tokenizer()
    seen = [0]
    started = time.perf_counter()
    with reporter.progress("learning the BPE vocabulary", total=None) as advance:
        trainer.train_from_iterator(_training_sample(documents, sample_chars, seen, advance), vocab_size - 1, pattern=SPLIT_PATTERN)
    if seen[0] == 0:
        raise AutoloopError("the train split has no text to learn a BPE vocabulary from: give the dataset more text")
    ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
    tokenizer = BPETokenizer.from_ranks(ranks, trainer.get_pattern())
    reporter.log(
        f"BPE vocabulary: {tokenizer.vocab_size} tokens (with BOS) learned from {format_count(seen[0])} characters "
        f"in {time.perf_counter() - started:.1f} s"
    )
    if tokenizer.vocab_size < vocab_size:
        reporter.log(f"note: the sample only supported {tokenizer.vocab_size} of the {vocab_size} tokens asked for")
    return tokenizer


def check_vocab_size(vocab_size: int) -> None:
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise AutoloopError(
            f"--vocab-size {vocab_size} is out of range: give {MIN_VOCAB_SIZE} (256 bytes + BOS) to {MAX_VOCAB_SIZE}; "
            f"{DEFAULT_VOCAB_SIZE} is the default"
        )


def encode_threads() -> int:
    """Threads for tiktoken's batch encoding: up to 8, but none extra on a 2- or 3-core
    machine, where a second thread measured slower than one (bench/prepare_speed.py)."""
    cpus = os.cpu_count() or 1
    return min(8, cpus) if cpus >= 4 else 1


def encoded(tokenizer, docs: Iterable[bytes], advance, threads: int) -> Iterator[bytes | np.ndarray]:
    """Documents for write_dataset: raw bytes for the byte tokenizer, batches of ids for BPE."""
    if isinstance(tokenizer, ByteTokenizer):
        for doc in docs:
            advance(len(doc))
            yield doc
        return
    batch, nbytes = [], 0
    for doc in docs:
        batch.append(doc)
        nbytes += len(doc)
        if len(batch) >= ENCODE_BATCH_DOCS or nbytes >= ENCODE_BATCH_BYTES:
            yield from tokenizer.encode_batch(batch, num_threads=threads)
            advance(nbytes)
            batch, nbytes = [], 0
    if batch:
        yield from tokenizer.encode_batch(batch, num_threads=threads)
        advance(nbytes)
