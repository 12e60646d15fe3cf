"""What an LLM or coding agent is told before it proposes: the shared research brief.

Both the `llm` and the `agent` proposer render the same context from the db and the
parent commit:

* `program.md` from the repository root (the human's research brief; re-read before each
  proposal, its hash travels with the proposal so the trial records the brief it saw);
* the run's state and the harness's fixed constants (what no edit can change);
* a rolling summary of everything tried, grouped by theme, so a long night does not
  circle: a theme is an UPPER_CASE constant a diff assigns (with the values tried) or
  else the top-level function or class a hunk falls in (git's hunk header);
* a compact table of the recent trials and the diffs of the last few;
* how the recent trials ran (autoloop.proposers.telemetry): each one's loss curve against
  the incumbent's at the same seed by quarter of the run, steps, tokens/s, MFU, peak
  memory and where its wall time went;
* results with their uncertainty (autoloop.decide.effects): a mean of several runs ± its
  standard error, the difference from the incumbent, and "not distinguishable from the
  incumbent" or "near miss" where the decision found it within the noise, so that the
  proposer does not chase noise; the run's measured noise in the state line;
* what the project's earlier runs established (autoloop.proposers.memory): their gains,
  the changes kept there and the themes discarded there, with effect sizes;
* the human's waiting idea, if the proposer took one;
* the editable files at the parent commit, in full.

Duplicates: a proposal whose *normalised diff* equals that of a trial already run is not
run again. The normalised diff is the multiset of removed and added lines per file,
stripped of surrounding whitespace, blank lines dropped, and with a line that is both
removed and added (moved, re-indented) cancelled out. It does not depend on the diff
algorithm, line numbers or hunk headers, so a git diff stored in a trial row and a diff
computed here with difflib compare equal when they make the same change. The same edit
already discarded on the same parent in an earlier run is refused too (unless it implements
a seeded idea): autoloop.proposers.memory.
"""

from __future__ import annotations

import difflib
import hashlib
import re
import subprocess
from collections import Counter
from pathlib import Path

from autoloop.decide.effects import NEAR_MISS, NOT_DISTINGUISHABLE, format_estimate, trial_effect
from autoloop.proposers.diffs import diff_themes, normalised_diff
from autoloop.proposers.proposal import matches
from autoloop.proposers.memory import context_memory, memory_section
from autoloop.proposers.telemetry import telemetry_section
from autoloop.store import IdeaStatus, Kind, Status

RECENT_TRIALS = 20  # rows of the recent-trials table
RECENT_DIFFS = 3  # trials whose diffs are shown in full (truncated)
DIFF_LINES = 80  # lines of each shown diff
THEMES = 30  # themes in the rolling summary (most recently tried first)
THEME_EXAMPLES = 5  # values or descriptions listed per theme
TEXT_CELL = 70  # characters of a description or reason in the table
# The whole prompt of one proposal (program.md, this brief, train.py in full, the answer
# format) at characters / 4: docs/night.md's "budget about 20,000"; telemetry and memory are
# bounded (TELEMETRY_TRIALS lines, MEMORY_CHARS) so that a long night stays within it
# (bench/brief_size.py --trials 100 measures it, a test holds it).
BRIEF_BUDGET_TOKENS = 20_000

FALLBACK_PROGRAM = """\
You are an ML researcher improving a small GPT pretraining script, train.py. Each change
you propose is trained for a fixed time budget and kept only if the validation metric
val_bpb (bits per byte, lower is better) improves. Propose one focused change at a time.
"""


# ---------------------------------------------------------------------------------------
# program.md and ideas
# ---------------------------------------------------------------------------------------


def read_program(project_dir: Path | str) -> tuple[str | None, str | None]:
    """(text, hash) of program.md at the repository root; (None, None) when absent.

    The hash is the controller's: sha256 of the bytes, first 16 hex digits.
    """
    path = Path(project_dir) / "program.md"
    if not path.exists():
        return None, None
    data = path.read_bytes()
    return data.decode("utf-8", errors="replace"), hashlib.sha256(data).hexdigest()[:16]


