"""Preparing a dataset (the one entry point), and listing and finding prepared datasets and downloads.

(autoloop.prepare: the rules of a preparation.)
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import numpy as np

from autoloop.errors import AutoloopError
from autoloop.harness.constants import SPLITS
from autoloop.harness.contract import cache_root, embedded_dataset_name
from autoloop.harness.data import Dataset, load_dataset, write_dataset
from autoloop.harness.errors import HarnessError
from autoloop.harness.tokenizer import ByteTokenizer
from autoloop.prepare.common import DEFAULT_VOCAB_SIZE, NAME_RE, RECIPE_VERSION, Reporter, TOKENIZER_SAMPLE_CHARS, format_count, format_size, need
from autoloop.prepare.hub import DATASETS, find_hub_dataset, hub_dir, read_manifest
from autoloop.prepare.sources import Source, resolve_source
from autoloop.prepare.tokenizer import check_vocab_size, encode_threads, encoded, train_bpe


@dataclass
class Prepared:
    dataset: Dataset
    reused: bool  # True when an identical preparation was already there
    seconds: float


def prepared_root() -> Path:
    return cache_root() / "data"


def _default_name(source: Source, tokenizer: str, vocab_size: int) -> str:
    return f"{source.label}-{'byte' if tokenizer == 'byte' else f'bpe{vocab_size}'}"


def check_name(name: str) -> str:
    if not NAME_RE.match(name) or name in (".", ".."):
        raise AutoloopError(f"--name {name!r} is not a valid dataset name: use letters, digits, '.', '_' and '-'")
    return name


def prepare_dataset(
    dataset: str,
    *,
    shards: int | None = None,
    tokenizer: str = "bpe",
    vocab_size: int | None = None,
    name: str | None = None,
    force: bool = False,
    sample_chars: int = TOKENIZER_SAMPLE_CHARS,
    reporter: Reporter | None = None,
) -> Prepared:
    """Prepare a named Hub dataset or local files as `cache_root()/data/<name>`.

    Returns the prepared dataset; an identical earlier preparation (same files, same
    tokenizer options) is reused unless `force`.
    """
    reporter = reporter or Reporter()
    started = time.perf_counter()
    if tokenizer not in ("byte", "bpe"):
        raise AutoloopError(f"unknown tokenizer {tokenizer!r}: use bpe or byte")
    if tokenizer == "byte" and vocab_size is not None:
        raise AutoloopError("--vocab-size applies to the BPE tokenizer only: drop it, or use --tokenizer bpe")
    vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
    if tokenizer == "bpe":
        check_vocab_size(vocab_size)
        # Before any download: a missing extra should not cost a 100 MB shard first.
        need("rustbpe", "bpe", "training a BPE tokenizer (or use --tokenizer byte)")
        need("tiktoken", "bpe", "a BPE tokenizer (or use --tokenizer byte)")
    if name is not None:
        check_name(name)

    source = resolve_source(dataset, shards, reporter)
    name = name or _default_name(source, tokenizer, vocab_size)
    data_dir = prepared_root() / name
    recipe = {
        "version": RECIPE_VERSION,
        "source": source.recipe,
        "tokenizer": tokenizer,
        **({"vocab_size": vocab_size, "sample_chars": sample_chars} if tokenizer == "bpe" else {}),
    }
    if not force and (data_dir / "meta.json").exists():
        try:
            existing = load_dataset(data_dir, prepare=False)
        except HarnessError:
            existing = None  # damaged: prepare it again below
        if existing is not None and existing.meta.get("recipe") == recipe:
            reporter.log(f"{name} is already prepared from the same files and options (pass --force to rebuild it)")
            return Prepared(existing, reused=True, seconds=time.perf_counter() - started)

    reporter.log(f"preparing {name} from {source.description}")
    if tokenizer == "bpe":
        tok = train_bpe(source.documents("train"), vocab_size, sample_chars, reporter)
        files = {tok.spec()["file"]: tok.file_bytes()}
    else:
        tok, files = ByteTokenizer(), {}
    threads = encode_threads()
    timings: dict[str, float] = {}

    def split_documents(split: str) -> Iterator[bytes | np.ndarray]:
        # write_dataset consumes the splits one after the other; each gets its own progress line.
        t0 = time.perf_counter()
        with reporter.progress(f"tokenizing {split}") as advance:
            yield from encoded(tok, source.documents(split), advance, threads)
        timings[split] = time.perf_counter() - t0

    ds = write_dataset(
        data_dir,
        name,
        tok,
        {split: split_documents(split) for split in SPLITS},
        source=source.description,
        extra_meta={
            "files": files,
            "recipe": recipe,
            "prepared_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        },
    )
    for split in SPLITS:
        info = ds.meta["splits"][split]
        seconds = timings.get(split, 0.0)
        rate = f", {info['bytes'] / seconds / 1e6:.1f} MB/s" if seconds > 0 else ""
        reporter.log(
            f"{split}: {info['documents']:,} documents, {format_size(info['bytes'])} of text -> {format_count(info['tokens'])} tokens "
            f"in {seconds:.1f} s{rate}"
        )
    return Prepared(ds, reused=False, seconds=time.perf_counter() - started)


# ---------------------------------------------------------------------- listing and lookup


@dataclass
class PreparedInfo:
    name: str
    path: Path
    problem: str | None  # None when meta.json reads; the data itself is not re-hashed here
    tokenizer: str = ""
    vocab_size: int | None = None
    tokens: dict = field(default_factory=dict)
    text_bytes: dict = field(default_factory=dict)
    disk_bytes: int = 0
    fingerprint: str | None = None
    source: str = ""
    dataset_key: str | None = None
    prepared_at: str | None = None


def _disk_usage(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def list_prepared() -> list[PreparedInfo]:
    """Every prepared dataset folder under cache_root()/data, by name (from meta.json only: fast)."""
    root = prepared_root()
    if not root.is_dir():
        return []
    infos = []
    for path in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            meta = json.loads((path / "meta.json").read_text())
            spec = meta["tokenizer"]
            recipe = meta.get("recipe") or {}
            infos.append(
                PreparedInfo(
                    name=path.name,
                    path=path,
                    problem=None,
                    tokenizer=spec.get("type", "?"),
                    vocab_size=int(meta["vocab_size"]),
                    tokens={s: meta["splits"][s]["tokens"] for s in SPLITS},
                    text_bytes={s: meta["splits"][s]["bytes"] for s in SPLITS},
                    disk_bytes=_disk_usage(path),
                    fingerprint=meta["fingerprint"],
                    source=meta.get("source", ""),
                    dataset_key=_key_of(recipe),
                    prepared_at=meta.get("prepared_at"),
                )
            )
        except FileNotFoundError:
            infos.append(PreparedInfo(path.name, path, "no meta.json: incomplete or not a dataset", disk_bytes=_disk_usage(path)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            infos.append(PreparedInfo(path.name, path, f"unreadable meta.json ({type(exc).__name__})", disk_bytes=_disk_usage(path)))
    return infos


def _key_of(recipe: dict) -> str | None:
    repo = (recipe.get("source") or {}).get("repo_id")
    for ds in DATASETS.values():
        if ds.repo_id == repo:
            return ds.key
    return None


@dataclass
class DownloadInfo:
    repo_id: str
    path: Path
    files: int
    disk_bytes: int
    revision: str | None


def list_downloads() -> list[DownloadInfo]:
    """The Hub repositories with files in hub_dir(), with what they hold."""
    root = hub_dir()
    if not root.is_dir():
        return []
    infos = []
    for owner in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for repo in sorted(p for p in owner.iterdir() if p.is_dir() and not p.name.startswith(".")):
            files = [p for p in repo.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(repo).parts)]
            infos.append(
                DownloadInfo(
                    repo_id=f"{owner.name}/{repo.name}",
                    path=repo,
                    files=len(files),
                    disk_bytes=sum(p.stat().st_size for p in files),
                    revision=read_manifest(repo).get("revision"),
                )
            )
    return infos


def resolve_data_dir(name_or_path: str | os.PathLike) -> Path:
    """The folder of a prepared dataset, from `[tool.autoloop] dataset = ...` or a flag.

    Accepts a prepared dataset's name (see `autoloop prepare --list`), a folder holding a
    prepared dataset, the embedded corpus's name (prepared on first use), or a Hub
    dataset's short name when exactly one preparation of it exists.
    """
    text = str(name_or_path).strip()
    if not text:
        raise AutoloopError("the dataset setting is empty: give a prepared dataset's name or folder, or remove the setting")
    # A prepared name wins over a same-named folder in the current directory.
    if NAME_RE.match(text):
        by_name = prepared_root() / text
        if (by_name / "meta.json").exists() or text == embedded_dataset_name():
            return by_name
    path = Path(text).expanduser()
    if (path / "meta.json").exists():
        return path.resolve()
    hub = find_hub_dataset(text)
    if hub is not None:
        matches = [info for info in list_prepared() if info.problem is None and info.dataset_key == hub.key]
        if len(matches) == 1:
            return matches[0].path
        if len(matches) > 1:
            names = ", ".join(info.name for info in matches)
            raise AutoloopError(f"dataset '{text}' is prepared more than once ({names}): set the dataset to one of these names")
        raise AutoloopError(f"dataset '{text}' is not prepared yet: run `autoloop prepare --dataset {text}`")
    if path.exists():
        raise AutoloopError(
            f"{path} holds no prepared dataset (no meta.json): run `autoloop prepare --dataset {text}` and use the name it prints"
        )
    raise AutoloopError(
        f"no prepared dataset named '{text}' in {prepared_root()}: see `autoloop prepare --list`, or prepare it with "
        f"`autoloop prepare --dataset NAME_OR_PATH`"
    )
