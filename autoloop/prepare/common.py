"""Constants and helpers every part of a preparation shares: the reporter (messages and live progress), sizes and counts as text, one-line errors, optional packages.

(autoloop.prepare: the rules of a preparation.)
"""

from __future__ import annotations

import contextlib
import importlib
import re
from typing import Callable, Iterator


from autoloop.errors import AutoloopError


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

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


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


def need(module: str, extra: str, purpose: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise AutoloopError(f"{purpose} needs {module}: pip install -e '.[{extra}]' in autoloop's folder") from None


def one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
