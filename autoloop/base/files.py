"""Copying a folder that someone else may have filled: its folders and regular files only.

A trusted cache is copied in and out of places a trial could have written (a run's
compile cache, a bytecode prefix): a link planted there must not make the copy read or
write a file elsewhere, and a reader beside the copy (another worker, another project)
must never see half a file. So links and anything but a regular file are passed over,
and each file is written whole beside its target and renamed into place.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Container
from pathlib import Path


def copy_regular_files(source: Path, dest: Path, *, skip: Container[str] = ()) -> None:
    """Copy `source`'s folders and regular files (never a link, never a name in `skip`)
    into `dest`, each file renamed into place whole. Raises OSError on the first failure,
    a folder that cannot be listed included."""

    def fail(error: OSError) -> None:
        raise error

    for folder, _dirs, files in os.walk(source, onerror=fail, followlinks=False):
        target = dest / Path(folder).relative_to(source)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            path = Path(folder) / name
            if name in skip or path.is_symlink() or not path.is_file():
                continue
            partial = target / f".{name}.{os.getpid()}"
            shutil.copyfile(path, partial)
            os.replace(partial, target / name)
