"""The docs cannot drift from the code: every `--flag` and `autoloop COMMAND` that README.md,
program.md and docs/ name exists, and every setting the README says works as a flag is one.

A flag of another tool (bubblewrap's, Ray's, a coding agent's) is allowed only where its
tool is named within three lines, from the table OTHER_TOOLS; a flag of a bench or script
is read from that file's own argparse calls.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "program.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")
# Flags that belong to other programs, and a word that names the program near them.
OTHER_TOOLS = {
    "--help": ("",),  # every command has it
    "--die-with-parent": ("bwrap", "bubblewrap"), "--dev-bind": ("bwrap", "bubblewrap"),
    "--head": ("ray",), "--address": ("ray",),
    "--permission-mode": ("claude",), "--sandbox": ("codex",),
    "--yes-always": ("aider",), "--no-check-update": ("aider",), "--model": ("aider",), "--message-file": ("aider",),
    "--no-index": ("pip",), "--dry-run": ("gpu_check",), "--durations": ("pytest",),
}


def autoloop_options() -> tuple[set[str], set[str]]:
    """(every --option of every autoloop command, the command names), from the CLI itself."""
    import typer

    from autoloop.cli import app

    root = typer.main.get_command(app)
    options: set[str] = set()

    def walk(command) -> None:
        for param in command.params:
            options.update(o for o in (*param.opts, *param.secondary_opts) if o.startswith("--"))
        for sub in getattr(command, "commands", {}).values():
            walk(sub)

    walk(root)
    return options, set(root.commands)


def script_options() -> set[str]:
    """The flags of the benches, the scripts and autoloop's internal entry points
    (`python -m autoloop.harness.evaluate --probe-noise ...`), read from their argparse calls."""
    found: set[str] = set()
    for path in [*(ROOT / "bench").glob("*.py"), *(ROOT / "scripts").glob("*.py"), *(ROOT / "autoloop").rglob("*.py")]:
        found.update(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", path.read_text()))
    return found


def unknown_flags(text: str, known: set[str]) -> list[tuple[int, str]]:
    """(line, flag) of every flag in `text` that is neither known nor another tool's flag
    with its tool named within three lines."""
    lines = text.splitlines()
    unknown = []
    for number, line in enumerate(lines, 1):
        for flag in FLAG.findall(line):
            if flag in known:
                continue
            tools = OTHER_TOOLS.get(flag)
            near = "\n".join(lines[max(0, number - 4):number + 3]).lower()
            if tools is not None and any(tool in near for tool in tools):
                continue
            unknown.append((number, flag))
    return unknown


def code_of(text: str) -> str:
    """The code spans and fenced blocks of a markdown text (where a command is named)."""
    blocks = re.findall(r"```.*?```", text, flags=re.S)
    rest = re.sub(r"```.*?```", "", text, flags=re.S)
    return "\n".join(blocks + re.findall(r"`[^`\n]+`", rest))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_flag_a_doc_names_exists(doc):
    options, _ = autoloop_options()
    unknown = unknown_flags(doc.read_text(), options | script_options())
    assert not unknown, f"{doc.name} names flags that no command has: {unknown}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_command_a_doc_names_exists(doc):
    _, commands = autoloop_options()
    # A command line, not a message that starts with the program's name ("autoloop nov29: ...").
    named = set(re.findall(r"(?<![\w./\"-])autoloop ([a-z][a-z-]*)(?![\w:-])", code_of(doc.read_text())))
    assert named <= commands, f"{doc.name} names commands that do not exist: {sorted(named - commands)}"


def test_the_flag_check_finds_a_flag_that_does_not_exist():
    options, _ = autoloop_options()
    text = "After `--max-consecutive-failures` crashes in a row.\nbwrap --die-with-parent\n\n\n\n\n--dev-bind alone"
    assert unknown_flags(text, options) == [(1, "--max-consecutive-failures"), (7, "--dev-bind")]


def test_every_setting_the_readme_calls_a_flag_is_one():
    """README: "The same names work as ... flags": only for the settings that have one; the
    rest are named as settings."""
    from autoloop.config import Config

    options, _ = autoloop_options()
    readme = (ROOT / "README.md").read_text()
    settings = {f.name.replace("_", "-") for f in fields(Config)}
    flagged = {flag[2:] for _, flag in [(0, f) for f in FLAG.findall(readme)] if flag[2:] in settings}
    assert all(f"--{name}" in options for name in flagged), sorted(n for n in flagged if f"--{n}" not in options)
    without = sorted(name for name in settings if f"--{name}" not in options)
    assert "max-consecutive-failures" in without  # a setting without a flag: the README says so
    toml = re.search(r"```toml\n(.*?)```", readme, flags=re.S).group(1)
    for name in re.findall(r"^([a-z][a-z-]*) =", toml, flags=re.M):
        assert name in settings, f"README's [tool.autoloop] example names {name!r}, which is no setting"


def test_no_doc_installs_autoloop_from_the_registry():
    """`autoloop` on the package registry is another project's distribution: ours is
    autoloop-research, installed from a clone (`pip install -e .`) or a wheelhouse."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"] == "autoloop-research"
    pattern = re.compile(r"pip install (?:-[\w=.-]+ )*['\"]?autoloop(\[[a-z,]+\])?['\"]?(?![\w-])")
    sources = [*DOCS, *(ROOT / "autoloop").rglob("*.py"), *(ROOT / "scripts").glob("*"), *(ROOT / "bench").glob("*.py")]
    found = [f"{p.relative_to(ROOT)}: {m.group()}" for p in sources if p.is_file() for m in pattern.finditer(p.read_text())]
    assert not found, found


