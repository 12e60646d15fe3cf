"""The change a diff makes, read the same way by the brief, the duplicate refusals and the
project's memory: normalised diffs and themes.

The normalised diff is the multiset of removed and added lines per file, stripped of
surrounding whitespace, blank lines dropped, and with a line that is both removed and added
(moved, re-indented) cancelled out: it does not depend on the diff algorithm, line numbers or
hunk headers. A theme is an UPPER_CASE constant a diff assigns (with its new value) or else
the top-level function or class a hunk falls in (git's hunk header).
"""

from __future__ import annotations

import re
from collections import Counter


def _diff_files(diff: str):
    """Yield (path, line) for each line of a unified diff, tracking the file it belongs to."""
    path = None
    for line in diff.splitlines():
        if line.startswith("diff --git "):
            match = re.match(r"diff --git a/(.*) b/(.*)$", line)
            path = match.group(2) if match else path
        elif line.startswith("+++ "):
            target = line[4:].strip()
            if target != "/dev/null":
                path = target[2:] if target.startswith("b/") else target
        elif line.startswith("--- "):
            source = line[4:].strip()
            if source != "/dev/null" and path is None:
                path = source[2:] if source.startswith("a/") else source
        else:
            yield path, line


def normalised_diff(diff: str | None) -> tuple:
    """The change a diff makes, independent of line numbers and the diff algorithm."""
    if not diff:
        return ()
    removed: Counter = Counter()
    added: Counter = Counter()
    for path, line in _diff_files(diff):
        if line.startswith(("+++", "---")) or not line[:1] in ("+", "-"):
            continue
        text = line[1:].strip()
        if not text:
            continue
        (added if line[0] == "+" else removed)[(path, text)] += 1
    common = removed & added
    removed, added = removed - common, added - common
    return tuple(sorted([("-", *key, n) for key, n in removed.items()] + [("+", *key, n) for key, n in added.items()]))


# Linear in the line: a lazy value followed by `\s*(?:#.*)?$` backtracked quadratically, so a
# trial's diff line of 100,000 spaces held the controller 135 s of CPU per brief.
_CONSTANT = re.compile(r"^([A-Z][A-Z0-9_]*)\s*(?::[^=]*)?=(.*)$")
_HUNK = re.compile(r"^@@ [^@]* @@ ?(.*)$")
_DEF = re.compile(r"^(?:async\s+)?(?:def|class)\s+([A-Za-z_]\w*)")


def diff_themes(diff: str | None) -> dict[str, str | None]:
    """{theme: value}: constants a diff assigns (value = the new text) and the top-level
    functions/classes it changes (value None). Other changes are theme 'other code'."""
    themes: dict[str, str | None] = {}
    context = None
    for _path, line in _diff_files(diff or ""):
        hunk = _HUNK.match(line)
        if hunk:
            found = _DEF.match(hunk.group(1).strip())
            context = found.group(1) + "()" if found else None
            continue
        if line.startswith(("+++", "---")) or line[:1] not in ("+", "-"):
            continue
        body = line[1:]
        if not body.strip() or body.lstrip().startswith("#"):
            continue
        constant = _CONSTANT.match(body)
        if constant:
            if line[0] == "+" or constant.group(1) not in themes:
                themes[constant.group(1)] = constant.group(2).split("#", 1)[0].strip() if line[0] == "+" else None
            continue
        defined = _DEF.match(body)
        if defined and not body.startswith((" ", "\t")):
            themes.setdefault(defined.group(1) + "()", None)
        else:
            themes.setdefault(context or "other code", None)
    return themes
