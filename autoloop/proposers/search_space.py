"""The search space of the built-in `search` proposer: which constants of train.py it
searches, in what order, and how each one moves.

Every module-level UPPER_CASE constant whose value is a number or a boolean literal (or
simple arithmetic of literals, such as `2**19`) is a candidate. Tuples, strings and
expressions that use names are left alone.

Hints (a trailing comment)
--------------------------
The comment after a constant is split into clauses on ';'. A clause is a *hint clause*
only if every word in it is a hint term, so ordinary prose ("learning rate", "the
coefficient table has 5") is never mistaken for a hint. Terms (case-insensitive, comma
or space separated):

    range LO..HI        bounds, inclusive (`range` may be left out: `1e-4..1`)
    log | linear        multiplicative or additive steps
    int | integer       integer values
    pow2 | power of two values are powers of two (doubled and halved)
    step X              the first step: a factor for log, an increment for linear
    fixed               never searched
    speed               changes speed or memory only, never what is learned (a speed knob)

    LR = 0.02  # learning rate; range 0.0001..1 log
    WIDTH = 64  # model width; power of two
    MUON_NS_STEPS = 5  # iterations (the table has 5); range 1..5 int

With `linear`, the first step is an eighth of the range (a quarter of the value without
one). A hint clause that contradicts itself (LO >= HI, a log range that reaches 0) is an
error naming the line, not something silently ignored.

Defaults without hints
----------------------
- booleans are flipped;
- positive floats move multiplicatively (x2 / /2 at first); zero floats additively
  (+0.1); names that read as fractions (RATIO, FRAC, MOMENTUM, BETA, DROPOUT, ...) with a
  value in [0, 1] move additively (0.1 at first) but never more than halfway to 0 or 1,
  so 0.95 becomes 0.975, not 1.0;
- integers that are powers of two and look like sizes (>= 16, written `2**k`, or named
  *BATCH*, *HEAD*, *DIM*, *WIDTH*, *SIZE*, *TOKENS*) are doubled and halved, and written
  back as `2**k` when they were written that way; other small integers (< 16) move by 1;
  larger ones multiplicatively, rounded;
- positive integers stay >= 1.

Order of attack
---------------
From training practice: learning rates, then the batch size, weight decay, the schedule
(warm-up, warm-down, final LR fraction), the rest, speed knobs, and architecture sizes
last (they change the cost of a step as well as the model). Within a group, file order.
Logging, evaluation, checkpointing and seed constants are not searched unless a hint asks
for it.

Speed knobs
-----------
Splitting the same total batch differently between the per-device batch and gradient
accumulation does the same arithmetic, only faster or slower. The search recognises it:

- a per-device batch (`*BATCH*` with DEVICE/MICRO/LOCAL/PER) next to a total batch
  (`*BATCH*` with TOTAL/GLOBAL/EFFECTIVE) is a speed knob: the script derives the
  accumulation from the total, so changing it alone keeps the total;
- a per-device batch next to an accumulation constant (ACCUM) and no total is moved in
  a pair with it (per-device x2, accumulation /2, and back), a two-line diff;
- any other batch constant changes the total batch: a quality change, the batch group.

A constant whose hint says `speed` is a speed knob too: train.py marks LOSS_CHUNK_BYTES
(the loss's working memory) and ATTENTION_AUTO_MARGIN (which kernel runs attention) so,
because either changes only how fast and in how much memory the same maths runs.

Speed knobs cannot change val_bpb in step mode (same steps, same tokens, same maths), so
they are searched only when trials run on a time budget, where a faster step means more
steps; they come after the quality constants.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass, replace

from autoloop.errors import AutoloopError
from autoloop.pyconst import Constant, Expression, current_device, device_branch, evaluate_text, read_constants
from autoloop import pyast

GROUP_ORDER = ("lr", "batch", "weight_decay", "schedule", "other", "speed", "architecture")
GROUP_LABELS = {
    "lr": "learning rate",
    "batch": "batch size",
    "weight_decay": "weight decay",
    "schedule": "schedule",
    "other": "other",
    "speed": "speed or memory only: the same maths",
    "architecture": "architecture",
}

MAX_LEVEL = 2  # the biggest step is the first step applied 2**2 = 4 times over (x16 for x2)

_SKIP_TOKENS = {"LOG", "LOGGING", "EVERY", "CURVE", "EVAL", "SEED", "PRINT", "VERBOSE", "DEBUG", "SAVE",
                "CHECKPOINT", "COMPILE", "PROFILE", "WANDB", "MODE"}
_SCHEDULE_TOKENS = {"WARMUP", "WARMDOWN", "COOLDOWN", "ANNEAL", "SCHEDULE"}
_ARCH_TOKENS = {"DEPTH", "WIDTH", "DIM", "HEAD", "HEADS", "LAYER", "LAYERS", "EMBD", "EMBED", "HIDDEN", "MLP",
                "VOCAB", "SEQ", "CONTEXT", "KV", "EXPERTS", "ROPE"}
_FRACTION_TOKENS = {"RATIO", "FRAC", "FRACTION", "DROPOUT", "MOMENTUM", "BETA", "BETA1", "BETA2", "PROB", "SMOOTHING"}
_SIZE_TOKENS = {"BATCH", "HEAD", "HEADS", "DIM", "WIDTH", "EMBD", "SIZE", "TOKENS", "HIDDEN"}
_DEVICE_BATCH_TOKENS = {"DEVICE", "MICRO", "LOCAL", "PER"}
_TOTAL_BATCH_TOKENS = {"TOTAL", "GLOBAL", "EFFECTIVE"}
_ACCUM_TOKENS = {"ACCUM", "ACCUMULATION"}


# ---------------------------------------------------------------------------------- hints


@dataclass(frozen=True)
class Hints:
    lo: float | None = None
    hi: float | None = None
    scale: str | None = None  # "log" | "linear"
    integer: bool = False
    pow2: bool = False
    fixed: bool = False
    step: float | None = None
    speed: bool = False

    @property
    def given(self) -> bool:
        return self != Hints()


_POW2_WORDS = re.compile(r"\bpowers?[\s-]+of[\s-]+two\b", re.IGNORECASE)


def _number(text: str) -> float:
    """A number in a hint: a float literal or arithmetic of literals (`2**10`, `3e-4`).
    The comment is a trial's text: evaluated within pyconst's caps (Unreadable is a ValueError)."""
    try:
        return float(text)
    except ValueError:
        pass
    value = evaluate_text(text)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(text)
    try:
        return float(value)
    except OverflowError:  # an int past a float's range
        raise ValueError(text) from None


def _parse_clause(clause: str) -> dict | None:
    """The hints of one clause, or None when the clause is prose."""
    words = _POW2_WORDS.sub("pow2", clause).replace(",", " ").split()
    if not words:
        return None
    found: dict = {}
    i = 0
    while i < len(words):
        word = words[i].lower()
        if word == "range" and i + 1 < len(words) and ".." in words[i + 1]:
            word, i = words[i + 1], i + 1
        if ".." in word:
            lo, _, hi = word.partition("..")
            try:
                found["lo"], found["hi"] = _number(lo), _number(hi)
            except (ValueError, SyntaxError):
                return None
        elif word in ("log", "linear"):
            found["scale"] = word
        elif word in ("int", "integer"):
            found["integer"] = True
        elif word == "pow2":
            found["pow2"] = True
        elif word == "fixed":
            found["fixed"] = True
        elif word == "speed":
            found["speed"] = True
        elif word == "step" and i + 1 < len(words):
            try:
                found["step"] = _number(words[i + 1])
            except (ValueError, SyntaxError):
                return None
            i += 1
        else:
            return None
        i += 1
    return found


def parse_hints(comment: str, *, name: str = "?", where: str = "train.py") -> Hints:
    """The hints in a constant's trailing comment (see the module docstring)."""
    merged: dict = {}
    for clause in comment.split(";"):
        parsed = _parse_clause(clause)
        if parsed:
            merged.update(parsed)
    hints = Hints(**merged)
    problem = None
    if hints.lo is not None and hints.hi is not None and hints.lo >= hints.hi:
        problem = f"range {hints.lo:g}..{hints.hi:g} is empty"
    elif hints.scale == "log" and hints.lo is not None and hints.lo <= 0:
        problem = f"a log range must stay above 0, not start at {hints.lo:g}"
    elif hints.pow2 and hints.lo is not None and hints.lo < 1:
        problem = f"a power-of-two range must start at 1 or more, not {hints.lo:g}"
    elif hints.step is not None and (hints.step <= 0 or (hints.scale == "log" and hints.step <= 1)):
        problem = f"step {hints.step:g} does not move (use a factor > 1 for log, an increment > 0 for linear)"
    if problem:
        raise AutoloopError(f"{where}: the search hint for {name} ({comment!r}): {problem}; fix the comment")
    return hints


