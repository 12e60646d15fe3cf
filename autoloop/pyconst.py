"""Read and edit the UPPER_CASE constants at the top level of a Python source file.

Constants are found with `ast`, and edited in the source *text* (only the value's span
is replaced), so comments and formatting survive and a one-constant change is a
one-line diff.

The source is a trial's, so its arithmetic is never handed to `eval` (nor to
`ast.literal_eval`): `8 + 0*(3**3**15)` took the controller 15 s per read, `9**9**9`
hours. `evaluate` walks the tree itself, over a small grammar (numbers, strings, bools,
None, tuples, lists, sets, dicts, unary and binary arithmetic; no names, no calls), and
checks what an operation would cost *before* it runs it: the tree's size and depth, the
bits of every integer (a power's exponent times its base's bits, a shift's count), the
length of every string and sequence (a repetition's count times its length). Over a cap
the expression is `Unreadable`, with the cap named, and a constant's value is None: a
number autoloop cannot read, never a stall and never an exception out of the reader.
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
    value: object  # the value (see `evaluate`), or None when it is not one autoloop evaluates
    source: str  # the value's source text, e.g. "2**19" or "0.04"
    lineno: int  # 1-based line of the assignment
    col: int  # value span on that line
    end_col: int
    comment: str  # the trailing comment on that line, without '#'
    unreadable: str = ""  # the cap that kept `value` None (see `evaluate`), "" otherwise


# Caps far above any real constant (train.py's largest is 2**30; a one-line tuple has a
# few dozen items) and far below a noticeable cost: the worst expression within them
# evaluates in milliseconds.
MAX_NODES = 1_000  # AST nodes in one expression
MAX_DEPTH = 40  # nesting of the tree (the evaluator recurses once per level)
MAX_INT_BITS = 4_096  # bits of any integer, intermediate ones included
MAX_SIZE = 100_000  # characters and items of a value, nested ones counted (a repr of that order)
MAX_TEXT = 10_000  # characters of an expression's source text


class Unreadable(ValueError):
    """An expression autoloop does not evaluate: outside the grammar, or one that fails (1/0)."""


class OverCap(Unreadable):
    """An expression whose evaluation would pass a cap: refused before it is computed."""


def evaluate(node: ast.AST):
    """The value of a constant expression, computed within the caps (module docstring);
    raises Unreadable, and nothing else, for anything outside them."""
    check_shape(node)
    try:
        return _eval(node)[0]
    except Unreadable:
        raise
    except (ArithmeticError, TypeError, ValueError, MemoryError, RecursionError) as exc:
        raise Unreadable(f"it fails to evaluate ({type(exc).__name__}: {exc})") from None


def evaluate_text(text: str):
    """`evaluate` of an expression's source text (a hint's number, a `--set` value)."""
    return evaluate(parse_expression(text))


def parse_expression(text: str) -> ast.expr:
    """The tree of one expression's text; Unreadable when it is too long or does not parse."""
    if len(text) > MAX_TEXT:
        raise OverCap(f"its text is {len(text):,} characters (more than {MAX_TEXT:,})")
    try:
        return pyast.parse(text.strip(" \t"), mode="eval").body
    except SyntaxError as exc:
        raise Unreadable(f"it is not a Python expression ({exc.msg})") from None
    except ValueError as exc:  # null bytes
        raise Unreadable(f"it is not a Python expression ({exc})") from None


def literal(node: ast.expr):
    """`evaluate`, or None for an expression it does not evaluate."""
    try:
        return evaluate(node)
    except Unreadable:
        return None


