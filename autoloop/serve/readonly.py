"""experiments.db opened read-only, as a WAL reader beside a running controller.

The page must never block or slow the controller (the db's only regular writer), so:

* the connection is opened with SQLite's `file:...?mode=ro` URI: it cannot write, cannot
  take the write lock, and never runs migrations (`Store.__init__` would, when the code is
  newer than the db; here a db that lacks a migration is refused in one line instead);
* in WAL mode a reader works on a snapshot: it never blocks the writer and the writer
  never blocks it. Every query runs in autocommit mode and fetches all its rows at once,
  so no read transaction outlives a call (the Store's rule); a read transaction held open
  would stop checkpoints from recycling the WAL;
* `PRAGMA data_version` changes exactly when another connection committed: one cheap
  statement tells whether anything the page shows may have changed, so the page's
  queries run only after a write, not on every poll;
* a short busy timeout (the reader never waits long for anything: in WAL mode it only
  waits while the WAL is being reset).

The class reuses the Store's read methods (`get_run`, `trials`, `best_trial`, ...), so
`autoloop.review.queries`'s functions work on it unchanged; its write methods fail, as a
read-only connection must.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from urllib.parse import quote

from autoloop.errors import AutoloopError
from autoloop.store import MIGRATIONS, Store, sqlite_utils

READ_BUSY_TIMEOUT_SECONDS = 2
TABLES = ("runs", "trials", "ideas", "measurements", "curves", "proposals", "events", "processes")


def _uri(path: Path) -> str:
    return f"file:{quote(str(path.resolve()))}?mode=ro"


class ReadOnlyStore(Store):
    """A Store over a read-only connection (module docstring)."""

    def __init__(self, path: str | Path):  # noqa: D107 - Store.__init__ is not called: it may migrate
        self.path = Path(path)
        self._lock = threading.RLock()
        self._savepoints = 0
        if not self.path.is_file():
            raise AutoloopError(f"no trial database at {self.path}: start a run with `autoloop run`, or point --db at one")
        try:
            self.conn = sqlite3.connect(_uri(self.path), uri=True, timeout=READ_BUSY_TIMEOUT_SECONDS,
                                        isolation_level=None, check_same_thread=False)
        except sqlite3.Error as error:
            raise AutoloopError(f"cannot read {self.path} ({error}): check that --db points at an experiments.db "
                                "you may read") from error
        try:
            # The header is read by SQLite, never by a plain open: closing a descriptor of the db
            # drops this process's POSIX locks on it (autoloop.store._refuse_non_sqlite_file).
            try:
                self.conn.execute("PRAGMA schema_version").fetchone()
            except sqlite3.DatabaseError as error:
                if getattr(error, "sqlite_errorcode", None) in (11, 26) or "not a database" in str(error):
                    raise AutoloopError(f"{self.path} is not an autoloop database (not a SQLite file): point --db "
                                        "at an experiments.db") from None
                raise
            self.conn.execute(f"PRAGMA busy_timeout = {READ_BUSY_TIMEOUT_SECONDS * 1000}")
            self.conn.execute("PRAGMA query_only = ON")
            self.db = sqlite_utils.Database(self.conn, execute_plugins=False)
            self._check_migrations()
            self._columns = {table: [row[1] for row in self.conn.execute(f"PRAGMA table_info({table})")]
                             for table in TABLES}
        except sqlite3.Error as error:
            self.conn.close()
            raise AutoloopError(f"cannot read {self.path} ({error}): check that --db points at an experiments.db "
                                "you may read") from error
        except BaseException:
            self.conn.close()
            raise

    def _check_migrations(self) -> None:
        known = [name for name, _ in MIGRATIONS]
        applied = self.applied_migrations()
        unknown = [name for name in applied if name not in known]
        if unknown:
            raise AutoloopError(f"experiments.db at {self.path} was written by a newer autoloop (unknown migration "
                                f"'{unknown[0]}'): upgrade autoloop")
        if applied != known:
            raise AutoloopError(f"experiments.db at {self.path} is from an older autoloop and `autoloop serve` only "
                                "reads: run `autoloop log` once to upgrade it, then serve again")

    def data_version(self) -> int:
        """A number that changes whenever another connection commits (module docstring)."""
        with self._lock:
            return int(self.conn.execute("PRAGMA data_version").fetchone()[0])

    def transaction(self):  # pragma: no cover - a write attempt is a bug in the page
        raise AutoloopError("autoloop serve reads experiments.db read-only: writes go through the CLI's code")
