"""train.py's invariants: its own `assert`s over its constants, checked without running it.

`--set N_KV_HEAD=3` next to N_HEAD=4 used to be seeded, trained at night and end as a bare
"AssertionError". The rule it broke is in train.py already, as an assert; this module
reads those asserts so that seeding and the built-in search refuse such a value at once,
in one line naming the assert, and no table of rules has to follow train.py's changes.

An assert is an invariant of the constants when every leaf of its test is a literal, a
module-level constant (`N_HEAD`), or a config lookup whose key the file's dict literals
map to one constant (`cfg["n_head"]`, where `model_config` returns `{"n_head": N_HEAD}`).
Anything else in the test (a local variable, an attribute, a call, a key mapped to two
constants or to an expression) depends on the run, and the assert is left alone.

The source is a trial's: it is parsed, never run. A test is evaluated by pyconst's bounded
evaluator (arithmetic within its caps), plus comparisons, `and`, `or` and `not` here; a
test that evaluator does not read is left alone, never an error.
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass

from autoloop import pyast
from autoloop.pyconst import Expression, Unreadable, check_shape, evaluate, evaluate_text, read_constants

_COMPARE = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge,
}
_ALLOWED = (ast.Constant, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.operator, ast.unaryop, ast.boolop,
            ast.cmpop, ast.expr_context)
_MIXED = object()  # a dict key mapped to two constants, or to an expression


@dataclass(frozen=True)
class Invariant:
    """One assert over constants: its line, and its test with config lookups written as
    the constants they hold (`MODEL_DIM % N_HEAD == 0`)."""

    lineno: int
    test: ast.expr

    @property
    def text(self) -> str:
        return ast.unparse(self.test)


@dataclass(frozen=True)
class Broken:
    """An invariant that does not hold: the false clause and the values it read."""

    invariant: Invariant
    clause: ast.expr
    values: dict[str, object]

    def describe(self, path: str = "train.py") -> str:
        clause = ast.unparse(self.clause)
        shown = ", ".join(f"{name}={value!r}" for name, value in self.values.items())
        why = _in_words(self.clause)
        return (f"{path} line {self.invariant.lineno} asserts {clause}" + (f" ({why})" if why else "")
                + f", and with {shown} it does not hold")


def invariants(source: str) -> list[Invariant]:
    """The asserts of `source` over its constants (module docstring), in file order."""
    tree = pyast.parse(source)
    constants = set(read_constants(source))
    keys = _config_keys(tree, constants)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            test = _in_constants(node.test, constants, keys)
            if test is not None:
                found.append(Invariant(node.lineno, test))
    return sorted(found, key=lambda inv: inv.lineno)


def check(rules: list[Invariant], values: dict[str, object]) -> list[Broken]:
    """The invariants in `rules` that the constants' `values` break. The search reads a
    parent's invariants once and checks each move's values here, without a parse."""
    out = []
    for invariant in rules:
        clause = _false_clause(invariant.test, values)
        if clause is not None:
            out.append(Broken(invariant, clause, {n: values[n] for n in _names_in_order(clause)}))
    return out


def broken(source: str) -> list[Broken]:
    """The invariants of `source` that its own constants break."""
    return check(invariants(source), {name: c.value for name, c in read_constants(source).items()})


def broken_by(old: str, new: str) -> list[Broken]:
    """What an edit from `old` to `new` breaks: the invariants `new` breaks that `old` did
    not (an idea is not blamed for a rule its base already broke)."""
    try:
        before = {b.invariant.text for b in broken(old)}
    except SyntaxError:
        before = set()
    return [b for b in broken(new) if b.invariant.text not in before]


def _names_in_order(clause: ast.expr) -> list[str]:
    """The constants a clause reads, in the order it reads them (N_HEAD before N_KV_HEAD)."""
    names: list[str] = []
    for node in sorted((n for n in ast.walk(clause) if isinstance(n, ast.Name)), key=lambda n: (n.lineno, n.col_offset)):
        if node.id not in names:
            names.append(node.id)
    return names


class Guard:
    """One parent file's invariants, read once, for checking many edits of its constants
    (the search tries dozens of moves on one parent): `breaks(sets)` parses nothing."""

    def __init__(self, source: str):
        try:
            self.rules = invariants(source)
            self.values = {name: c.value for name, c in read_constants(source).items()}
        except SyntaxError:
            self.rules, self.values = [], {}
        self.before = {b.invariant.text for b in check(self.rules, self.values)}

    def breaks(self, sets: dict[str, object]) -> list[Broken]:
        """What setting the constants to `sets` (values, or pyconst Expressions such as
        `2**20`) breaks that the parent did not."""
        values = dict(self.values)
        for name, value in sets.items():
            if isinstance(value, Expression):
                try:
                    value = evaluate_text(value)
                except Unreadable:
                    value = None  # train.py evaluates it: no rule over it is judged here
            values[name] = value
        return [b for b in check(self.rules, values) if b.invariant.text not in self.before]


# ---------------------------------------------------------------------------- reading the asserts


def _config_keys(tree: ast.AST, constants: set[str]) -> dict[str, object]:
    """{key: constant name} from every dict literal (and `dict(key=...)` call) that maps a
    string key to a constant; a key seen with two values maps to _MIXED."""
    keys: dict[str, object] = {}

    def note(key: str, value: ast.expr) -> None:
        name = value.id if isinstance(value, ast.Name) and value.id in constants else _MIXED
        keys[key] = name if keys.get(key, name) == name else _MIXED

    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    note(key.value, value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
            for keyword in node.keywords:
                if keyword.arg is not None:
                    note(keyword.arg, keyword.value)
    return keys


class _Unresolved(Exception):
    pass


class _ToConstants(ast.NodeTransformer):
    def __init__(self, constants: set[str], keys: dict[str, object]):
        self.constants, self.keys = constants, keys

    def visit_Name(self, node: ast.Name):
        if node.id not in self.constants:
            raise _Unresolved(node.id)
        return node

    def visit_Subscript(self, node: ast.Subscript):
        key = node.slice
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str) and _is_reference(node.value)):
            raise _Unresolved("subscript")
        name = self.keys.get(key.value)
        if not isinstance(name, str):
            raise _Unresolved(key.value)
        return ast.copy_location(ast.Name(id=name, ctx=ast.Load()), node)

    def generic_visit(self, node: ast.AST):
        if not isinstance(node, _ALLOWED):
            raise _Unresolved(type(node).__name__)
        return super().generic_visit(node)


def _is_reference(node: ast.expr) -> bool:
    """`cfg` or `self.config`: a plain name or attribute chain (no call, no computed part)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def _in_constants(test: ast.expr, constants: set[str], keys: dict[str, object]) -> ast.expr | None:
    import copy

    try:
        check_shape(test)  # a trial's assert of 10,000 nested terms is not walked recursively
        return _ToConstants(constants, keys).visit(copy.deepcopy(test))
    except (_Unresolved, Unreadable):
        return None


