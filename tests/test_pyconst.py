"""The bounded evaluator of constants (autoloop/pyconst.py): known answers, exact caps,
and every expression that stalled the controller refused in milliseconds."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from autoloop.errors import AutoloopError
from autoloop.proposers.search_space import parse_hints
from autoloop.pyconst import (MAX_DEPTH, MAX_INT_BITS, MAX_NODES, MAX_SIZE, Expression, OverCap, Unreadable,
                              evaluate, evaluate_text, literal, parse_value, read_constants)

TRAIN_PY = Path(__file__).resolve().parents[1] / "train.py"
CPU_SECONDS = 0.5  # per expression: generous on a busy 2-core machine; the bombs took 3 s to hours


def _previous_reader(node: ast.expr):
    """How constants were read before the bounded evaluator (ast.literal_eval, then eval of
    arithmetic of literals): the oracle for our own, trusted train.py."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    expr = ast.fix_missing_locations(ast.Expression(body=node))
    if all(isinstance(n, (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.operator, ast.unaryop))
           for n in ast.walk(expr)):
        return eval(compile(expr, "<constant>", "eval"), {"__builtins__": {}})
    return None


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_constant_of_train_py_reads_as_before(device):
    source = TRAIN_PY.read_text()
    constants = read_constants(source, device)
    for name, const in constants.items():
        before = _previous_reader(ast.parse(const.source, mode="eval").body)
        assert (const.value, type(const.value)) == (before, type(before)), name
        assert not const.unreadable, (name, const.unreadable)
    # Known answers, whatever the oracle says.
    assert constants["TOTAL_BATCH_TOKENS"].value == (2048 if device == "cpu" else 524288)
    assert constants["LOSS_CHUNK_BYTES"].value == 2**30
    assert constants["ADAM_BETAS"].value == (0.8, 0.95) and constants["ADAM_EPS"].value == 1e-10
    assert constants["ATTENTION_BACKEND"].value == "auto" and constants["DEVICE_TYPE"].value is None


