"""Secrets never leave the environment: redaction of everything stored, logged, shown or sent.

A trial's output (its log, its reasons, its diff) is untrusted text, and so is what a
model proposes; either can carry a secret the process could reach: an API key in a
`.env` file of the project, a token in the controller's environment. The sandbox keeps
both away from trials (an allow-listed environment; secret-looking files hidden), and
this module is the second line: every text autoloop writes to experiments.db
(autoloop.store), every log line it writes for a child process (autoloop.measure.runner),
every line it prints, and every brief it sends to a model (autoloop.proposers.brief) goes
through `redact`, which replaces

* the value of every environment variable of this process that is not on the sandbox's
  allow-list (autoloop.measure.sandbox: those are paths, locales and thread counts), when
  it is long enough to be a secret (SECRET_MIN_CHARS; 4 for a variable whose name says
  it holds one: TOKEN, SECRET, PASSWORD, ... anywhere in it, KEY or AUTH as a part of it;
  GIT_AUTHOR_NAME is the user's name, no secret) and is not a path, a number, a
  boolean or (for a variable whose name does not say secret) one plain lowercase word such
  as `protected` or `debug`: replacing words of the language would garble every message;
* every value of the `.env`-style files of the registered project folders (`register_project`);
* every key-shaped string (KEY_PATTERNS: OpenAI, Anthropic, GitHub, AWS, Slack, Hugging
  Face, Google and GitLab keys, bearer tokens, private key blocks), wherever it came from,

by `[redacted]`. The values are collected when the redactor is built and again when a
project is registered, so a key exported before `autoloop run` is covered; one exported in
another shell is not in this process and cannot leak from it.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from autoloop.base.secret_names import is_secret_file

REDACTED = "[redacted]"
SECRET_MIN_CHARS = 8
SECRET_NAME_MIN_CHARS = 4
# One lowercase word (a mode, a flag): a value no unnamed variable holds as a secret.
PLAIN_WORD = re.compile(r"[a-z][a-z_\-]{0,23}")
# A name says "secret" when it holds one of these anywhere (PGPASSWORD, HF_TOKEN) ...
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|COOKIE|PRIVATE|SIGNATURE", re.IGNORECASE)
# ... or one of these as a whole part between underscores (OPENAI_API_KEY, APIKEY,
# BASIC_AUTH): as substrings they are in names of no secret (GIT_AUTHOR_NAME holds the
# user's name, which is in their paths; KEYMAP, MONKEY_MODE, XDG_SESSION_TYPE).
SECRET_NAME_PARTS = frozenset({"KEY", "KEYS", "APIKEY", "ACCESSKEY", "AUTH", "AUTHORIZATION", "PASS"})

# Variables of a shell or a desktop whose values are not secrets (and appear in messages).
BENIGN_NAMES = frozenset({
    "PWD", "OLDPWD", "SHELL", "SHLVL", "HOSTNAME", "HOSTTYPE", "OSTYPE", "MACHTYPE", "TERM_PROGRAM",
    "TERM_PROGRAM_VERSION", "COLORTERM", "DISPLAY", "EDITOR", "VISUAL", "PAGER", "MAIL", "MANPATH", "INFOPATH",
    "LS_COLORS", "LSCOLORS", "_", "PS1", "PS2", "HISTFILE", "HISTSIZE", "HISTFILESIZE", "HISTCONTROL", "LESSOPEN",
    "LESSCLOSE", "SSH_TTY", "WINDOWID", "DESKTOP_SESSION", "XAUTHORITY", "GPG_TTY", "LOGNAME", "USERNAME",
    "GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL",  # in every commit anyway
})
KEY_PATTERNS = (
    r"sk-(?:ant-|proj-|svcacct-)?[A-Za-z0-9_\-]{16,}",
    r"gh[pousr]_[A-Za-z0-9]{20,}",
    r"github_pat_[A-Za-z0-9_]{20,}",
    r"(?:AKIA|ASIA)[0-9A-Z]{16}",
    r"xox[abprs]-[A-Za-z0-9\-]{10,}",
    r"hf_[A-Za-z0-9]{20,}",
    r"AIza[0-9A-Za-z_\-]{30,}",
    r"glpat-[A-Za-z0-9_\-]{20,}",
    r"(?i:bearer)\s+[A-Za-z0-9._\-~+/]{20,}=*",
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)",
)
DOTENV_FILES = (".env", ".env.local", ".envrc", ".secrets")
_DOTENV_LINE = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_.\-]*)\s*[=:]\s*(.*?)\s*$")


def secret_name(name: str) -> bool:
    """Whether a variable's name says it holds a secret (module docstring)."""
    if SECRET_NAME.search(name):
        return True
    return any(part in SECRET_NAME_PARTS for part in re.split(r"[^A-Z0-9]+", name.upper()))


