"""docs/settings.md, made from the configuration itself so the table cannot drift.

Each setting's row: its TOML name, its environment variable, the flag that sets it (where
a command has one), its default and what it does. What it does is the comment written
beside the field in autoloop/config.py (or the comment block above it): the one place a
setting is explained. `python -m autoloop.cli.settings_page`
rewrites the page; tests/test_docs.py fails when the page and the code disagree.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from dataclasses import MISSING, fields
from pathlib import Path

from autoloop import config as config_module
from autoloop.config import ENV_PREFIX, Config

PAGE = Path(__file__).resolve().parents[2] / "docs" / "settings.md"

HEADER = """# Settings

Every setting, as `[tool.autoloop]` in your `pyproject.toml` names it, as an environment
variable, and as a flag where a command takes one (precedence, lowest to highest: the
default < `pyproject.toml` < the environment < the flag). Made from `autoloop/config.py`
by `python -m autoloop.cli.settings_page`; a test fails when this page and the code disagree.

| setting | environment | flag | default | what it does |
| --- | --- | --- | --- | --- |
"""


def field_comments(source: str) -> dict[str, str]:
    """Each Config field's comment: the one beside it, else the block just above it."""
    tree = ast.parse(source)
    config = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    found: dict[str, str] = {}
    for node in config.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        beside = [comments[n] for n in range(node.lineno, node.end_lineno + 1)
                  if n in comments and not lines[n - 1].lstrip().startswith("#")]
        if beside:
            found[node.target.id] = " ".join(beside)
            continue
        above, n = [], node.lineno - 1
        while n in comments and lines[n - 1].lstrip().startswith("#"):
            above.insert(0, comments[n])
            n -= 1
        if above:
            found[node.target.id] = " ".join(above)
    return found


def _default(f) -> str:
    value = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = repr(value) if isinstance(value, (list, dict)) else str(value)
    return f"`{text}`" if text else "(empty)"


def command_flags() -> dict[str, list[str]]:
    """--option -> the commands that take it, from the CLI itself."""
    import typer

    from autoloop.cli import app

    found: dict[str, list[str]] = {}

    def walk(command, name: str) -> None:
        for param in command.params:
            for option in (*param.opts, *param.secondary_opts):
                if option.startswith("--"):
                    found.setdefault(option, []).append(name)
        for sub_name, sub in getattr(command, "commands", {}).items():
            walk(sub, sub_name)

    walk(typer.main.get_command(app), "")
    return found


def rows() -> list[tuple[str, str, str, str, str]]:
    comments = field_comments(Path(config_module.__file__).read_text())
    flags = command_flags()
    out = []
    for f in fields(Config):
        name = f.name.replace("_", "-")
        what = comments.get(f.name, "")
        shown = [f"`{option}` ({', '.join(sorted(set(flags[option])))})"
                 for option in (f"--{name}", f"--no-{name}") if option in flags]
        flag = ", ".join(shown) or "none"
        out.append((f"`{name}`", f"`{ENV_PREFIX}{f.name.upper()}`", flag, _default(f), what.replace("|", "\\|")))
    return out


def page() -> str:
    return HEADER + "".join(f"| {' | '.join(row)} |\n" for row in rows())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--check"]:
        if PAGE.read_text() != page():
            print(f"{PAGE} is out of date: run python -m autoloop.cli.settings_page")
            return 1
        return 0
    PAGE.write_text(page())
    print(f"wrote {PAGE} ({len(fields(Config))} settings)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
