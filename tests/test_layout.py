"""The package's shape is checked, not just described.

* Every package imports only from the floors below its own (FLOORS: base at the bottom,
  cli at the top), function-level imports counted.
* No import circle among autoloop's modules outside `autoloop/harness/` (whose two circles
  go with a harness version bump): every `import autoloop...` and `from autoloop... import`
  counts, at module level and inside functions, because a function-level import is still a
  dependency, only a later one.
* docs/architecture.md opens with the package tree, one line per module; the tree and the
  modules on disk agree.
* README's "## Commands" table and `autoloop --help` agree (sqlite-utils' tests/test_docs.py
  is the model): every command is documented and every documented command exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autoloop"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
README = ROOT / "README.md"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def type_only_imports(tree: ast.AST) -> set[int]:
    """ids of the import statements under `if TYPE_CHECKING:` (annotations only)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            found.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return found


def imported_modules(path: Path, modules: dict[str, Path], *, type_only: bool = True) -> set[str]:
    """The autoloop modules `path` imports, wherever in the file the import statement is
    (those under `if TYPE_CHECKING:` too, unless `type_only` is False: a type named for an
    editor is a dependency between floors, but not a circle at run time).

    `from autoloop.x import y` is an edge to `autoloop.x.y` when that is a module, else to
    `autoloop.x`. The parent packages Python initialises on the way are not counted: a
    package's `__init__` importing its own submodules is not a circle.
    """
    found: set[str] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = set() if type_only else type_only_imports(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "autoloop")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "autoloop":
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
    return {name for name in found if name in modules}