BOMBS = {
    "3**3**15": "3**3**15",
    "9**9**9": "9**9**9",
    "1<<10**9": "1<<10**9",
    "'a'*10**9": "'a'*10**9",
    "10**10**10": "10**10**10",
    "a product": "(2**3000)*(2**3000)",
    "a list repeated": "[0]*10**9",
    "nested repetitions": "((('a'*10000,)*10000,)*10000,)",
    "a hex literal": "0x" + "f" * 3000,
    "10,000 nodes": "(" + "1," * 5000 + ")",
    "nested tuples": "(" * 150 + "1," + ")," * 149 + ")",
    "nested parens": "(" * 1000 + "1" + ")" * 1000,
    "a unary chain": "-" * 1000 + "1",
    "a long unary chain": "-" * 100_000 + "1",
    "a long sum": "1+" * 20_000 + "1",
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_a_bomb_is_unreadable_at_once(name):
    text = BOMBS[name]
    started = time.process_time()
    with pytest.raises(Unreadable):
        evaluate_text(text)
    assert time.process_time() - started < CPU_SECONDS


@pytest.mark.parametrize("name", list(BOMBS))
def test_a_bomb_in_a_file_is_a_constant_without_a_value(name):
    """As read_constants meets it: a line of a trial's train.py, no text cap in the way."""
    source = f"DEPTH = 4\nBOMB = {BOMBS[name]}  # range 1..{BOMBS[name]}\n"
    started = time.process_time()
    try:
        constants = read_constants(source, "cpu")
    except SyntaxError:
        # Past the parser's own limits the file does not parse (train.py would not compile),
        # and says so as a SyntaxError, not a RecursionError or MemoryError.
        assert name in ("nested parens", "a long unary chain", "a long sum")
    else:
        assert constants["BOMB"].value is None and constants["DEPTH"].value == 4
        assert parse_hints(constants["BOMB"].comment, name="BOMB").hi is None
    assert time.process_time() - started < CPU_SECONDS


def _unreadable(text: str) -> bool:
    try:
        evaluate_text(text)
    except OverCap:
        return True
    return False


def _nodes(text: str) -> ast.expr:
    return ast.parse(text, mode="eval").body


def test_the_caps_are_where_they_say():
    assert MAX_INT_BITS == 4096 and evaluate_text("2**4095") == 2**4095 and _unreadable("2**4096")
    assert evaluate_text("1<<4095") == 1 << 4095 and _unreadable("1<<4096")
    assert evaluate_text("(2**2048)*(2**2047)") == 2**4095 and _unreadable("(2**2048)*(2**2048)")
    assert evaluate_text("2**4095 - 1 + 2**4095") == 2**4096 - 1 and _unreadable("2**4095 + 2**4095")
    assert evaluate_text(f"'a'*{MAX_SIZE}") == "a" * MAX_SIZE and _unreadable(f"'a'*{MAX_SIZE + 1}")
    assert len(evaluate_text(f"(1,)*{MAX_SIZE - 1}")) == MAX_SIZE - 1 and _unreadable(f"(1,)*{MAX_SIZE}")
    # A tuple of n constants is n + 2 nodes (the tuple and its Load context).
    wide = lambda n: _nodes("(" + "1," * n + ")")  # noqa: E731
    assert evaluate(wide(MAX_NODES - 2)) == (1,) * (MAX_NODES - 2)
    with pytest.raises(OverCap, match="nodes"):
        evaluate(wide(MAX_NODES - 1))
    # k nested 1-tuples put the innermost constant k + 1 deep.
    deep = lambda k: _nodes("(" * k + "1" + ",)" * k)  # noqa: E731
    assert evaluate(deep(MAX_DEPTH - 1)) is not None
    with pytest.raises(OverCap, match="nested"):
        evaluate(deep(MAX_DEPTH))


@pytest.mark.parametrize("text", [
    "2**19", "256 * 1024", "3e-4", "-7 % 3", "7 // 2", "2**-1", "1 / 8", "~5", "-(2**63)", "0b1010 | 0x0f ^ 3 & 7",
    "1 >> 3", "(1, 2) + (3,)", "[0] * 3", "'ab' * 2", "2 * 'ab'", "b'x' + b'y'", "1 + 2j", "(1+2j) ** 2",
    "True + 1", "None", "{'a': [1, 2.5], 3: (4,)}", "{1, 2, 2}", "-0.0", "1e400", "2.0 ** 0.5", "(-8) ** 0.5",
])
def test_arithmetic_of_literals_matches_python(text):
    expected = eval(text, {"__builtins__": {}})  # our own texts: the oracle
    value = evaluate_text(text)
    assert (value, type(value)) == (expected, type(expected)) or (value != value and expected != expected)


@pytest.mark.parametrize("text", [
    "DEPTH * 2", "max(1, 2)", "__import__('os')", "'%s' % 'x'", "f'{1}'", "1 if True else 2", "1 < 2", "1 and 2",
    "lambda: 1", "[x for x in (1,)]", "1 / 0", "2.0 ** 2000", "(2**4000) / 1e-300", "{[1]: 2}", "[*(1,)]", "1 @ 2",
    "'a' - 'b'", "...", "{**{}}", "(1,) * 2.0",
])
def test_anything_else_is_unreadable_not_an_error(text):
    with pytest.raises(Unreadable):
        evaluate_text(text)
    assert literal(ast.parse(text, mode="eval").body) is None


def test_a_set_value_is_a_literal_or_the_text_as_typed():
    assert parse_value("0.5") == 0.5 and parse_value("'adamw'") == "adamw" and parse_value("(1, -2)") == (1, -2)
    assert parse_value("1+2j") == 1 + 2j
    for text in ("2**18", "DEPTH * 2", "3**3**15"):  # written into train.py as typed, never evaluated here
        assert isinstance(parse_value(text), Expression) and parse_value(text) == text
    started = time.process_time()
    for text in ("-" * 100_000 + "1", "1+" * 20_000 + "1", "(" * 1000 + ")" * 1000):
        with pytest.raises(AutoloopError) as caught:
            parse_value(text)
        assert "\n" not in str(caught.value) and len(str(caught.value)) < 300
    assert time.process_time() - started < CPU_SECONDS


def test_hint_numbers_are_bounded():
    assert parse_hints("range 1..2**10 log", name="X").hi == 1024.0
    for bomb in ("3**3**15", "9**9**9", "'a'*10**9", "2**4095"):
        started = time.process_time()
        assert parse_hints(f"range 1..{bomb} log", name="X").hi is None  # not a hint clause: prose
        assert time.process_time() - started < CPU_SECONDS


def test_the_device_is_cpu_without_a_gpu_driver_and_torch_is_not_imported_for_it(tmp_path):
    """`autoloop seed --set` reads train.py's constants for the device it will run on: a
    machine with no GPU driver is a CPU one, said without importing torch (2.6 s)."""
    import subprocess
    import sys

    from autoloop.pyconst import gpu_driver_present

    node = tmp_path / "nvidiactl"
    assert not gpu_driver_present((str(tmp_path / "absent"),))
    node.write_text("")
    assert gpu_driver_present((str(tmp_path / "absent"), str(node)))
    if gpu_driver_present():
        pytest.skip("this machine has a GPU driver: the device is torch's answer")
    code = ("import os, sys; os.environ.pop('AUTOLOOP_DEVICE_TYPE', None); from autoloop.pyconst import current_device; "
            "sys.exit(0 if current_device() == 'cpu' and 'torch' not in sys.modules else 1)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
