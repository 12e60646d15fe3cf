"""Text from a trial is data (autoloop.base.text): known answers for every class of control."""

from __future__ import annotations

import re
import sys
import unicodedata

import pytest

from autoloop.base.text import has_controls, strip_controls, strip_controls_in

ESC = "\x1b"


@pytest.mark.parametrize("raw, clean", [
    # OSC 52: a write to the user's clipboard, terminated by BEL or by ST (ESC \).
    (f"ok{ESC}]52;c;cm0gLXJmIH4K\x07 done", "ok done"),
    (f"ok{ESC}]52;c;cm0gLXJmIH4K{ESC}\\ done", "ok done"),
    # OSC 0: the window's title.
    (f"{ESC}]0;you have been pwned\x07loss 3.2", "loss 3.2"),
    # CSI 2J (clear the screen), CSI H (cursor home), CSI 8m (hidden text) and its end.
    (f"step 5{ESC}[2J{ESC}[H", "step 5"),
    (f"visible {ESC}[8mhidden{ESC}[28m visible", "visible hidden visible"),
    # Colours leave no "[32m" behind.
    (f"{ESC}[1;32mOK{ESC}[0m", "OK"),
    # C1 CSI (0x9B) and C1 OSC (0x9D, ended by C1 ST 0x9C), as code points.
    ("a\x9b2Jb", "ab"),
    ("a\x9d0;title\x9cb", "ab"),
    # DCS, and two-character escapes (reset, save cursor, a character set).
    (f"a{ESC}Pq#0;2;0;0;0{ESC}\\b", "ab"),
    (f"a{ESC}cb{ESC}7c{ESC}(Bd", "abcd"),
    # An unterminated OSC: only its introducer goes, the rest is shown as text.
    (f"a{ESC}]52;c;payload", "a52;c;payload"),
    # A lone ESC at the end.
    (f"end{ESC}", "end"),
    # \r would overwrite the line; CR LF is one newline.
    ("loss 3.1\rloss 0.01 (fake)", "loss 3.1\nloss 0.01 (fake)"),
    ("line one\r\nline two\r\n", "line one\nline two\n"),
    # Backspaces, NUL, BEL, vertical tab, form feed, DEL, the other C0 and C1 controls.
    ("val_bpb 3.9\x08\x08\x08 0.1", "val_bpb 3.9 0.1"),
    ("a\x00b\x07c\x0bd\x0ce\x7ff\x85g\x9fh\x1ci", "abcdefghi"),
    # Bidi: an override, embeddings and isolates; and the line separators become newlines.
    ("file\u202eexe.txt", "fileexe.txt"),
    ("a\u202ab\u202cc\u2066d\u2069e\u200ef\u200fg\u061ch", "abcdefgh"),
    ("one\u2028two\u2029three", "one\ntwo\nthree"),
    # Invisible: zero-width space, word joiner, BOM, soft hyphen, and tag characters
    # (ASCII smuggled to a model: "ignore" in tags).
    ("a\u200bb\u2060c\ufeffd\u00ade", "abcde"),
    ("please " + "".join(chr(0xE0000 + ord(c)) for c in "ignore") + "\U000e0001.", "please ."),
    # A lone surrogate (from a JSON "\ud800") makes encoders fail.
    ("x\ud800y\udfffz", "xyz"),
])
def test_each_class_of_control_is_stripped(raw, clean):
    assert strip_controls(raw) == clean
    assert has_controls(raw)
    assert strip_controls(clean) == clean  # idempotent


@pytest.mark.parametrize("text", [
    "Traceback (most recent call last):\n\tFile \"train.py\", line 3\nRuntimeError: boom\n",
    "val_bpb: 1.234567\ntraining_seconds: 30.1\n",
    "naïve café, Ελληνικά, русский, 中文, 日本語, 한국어, עברית, العربية, हिन्दी",
    "emoji: 👍🏽 👨\u200d👩\u200d👧 ❤\ufe0f, a Persian ZWNJ: می\u200cخواهم",
    "math: ∑ x² ≤ ∞, arrows → ←, box ┌─┐, quotes “ ” « »",
    "",
])
def test_ordinary_text_newlines_and_tabs_are_kept(text):
    assert strip_controls(text) == text
    assert not has_controls(text)


def test_every_control_and_format_character_of_this_unicode_is_stripped():
    """Against unicodedata's own categories (the module's list is Unicode 15's): every Cc
    but \\t and \\n, every Cf but ZWJ and ZWNJ, every surrogate."""
    missed = []
    for code in range(sys.maxunicode + 1):
        char = chr(code)
        category = unicodedata.category(char)
        if category in ("Cc", "Cf", "Cs") and char not in "\t\n\r\u200c\u200d":
            if strip_controls(f"a{char}\n") != "a\n":  # a newline ends no escape sequence
                missed.append(f"U+{code:04X} {category}")
    assert not missed, missed


