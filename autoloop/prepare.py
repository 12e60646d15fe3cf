"""Preparing real datasets: named Hub datasets or local files -> a prepared dataset folder.

`prepare_dataset(...)` downloads or reads the text, trains a BPE tokenizer if asked, and
writes `cache_root()/data/<name>` with the harness's atomic writer (write_dataset), so a
failed or interrupted preparation never damages a dataset prepared before.

Rules that are not obvious from the code:

Splits (the data-split contract: train, val, heldout).
- Named Hub datasets come in numbered shards. `train` is the first N shards; `val` is
  the last shard, pinned (climbmix's shard_06542, as in autoresearch); `heldout` is the
  shard before it, also pinned, so adding train shards never moves either. A dataset
  that pins one file for both (TinyStories' valid file) divides its documents between
  val and heldout by a hash of their text.
- Local files (`--dataset PATH`) are assigned per document by a hash of the document's
  bytes: buckets 90-94 of 100 go to val, 95-99 to heldout (the embedded corpus's
  proportions). Hashing the content, not the position, sends duplicates to the same
  split, so a repeated document cannot leak from train into val.
- `val` and `heldout` keep whole documents, in file order, up to EVAL_SPLIT_BYTE_CAP of
  text: evaluation reads only the first `eval_tokens` (8M tokens, ~40 MB of text on
  CUDA), so the rest of a pinned shard would be unused disk and preparation time.

Documents.
- `.jsonl`: one JSON object per line, the document in its "text" field. `.parquet`: one
  document per row of the "text" column. Empty documents are skipped; others are kept
  byte for byte.
- `.txt`: documents are separated by `<|endoftext|>` (TinyStories' and GPT-2's
  convention). A longer stretch is cut into documents at the first blank line after
  TXT_DOC_BYTES (at a line end if there is no blank line within 4x that), so a single
  text file (a novel, tinyshakespeare) still yields enough documents for the hash split.
  Each .txt document is stripped of surrounding whitespace.
- Text is never decoded and re-encoded on its way to the tokenizer: both tokenizers see
  the same bytes, so the metric's byte counts, and val_bpb, are comparable across them.

Tokenizer. The BPE vocabulary is learned with rustbpe from the first
TOKENIZER_SAMPLE_CHARS characters of the train split (each document truncated to
SAMPLE_DOC_CHARS characters, as autoresearch does, so one huge document cannot dominate the counts); val
and heldout are never seen. Its size includes one BOS token. Documents are packed
BOS-aligned without padding: each is written after a BOS token, back to back.

Downloads. Hub files go to `hub_dir()/<owner>/<repo>/` ($AUTOLOOP_HUB_DIR, else
`cache_root()/hub`, which honours $AUTOLOOP_CACHE_DIR) through huggingface_hub, which
honours HF_ENDPOINT and HF_TOKEN. Each file is fetched whole and kept: a rerun skips
complete files without any network request and re-fetches a file that fails its size or
parquet check. The first download pins the repository's commit in
`.autoloop-manifest.json`, so shards fetched on different days come from one revision.
A lock file keeps two preparations of one repository from downloading the same shard.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from autoloop.errors import AutoloopError
from autoloop.harness.constants import HELDOUT_BUCKETS, SPLITS, VAL_BUCKETS
from autoloop.harness.contract import cache_root, embedded_dataset_name
from autoloop.harness.data import Dataset, load_dataset, write_dataset
from autoloop.harness.errors import HarnessError
from autoloop.harness.tokenizer import ByteTokenizer

ENV_HUB_DIR = "AUTOLOOP_HUB_DIR"
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
DEFAULT_VOCAB_SIZE = 8192
MIN_VOCAB_SIZE = 257  # the 256 single bytes and BOS
MAX_VOCAB_SIZE = 2**18
TOKENIZER_SAMPLE_CHARS = 256 * 2**20
SAMPLE_DOC_CHARS = 10_000
EVAL_SPLIT_BYTE_CAP = 128 * 2**20
TXT_DOC_SEPARATOR = b"<|endoftext|>"
TXT_DOC_BYTES = 8 * 2**10
TXT_READ_BLOCK = 4 * 2**20
# Documents encoded per tiktoken batch call (and an upper bound on the bytes held at once).
ENCODE_BATCH_DOCS = 1024
ENCODE_BATCH_BYTES = 16 * 2**20
HUB_METADATA_TIMEOUT = 20.0
MANIFEST = ".autoloop-manifest.json"
# Bumped when the preparation rules above change, so an older folder is not reused as-is.
RECIPE_VERSION = 1

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


# ---------------------------------------------------------------------- progress


class Reporter:
    """Where preparation reports to. This base one is silent and keeps the messages."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def log(self, message: str) -> None:
        self.messages.append(message)

    @contextlib.contextmanager
    def progress(self, description: str, total: int | None = None) -> Iterator[Callable[[int], None]]:
        """A context whose value is called with the number of bytes just processed."""
        yield lambda n: None