# ---------------------------------------------------------------------------------- params


def _tokens(name: str) -> set[str]:
    return {t for t in name.split("_") if t}


def _is_pow2(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1 and value & (value - 1) == 0


def _round_float(value: float, digits: int) -> float:
    """A few significant digits: values stay readable and a re-read gives the same float."""
    if value == 0 or not math.isfinite(value):
        return value
    return float(f"{value:.{digits}g}")


@dataclass(frozen=True)
class Param:
    """One searchable constant and how it moves."""

    name: str
    value: object  # bool | int | float: the parent's value
    source: str  # its source text, e.g. "2**19"
    lineno: int
    group: str
    kind: str  # "bool" | "int" | "float"
    scale: str  # "flip" | "log" | "linear" | "fraction"
    step: float = 2.0  # first step: factor (log) or increment (linear, fraction)
    min_level: int = 0  # smallest step = step applied 2**min_level times over
    pow2: bool = False
    lo: float | None = None
    hi: float | None = None
    partner: str | None = None  # speed pair: the accumulation constant moved inversely
    partner_value: int | None = None
    shadowed: bool = False  # assigned again later at module level (e.g. in a CPU-scale `if` block)

    @property
    def order(self) -> tuple[int, int]:
        return GROUP_ORDER.index(self.group), self.lineno

    @property
    def restart_level(self) -> int:
        """The level a new round starts at: one above the smallest step."""
        return min(0, self.min_level + 1)

    def summary(self) -> str:
        """How this constant moves, in a few words (for `autoloop search-plan`)."""
        if self.scale == "flip":
            how = "flipped"
        elif self.scale == "log":
            how = "powers of two, x2 first" if self.pow2 else f"x{self.step:g} first, down to x{self.step ** (2.0 ** self.min_level):.3g}"
        elif self.scale == "fraction":
            how = f"+-{self.step:g} first, at most halfway to {self.lo:g} or {self.hi:g}"
        else:
            how = f"+-{self.step:g} first" + ("" if self.min_level >= 0 else f", down to +-{self.step * 2.0 ** self.min_level:g}")
        if self.kind == "int" and not self.pow2 and self.scale != "flip":
            how += ", integers"
        if self.lo is not None and self.hi is not None:
            how += f", range {self.lo:g}..{self.hi:g}"
        elif self.lo is not None:
            how += f", >= {self.lo:g}"
        elif self.hi is not None:
            how += f", <= {self.hi:g}"
        if self.partner:
            how += f", with {self.partner} moved inversely"
        if self.shadowed:
            how += "; reassigned further down (e.g. a CPU block)"
        return how

    def _clamp(self, value):
        if self.lo is not None and value < self.lo:
            value = self.lo
        if self.hi is not None and value > self.hi:
            value = self.hi
        return value

    def _cast(self, value):
        if self.kind == "int":
            return int(value)
        # Log steps are ratios: three significant digits; additive ones keep four.
        return _round_float(float(value), 3 if self.scale == "log" else 4)

    def _render(self, value):
        if self.pow2 and "**" in self.source and _is_pow2(value):
            return Expression(f"2**{value.bit_length() - 1}")
        return value

    def move(self, direction: int, level: int) -> dict | None:
        """The constants to set for one step (direction +1 up, -1 down; level 0 = the
        first step), or None when the value cannot move that way (a bound, or rounding)."""
        value = self.value
        if self.scale == "flip":
            return {self.name: not value}
        if self.scale == "log":
            if value == 0:
                return None  # a multiplicative step cannot leave 0
            factor = self.step ** (2.0 ** level)
            new = value * factor if direction > 0 else value / factor
            if self.pow2:
                exponent = round(math.log2(new)) if new > 0 else 0
                new = 2 ** max(exponent, 0)
            elif self.kind == "int":
                rounded = round(new)
                # Rounding must not swallow the step: move by at least one.
                new = rounded if rounded != value else value + direction
        else:
            increment = self.step * (2.0 ** level)
            if self.scale == "fraction":
                room = (self.hi - value) if direction > 0 else (value - self.lo)
                increment = min(increment, room / 2)
            new = value + direction * increment
            if self.kind == "int":
                new = round(new)
            else:
                new = round(new, 9)  # drop binary noise (0.1 + 0.2) before rounding digits
        new = self._clamp(self._cast(new))
        if self.pow2 and self.kind == "int" and not _is_pow2(new):
            return None  # a bound that is not a power of two
        if new == value:
            return None
        sets = {self.name: self._render(new)}
        if self.partner is not None:
            # Per-device batch x f, accumulation / f: the total batch is unchanged.
            if new > value:
                if new % value or self.partner_value % (new // value):
                    return None
                partner = self.partner_value // (new // value)
            else:
                if value % new:
                    return None
                partner = self.partner_value * (value // new)
            if partner < 1:
                return None
            sets[self.partner] = partner
        return sets


def _group(name: str) -> str:
    tokens = _tokens(name)
    if tokens & _SKIP_TOKENS:
        return "skip"
    if tokens & _SCHEDULE_TOKENS or ("LR" in tokens and tokens & {"FRAC", "MIN", "FINAL", "RATIO"}):
        return "schedule"
    if "LR" in tokens or "LEARNING" in tokens:
        return "lr"
    if {"WEIGHT", "DECAY"} <= tokens or "WD" in tokens:
        return "weight_decay"
    if "BATCH" in tokens or tokens & _ACCUM_TOKENS:
        return "batch"
    if tokens & _ARCH_TOKENS or name.startswith("N_"):
        return "architecture"
    return "other"


def _default_param(const: Constant, group: str) -> Param | None:
    value = const.value
    tokens = _tokens(const.name)
    base = dict(name=const.name, value=value, source=const.source, lineno=const.lineno, group=group)
    if isinstance(value, bool):
        return Param(**base, kind="bool", scale="flip")
    if isinstance(value, int):
        if _is_pow2(value) and (value >= 16 or "**" in const.source or tokens & _SIZE_TOKENS):
            return Param(**base, kind="int", scale="log", step=2.0, pow2=True, lo=1)
        if abs(value) < 16:
            return Param(**base, kind="int", scale="linear", step=1.0, lo=1 if value >= 1 else None)
        return Param(**base, kind="int", scale="log", step=2.0, min_level=-2, lo=1 if value >= 1 else None)
    if isinstance(value, float) and math.isfinite(value):
        if tokens & _FRACTION_TOKENS and 0.0 <= value <= 1.0:
            return Param(**base, kind="float", scale="fraction", step=0.1, min_level=-2, lo=0.0, hi=1.0)
        if value == 0.0:
            return Param(**base, kind="float", scale="linear", step=0.1, min_level=-2, lo=0.0)
        return Param(**base, kind="float", scale="log", step=2.0, min_level=-2)
    return None


def _apply_hints(param: Param, hints: Hints) -> Param:
    changes: dict = {}
    if hints.integer or hints.pow2:
        changes.update(kind="int", value=int(round(param.value)))
    value = changes.get("value", param.value)
    integer = changes.get("kind", param.kind) == "int"
    lo, hi = hints.lo, hints.hi
    if integer:
        lo = math.ceil(lo) if lo is not None else lo
        hi = math.floor(hi) if hi is not None else hi
    if hints.pow2:
        changes.update(scale="log", step=2.0, min_level=0, pow2=True)
        lo = max(lo or 1, 1)
    elif hints.scale == "log":
        changes.update(scale="log", step=2.0, min_level=0 if integer and abs(value) < 16 else -2, pow2=False)
    elif hints.scale == "linear":
        span = hi - lo if lo is not None and hi is not None else None
        if integer:
            changes.update(scale="linear", step=float(max(1, round(span / 8))) if span else 1.0, min_level=0)
        else:
            changes.update(scale="linear", step=span / 8 if span else (abs(value) / 4 or 0.1), min_level=-2)
    if lo is not None:
        changes["lo"] = lo
    if hi is not None:
        changes["hi"] = hi
    if hints.step is not None:
        changes["step"] = hints.step
    return replace(param, **changes)


def _hinted_param(const: Constant, group: str, hints: Hints) -> Param | None:
    """A constant whose name says "do not search" but whose hint asks for it."""
    if group == "skip" and not (hints.lo is not None or hints.scale or hints.integer or hints.pow2 or hints.step):
        return None
    return _default_param(const, "other" if group == "skip" else group)


def build_space(source: str, *, step_mode: bool, path: str = "train.py", strict: bool = True) -> list[Param]:
    """The searchable constants of `source`, in the order the search attacks them.

    A contradictory hint raises AutoloopError; with strict=False its constant is left
    out instead (for commits that proposals wrote, which the user cannot fix in place)."""
    return _build(source, step_mode=step_mode, path=path, strict=strict)[0]


def explain_space(source: str, *, step_mode: bool, path: str = "train.py") -> tuple[list[Param], list[tuple[str, str]]]:
    """The searchable constants, and (name, why not) for every other UPPER_CASE constant."""
    return _build(source, step_mode=step_mode, path=path, strict=False)


def _build(source: str, *, step_mode: bool, path: str, strict: bool) -> tuple[list[Param], list[tuple[str, str]]]:
    constants = read_constants(source)
    params: list[Param] = []
    skipped: list[tuple[str, str]] = []
    for const in constants.values():
        value = const.value
        if not isinstance(value, (bool, int, float)) or (isinstance(value, float) and not math.isfinite(value)):
            skipped.append((const.name, f"not evaluated: {const.unreadable}" if const.unreadable
                            else "not a number or boolean literal"))
            continue
        try:
            hints = parse_hints(const.comment, name=const.name, where=f"{path} line {const.lineno}")
        except AutoloopError as exc:
            if strict:
                raise
            skipped.append((const.name, str(exc)))
            continue
        if hints.fixed:
            skipped.append((const.name, "fixed by its hint"))
            continue
        param = _hinted_param(const, _group(const.name), hints)
        if param is None:
            skipped.append((const.name, "a logging, evaluation, checkpoint or seed setting (a hint can ask for it)"))
            continue
        if hints.given and param.kind != "bool":
            param = _apply_hints(param, hints)
        if hints.speed:
            param = replace(param, group="speed")
        params.append(param)
    params = _mark_speed(params, constants)
    reassigned = _reassigned_in_blocks(source)
    params = [replace(p, shadowed=True) if p.name in reassigned else p for p in params]
    if step_mode:
        skipped += [(p.name, "a speed or memory knob: it cannot change val_bpb in step mode")
                    for p in params if p.group == "speed"]
        params = [p for p in params if p.group != "speed"]
    return sorted(params, key=lambda p: p.order), skipped


def _mark_speed(params: list[Param], constants: dict[str, Constant]) -> list[Param]:
    """Move per-device batch sizes that do not change the total batch to the speed group."""
    batch = {p.name: p for p in params if p.group == "batch"}
    names = [n for n in constants if "BATCH" in _tokens(n) or _tokens(n) & _ACCUM_TOKENS]
    totals = [n for n in names if "BATCH" in _tokens(n) and _tokens(n) & _TOTAL_BATCH_TOKENS]
    accums = [n for n in names if _tokens(n) & _ACCUM_TOKENS and isinstance(constants[n].value, int)]
    out = []
    for param in params:
        tokens = _tokens(param.name)
        per_device = param.name in batch and "BATCH" in tokens and tokens & _DEVICE_BATCH_TOKENS \
            and param.kind == "int"
        if per_device and totals:
            param = replace(param, group="speed")
        elif per_device and accums:
            partner = accums[0]
            param = replace(param, group="speed", partner=partner, partner_value=constants[partner].value,
                            scale="log", step=2.0, min_level=0, pow2=_is_pow2(param.value))
        out.append(param)
    return out


def _reassigned_in_blocks(source: str) -> set[str]:
    """Names assigned inside module-level compound statements (`if DEVICE == "cpu": ...`):
    where that block runs, an edit of the top-level constant has no effect."""
    names: set[str] = set()
    device = current_device()
    for node in pyast.parse(source).body:
        if device_branch(node, device) is not None:
            continue  # a device block: read_constants already edits the line that runs here
        if isinstance(node, (ast.If, ast.With, ast.Try, ast.For, ast.While)):
            for inner in ast.walk(node):
                targets = inner.targets if isinstance(inner, ast.Assign) else (
                    [inner.target] if isinstance(inner, (ast.AugAssign, ast.AnnAssign)) else [])
                names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names