def _is_path_like(value: str) -> bool:
    parts = [p for p in value.split(os.pathsep) if p]
    return bool(parts) and all(p.startswith(("/", "~", "./")) or os.path.exists(p) for p in parts)


def _plain(value: str) -> bool:
    """Values no secret takes: numbers, booleans, a single short word of letters."""
    v = value.strip()
    if not v:
        return True
    try:
        float(v)
        return True
    except ValueError:
        pass
    return v.lower() in ("true", "false", "yes", "no", "on", "off", "none", "null")


def environment_secrets(environ: Mapping[str, str], allowed) -> set[str]:
    """The values of `environ` that are secrets by the rules in the module docstring;
    `allowed(name)` says whether a name is on the sandbox's allow-list."""
    found = set()
    for name, value in environ.items():
        if not isinstance(value, str) or name in BENIGN_NAMES or _plain(value):
            continue
        named = secret_name(name)
        if not named and (allowed(name) or PLAIN_WORD.fullmatch(value)):
            continue
        if len(value) >= (SECRET_NAME_MIN_CHARS if named else SECRET_MIN_CHARS) and not _is_path_like(value):
            found.add(value)
    return found


def dotenv_secrets(folder: Path) -> set[str]:
    """The values of the `.env`-style files directly in `folder`."""
    return file_secrets(Path(folder) / name for name in DOTENV_FILES)


def file_secrets(paths: Iterable[Path]) -> set[str]:
    """The values of KEY=VALUE lines in the given files (those that exist)."""
    found = set()
    for path in paths:
        path = Path(path)
        try:
            if not path.is_file() or path.is_symlink() or path.stat().st_size > 1 << 20:
                continue
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            match = _DOTENV_LINE.match(line)
            if not match or line.lstrip().startswith("#"):
                continue
            value = match.group(2).strip().strip("'\"")
            if len(value) >= SECRET_NAME_MIN_CHARS and not _plain(value):
                found.add(value)
    return found


class Redactor:
    """Replaces known secret values and key-shaped strings by REDACTED."""

    def __init__(self, values: Iterable[str] = ()):
        self._lock = threading.Lock()
        self._values: set[str] = set()
        self._pattern: re.Pattern | None = None
        self.add(values)

    def add(self, values: Iterable[str]) -> None:
        with self._lock:
            new = {v for v in values if v and v != REDACTED} - self._values
            if not new and self._pattern is not None:
                return
            self._values |= new
            literal = [re.escape(v) for v in sorted(self._values, key=len, reverse=True)]
            self._pattern = re.compile("|".join(literal + list(KEY_PATTERNS)))

    def __call__(self, text: str) -> str:
        if not text:
            return text
        return self._pattern.sub(REDACTED, text)

_default: Redactor | None = None
_projects: set[Path] = set()
_default_lock = threading.Lock()


def _allowed(name: str) -> bool:
    from autoloop.base.environment import is_allowed

    return is_allowed(name)


def default_redactor() -> Redactor:
    """The process's redactor: this environment's secrets and those of registered projects."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Redactor(environment_secrets(os.environ, _allowed))
        return _default


def register_project(folder: Path | str) -> None:
    """Add the secrets of a project's `.env`-style files (and the environment's, again)."""
    folder = Path(folder)
    redactor = default_redactor()
    redactor.add(environment_secrets(os.environ, _allowed))
    with _default_lock:
        _projects.add(folder)
    redactor.add(dotenv_secrets(folder))


def register_files(paths: Iterable[Path | str]) -> None:
    """Add the values of those of `paths` that are secret files by their name (a worker
    process learns the project's from its job's hidden paths, which name them)."""
    default_redactor().add(file_secrets(Path(p) for p in paths if is_secret_file(p)))


def redact(text: str | None) -> str | None:
    """`text` with every secret replaced (None stays None)."""
    if text is None:
        return None
    return default_redactor()(text)


def secret_files(folder: Path | str, *, max_depth: int = 3, limit: int = 200) -> list[Path]:
    """Files under `folder` that hold secrets by convention (autoloop.base.secret_names), for the
    sandbox to hide: at most `max_depth` folders down, skipping .git, .autoloop and
    virtual environments, at most `limit` of them."""
    root = Path(folder)
    found: list[Path] = []
    skip = {".git", ".autoloop", "node_modules", "__pycache__", ".venv", "venv", ".tox", ".mypy_cache"}

    def walk(path: Path, depth: int) -> None:
        try:
            entries = list(os.scandir(path))
        except OSError:
            return
        for entry in entries:
            if len(found) >= limit:
                return
            if entry.is_dir(follow_symlinks=False):
                if depth < max_depth and entry.name not in skip and not entry.name.startswith(".venv") \
                        and not (Path(entry.path) / "pyvenv.cfg").exists():
                    walk(Path(entry.path), depth + 1)
            elif is_secret_file(entry.name):
                found.append(Path(entry.path))

    walk(root, 0)
    return found