class ConsoleReporter(Reporter):
    """Messages as lines and a live rich progress line (bytes and rate) per long step."""

    def __init__(self, console=None) -> None:
        super().__init__()
        from rich.console import Console

        self.console = console or Console(stderr=True)

    def log(self, message: str) -> None:
        super().log(message)
        self.console.print(message, highlight=False, markup=False, soft_wrap=True)

    @contextlib.contextmanager
    def progress(self, description: str, total: int | None = None):
        if not self.console.is_terminal:
            # A live line in a log file is just noise; the summary lines say the same.
            yield lambda n: None
            return
        from rich.progress import BarColumn, FileSizeColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TransferSpeedColumn

        columns = [SpinnerColumn(), TextColumn("{task.description}"), FileSizeColumn(), TransferSpeedColumn(), TimeElapsedColumn()]
        if total:
            columns.insert(2, BarColumn())
        with Progress(*columns, console=self.console, transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n: bar.advance(task, n)


def format_size(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(nbytes) < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.1f} TB"


def format_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K" if n >= 1e3 else str(n)


def _need(module: str, extra: str, purpose: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise AutoloopError(f"{purpose} needs {module}: pip install -e '.[{extra}]' in autoloop's folder") from None


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------- named Hub datasets


@dataclass(frozen=True)
class HubDataset:
    """A named dataset on the Hugging Face Hub and its pinned split layout."""

    key: str
    repo_id: str
    description: str
    format: str  # "parquet" (a "text" column) or "txt"
    val_file: str
    heldout_file: str
    default_shards: int
    shard_pattern: str | None = None  # numbered train shards: pattern.format(i), i = 0, 1, ...
    max_train_shards: int = 1
    train_files: tuple[str, ...] = ()  # or an explicit list

    def train_shards(self, n: int) -> list[str]:
        if self.shard_pattern is not None:
            return [self.shard_pattern.format(i) for i in range(n)]
        return list(self.train_files[:n])


def _numbered(key, repo_id, description, last_shard, default_shards=10) -> HubDataset:
    pattern = "shard_{:05d}.parquet"
    return HubDataset(
        key=key, repo_id=repo_id, description=description, format="parquet",
        val_file=pattern.format(last_shard), heldout_file=pattern.format(last_shard - 1),
        default_shards=default_shards, shard_pattern=pattern, max_train_shards=last_shard - 1,
    )


DATASETS: dict[str, HubDataset] = {
    ds.key: ds
    for ds in (
        # autoresearch's data: ClimbMix, shuffled into ~100 MB parquet shards; val is its last shard.
        _numbered("climbmix", "karpathy/climbmix-400b-shuffle", "ClimbMix 400B tokens, shuffled (autoresearch's data)", 6542),
        # FineWeb-Edu's 100B-token sample in the same shard layout (nanochat's data).
        _numbered("fineweb-edu", "karpathy/fineweb-edu-100b-shuffle", "FineWeb-Edu 100B tokens, shuffled (nanochat's data)", 1822),
        # ~2 GB of simple stories: a small model learns it in minutes, for small machines.
        HubDataset(
            key="tinystories", repo_id="roneneldan/TinyStories", format="txt",
            description="TinyStories V2 (GPT-4 stories): small, for CPUs and small GPUs",
            train_files=("TinyStoriesV2-GPT4-train.txt",), max_train_shards=1, default_shards=1,
            val_file="TinyStoriesV2-GPT4-valid.txt", heldout_file="TinyStoriesV2-GPT4-valid.txt",
        ),
    )
}


def find_hub_dataset(name: str) -> HubDataset | None:
    wanted = name.strip().lower()
    for ds in DATASETS.values():
        if wanted in (ds.key, ds.repo_id.lower(), ds.key.replace("-", "_")):
            return ds
    return None


def hub_dir() -> Path:
    """Where Hub downloads are kept: $AUTOLOOP_HUB_DIR, else cache_root()/hub."""
    if os.environ.get(ENV_HUB_DIR):
        return Path(os.environ[ENV_HUB_DIR]).expanduser()
    return cache_root() / "hub"


def hub_endpoint() -> str:
    # Read at call time (huggingface_hub reads HF_ENDPOINT once, at import) and passed explicitly.
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_HUB_ENDPOINT).rstrip("/")


# ---------------------------------------------------------------------- documents


def _txt_cut(buf: bytes, start: int, end: int) -> int | None:
    """End of the first document in buf[start:end], or None if it may still grow."""
    if end - start <= TXT_DOC_BYTES:
        return None
    limit = min(start + 4 * TXT_DOC_BYTES, end)
    blank = buf.find(b"\n\n", start + TXT_DOC_BYTES, limit)
    if blank >= 0:
        return blank + 2
    if end - start < 4 * TXT_DOC_BYTES:
        return None
    line = buf.rfind(b"\n", start + TXT_DOC_BYTES, limit)
    return line + 1 if line >= 0 else limit


def _txt_chunks(buf: bytes, start: int, end: int, final: bool):
    """Yield documents from buf[start:end]; return where the unfinished remainder starts."""
    while (cut := _txt_cut(buf, start, end)) is not None:
        if doc := buf[start:cut].strip():
            yield doc
        start = cut
    if final:
        if doc := buf[start:end].strip():
            yield doc
        return end
    return start


def txt_documents(path: Path, block_size: int = TXT_READ_BLOCK) -> Iterator[bytes]:
    """Documents of a .txt file (see the module docstring), streamed: memory stays small."""
    sep = TXT_DOC_SEPARATOR
    tail = b""
    with open(path, "rb") as handle:
        while True:
            block = handle.read(block_size)
            final = not block
            buf, pos = tail + block, 0
            while (hit := buf.find(sep, pos)) >= 0:
                yield from _txt_chunks(buf, pos, hit, final=True)
                pos = hit + len(sep)
            # A separator may be starting in the last len(sep) - 1 bytes: cut only before them.
            end = len(buf) if final else max(pos, len(buf) - len(sep) + 1)
            pos = yield from _txt_chunks(buf, pos, end, final=final)
            if final:
                return
            tail = buf[pos:]


def jsonl_documents(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise AutoloopError(f"{path}:{number} is not valid JSON ({_one_line(exc, 80)}): fix or remove that line") from None
            if not isinstance(record, dict) or "text" not in record:
                fields = f" (it has {', '.join(map(str, list(record)[:8]))})" if isinstance(record, dict) else ""
                raise AutoloopError(
                    f"{path}:{number} has no \"text\" field{fields}: each line must be a JSON object with the document in \"text\""
                )
            text = record["text"]
            if not isinstance(text, str):
                raise AutoloopError(f"{path}:{number}: \"text\" is a {type(text).__name__}, not a string: store the document as a string")
            if text:
                yield text.encode("utf-8", errors="surrogatepass")


def _inspect_parquet(path: Path):
    """(open ParquetFile, None), or (None, why it cannot be used) in a few words."""
    pq = _need("pyarrow.parquet", "parquet", "reading .parquet files")
    import pyarrow as pa

    try:
        handle = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        return None, f"not a readable parquet file: {_one_line(exc, 100)}"
    schema = handle.schema_arrow
    index = schema.get_field_index("text")
    if index < 0:
        return None, f"no \"text\" column; columns: {', '.join(schema.names[:8]) or 'none'}"
    kind = schema.field(index).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        return None, f"column \"text\" holds {kind}, not strings"
    return handle, None


def _open_parquet(path: Path):
    handle, problem = _inspect_parquet(path)
    if problem is None:
        return handle
    if problem.startswith("not a readable"):
        raise AutoloopError(f"{path} is {problem.split(': ', 1)[0]} ({problem.split(': ', 1)[1]}): replace it with a complete copy")
    raise AutoloopError(f"{path} has {problem}: put the documents in a string column named text")


def parquet_documents(path: Path) -> Iterator[bytes]:
    handle = _open_parquet(path)
    import pyarrow as pa

    for group in range(handle.num_row_groups):
        try:
            texts = handle.read_row_group(group, columns=["text"]).column(0).to_pylist()
        except (OSError, pa.ArrowException) as exc:
            raise AutoloopError(f"{path} is corrupt (row group {group}: {_one_line(exc, 100)}): replace it with a complete copy") from None
        for text in texts:
            if text:
                yield text.encode("utf-8", errors="surrogatepass")


READERS: dict[str, Callable[[Path], Iterator[bytes]]] = {
    ".txt": txt_documents,
    ".jsonl": jsonl_documents,
    ".parquet": parquet_documents,
}


def _bucket(doc: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(doc, digest_size=4).digest(), "big") % 100


def split_of_document(doc: bytes) -> str:
    """The split of a local document, by a hash of its bytes (see the module docstring)."""
    bucket = _bucket(doc)
    return "val" if bucket in VAL_BUCKETS else "heldout" if bucket in HELDOUT_BUCKETS else "train"


# ---------------------------------------------------------------------- sources


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
            _open_parquet(f)
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
            if not shared or (_bucket(doc) < 50) == (split == "val"):
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


# ---------------------------------------------------------------------- Hub downloads


def _read_manifest(root: Path) -> dict:
    try:
        manifest = json.loads((root / MANIFEST).read_text())
        return manifest if isinstance(manifest, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_manifest(root: Path, manifest: dict) -> None:
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, root / MANIFEST)


@contextlib.contextmanager
def _repo_lock(root: Path, reporter: Reporter):
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no lock, concurrent preparations are the user's call
        yield
        return
    with open(root / ".autoloop.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            reporter.log(f"waiting for another autoloop prepare that is downloading into {root}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def check_download(path: Path, fmt: str, expected_size: int | None) -> str | None:
    """Why a downloaded file is not usable (truncated, corrupt), or None if it is."""
    size = path.stat().st_size
    if expected_size is not None and size != expected_size:
        return f"{size} bytes, expected {expected_size}"
    if fmt == "parquet":
        return _inspect_parquet(path)[1]
    return None


def _hub_failure(exc: BaseException, ds: HubDataset, filename: str, revision: str, root: Path, have: int) -> AutoloopError:
    # huggingface_hub's exception classes differ between its versions (requests before
    # 1.0, httpx after), so they are told apart by name rather than imported.
    names = {cls.__name__ for cls in type(exc).__mro__}
    endpoint = hub_endpoint()
    kept = f"; the {have} file(s) already downloaded are kept in {root}" if have else ""
    if "GatedRepoError" in names:
        return AutoloopError(f"{ds.repo_id} is gated at {endpoint}: accept its terms on its page and log in with `hf auth login`")
    if "RepositoryNotFoundError" in names:
        return AutoloopError(f"dataset repository {ds.repo_id} was not found at {endpoint}: check HF_ENDPOINT, or log in if it is private")
    if "RevisionNotFoundError" in names:
        return AutoloopError(
            f"revision {revision} of {ds.repo_id}, pinned by the first download, no longer exists at {endpoint}: "
            f"delete {root} to start again from the current revision"
        )
    if "EntryNotFoundError" in names and "LocalEntryNotFoundError" not in names:
        return AutoloopError(f"{ds.repo_id} has no file {filename} at {endpoint} (revision {revision[:12]}): prepare fewer shards, or check HF_ENDPOINT{kept}")
    if "OfflineModeIsEnabled" in names:
        return AutoloopError(f"{filename} of {ds.repo_id} is not downloaded yet and HF_HUB_OFFLINE is set: unset it to download{kept}")
    return AutoloopError(
        f"cannot download {filename} of {ds.repo_id} from {endpoint} ({type(exc).__name__}: {_one_line(exc, 160)}): "
        f"check the network connection or HF_ENDPOINT and run again{kept}"
    )


def download(ds: HubDataset, filenames: list[str], reporter: Reporter) -> tuple[dict[str, Path], str]:
    """Make sure the files are complete on local disk; returns their paths and the pinned revision."""
    root = hub_dir() / ds.repo_id
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AutoloopError(f"cannot create the download folder {root} ({exc.strerror}): set {ENV_HUB_DIR} to a writable folder") from None
    names = list(dict.fromkeys(filenames))
    with _repo_lock(root, reporter):
        manifest = _read_manifest(root)
        sizes = manifest.setdefault("sizes", {})
        missing = []
        for name in names:
            path = root / name
            if not path.exists():
                missing.append(name)
                continue
            problem = check_download(path, ds.format, sizes.get(name))
            if problem is not None:
                reporter.log(f"{path} is incomplete or corrupt ({problem}): fetching it again")
                path.unlink()
                missing.append(name)
        have = len(names) - len(missing)
        if missing:
            reporter.log(f"{ds.repo_id}: {have} of {len(names)} files already downloaded in {root}; fetching {len(missing)}")
        else:
            reporter.log(f"{ds.repo_id}: all {len(names)} files already downloaded in {root}")
        for number, name in enumerate(missing, 1):
            if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
                raise AutoloopError(f"{name} of {ds.repo_id} is not downloaded yet and HF_HUB_OFFLINE is set: unset it to download")
            hf = _need("huggingface_hub", "hub", f"downloading {ds.key}")
            revision = manifest.get("revision") or "main"
            endpoint = hub_endpoint()
            try:
                # One quick metadata request first: huggingface_hub's own download retries
                # a refused connection for ~25 s, so "no network" is reported at once here.
                url = hf.hf_hub_url(ds.repo_id, name, repo_type="dataset", revision=revision, endpoint=endpoint)
                meta = hf.get_hf_file_metadata(url, timeout=HUB_METADATA_TIMEOUT)
                if not manifest.get("revision") and meta.commit_hash:
                    manifest.update(repo_id=ds.repo_id, endpoint=endpoint, revision=meta.commit_hash)
                    revision = meta.commit_hash
                    _write_manifest(root, manifest)
                reporter.log(f"[{number}/{len(missing)}] downloading {name} ({format_size(meta.size) if meta.size else 'size unknown'})")
                fetched = Path(
                    hf.hf_hub_download(
                        repo_id=ds.repo_id, filename=name, repo_type="dataset", revision=revision, local_dir=root, endpoint=endpoint
                    )
                )
            except Exception as exc:  # the network boundary: every failure becomes one line
                raise _hub_failure(exc, ds, name, revision, root, have) from None
            if not os.path.samefile(fetched, root / name):  # pragma: no cover - huggingface_hub honours local_dir
                shutil.move(fetched, root / name)
            problem = check_download(root / name, ds.format, meta.size)
            if problem is not None:
                (root / name).unlink()
                raise AutoloopError(
                    f"{name} downloaded from {endpoint} is unusable ({problem}) and was deleted: run again; "
                    "if it fails again the file on the Hub (or HF_ENDPOINT) is at fault"
                )
            sizes[name] = (root / name).stat().st_size
            _write_manifest(root, manifest)
            have += 1
        if "revision" not in manifest:
            # Files placed by hand (or by an older autoloop): nothing pins a revision.
            manifest["revision"] = "unknown"
            _write_manifest(root, manifest)
    return {name: root / name for name in names}, manifest["revision"]


# ---------------------------------------------------------------------- tokenizer


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
    rustbpe = _need("rustbpe", "bpe", "training a BPE tokenizer (or use --tokenizer byte)")
    _need("tiktoken", "bpe", "a BPE tokenizer (or use --tokenizer byte)")
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


def _encoded(tokenizer, docs: Iterable[bytes], advance, threads: int) -> Iterator[bytes | np.ndarray]:
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


# ---------------------------------------------------------------------- preparing


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
    if not _NAME_RE.match(name) or name in (".", ".."):
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
        _need("rustbpe", "bpe", "training a BPE tokenizer (or use --tokenizer byte)")
        _need("tiktoken", "bpe", "a BPE tokenizer (or use --tokenizer byte)")
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
            yield from _encoded(tok, source.documents(split), advance, threads)
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
                    revision=_read_manifest(repo).get("revision"),
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
    if _NAME_RE.match(text):
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
