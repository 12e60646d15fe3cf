"""Which autoloop a child imports: the one this process runs, whatever the interpreter's default.

The controller may run an autoloop that is not the one its interpreter would import on its
own: a second checkout put first on the import path (bench/night.py from a clone), or a
checkout run beside an installed copy. Every child that imports the harness (training, the
evaluator, a worker, the trusted bytecode warm-up) gets `trusted_python_path` as its
PYTHONPATH, so it imports the package this process measures and fingerprints. The root is a
folder holding nothing but a link named `autoloop`, so no project folder or trial file can
be imported through it under a familiar name; a sandbox shows it read-only, and the link's
target, the package, is shown anyway (autoloop.measure.sandbox.interpreter_paths).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any, Mapping


def trusted_import_root(cache: Path | str | None = None) -> Path:
    """A folder holding only `autoloop` (a link to the package this process runs), under the
    cache folder (default: autoloop.harness.contract.cache_root)."""
    import autoloop

    package = Path(autoloop.__file__).resolve().parent
    if cache is None:
        from autoloop.harness.contract import cache_root

        cache = cache_root()
    root = Path(cache) / "pylib" / hashlib.sha256(str(package).encode()).hexdigest()[:12]
    link = root / "autoloop"
    if not (link.is_symlink() and Path(os.readlink(link)) == package):
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".autoloop.{os.getpid()}.{threading.get_ident()}"
        tmp.unlink(missing_ok=True)
        os.symlink(package, tmp)
        os.replace(tmp, link)
    return root


def trusted_python_path(env: Mapping[str, Any], cache: Path | str | None = None) -> str:
    """PYTHONPATH for a child: autoloop's own root first, then the user's (`env`'s, else
    ours), without the root a second time (a worker's children inherit it)."""
    root = str(trusted_import_root(cache))
    given = env.get("PYTHONPATH") or os.environ.get("PYTHONPATH") or ""
    rest = [p for p in str(given).split(os.pathsep) if p and p != root]
    return os.pathsep.join([root, *rest])
