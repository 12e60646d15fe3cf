"""The project's earlier runs: what the proposers, `autoloop ideas` and the report know of them.

A new tag used to start blind to what earlier nights of the same project tried. The
memory is every trial of the **earlier runs** in this experiments.db (every tag created
before the current one) and of **another db the user names** (`memory-db`, `--memory-db PATH`: an
experiments.db of another clone or machine of the project), read-only: a plain SQLite
connection opened `mode=ro`, so a db another controller is writing is never blocked or
migrated.

What it gives:

* `memory_section`: the brief's summary, within a fixed size (MEMORY_CHARS): one line per
  earlier run (trials, kept, baseline -> best), the changes kept there with their effect
  against their incumbent (autoloop.decide.effects: a mean difference ± its standard
  error where measured at several seeds), and the themes discarded there with the values
  tried and their effects (autoloop.proposers.diffs.diff_themes);
* `discarded_elsewhere`: an earlier discarded trial that made **the same edit** (the
  normalised diff of autoloop.proposers.diffs, the notion the in-run duplicate refusal
  uses) **on the same parent** (the same parent commit, or a parent commit with the same
  tree where this repository has both). The llm and agent proposers refuse such an
  answer as they refuse an in-run duplicate; the search treats the train.py of an
  earlier discarded trial (where this repository has its commit) as one it has already
  evaluated. Seeded ideas are never refused: the human asked for them.
* `lessons`: what earlier nights established, for the report (`autoloop report`).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from urllib.parse import quote

from autoloop.decide.effects import trial_effect
from autoloop.errors import AutoloopError

MEMORY_CHARS = 4000  # the brief's memory section at most (~1,000 tokens at 4 characters a token)
MEMORY_RUNS = 8  # earlier runs listed, most recent first
MEMORY_KEPT = 10  # kept changes listed, best effect first
MEMORY_THEMES = 12  # discarded themes listed, most tried first
THEME_VALUES = 4  # values listed per discarded theme
_COLUMNS = ("number", "kind", "status", "description", "diff", "edits", "parent_commit", "trial_commit", "metric", "metric_sd",
            "n_runs", "best_before", "delta", "decision", "tier", "stopped_at", "finished_at")
_PROPOSED = ("proposal", "repair")  # the kinds that are edits someone proposed


def memory_db_path(config, project_dir: Path | str) -> Path | None:
    """The `memory-db` setting as a path (relative to the project), or None when unset;
    a path that is not a file is refused in one line."""
    value = getattr(config, "memory_db", None)
    if not value:
        return None
    path = Path(value).expanduser()
    path = path if path.is_absolute() else Path(project_dir) / path
    if not path.is_file():
        raise AutoloopError(f"memory-db {value} is not a file: point --memory-db at the experiments.db of an earlier "
                            "run of this project, or leave it out")
    return path


def _read(query, source: str, before_run: int | None) -> list[dict]:
    """The trials of the runs created before `before_run` (all runs for None). `query(sql,
    params) -> [dict]`: the Store's own (its lock), or a plain read-only connection's."""
    have = {row["name"] for row in query("PRAGMA table_info(trials)", ())}
    columns = ", ".join(f"t.{c}" for c in _COLUMNS if c in have)
    sql = (f"SELECT r.tag AS tag, r.id AS run_key, {columns} FROM trials t JOIN runs r ON r.id = t.run_id "
           + ("WHERE t.run_id < ? " if before_run is not None else "") + "ORDER BY t.run_id, t.number")
    rows = query(sql, (before_run,) if before_run is not None else ())
    return [{**{c: None for c in _COLUMNS}, **row, "source": source} for row in rows]


def _plain_query(conn: sqlite3.Connection):
    def query(sql: str, params) -> list[dict]:
        cursor = conn.execute(sql, tuple(params))
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row)) for row in cursor.fetchall()]
    return query


def earlier_trials(store, run_id: int | None, memory_db: Path | None = None) -> list[dict]:
    """Every trial of the runs of this db created before run `run_id` (of every run for
    None: `autoloop ideas`), then every trial of `memory_db`, each with its run's `tag` and
    `source` ('this db' or the other db's file name)."""
    rows = _read(store.query, "this db", run_id)
    if memory_db is not None:
        if Path(memory_db).resolve() == Path(store.path).resolve():
            return rows  # the same file: its earlier runs are read already
        try:
            conn = sqlite3.connect(f"file:{quote(str(Path(memory_db).resolve()))}?mode=ro", uri=True, timeout=2)
        except sqlite3.Error as error:
            raise AutoloopError(f"cannot read memory-db {memory_db} ({error}): point --memory-db at an "
                                "experiments.db") from None
        try:
            rows += _read(_plain_query(conn), Path(memory_db).name, None)
        except sqlite3.DatabaseError as error:
            raise AutoloopError(f"memory-db {memory_db} is not an autoloop database ({error}): point --memory-db "
                                "at an experiments.db") from None
        finally:
            conn.close()
    return rows


def context_memory(ctx) -> list[dict]:
    """The earlier trials a proposal context knows (cached on the context: one read per proposal)."""
    if "memory" not in ctx.extra:
        try:
            path = memory_db_path(ctx.config, ctx.repo.project_dir)
        except AutoloopError:
            path = None  # `run` refused it before the night; gone since: the night goes on with this db's runs
        ctx.extra["memory"] = earlier_trials(ctx.store, ctx.run["id"], path)
    return ctx.extra["memory"]


# ---------------------------------------------------------------------------------------
# The same edit on the same parent
# ---------------------------------------------------------------------------------------


def _tree(repo, commit: str | None, cache: dict) -> str | None:
    if not commit or repo is None:
        return None
    if commit not in cache:
        try:
            cache[commit] = repo.tree_of(commit) if repo.commit_exists(commit) else None
        except Exception:  # noqa: BLE001 - a commit of another clone: no tree here, compare by sha only
            cache[commit] = None
    return cache[commit]


def same_parent(a: str | None, b: str | None, repo=None, cache: dict | None = None) -> bool:
    """The same parent commit, or two commits with the same tree in this repository."""
    if not a or not b:
        return False
    if a == b:
        return True
    cache = {} if cache is None else cache
    tree_a, tree_b = _tree(repo, a, cache), _tree(repo, b, cache)
    return tree_a is not None and tree_a == tree_b


def discarded_elsewhere(diff: str, parent_commit: str, earlier: list[dict], repo=None) -> dict | None:
    """The first earlier discarded trial that made this edit on the same parent, or None."""
    from autoloop.proposers.diffs import normalised_diff

    signature = normalised_diff(diff)
    if not signature:
        return None
    cache: dict = {}
    for trial in earlier:
        if trial.get("status") == "discard" and trial.get("kind") in _PROPOSED and trial.get("diff") \
                and normalised_diff(trial["diff"]) == signature \
                and same_parent(trial.get("parent_commit"), parent_commit, repo, cache):
            return trial
    return None


def refused_repeat(ctx, diff: str) -> dict | None:
    """The earlier discarded trial a proposal on `ctx` repeats, or None; never for a proposal
    that implements a human's seeded idea (`ctx.extra["taken_idea"]`): the human asked."""
    if ctx.extra.get("taken_idea") is not None:
        return None
    return discarded_elsewhere(diff, ctx.parent_commit, context_memory(ctx), ctx.repo)


def discarded_commits(earlier: list[dict]) -> list[str]:
    """The commits of the earlier discarded proposals (the search reads their train.py
    where this repository has them: archived under refs/autoloop/<tag>/trials/<n>)."""
    return [t["trial_commit"] for t in earlier
            if t.get("status") == "discard" and t.get("kind") in _PROPOSED and t.get("trial_commit")]


def _sets_of(trial: dict) -> dict | None:
    """The constants a one-edit trial set ({NAME: text}), or None for any other edit."""
    edits = trial.get("edits")
    if isinstance(edits, str):
        try:
            edits = json.loads(edits)
        except ValueError:
            return None
    edits = edits if isinstance(edits, dict) else {}
    items = edits.get("edits") or []
    if len(items) != 1 or edits.get("patch") or not isinstance(items[0], dict) or not items[0].get("sets"):
        return None
    return {str(k): str(v) for k, v in items[0]["sets"].items()}


def tried_before(idea: dict, earlier: list[dict]) -> dict | None:
    """The latest earlier trial (kept or discarded) that made the edit a seeded idea names:
    the same constants (an idea of constants only) or the same normalised diff (a patch)."""
    from autoloop.proposers.diffs import normalised_diff

    sets = {str(k): str(v) for k, v in (idea.get("sets") or {}).items()}
    signature = normalised_diff(idea.get("patch")) if idea.get("patch") and not sets else None
    if not sets and not signature:
        return None
    for trial in reversed(earlier):
        if trial.get("status") not in ("keep", "discard") or trial.get("kind") not in _PROPOSED:
            continue
        if (sets and _sets_of(trial) == sets) or (signature and trial.get("diff")
                                                  and normalised_diff(trial["diff"]) == signature):
            return trial
    return None


def tried_before_text(trial: dict) -> str:
    effect = _effect(trial)
    where = "" if trial["source"] == "this db" else f" ({trial['source']})"
    return f"tried before in run '{trial['tag']}'{where} as trial {trial['number']}: {trial['status']}" + (
        f" ({effect})" if effect else "")


def elsewhere_reason(trial: dict) -> str:
    effect = _effect(trial)
    return (f"already discarded on the same parent in run '{trial['tag']}' ({trial['source']}) as trial "
            f"{trial['number']}{' (' + effect + ')' if effect else ''}: propose something different")


# ---------------------------------------------------------------------------------------
# The brief's summary and the report's lessons
# ---------------------------------------------------------------------------------------


def _effect(trial: dict) -> str:
    effect = trial_effect(trial)
    if effect.diff is None:
        return ""
    text = f"{effect.diff:+.4f}" + (f" ± {effect.diff_se:.4f}" if effect.diff_se is not None else "")
    if effect.noise_aware and not effect.distinguishable:
        text += ", within the noise"
    return text


def _cut(text: str | None, width: int) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _runs(earlier: list[dict]) -> list[dict]:
    """One summary per earlier run, most recent first: {tag, source, trials, kept, baseline, best}."""
    runs: dict[tuple, dict] = {}
    for t in earlier:
        key = (t["source"], t["run_key"])
        r = runs.setdefault(key, {"tag": t["tag"], "source": t["source"], "trials": 0, "kept": 0,
                                  "baseline": None, "best": None, "order": 0})
        r["trials"] += 1
        r["order"] = max(r["order"], t.get("run_key") or 0)
        if t["kind"] == "baseline" and t.get("metric") is not None and r["baseline"] is None:
            r["baseline"] = t["metric"]
        if t["status"] == "keep" and t.get("metric") is not None:
            if t["kind"] != "baseline":
                r["kept"] += 1
            r["best"] = t["metric"] if r["best"] is None else min(r["best"], t["metric"])
    return sorted(runs.values(), key=lambda r: (r["source"] != "this db", -r["order"]))


def _kept(earlier: list[dict]) -> list[dict]:
    kept = [t for t in earlier if t["status"] == "keep" and t["kind"] in _PROPOSED]
    return sorted(kept, key=lambda t: trial_effect(t).diff if trial_effect(t).diff is not None else 0.0)


def _discarded_themes(earlier: list[dict]) -> list[tuple[str, list[tuple[dict, str | None]]]]:
    from autoloop.proposers.diffs import diff_themes

    themes: dict[str, list[tuple[dict, str | None]]] = {}
    for t in earlier:
        if t["status"] == "discard" and t["kind"] in _PROPOSED and t.get("diff"):
            for theme, value in diff_themes(t["diff"]).items():
                themes.setdefault(theme, []).append((t, value))
    return sorted(themes.items(), key=lambda kv: -len(kv[1]))


def _label(t: dict) -> str:
    return f"{t['tag']}#{t['number']}"


def memory_section(earlier: list[dict], limit: int = MEMORY_CHARS) -> str:
    """The brief's memory of earlier runs ('' when there are none), at most `limit` characters."""
    runs = _runs(earlier)
    if not runs:
        return ""
    lines = ["Earlier runs of this project (earlier tags; effects are val_bpb against the incumbent of the time, "
             "negative helps; tag#N is trial N of that run). An edit discarded there on the same parent is "
             "refused here: build on what held, not on what failed."]
    for r in runs[:MEMORY_RUNS]:
        path = (f"; baseline {r['baseline']:.4f} -> best {r['best']:.4f}" if r["baseline"] is not None
                and r["best"] is not None else "")
        where = "" if r["source"] == "this db" else f" ({r['source']})"
        lines.append(f"- run '{r['tag']}'{where}: {r['trials']} trials, {r['kept']} kept{path}")
    if len(runs) > MEMORY_RUNS:
        lines.append(f"- ... and {len(runs) - MEMORY_RUNS} older runs")
    kept = _kept(earlier)
    if kept:
        lines.append("Kept there:")
        for t in kept[:MEMORY_KEPT]:
            effect = _effect(t)
            lines.append(f"- {_label(t)} \"{_cut(t.get('description'), 70)}\"" + (f": {effect}" if effect else ""))
    themes = _discarded_themes(earlier)
    if themes:
        lines.append("Discarded there, by theme:")
        for theme, entries in themes[:MEMORY_THEMES]:
            shown = []
            for t, value in entries[-THEME_VALUES:]:
                what = f"= {_cut(value, 24)}" if value is not None else f"\"{_cut(t.get('description'), 40)}\""
                effect = _effect(t)
                shown.append(f"{_label(t)} {what}" + (f" ({effect})" if effect else ""))
            lines.append(f"- {theme}: {len(entries)} discarded: " + "; ".join(shown))
        if len(themes) > MEMORY_THEMES:
            lines.append(f"- ... and {len(themes) - MEMORY_THEMES} more themes")
    text = ""
    for line in lines:  # whole lines only, within the budget
        if len(text) + len(line) + 1 > limit:
            text += "- ... (cut to the brief's budget)"
            break
        text += line + "\n"
    return text.rstrip("\n")


def lessons(earlier: list[dict]) -> list[str]:
    """What earlier nights established, one sentence each, for the report: each run's gain,
    the changes kept with their effect, and the themes every try of which was discarded."""
    out = []
    for r in _runs(earlier):
        where = "" if r["source"] == "this db" else f" ({r['source']})"
        gain = (f", val_bpb {r['baseline']:.4f} -> {r['best']:.4f}" if r["baseline"] is not None
                and r["best"] is not None else "")
        out.append(f"Run '{r['tag']}'{where}: {r['trials']} trials, {r['kept']} kept{gain}.")
    for t in _kept(earlier)[:MEMORY_KEPT]:
        effect = _effect(t)
        out.append(f"Kept in {_label(t)}: {_cut(t.get('description'), 90)}" + (f" ({effect})." if effect else "."))
    kept_themes = set()
    from autoloop.proposers.diffs import diff_themes

    for t in earlier:
        if t["status"] == "keep" and t["kind"] in _PROPOSED:
            kept_themes.update(diff_themes(t.get("diff")))
    for theme, entries in _discarded_themes(earlier)[:MEMORY_THEMES]:
        if theme not in kept_themes and len(entries) >= 2:
            out.append(f"{theme}: tried {len(entries)} times, never kept.")
    return out