def take_idea(ctx) -> dict | None:
    """Take the next pending idea this proposer should implement, for this run.

    Text-only ideas always; ideas with constants or a patch only when the chain has no
    `ideas` proposer to apply them as they are (a prepared LLM proposal must not take
    them from under it). Highest priority first, then oldest; marked taken in the same
    `BEGIN IMMEDIATE` transaction, so no other controller takes it too. The id is
    published in `ctx.extra["taken_idea"]` so that whoever abandons the proposal
    half-way (the prefetcher at shutdown) can hand the idea back.
    """
    from autoloop.proposers.base import resolve_names

    if "ideas" not in resolve_names(ctx.config):
        idea = ctx.store.next_idea(ctx.run["id"])
    else:
        with ctx.store.transaction():
            waiting = [i for i in ctx.store.ideas(ctx.run["id"], status=IdeaStatus.PENDING)
                       if not i.get("sets") and not i.get("patch")]
            idea = min(waiting, key=lambda i: (-i["priority"], i["id"]), default=None)
            if idea is not None:
                ctx.store.set_idea_status(idea["id"], IdeaStatus.TAKEN)
                idea["status"] = IdeaStatus.TAKEN.value
    if idea is not None:
        ctx.extra["taken_idea"] = idea["id"]
    return idea


def give_back_idea(ctx, idea: dict | None) -> None:
    """The proposal failed before it became a trial: the idea waits for the next one."""
    if idea is not None:
        ctx.store.set_idea_status(idea["id"], IdeaStatus.PENDING)
        ctx.extra.pop("taken_idea", None)


# ---------------------------------------------------------------------------------------
# Normalised diffs and duplicates
# ---------------------------------------------------------------------------------------


def files_diff(files: dict[str, str | None], read_parent_file) -> str:
    """A unified diff (difflib) from the parent to the materialized files."""
    parts = []
    for path, new in sorted(files.items()):
        old = read_parent_file(path)
        parts.extend(difflib.unified_diff(
            (old or "").splitlines(keepends=True), (new or "").splitlines(keepends=True),
            "/dev/null" if old is None else f"a/{path}", "/dev/null" if new is None else f"b/{path}",
        ))
    return "".join(line if line.endswith("\n") else line + "\n" for line in parts)


def find_duplicate(diff: str, trials: list[dict]) -> dict | None:
    """The earliest trial that already made this change, or None.

    Interrupted trials do not count: they never got a result and their idea is retried.
    """
    signature = normalised_diff(diff)
    if not signature:
        return None
    for trial in trials:
        if trial.get("diff") and trial["status"] != Status.INTERRUPTED.value \
                and normalised_diff(trial["diff"]) == signature:
            return trial
    return None


def duplicate_reason(trial: dict) -> str:
    metric = f", val_bpb {trial['metric']:.6f}" if trial.get("metric") is not None else ""
    return (
        f"duplicate of trial {trial['number']} ({trial['status']}{metric}: {_cut(trial.get('description'), 80)}): "
        "this exact change was already tried"
    )


# ---------------------------------------------------------------------------------------
# Themes: the rolling summary
# ---------------------------------------------------------------------------------------

def versus_incumbent(trial: dict, digits: int = 4) -> str:
    """The trial against the incumbent, for a proposer: a mean difference with its
    standard error, and 'not distinguishable from the incumbent' (or 'near miss') when
    the decision found the difference within the noise, so that nobody chases it. A
    trial from before noise-aware decisions: the bare delta, as before."""
    effect = trial_effect(trial)
    if effect.diff is None:
        return ""
    if not effect.noise_aware:
        return f"{effect.diff:+.{digits}f}"
    text = f"{effect.diff:+.4f}" + (f" ± {effect.diff_se:.4f}" if effect.diff_se is not None else "")
    if effect.near_miss:
        return f"{text}, {NEAR_MISS}: {NOT_DISTINGUISHABLE}"
    if not effect.distinguishable:
        return f"{text}, {NOT_DISTINGUISHABLE}"
    return text


def status_text(trial: dict) -> str:
    """A trial's status for a proposer: a keep says its tier (adopted: the paired mean was
    lower; confirmed: the sequential test says so too), an early stop says so."""
    if trial["status"] == Status.KEEP.value and trial.get("tier") in ("adopted", "confirmed"):
        return f"keep ({trial['tier']})"
    if trial.get("stopped_at") is not None:
        return f"discard (stopped early at {trial['stopped_at']:.0%}: clearly worse)"
    return trial["status"]


def _outcome(trial: dict) -> str:
    if trial["status"] in (Status.KEEP.value, Status.DISCARD.value):
        versus = versus_incumbent(trial)
        if versus:
            # An ablation took a kept change out of the best commit: it was never a proposal.
            label = "ablation of the best" if trial.get("kind") == Kind.ABLATION.value else status_text(trial)
            return f"{label} {versus}"
    return status_text(trial)