def import_graph(*, type_only: bool = True) -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imported_modules(path, modules, type_only=type_only) - {name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle in `graph` as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


# The floors, lowest first: a package imports only from the floors below it (and itself),
# counting imports inside functions. The root `autoloop` (its version, and `load_trials`
# imported lazily) is the package's face, not a floor. review is above loop: `ablate` and
# the re-measurement of the best are clients of the loop (each drives the one Controller
# through a short night of its own, with the same rule, sandbox and harness), and the loop
# never calls the review; serve is above review and reads the run the way the commands do.
FLOORS = [
    ("errors", "pyast", "envinfo"),  # no autoloop imports at all
    ("base",),  # the ground floor: processes, the allowed environment, statuses, redaction, faults
    ("harness",),  # train.py's half: torch, numpy, the standard library
    ("config", "pyconst", "gitops", "prepare"),
    ("decide", "invariants"),  # pure readings of what they are given (statistics, train.py's asserts): no db, no git
    ("store",),
    ("trust",),
    ("measure",),
    ("check", "proposers"),
    ("loop",),
    ("review",),
    ("serve",),
    ("cli",),
    ("__main__",),
]


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def floor_of(package: str) -> int:
    for number, floor in enumerate(FLOORS):
        if package in floor:
            return number
    raise AssertionError(f"autoloop.{package} is on no floor of tests/test_layout.py: add it to FLOORS")


def arrows_against_the_floors(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a package to one on its own floor or above (the root excepted)."""
    wrong = []
    for module, imported in sorted(graph.items()):
        here = package_of(module)
        for target in sorted(imported):
            there = package_of(target)
            if not here or not there or here == there:
                continue
            if floor_of(there) >= floor_of(here):
                wrong.append(f"{module} -> {target}")
    return wrong


def test_every_package_imports_only_from_the_floors_below():
    wrong = arrows_against_the_floors(import_graph())
    assert not wrong, "imports against the floors of tests/test_layout.py:\n" + "\n".join(wrong)


def test_every_package_is_on_a_floor():
    for name in all_modules():
        if package_of(name):
            floor_of(package_of(name))


def test_the_floor_check_finds_an_arrow_upward():
    graph = {"autoloop.trust.integrity": {"autoloop.measure.runner", "autoloop.base.status"},
             "autoloop.store": {"autoloop.decide.rule"}, "autoloop.decide.rule": {"autoloop.store"},
             "autoloop.loop.run": {"autoloop"}, "autoloop": {"autoloop.review.export"}}
    assert arrows_against_the_floors(graph) == ["autoloop.decide.rule -> autoloop.store",
                                                "autoloop.trust.integrity -> autoloop.measure.runner"]


def outside_harness(name: str) -> bool:
    return not (name == "autoloop.harness" or name.startswith("autoloop.harness."))


def test_no_import_circle_outside_the_harness():
    graph = import_graph(type_only=False)
    graph = {m: {d for d in deps if outside_harness(d)} for m, deps in graph.items() if outside_harness(m)}
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_known_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_function_level_imports_count(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from autoloop.store import Store\n    import autoloop.config\n")
    modules = {"autoloop.store": Path(), "autoloop.config": Path()}
    assert imported_modules(source, modules) == {"autoloop.store", "autoloop.config"}


# ---------------------------------------------------------------------------- the package tree

TREE_LINE = re.compile(r"^[│├└─\s]*(\S+?)(?:\s{2,}(.*))?$")


def documented_tree(text: str) -> dict[str, str]:
    """{path relative to the repository: comment} from the first fenced block of
    docs/architecture.md, a tree drawn with │ ├── └── and indented by four per level."""
    block = text.split("```", 2)[1].splitlines()[1:]
    entries: dict[str, str] = {}
    stack: list[str] = []  # the folders above the current line
    for line in block:
        if not line.strip():
            continue
        depth = len(re.match(r"^[│├└─ ]*", line).group(0)) // 4
        name, comment = TREE_LINE.match(line).groups()
        stack = stack[:depth]
        path = "".join(stack) + name
        entries[path] = (comment or "").strip()
        if name.endswith("/"):
            stack.append(name)
    return entries


def test_architecture_opens_with_the_package_tree():
    text = ARCHITECTURE.read_text()
    head = text.split("```", 1)[0]
    assert head.count("\n## ") <= 1 and "## Package tree" in head, "docs/architecture.md must open with the tree"
    assert documented_tree(text), "no tree in docs/architecture.md's first code block"


def test_the_tree_names_every_module_and_only_modules_that_exist():
    """Every .py under autoloop/ (an `__init__.py` may be named by its folder's line
    instead) and every package folder has a line with a comment saying what it owns."""
    tree = documented_tree(ARCHITECTURE.read_text())
    on_disk = {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    folders = {p.relative_to(ROOT).as_posix() + "/" for p in [PACKAGE, *PACKAGE.rglob("*")] if p.is_dir()
               and (p / "__init__.py").exists()}
    missing = sorted(path for path in on_disk if path not in tree and not (
        path.endswith("/__init__.py") and path[: -len("__init__.py")] in tree))
    missing += sorted(folder for folder in folders if folder not in tree)
    assert not missing, f"modules missing from the tree in docs/architecture.md: {missing}"
    stale = sorted(path for path in tree if path not in on_disk and path not in folders)
    assert not stale, f"docs/architecture.md's tree names what does not exist: {stale}"
    silent = sorted(path for path, comment in tree.items() if not comment and path != "autoloop/")
    assert not silent, f"tree lines without a word on what the module owns: {silent}"


def test_the_tree_parser_reads_nesting():
    text = "x\n```\nautoloop/\n├── a.py      one\n├── p/        pkg\n│   └── b.py  two\n└── c.py      three\n```\n"
    assert documented_tree(text) == {"autoloop/": "", "autoloop/a.py": "one", "autoloop/p/": "pkg",
                                     "autoloop/p/b.py": "two", "autoloop/c.py": "three"}


# ---------------------------------------------------------------------------- README's commands


def readme_commands() -> set[str]:
    """The command names of README's "## Commands" table (`autoloop NAME ...` cells)."""
    section = README.read_text().split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `autoloop ([a-z][a-z-]*)", section, flags=re.M))


def cli_commands() -> set[str]:
    import typer.main

    from autoloop.cli import app

    return set(typer.main.get_command(app).list_commands(None))


def test_readme_commands_table_matches_the_cli():
    documented, actual = readme_commands(), cli_commands()
    assert actual - documented == set(), f"commands missing from README's Commands table: {sorted(actual - documented)}"
    assert documented - actual == set(), f"README's Commands table names no such command: {sorted(documented - actual)}"


@pytest.mark.parametrize("name", sorted(readme_commands()))
def test_every_documented_command_has_help(name):
    from typer.testing import CliRunner

    from autoloop.cli import app

    result = CliRunner().invoke(app, [name, "--help"])
    assert result.exit_code == 0 and "Usage" in result.output, result.output


# ---------------------------------------------------------------------------- the loop's shape

MODULE_LINES = 600  # ShinkaEvolve's 6,254-line async runner is the counter-example
# The modules allowed past MODULE_LINES, each with the one concept it holds whole (sqlite-utils'
# db.py is the model: one long module because the database is one thing). A module that grows
# past the line and holds several concepts is split instead (issue 32 split check.py into a
# package of its four parts, and measure/runner.py into the runner, the reaper, the log pipe
# and the outcome rules).
ONE_CONCEPT = {
    "autoloop/store.py": "experiments.db: its schema, its migrations and every read and write of it",
    "autoloop/harness/feed.py": "the data feed: the trusted server of training batches and the client train.py uses",
    "autoloop/decide/simulate.py": "simulated nights of the one decision rule, at equal compute",
    "autoloop/decide/rule.py": "the decision: keep, discard or measure again, from paired runs",
    "autoloop/review/queries.py": "reading a run back from experiments.db: the rows the review prints",
    "autoloop/review/report.py": "the report: one self-contained HTML page about a run",
    "autoloop/proposers/search.py": "the built-in search: the pattern search over train.py's constants, its re-tune "
                                    "after a structural keep and the points a model's constant-only answer names",
    "autoloop/measure/worker.py": "the worker's half of one measurement: train, check, evaluate one commit at one seed",
}


def module_lines() -> dict[str, int]:
    return {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in sorted(PACKAGE.rglob("*.py"))}


def test_a_module_past_600_lines_holds_one_named_concept():
    """A module that grows past this is doing two things, unless it holds one concept whole
    and ONE_CONCEPT names it; a named module back under the line leaves the table."""
    lines = module_lines()
    long = {path: n for path, n in lines.items() if n > MODULE_LINES and path not in ONE_CONCEPT}
    assert not long, f"modules over {MODULE_LINES} lines: split them by concept, or name the one they hold: {long}"
    stale = sorted(path for path in ONE_CONCEPT if lines.get(path, 0) <= MODULE_LINES)
    assert not stale, f"ONE_CONCEPT names modules no longer over {MODULE_LINES} lines: {stale}"


def thread_locals(path: Path) -> list[int]:
    """Lines of `path` that make or import thread-local state."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "local" and isinstance(node.value, ast.Name) \
                and node.value.id == "threading":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module in ("threading", "_threading_local") \
                and any(alias.name == "local" for alias in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.Import) and any(alias.name == "_threading_local" for alias in node.names):
            lines.append(node.lineno)
    return lines


def test_no_thread_local_state():
    """A trial's context (slot, lineage, incumbent) travels as an argument: code that answers
    differently depending on the calling thread is how the next method falls into a race."""
    found = {p.relative_to(ROOT).as_posix(): lines for p in sorted(PACKAGE.rglob("*.py")) if (lines := thread_locals(p))}
    assert not found, f"threading.local in {found}: pass the context as an argument"


def test_the_thread_local_finder_finds_one(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import threading\nfrom threading import local\nx = threading.local()\n")
    assert thread_locals(source) == [2, 3]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_names(tree: ast.AST) -> set[str]:
    """Every name a module defines for itself: functions, classes, assigned names and
    attributes (`self._x = ...`, `_x: int = 0` in a class body)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


def foreign_private_uses(path: Path) -> list[tuple[int, str]]:
    """(line, what) for each use in `path` of another module's private name: `x._name` where x
    is not self/cls and the module does not define `_name` itself, `getattr(x, "_name")`, and
    `from m import _name`. Dunders are public."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own = own_names(tree)
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own \
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            uses.append((node.lineno, node.col_offset, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and _private(node.args[1].value) and node.args[1].value not in own:
            uses.append((node.lineno, node.col_offset, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom):
            uses += [(node.lineno, node.col_offset, f"from {node.module} import {alias.name}") for alias in node.names
                     if _private(alias.name)]
    return [(line, what) for line, _, what in sorted(uses)]


# Uses allowed, each with its reason. Nothing else: a module that needs another's private name
# needs a public one.
PRIVATE_USE_ALLOWED: set[tuple[str, str]] = set()


def test_no_module_uses_another_modules_private_names():
    """The harness is not checked: it is fixed and fingerprinted (every run records its
    fingerprint), so its own cross-module uses (feed.py reading data.py's `_memmap`, and
    `os._exit`) change only with a deliberate harness version bump."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("autoloop/harness/"):
            continue
        found += [f"{relative}:{line}: {what}" for line, what in foreign_private_uses(path)
                  if (relative, what) not in PRIVATE_USE_ALLOWED]
    assert not found, "another module's private names used (give it a public name):\n" + "\n".join(found)


def test_the_private_use_finder(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from x import _hidden, shown\n"
        "class A:\n    _mine = 1\n    def f(self, other):\n"
        "        self._a = other._mine + other._theirs + getattr(other, '_also') + other.__class__.__name__\n"
    )
    assert [what for _, what in foreign_private_uses(source)] == ["from x import _hidden", "other._theirs",
                                                                  "getattr(other, '_also')"]


def test_no_import_circle_in_the_harness_either():
    """The harness's two circles (bpe <-> tokenizer, data <-> feed) went with the harness
    version of the trust issue: the loader has a module of its own, BPE is imported by name."""
    graph = import_graph(type_only=False)
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


# ---------------------------------------------------------------------- a typed host for a trial

HOST_NAMES = ("c", "controller", "host")


def untyped_hosts(path: Path) -> list[str]:
    """`file:line name` of every function parameter that holds the run (c, controller,
    host) without a type."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                if arg.arg in HOST_NAMES and arg.annotation is None:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}({arg.arg})")
    return found


def test_no_function_takes_the_run_untyped():
    """The loop's functions take a TrialHost (autoloop/loop/host.py), the measurement's a
    MeasureHost: an editor follows every `c.` to its type. (Local closures over a number
    `c` in decide/ are numbers, and typed.)"""
    untyped = [f for path in sorted(PACKAGE.rglob("*.py")) for f in untyped_hosts(path)]
    assert not untyped, f"parameters holding the run without a type: {untyped}"


def test_the_untyped_host_finder_finds_one(tmp_path):
    path = ROOT / "tests" / "data" / "_untyped_host_probe.py"
    path.write_text("def f(c, x: int):\n    pass\n\ndef g(c: int):\n    pass\n")
    try:
        assert untyped_hosts(path) == ["tests/data/_untyped_host_probe.py:1 f(c)"]
    finally:
        path.unlink()


def test_the_controller_is_every_host_it_is_given_as(tmp_path):
    """Every member the TrialHost and MeasureHost protocols name is the Controller's: the
    protocols say what a trial uses, and the one implementation has it all."""
    from autoloop.config import Config
    from autoloop.loop.controller import Controller
    from autoloop.loop.host import TrialHost
    from autoloop.measure.measurer import MeasureHost

    controller = Controller(Config(), tmp_path)
    for protocol in (TrialHost, MeasureHost):
        members: set[str] = set()
        for base in protocol.__mro__:
            if base in (TrialHost, MeasureHost):
                members |= set(base.__annotations__)
                members |= {name for name, value in vars(base).items()
                            if not name.startswith("_") and (callable(value) or isinstance(value, property))}
        missing = sorted(name for name in members if not hasattr(controller, name))
        assert not missing, f"{protocol.__name__} names what the Controller lacks: {missing}"
        assert len(members) > 20


# Infrastructure train.py leans on, each defined once, in the harness (issue 32): a proposal
# reads train.py whole every trial, and two copies drift (the check's and train.py's
# kernel_from_op_names had different tables).
HARNESS_ONLY = {
    "kernel_from_op_names": "kernels.py", "time_attention_kernels": "kernels.py", "choose_attention_kernel": "kernels.py",
    "pick_attention_kernel": "kernels.py", "flops_per_token": "flops.py", "flops_per_token_palm": "flops.py",
    "executed_flops_per_token": "flops.py", "mfu_figures": "flops.py", "peak_flops": "flops.py",
    "peak_memory_mb": "hardware.py", "is_compile_error": "compile.py", "warm_up": "compile.py",
}


def test_train_py_is_the_experiment_and_its_infrastructure_is_defined_once_in_the_harness():
    train_py = (ROOT / "train.py").read_text()
    assert len(train_py.splitlines()) <= 700, "train.py is the experiment: keep it <= 700 lines, infrastructure in the harness"
    sources = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "train.py", *sorted(PACKAGE.rglob("*.py"))]}
    for name, module in HARNESS_ONLY.items():
        defined = [path for path, text in sources.items() if re.search(rf"^def {name}\(", text, re.M)]
        assert defined == [f"autoloop/harness/{module}"], (name, defined)
