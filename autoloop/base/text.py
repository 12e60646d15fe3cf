"""Text from a trial is data: control characters stripped before it is stored, printed or sent.

A trial's log, its exception message, a model's description of its change: untrusted text
that reaches a terminal (`autoloop show`, `log`, `status`, the console of a run), the db
and a model's prompt. A terminal obeys what it prints, so the text of a trial could write
the user's clipboard (OSC 52), set the window's title (OSC 0), clear the screen (CSI 2J),
hide what follows (CSI 8m), move the cursor or overwrite a line (\\r, \\b), and a Unicode
bidi override (U+202E) shows text in an order that is not the one stored; tag characters
(U+E0000 block) are invisible on screen and read by a model. `strip_controls` removes

* whole escape sequences, so that colours leave no `[32m` behind: CSI (ESC [ or the C1
  byte 0x9B, up to its final byte), the strings OSC, DCS, SOS, PM and APC (ESC ], P, X,
  ^, _ or their C1 forms, up to BEL or ST), and two-character escapes (ESC c, ESC 7, ...);
  an unterminated string loses only its ESC, and what follows is shown as text;
* every other C0 control but newline and tab, DEL and the C1 controls (U+0080-U+009F);
* Unicode's format characters (category Cf: bidi embeddings, overrides and isolates,
  zero-width spaces, soft hyphen, BOM, tag characters), but the zero-width joiner and
  non-joiner that emoji and several scripts need; and lone surrogates, which no terminal
  or encoder takes,

and turns a carriage return into a newline (CR LF into one newline; the line separators
U+2028 and U+2029 too), so a progress bar's overwritten states read as lines, not as one.
Ordinary text of any script is kept as it is. The function is idempotent and linear.

Where it applies (docs/verification.md, "Text from a trial"): the Store strips every text
it writes (autoloop.store), except the columns that hold code applied again
(`CODE_COLUMNS`); a trial's log is stripped line by line as the worker writes it
(autoloop.measure.runner); the CLI strips everything it prints (autoloop.cli.common.echo)
and the console of a run (autoloop.cli.display), so rows and logs written before this
module print clean too; a model's brief is stripped whole (autoloop.proposers.brief).
Strip before redacting (autoloop.base.redact): a control character inside a key would
otherwise hide it from the key patterns.
"""

from __future__ import annotations

import re
from typing import Any

# Columns that hold code or a patch which is applied again (an ablation reverses a
# trial's diff, a near miss re-runs its edits, a seeded idea applies its patch): stripping
# would change the code, and the record would no longer be what ran. Every printer and
# every brief strips them on the way out.
CODE_COLUMNS: frozenset[tuple[str, str]] = frozenset({("trials", "diff"), ("trials", "edits"), ("ideas", "patch")})

# The longest OSC/DCS string taken whole; a longer one loses its ESC only (shown as text).
_MAX_STRING = 4096
_SEQUENCE = re.compile(
    r"(?:\x1b\[|\x9b)[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]"  # CSI: parameters, intermediates, final byte
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]{0,%d}(?:\x07|\x1b\\|\x9c)"  # OSC, DCS, SOS, PM, APC
    r"|\x1b[\x20-\x2f]*[\x30-\x7e]" % _MAX_STRING  # ESC c, ESC 7, ESC ( B, ...
)
_NEWLINES = re.compile("\r\n?|[\u2028\u2029]")
# C0 but \t and \n, DEL and C1; Cf but U+200C/U+200D (as of Unicode 15); surrogates.
_CONTROL = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f"
    "\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b\u200e\u200f\u202a-\u202e"
    "\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f"
    "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f"
    "\ud800-\udfff]"
)
# Anything either pass would change: a quick test that leaves clean text untouched (ASCII
# text, a log's usual line, has a shorter one).
_ANY = re.compile(_CONTROL.pattern[:-1] + "\r\u2028\u2029]")
_ANY_ASCII = re.compile("[\x00-\x08\x0b-\x1f\x7f]")


def strip_controls(text: str) -> str:
    """`text` without control characters but newline and tab (module docstring)."""
    if not text or not (_ANY_ASCII if text.isascii() else _ANY).search(text):
        return text
    text = _SEQUENCE.sub("", text)
    text = _NEWLINES.sub("\n", text)
    return _CONTROL.sub("", text)


def strip_controls_in(value: Any) -> Any:
    """`value` (JSON-like: dicts, lists, strings, numbers) with `strip_controls` applied to
    every string in it, keys included."""
    if isinstance(value, str):
        return strip_controls(value)
    if isinstance(value, dict):
        return {strip_controls_in(k): strip_controls_in(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strip_controls_in(v) for v in value]
    return value


def has_controls(text: str | None) -> bool:
    """Whether `strip_controls` would change `text`."""
    return bool(text) and strip_controls(text) != text
