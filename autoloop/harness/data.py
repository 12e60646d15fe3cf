"""Prepared datasets: token arrays per split, their fingerprints, and a fast loader.

A prepared dataset is a folder:

    meta.json          name, tokenizer spec, vocab size, dtype, per-split token/byte
                       counts and sha256, and the dataset fingerprint
    token_bytes.npy    raw byte length of every token id (0 for special tokens)
    train.bin, val.bin, heldout.bin   flat token arrays, each document preceded by BOS

Splits (the data-split contract): training reads `train` and evaluates on `val`;
`heldout` is read only by the verifier. Under the controller the training process gets a
meta-only view of the folder (make_meta_only_view: meta.json, token_bytes.npy and the
tokenizer's files, no split files) and its training batches from the harness's data
feed (autoloop/harness/feed.py), which counts what it serves. A folder is written under a temporary name and
renamed into place, so a crash or a concurrent preparation never leaves a half-written
dataset where a complete one was.

The embedded default corpus is text in a made-up language generated from a secret key in
the cache folder (autoloop/harness/synthetic.py, autoloop/harness/corpus_key.py), so that
no file a sandbox can read holds its val or held-out text. It needs no download and is
prepared on first use; its meta.json names the key by a one-way digest, which the
dataset's fingerprint covers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from autoloop.harness.constants import EMBEDDED_DOCUMENTS, SPLITS
from autoloop.harness.contract import ENV_DATA_DIR, cache_root, default_data_dir, embedded_dataset_name
from autoloop.harness.errors import HarnessError
from autoloop.harness.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

META_FORMAT = 1
# Set by the controller for a training process: the unix socket of the harness's data
# feed (autoloop/harness/feed.py), from which TokenLoader(ds, "train", ...) gets batches.
ENV_FEED = "AUTOLOOP_FEED"


# ---------------------------------------------------------------------------- loading


# Written into a meta-only view of a dataset: its split files are deliberately absent.
WITHHELD_MARKER = "splits-withheld.json"


def split_refusal(split: str) -> str:
    """Why a training process under autoloop may not read `split` (one line)."""
    if split == "train":
        return ("the train split is served to training by the harness's data feed under autoloop: read it with "
                "TokenLoader(ds, \"train\", ...), not from the split files")
    return (f"the {split} split is not available to training under autoloop: val_bpb is computed by the harness's "
            "evaluator in a separate process (train on the train split only)")


@dataclass
class Dataset:
    path: Path
    meta: dict
    tokenizer: Tokenizer
    token_bytes: np.ndarray
    withheld: bool = False  # a meta-only view: no split files (see make_meta_only_view)
    _splits: dict = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return self.meta["name"]

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def bos_id(self) -> int:
        return int(self.meta["bos_id"])

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    def split_fingerprint(self, name: str) -> str:
        return self.meta["splits"][name]["sha256"]

    def split(self, name: str) -> np.ndarray:
        """The split's tokens as a read-only memory map (opened once per process).

        Refused in a meta-only view (the training process under the controller), whose
        training batches come from the data feed and whose evaluation runs elsewhere.
        """
        if self.withheld:
            raise HarnessError(split_refusal(name))
        return self._memmap(name)

    def _memmap(self, name: str) -> np.ndarray:
        if name not in self._splits:
            self._splits[name] = np.memmap(self.path / f"{name}.bin", dtype=self.meta["dtype"], mode="r")
        return self._splits[name]


def _corrupt(data_dir: Path, what: str) -> HarnessError:
    return HarnessError(
        f"data cache {data_dir} is corrupt ({what}): delete it with `rm -rf {data_dir}` and run again "
        "(the embedded corpus is prepared again automatically; a named dataset needs `autoloop prepare`)"
    )


def _is_embedded_default(data_dir: Path) -> bool:
    return not os.environ.get(ENV_DATA_DIR) and data_dir == cache_root() / "data" / embedded_dataset_name()


def load_dataset(data_dir: Path | str | None = None, *, prepare: bool = True) -> Dataset:
    """Open a prepared dataset; the embedded default corpus is prepared on first use."""
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    meta_path = data_dir / "meta.json"
    if not meta_path.exists():
        if prepare and _is_embedded_default(data_dir):
            prepare_embedded(data_dir)
        elif data_dir.exists() and any(data_dir.iterdir()):
            raise _corrupt(data_dir, "meta.json is missing")
        else:
            raise HarnessError(
                f"no prepared dataset at {data_dir}: run `autoloop prepare --dataset NAME` for it, "
                f"or unset {ENV_DATA_DIR} to use the embedded default corpus"
            )
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != META_FORMAT:
            raise _corrupt(data_dir, f"meta.json has format {meta.get('format')!r}, expected {META_FORMAT}")
        itemsize = np.dtype(meta["dtype"]).itemsize
        withheld = (data_dir / WITHHELD_MARKER).exists()
        for name in SPLITS if not withheld else ():
            info = meta["splits"][name]
            size = (data_dir / f"{name}.bin").stat().st_size
            if size != info["tokens"] * itemsize:
                raise _corrupt(data_dir, f"{name}.bin has {size} bytes, meta.json says {info['tokens'] * itemsize}")
        token_bytes = np.load(data_dir / "token_bytes.npy")
    except HarnessError:
        raise
    except FileNotFoundError as exc:
        raise _corrupt(data_dir, f"{Path(exc.filename).name} is missing") from None
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise _corrupt(data_dir, f"{type(exc).__name__}: {exc}") from None
    if token_bytes.shape != (meta["vocab_size"],):
        raise _corrupt(data_dir, f"token_bytes.npy has shape {token_bytes.shape}, expected ({meta['vocab_size']},)")
    tokenizer = load_tokenizer(meta["tokenizer"], data_dir)
    return Dataset(path=data_dir, meta=meta, tokenizer=tokenizer, token_bytes=token_bytes.astype(np.int64),
                   withheld=withheld)


def make_meta_only_view(data_dir: Path | str, dest: Path | str) -> Path:
    """A folder `dest` that load_dataset opens as `data_dir`'s dataset, without its split files.

    It holds every file of the dataset except the splits (meta.json, token_bytes.npy, a
    BPE vocabulary, ...), so vocabulary, BOS id and fingerprints are the dataset's own,
    plus a marker that makes every split access raise split_refusal. The controller
    gives it to the training process; the batches come from the data feed.
    """
    data_dir, dest = Path(data_dir), Path(dest)
    split_files = {f"{name}.bin" for name in SPLITS}
    if not (data_dir / "meta.json").is_file():
        raise HarnessError(f"no prepared dataset at {data_dir} to make a meta-only view of: prepare it first")
    try:
        dest.mkdir(parents=True, exist_ok=True)
        for path in sorted(data_dir.iterdir()):
            if path.is_file() and path.name not in split_files and not path.name.startswith("."):
                shutil.copyfile(path, dest / path.name)
        (dest / WITHHELD_MARKER).write_text(json.dumps(
            {"splits": list(SPLITS), "source": str(data_dir), "why": "training gets its batches from the data feed"}
        ))
    except OSError as exc:
        raise HarnessError(f"cannot write the meta-only data view at {dest} ({exc.strerror}): check the run folder") from None
    return dest


def verify_dataset(ds: Dataset) -> list[str]:
    """Recompute every split's sha256; returns the names of splits that no longer match."""
    from autoloop.harness.fingerprint import sha256_file

    return [name for name in SPLITS if sha256_file(ds.path / f"{name}.bin") != ds.split_fingerprint(name)]


