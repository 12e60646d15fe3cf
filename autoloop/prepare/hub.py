"""Named Hub datasets and their downloads: whole files, kept, pinned to one revision, locked per repository.

(autoloop.prepare: the rules of a preparation.)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path


from autoloop.errors import AutoloopError
from autoloop.harness.contract import cache_root
from autoloop.prepare.common import DEFAULT_HUB_ENDPOINT, ENV_HUB_DIR, HUB_METADATA_TIMEOUT, MANIFEST, Reporter, format_size, need, one_line
from autoloop.prepare.documents import inspect_parquet


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


# ---------------------------------------------------------------------- Hub downloads


def read_manifest(root: Path) -> dict:
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
        return inspect_parquet(path)[1]
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
        f"cannot download {filename} of {ds.repo_id} from {endpoint} ({type(exc).__name__}: {one_line(exc, 160)}): "
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
        manifest = read_manifest(root)
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
            hf = need("huggingface_hub", "hub", f"downloading {ds.key}")
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
