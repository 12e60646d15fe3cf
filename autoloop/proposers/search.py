"""The built-in `search` proposer: a pattern search over train.py's constants, no LLM.

What it searches and how each constant moves is in `search_space` (hint grammar,
defaults, order of attack, speed knobs). This module holds the search itself.

The pattern search
------------------
One constant per trial, in sweeps over the constants. A *visit* to a constant tries its
preferred direction (up at first) at its current step, then the other direction:

- the first sweep is a screen: one trial per constant, in the order of attack, so that
  every constant has been tried once before any is pushed further (with 10-20
  constants, exploring one fully before the next would spend the first dozens of
  trials on the learning rate alone);
- later sweeps visit the constants whose latest trial moved val_bpb the most first
  (ties in the order of attack): effort goes where the metric is sensitive. A move
  is read with its uncertainty (`autoloop.decide.effects`): the paired mean difference from
  the incumbent where the trial was measured at several seeds, and no movement at all
  when the decision found it not distinguishable from the incumbent, so a noisy
  constant is not chased because one lucky or unlucky draw looked large;
- a success (the trial is kept) makes that the preferred direction and grows the step
  (x2 becomes x4, then x16); outside the screen the visit goes on in the same
  direction, from the new best, until a failure (then the step shrinks back by one
  level and the visit ends);
- a direction that fails is not tried again at that step until the other one has been
  tried too; when both have failed the step shrinks by one level (x2 -> x1.41 ->
  x1.19), or, at the smallest step, the constant is set aside for the round;
- a boolean is flipped once per round: kept or not, it is then set aside;
- a constant whose trials twice gave exactly their parent's val_bpb (the same runs at
  the same seeds: a paired difference of exactly 0) is set aside for the
  whole run: in step mode training is deterministic, so the constant does not affect
  this run. Once is enough for a constant that train.py assigns again further down (e.g.
  in a CPU-scale `if` block, which overrides it on a CPU); otherwise one tie can be a
  coincidence, e.g. two values either side of an optimum, and counts as a failure;
- when every constant is set aside the round ends; if the best commit changed during the
  round (anything was kept, by any proposer), a new round starts one level above the
  smallest steps; otherwise the search is converged and proposes nothing.

A move whose train.py would be identical to one already evaluated in this run (any
proposer, any parent: "the same constant and value on the same parent" is a special
case) counts as a failure without a trial, as does a move blocked by a bound or one that breaks
one of train.py's own asserts over its constants (`N_HEAD % N_KV_HEAD == 0`: see
`autoloop.invariants`), which would only crash. So a
(constant, value, parent) is never tried twice, and the search never walks back to a
configuration it knows. The project's earlier runs count too: a move whose train.py
is that of a proposal discarded in another run (another tag of this db, or `memory-db`;
autoloop.proposers.memory), where this repository has its commit, is skipped the same way.

Crashes, timeouts, invalid trials and discards are failures; interrupted trials are not
evidence (the same move is proposed again).

State
-----
Nothing is kept outside the db. `propose` replays the run's trials in order through the
state machine: at each search trial it recomputes the move the machine would have made
on that trial's parent commit and, when it matches the recorded edit, applies the
recorded outcome. A resumed run therefore proposes exactly what an uninterrupted run
would have. A recorded search edit that does not match (the hints or this code changed
between sessions) is treated like any other proposer's trial. The replayed state is
cached between calls and reused while the trial history only grows.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
from dataclasses import dataclass, field

from autoloop.config import Config
from autoloop.decide.effects import sensitivity, trial_effect
from autoloop.errors import AutoloopError
from autoloop.invariants import Guard
from autoloop.proposers.proposal import Edit, Proposal, matches
from autoloop.proposers.search_space import GROUP_LABELS, MAX_LEVEL, Param, build_space
from autoloop.pyconst import Expression, evaluate_text, format_value, set_constants
from autoloop.store import Status

SUCCESS, FAILURE, INERT = "success", "failure", "inert"
_NOT_EVIDENCE = (Status.RUNNING.value, Status.INTERRUPTED.value)
_MAX_SKIPS = 100_000  # skips are bounded anyway (each one shrinks or retires a step); a guard against bugs


@functools.lru_cache(maxsize=8)
def _guard(parent_text: str) -> Guard:
    """The parent's asserts over its constants (autoloop.invariants), read once per parent."""
    return Guard(parent_text)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _value(value):
    """The number an edit writes (`2**20` is written as an expression)."""
    return evaluate_text(str(value)) if isinstance(value, Expression) else value