# ---------------------------------------------------------------------------- writing


def _dataset_fingerprint(tokenizer_spec: dict, splits: dict, key_id: str | None = None) -> str:
    digest = hashlib.sha256(json.dumps(tokenizer_spec, sort_keys=True).encode())
    for name in SPLITS:
        digest.update(f"{name}:{splits[name]['sha256']}".encode())
    if key_id:  # a generated corpus: the key it came from, by its digest (corpus_key.key_id)
        digest.update(f"key:{key_id}".encode())
    return digest.hexdigest()


def write_dataset(
    data_dir: Path,
    name: str,
    tokenizer: Tokenizer,
    documents: dict[str, Iterable[bytes | np.ndarray]],
    *,
    source: str = "",
    extra_meta: dict | None = None,
) -> Dataset:
    """Tokenize documents per split and write a prepared dataset atomically.

    `documents[split]` yields raw document bytes (or already tokenized arrays); each
    document is written after a BOS token. Streaming: documents are never all in memory.
    Files the tokenizer needs (e.g. a BPE vocabulary) can be placed in the folder by a
    caller-provided `extra_meta["files"]` mapping name -> bytes.
    """
    data_dir = Path(data_dir)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    token_bytes = tokenizer.token_bytes()
    try:
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{data_dir.name}.", dir=data_dir.parent))
    except OSError as exc:
        raise HarnessError(
            f"cannot write the data cache at {data_dir.parent} ({exc.strerror}): "
            "set AUTOLOOP_CACHE_DIR (or AUTOLOOP_DATA_DIR) to a writable folder"
        ) from None
    try:
        splits = {}
        bos = np.array([tokenizer.bos_id], dtype=dtype)
        for split in SPLITS:
            digest = hashlib.sha256()
            tokens = nbytes = docs = 0
            with open(tmp / f"{split}.bin", "wb") as out:
                for doc in documents[split]:
                    ids = doc if isinstance(doc, np.ndarray) else tokenizer.encode(doc)
                    ids = np.concatenate([bos, np.asarray(ids, dtype=dtype)])
                    raw = ids.tobytes()
                    out.write(raw)
                    digest.update(raw)
                    tokens += len(ids)
                    nbytes += int(token_bytes[ids].sum())
                    docs += 1
            if tokens < 2:
                raise HarnessError(f"the {split} split of {name} is empty: give the dataset more text")
            splits[split] = {"tokens": tokens, "bytes": nbytes, "documents": docs, "sha256": digest.hexdigest()}
        np.save(tmp / "token_bytes.npy", token_bytes)
        extra = dict(extra_meta or {})
        for fname, content in extra.pop("files", {}).items():
            (tmp / fname).write_bytes(content)
        meta = {
            "format": META_FORMAT,
            "name": name,
            "source": source,
            "tokenizer": tokenizer.spec(),
            "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id,
            "dtype": np.dtype(dtype).name,
            "splits": splits,
            **extra,
            "fingerprint": _dataset_fingerprint(tokenizer.spec(), splits, extra.get("key_id")),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if (data_dir / "meta.json").exists():
            # Someone prepared it concurrently, or the caller is replacing it: the new
            # folder goes in whole, the old one is removed only after.
            old = data_dir.with_name(f".{data_dir.name}.old-{os.getpid()}")
            os.replace(data_dir, old)
            os.replace(tmp, data_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            if data_dir.exists():
                shutil.rmtree(data_dir)
            os.replace(tmp, data_dir)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise HarnessError(
            f"cannot write the data cache at {data_dir} ({exc.strerror}): "
            "set AUTOLOOP_CACHE_DIR (or AUTOLOOP_DATA_DIR) to a writable folder"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return load_dataset(data_dir, prepare=False)


def prepare_embedded(data_dir: Path | None = None) -> Dataset:
    """Prepare the embedded default corpus from the cache folder's key (a few seconds, no network).

    The key is made on first use (autoloop/harness/corpus_key.py); the same key always
    gives the same corpus, bit for bit.
    """
    from autoloop.harness import synthetic
    from autoloop.harness.corpus_key import corpus_key, key_id

    data_dir = Path(data_dir) if data_dir is not None else cache_root() / "data" / embedded_dataset_name()
    key = corpus_key()
    language = synthetic.Language.from_key(key)
    return write_dataset(
        data_dir,
        embedded_dataset_name(),
        ByteTokenizer(),
        {split: synthetic.generate(key, split, EMBEDDED_DOCUMENTS[split], language=language) for split in SPLITS},
        source=(f"a made-up language generated from the key in the cache folder (synthetic v{synthetic.LANGUAGE_VERSION}, "
                f"{sum(EMBEDDED_DOCUMENTS.values())} documents)"),
        extra_meta={"key_id": key_id(key)},
    )


# ---------------------------------------------------------------------------- loader


class WindowSampler:
    """Where the windows of each batch start: the one sampling rule of the loader and the feed.

    Random mode draws starts uniformly from its own seeded generator, so a seed fixes
    the data order; sequential mode walks the split in order and wraps. TokenLoader
    (reading the memory map) and the data feed (serving over a socket) both use it, so
    a run gets the same batches, bit for bit, with or without the feed.
    """

    def __init__(self, n_tokens: int, batch_size: int, seq_len: int, *, seed: int = 0, sequential: bool = False):
        self.batch_size, self.seq_len = batch_size, seq_len
        self.last_start = n_tokens - (seq_len + 1)
        self.sequential = sequential
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.position = 0

    def starts(self) -> np.ndarray:
        if not self.sequential:
            return self.rng.integers(0, self.last_start + 1, size=self.batch_size)
        # The walk visits 0, L, 2L, ... up to last_start, then wraps to 0: computed as one
        # array, not a Python int per window (a trial chooses batch_size; the feed serves it).
        cycle = self.last_start // self.seq_len + 1
        first = (self.position // self.seq_len) % cycle
        index = (first + np.arange(self.batch_size, dtype=np.int64)) % cycle
        self.position = (int(index[-1]) + 1) * self.seq_len if self.batch_size else self.position
        return index * self.seq_len


def read_windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """The (batch, seq_len + 1) windows at `starts`, in the split's own dtype."""
    # One gather from a strided view: the batch's own array and nothing per window (a list
    # of 2^21 slices cost the controller gigabytes; autoloop.harness.feed bounds the rest).
    windows = np.lib.stride_tricks.sliding_window_view(tokens, seq_len + 1)
    return windows[np.asarray(starts, dtype=np.int64)]


def check_window_fits(n_tokens: int, seq_len: int, split: str, where) -> None:
    if n_tokens < seq_len + 2:
        raise HarnessError(
            f"the {split} split of {where} has {n_tokens} tokens, fewer than one window of {seq_len + 1}: "
            "prepare a larger dataset"
        )
