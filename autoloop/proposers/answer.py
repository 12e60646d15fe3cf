"""Parsing an LLM's answer into a Proposal, robustly.

The answer format (program.md and the prompt both state it)::

    DESCRIPTION: one line saying what changes and why

    FILE: train.py
    <<<<<<< SEARCH
    exact lines of the current file
    =======
    the new lines
    >>>>>>> REPLACE

Models wrap this in prose, code fences, `<think>` sections and markdown, so the parser
looks for the markers rather than for a rigid layout:

* `<think>...</think>` reasoning is dropped first (local reasoning models emit it).
* Each SEARCH/REPLACE block (5 to 9 marker characters, as models miscount) belongs to the
  nearest file named before it on a line of its own: `FILE: path`, `### path`,
  `` `path` ``, `# path` or a fence info string such as ```` ```python train.py ````.
  Prose that mentions a file does not count. Without any, the first editable file.
* The description is the `DESCRIPTION:` line, else the first line of prose.
* No block but a unified diff (```` ```diff ```` or `--- a/`/`+++ b/` headers): the
  diff becomes the proposal's patch.

A SEARCH text that is not found verbatim is matched again ignoring trailing whitespace
and surrounding blank lines (`resolve_searches`); when that finds exactly one place, the
file's own text is used, so `materialize` applies it exactly. Anything else is left for
`materialize`/`validate` to reject with a reason the model can act on.
"""

from __future__ import annotations

import re

from autoloop.proposers.proposal import Edit, InvalidProposal, Proposal

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_BLOCK = re.compile(
    r"^[ \t]*<{5,9}[ \t]*SEARCH[^\n]*\n(.*?)^[ \t]*={5,9}[ \t]*\n(.*?)^[ \t]*>{5,9}[ \t]*REPLACE[^\n]*$",
    re.MULTILINE | re.DOTALL,
)
_DESCRIPTION = re.compile(r"^[ \t>*#_`-]*DESCRIPTION[*_`]*[ \t]*:[ \t]*[*_`]*[ \t]*(.+?)[ \t]*$", re.MULTILINE | re.IGNORECASE)
_PATH = re.compile(r"[\w][\w./-]*\.[A-Za-z0-9]+")
_FILE = re.compile(r"^[ \t#>*_`]*FILE[*_`]*[ \t]*:[ \t]*(\S+)[ \t]*$", re.IGNORECASE)
_DIFF_FENCE = re.compile(r"```(?:diff|patch)[^\n]*\n(.*?)```", re.DOTALL)
_DIFF_TEXT = re.compile(r"^(?:diff --git .*\n)?--- (?:a/|/dev/null).*\n\+\+\+ .*\n@@.*", re.MULTILINE | re.DOTALL)
MAX_DESCRIPTION = 200


def _path_on_line(line: str) -> str | None:
    """A file path if the line names one and nothing else (after markup)."""
    explicit = _FILE.match(line)
    if explicit:  # whatever follows FILE: is the path, even one that validation will refuse
        path = explicit.group(1).strip("`*_'\"")
        return path[2:] if path.startswith("./") else path
    text = line.strip()
    if text.startswith("```"):
        text = text[3:].replace(":", " ").split()[-1] if text[3:].strip() else ""
    text = re.sub(r"^(?:[#>*`\s]+)", "", text)
    text = re.sub(r"^(?:file|path|filename|in)\s*[:=]?\s*", "", text, flags=re.IGNORECASE)
    text = text.strip("`*_: \t")
    if text.startswith("./"):
        text = text[2:]
    return text if _PATH.fullmatch(text) else None


def _description(text: str, blocks_start: int) -> str:
    found = _DESCRIPTION.search(text)
    if found:
        return found.group(1).strip("*_` ")[:MAX_DESCRIPTION]
    for line in text[:blocks_start].splitlines():
        line = line.strip().strip("#*_` ").strip()
        if line and not line.startswith("```") and _path_on_line(line) is None and not line.lower().startswith("file"):
            return line[:MAX_DESCRIPTION]
    return ""


def parse_answer(text: str, default_path: str) -> Proposal:
    """Turn a model's answer into a Proposal (source "llm"); InvalidProposal if it has no
    edit in a recognisable form."""
    text = _THINK.sub("", text or "").replace("\r\n", "\n")
    blocks = list(_BLOCK.finditer(text))
    edits = []
    previous_end = 0
    for block in blocks:
        path = None
        for line in reversed(text[previous_end:block.start()].splitlines()):
            path = _path_on_line(line)
            if path:
                break
        search, replace = block.group(1), block.group(2)
        if not search.strip():
            raise InvalidProposal(
                "a SEARCH section is empty: to insert code, search for the neighbouring lines and repeat them in REPLACE"
            )
        path = path or default_path
        if path.startswith("/") or ".." in path.split("/"):
            raise InvalidProposal(f"edits a path outside the repository: {path}")
        edits.append(Edit(path=path, search=search, replace=replace))
        previous_end = block.end()
    if edits:
        description = _description(text, blocks[0].start())
        return Proposal(description=description or "LLM edit", edits=edits, source="llm")
    fenced = _DIFF_FENCE.search(text)
    diff = fenced.group(1) if fenced else None
    if diff is None:
        bare = _DIFF_TEXT.search(text)
        diff = bare.group(0) if bare else None
    if diff and "@@" in diff:
        start = fenced.start() if fenced else text.find(diff)
        description = _description(text, start)
        return Proposal(description=description or "LLM edit", patch=diff if diff.endswith("\n") else diff + "\n",
                        source="llm")
    raise InvalidProposal(
        "the answer has no edit: give DESCRIPTION: and then FILE: <path> with <<<<<<< SEARCH / ======= / "
        ">>>>>>> REPLACE blocks"
    )


def _match_loosely(text: str, search: str) -> str | None:
    """The unique span of `text` equal to `search` up to trailing whitespace per line and
    blank lines around it; None when there is no such span or more than one."""
    wanted = [line.rstrip() for line in search.splitlines()]
    while wanted and not wanted[0]:
        wanted.pop(0)
    while wanted and not wanted[-1]:
        wanted.pop()
    if not wanted:
        return None
    lines = text.splitlines(keepends=True)
    stripped = [line.rstrip() for line in lines]
    hits = [i for i in range(len(lines) - len(wanted) + 1) if stripped[i:i + len(wanted)] == wanted]
    if len(hits) != 1:
        return None
    span = "".join(lines[hits[0]:hits[0] + len(wanted)])
    # Keep the original's ending: a search without a final newline replaces no newline.
    return span if search.endswith("\n") or not span.endswith("\n") else span[:-1]


def resolve_searches(proposal: Proposal, read_parent_file) -> Proposal:
    """Replace each SEARCH text that only matches loosely by the file's exact text.

    Edits apply in order, so each search is resolved against the file as the edits
    before it leave it, as `materialize` will apply them.
    """
    current: dict[str, str | None] = {}
    for edit in proposal.edits:
        if edit.search is None:
            continue
        if edit.path not in current:
            current[edit.path] = read_parent_file(edit.path)
        text = current[edit.path]
        if text is None:
            continue
        if text.count(edit.search) != 1:
            exact = _match_loosely(text, edit.search)
            if exact is not None and text.count(exact) == 1:
                if edit.search.endswith("\n") and not exact.endswith("\n"):
                    edit.replace = (edit.replace or "").rstrip("\n")
                edit.search = exact
        if text.count(edit.search) == 1:
            current[edit.path] = text.replace(edit.search, edit.replace or "", 1)
    return proposal
