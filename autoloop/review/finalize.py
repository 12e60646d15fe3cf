"""`autoloop finalize`: a clean branch of what a run kept, and the best trial's weights.

The run's own branch (`autoloop/<tag>`) is the controller's: it is never moved, reset or
checked out here, so finalizing works while the run is still going. Instead:

* The new branch starts at the run's base commit (`runs.base_commit`, where
  `autoloop/<tag>` was created) and ends at a commit whose **tree is exactly the tree of
  the run's best commit** - built with `git commit-tree <tree> -p <parent>` (plumbing),
  so nothing is re-applied or merged and the result cannot differ from what was
  measured. The default is one squashed commit whose message lists the kept changes
  with their deltas; `--per-trial` makes one commit per kept trial instead, each with
  the tree of that trial's commit, so `git log` tells the story step by step.
* The kept changes are the kept trials whose commits lie on the path from the base to
  the best commit (`git merge-base --is-ancestor`), in trial order.
* Only the new branch's ref is written (`git update-ref`, refusing to replace an
  existing branch unless `force`); the worktree, the index and the current branch stay
  as they are, unless `checkout` asks to switch to the new branch (refused while the
  run's controller holds its lock, since the controller trains on its checkout).
* The best trial's checkpoint (`trials.checkpoint_path`) is copied to
  `.autoloop/<tag>/best/` with a `best.json` that says which trial, commit and metric
  it belongs to.
* `drop_null` leaves out the kept changes that the latest `autoloop ablate` marked as
  candidates to drop (their effect on the best commit is indistinguishable from zero,
  or harmful; `decision.drop` of the ablation trial). The final tree is then the best
  commit's tree with those changes reverse-applied (autoloop.review.ablate.reverse_applied),
  which is exactly the tree that ablation measured when one change is dropped. With
  `--per-trial` each kept commit's tree has the dropped changes before it reverted. The
  best trial's checkpoint was trained with the dropped changes, so it is not copied.
* `confirmed_only` leaves out, the same way, every kept change that was only *adopted*
  (the branch moved on its paired mean; the sequential test did not confirm it:
  `trials.tier`), so the branch holds only changes whose gain is confirmed. A run that
  confirmed none has nothing to finalize this way.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autoloop.errors import AutoloopError
from autoloop.config import STATE_DIR
from autoloop.gitops import BRANCH_PREFIX, GitRepo
from autoloop.decide.figures import baseline_to_best, change_text, pair_text
from autoloop.review.queries import (CHANGE_KINDS, baseline_trial, best_trial, kept_trials, require_trials, trial_delta,
                                     trial_file)
from autoloop.store import utcnow


@dataclass
class Finalized:
    branch: str
    commit: str
    base_commit: str
    best_commit: str
    best_trial: int
    commits: list[str] = field(default_factory=list)
    trials: list[int] = field(default_factory=list)
    checkpoint: str | None = None
    checkpoint_note: str | None = None
    checked_out: bool = False
    dropped: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def default_branch(tag: str) -> str:
    # Outside autoloop/: that namespace holds the runs' own branches, and a later run
    # tagged '<tag>-final' must not resume this branch as its own.
    return f"final/{tag}"


def _fmt(value: float | None, spec: str = ".6f") -> str:
    return "-" if value is None else f"{value:{spec}}"


def squash_message(run: dict, kept: list[dict], base: dict | None, best: dict, dropped: list[dict] = (),
                   headline: dict | None = None) -> str:
    lines = []
    head = f"autoloop {run['tag']}: {len(kept)} kept change{'s' if len(kept) != 1 else ''}"
    # The pair `best`, `report` and the page show (autoloop.decide.figures): re-measured where it was.
    pair = baseline_to_best(base["metric"], best["metric"], headline) if base is not None else None
    if pair is not None and not dropped:
        head += (f", val_bpb {pair['baseline']:.4f} -> {pair['best']:.4f}: "
                 f"{change_text(pair['delta'], pair['baseline'])}")
    lines += [head, ""]
    if pair is not None and not dropped:
        lines += [f"{pair_text(pair)}.", ""]
    for t in kept:
        lines.append(f"- trial {t['number']}: {t.get('description') or '(no description)'} "
                     f"(val_bpb {_fmt(t['metric'])}, {_fmt(trial_delta(t), '+.4f')} bpb against its incumbent)")
    if dropped:
        why = ("not confirmed, or no benefit in the ablation" if any(t.get("unconfirmed") for t in dropped)
               else "they did not hold at a larger scale" if any(t.get("not_held") for t in dropped)
               else "their ablation found no benefit in the best commit")
        lines += ["", f"Left out ({why}):"]
        for t in dropped:
            lines.append(f"- trial {t['number']}: {t.get('description') or '(no description)'} ({t['ablation_note']})")
    lines += ["", f"Autoloop-Run: {run['tag']}", f"Autoloop-Base: {run['base_commit']}",
              f"Autoloop-Best: {best['trial_commit']} (trial {best['number']})"]
    if dropped:
        lines.append(f"Autoloop-Dropped: {', '.join(str(t['number']) for t in dropped)}")
    return "\n".join(lines) + "\n"


def changes_to_drop(store, run: dict, git: GitRepo, best_sha: str, kept: list[dict]) -> list[dict]:
    """The kept trials whose latest ablation marked them as candidates to drop, each with
    an `ablation_note`; refused when there is no ablation, or when it measured another
    best commit (the run went on since: ablate again)."""
    from autoloop.decide.effects import ablation_verdict, format_interval
    from autoloop.review.queries import latest_ablations

    ablations = {a["trial"]: a for a in latest_ablations(store, run)}
    measured = {a["trial"]: a for a in ablations.values() if a.get("figures") is not None}
    if not measured:
        raise AutoloopError(f"run '{run['tag']}' has no ablation yet, so nothing is known to be null: "
                            f"run `autoloop ablate --tag {run['tag']}` first, or finalize without --drop-null")
    stale = sorted(n for n, a in measured.items() if a.get("parent_commit") != best_sha)
    if stale:
        raise AutoloopError(f"the latest ablation of trial {', '.join(map(str, stale))} measured another best commit "
                            f"than today's ({best_sha[:12]}): run `autoloop ablate --tag {run['tag']}` again")
    dropped = []
    for t in kept:
        a = measured.get(t["number"])
        if a is not None and a["figures"].drop:
            f = a["figures"]
            note = (f"ablation trial {a['ablation']}: effect {f.effect:+.4f}, "
                    f"{format_interval(f.low, f.high, f.level) or 'interval unbounded'}: {ablation_verdict(f)}")
            dropped.append({**t, "ablation_note": note})
    return dropped


def unconfirmed_changes(kept: list[dict], already: list[dict]) -> list[dict]:
    """--confirmed-only: the kept changes that were only adopted (not in `already`), each
    with its note; refused when no kept change was confirmed."""
    if not any(t.get("tier") == "confirmed" for t in kept if t["number"] not in {d["number"] for d in already}):
        raise AutoloopError("the run confirmed none of its kept changes (each was adopted on its paired mean, none "
                            "passed the sequential test): finalize without --confirmed-only")
    numbers = {t["number"] for t in already}
    return [{**t, "unconfirmed": True, "ablation_note": "adopted on its paired mean, not confirmed"}
            for t in kept if t.get("tier") != "confirmed" and t["number"] not in numbers]


def changes_not_held(store, run: dict, best_sha: str, kept: list[dict], already: list[dict]) -> list[dict]:
    """--holds-at-scale: the kept changes (not in `already`) that the run's latest ladder
    rung did not tag `holds`, each with its note; refused without a finished rung for
    today's best commit (autoloop.review.ladder)."""
    rungs = [r for r in store.rungs(run["id"]) if r["status"] == "done"]
    if not rungs:
        raise AutoloopError(f"run '{run['tag']}' has no finished ladder rung, so nothing is known to hold at scale: run "
                            f"`autoloop ladder SPEC --tag {run['tag']}` first, or finalize without --holds-at-scale")
    rung = rungs[-1]
    if rung.get("best_commit") != best_sha:
        raise AutoloopError(f"the latest ladder rung ({rung['spec']}) measured another best commit than today's "
                            f"({best_sha[:12]}): run `autoloop ladder --tag {run['tag']}` again")
    tags = {t["kept_trial_id"]: t for t in store.ladder_tags(rung["id"])}
    numbers = {t["number"] for t in already}
    out = []
    for t in kept:
        tag = tags.get(t["id"])
        if t["number"] in numbers or (tag is not None and tag["tag"] == "holds"):
            continue
        note = (f"at {rung['spec']}: {tag['tag']}, effect {tag['effect']:+.4f}" if tag is not None
                else f"at {rung['spec']}: not measured")
        out.append({**t, "not_held": True, "ablation_note": note})
    if len(out) + len(already) >= len(kept):
        raise AutoloopError(f"no kept change holds at {rung['spec']}: there is no branch of held changes to make; "
                            "finalize without --holds-at-scale")
    return out