# ---------------------------------------------------------------------------- evaluating them


def _false_clause(test: ast.expr, values: dict[str, object]) -> ast.expr | None:
    """The innermost conjunct of `test` that is false with `values`; None when the test
    holds or cannot be read."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        for part in test.values:
            clause = _false_clause(part, values)
            if clause is not None:
                return clause
        return None
    try:
        return None if _truth(test, values) else test
    except Unreadable:
        return None


def _truth(node: ast.expr, values: dict[str, object]) -> bool:
    if isinstance(node, ast.BoolOp):
        parts = (_truth(v, values) for v in node.values)
        return all(parts) if isinstance(node.op, ast.And) else any(parts)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not _truth(node.operand, values)
    if isinstance(node, ast.Compare):
        left = _value(node.left, values)
        for op, right_node in zip(node.ops, node.comparators):
            right = _value(right_node, values)
            compare = _COMPARE.get(type(op))
            if compare is None:
                raise Unreadable(f"the comparison {type(op).__name__} is not evaluated")
            try:
                if not compare(left, right):
                    return False
            except TypeError as exc:
                raise Unreadable(str(exc)) from None
            left = right
        return True
    return bool(_value(node, values))


def _value(node: ast.expr, values: dict[str, object]):
    """The value of an arithmetic expression over constants, within pyconst's caps."""

    class Substitute(ast.NodeTransformer):
        def visit_Name(self, name: ast.Name):
            value = values.get(name.id)
            if not isinstance(value, (int, float, str)):
                raise Unreadable(f"{name.id} has no value autoloop reads")
            return ast.copy_location(ast.Constant(value=value), name)

        def visit_BoolOp(self, inner: ast.BoolOp):
            raise Unreadable("a boolean operation inside arithmetic")

        visit_Compare = visit_BoolOp

    import copy

    return evaluate(Substitute().visit(copy.deepcopy(node)))


def _in_words(clause: ast.expr) -> str:
    """`A % B == 0` as "A must be a multiple of B"; "" for other shapes."""
    if (isinstance(clause, ast.Compare) and len(clause.ops) == 1 and isinstance(clause.ops[0], ast.Eq)
            and isinstance(clause.left, ast.BinOp) and isinstance(clause.left.op, ast.Mod)
            and isinstance(clause.comparators[0], ast.Constant) and clause.comparators[0].value == 0):
        return f"{ast.unparse(clause.left.left)} must be a multiple of {ast.unparse(clause.left.right)}"
    return ""
