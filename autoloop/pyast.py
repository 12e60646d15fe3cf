"""`ast.parse` that threads may call at once.

CPython before 3.12.x/3.13 keeps the AST converter's recursion depth in shared state, so
two threads parsing at the same moment can fail with "SystemError: AST constructor
recursion depth mismatch" (CPython issue 106905). With several workers the controller
materialises a proposal in one trial's thread while the scheduler, the prefetcher or
another trial parses in theirs, so every parse in autoloop takes this lock.
"""

from __future__ import annotations

import ast
import threading

_LOCK = threading.Lock()


def parse(source, mode: str = "exec") -> ast.AST:
    """ast.parse; a source nested too deep for CPython's parser (`1+1+...` 10,000 times,
    `-` 100,000 times) raises SyntaxError like any other source that does not parse,
    not RecursionError or MemoryError, which callers reading a trial's file do not expect."""
    with _LOCK:
        try:
            return ast.parse(source, mode=mode)
        except (RecursionError, MemoryError) as exc:
            raise SyntaxError(f"too deeply nested to parse ({type(exc).__name__})") from None