def trial_message(run: dict, trial: dict) -> str:
    return (f"{trial.get('description') or '(no description)'}\n\n"
            f"autoloop {run['tag']} trial {trial['number']}: val_bpb {_fmt(trial['metric'])} "
            f"({_fmt(trial.get('delta'), '+.6f')} vs the best before, {_fmt(trial.get('best_before'))})\n\n"
            f"Autoloop-Run: {run['tag']}\nAutoloop-Trial: {trial['number']}\nAutoloop-Commit: {trial['trial_commit']}\n")


def run_lock_held(repo_root: Path, tag: str) -> bool:
    """True while a controller runs in this working tree (see autoloop.loop.lock): `tag`, or any
    other run, since a checkout would pull the tree from under it either way."""
    from autoloop.loop.lock import holder

    return holder(repo_root) is not None


def finalize(store, run: dict, project_dir: Path, *, branch: str | None = None, per_trial: bool = False,
             force: bool = False, checkout: bool = False, drop_null: bool = False,
             confirmed_only: bool = False, holds_at_scale: bool = False) -> Finalized:
    require_trials(store, run)
    git = GitRepo.open(project_dir)
    tag = run["tag"]
    branch = branch or default_branch(tag)
    if not git.is_valid_branch_name(branch):
        raise AutoloopError(f"'{branch}' is not a valid branch name: pick another with --branch")
    own = run.get("branch") or BRANCH_PREFIX + tag
    if branch == own or branch.startswith(own + "-w"):
        raise AutoloopError(f"'{branch}' is the run's own branch, which finalize never touches: pick another with --branch")
    existing = git.branch_commit(branch)
    if existing is not None and not force:
        raise AutoloopError(f"branch '{branch}' already exists (at {existing[:12]}): pass --branch NAME, or --force to replace it")
    if existing is not None and git.current_branch() == branch:
        raise AutoloopError(f"branch '{branch}' is checked out: switch to another branch before replacing it with --force")

    if checkout:  # refuse before writing anything
        if run_lock_held(git.project_dir, tag):
            raise AutoloopError(f"run '{tag}' is still running on this checkout, so --checkout would pull the tree from "
                                "under it: finalize without --checkout, or after the run stops")
        dirty = git.dirty_files()
        if dirty:
            raise AutoloopError(f"{len(dirty)} tracked file(s) have uncommitted changes ({', '.join(dirty[:3])}): "
                                "commit or stash them, or finalize without --checkout")

    base_sha = run.get("base_commit")
    if not base_sha or not git.commit_exists(base_sha):
        raise AutoloopError(f"the base commit of run '{tag}' ({base_sha}) is not in {git.project_dir}: run finalize in the run's repository (--repo)")
    best = best_trial(store, run)
    if best is None:
        raise AutoloopError(f"run '{tag}' has no successful trial yet: nothing to finalize")
    best_sha = best["trial_commit"]
    if not best_sha or not git.commit_exists(best_sha):
        raise AutoloopError(f"the best commit of run '{tag}' ({best_sha}) is not in {git.project_dir}: run finalize in the run's repository (--repo)")
    kept = [t for t in kept_trials(store, run)
            if t["kind"] in CHANGE_KINDS and t.get("trial_commit") and t["trial_commit"] != base_sha
            and git.commit_exists(t["trial_commit"]) and git.is_ancestor(t["trial_commit"], best_sha)]
    if not kept or best_sha == base_sha:
        raise AutoloopError(f"run '{tag}' kept no change over its baseline: there is nothing to finalize")

    dropped = changes_to_drop(store, run, git, best_sha, kept) if drop_null else []
    if confirmed_only:
        dropped = sorted(dropped + unconfirmed_changes(kept, dropped), key=lambda t: t["number"])
    if holds_at_scale:
        dropped = sorted(dropped + changes_not_held(store, run, best_sha, kept, dropped), key=lambda t: t["number"])
    expected_tree = git.tree_of(best_sha)
    if dropped:
        left = {t["number"] for t in dropped}
        kept = [t for t in kept if t["number"] not in left]
        if not kept:  # the branch would be the base again: an empty commit says nothing
            numbers = ", ".join(str(n) for n in sorted(left))
            raise AutoloopError(f"the ablation found no benefit from any kept change of run '{tag}' (trial {numbers}): "
                                "with --drop-null nothing is left to finalize; finalize without --drop-null to keep "
                                "them anyway")
        expected_tree = _without(git, best_sha, dropped, "the best commit")

    commits: list[str] = []
    parent = base_sha
    if per_trial:
        steps = []
        for t in kept:
            before = [d for d in dropped if d["number"] < t["number"]]
            tree = _without(git, t["trial_commit"], before, f"trial {t['number']}") if before else \
                git.tree_of(t['trial_commit'])
            steps.append((tree, trial_message(run, t)))
    else:
        from autoloop.loop.reserve import headline_of

        steps = [(expected_tree, squash_message(run, kept, baseline_trial(store, run), best, dropped,
                                                headline_of(store, run)))]
    for tree, message in steps:
        parent = git.commit_tree(tree, parent, message)
        commits.append(parent)
    if per_trial and dropped and git.tree_of(parent) != expected_tree:
        # A dropped change after the last kept one: one more commit leaves it out.
        why = "not confirmed, or ablation: no benefit" if any(t.get("unconfirmed") for t in dropped) else "ablation: no benefit"
        message = (f"Leave out trial {', '.join(str(t['number']) for t in dropped)} ({why})\n\n"
                   + "".join(f"- trial {t['number']}: {t.get('description')} ({t['ablation_note']})\n" for t in dropped))
        parent = git.commit_tree(expected_tree, parent, message)
        commits.append(parent)
    final_tree = git.tree_of(parent)
    if final_tree != expected_tree:  # cannot happen; guard the promise anyway
        raise AutoloopError(f"internal error: the finalized tree differs from the best commit {best_sha[:12]}"
                            f"{' without the dropped changes' if dropped else ''}; nothing was written")
    # Compare-and-swap: fail instead of clobbering a branch someone created meanwhile.
    git.set_branch(branch, parent, expected=existing, message=f"autoloop finalize {tag}")

    result = Finalized(branch=branch, commit=parent, base_commit=base_sha, best_commit=best_sha,
                       best_trial=best["number"], commits=commits, trials=[t["number"] for t in kept],
                       dropped=[t["number"] for t in dropped])
    _keep_checkpoint(result, run, best, git.project_dir)
    if checkout:
        git.checkout_branch(branch)
        result.checked_out = True
    return result


