"""The controller: the only writer of experiments.db and of git refs.

One trial, in the order that keeps every crash recoverable:

1. A proposal is materialized from the parent (best) commit and validated; an invalid
   one becomes an `invalid` row with nothing committed.
2. The trial row is written `running` with the parent and the edits (the intent).
3. The commit is created through a temporary index (the worktree is untouched), its sha
   and diff go into the row, and only then does the branch move to it.
4. Training runs in its own process group; its pgid, pid and start time go into the row
   before the controller waits on it.
5. The decision and the run's new best commit are written in one transaction: the db is
   the truth, and git is made to agree with it. Before it, the verifier (autoloop.trust.watch)
   compares the harness and data with their state before training and checks the
   reported budget; a trial the decision would keep is first verified in a fresh process
   (causality, re-evaluated val_bpb, held-out), and the verified value decides.
6. Git converges: a kept commit stays on the branch; any other is archived under
   refs/autoloop/<tag>/trials/<n> and the branch is reset to the best commit.

On start-up (`recover`) the controller kills a training process group left by a dead
controller (and, for any tag, a coding agent's process group, deleting its temporary
clone: `_reap_helpers`), marks its row `interrupted`, archives commits of finished
trials that lack their ref, and resets the branch and worktree to the db's best commit. Each window is
reachable by fault injection (`autoloop.loop.faults`).

A full disk, wherever it surfaces in a trial (the training log, git, the db, our own
writes), is not the proposal's fault: the trial becomes `interrupted` and the run pauses
with that diagnosis, leaving no `running` row (`execute`, `_pause_for_full_disk`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from autoloop.loop import faults
from autoloop.config import STATE_DIR, Config
from autoloop.decide.rule import DecisionConfig, Noise, decide, estimate, pool_noise
from autoloop.errors import AutoloopError, DiskFull, disk_full_what, is_disk_full
from autoloop.gitops import GitRepo
from autoloop.loop.lock import RunLock
from autoloop.proposers.proposal import InvalidProposal, Proposal, materialize, matches, validate
from autoloop.proposers import ProposalContext, build_chain
from autoloop.measure.measurer import Measurement, Measurer
from autoloop.measure.runner import gpu_busy_report, kill_process_group
from autoloop.loop.scheduler import Scheduler, WorkItem
from autoloop.loop.notify import notifier_for
from autoloop.store import IdeaStatus, Kind, MetricSource, RunStatus, Status, Store

# `Controller(verifier=...)` default: the real verifier (autoloop.trust.watch). Pass None to turn
# off integrity checks and verification, e.g. for a fake script that has no model.
DEFAULT_VERIFIER = object()


@dataclass
class RunSummary:
    tag: str
    trials_run: int = 0
    kept: int = 0
    stop_reason: str = ""
    best_metric: float | None = None
    baseline_metric: float | None = None
    best_commit: str | None = None
    paused: bool = False
    statuses: dict = field(default_factory=dict)


class Controller:
    def __init__(
        self,
        config: Config,
        repo_dir: Path | str = ".",
        *,
        display=None,
        verifier=DEFAULT_VERIFIER,
        chain=None,
    ):
        self.config = config
        self.repo_dir = Path(repo_dir).resolve()
        self.display = display
        if verifier is DEFAULT_VERIFIER:
            from autoloop.trust.watch import Verifier

            verifier = Verifier()
        self.verifier = verifier
        self._chain = chain
        self.scheduler: Scheduler | None = None  # set by run(); prepares proposals while trials train
        self.abort_requested = False
        self._pending_pause: str | None = None  # a pause decided inside a trial (a full disk), taken next
        self._worker_pause: str | None = None  # a harness/data change a worker found (taken after check_run's)
        self._slots = threading.local()  # .slot: the slot the current thread's trial measures on
        self._serial: object | None = None
        self.repo: GitRepo | None = None
        self.store: Store | None = None
        self.run_row: dict | None = None
        self.branch = ""
        self.measurer = Measurer(self)
        self._noise_cache: Noise | None = None
        self._curves: dict[int, list] = {}  # a trial's curve (of its last run), stored when it ends
        # Several trials at once (autoloop.loop.run): each thread's slot and lineage, the
        # trials in flight, one lock for git and decisions, edits waiting to be re-based.
        self._local = threading.local()
        self._git_lock = threading.RLock()
        self._in_flight: set[int] = set()
        self._requeue: list[tuple[int, str | None]] = []  # (trial id, its lineage in islands mode)
        self.executor = None
        # `--notify CMD` (autoloop/loop/notify.py): events go to a background thread, never waited on.
        self.notifier = notifier_for(config, on_failure=self._notify_failed)

    # ------------------------------------------------------------------ paths and setup

    @property
    def tag(self) -> str:
        return self.config.tag

    @property
    def state_dir(self) -> Path:
        return self.repo_dir / STATE_DIR

    def trial_dir(self, number: int) -> Path:
        return self.state_dir / self.tag / "trials" / str(number)

    def db_path(self) -> Path:
        path = Path(self.config.db)
        return path if path.is_absolute() else self.repo_dir / path

    def _say(self, message: str, style: str | None = None) -> None:
        if self.display is not None:
            self.display.say(message, style)

    def _event(self, kind: str, message: str, trial_id: int | None = None) -> None:
        self.store.add_event(self.run_row["id"], kind, message, trial_id=trial_id)
        self.notifier.event(kind, message)  # a pause is news for --notify

    def _notify_failed(self, message: str) -> None:
        """Called once, from the notifier's thread, when the notify command first fails."""
        self._say(message, "yellow")
        if self.store is not None and self.run_row is not None:
            self.store.add_event(self.run_row["id"], "notify_failed", message)

    def _notify_end(self, summary: RunSummary) -> None:
        """The `end` notification (an error on its way out included), then a bounded drain."""
        self.notifier.run_ended(summary, error=sys.exc_info()[1])
        problems = self.notifier.close()
        if problems:
            self._say(problems, "yellow")

    def _exclude_runtime_files(self) -> None:
        """Keep .autoloop/ and the db out of `git status` in a user's own repo too."""
        exclude = Path(self.repo.repo.git_dir) / "info" / "exclude"
        exclude.parent.mkdir(parents=True, exist_ok=True)
        current = exclude.read_text() if exclude.exists() else ""
        prefix = self.repo.prefix  # the project folder may be a subfolder of the repository
        wanted = [f"/{prefix}{STATE_DIR}/", f"/{prefix}{Path(self.config.db).name}*"]
        missing = [line for line in wanted if line not in current.splitlines()]
        if missing:
            with open(exclude, "a") as handle:
                handle.write(("" if current.endswith("\n") or not current else "\n") + "\n".join(missing) + "\n")

    def _train_script(self) -> Path | None:
        for arg in self.config.train_argv()[1:]:
            if arg.endswith(".py"):
                return self.repo_dir / arg
        return None

    # ------------------------------------------------------------------ environment

    def _environment(self) -> dict:
        from autoloop.envinfo import collect_environment
        from autoloop import harness

        env = collect_environment()
        data_dir = self.data_dir()
        try:
            dataset = harness.load_dataset(data_dir)
        except harness.HarnessError:
            raise
        env["data_fingerprint"] = dataset.fingerprint
        env["harness_fingerprint"] = harness.compute_harness_fingerprint()
        return env

    def data_dir(self) -> Path:
        from autoloop.harness import default_data_dir

        if self.config.dataset:
            try:
                from autoloop.prepare import resolve_data_dir
            except ImportError:  # pragma: no cover - prepare module absent
                return Path(self.config.dataset).expanduser()
            return resolve_data_dir(self.config.dataset)
        return default_data_dir()

    _COMPARED = ("gpu", "torch_version", "cuda_version", "data_fingerprint", "harness_fingerprint")

    def _check_comparability(self, env: dict) -> None:
        changes = {
            key: (self.run_row.get(key), env.get(key))
            for key in self._COMPARED
            if self.run_row.get(key) != env.get(key)
        }
        if not changes:
            return
        described = "; ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())
        if not self.config.allow_env_change:
            raise AutoloopError(
                f"run '{self.tag}' was started with a different environment ({described}): its trials would not be "
                "comparable; use another --tag, or pass --allow-env-change to continue anyway (it is recorded)"
            )
        history = list(self.run_row.get("env_changes") or [])
        history.append({"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "changes": {k: list(v) for k, v in changes.items()}})
        self.store.update_run(self.run_row["id"], env_changes=history, **{k: env.get(k) for k in changes})
        self._event("env_change", f"environment changed and accepted: {described}")
        self._say(f"environment changed (accepted with --allow-env-change): {described}", "yellow")

    # ------------------------------------------------------------------ start-up

    def open(self) -> None:
        if self._train_script() is not None and not self._train_script().exists():
            raise AutoloopError(
                f"training script {self._train_script()} does not exist: create it or set train_command in [tool.autoloop]"
            )
        script = self._train_script()
        if script is not None and not script.resolve().is_relative_to(self.repo_dir):
            raise AutoloopError(
                f"the training script {script} is outside the project folder {self.repo_dir}: run autoloop in the "
                "folder that holds it (edits, training and .autoloop/ all refer to that folder)"
            )
        self.repo = GitRepo.open(self.repo_dir)
        self.state_dir.mkdir(exist_ok=True)
        self.store = Store(self.db_path())
        self._lock = RunLock.for_folder(self.repo_dir).acquire(self.tag, self.repo_dir)  # one loop per working tree
        try:
            self._reap_helpers()
            self._exclude_runtime_files()
            env = self._environment()
            existing = self.store.get_run(self.tag)
            if existing is None:
                branch, base, _ = self.repo.ensure_branch(self.tag)
                self.run_row = self.store.create_run(
                    self.tag,
                    branch=branch,
                    repo=str(self.repo_dir),
                    base_commit=base,
                    best_commit=base,
                    config=_config_dict(self.config),
                    status=RunStatus.ACTIVE,
                    **{k: env.get(k) for k in (
                        "host", "gpu", "driver", "torch_version", "cuda_version", "python_version",
                        "data_fingerprint", "harness_fingerprint",
                    )},
                )
                self.branch = branch
            else:
                self.run_row = existing
                self.branch = existing["branch"]
                self._check_comparability(env)
                self.recover()
                self.repo.ensure_branch(self.tag)
                self.store.update_run(existing["id"], status=RunStatus.ACTIVE, stop_requested=0, pause_reason=None,
                                      config=_config_dict(self.config))
            self.run_row = self.store.get_run(self.tag)
            self._record_rules(existing)
        except BaseException:
            self.close()
            raise

    def _record_rules(self, existing: dict | None) -> None:
        """The decision rule and the isolation of this invocation, on the run and said once."""
        fields = {}
        rule = self.config.decision_rule
        if existing is not None and (existing.get("decision_rule") or "strict") != rule:
            before = existing.get("decision_rule") or "strict (one run, lower wins: before autoloop decided with noise)"
            message = f"run '{self.tag}' was decided by the {before} rule; it resumes with the {rule} rule (docs/decisions.md)"
            self._event("rule_change", message)
            self._say(message, "yellow")
        fields["decision_rule"] = rule
        if self.verifier is not None:
            sandbox = self.measurer.describe_sandbox()
            fields["sandbox"] = sandbox
            if not sandbox.startswith("bwrap"):
                self._event("unsandboxed", f"trials run unsandboxed: {sandbox}")
                self._say(f"trials run unsandboxed: {sandbox} (docs/verification.md)", "yellow")
        self.store.update_run(self.run_row["id"], **fields)
        self.run_row = self.store.get_run(self.tag)

    def _reap_helpers(self) -> None:
        """End helper processes (coding agents) of this folder's runs that a dead controller
        left running, and delete their temporary clones (autoloop.proposers.agent). Part of
        recovery, for a new tag too: it runs holding the working tree's lock, so no live
        controller owns them."""
        from autoloop.proposers.agent import reap_helpers

        for run in self.store.runs():
            if run.get("repo") in (None, str(self.repo_dir)):  # a db shared with other folders: only ours
                for line in reap_helpers(self.store, [run["id"]]):
                    self.store.add_event(run["id"], "recovered", f"helper process left by a dead controller: {line}")

    def close(self) -> None:
        lock = getattr(self, "_lock", None)
        if lock is not None and lock.held and self.store is not None and self.run_row is not None:
            try:  # an agent still preparing a proposal when the run stops must not outlive it
                self._reap_helpers()
            except Exception as exc:  # never mask the error that is closing the run
                self._say(f"could not end helper processes ({exc}): the next start does it", "yellow")
        if lock is not None:
            lock.release()
        if self.store is not None:
            self.store.close()

    def best_commit(self) -> str:
        run = self.store.get_run(self.tag)
        return run["best_commit"] or run["base_commit"]

    # ------------------------------------------------------------------ several workers

    @property
    def parallel(self) -> bool:
        return self.executor is not None

    def bound_slot(self):
        """The worker slot bound to the calling thread; None on the serial path."""
        return getattr(self._slots, "slot", None)

    def current_lineage(self) -> str | None:
        return getattr(self._local, "lineage", None)

    def lineage_of(self, slot) -> str | None:
        """Islands: worker k advances lineage w<k>; shared: one lineage for all."""
        return slot.name if self.config.search_mode == "islands" else None

    def trials_in_flight(self) -> list[int]:
        with self._git_lock:
            return list(self._in_flight)

    def execute_on(self, slot, item: WorkItem, lineage: str | None) -> dict:
        """`execute(item)` in a worker thread: its measurements go through `slot`."""
        self.bind_slot(slot)
        if item.kind == "resume" and self.config.search_mode == "islands":
            row = self.store.trial_by_id(item.derived_from)
            lineage = row.get("lineage") if row and row.get("lineage") not in (None, "main") else lineage
        if item.kind in ("baseline", "rerun") or item.trial_kind in (Kind.BASELINE, Kind.RERUN, Kind.DRIFT):
            lineage = None  # the run's own incumbent, shared by every lineage
        self._local.lineage = lineage
        try:
            return self.execute(item)
        finally:
            self.bind_slot(None)
            self._local.lineage = None

    def _islands(self) -> dict[str, int]:
        raw = (self.store.get_run(self.tag) or {}).get("islands")
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except ValueError:
                raw = None
        return dict(raw or {})

    def incumbent_trial(self, lineage: str | None = None) -> dict | None:
        """What a trial of `lineage` (default: the calling thread's) is compared with: the
        run's incumbent, or in islands mode the lineage's own."""
        lineage = lineage or self.current_lineage()
        if lineage and self.config.search_mode == "islands":
            trial_id = self._islands().get(lineage)
            if trial_id is not None:
                row = self.store.trial_by_id(trial_id)
                if row is not None:
                    return row
            return self.store.best_trial(self.run_row["id"], lineage="main")
        return self.store.best_trial(self.run_row["id"])

    def parent_for(self, lineage: str | None) -> str:
        """The commit new proposals of `lineage` start from."""
        if lineage and self.config.search_mode == "islands":
            incumbent = self.incumbent_trial(lineage)
            if incumbent is not None and incumbent.get("trial_commit"):
                return incumbent["trial_commit"]
        return self.best_commit()

    def _lineage_branch(self, lineage: str) -> str:
        return f"{self.branch}-{lineage}"

    def _keep_in_lineage(self, trial: dict, lineage: str) -> str:
        """Islands: `trial` is its lineage's incumbent now; returns the run's best commit
        (the best incumbent over the lineages)."""
        islands = self._islands()
        islands[lineage] = trial["id"]
        self.store.update_run(self.run_row["id"], islands=islands)
        self.repo.set_lineage_branch(self._lineage_branch(lineage), trial["trial_commit"])
        return self._best_of_islands(islands, extra=trial)["trial_commit"]

    def _best_of_islands(self, islands: dict[str, int], extra: dict | None = None) -> dict:
        rows = [self.store.trial_by_id(tid) for tid in islands.values()]
        if extra is not None:
            rows.append({**self.store.trial_by_id(extra["id"]), **{k: v for k, v in extra.items() if v is not None}})
        rows = [r for r in rows if r is not None and r.get("metric") is not None]
        return min(rows, key=lambda r: r["metric"])

    def after_parallel_trial(self, trial: dict) -> None:
        """In the main thread after each trial of the parallel loop: islands migrate."""
        every = self.config.migrate_every
        if self.config.search_mode != "islands" or not every:
            return
        finished = [t for t in self.store.trials(self.run_row["id"])
                    if t["status"] != Status.RUNNING.value and t["kind"] != Kind.BASELINE.value]
        if len(finished) % every == 0:
            self.migrate()

    def migrate(self) -> list[str]:
        """The best lineage's incumbent becomes the incumbent of every lineage it beats."""
        with self._git_lock:
            islands = self._islands()
            lineages = [self.lineage_of(slot) for slot in (self.executor.slots if self.executor else [])]
            base = self.store.best_trial(self.run_row["id"], lineage="main")
            for lineage in lineages:
                if lineage and lineage not in islands and base is not None:
                    islands[lineage] = base["id"]
            if len(islands) < 2:
                return []
            best = self._best_of_islands(islands)
            moved = []
            for lineage, trial_id in sorted(islands.items()):
                row = self.store.trial_by_id(trial_id)
                if trial_id == best["id"] or row is None or row.get("metric") is None or row["metric"] <= best["metric"]:
                    continue
                islands[lineage] = best["id"]
                self.repo.set_lineage_branch(self._lineage_branch(lineage), best["trial_commit"])
                moved.append(f"{lineage} adopts trial {best['number']} ({best['metric']:.4f} < {row['metric']:.4f})")
            if moved:
                self.store.update_run(self.run_row["id"], islands=islands)
                self._event("migration", "; ".join(moved))
                self._say("migration: " + "; ".join(moved))
            return moved

    def _stale_keep(self, trial: dict, outcome: "TrialOutcome") -> "TrialOutcome":
        """Shared incumbent: a keep decided against an incumbent that is no longer the best
        (another trial was kept while it trained) is not kept over the newer best; its edit
        is re-queued on the new best when it still applies."""
        if outcome.status != Status.KEEP or trial["kind"] == Kind.BASELINE.value or not self.parallel:
            return outcome
        compared = (outcome.fields.get("decision") or {}).get("incumbent_id")
        current = self.incumbent_trial()
        if compared is None or current is None or current["id"] == compared:
            return outcome
        old = self.store.trial_by_id(compared)
        files, problem = self._rebased_files(trial, current["trial_commit"])
        what = (f"better than its incumbent, trial {old['number'] if old else compared} ({outcome.reason}), but trial "
                f"{current['number']} was kept while it trained")
        if problem:
            reason = f"{what}; not re-queued: {problem}"
        else:
            self._requeue.append((trial["id"], self.current_lineage()))
            outcome.fields["decision"] = {**(outcome.fields.get("decision") or {}), "requeued": True}
            reason = f"{what}; its edit is re-queued on the new best"
        self._event("rebase", f"trial {trial['number']}: {reason}", trial_id=trial["id"])
        return TrialOutcome(Status.DISCARD, reason, outcome.fields)

    def _rebased_files(self, trial: dict, onto: str) -> tuple[dict[str, str], str | None]:
        """The trial's edit (parent -> trial commit) merged onto `onto`, file by file
        (`git merge-file`): ({path: content}, None), or ({}, why it does not apply)."""
        import subprocess
        import tempfile

        parent, mine = trial.get("parent_commit"), trial.get("trial_commit")
        if not parent or not mine:
            return {}, "it has no commit"
        merged = {}
        for path in self.repo.changed_paths(parent, mine):
            read = lambda sha: self.repo.file_reader(sha)(path)  # noqa: E731
            base, theirs, ours = read(parent), read(mine), read(onto)
            if theirs is None or base is None or ours is None:
                return {}, f"{path} was added or deleted"
            with tempfile.TemporaryDirectory(prefix="autoloop-rebase-") as tmp:
                names = []
                for name, text in (("ours", ours), ("base", base), ("theirs", theirs)):
                    (Path(tmp) / name).write_text(text)
                    names.append(str(Path(tmp) / name))
                done = subprocess.run(["git", "merge-file", "-p", *names], capture_output=True, text=True)
            if done.returncode != 0:
                return {}, f"its change to {path} conflicts with the new best"
            merged[path] = done.stdout
        return merged, None

    def load_requeued(self) -> None:
        """Edits re-queued by an earlier invocation that never ran again (the controller
        stopped or died first): the queue lives in the db, not only in memory."""
        trials = self.store.trials(self.run_row["id"])
        retried = {t.get("derived_from") for t in trials}
        self._requeue = [(t["id"], t.get("lineage") if t.get("lineage") != "main" else None) for t in trials
                         if (t.get("decision") or {}).get("requeued") and t["id"] not in retried]

    def take_requeued(self, lineage: str | None = None) -> WorkItem | None:
        """A re-queued edit, re-based onto the current best now (it may have moved again)."""
        while True:
            # Islands: a lineage's edit goes back to its own lineage.
            entry = next((e for e in self._requeue if lineage is None or e[1] in (None, lineage)), None)
            if entry is None:
                return None
            self._requeue.remove(entry)
            trial = self.store.trial_by_id(entry[0])
            parent = self.parent_for(lineage)
            files, problem = self._rebased_files(trial, parent)
            if problem:
                self._event("rebase", f"trial {trial['number']} is not tried again: {problem}", trial_id=trial["id"])
                continue
            from autoloop.proposers.proposal import Edit

            proposal = Proposal(f"{trial.get('description') or 'edit'} (re-based from trial {trial['number']})",
                                [Edit(path=p, content=text) for p, text in files.items()],
                                source=trial.get("proposer") or "controller")
            return WorkItem("proposal", reason=proposal.description, proposal=proposal, parent=parent,
                            derived_from=trial["id"])

    def recover(self) -> list[int]:
        """Make processes, git and db agree after a dead controller. Returns recovered trial numbers."""
        run_id = self.run_row["id"]
        recovered = []
        ours_dirty = False
        for trial in self.store.running_trials(run_id):
            if trial.get("pgid"):
                kill_process_group(trial["pgid"], expected_pid=trial.get("pid"), expected_start_time=trial.get("pid_start_time"))
            done = self.store.measurements_for(trial["id"])
            if done and trial.get("trial_commit") and trial["kind"] != Kind.ABLATION.value:
                # Its measurements are recorded: the trial goes on where it stopped (the run in
                # flight is lost and run again; none recorded is repeated).
                self._event("recovered", f"trial {trial['number']} resumes after a dead controller with "
                            f"{len(done)} measurement{'s' if len(done) != 1 else ''} recorded", trial_id=trial["id"])
                recovered.append(trial["number"])
                ours_dirty = True
                continue
            self.store.update_trial(
                trial["id"], status=Status.INTERRUPTED,
                reason="the controller stopped while this trial ran; recovered at the next start",
            )
            if trial.get("idea_id"):
                # The idea was never evaluated: give it back to the queue.
                self.store.set_idea_status(trial["idea_id"], IdeaStatus.PENDING)
            self._event("recovered", f"trial {trial['number']} interrupted by a dead controller", trial_id=trial["id"])
            recovered.append(trial["number"])
            ours_dirty = True
        for idea in self.store.ideas(run_id, status=IdeaStatus.TAKEN):
            # Taken for a proposal that never became a trial (possibly prepared in the
            # background), or whose trial ended just before the controller died.
            trial = self.store.trial_by_id(idea["trial_id"]) if idea.get("trial_id") else None
            if trial is None or trial["status"] == Status.INTERRUPTED.value:
                self.store.set_idea_status(idea["id"], IdeaStatus.PENDING)
            elif trial["status"] != Status.RUNNING.value:
                self.store.set_idea_status(idea["id"], IdeaStatus.DONE)
        archived = self.repo.archived(self.tag)
        best = self.best_commit()
        for trial in self.store.trials(run_id):
            sha = trial.get("trial_commit")
            if sha and trial["kind"] != Kind.BASELINE.value and trial["status"] != Status.KEEP.value \
                    and sha != best and trial["number"] not in archived and self.repo.commit_exists(sha):
                self.repo.archive(self.tag, trial["number"], sha)
        tip = self.repo.branch_commit(self.branch)
        if tip is not None and tip != best:
            known = {t.get("trial_commit") for t in self.store.trials(run_id)} | {self.run_row["base_commit"]}
            if tip not in known:
                # A commit on the run's branch that no trial made: keep it reachable.
                ref = f"refs/autoloop/{self.tag}/orphans/{tip[:12]}"
                self.repo.set_ref(ref, tip)
                self._event("recovered", f"branch tip {tip[:12]} had no trial row; archived as {ref}")
            ours_dirty = True
        if ours_dirty or (tip is not None and tip != best):
            self._checkout(best)
        return recovered

    # ------------------------------------------------------------------ the loop

    def chain(self):
        if self._chain is None:
            self._chain = build_chain(self.config)
        return self._chain

    def _stop_reason(self, started: float, trials_run: int) -> str | None:
        cfg = self.config
        if self._pending_pause:
            return None  # the pause (a full disk) is recorded first, whatever else would stop the run
        if self.abort_requested:
            return "interrupted (Ctrl-C)"
        if cfg.max_trials is not None and trials_run >= cfg.max_trials:
            return f"reached --max-trials {cfg.max_trials}"
        if self.store.stop_requested(self.run_row["id"]):
            return "stopped by `autoloop stop`"
        if cfg.hours is not None:
            left = started + cfg.hours * 3600 - time.time()
            if left < self._trial_estimate():
                return f"--hours {cfg.hours}: the next trial could not finish in the {max(left, 0) / 60:.1f} min left"
        return None

    def _trial_estimate(self) -> float:
        """The median wall time of a recent trial, every run it took (its own and the
        incumbent's re-measurements) counted."""
        walls = []
        for t in self.store.trials(self.run_row["id"], last=20):
            runs = [m.get("wall_seconds") or 0.0 for m in self.store.measurements_for(t["id"])]
            wall = sum(runs) if runs else t.get("wall_seconds")
            if wall:
                walls.append(wall)
        if walls:
            return statistics.median(walls)
        return self.config.time_budget + 30.0

    def run(self) -> RunSummary:
        """Run trials until a stop condition; always leaves git on the best commit."""
        self.chain()  # a misconfigured proposer (no model, agent not installed) fails now, before the baseline
        summary = RunSummary(tag=self.tag)
        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread (e.g. some test runners)
                pass
        try:
            self.open()
        except BaseException:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            raise
        try:
            self._check_before_the_night()
            scheduler = self.scheduler = Scheduler(self)
            started = time.time()
            if self.config.executor != "serial":
                from autoloop.measure.executors import make_executor
                from autoloop.loop.run import ParallelLoop

                self.executor = make_executor(self)
                self._say(f"{self.config.executor} executor: {len(self.executor.slots)} workers "
                          f"({', '.join(f'{s.name} on {s.device}' for s in self.executor.slots)}), "
                          f"{self.config.search_mode} search")
                ParallelLoop(self, self.executor).run(summary, started)
            while self.executor is None:
                reason = self._stop_reason(started, summary.trials_run)
                if reason:
                    summary.stop_reason = reason
                    break
                item = self._integrity_pause() or scheduler.next_item()
                if item is None:
                    summary.stop_reason = scheduler.exhausted_reason
                    break
                if item.kind == "pause":
                    summary.stop_reason = f"paused: {item.reason}"
                    summary.paused = True
                    self.store.update_run(self.run_row["id"], status=RunStatus.PAUSED, pause_reason=item.reason)
                    self._event("paused", item.reason)
                    break
                trial = self.execute(item)
                summary.trials_run += 1
                scheduler.observe(trial)
            if not summary.paused:
                final = RunStatus.STOPPED if (self.abort_requested or "stop" in summary.stop_reason) else RunStatus.FINISHED
                self.store.update_run(self.run_row["id"], status=final, stop_requested=0)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            try:
                if self.executor is not None:
                    self.executor.close()
                if self.scheduler is not None:
                    self.scheduler.close()  # hands back a proposal prepared for a trial that will not run
                if self.repo is not None and self.store is not None and self.run_row is not None:
                    self._converge_git_at_exit()
            finally:
                self._fill_summary(summary)
                self._notify_end(summary)
                self.close()
        return summary

    def _check_before_the_night(self) -> None:
        """`autoloop check` on a new run's train.py, in its own process: a model that cannot
        overfit one batch has a bug, and the night should not be spent on it. The LR range
        test's result is stored on the run for the search proposer and the LLM brief."""
        if not self.config.check or self.verifier is None or self.run_row.get("check_result") is not None \
                or self.store.trials(self.run_row["id"], last=1):
            return
        script = self._train_script()
        if script is None or script.name != "train.py" or script.parent != self.repo_dir:
            return
        import subprocess
        import sys

        parts = "overfit,lr,budget"
        command = [sys.executable, "-m", "autoloop", "check", "--repo", str(self.repo_dir), "--tag", self.tag,
                   "--db", str(self.db_path()), "--parts", parts, "--time-budget", str(self.config.time_budget)]
        if self.config.max_steps:
            command += ["--max-steps", str(self.config.max_steps)]
        if self.config.hours:
            command += ["--hours", str(self.config.hours)]
        if self.config.dataset:
            command += ["--dataset", self.config.dataset]
        self._say("checking train.py before the night: overfit one batch, LR range test, budget plan (--no-check skips)")
        done = subprocess.run(command, cwd=self.repo_dir, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        for line in done.stdout.splitlines():
            self._say(f"  {line}")
        self.run_row = self.store.get_run(self.tag)
        if done.returncode != 0:
            result = self.run_row.get("check_result") or {}
            failed = [part.get("message") for part in result.values()
                      if isinstance(part, dict) and part.get("status") == "fail" and part.get("message")]
            tail = "; ".join(failed) or (done.stderr.strip().splitlines() or done.stdout.strip().splitlines()
                                         or ["no output"])[-1]
            self._event("check_failed", tail)
            raise AutoloopError(f"`autoloop check` failed before the baseline: {tail} (fix train.py, or run with "
                                "--no-check to start anyway)")

    def _on_signal(self, signum, frame) -> None:
        if self.abort_requested:
            raise KeyboardInterrupt  # a second Ctrl-C: stop waiting politely
        self.abort_requested = True
        self._say("stopping: killing the current trial and resetting to the best commit (Ctrl-C again to force)", "yellow")

    def _checkout(self, sha: str) -> None:
        """Move the run's branch to `sha` and make the worktree match, keeping the human's
        uncommitted edits to files proposals cannot change (e.g. program.md, to steer a
        running loop). Such files are identical in every trial commit, so keeping the
        local version is exact; a copy goes to .autoloop/ first so a crash cannot lose it."""
        saved = {}
        for path in self.repo.dirty_files():
            if matches(path, self.config.editable) or not (self.repo_dir / path).is_file():
                continue
            saved[path] = (self.repo_dir / path).read_bytes()
        if saved:
            backup = self.state_dir / self.tag / "local-edits"
            for path, data in saved.items():
                (backup / path).parent.mkdir(parents=True, exist_ok=True)
                (backup / path).write_bytes(data)
        self.repo.checkout_commit(self.branch, sha)
        for path, data in saved.items():
            (self.repo_dir / path).write_bytes(data)

    def _converge_git(self) -> None:
        best = self.best_commit()
        dirty = any(matches(path, self.config.editable) for path in self.repo.dirty_files())
        if self.repo.branch_commit(self.branch) != best or dirty:
            self._checkout(best)

    def _fill_summary(self, summary: RunSummary) -> None:
        run_id = self.run_row["id"] if self.run_row else None
        if run_id is None:
            return
        trials = self.store.trials(run_id)
        for t in trials:
            summary.statuses[t["status"]] = summary.statuses.get(t["status"], 0) + 1
        best = self.store.best_trial(run_id)
        summary.best_metric = best["metric"] if best else None
        summary.best_commit = self.best_commit()
        baseline = [t for t in trials if t["kind"] == Kind.BASELINE.value and t["metric"] is not None]
        summary.baseline_metric = baseline[0]["metric"] if baseline else None
        summary.kept = summary.statuses.get(Status.KEEP.value, 0)

    # ------------------------------------------------------------------ one trial

    def proposal_context(self, parent: str, repo: GitRepo | None = None) -> ProposalContext:
        """`repo`: a GitRepo of the same repository for use from another thread (prefetch)."""
        best = self.incumbent_trial()
        repo = repo or self.repo

        read_parent_file = repo.file_reader(parent)
        return ProposalContext(
            config=self.config, store=self.store, run=self.run_row, repo=repo, parent_commit=parent,
            read_parent_file=read_parent_file, best_metric=best["metric"] if best else None,
        )

    def _program_hash(self) -> str | None:
        path = self.repo_dir / "program.md"
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.exists() else None

    def execute(self, item: WorkItem) -> dict:
        before = self.store.trials(self.run_row["id"], last=1)
        try:
            if item.kind == "resume":
                trial = self.store.trial_by_id(item.derived_from)
                self._say(f"trial {trial['number']} resumes: {trial.get('description') or trial['kind']}", "yellow")
                trial = self._train_and_decide(trial)
            elif item.kind == "proposal":
                trial = self._execute_proposal(item.proposal, item.parent, derived_from=item.derived_from,
                                               kind=item.trial_kind)
            else:
                trial = self._execute_rerun(item)
        except Exception as exc:  # a full disk, wherever it surfaced in the trial's handling
            if not is_disk_full(exc):
                raise
            latest = self.store.trials(self.run_row["id"], last=1)
            ours = bool(latest) and (not before or latest[0]["id"] != before[0]["id"])  # this item's trial
            return self._pause_for_full_disk(
                disk_full_what(exc), latest[0] if ours and self._failed_for_full_disk(latest[0]) else None)
        line = self._failed_for_full_disk(trial)
        if line is not None:  # training itself ran out of space (e.g. saving its checkpoint)
            return self._pause_for_full_disk(f"trial {trial['number']}: {line}", trial)
        return trial

    @staticmethod
    def _failed_for_full_disk(trial: dict) -> str | None:
        """The log line saying the disk is full, for a trial that crashed, timed out or failed
        its checks (the verifier's evaluation can run out of space too)."""
        if trial.get("status") not in (Status.CRASH.value, Status.TIMEOUT.value, Status.INVALID.value):
            return None
        return _disk_full_line(trial.get("error_tail"), trial.get("reason"))

    def _pause_for_full_disk(self, what: str, trial: dict | None = None) -> dict:
        """A full disk is nobody's proposal's fault: the trial it hit is `interrupted` (its
        idea goes back to the queue), the db is left with no `running` row, and the run
        pauses with that diagnosis (see `_integrity_pause`). Returns the trial row."""
        try:
            free = f", {shutil.disk_usage(self.state_dir).free >> 20} MB free"
        except OSError:
            free = ""
        reason = (f"the disk is full ({what}{free}): free some space, then resume with "
                  f"`autoloop run --tag {self.tag}`")
        run_id = self.run_row["id"]
        try:
            hit = {t["id"]: t for t in self.store.running_trials(run_id)}
            if trial is not None:
                hit[trial["id"]] = trial
            for row in hit.values():
                if row.get("pgid"):
                    kill_process_group(row["pgid"], expected_pid=row.get("pid"),
                                       expected_start_time=row.get("pid_start_time"))
                self.store.update_trial(row["id"], status=Status.INTERRUPTED, reason=reason)
                if row.get("idea_id"):
                    self.store.set_idea_status(row["idea_id"], IdeaStatus.PENDING)
                self._archive_quietly(row)
            self._event("disk_full", reason, trial_id=next(iter(hit), None))
        except Exception as exc:
            if is_disk_full(exc):  # not even the db can be written: the next start recovers it
                raise DiskFull(f"{reason}; experiments.db could not be updated either (the next start recovers it)") from exc
            raise
        self._say(reason, "red")
        self._pending_pause = reason
        latest = self.store.trials(run_id, last=1)
        return self.store.trial_by_id(trial["id"]) if trial is not None else (latest[0] if latest else {})

    def _archive_quietly(self, trial: dict) -> None:
        """Archive a non-kept trial's commit now if the disk allows; else recovery does it."""
        sha = trial.get("trial_commit")
        if not sha or trial["kind"] in (Kind.BASELINE.value, Kind.RERUN.value) or sha == self.best_commit():
            return
        try:
            self.repo.archive(self.tag, trial["number"], sha)
        except Exception as exc:
            if not is_disk_full(exc):
                raise

    def _converge_git_at_exit(self) -> None:
        """Leave git on the best commit; on a full disk say so: the next start does it."""
        try:
            self._converge_git()
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            self._say(f"git is not reset to the best commit ({disk_full_what(exc)}): the next start does it", "yellow")

    def _common_fields(self, proposal: Proposal | None = None) -> dict:
        # An LLM/agent proposal carries the hash of the program.md it was written from.
        program_hash = (proposal.meta.get("program_hash") if proposal else None) or self._program_hash()
        fields = {"seed": self.config.seed, "program_hash": program_hash, "started_at": _now()}
        slot = self.bound_slot()
        if slot is not None:
            fields["worker"] = slot.name
        if self.current_lineage():
            fields["lineage"] = self.current_lineage()
        return fields

    def _record_proposal_calls(self, proposal: Proposal, trial_id: int) -> None:
        """Tokens, cost and latency of the calls that produced the proposal, now that its trial exists."""
        for call in proposal.meta.get("calls", ()):
            self.store.add_proposal_record(run_id=self.run_row["id"], trial_id=trial_id, **call)
        if proposal.meta.get("transcript"):
            self._event("transcript", f"{proposal.source}: {proposal.meta['transcript']}", trial_id=trial_id)

    def _record_invalid(self, proposal: Proposal, parent: str, reason: str, kind: Kind, derived_from=None) -> dict:
        trial = self.store.new_trial(
            self.run_row["id"], kind, status=Status.INVALID, reason=reason, description=proposal.description,
            proposer=proposal.source, idea_id=proposal.idea_id, parent_commit=parent, edits=json.loads(proposal.to_json()),
            model=proposal.model, derived_from=derived_from, best_before=self._best_metric(),
            **self._common_fields(proposal),
        )
        self.store.update_trial(trial["id"], status=Status.INVALID)  # stamps finished_at
        self._record_proposal_calls(proposal, trial["id"])
        if proposal.idea_id:
            self.store.set_idea_status(proposal.idea_id, IdeaStatus.DONE, trial_id=trial["id"])
        self._say(f"trial {trial['number']} invalid: {reason}", "red")
        return self.store.trial_by_id(trial["id"])

    def _best_metric(self) -> float | None:
        best = self.incumbent_trial()
        return best["metric"] if best else None

    def _execute_proposal(self, proposal: Proposal, parent: str, *, derived_from=None, kind=Kind.PROPOSAL) -> dict:
        ctx = self.proposal_context(parent)
        if proposal.meta.get("invalid"):
            # The proposer already judged it (an LLM answer still unusable after repairs, a duplicate).
            return self._record_invalid(proposal, parent, proposal.meta["invalid"], kind, derived_from)
        try:
            files = materialize(proposal, str(self.repo_dir), parent, ctx.read_parent_file)
            changed = validate(files, ctx.read_parent_file, editable=self.config.editable, protected=self.config.protected)
        except Exception as exc:  # whatever the cause, an unusable proposal is one invalid trial
            if is_disk_full(exc):
                raise
            return self._record_invalid(proposal, parent, _invalid_reason(exc), kind, derived_from)
        trial = self.store.new_trial(
            self.run_row["id"], kind, description=proposal.description, proposer=proposal.source,
            idea_id=proposal.idea_id, parent_commit=parent, edits=json.loads(proposal.to_json()), model=proposal.model,
            derived_from=derived_from, best_before=self._best_metric(), **self._common_fields(proposal),
        )
        self._record_proposal_calls(proposal, trial["id"])
        if proposal.idea_id:
            self.store.set_idea_status(proposal.idea_id, IdeaStatus.TAKEN, trial_id=trial["id"])
        faults.fault_point("after_row")
        message = f"autoloop {self.tag} trial {trial['number']}: {proposal.description}"
        with self._git_lock:
            sha = self.repo.commit_files(parent, changed, message)
            self.store.update_trial(trial["id"], trial_commit=sha, diff=self.repo.diff(parent, sha))
        faults.fault_point("after_commit")
        if not self.parallel:  # workers check the commit out in their own worktrees
            self._checkout(sha)
        return self._train_and_decide(self.store.trial_by_id(trial["id"]))

    def _execute_rerun(self, item: WorkItem) -> dict:
        best = self.best_commit()
        trial = self.store.new_trial(
            self.run_row["id"], item.trial_kind, description=item.reason, proposer="controller", parent_commit=best,
            trial_commit=best, derived_from=item.derived_from, best_before=self._best_metric(), **self._common_fields(),
        )
        faults.fault_point("after_row")
        if not self.parallel:
            self._converge_git()
        return self._train_and_decide(self.store.trial_by_id(trial["id"]))

    # ------------------------------------------------------------------ measurements

    @property
    def python(self) -> str:
        import sys

        return sys.executable

    def git_dir(self) -> Path:
        return Path(self.repo.repo.git_dir)

    def compile_cache_dirs(self) -> list[Path]:
        """Caches a training run may write (torch.compile's): shared across trials for speed."""
        from autoloop.harness.contract import cache_root

        path = Path(os.environ.get("AUTOLOOP_COMPILE_CACHE") or cache_root() / "compile")
        path.mkdir(parents=True, exist_ok=True)
        return [path]

    def checkout_for_measurement(self, commit: str) -> None:
        dirty = any(matches(path, self.config.editable) for path in self.repo.dirty_files())
        if self.repo.branch_commit(self.branch) != commit or dirty:
            self._checkout(commit)

    def sources_of(self, commit: str) -> tuple[str, dict[str, str]]:
        """(the train script relative to the project, {path: text} of it and the other
        editable files of `commit` named by a literal path): what the evaluator imports,
        never the working tree. An editable file the commit lacks is skipped."""
        script = self._train_script()
        if script is None:
            raise AutoloopError(
                f"the train command {self.config.train_command!r} names no .py file, so the harness cannot rebuild "
                "the model: use a command like 'python train.py', or run with --no-verify"
            )
        relative = script.resolve().relative_to(self.repo_dir).as_posix()
        files = {}
        for path in [relative] + [p for p in self.config.editable if p != relative and not any(c in p for c in "*?[")]:
            try:
                files[path] = self.repo.show_file(commit, path)
            except AutoloopError:
                if path == relative:
                    raise
        return relative, files

    # ------------------------------------------------------------------ slots

    def current_slot(self):
        """The slot the calling thread's trial measures on (autoloop.measure.executors): the one
        bound to this thread (`bind_slot`), else the serial slot."""
        return getattr(self._slots, "slot", None) or self._serial_slot()

    def bind_slot(self, slot) -> None:
        """Measure this thread's trials on `slot` (None: the serial slot again)."""
        self._slots.slot = slot

    def _serial_slot(self):
        if self._serial is None:
            from autoloop.measure.executors.serial import SerialSlot

            self._serial = SerialSlot(self)
        return self._serial

    def worker_pause(self, reason: str) -> None:
        """A worker found the harness or the data changed under its run: the run pauses
        before the next work item (unless the verifier's own check pauses it first)."""
        if self._worker_pause is None:
            self._worker_pause = reason

    def best_metric(self) -> float | None:
        return self._best_metric()

    def measure_commit(self, commit: str, seed: int, *, owner: dict, role: str, for_trial: dict | None = None,
                       verify: bool = False) -> Measurement:
        """One training run of `commit` at `seed`, evaluated by the harness and recorded as a
        measurement of `owner` (for `autoloop ablate` and the decision loop)."""
        m = self.measurer.measure(commit, seed, owner=owner, role=role, running=for_trial or owner, verify=verify)
        if m.ok and for_trial is None and owner.get("status") == Status.RUNNING.value:
            self.store.update_trial(owner["id"], metric_source=m.metric_source)
        return m

    def seeds(self, n: int) -> list[int]:
        """The run's seed sequence: every trial's k-th run uses the k-th seed, so candidate
        and incumbent are compared on the same data order and init stream."""
        return [self.config.seed + k for k in range(n)]

    def decision_config(self) -> DecisionConfig:
        cfg = self.config
        return DecisionConfig(rule=cfg.decision_rule, baseline_seeds=cfg.baseline_seeds, max_runs=cfg.max_runs,
                              alpha=cfg.alpha, futility=cfg.futility, margin=cfg.keep_margin)

    def _runs(self, trial: dict, roles: tuple[str, ...] | None = None, device: str | None = None) -> dict[int, float]:
        """{seed: metric} of a trial's successful runs (the first run per seed); with
        `device`, only runs on that kind of device (or of unknown kind)."""
        runs: dict[int, float] = {}
        for row in self.store.measurements(trial["id"]):
            if row.get("status") not in (None, "ok") or row.get("metric") is None or row.get("seed") is None:
                continue
            if device is not None and row.get("device") not in (None, device):
                continue
            if roles is not None and (row.get("role") or "candidate") not in roles:
                continue
            runs.setdefault(int(row["seed"]), float(row["metric"]))
        return runs

    def incumbent_runs(self, incumbent: dict, device: str | None = None) -> dict[int, float]:
        """The incumbent's runs a candidate is paired with: in time mode a faster GPU buys
        more steps, so with several kinds of device only those on the candidate's kind."""
        return self._runs(incumbent, ("baseline", "candidate", "incumbent"), device)

    def noise(self) -> Noise | None:
        return self._noise_cache

    def update_noise(self) -> Noise | None:
        """Pool every repeated measurement of the run into the noise of a paired difference."""
        run_id = self.run_row["id"]
        repeats, paired = [], []
        trials = {t["id"]: t for t in self.store.trials(run_id)}
        by_trial: dict[int, dict[int, float]] = {}
        for tid, trial in trials.items():
            runs = self._runs(trial, ("baseline", "candidate", "incumbent", "ablation"))
            if runs:
                by_trial[tid] = runs
            if len(runs) >= 2:
                repeats.append(list(runs.values()))
        for tid, trial in trials.items():
            incumbent_id = (trial.get("decision") or {}).get("incumbent_id")
            if incumbent_id in by_trial and tid in by_trial and trial["kind"] != Kind.BASELINE.value:
                cand, inc = by_trial[tid], by_trial[incumbent_id]
                diffs = [cand[s] - inc[s] for s in cand if s in inc]
                if len(diffs) >= 2:
                    paired.append(diffs)
        noise = pool_noise(repeats, paired)
        self._noise_cache = noise
        if noise is not None:
            self.store.update_run(run_id, noise_sd=noise.run_sd, noise_pair_sd=noise.pair_sd, noise_df=noise.df)
        return noise

    # ------------------------------------------------------------------ one trial

    def _train_and_decide(self, trial: dict) -> dict:
        """Measure the trial as often as its decision needs, then keep or discard it."""
        with self._git_lock:
            self._in_flight.add(trial["id"])
        try:
            return self._train_and_decide_once(trial)
        finally:
            with self._git_lock:
                self._in_flight.discard(trial["id"])

    def _train_and_decide_once(self, trial: dict) -> dict:
        trial_dir = self.trial_dir(trial["number"])
        if not self.store.measurements(trial["id"]) and trial_dir.exists():
            shutil.rmtree(trial_dir)  # left by an interrupted attempt with this number
        trial_dir.mkdir(parents=True, exist_ok=True)
        busy = gpu_busy_report()
        if busy:
            message = "the GPU is held by other processes: " + "; ".join(busy)
            self._event("gpu_busy", message, trial_id=trial["id"])
            self._say(message, "yellow")
        if self._noise_cache is None:
            self.update_noise()
        kind = trial["kind"]
        if kind == Kind.BASELINE.value:
            outcome = self._measure_baseline(trial)
        elif kind in (Kind.RERUN.value, Kind.DRIFT.value):
            outcome = self._measure_incumbent_again(trial)
        else:
            outcome = self._compare(trial)
        return self._finish(trial, outcome)

    def _measured(self, trial: dict, m: Measurement) -> TrialOutcome | None:
        """The trial's end when a run of its own failed, else None."""
        if m.ok:
            return None
        # "lost": the worker died (its process, a Ray node), not the trial's fault: interrupted,
        # and its idea goes back to the queue (_finish) to run again.
        status = {"aborted": Status.INTERRUPTED, "lost": Status.INTERRUPTED, "timeout": Status.TIMEOUT,
                  "invalid": Status.INVALID}.get(m.status, Status.CRASH)
        fields = dict(m.fields)
        fields.pop("curve", None)
        return TrialOutcome(status, m.reason or m.status, fields)

    def _measure_baseline(self, trial: dict) -> TrialOutcome:
        """The unmodified script at `baseline_seeds` seeds: the first incumbent and the
        first measure of the noise."""
        cfg = self.decision_config()
        seeds = self.seeds(max(1, cfg.baseline_seeds if cfg.rule != "strict" else 1))
        commit = trial["trial_commit"]
        last = None
        for seed in seeds:
            if seed in self._runs(trial):
                continue
            if self.abort_requested:
                return TrialOutcome(Status.INTERRUPTED, "interrupted by the user", {})
            last = self.measure_commit(commit, seed, owner=trial, role="baseline")
            failed = self._measured(trial, last)
            if failed:
                return failed
        self.update_noise()
        runs = self._runs(trial)
        outcome = TrialOutcome(Status.KEEP, "", self._trial_fields(trial, last))
        mean, se = estimate(list(runs.values()), self.noise())
        outcome.fields.update(metric=mean, metric_sd=se, n_runs=len(runs))
        noise = self.noise()
        outcome.reason = f"baseline: val_bpb {_pm(mean, se)} over {len(runs)} seed{'s' if len(runs) > 1 else ''}" + (
            f"; run-to-run noise {noise.run_sd:.4f} bpb" if noise is not None else "")
        return self._verify_keep(trial, outcome, incumbent=None)

    def _measure_incumbent_again(self, trial: dict) -> TrialOutcome:
        """A `rerun` (circuit breaker) or `drift` trial: the incumbent at its first seed."""
        incumbent = self.store.best_trial(self.run_row["id"])
        seed = self.seeds(1)[0]
        m = self.measure_commit(incumbent["trial_commit"] or self.best_commit(), seed, owner=trial,
                                role="drift" if trial["kind"] == Kind.DRIFT.value else "rerun")
        failed = self._measured(trial, m)
        if failed:
            return failed
        fields = self._trial_fields(trial, m)
        fields.update(metric=m.metric, n_runs=1)
        before = self.incumbent_runs(incumbent).get(seed)
        if trial["kind"] == Kind.RERUN.value or before is None:
            best = self._best_metric()
            reason = (f"re-run of the incumbent: val_bpb {m.metric:.6f} (best {best:.6f})" if best is not None
                      else f"re-run: val_bpb {m.metric:.6f}")
            return TrialOutcome(Status.DISCARD, reason, fields)
        return self._judge_drift(trial, m, before, fields)

    def _judge_drift(self, trial: dict, m: Measurement, before: float, fields: dict) -> TrialOutcome:
        shift = m.metric - before
        noise = self.noise()
        sd = noise.pair_sd if noise is not None else 0.0
        # A step-mode repeat at the same seed is bit-identical: any shift beyond rounding is real.
        scale = max(sd, 1e-6)
        sigmas = abs(shift) / scale
        fields["decision"] = {"action": "drift", "shift": shift, "pair_sd": sd, "sigmas": sigmas,
                              "seed": m.seed, "before": before, "after": m.metric}
        what = (f"drift check: the incumbent at seed {m.seed} gave {m.metric:.6f}, {before:.6f} when it was measured "
                f"({shift:+.6f}, {sigmas:.1f} x the paired noise {sd:.4f})")
        if sigmas > self.config.drift_pause_sigmas:
            fields["decision"]["pause"] = True
            self._event("drift", what + ": a large shift", trial_id=trial["id"])
            self._pending_pause = (
                f"{what}: the machine or software changed under the run (a throttled GPU, another process, a new "
                "driver?); check it and resume with `autoloop run --tag " + self.tag + "`")
        elif sigmas > self.config.drift_event_sigmas:
            self._event("drift", what, trial_id=trial["id"])
            self._say(what, "yellow")
        return TrialOutcome(Status.DISCARD, what, fields)

    def _compare(self, trial: dict) -> TrialOutcome:
        """The paired, sequential comparison of a candidate with the incumbent (autoloop.decide.rule)."""
        cfg = self.decision_config()
        incumbent = self.incumbent_trial()
        seeds = self.seeds(max(cfg.max_runs, cfg.baseline_seeds, 1) + 1)
        last = None
        while True:
            if self.abort_requested:
                return TrialOutcome(Status.INTERRUPTED, "interrupted by the user", {})
            candidate = self._runs(trial, ("candidate",))
            device = getattr(self.bound_slot(), "device", None) if self.config.allow_mixed_devices else None
            inc_runs = self.incumbent_runs(incumbent, device) if incumbent is not None else {}
            if incumbent is not None and incumbent.get("metric_source") == MetricSource.REPORTED.value:
                cfg = DecisionConfig(rule="strict", margin=self.config.keep_margin)
            verdict = decide(candidate, inc_runs, self.noise(), cfg, seeds)
            record = {**verdict.figures, "action": verdict.action, "reason": verdict.reason, "rule": cfg.rule,
                      "incumbent_id": incumbent["id"] if incumbent else None,
                      "incumbent_number": incumbent["number"] if incumbent else None}
            self.store.update_trial(trial["id"], decision=record)
            if verdict.action == "measure":
                if verdict.side == "incumbent":
                    m = self.measure_commit(incumbent["trial_commit"] or self.best_commit(), verdict.seed,
                                            owner=incumbent, role="incumbent", for_trial=trial)
                    if m.status == "aborted":
                        return TrialOutcome(Status.INTERRUPTED, "interrupted by the user", {})
                    if m.status == "lost":
                        return TrialOutcome(Status.INTERRUPTED, (
                            f"the incumbent's re-measurement at seed {verdict.seed} was lost: {m.reason}"), {})
                    if not m.ok:
                        return TrialOutcome(Status.CRASH, (
                            f"the incumbent (trial {incumbent['number']}) failed when re-measured at seed "
                            f"{verdict.seed}: {m.reason}"), {})
                    self._delete_run_checkpoint(m.run_dir)
                else:
                    last = self.measure_commit(trial["trial_commit"], verdict.seed, owner=trial, role="candidate")
                    failed = self._measured(trial, last)
                    if failed:
                        return failed
                faults.fault_point("between_measurements")
                self.update_noise()
                continue
            fields = self._trial_fields(trial, last)
            mean, se = estimate(list(candidate.values()), self.noise())
            fields.update(metric=mean, metric_sd=se, n_runs=len(candidate))
            best_before = trial.get("best_before")
            if best_before is not None and mean is not None:
                fields["delta"] = mean - (estimate(list(inc_runs.values()), self.noise())[0] if inc_runs else best_before)
            interval = verdict.figures.get("interval") or [None, None]
            record["distinguishable"] = verdict.action == "keep" or (
                None not in interval and (interval[1] < 0 or interval[0] > 0))
            # A near miss: it looked better, but not distinguishably so.
            record["near_miss"] = verdict.action == "discard" and (
                bool(verdict.figures.get("near_miss"))
                or ((verdict.figures.get("mean_diff") or 0.0) < 0 and not record["distinguishable"]))
            fields["decision"] = record
            if incumbent is not None and incumbent.get("metric_source") != MetricSource.REPORTED.value \
                    and any(m.get("role") == "candidate" and m.get("status") == "ok" and m.get("metric") is not None
                            for m in self.store.measurements(trial["id"])) \
                    and self._last_source(trial) == MetricSource.REPORTED.value:
                return TrialOutcome(Status.INVALID, (
                    "only a printed val_bpb (no result JSON): it cannot be checked, so it is not compared with the "
                    "harness-measured best"), fields)
            if verdict.action == "discard":
                return TrialOutcome(Status.DISCARD, verdict.reason, fields)
            return self._verify_keep(trial, TrialOutcome(Status.KEEP, verdict.reason, fields), incumbent=incumbent)

    def _last_source(self, trial: dict) -> str | None:
        row = self.store.trial_by_id(trial["id"])
        return row.get("metric_source") if row else None

    def _verify_keep(self, trial: dict, outcome: TrialOutcome, incumbent: dict | None) -> TrialOutcome:
        """A keep stands only on verified numbers: every run of the trial with a checkpoint
        is re-checked (causality, held-out); then the held-out guard."""
        fields = outcome.fields
        source = self._last_source(trial)
        if source == MetricSource.REPORTED.value:
            fields["metric_source"] = MetricSource.REPORTED.value
            self._say(f"trial {trial['number']}: only a printed val_bpb (no result JSON), so it cannot be verified; "
                      "it is kept as reported (unverified)", "yellow")
            return outcome
        if self.verifier is None or not self.config.verify:
            fields["metric_source"] = source or MetricSource.HARNESS.value
            return outcome
        started = time.monotonic()
        self._say(f"verifying trial {trial['number']} in a fresh process: causality, val_bpb, held-out")
        heldouts = {}
        role = "baseline" if trial["kind"] == Kind.BASELINE.value else "candidate"
        for row in self.store.measurements(trial["id"]):
            if row.get("role") != role or row.get("status") != "ok":
                continue
            ok, reason, heldout = self.measurer.verify(trial, trial, row)
            if not ok:
                fields["verify_seconds"] = time.monotonic() - started
                if self.abort_requested:
                    return TrialOutcome(Status.INTERRUPTED, "interrupted by the user during verification", fields)
                if ok is None:  # the worker was lost: not the trial's fault
                    return TrialOutcome(Status.INTERRUPTED, reason, fields)
                return TrialOutcome(Status.INVALID, reason, fields)
            heldouts[int(row["seed"])] = heldout
        fields["verify_seconds"] = time.monotonic() - started
        fields["metric_source"] = MetricSource.VERIFIED.value
        if heldouts:
            mean, se = estimate(list(heldouts.values()), self.noise())
            fields["heldout_metric"], fields["heldout_sd"] = mean, se
        if incumbent is not None and heldouts:
            inc_heldouts = {int(r["seed"]): float(r["heldout_metric"]) for r in self.store.measurements(incumbent["id"])
                            if r.get("heldout_metric") is not None and r.get("seed") is not None}
            problem = self._heldout_problem(trial, incumbent, heldouts, inc_heldouts)
            if problem:
                return TrialOutcome(Status.INVALID, problem, fields)
        self._delete_checkpoints(trial, keep_last=True)
        self._say(f"trial {trial['number']} verified in {fields['verify_seconds']:.1f} s: held-out "
                  f"{fields.get('heldout_metric', float('nan')):.6f}, causal", "green")
        return outcome

    def _heldout_problem(self, trial, incumbent, heldouts: dict, inc_heldouts: dict) -> str | None:
        from autoloop.decide.heldout import heldout_guard

        if not inc_heldouts:
            return None
        cand_val = self._runs(trial, ("candidate",))
        inc_val = self.incumbent_runs(incumbent)
        shared = [s for s in heldouts if s in inc_heldouts and s in cand_val and s in inc_val]
        if shared:
            val_delta = sum(cand_val[s] - inc_val[s] for s in shared) / len(shared)
            heldout_delta = sum(heldouts[s] - inc_heldouts[s] for s in shared) / len(shared)
            n = len(shared)
        else:
            val_delta = sum(cand_val.values()) / len(cand_val) - sum(inc_val.values()) / len(inc_val)
            heldout_delta = sum(heldouts.values()) / len(heldouts) - sum(inc_heldouts.values()) / len(inc_heldouts)
            n = 1
        noise = self.noise()
        pair_sd = noise.pair_sd if noise is not None else 0.0
        return heldout_guard(val_delta, heldout_delta, pair_sd, n)

    def _trial_fields(self, trial: dict, m: Measurement | None) -> dict:
        if m is None:
            rows = [r for r in self.store.measurements(trial["id"]) if r.get("status") == "ok"]
            return {"wall_seconds": rows[-1].get("wall_seconds")} if rows else {}
        fields = {k: v for k, v in m.fields.items() if k not in ("curve",)}
        fields["checkpoint_path"] = str(m.checkpoint) if m.checkpoint.exists() else None
        if m.fields.get("curve"):
            self._curves[trial["id"]] = m.fields["curve"]
        return fields

    def _progress_curve(self, trial: dict) -> list[dict] | None:
        """The curve of the trial's last run from its progress lines, for a run that ended
        without a result (a divergence that stopped with FAIL, a crash): the diagnosis reads it."""
        rows = [r for r in self.store.measurements(trial["id"]) if r.get("log_path")]
        if not rows:
            return None
        path = Path(rows[-1]["log_path"]).with_name("progress.jsonl")
        points = []
        try:
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and "loss" in record:
                    points.append({k: record.get(k) for k in ("step", "loss", "lr", "grad_norm")}
                                  | {"seconds": record.get("training_seconds")})
        except OSError:
            return None
        return points or None

    def _delete_run_checkpoint(self, run_dir: Path) -> None:
        (run_dir / "checkpoint.pt").unlink(missing_ok=True)

    def _delete_checkpoints(self, trial: dict, keep_last: bool) -> None:
        """Only one checkpoint per kept trial is worth the disk (finalize copies it)."""
        rows = [r for r in self.store.measurements(trial["id"]) if r.get("log_path")]
        keep = Path(rows[0]["log_path"]).parent if (keep_last and rows) else None
        runs = self.trial_dir(trial["number"]) / "runs"
        if not runs.exists():
            return
        for run_dir in runs.iterdir():
            if run_dir != keep:
                self._delete_run_checkpoint(run_dir)

    def _finish(self, trial: dict, outcome: TrialOutcome) -> dict:
        """Record the decision and the new best in one transaction, then make git agree.
        With several workers, finishes take turns: each keep is judged against the best
        as it is at that moment."""
        with self._git_lock:
            return self._finish_now(trial, self._stale_keep(trial, outcome))

    def _finish_now(self, trial: dict, outcome: TrialOutcome) -> dict:
        status, reason, fields = outcome.status, outcome.reason, dict(outcome.fields)
        keep = status == Status.KEEP
        number = trial["number"]
        fields.pop("curve", None)
        if "metric" not in fields:
            # A trial that ended without a metric of its own has none, whatever the row holds
            # (a run that wrote to the db may have set one).
            fields.update(metric=None, metric_source=None)
        curve = self._curves.pop(trial["id"], None) or self._progress_curve(trial)
        if curve:
            from autoloop.decide.diagnosis import diagnose

            flags = diagnose(curve)
            if flags:
                fields["flags"] = flags
        lineage = trial.get("lineage") if self.config.search_mode == "islands" else None
        best = trial["trial_commit"]
        if keep and lineage and lineage != "main":
            best = self._keep_in_lineage({**trial, "metric": fields.get("metric")}, lineage)
        with self.store.transaction():
            self.store.update_trial(trial["id"], status=status, reason=reason, **fields)
            if keep:
                self.store.update_run(self.run_row["id"], best_commit=best)
        if keep and fields.get("heldout_metric") is not None:
            self._watch_overfitting(trial)
        faults.fault_point("during_reset")
        if curve:
            self.store.add_curve(trial["id"], curve)
        if not keep and trial["kind"] not in (Kind.BASELINE.value, Kind.RERUN.value, Kind.DRIFT.value) \
                and trial.get("trial_commit"):
            self.repo.archive(self.tag, number, trial["trial_commit"])
        self._converge_git()
        if trial.get("idea_id"):
            self.store.set_idea_status(
                trial["idea_id"], IdeaStatus.PENDING if status == Status.INTERRUPTED else IdeaStatus.DONE,
                trial_id=trial["id"],
            )
        if not keep:
            self._delete_checkpoints(trial, keep_last=False)
        final = self.store.trial_by_id(trial["id"])
        if self.display is not None:
            self.display.trial_finished(final)
        self.notifier.trial_finished(final)  # a keep or a confirmed gain, for --notify
        return final

    def _integrity_pause(self) -> WorkItem | None:
        """A pause when the disk filled up, a drift check found a large shift, or the harness
        or the data changed under the run (autoloop.trust.watch)."""
        if self._pending_pause:
            reason, self._pending_pause = self._pending_pause, None
            return WorkItem("pause", reason=reason)
        check = getattr(self.verifier, "check_run", None)
        reason = check(self) if check is not None else None
        if not reason and self._worker_pause:
            reason = self._worker_pause  # found by a worker the verifier's check does not see
        self._worker_pause = None
        return WorkItem("pause", reason=reason) if reason else None

    def _watch_overfitting(self, trial: dict) -> None:
        from autoloop.decide.overfit import watch

        signal_ = watch(self.store, self.run_row["id"])
        if signal_ is not None:
            self._event("overfitting", signal_["message"], trial_id=trial["id"])
            self._say(signal_["message"], "yellow")


@dataclass
class TrialOutcome:
    status: Status
    reason: str
    fields: dict


def _pm(mean: float | None, se: float | None) -> str:
    if mean is None:
        return "-"
    return f"{mean:.6f}" if not se else f"{mean:.6f} ± {se:.6f}"


def _disk_full_line(*texts: str | None) -> str | None:
    """The last line of a training log tail (or reason) that says the disk is full."""
    for text in texts:
        for line in reversed((text or "").splitlines()):
            if is_disk_full(line):
                return line.strip()[:200]
    return None


def _invalid_reason(exc: Exception) -> str:
    """One line for a proposal that could not be materialized or validated."""
    if isinstance(exc, InvalidProposal):
        return str(exc)
    text = " ".join(str(exc).split())[:300]
    return f"the proposal cannot be applied: {type(exc).__name__}" + (f": {text}" if text else "")


def _now() -> str:
    from autoloop.store import utcnow

    return utcnow()


def _config_dict(config: Config) -> dict:
    from dataclasses import asdict

    stored = asdict(config)
    stored["notify"] = None  # the user's notify command may hold a webhook's secret: never in the db
    return stored
