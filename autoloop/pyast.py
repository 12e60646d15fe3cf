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
    with _LOCK:
        return ast.parse(source, mode=mode)


def compile_tree(tree: ast.AST, filename: str, mode: str):
    """compile() of an AST object (the same converter, the other way)."""
    with _LOCK:
        return compile(tree, filename, mode)
