"""Read and edit the UPPER_CASE constants at the top level of a Python source file.

Constants are found with `ast`, and edited in the source *text* (only the value's span
is replaced), so comments and formatting survive and a one-constant change is a
one-line diff.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass

from autoloop.errors import AutoloopError
from autoloop import pyast

_CONSTANT_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")


@dataclass(frozen=True)
class Constant:
    name: str
    value: object  # the literal value, or None when the expression is not a literal
    source: str  # the value's source text, e.g. "2**19" or "0.04"
    lineno: int  # 1-based line of the assignment
    col: int  # value span on that line
    end_col: int
    comment: str  # the trailing comment on that line, without '#'


def literal(node: ast.expr):
    """The value of a constant's expression: a literal, or simple arithmetic of literals (None if neither)."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    # Simple arithmetic of literals (2**19, 3e-4 * 2) is common for constants.
    try:
        expr = ast.Expression(body=node)
        ast.fix_missing_locations(expr)
        if all(isinstance(n, (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.operator, ast.unaryop)) for n in ast.walk(expr)):
            return eval(pyast.compile_tree(expr, "<constant>", "eval"), {"__builtins__": {}})
    except Exception:
        pass
    return None


def current_device() -> str:
    """The device type train.py will pick on this machine ("cuda" or "cpu"), as it does."""
    override = os.environ.get("AUTOLOOP_DEVICE_TYPE")
    if override:
        return override
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_branch(node: ast.stmt, device: str) -> list[ast.stmt] | None:
    """The statements that run on `device` if `node` is `if DEVICE_TYPE == "...":` (or
    `!=`) at module level; None for any other statement."""
    if not isinstance(node, ast.If):
        return None
    test = node.test
    if not (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "DEVICE_TYPE"
            and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Eq, ast.NotEq))
            and isinstance(test.comparators[0], ast.Constant) and isinstance(test.comparators[0].value, str)):
        return None
    applies = (test.comparators[0].value == device) == isinstance(test.ops[0], ast.Eq)
    return node.body if applies else node.orelse


def read_constants(source: str, device: str | None = None) -> dict[str, Constant]:
    """The effective module-level `NAME = value` assignments whose value fits on one line.

    A device block (`if DEVICE_TYPE == "cpu": DEPTH = 2`) overrides the top-level value
    on that device, so on a CPU the constant *is* the assignment in the block: that is
    the line an edit must change to have an effect. Its hint comment falls back to the
    top-level one. `device` defaults to the device train.py picks on this machine.
    """
    tree = pyast.parse(source)
    lines = source.splitlines()
    found: dict[str, Constant] = {}
    device = device or current_device()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            branch = device_branch(node, device)
            if branch is not None:
                visit(branch)
                continue
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                target, value = node.target, node.value
            else:
                continue
            if not (isinstance(target, ast.Name) and _CONSTANT_NAME.match(target.id)):
                continue
            if value.lineno != value.end_lineno:
                continue
            # ast offsets count UTF-8 bytes, not characters.
            line = lines[value.lineno - 1].encode()
            after = line[value.end_col_offset :].decode()
            comment = after.split("#", 1)[1].strip() if "#" in after else ""
            earlier = found.get(target.id)
            if earlier is not None and earlier.comment:
                comment = "; ".join(part for part in (comment, earlier.comment) if part)
            found[target.id] = Constant(
                name=target.id,
                value=literal(value),
                source=line[value.col_offset : value.end_col_offset].decode(),
                lineno=value.lineno,
                col=len(line[: value.col_offset].decode()),
                end_col=len(line[: value.end_col_offset].decode()),
                comment=comment,
            )

    visit(tree.body)
    return found


class Expression(str):
    """Source text of a non-literal value (e.g. "2**18"), written into the file as is."""


def format_value(value) -> str:
    """Source text for a value: repr for literals, raw text kept for expressions."""
    if isinstance(value, Expression):
        return str(value)
    if isinstance(value, float):
        text = repr(value)
        return text if "e" in text or len(text) < 12 else f"{value:.6g}"
    return repr(value)


def parse_value(text: str):
    """A `--set NAME=VALUE` value: a Python literal, else the expression text itself."""
    try:
        return ast.literal_eval(pyast.parse(text.lstrip(" \t"), mode="eval"))
    except (ValueError, SyntaxError):
        try:
            pyast.parse(text, mode="eval")
        except SyntaxError:
            raise AutoloopError(f"{text!r} is not a Python value or expression: quote it as a literal, e.g. NAME=0.02 or NAME='adamw'") from None
        return Expression(text)


def set_constants(source: str, values: dict[str, object], *, path: str = "train.py", device: str | None = None) -> str:
    """Return `source` with the named constants' effective values replaced in place."""
    constants = read_constants(source, device)
    unknown = [name for name in values if name not in constants]
    if unknown:
        known = ", ".join(sorted(constants)) or "none"
        raise AutoloopError(f"{path} has no constant {unknown[0]}: use one of its UPPER_CASE constants ({known})")
    lines = source.splitlines(keepends=True)
    # Right to left on each line, so earlier spans stay valid.
    for name in sorted(values, key=lambda n: (constants[n].lineno, -constants[n].col)):
        const = constants[name]
        line = lines[const.lineno - 1]
        lines[const.lineno - 1] = line[: const.col] + format_value(values[name]) + line[const.end_col :]
    return "".join(lines)