def _normal(sets: dict) -> dict:
    """Sets as they read back from the db (Expression -> str, tuples -> lists)."""
    return json.loads(json.dumps(sets, default=str))


@dataclass
class ConstState:
    level: int
    direction: int = 1  # preferred direction: the last one that worked
    failed: list = field(default_factory=list)  # directions that failed at this level since the last success
    aside: bool = False
    inert: bool = False  # no effect on val_bpb in this run: set aside for good
    ties: int = 0  # trials that gave exactly the parent's val_bpb
    sensitivity: float | None = None  # |val_bpb change| of its latest trial


@dataclass
class Visit:
    name: str
    trials: int = 0  # trials run on this visit (moves skipped without a trial do not count)
    streak: bool = False  # a success on this visit: keep going the same way


@dataclass
class Move:
    param: Param
    direction: int
    level: int
    sets: dict
    digest: str  # of the train.py it produces

    def describe(self) -> str:
        p = self.param
        changes = ", ".join(f"{name} {self._old(name)} -> {format_value(value)}" for name, value in self.sets.items())
        # The step actually taken (after rounding and bounds), not the nominal one.
        new = float(_value(self.sets[p.name]))
        if p.scale == "flip":
            how = "flip"
        elif p.scale == "log" and new and p.value:
            ratio = new / p.value
            how = f"x{ratio:.3g}" if ratio >= 1 else f"/{1 / ratio:.3g}"
        else:
            how = f"{new - p.value:+.3g}"
        return f"search: {changes} ({GROUP_LABELS[p.group]}; {how})"

    def _old(self, name: str) -> str:
        return self.param.source if name == self.param.name else format_value(self.param.partner_value)