def test_no_printable_character_is_stripped():
    """Letters, marks, numbers, punctuation, symbols and spaces of every script stay."""
    kept = "".join(chr(c) for c in range(sys.maxunicode + 1)
                   if unicodedata.category(chr(c))[0] in "LMNPSZ" and chr(c) not in "\u2028\u2029")
    assert strip_controls(kept) == kept


def test_nested_values_are_stripped_keys_included():
    value = {"reason\x1b[2J": ["a\x07", {"b": "c\u202e"}], "n": 3, "x": None, "f": 1.5}
    assert strip_controls_in(value) == {"reason": ["a", {"b": "c"}], "n": 3, "x": None, "f": 1.5}


def test_a_long_hostile_text_is_stripped_in_linear_time():
    import time

    hostile = (ESC + "]" + "a" * 5000 + ESC + "[" + "1;" * 5000) * 20  # unterminated strings, endless parameters
    started = time.perf_counter()
    out = strip_controls(hostile)
    assert time.perf_counter() - started < 1.0
    assert not has_controls(out)


# ---------------------------------------------------------------------------- where it applies

ATTACK = f"{ESC}]52;c;cm0gLXJmIH4K\x07{ESC}]0;pwned\x07{ESC}[2J{ESC}[8mHIDDEN{ESC}[28m\x9b2Jx\ry\x08\x00\u202eexe"
SHOWN = "HIDDENx\nyexe"  # what is left of ATTACK: its text, as text


def controls(text: str | None) -> list[str]:
    """The control characters of `text` but newline and tab, by Unicode's own categories
    (an oracle independent of autoloop.base.text)."""
    return [f"U+{ord(c):04X}" for c in text or ""
            if unicodedata.category(c) in ("Cc", "Cf", "Cs") and c not in "\n\t\u200c\u200d"]


def test_the_oracle_sees_every_class():
    assert controls(ATTACK) and controls("\U000e0041") and controls("\ud800") and not controls(SHOWN + "\t")
    assert strip_controls(ATTACK) == SHOWN


def test_the_store_strips_every_text_but_keeps_code_exact(tmp_path):
    from autoloop.store import Store

    store = Store(tmp_path / "experiments.db")
    try:
        run = store.create_run("t", config={"note": ATTACK})
        diff = f"+# {ATTACK}\n"
        trial = store.new_trial(run["id"], "proposal", description=ATTACK, reason=ATTACK, error_tail=ATTACK,
                                diff=diff, edits={"edits": [{"search": "a", "replace": ATTACK}]},
                                result={"note": ATTACK, ATTACK: 1})
        store.add_event(run["id"], "note", ATTACK, trial_id=trial["id"])
        idea = store.add_idea(ATTACK, patch=diff)
        store.add_proposal_record(run_id=run["id"], trial_id=trial["id"], proposer="llm", error=ATTACK)
        row = store.trial_by_id(trial["id"])
        assert (row["description"], row["reason"], row["error_tail"]) == (SHOWN,) * 3
        assert row["result"] == {"note": SHOWN, SHOWN: 1}
        assert store.get_run("t")["config"] == {"note": SHOWN}
        assert store.events(run["id"])[-1]["message"] == SHOWN
        assert store.ideas()[0]["text"] == SHOWN
        # Code applied again (an ablation's reversed diff, a near miss's edits, a seeded
        # patch) stays the bytes that ran; every printer strips it.
        assert row["diff"] == diff and store.ideas()[0]["patch"] == diff
        assert row["edits"] == {"edits": [{"search": "a", "replace": ATTACK}]}
        assert idea["text"] == SHOWN
        assert store.query("SELECT error FROM proposals")[0]["error"] == SHOWN
        # A lone surrogate (a result JSON's "\ud800") made SQLite's encoder raise in the controller.
        assert store.new_trial(run["id"], "proposal", reason="x\ud800y")["reason"] == "xy"
    finally:
        store.close()


def test_a_childs_log_is_stripped_line_by_line(tmp_path):
    import subprocess

    from autoloop.measure.logpipe import LogPipe

    pipe = LogPipe(tmp_path / "train.log")
    child = subprocess.Popen([sys.executable, "-c", f"import sys; print({ATTACK!r}); print({ATTACK!r}, file=sys.stderr)"],
                             stdout=pipe.write_fd, stderr=pipe.write_fd, pass_fds=(pipe.write_fd,))
    pipe.start()
    child.wait()
    pipe.close()
    assert pipe.text() == f"{SHOWN}\n{SHOWN}\n"
    assert (tmp_path / "train.log").read_text() == f"{SHOWN}\n{SHOWN}\n"