def theme_summary(trials: list[dict]) -> str:
    """One line per theme: how often it was tried, what came of it, most recent first."""
    seen: dict[str, list[tuple[dict, str | None]]] = {}
    for trial in trials:
        if trial["kind"] == Kind.BASELINE.value or not trial.get("diff"):
            continue
        for theme, value in diff_themes(trial["diff"]).items():
            seen.setdefault(theme, []).append((trial, value))
    if not seen:
        return "Nothing has been tried yet beyond the baseline."
    order = sorted(seen, key=lambda t: max(tr["number"] for tr, _ in seen[t]), reverse=True)
    lines = []
    for theme in order[:THEMES]:
        entries = seen[theme]
        kept = sum(1 for tr, _ in entries if tr["status"] == Status.KEEP.value)
        near = sum(1 for tr, _ in entries if tr["status"] == Status.DISCARD.value and trial_effect(tr).near_miss)
        examples = []
        for trial, value in entries[-THEME_EXAMPLES:]:
            what = f"= {value}" if value is not None else f"\"{_cut(trial.get('description'), 50)}\""
            examples.append(f"#{trial['number']} {what} ({_outcome(trial)})")
        more = f"; {len(entries) - THEME_EXAMPLES} earlier" if len(entries) > THEME_EXAMPLES else ""
        misses = f", {near} near miss{'es' if near != 1 else ''}" if near else ""
        lines.append(f"- {theme}: {len(entries)} tried, {kept} kept{misses}: " + "; ".join(examples) + more)
    if len(order) > THEMES:
        lines.append(f"- ... and {len(order) - THEMES} older themes")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------


def _cut(text: str | None, width: int) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _metric(value) -> str:
    return "-" if value is None else f"{value:.6f}"


RESULTS_LEGEND = (
    "val_bpb of several runs is their mean ± its standard error (number of runs); the difference from the "
    "incumbent is paired by seed. \"not distinguishable from the incumbent\" means the difference lies within "
    "the measured noise: it is no evidence that the change helps or hurts, so do not build on it or retry it "
    "with a tiny tweak. A \"near miss\" was discarded but may be slightly better than the incumbent: a bigger "
    "step in the same direction can be worth a try. A keep is \"adopted\" (the branch moved: its paired mean was "
    "lower) or \"confirmed\" (the sequential test against the measured noise says so too): an adopted change may "
    "still be noise."
)


def trials_table(trials: list[dict]) -> str:
    if not trials:
        return "(no trials yet)"
    shown = trials[-RECENT_TRIALS:]
    noisy = any(trial_effect(t).noise_aware or (t.get("n_runs") or 0) > 1 for t in shown)
    header = "| # | kind | status | val_bpb | vs incumbent | description | reason |" if noisy else \
        "| # | kind | status | val_bpb | delta | description | reason |"
    rows = [header, "|---|---|---|---|---|---|---|"]
    for t in shown:
        delta = versus_incumbent(t, digits=6) or "-"
        metric = format_estimate(t.get("metric"), t.get("metric_sd"), t.get("n_runs"))
        reason = t.get("reason") or ""
        if t.get("flags"):
            from autoloop.decide.diagnosis import names

            # The curve's diagnosis says why a trial failed, not only that it did.
            reason = f"[{names(t['flags'])}] {reason}"
        rows.append(
            f"| {t['number']} | {t['kind']} | {status_text(t)} | {metric} | {delta} | "
            f"{_cut(t.get('description'), TEXT_CELL).replace('|', '/')} | {_cut(reason, TEXT_CELL).replace('|', '/')} |"
        )
    if noisy:
        rows += ["", RESULTS_LEGEND]
    return "\n".join(rows)


def _truncated_diff(diff: str) -> str:
    lines = diff.rstrip("\n").splitlines()
    if len(lines) <= DIFF_LINES:
        return "\n".join(lines)
    return "\n".join(lines[:DIFF_LINES] + [f"... ({len(lines) - DIFF_LINES} more lines)"])


def recent_diffs(trials: list[dict]) -> str:
    shown = [t for t in trials if t.get("diff") and t["kind"] != Kind.BASELINE.value][-RECENT_DIFFS:]
    if not shown:
        return "(none yet)"
    parts = []
    for t in shown:
        parts.append(f"### trial {t['number']} ({_outcome(t)}): {_cut(t.get('description'), 100)}\n"
                     f"```diff\n{_truncated_diff(t['diff'])}\n```")
    return "\n\n".join(parts)