@dataclass
class SearchState:
    """The pattern search's state; changed only by `next_move` and `observe`."""

    consts: dict = field(default_factory=dict)  # name -> ConstState
    queue: list = field(default_factory=list)  # names left in the current sweep
    visit: Visit | None = None
    round: int = 0
    round_parent: str | None = None  # the best commit when this round started
    sweeps: int = 0  # sweeps started; the first one is the screen
    unmatched: int = 0  # recorded search trials this search would not propose now (see "State")
    _pending: Move | None = None  # the move `observe` applies to

    @property
    def screening(self) -> bool:
        return self.round == 0 and self.sweeps == 1

    def _const(self, param: Param) -> ConstState:
        if param.name not in self.consts:
            level = 0 if self.round == 0 else param.restart_level
            self.consts[param.name] = ConstState(level=level)
        return self.consts[param.name]

    # -- choosing ------------------------------------------------------------------------

    def _sweep_order(self, space: dict[str, Param]) -> list[str]:
        """The first sweep follows the order of attack; later ones take the constants
        that moved val_bpb most first (unmeasured ones before measured ones), ties in the
        order of attack."""
        names = [n for n in space if not self._const(space[n]).aside]
        if self.sweeps == 0:
            return names
        rank = {name: i for i, name in enumerate(space)}
        return sorted(names, key=lambda n: (-(math.inf if self.consts[n].sensitivity is None
                                               else self.consts[n].sensitivity), rank[n]))

    def _start_visit(self, space: dict[str, Param], parent: str) -> bool:
        """Begin the next visit; False when the search is converged."""
        if self.round_parent is None:
            self.round_parent = parent
        for _ in range(3):  # at most: finish the sweep, start a sweep, start a round
            while self.queue:
                name = self.queue.pop(0)
                if name in space and not self._const(space[name]).aside:
                    self.visit = Visit(name)
                    return True
            active = self._sweep_order(space)
            if active:
                self.queue = active
                self.sweeps += 1
                continue
            if parent == self.round_parent or not space:
                return False
            # Everything is set aside, but the best moved since the round began: the
            # landscape changed, so look again with small steps.
            self.round += 1
            self.round_parent = parent
            for name, state in self.consts.items():
                state.aside, state.failed = state.inert, []
                if name in space:
                    state.level = space[name].restart_level
            self.queue = self._sweep_order(space)
        return False

    def _direction(self, param: Param, state: ConstState) -> int | None:
        visit = self.visit
        if param.scale == "flip":
            return 1 if visit.trials == 0 and not state.failed else None
        if self.screening and visit.trials:
            return None  # the screen: one trial per constant
        if visit.streak:
            return state.direction
        for direction in (state.direction, -state.direction):
            if direction not in state.failed:
                return direction
        return None

    def next_move(self, params: list[Param], parent: str, parent_text: str, seen: set[str]) -> Move | None:
        """The next move on `parent`, skipping (as failures) moves that are blocked or
        would reproduce a known train.py; None when the search is converged."""
        space = {p.name: p for p in params}
        for _ in range(_MAX_SKIPS):
            if self.visit is None and not self._start_visit(space, parent):
                return None
            param = space.get(self.visit.name)
            if param is None:  # the constant disappeared from train.py
                self.visit = None
                continue
            state = self._const(param)
            direction = self._direction(param, state)
            if direction is None:
                self.visit = None
                continue
            sets = param.move(direction, state.level)
            if sets is not None and _guard(parent_text).breaks(sets):
                sets = None  # it breaks one of train.py's own asserts (N_HEAD % N_KV_HEAD): blocked, like a bound
            move = Move(param, direction, state.level, sets or {}, "")
            if sets is not None:
                move.digest = _digest(set_constants(parent_text, sets))
                if move.digest not in seen:
                    self._pending = move
                    return move
            self._pending = move
            self.observe(FAILURE, trial=False)
        raise AutoloopError("the search proposer did not settle on a move: please report this as a bug")

    # -- learning ------------------------------------------------------------------------

    def observe(self, outcome: str, delta: float | None = None, *, trial: bool = True) -> None:
        """Apply the outcome of the pending move (the last one `next_move` chose).
        `delta`: how far it moved val_bpb (`observed_change`; only its size is
        used); `trial`: False for a move skipped without a trial."""
        move, self._pending = self._pending, None
        visit, param = self.visit, move.param
        state = self._const(param)
        if trial:
            visit.trials += 1
        if delta is not None and math.isfinite(delta):
            state.sensitivity = abs(delta)
        if outcome == INERT:
            state.ties += 1
            if state.ties >= 2 or param.shadowed:
                state.aside = state.inert = True
                self.visit = None
                return
            outcome = FAILURE  # one tie can be a coincidence (a symmetric optimum): a failure
        if outcome == SUCCESS:
            state.direction, state.failed = move.direction, []
            if param.scale == "flip":
                state.aside = True  # flipping back is walking back: not before the next round
                self.visit = None
            else:
                state.level = min(move.level + 1, MAX_LEVEL)
                visit.streak = True
        elif visit.streak:
            # The grown step overshot: come back to the one that worked, next constant.
            state.level = max(move.level - 1, param.min_level)
            self.visit = None
        elif param.scale == "flip":
            state.aside = True
            self.visit = None
        else:
            state.failed.append(move.direction)
            if len(set(state.failed)) >= 2:
                state.failed = []
                if state.level <= param.min_level:
                    state.aside = True
                else:
                    state.level -= 1
                self.visit = None


def outcome_of(trial: dict) -> str:
    if trial["status"] == Status.KEEP.value:
        return SUCCESS
    if trial["status"] == Status.DISCARD.value:
        effect = trial_effect(trial)
        if effect.noise_aware:
            # Identical runs at every shared seed: in step mode, the constant changed nothing.
            if effect.diff == 0.0:
                return INERT
        elif trial.get("metric") is not None and trial.get("metric") == trial.get("best_before"):
            return INERT
    return FAILURE


def observed_change(trial: dict) -> float | None:
    """How far the trial demonstrably moved val_bpb from its parent, for the sweep
    order: |paired mean difference|, 0 when not distinguishable from the incumbent,
    |delta| for a trial from before noise-aware decisions (None: no metric)."""
    return sensitivity(trial_effect(trial))