def _without(git: GitRepo, commit: str, dropped: list[dict], what: str) -> str:
    """The tree of `commit` with the dropped changes reverse-applied, latest first."""
    from autoloop.review.ablate import NotRevertible, change_diff, reverse_applied

    try:
        tree, _files = reverse_applied(git, commit, [change_diff(git, t) for t in sorted(dropped, key=lambda t: -t["number"])])
    except NotRevertible as exc:
        raise AutoloopError(f"trial {', '.join(str(t['number']) for t in dropped)} cannot be left out of {what}: {exc}; "
                            "finalize without --drop-null or --confirmed-only") from None
    return tree


def _keep_checkpoint(result: Finalized, run: dict, best: dict, root: Path) -> None:
    target_dir = root / STATE_DIR / run["tag"] / "best"
    source = trial_file(best, run, root, "checkpoint_path", "checkpoint.pt")
    if result.dropped:
        # The weights were trained with the changes left out: they are not the final tree's.
        source = None
    target_dir.mkdir(parents=True, exist_ok=True)
    info = {"run": run["tag"], "trial": best["number"], "commit": best["trial_commit"], "val_bpb": best["metric"],
            "metric_source": best.get("metric_source"), "heldout_bpb": best.get("heldout_metric"),
            "branch": result.branch, "finalized_commit": result.commit, "checkpoint": None, "copied_at": utcnow()}
    if source is None and result.dropped:
        result.checkpoint_note = (f"trial {best['number']}'s checkpoint was trained with trial "
                                  f"{', '.join(map(str, result.dropped))}, which the branch leaves out: train the "
                                  "branch for its own weights; only best.json was written")
        info["dropped"] = result.dropped
    elif source is None:
        result.checkpoint_note = (f"trial {best['number']} has no checkpoint on disk (the training script saved none, "
                                  "or it was deleted); only best.json was written")
    else:
        target = target_dir / source.name
        tmp = target.with_name(target.name + ".tmp")
        shutil.copy2(source, tmp)
        os.replace(tmp, target)  # never a half-copied checkpoint under the final name
        result.checkpoint = str(target)
        info["checkpoint"] = str(target)
        info["source"] = str(source)
    (target_dir / "best.json").write_text(json.dumps(info, indent=1) + "\n")