def harness_facts(config) -> str:
    from autoloop.harness import constants as C
    from autoloop.harness.tokenizer import ByteTokenizer

    if config.max_steps:
        budget = f"{config.max_steps} optimizer steps per trial (step budget; progress = step / steps)"
    else:
        budget = f"{config.time_budget:g} seconds of timed training per trial"
    return "\n".join([
        f"- budget: {budget}; start-up, compilation and evaluation get {config.grace_seconds:g} s more before a kill",
        f"- untimed warm-up steps (compilation): {C.UNTIMED_WARMUP_STEPS}, fixed by the harness",
        f"- context length: {C.SEQ_LEN['cuda']} tokens on CUDA, {C.SEQ_LEN['cpu']} on CPU",
        f"- tokenizer: bytes (vocabulary {ByteTokenizer.vocab_size}); val_bpb = mean cross-entropy / ln 2 per raw byte",
        f"- validation set: {C.EVAL_TOKENS['cuda']} target tokens on CUDA, {C.EVAL_TOKENS['cpu']} on CPU; "
        "a held-out split checks kept trials",
        f"- seed: {config.seed}; data, tokenizer, loader, evaluation and clock come from autoloop.harness (read-only)",
    ])


def state_line(ctx, trials: list[dict]) -> str:
    baseline = next((t for t in trials if t["kind"] == Kind.BASELINE.value and t.get("metric") is not None), None)
    best = ctx.store.best_trial(ctx.run["id"])
    counts = Counter(t["status"] for t in trials)
    counted = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "none"
    parts = [f"Run '{ctx.run['tag']}': {len(trials)} trials so far ({counted})."]
    if baseline is not None:
        parts.append(f"Baseline val_bpb {_estimate(baseline)}.")
    if best is not None:
        tier = f", {best['tier']}" if best.get("tier") in ("adopted", "confirmed") else ""
        parts.append(f"Best val_bpb {_estimate(best)} (trial {best['number']}{tier}); the files below are that version.")
    noise = noise_sentence(ctx)
    if noise:
        parts.append(noise)
    lr = lr_range_sentence(ctx)
    if lr:
        parts.append(lr)
    running = [t["number"] for t in trials if t["status"] == Status.RUNNING.value]
    if running:
        parts.append(f"Trial {', '.join(map(str, running))} is training now (result not known yet): "
                     "propose something else.")
    return " ".join(parts)


def _estimate(trial: dict) -> str:
    """'2.543100', or '2.5431 ± 0.0023 (mean of 3 runs)'."""
    n = trial.get("n_runs") or 1
    if n > 1 and trial.get("metric_sd") is not None:
        return f"{trial['metric']:.4f} ± {trial['metric_sd']:.4f} (mean of {n} runs)"
    return _metric(trial.get("metric"))


def lr_range_sentence(ctx) -> str:
    """`autoloop check`'s LR range test in one sentence ('' when the run has none)."""
    run = ctx.store.get_run(ctx.run["tag"]) or ctx.run
    lr = ((run.get("check_result") or {}).get("lr") or {})
    if lr.get("status") not in ("ok", "warn") or not lr.get("message"):
        return ""
    constants = ", ".join(f"{k} {v:.3g}" for k, v in (lr.get("suggested_constants") or {}).items())
    return (f"LR range test before the run (all learning rates scaled together): {lr['message']}"
            + (f" ({constants})" if constants else "") + ".")


def noise_sentence(ctx) -> str:
    """The run's measured noise in one sentence ('' before it is measured)."""
    run = ctx.store.get_run(ctx.run["tag"]) or ctx.run  # the controller updates the estimate as it goes
    run_sd, pair_sd = run.get("noise_sd"), run.get("noise_pair_sd")
    if run_sd is None and pair_sd is None:
        return ""
    parts = []
    if run_sd is not None:
        parts.append(f"one run's val_bpb varies by sd {run_sd:.4f} between seeds")
    if pair_sd is not None:
        parts.append(f"a paired difference from the incumbent by sd {pair_sd:.4f}")
    return ("Measured noise: " + " and ".join(parts) + ". Gains much smaller than that cannot be told apart "
            "from noise with a few runs: aim for changes that could matter by more.")