# ---------------------------------------------------------------------- docs made from, or checked against, the code


def test_the_settings_page_is_the_configuration():
    """docs/settings.md is made from autoloop/config.py and the CLI: every setting, its
    variable, its flag where there is one, its default and its comment."""
    from autoloop.cli import settings_page

    assert settings_page.PAGE.read_text() == settings_page.page(), \
        "docs/settings.md is out of date: run python -m autoloop.cli.settings_page"
    assert "docs/settings.md" in (ROOT / "README.md").read_text()
    rows = settings_page.rows()
    assert all(row[4] for row in rows), [row[0] for row in rows if not row[4]]  # each setting says what it does


def test_the_settings_page_reads_a_fields_own_comment():
    source = ("from dataclasses import dataclass\n@dataclass\nclass Config:\n"
              "    a: int = 1  # beside a\n"
              "    # above b,\n    # two lines\n    b: int = 2\n"
              "    c: int = 3\n")
    from autoloop.cli.settings_page import field_comments

    assert field_comments(source) == {"a": "beside a", "b": "above b, two lines"}


def _backticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def test_architecture_names_every_migration_in_order():
    from autoloop.store import MIGRATIONS

    text = (ROOT / "docs" / "architecture.md").read_text()
    named = re.findall(r"`(\d{4}_\w+)`", text)
    assert named == [name for name, _ in MIGRATIONS]


def test_architecture_names_every_measurement_status():
    from autoloop.base.status import MEASUREMENT_STATUSES
    from autoloop.measure.measurer import trial_status

    text = " ".join((ROOT / "docs" / "architecture.md").read_text().split())
    listed = re.search(r"A measurement's status \(([^)]*)\)", text).group(1)
    assert _backticked(listed) == list(MEASUREMENT_STATUSES)
    # Each ends a trial somewhere; only ok is not a failure.
    assert {trial_status(s).value for s in MEASUREMENT_STATUSES if s != "ok"} <= {"crash", "timeout", "invalid",
                                                                                  "interrupted", "discard"}


def test_the_readme_names_every_fault_point():
    from autoloop.base.faults import POINTS

    text = " ".join((ROOT / "README.md").read_text().split())
    listed = re.search(r"kills the controller at a named point \(([^)]*)\)", text).group(1)
    assert _backticked(listed) == list(POINTS)
