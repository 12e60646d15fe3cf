"""Tokenization throughput of `autoloop prepare`, in MB of text per second, per tokenizer.

    python bench/prepare_speed.py [--mb 8] [--vocab-size 8192] [--threads N]

Needs no network: the text is this interpreter's standard library source (real code,
read from disk). Prints, for the byte tokenizer and a BPE tokenizer trained here:
- encode:   one document at a time, in one thread;
- batch:    tiktoken's threaded batch encoding (`autoloop prepare` uses it on 4+ cores);
- prepare:  a whole `prepare_dataset` of those files as a local .jsonl source (reading,
            hashing into splits, encoding, writing), in MB of input text per second.
BPE training time is printed too. Figures depend on the machine and on its load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoloop.harness.tokenizer import ByteTokenizer  # noqa: E402
from autoloop.prepare import encode_threads, prepare_dataset, train_bpe  # noqa: E402


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


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=8.0, help="Megabytes of text to tokenize.")
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size.")
    parser.add_argument("--threads", type=int, default=max(2, encode_threads()), help="Threads for batch encoding.")
    args = parser.parse_args()

    docs = [path.read_bytes() for path in stdlib_files(byte_cap=int(args.mb * 1e6))]
    total = sum(map(len, docs))
    mb = total / 1e6
    print(f"text: {len(docs)} files, {mb:.1f} MB; cpus: {os.cpu_count()}; batch threads: {args.threads}")

    seconds = timed(lambda: globals().update(bpe=train_bpe(iter(docs), args.vocab_size)))
    bpe = globals()["bpe"]
    print(f"BPE training: {bpe.vocab_size} tokens in {seconds:.1f} s ({mb / seconds:.1f} MB/s)")
    bpe.encode(b"warm up")  # builds the tiktoken encoding once, outside the timings

    byte = ByteTokenizer()
    rows = [
        ("byte", "encode", timed(lambda: [byte.encode(d) for d in docs])),
        ("bpe", "encode", timed(lambda: [bpe.encode(d) for d in docs])),
        ("bpe", "batch", timed(lambda: bpe.encode_batch(docs, num_threads=args.threads))),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["AUTOLOOP_CACHE_DIR"] = str(Path(tmp) / "cache")
        source = Path(tmp) / "src" / "text.jsonl"
        source.parent.mkdir()
        source.write_text("".join(json.dumps({"text": d.decode("utf-8", errors="replace")}) + "\n" for d in docs))
        rows.append(("byte", "prepare", timed(lambda: prepare_dataset(str(source.parent), tokenizer="byte"))))
        # The BPE prepare includes training its vocabulary again, as the command does.
        rows.append(("bpe", "prepare", timed(lambda: prepare_dataset(str(source.parent), tokenizer="bpe", vocab_size=args.vocab_size))))
    print(f"{'tokenizer':<10}{'mode':<9}{'seconds':>9}{'MB/s':>9}")
    for name, mode, seconds in rows:
        print(f"{name:<10}{mode:<9}{seconds:>9.2f}{mb / seconds:>9.1f}")


if __name__ == "__main__":
    main()