def idea_section(idea: dict | None) -> str:
    if idea is None:
        return ""
    extra = ""
    if idea.get("sets"):
        extra += "\nSuggested constant values: " + ", ".join(f"{k} = {v}" for k, v in idea["sets"].items())
    if idea.get("patch"):
        extra += f"\nSuggested patch:\n```diff\n{_truncated_diff(idea['patch'])}\n```"
    return (
        "# The human's idea to try now\n"
        "The human asked for this; implement it (say so in your description):\n"
        f"> {idea['text']}{extra}\n\n"
    )


def files_section(ctx, read_file, heading: str) -> str:
    parts = [f"# {heading}"]
    for path in editable_paths(ctx, read_file):
        text = read_file(path)
        parts.append(f"## {path}\n```{_language(path)}\n{text.rstrip()}\n```")
    return "\n\n".join(parts)


def editable_paths(ctx, read_file) -> list[str]:
    """Editable files that exist at the parent commit (glob patterns are listed by git)."""
    paths = []
    for pattern in ctx.config.editable:
        if any(ch in pattern for ch in "*?["):
            listed = subprocess.run(
                ["git", "ls-tree", "-r", "--name-only", ctx.parent_commit], cwd=ctx.repo.project_dir,
                capture_output=True, text=True, check=True,
            ).stdout.splitlines()
            paths.extend(p for p in listed if matches(p, [pattern]) and p not in paths)
        elif read_file(pattern) is not None and pattern not in paths:
            paths.append(pattern)
    return paths


def _language(path: str) -> str:
    return {"py": "python", "md": "markdown", "toml": "toml", "json": "json"}.get(path.rsplit(".", 1)[-1], "")


def render_context(ctx, *, idea: dict | None = None, read_file=None, files_heading: str | None = None,
                   extra: str = "") -> str:
    """The user-side prompt shared by the LLM and the agent (the answer format is added
    by each). `read_file` defaults to the parent commit; a repair passes the crashed
    version instead."""
    read_file = read_file or ctx.read_parent_file
    trials = ctx.history()
    sections = [
        "# State\n" + state_line(ctx, trials),
        "# Fixed by the harness (no edit can change these)\n" + harness_facts(ctx.config),
        "# What has been tried, by theme (most recent first)\n" + theme_summary(trials),
        "# Recent trials (newest last)\n" + trials_table(trials),
    ]
    telemetry = telemetry_section(ctx.store, trials, ctx.config)
    if telemetry:
        sections.append("# How the recent trials ran (beside the incumbent at the same seed)\n" + telemetry)
    sections.append("# Diffs of the last few trials\n" + recent_diffs(trials))
    earlier = memory_section(context_memory(ctx))
    if earlier:
        sections.append("# What earlier runs of this project established\n" + earlier)
    text = "\n\n".join(sections) + "\n\n" + idea_section(idea) + extra
    heading = files_heading or "The editable files at the current best commit (your edits apply to these)"
    from autoloop.base.redact import redact
    from autoloop.base.text import strip_controls

    return redact(strip_controls(text + files_section(ctx, read_file, heading) + "\n"))


def repair_section(trial: dict) -> str:
    """The crashed trial, its traceback and what is asked: fix it, keep the idea."""
    from autoloop.base.redact import redact
    from autoloop.base.text import strip_controls

    return redact(strip_controls(
        f"# Repair: trial {trial['number']} crashed\n"
        f"Trial {trial['number']} (\"{_cut(trial.get('description'), 200)}\") crashed: {_cut(trial.get('reason'), 300)}\n"
        "The end of its log:\n"
        f"```\n{(trial.get('error_tail') or '').rstrip()}\n```\n"
        "Fix the cause of the crash while keeping the idea of the change. The files below are "
        "the crashed version (the change included): edit those.\n\n"
    ))


def is_repairable(trial: dict) -> bool:
    """A crash with a plain Python error (a traceback or an `...Error: message` line) is
    worth one repair; timeouts, NaN losses and kills are not code errors to fix."""
    if trial.get("status") != Status.CRASH.value or trial.get("kind") != Kind.PROPOSAL.value:
        return False
    tail = trial.get("error_tail") or ""
    return "Traceback (most recent call last)" in tail or bool(
        re.search(r"^\w+(?:\.\w+)*(?:Error|Exception)\b[^\n]*", tail, re.MULTILINE)
    )