def check_shape(root: ast.AST) -> None:
    """Count the nodes and measure the depth without recursion, stopping at the caps
    (OverCap): before anything walks a trial's expression recursively."""
    stack, count = [(root, 1)], 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise OverCap(f"the expression has more than {MAX_NODES:,} nodes")
        if depth > MAX_DEPTH:
            raise OverCap(f"the expression is nested more than {MAX_DEPTH} deep")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def _size(value) -> int:
    """A value's weight against MAX_SIZE, for a leaf: about the characters of its repr."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 3 + 1  # decimal digits, at most
    return 1


def _sized(value, size: int) -> tuple[object, int]:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise OverCap(f"an integer of {value.bit_length():,} bits (more than {MAX_INT_BITS:,})")
    return value, _within(size)


_NUMBER = (int, float, complex)
_LEAF = (int, float, complex, str, bytes, type(None))
_UNARY = {ast.UAdd: lambda a: +a, ast.USub: lambda a: -a, ast.Invert: lambda a: ~a, ast.Not: lambda a: not a}
_BINARY = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a ** b, ast.LShift: lambda a, b: a << b, ast.RShift: lambda a, b: a >> b,
    ast.BitAnd: lambda a, b: a & b, ast.BitOr: lambda a, b: a | b, ast.BitXor: lambda a, b: a ^ b,
}


def _eval(node: ast.AST) -> tuple[object, int]:
    """(value, size); recursion is bounded by MAX_DEPTH, checked before."""
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if not isinstance(node.value, _LEAF):
            raise Unreadable(f"{type(node.value).__name__} is not a constant autoloop reads")
        return _sized(node.value, _size(node.value))
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [_eval(e) for e in node.elts]  # a Starred element is refused by _eval
        value = [v for v, _ in items]
        value = tuple(value) if isinstance(node, ast.Tuple) else set(value) if isinstance(node, ast.Set) else value
        return _sized(value, 1 + sum(s for _, s in items))
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise Unreadable("a ** in a dict is not evaluated")
        keys, values = [_eval(k) for k in node.keys], [_eval(v) for v in node.values]
        return _sized(dict(zip((k for k, _ in keys), (v for v, _ in values))), 1 + sum(s for _, s in keys + values))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        operand, size = _eval(node.operand)
        if not isinstance(operand, _NUMBER):
            raise Unreadable(f"a unary {type(node.op).__name__} of a {type(operand).__name__} is not evaluated")
        value = _UNARY[type(node.op)](operand)
        return _sized(value, _size(value))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        (a, size_a), (b, size_b) = _eval(node.left), _eval(node.right)
        size = _cost(type(node.op), a, b, size_a, size_b)
        value = _BINARY[type(node.op)](a, b)
        return _sized(value, size if size is not None else _size(value))
    what = type(node).__name__
    if isinstance(node, ast.Name):
        what = f"the name {node.id}"
    elif isinstance(node, (ast.BinOp, ast.UnaryOp)):
        what = f"the operator {type(node.op).__name__}"
    raise Unreadable(f"{what} is not evaluated (numbers, strings, tuples, lists and arithmetic only)")


def _cost(op: type, a, b, size_a: int, size_b: int) -> int | None:
    """Refuse an operation whose result would pass a cap, before it runs. Returns the
    result's size for sequences (None for numbers, measured after)."""
    ints = isinstance(a, int) and isinstance(b, int)
    if ints:
        bits_a, bits_b = abs(a).bit_length(), abs(b).bit_length()
        if op is ast.Mult and bits_a + bits_b > MAX_INT_BITS + 1:
            raise OverCap(f"a product of {bits_a + bits_b:,} bits (more than {MAX_INT_BITS:,})")
        # |a|**b has b*log2|a| bits, and log2|a| >= bits_a - 1: over the cap, never computed.
        if op is ast.Pow and b > 0 and abs(a) > 1 and b * (bits_a - 1 or 1) > MAX_INT_BITS:
            raise OverCap(f"a power {a if bits_a < 64 else '(a big integer)'}**{b if bits_b < 64 else '(a big integer)'} "
                             f"of more than {MAX_INT_BITS:,} bits")
        if op is ast.LShift and a and b > 0 and bits_a + b > MAX_INT_BITS:
            raise OverCap(f"a shift to more than {MAX_INT_BITS:,} bits")
        return None
    if isinstance(a, _NUMBER) and isinstance(b, _NUMBER):
        return None  # a float or a complex: constant time, overflow raises
    sequences = (str, bytes, tuple, list)
    if op is ast.Add and isinstance(a, sequences) and type(a) is type(b):
        return _within(size_a + size_b)
    if op is ast.Mult and (isinstance(a, sequences) and isinstance(b, int) or isinstance(b, sequences) and isinstance(a, int)):
        seq, count, size = (a, b, size_a) if isinstance(a, sequences) else (b, a, size_b)
        count = max(int(count), 0)
        inner = size if isinstance(seq, (str, bytes)) else size - 1
        return _within(inner * count + (0 if isinstance(seq, (str, bytes)) else 1))
    raise Unreadable(f"{type(a).__name__} {op.__name__} {type(b).__name__} is not evaluated")


def _within(size: int) -> int:
    if size > MAX_SIZE:
        raise OverCap(f"a value of {size:,} characters or items (more than {MAX_SIZE:,})")
    return size


# What a GPU's kernel driver puts on a machine (NVIDIA, ROCm, WSL's bridge): without any of
# them no CUDA device can be available, whatever torch is installed.
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def gpu_driver_present(paths: tuple[str, ...] = GPU_DRIVER_PATHS) -> bool:
    return any(os.path.exists(p) for p in paths)


def current_device() -> str:
    """The device type train.py will pick on this machine ("cuda" or "cpu"), as it does."""
    override = os.environ.get("AUTOLOOP_DEVICE_TYPE")
    if override:
        return override
    if not gpu_driver_present():  # torch would say "cpu" too, after 2.6 s of importing itself
        return "cpu"
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
            try:
                number, unreadable = evaluate(value), ""
            except OverCap as exc:
                number, unreadable = None, str(exc)
            except Unreadable:  # outside the grammar (a name, a call): not a literal, as ever
                number, unreadable = None, ""
            found[target.id] = Constant(
                name=target.id,
                value=number,
                source=line[value.col_offset : value.end_col_offset].decode(),
                lineno=value.lineno,
                col=len(line[: value.col_offset].decode()),
                end_col=len(line[: value.end_col_offset].decode()),
                comment=comment,
                unreadable=unreadable,
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
    """A `--set NAME=VALUE` value: a Python literal, else the expression text itself.

    Evaluated only within `evaluate`'s caps: an expression over them (or one of other
    constants' names) stays text for train.py to evaluate, in its sandbox."""
    try:
        node = parse_expression(text)
    except Unreadable as exc:
        raise AutoloopError(f"{text[:80]!r} is not a Python value or expression ({exc}): quote it as a literal, "
                            "e.g. NAME=0.02 or NAME='adamw'") from None
    if not _is_literal(node):
        return Expression(text)  # arithmetic stays as typed: `2**18` is written as 2**18
    try:
        return evaluate(node)
    except Unreadable:
        return Expression(text)


_LITERAL_NODES = (ast.Constant, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.UnaryOp, ast.BinOp,
                  ast.expr_context, ast.UAdd, ast.USub, ast.Add, ast.Sub)


def _is_literal(node: ast.expr) -> bool:
    """What ast.literal_eval accepts: literals, a sign, and `1+2j`, the one sum a literal is written with."""
    for n in ast.walk(node):
        if not isinstance(n, _LITERAL_NODES):
            return False
        if isinstance(n, ast.BinOp) and not (isinstance(n.op, (ast.Add, ast.Sub)) and isinstance(n.right, ast.Constant)
                                             and isinstance(n.right.value, complex)):
            return False
    return True


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
