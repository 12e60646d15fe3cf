"""Issue 31, item 8: text from a trial is data, through the real sandboxed loop.

Two trials print terminal control sequences (a clipboard write, a window title, clear
screen, hidden text, a C1 CSI, a carriage return that overwrites, backspaces, NUL, a bidi
override, invisible tag characters) to their log; one crashes with them in its exception
message, the other is merely discarded. Their ideas' descriptions (what a model would
write) carry them too, and the source carries them raw in a comment. Afterwards no
control character but newline and tab is in the db (but the code columns, which hold the
exact diff: autoloop.base.text.CODE_COLUMNS), a trial's log file, the console of the
run, `autoloop show N`, `log`, `status`, `ideas`, or a model's brief.
"""

from __future__ import annotations

import sqlite3
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autoloop.proposers.seeding import seed_idea
from autoloop.store import Store
from tests.test_attacks import IMPORT_ANCHOR, _brief, _patched, _run, needs_bwrap
from tests.test_text import controls  # an oracle by Unicode's own categories

# Written as Python escapes in the source, so they are raw only when printed.
PAYLOAD = (r"\x1b]52;c;cm0gLXJmIH4K\x07\x1b]0;pwned title\x07\x1b[2J\x1b[H\x1b[8mHIDDEN\x1b[28m"
           r"\u009b2Jloss 9.9\rloss 0.01 (fake)\x08\x08\x00 \u202eexe.txt"
           r"\U000e0069\U000e0067\U000e006e\U000e006f\U000e0072\U000e0065")
# Raw in the source (a comment): a diff that holds them, shown and sent stripped.
RAW_COMMENT = "# \x1b]0;raw title\x07 \x1b[31mred\x1b[0m \u202edesrever\n"
SAY = ("import os as _os, sys as _sys\n" + RAW_COMMENT +
       "if 'AUTOLOOP_RESULT' in _os.environ:  # training, not the evaluator's import\n"
       f"    print('TERMINAL-ATTACK ' + '{PAYLOAD}', flush=True)\n"
       f"    print('TERMINAL-ATTACK on stderr ' + '{PAYLOAD}', file=_sys.stderr, flush=True)\n")
ATTACKS = {
    "terminal crash": _patched(IMPORT_ANCHOR, IMPORT_ANCHOR + SAY + (
        "    raise RuntimeError('TERMINAL-CRASH ' + '" + PAYLOAD + "')\n")),
    "terminal discard": _patched(IMPORT_ANCHOR, IMPORT_ANCHOR + SAY),
}
DESCRIPTION = "attack: {name} \x1b]0;title from a model\x07\x1b[2J \u202e(reversed)\x9b8m"


def _seed(repo: Path, config) -> None:
    original = (repo / "train.py").read_text()
    patches = repo.parent / "patches"
    patches.mkdir(exist_ok=True)
    for name, source in ATTACKS.items():
        (repo / "train.py").write_text(source)
        diff = subprocess.run(["git", "diff"], cwd=repo, capture_output=True, check=True).stdout
        (repo / "train.py").write_text(original)
        path = patches / (name.replace(" ", "_") + ".diff")
        path.write_bytes(diff)
        seed_idea(config, repo, DESCRIPTION.format(name=name), sets=[], patch=path)


def _db_controls(db: Path) -> dict[str, list[str]]:
    """Every text cell of every table with a control character in it, but the code columns."""
    from autoloop.base.text import CODE_COLUMNS

    found = {}
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            cursor = conn.execute(f"SELECT rowid, * FROM {table}")
            names = [d[0] for d in cursor.description]
            for row in cursor:
                for name, value in zip(names, row):
                    if isinstance(value, str) and (table, name) not in CODE_COLUMNS and controls(value):
                        found[f"{table}.{name} row {row[0]}"] = controls(value)
    finally:
        conn.close()
    return found


@pytest.mark.slow
@needs_bwrap
def test_control_sequences_from_a_trial_reach_no_terminal_db_or_brief(attacked_repo, monkeypatch, capsys):
    from autoloop.cli import app
    from autoloop.cli.display import Display
    from autoloop.loop.controller import Controller

    repo = attacked_repo  # the shared sandboxed baseline's run, ours to run on
    config = _run(repo, monkeypatch, max_steps=6, max_trials=len(ATTACKS))
    _seed(repo, config)
    Controller(config, repo, display=Display()).run()
    console = capsys.readouterr().out

    store = Store(repo / "experiments.db")
    try:
        trials = store.trials(store.get_run("a")["id"])
    finally:
        store.close()
    by_name = {name: t for t in trials for name in ATTACKS if name in (t.get("description") or "")}
    assert set(by_name) == set(ATTACKS), [t.get("description") for t in trials]
    crash, discard = by_name["terminal crash"], by_name["terminal discard"]
    assert crash["status"] == "crash", (crash["status"], crash["reason"])
    assert discard["status"] == "discard", (discard["status"], discard["reason"])
    # The attack ran: what it printed is there, as text.
    assert "TERMINAL-CRASH" in (crash["error_tail"] or "") + (crash["reason"] or "")
    logs = {p: p.read_text(errors="replace") for p in (repo / ".autoloop").rglob("*.log")}
    assert any("TERMINAL-ATTACK" in text and "HIDDEN" in text for text in logs.values()), sorted(map(str, logs))
    assert discard["diff"] and "\x1b]0;raw title" in discard["diff"]  # the code column holds the exact diff

    leaks = {f"db {where}": chars for where, chars in _db_controls(repo / "experiments.db").items()}
    leaks.update({f"file {p.relative_to(repo)}": controls(text) for p, text in logs.items() if controls(text)})
    leaks.update({"console of the run": controls(console)} if controls(console) else {})
    runner = CliRunner()
    commands = [["show", str(t["number"])] for t in (crash, discard)] + [
        ["show", str(crash["number"]), "--json"], ["log"], ["log", "--json"], ["status"], ["ideas"]]
    for args in commands:
        result = runner.invoke(app, [*args, "--repo", str(repo)])
        assert result.exit_code == 0, (args, result.output)
        if controls(result.output):
            leaks[f"autoloop {' '.join(args)}"] = controls(result.output)
    shown = runner.invoke(app, ["show", str(discard["number"]), "--repo", str(repo)]).output
    assert "TERMINAL-ATTACK" in shown and "HIDDEN" in shown  # the text is shown, as text
    brief = _brief(repo)
    assert "TERMINAL-CRASH" in brief  # the repair section quotes the crash
    if controls(brief):
        leaks["LLM brief"] = controls(brief)
    assert not leaks, "\n".join(f"{where}: {len(chars)} control characters ({' '.join(sorted(set(chars))[:8])})"
                                 for where, chars in sorted(leaks.items()))