@pytest.fixture
def old_db(tmp_path):
    """A db and a log written by code that stored a trial's text raw: its rows are
    rewritten with sqlite3 itself, past the Store's stripping."""
    import sqlite3

    from autoloop.store import Store
    from tests.conftest import make_repo

    repo = make_repo(tmp_path / "repo", "print('hi')\n")
    log = tmp_path / "train.log"
    log.write_text(f"step 1\n{ATTACK}\nTraceback (most recent call last):\nRuntimeError: {ATTACK}\n")
    store = Store(repo / "experiments.db")
    try:
        run = store.create_run("old", branch="autoloop/old")
        store.new_trial(run["id"], "baseline", status="keep", metric=3.0)
        crash = store.new_trial(run["id"], "proposal", status="crash", log_path=str(log))
        store.new_trial(run["id"], "proposal")  # running: `status` shows its description
        store.add_event(run["id"], "note", "x", trial_id=crash["id"])
        store.add_idea("x")
    finally:
        store.close()
    conn = sqlite3.connect(repo / "experiments.db")
    with conn:
        conn.execute("UPDATE trials SET description = ?, reason = ?, error_tail = ?, diff = ? WHERE number > 1",
                     (ATTACK, ATTACK, ATTACK, f"--- a/train.py\n+++ b/train.py\n+# {ATTACK}\n"))
        conn.execute("UPDATE events SET message = ?", (ATTACK,))
        conn.execute("UPDATE ideas SET text = ?", (ATTACK,))
        conn.execute("UPDATE runs SET pause_reason = ?", (ATTACK,))
    conn.close()
    return repo


@pytest.mark.parametrize("args", [["show", "2"], ["show", "3"], ["show", "2", "--json"], ["log"], ["log", "--json"],
                                  ["status"], ["status", "--json"], ["ideas"], ["ideas", "--json"], ["best"],
                                  ["export"]])
def test_the_cli_prints_an_old_dbs_rows_and_logs_clean(old_db, args):
    from typer.testing import CliRunner

    from autoloop.cli import app

    result = CliRunner().invoke(app, [*args, "--repo", str(old_db)] + (["--no-remeasure"] if args == ["best"] else []))
    assert result.exit_code == 0, result.output
    assert not controls(result.output), (args, controls(result.output))
    if "--json" in args:  # escaped by JSON, the characters would still reach whoever decodes it
        import json

        decoded = json.dumps(json.loads(result.output), ensure_ascii=False)
        assert not controls(decoded), (args, controls(decoded))
    if args[:2] == ["show", "2"] and "--json" not in args:
        assert "HIDDEN" in result.output and "RuntimeError: HIDDENx" in result.output  # the log's tail, as text


def test_diff_piped_is_exact_for_git_apply(old_db):
    from typer.testing import CliRunner

    from autoloop.cli import app

    out = CliRunner().invoke(app, ["diff", "2", "--repo", str(old_db)]).output
    assert out == f"--- a/train.py\n+++ b/train.py\n+# {ATTACK}\n"


def test_a_notification_carries_a_trials_text_stripped(tmp_path):
    import json

    from autoloop.loop.notify import Notifier

    out, env_out = tmp_path / "events.jsonl", tmp_path / "env.txt"
    notifier = Notifier(f'cat >> {out}; printf "%s\\n" "$AUTOLOOP_MESSAGE" >> {env_out}', timeout=10, tag="t")
    notifier.trial_finished({"kind": "proposal", "status": "keep", "number": 2, "description": ATTACK,
                             "metric": 1.0, "delta": -0.1, "decision": {"action": "keep"}})
    notifier.worker_lost("w", {"number": 3}, ATTACK)
    assert notifier.close() is None and notifier.sent == 2
    events = [json.loads(line) for line in out.read_text().splitlines()]
    assert events[0]["description"] == SHOWN and events[1]["reason"] == SHOWN
    assert not [controls(e["message"]) for e in events if controls(e["message"])]
    assert "HIDDENx y" in env_out.read_text() and not controls(env_out.read_text())


def test_the_console_of_a_run_prints_a_trials_text_stripped():
    import io

    from rich.console import Console

    from autoloop.cli.display import Display

    out = io.StringIO()
    display = Display(Console(file=out, force_terminal=True, width=400))
    display.later(f"header {ATTACK}")
    display.say(f"trial 2 [proposal] {ATTACK}")
    display.trial_finished({"number": 2, "status": "crash", "reason": ATTACK})
    printed = out.getvalue()
    assert "HIDDENx" in printed
    # As on a terminal: rich's own styles are ESC [ ... m; nothing else may be there.
    assert not controls(re.sub(r"\x1b\[[0-9;]*m", "", printed))


def test_the_repair_section_sent_to_a_model_is_stripped():
    from autoloop.proposers.brief import repair_section

    text = repair_section({"number": 4, "description": ATTACK, "reason": ATTACK, "error_tail": ATTACK})
    assert "HIDDENx" in text and not controls(text)
