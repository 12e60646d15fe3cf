"""The controller's dataset on a Ray node: found in its cache, or prepared there from the
recipe in the controller's meta.json (as `autoloop prepare` does), and its fingerprint
checked, so a node never measures on other data (autoloop.measure.executors.ray)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from autoloop.errors import AutoloopError

def one_line(text: Any, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def dataset_spec(job) -> dict:
    """What a node needs to find or prepare the controller's dataset (controller side):
    its name, its preparation recipe (from the controller's meta.json), its fingerprint."""
    from autoloop.harness.contract import embedded_dataset_name

    data_dir = Path(job.data_dir) if getattr(job, "data_dir", None) else None
    meta: dict = {}
    if data_dir is not None:
        try:
            meta = json.loads((data_dir / "meta.json").read_text())
        except (OSError, ValueError):
            meta = {}
    name = meta.get("name") or (data_dir.name if data_dir is not None else None) or embedded_dataset_name()
    return {
        "name": name,
        "dataset": getattr(job, "dataset", None),
        "recipe": meta.get("recipe"),
        "fingerprint": getattr(job, "data_fingerprint", None) or meta.get("fingerprint"),
        "controller_dir": str(data_dir) if data_dir is not None else None,
        "embedded": name == embedded_dataset_name() and not meta.get("recipe"),
    }


def prepare_command(spec: dict) -> str:
    recipe = spec.get("recipe") or {}
    source = recipe.get("source") or {}
    if source.get("kind") == "hub":
        from autoloop.prepare import find_hub_dataset

        hub = find_hub_dataset(source.get("repo_id", ""))
        shards = len((source.get("files") or {}).get("train") or [])
        what = f"{hub.key if hub else source.get('repo_id')} --shards {shards}"
    elif source.get("kind") == "local":
        what = source.get("path")
    else:
        what = "NAME_OR_PATH"
    tok = recipe.get("tokenizer", "bpe")
    vocab = f" --vocab-size {recipe['vocab_size']}" if tok == "bpe" and recipe.get("vocab_size") else ""
    return f"autoloop prepare --dataset {what} --tokenizer {tok}{vocab} --name {spec['name']} --force"


def _prepare_on_node(spec: dict, path: Path) -> str | None:
    """Prepare the controller's dataset into the node's cache as `path`, from the recipe in
    the controller's meta.json (autoloop.prepare.prepare_dataset, the code of `autoloop
    prepare`). Returns why it cannot, or None. The embedded corpus is generated from the
    node's own key (autoloop/harness/corpus_key.py): the same corpus only where the
    controller's key was copied; the fingerprint check after says so otherwise."""
    name = spec["name"]
    if spec.get("embedded"):
        from autoloop.harness.data import prepare_embedded

        prepare_embedded(path)
        return None
    recipe = spec.get("recipe") or {}
    source = recipe.get("source") or {}
    from autoloop.prepare import prepare_dataset

    tokenizer = recipe.get("tokenizer", "bpe")
    options: dict = {"tokenizer": tokenizer, "name": name}
    if tokenizer == "bpe":
        options["vocab_size"] = recipe.get("vocab_size")
        if recipe.get("sample_chars"):
            options["sample_chars"] = recipe["sample_chars"]
    if source.get("kind") == "hub":
        from autoloop.prepare import MANIFEST, find_hub_dataset, hub_dir

        hub = find_hub_dataset(source.get("repo_id", ""))
        if hub is None:
            return f"the controller's dataset {name} comes from {source.get('repo_id')}, which this node's autoloop does not know"
        revision = source.get("revision")
        root = hub_dir() / hub.repo_id
        if revision and revision != "unknown" and not (root / MANIFEST).exists():
            # Download the revision the controller's data came from, not today's.
            root.mkdir(parents=True, exist_ok=True)
            (root / MANIFEST).write_text(json.dumps({"repo_id": hub.repo_id, "revision": revision}))
        prepare_dataset(hub.key, shards=len((source.get("files") or {}).get("train") or []) or None, **options)
        return None
    if source.get("kind") == "local":
        where = Path(source.get("path", ""))
        if not where.exists():
            return (f"the controller's dataset {name} was prepared from {where}, which this node does not have: "
                    f"copy the files there, or prepare the same data on the node with `{prepare_command(spec)}`")
        prepare_dataset(str(where), **options)
        return None
    return (f"the controller's dataset {name} has no preparation recipe in its meta.json (prepared by hand or by an "
            f"older autoloop), so this node cannot prepare it: copy {spec.get('controller_dir')} to {path}")


def _node_lock(path: Path):
    import contextlib
    import fcntl

    @contextlib.contextmanager
    def lock():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / f".{path.name}.ray-lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    return lock()


def _fingerprint_of(path: Path) -> str | None:
    try:
        return json.loads((path / "meta.json").read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def ensure_node_dataset(spec: dict, verified: set | None = None) -> tuple[Path | None, str | None]:
    """The node's copy of the controller's dataset: `(path, None)`, or `(None, why not)`.

    Looked up by name in the node's cache (`cache_root()/data/<name>`, as `autoloop
    prepare` writes it). If absent there, the controller's own folder is used when the
    node sees it with the same fingerprint (a shared file system, or the controller's
    machine); else the dataset is prepared into the node's cache from the recipe in the
    controller's meta.json, as `autoloop prepare` does (the embedded corpus: as on first use).
    The node's fingerprint must be the controller's: a node never measures on other data.
    Its split files are re-hashed once per process (`verified` remembers which).
    """
    from autoloop.harness.data import load_dataset, verify_dataset
    from autoloop.harness.errors import HarnessError
    from autoloop.prepare import prepared_root

    name, wanted = spec["name"], spec.get("fingerprint")
    host = socket.gethostname()
    path = prepared_root() / name
    shared = Path(spec["controller_dir"]) if spec.get("controller_dir") else None
    with _node_lock(path):
        if not (path / "meta.json").exists():
            if shared is not None and shared != path and _fingerprint_of(shared) == wanted and wanted:
                path = shared  # the controller's own folder, seen through a shared file system
            else:
                try:
                    problem = _prepare_on_node(spec, path)
                except (AutoloopError, HarnessError) as exc:
                    problem = f"preparing it failed: {one_line(exc)}"
                if problem:
                    return None, f"the dataset {name} is not on node {host}: {problem}"
        try:
            ds = load_dataset(path, prepare=False)
        except HarnessError as exc:
            return None, f"the dataset {name} on node {host} cannot be read: {one_line(exc)}"
        if wanted and ds.fingerprint != wanted:
            if spec.get("embedded"):
                from autoloop.harness.corpus_key import corpus_key_path

                fix = (f"the embedded corpus is generated from the key in the cache folder, so copy the controller's "
                       f"key to {corpus_key_path()} on the node (mode 0600) and remove {path} there, "
                       "or use a prepared dataset (autoloop prepare)")
            else:
                fix = (f"prepare the controller's data on the node (`{prepare_command(spec)}`) or remove {path} "
                       "there so that it is prepared again")
            return None, (
                f"data fingerprint mismatch on node {host}: its {name} ({path}) has fingerprint {ds.fingerprint[:16]}, "
                f"the controller's has {wanted[:16]}; no measurement on other data: {fix}"
            )
        key = (str(path), ds.fingerprint)
        if verified is not None and key not in verified:
            changed = verify_dataset(ds)
            if changed:
                return None, (f"the dataset {name} on node {host} ({path}) is damaged: its {', '.join(changed)} split(s) "
                              f"no longer match meta.json; remove {path} there so that it is prepared again")
            verified.add(key)
    return path, None