class SearchProposer:
    name = "search"

    def __init__(self, config: Config):
        self.config = config
        self.path = target_path(config)
        self._texts: dict[str, str | None] = {}  # commit -> train.py text (commits are immutable)
        self._spaces: dict[str, list[Param]] = {}  # commit -> search space
        self._cache: tuple[list, SearchState, set] | None = None  # (replayed keys, state, seen)
        self.replayed: SearchState | None = None  # the state the last proposal started from
        self._memory: set[str] | None = None  # train.py digests discarded in earlier runs (read once)

    # -- reading commits -----------------------------------------------------------------

    def _text(self, ctx, commit: str) -> str | None:
        if commit not in self._texts:
            if commit == ctx.parent_commit:
                self._texts[commit] = ctx.read_parent_file(self.path)
            else:
                try:
                    self._texts[commit] = ctx.repo.show_file(commit, self.path)
                except (AutoloopError, ValueError):
                    self._texts[commit] = None  # gone (or never had the file): no evidence
        return self._texts[commit]

    def _space(self, ctx, commit: str) -> list[Param] | None:
        if commit not in self._spaces:
            text = self._text(ctx, commit)
            if text is None:
                return None
            # A contradictory hint in the user's own train.py (the run's base commit) is
            # an error to fix; in a commit a proposal wrote, that constant is skipped.
            strict = commit == ctx.run.get("base_commit")
            try:
                space = build_space(text, step_mode=bool(self.config.max_steps), path=self.path, strict=strict)
            except SyntaxError:
                space = []
            except AutoloopError as exc:
                raise AutoloopError(f"{exc}, then start a new run (another --tag): this run's commits keep the "
                                    "old comment") from None
            self._spaces[commit] = space
        return self._spaces[commit]

    # -- replay --------------------------------------------------------------------------

    def _evidence(self, ctx) -> list[dict]:
        return [t for t in ctx.history() if t["status"] not in _NOT_EVIDENCE]

    def _replay(self, ctx, trials: list[dict]) -> tuple[SearchState, set]:
        keys = [(t["id"], t["status"]) for t in trials]
        if self._cache is not None and keys[: len(self._cache[0])] == self._cache[0]:
            done, state, seen = self._cache
            state, seen = copy.deepcopy(state), set(seen)
        else:
            done, state, seen = [], SearchState(), set(self._earlier_discards(ctx))
        for trial in trials[len(done):]:
            digest = None
            if trial.get("proposer") == self.name and trial.get("parent_commit") and not scheduled(trial):
                digest = self._replay_search_trial(ctx, state, seen, trial)
            if digest is None:
                digest = self._trial_digest(ctx, trial)
            if digest is not None:
                seen.add(digest)
        self._cache = (keys, copy.deepcopy(state), set(seen))
        self.replayed = self._cache[1]
        return state, seen

    def _earlier_discards(self, ctx) -> set[str]:
        """The train.py of every proposal discarded in the project's earlier runs
        (autoloop.proposers.memory) whose commit this repository has: a move that would
        reproduce one is skipped as already evaluated, like a move of this run. Read once
        per proposer, so a replay always starts from the same set."""
        if self._memory is None:
            from autoloop.proposers.memory import context_memory, discarded_commits

            commits = [c for c in discarded_commits(context_memory(ctx)) if ctx.repo.commit_exists(c)]
            texts = (self._text(ctx, commit) for commit in commits)
            self._memory = {_digest(text) for text in texts if text is not None}
        return self._memory

    def _replay_search_trial(self, ctx, state: SearchState, seen: set, trial: dict) -> str | None:
        parent = trial["parent_commit"]
        params, text = self._space(ctx, parent), self._text(ctx, parent)
        if params is None or text is None:
            return None
        seen.add(_digest(text))  # as `propose` does for the live parent
        move = state.next_move(params, parent, text, seen)
        recorded = [e for e in (trial.get("edits") or {}).get("edits", [])]
        if move is None or len(recorded) != 1 or recorded[0].get("path") != self.path \
                or recorded[0].get("sets") != _normal(move.sets):
            # Not the move this search makes now (hints or code changed since): another
            # proposer's evidence. The skips next_move made are deterministic, so they stay.
            state._pending = None
            state.unmatched += 1
            return None
        state.observe(outcome_of(trial), observed_change(trial))
        return move.digest

    def _trial_digest(self, ctx, trial: dict) -> str | None:
        """The train.py a finished trial evaluated (or tried to), as a digest."""
        commit = trial.get("trial_commit")
        if commit:
            text = self._text(ctx, commit)
            return _digest(text) if text is not None else None
        parent, edits = trial.get("parent_commit"), (trial.get("edits") or {}).get("edits") or []
        sets = [e for e in edits if e.get("sets") and e.get("path") == self.path]
        if parent and sets and len(sets) == len(edits) and not (trial.get("edits") or {}).get("patch"):
            text = self._text(ctx, parent)
            try:
                for edit in sets:
                    text = set_constants(text, edit["sets"], path=self.path)
            except (AutoloopError, SyntaxError, TypeError):
                return None
            return _digest(text)
        return None

    # -- proposing -----------------------------------------------------------------------

    def propose(self, ctx) -> Proposal | None:
        parent = ctx.parent_commit
        params, text = self._space(ctx, parent), self._text(ctx, parent)
        if not params or text is None:
            return None
        first = self._lr_range_move(ctx, text)
        if first is not None:
            return first
        trials = ctx.history()
        state, seen = self._replay(ctx, [t for t in trials if t["status"] not in _NOT_EVIDENCE])
        seen.add(_digest(text))
        # What another worker is training now is no move for this one: the same train.py
        # twice at once (both re-based onto whichever was kept first) measures one change
        # twice. The state skips it here only; replayed, it is that trial's own evidence.
        seen.update(d for d in (self._trial_digest(ctx, t) for t in trials if t["status"] == Status.RUNNING.value) if d)
        move = state.next_move(params, parent, text, seen)
        if move is None:
            return None
        return Proposal(
            description=move.describe(),
            edits=[Edit(path=self.path, sets=move.sets)],
            source=self.name,
            meta={"group": move.param.group, "direction": move.direction, "level": move.level,
                  "round": state.round, "sweep": state.sweeps},
        )


    # -- the scheduler's parts (autoloop.loop.sources, schedule = "yield") -------------

    def covered_sets(self, ctx, old: str, new: str) -> dict | None:
        """The constants `new` sets, when it differs from `old` only in values of constants
        this search covers on `ctx.parent_commit` (comments aside); None otherwise."""
        import ast

        from autoloop.pyconst import read_constants

        params = {p.name for p in self._space(ctx, ctx.parent_commit) or []}
        try:
            before, after = read_constants(old), read_constants(new)
        except SyntaxError:
            return None
        moved = {n: c for n, c in after.items() if n in before and c.source != before[n].source}
        if not moved or set(before) != set(after) or not set(moved) <= params:
            return None
        sets = {}
        for name, const in moved.items():
            try:
                literal = ast.literal_eval(const.source)
            except (ValueError, SyntaxError):
                literal = None
            sets[name] = literal if isinstance(literal, (bool, int, float)) else Expression(const.source)
        try:
            same = ast.dump(ast.parse(set_constants(old, sets, path=self.path))) == ast.dump(ast.parse(new))
        except (AutoloopError, SyntaxError):
            return None
        return sets if same else None

    def structural_keep(self, ctx) -> dict | None:
        """The trial that made `ctx.parent_commit`, when a model or agent wrote it and it is
        more than new values of constants this search covers."""
        made = [t for t in ctx.store.trials(ctx.run["id"], last=50)
                if t.get("trial_commit") == ctx.parent_commit and t["status"] == Status.KEEP.value]
        if not made or made[-1].get("proposer") not in RETUNE_AFTER or not made[-1].get("parent_commit"):
            return None
        keep = made[-1]
        old, new = self._text(ctx, keep["parent_commit"]), self._text(ctx, ctx.parent_commit)
        if old is None or new is None or old == new:
            return None
        return None if self.covered_sets(ctx, old, new) else keep

    def retune(self, ctx) -> Proposal | None:
        """After a model's structural keep, the learning rates re-tuned on it: all of them
        together, half the search's first step (x1.41 for a x2 step) down, then up; at most
        RETUNE_TRIALS moves, none that reproduces a train.py already tried on this parent.

        Why so little: the incumbent's rates were tuned by the search before the change,
        and a change seldom moves their optimum by a whole step: on real CPU nights
        (docs/search.md, "The third check"), every rate x2 or /2 at once ended 0.06 to 0.49
        bpb worse. The constants the change's diff names (a re-tune each, before) are the
        pattern search's to visit. Down first: a rate too high costs more than one too low
        (training can diverge). A kept move makes the incumbent the search's own, which ends
        the re-tune; the pattern search goes on from it."""
        keep = self.structural_keep(ctx)
        if keep is None:
            return None
        parent, text = ctx.parent_commit, self._text(ctx, ctx.parent_commit)
        lrs = [p for p in (self._space(ctx, parent) or []) if p.group == "lr"]
        tried = [t for t in ctx.store.trials(ctx.run["id"], last=200)
                 if t.get("parent_commit") == parent and (t.get("description") or "").startswith(RETUNE_PREFIX)]
        if not lrs or len(tried) >= RETUNE_TRIALS:
            return None
        seen = {d for d in (self._trial_digest(ctx, t) for t in ctx.history(last=200)
                            if t.get("parent_commit") == parent) if d}
        seen.add(_digest(text))
        for direction in (-1, 1):
            sets, factors = {}, set()
            for p in lrs:
                level = max(RETUNE_LEVEL, p.min_level)
                move = p.move(direction, level)
                if move is not None:
                    sets.update(move)
                    factors.add(p.step ** (2.0 ** level) if p.scale == "log" else None)
            if not sets or _guard(text).breaks(sets) or _digest(set_constants(text, sets)) in seen:
                continue
            factor = next(iter(factors)) if len(factors) == 1 and None not in factors else None
            how = (("x" if direction > 0 else "/") + f"{factor:.3g}") if factor else ("up" if direction > 0 else "down")
            changes = ", ".join(f"{n} {next(p.source for p in lrs if p.name == n)} -> {format_value(v)}"
                                for n, v in sets.items())
            return Proposal(
                description=f"{RETUNE_PREFIX} {keep['number']}'s change: every learning rate {how} ({changes})",
                edits=[Edit(path=self.path, sets=sets)], source=self.name,
                meta={"group": "retune", "after": keep["number"]},
            )
        return None

    def _lr_range_move(self, ctx, text: str) -> Proposal | None:
        """The first learning-rate step, placed by `autoloop check`'s LR range test: every LR
        constant scaled to its suggestion, once per run, when the suggestion is far enough
        from the current values to be told from noise (more than LR_RANGE_MIN_FACTOR)."""
        from autoloop.pyconst import read_constants

        run = ctx.store.get_run(ctx.run["tag"]) or ctx.run
        lr = (run.get("check_result") or {}).get("lr") or {}
        suggested = lr.get("suggested_constants") or {}
        multiplier = lr.get("suggested_multiplier")
        if lr.get("status") not in ("ok", "warn") or not suggested or not multiplier:
            return None
        if max(multiplier, 1 / multiplier) < LR_RANGE_MIN_FACTOR:
            return None
        if any((t.get("description") or "").startswith(LR_RANGE_DESCRIPTION) for t in self._evidence(ctx)):
            return None
        constants = read_constants(text)
        sets = {name: float(f"{value:.3g}") for name, value in suggested.items() if name in constants}
        if not sets:
            return None
        return Proposal(
            description=f"{LR_RANGE_DESCRIPTION}: every learning rate x{multiplier:.3g} "
                        f"({', '.join(f'{k}={v:g}' for k, v in sets.items())})",
            edits=[Edit(path=self.path, sets=sets)], source=self.name, meta={"group": "lr-range"},
        )


