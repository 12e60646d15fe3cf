"""The secret key the embedded corpus is generated from (autoloop/harness/synthetic.py).

Everything random in the embedded corpus, the language's parameters and every document,
comes from this key, so the generator's code (which a proposal has read) and the training
text it is shown do not let it rebuild `val` or `heldout`: only learning the language does.
The key is the only copy of that secret:

* it lives in `<cache_root>/secret/corpus.key`, 32 bytes from os.urandom, mode 0600 in a
  folder of mode 0700, and no sandbox sees the cache folder;
* it is made on first use, atomically: written whole under a temporary name, then
  hard-linked into place, so a second process that races the first reads the first
  one's key instead of making its own, and nobody ever reads half a key;
* it is never put into an environment, an argument or a log: only its digest
  (`key_id`, a one-way hash under its own label) goes into the dataset's meta.json,
  so a dataset generated from another key has another fingerprint.

Deleting the key makes the next preparation of the embedded corpus a different corpus
(a different fingerprint): a run's database then refuses it, as for any changed dataset.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path

from autoloop.harness.contract import cache_root
from autoloop.harness.errors import HarnessError

KEY_BYTES = 32
KEY_FOLDER = "secret"
KEY_FILE = "corpus.key"


def corpus_key_path(root: Path | str | None = None) -> Path:
    """Where the key lives: `<root>/secret/corpus.key`, `root` the cache folder by default."""
    return Path(root if root is not None else cache_root()) / KEY_FOLDER / KEY_FILE


def corpus_key(root: Path | str | None = None, *, create: bool = True) -> bytes:
    """The corpus key, made on first use when `create` (see the module's docstring)."""
    path = corpus_key_path(root)
    try:
        return _read(path)
    except FileNotFoundError:
        if not create:
            raise HarnessError(f"no corpus key at {path}: prepare the embedded corpus once (it makes the key)") from None
    _create(path)
    return _read(path)


def key_id(key: bytes) -> str:
    """A name for the key that may be published (meta.json, fingerprints): a labelled
    sha256, so it says nothing of the key nor of the seeds derived from it."""
    return hashlib.sha256(b"autoloop corpus key id\0" + key).hexdigest()


def write_key(path: Path | str, key: bytes) -> Path:
    """Put a given key in place (tests use a fixed one so that their corpus never changes)."""
    if len(key) != KEY_BYTES:
        raise HarnessError(f"a corpus key has {KEY_BYTES} bytes, not {len(key)}: give {KEY_BYTES} bytes")
    path = Path(path)
    _make_folder(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, key)
    finally:
        os.close(fd)
    return path


def _make_folder(folder: Path) -> None:
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise HarnessError(
            f"cannot write the data cache at {folder} ({exc.strerror}), where the corpus key goes: "
            "set AUTOLOOP_CACHE_DIR to a writable folder"
        ) from None


def _create(path: Path) -> None:
    _make_folder(path.parent)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{KEY_FILE}.", dir=path.parent)  # mode 0600
    except OSError as exc:
        raise HarnessError(f"cannot write the data cache at {path.parent} ({exc.strerror}), where the corpus key "
                           "goes: set AUTOLOOP_CACHE_DIR to a writable folder") from None
    try:
        try:
            os.write(fd, os.urandom(KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if another process put its key there first: theirs stands
        except FileExistsError:
            pass
        except OSError as exc:
            raise HarnessError(
                f"cannot put the corpus key at {path} ({exc.strerror}; its file system needs hard links): "
                "set AUTOLOOP_CACHE_DIR to a folder on a local disk"
            ) from None
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def _read(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
            raise FileNotFoundError(path) from None  # no key yet (or no cache folder): make one
        raise HarnessError(f"cannot read the corpus key {path} ({exc.strerror}): it must be a regular file "
                           "of yours; delete it to make a new key (a new corpus)") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise HarnessError(f"the corpus key {path} is not a regular file: delete it to make a new key (a new corpus)")
        if info.st_mode & 0o077:
            raise HarnessError(f"the corpus key {path} can be read by others (mode {stat.S_IMODE(info.st_mode):04o}): "
                               f"run `chmod 600 {path}`")
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise HarnessError(f"the corpus key {path} has {len(key)} bytes, not {KEY_BYTES}: "
                           "delete it to make a new key (a new corpus)")
    return key
