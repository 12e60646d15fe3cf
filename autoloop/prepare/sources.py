"""Where a preparation's documents come from: local files or a named Hub dataset, per split.

(autoloop.prepare: the rules of a preparation.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator


from autoloop.errors import AutoloopError
from autoloop.prepare.common import EVAL_SPLIT_BYTE_CAP, Reporter, format_size
from autoloop.prepare.documents import READERS, bucket_of, jsonl_documents, open_parquet, split_of_document
from autoloop.prepare.hub import DATASETS, HubDataset, download, find_hub_dataset, hub_dir


@dataclass
class Source:
    """Where a dataset's documents come from, already on local disk."""

    key: str  # the Hub dataset key, or the absolute path of local files
    label: str  # the default prepared name's stem
    description: str
    recipe: dict  # what was read: part of the recipe that decides whether a folder is reused
    _documents: Callable[[str], Iterator[bytes]] = field(repr=False, default=None)

    def documents(self, split: str) -> Iterator[bytes]:
        docs = self._documents(split)
        if split != "train":
            docs = _capped(docs, EVAL_SPLIT_BYTE_CAP)
        return _nonempty(docs, split, self)


def _capped(docs: Iterable[bytes], cap: int) -> Iterator[bytes]:
    total = 0
    for doc in docs:
        if total >= cap:
            return
        total += len(doc)
        yield doc


def _nonempty(docs: Iterable[bytes], split: str, source: Source) -> Iterator[bytes]:
    n = 0
    for doc in docs:
        n += 1
        yield doc
    if n == 0:
        hint = (
            "give it more documents: each goes to val or heldout with 5% chance (by a hash of its text)"
            if source.recipe.get("kind") == "local"
            else f"the file for {split} has no text; delete it from {hub_dir()} and run again"
        )
        raise AutoloopError(f"the {split} split of {source.label} has no documents: {hint}")


def local_files(path: Path) -> list[Path]:
    """The .txt/.jsonl/.parquet files of a file or folder (hidden ones skipped), sorted."""
    if path.is_file():
        if path.suffix.lower() not in READERS:
            raise AutoloopError(f"{path} is a {path.suffix or 'suffix-less'} file: give .txt, .jsonl or .parquet files")
        return [path]
    files = sorted(
        p
        for p in path.rglob("*")
        if p.suffix.lower() in READERS and p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise AutoloopError(f"folder {path} has no .txt, .jsonl or .parquet files: put the text there, or give another path")
    return files


def local_source(path: Path) -> Source:
    path = path.expanduser().resolve()
    files = local_files(path)
    for f in files:
        # Fail now, not after minutes of tokenizing, on a file that cannot be read at all.
        if f.suffix.lower() == ".parquet":
            open_parquet(f)
        elif f.suffix.lower() == ".jsonl":
            next(jsonl_documents(f), None)
    base = path if path.is_dir() else path.parent
    stats = [(f.relative_to(base).as_posix(), f.stat()) for f in files]
    counts = {}
    for f in files:
        counts[f.suffix.lower()] = counts.get(f.suffix.lower(), 0) + 1

    def documents(split: str) -> Iterator[bytes]:
        for f in files:
            for doc in READERS[f.suffix.lower()](f):
                if split_of_document(doc) == split:
                    yield doc

    label = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem if path.is_file() else path.name).strip("-.") or "local"
    kinds = ", ".join(f"{n} {suffix}" for suffix, n in sorted(counts.items()))
    return Source(
        key=str(path),
        label=label,
        description=f"{path} ({kinds}, {format_size(sum(s.st_size for _, s in stats))}; split by document hash)",
        recipe={"kind": "local", "path": str(path), "files": [[rel, s.st_size, s.st_mtime_ns] for rel, s in stats]},
        _documents=documents,
    )


def hub_source(ds: HubDataset, shards: int | None, reporter: Reporter) -> Source:
    n = ds.default_shards if shards is None else shards
    if n < 1:
        raise AutoloopError(f"--shards {n} is too few: {ds.key} needs at least one train shard")
    if n > ds.max_train_shards:
        reporter.log(f"{ds.key} has {ds.max_train_shards} train shard(s) besides the pinned val and heldout ones: using all of them")
        n = ds.max_train_shards
    train = ds.train_shards(n)
    paths, revision = download(ds, train + [ds.val_file, ds.heldout_file], reporter)
    reader = READERS["." + ds.format]
    shared = ds.val_file == ds.heldout_file

    def documents(split: str) -> Iterator[bytes]:
        if split == "train":
            for name in train:
                yield from reader(paths[name])
            return
        for doc in reader(paths[ds.val_file if split == "val" else ds.heldout_file]):
            if not shared or (bucket_of(doc) < 50) == (split == "val"):
                yield doc

    first, last = train[0], train[-1]
    shown = first if n == 1 else f"{first}..{last}"
    return Source(
        key=ds.key,
        label=ds.key,
        description=(
            f"{ds.repo_id}@{revision[:12]}: train {shown} ({n} shard{'s' * (n > 1)}), val {ds.val_file}, heldout "
            f"{ds.heldout_file}{' (split by document hash)' if shared else ''}"
        ),
        recipe={
            "kind": "hub",
            "repo_id": ds.repo_id,
            "revision": revision,
            "files": {split: names for split, names in (("train", train), ("val", [ds.val_file]), ("heldout", [ds.heldout_file]))},
            "sizes": {name: paths[name].stat().st_size for name in paths},
        },
        _documents=documents,
    )


def resolve_source(dataset: str, shards: int | None, reporter: Reporter) -> Source:
    named = find_hub_dataset(dataset)
    if named is not None:
        return hub_source(named, shards, reporter)
    path = Path(dataset).expanduser()
    if path.exists():
        if shards is not None:
            raise AutoloopError("--shards applies to named Hub datasets only: a local path is prepared whole")
        return local_source(path)
    known = ", ".join(DATASETS)
    raise AutoloopError(
        f"unknown dataset '{dataset}': it is neither a known name ({known}) nor an existing file or folder; "
        "give one of those names or a path to .txt, .jsonl or .parquet files"
    )