# The re-tune after a structural keep (SearchProposer.retune): whose keeps, how many moves.
RETUNE_AFTER = ("llm", "agent")
RETUNE_TRIALS = 2  # every learning rate down, then up
RETUNE_LEVEL = -1  # half the first step, in log: x1.41 for the learning rates' x2
RETUNE_PREFIX = "search: re-tune after trial"
# A model's answer that only sets constants this search covers, tried as its point
# (autoloop.loop.sources routes it).
POINT_PREFIX = "search: a point proposed by"


def scheduled(trial: dict) -> bool:
    """A search trial the scheduler made (a re-tune, a model's point), not a move of the
    pattern search: the replay reads it as another proposer's evidence."""
    return (trial.get("description") or "").startswith((RETUNE_PREFIX, POINT_PREFIX))


# The LR range test's suggestion is tried first when it is at least this factor away.
LR_RANGE_MIN_FACTOR = 1.25
LR_RANGE_DESCRIPTION = "LR range test's suggestion"


def target_path(config: Config) -> str:
    """The file the search edits: the training script, if proposals may edit it."""
    script = next((arg for arg in config.train_argv()[1:] if arg.endswith(".py")), None)
    if script and matches(script, config.editable):
        return script
    plain = [p for p in config.editable if p.endswith(".py") and not any(c in p for c in "*?[")]
    if plain:
        return plain[0]
    raise AutoloopError(
        "the search proposer needs a Python file it may edit: add the training script to `editable` "
        "or remove 'search' from `proposers`"
    )
