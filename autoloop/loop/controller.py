"""The controller: the only writer of experiments.db and of git refs.

It opens a run (or resumes it), runs the loop, and closes it; what happens in between
lives in the modules named here, each a concern of its own:

* `open`: the project folder and its git repository, the db, the run lock (one loop per
  working tree, autoloop.loop.lock), helper processes a dead controller left
  (autoloop.loop.recovery), the environment guard (autoloop.loop.environment), crash
  recovery of a resumed run;
* `run`: Ctrl-C and SIGTERM handlers, the pre-night check (autoloop.loop.preflight), the
  scheduler (autoloop.loop.scheduler), the executor's slots (autoloop.measure.executors),
  then the one loop (autoloop.loop.run), the reserve of a night that ended by its limit
  (the best at fresh seeds: autoloop.loop.reserve), and at the end git left on the best commit;
* `execute`: one work item on the context the loop gives it (autoloop.loop.trial), a full
  disk turned into a pause (autoloop.loop.disk).

What several trials share is owned here, each with a lock named for what it guards:

* `refs_lock`: git refs and the project folder's checkout, and the decisions that move
  them: a trial's commit and its row's sha, a trial's finish (the decision and the run's
  best commit in one transaction, a lineage's incumbent, the archive ref, the checkout),
  a migration between lineages. Re-entrant: a finish converges git, which takes it too.
* `noise` (autoloop.loop.noise.NoiseEstimate), `stops` (the early stop's calibration,
  autoloop.loop.stops.EarlyStops), `requeue` (autoloop.loop.islands.Requeue) and `pauses`
  (autoloop.loop.run.Pauses): each holds its own lock.
* `abort_requested` is a flag, not state to guard: set by the signal handler (or by the
  loop when a trial's thread failed), read by every trial between its steps.
* `run_row` and `display` are replaced only by the main thread before trials start.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from autoloop.config import STATE_DIR, Config
from autoloop.decide.rule import DecisionConfig, default_alpha
from autoloop.errors import AutoloopError, disk_full_what, is_disk_full
from autoloop.gitops import GitRepo
from autoloop.loop import disk, environment, preflight, recovery, reserve, trial
from autoloop.loop.islands import Islands, Requeue
from autoloop.loop.lock import RunLock
from autoloop.loop.notify import notifier_for
from autoloop.loop.noise import INCUMBENT_ROLES, NoiseEstimate, runs_of
from autoloop.loop.run import Loop, Pauses
from autoloop.loop.scheduler import OF_THE_INCUMBENT, Scheduler, Work, WorkItem
from autoloop.loop.stops import EarlyStops
from autoloop.measure.measurer import Measurement, Measurer
from autoloop.proposers import ProposalContext, build_chain
from autoloop.proposers.proposal import matches
from autoloop.decide.figures import status_counts
from autoloop.store import Kind, RunStatus, Status, Store

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
    counts: dict = field(default_factory=dict)  # statuses with the baseline apart (autoloop.decide.figures)
    headline: dict | None = None  # the best re-measured at fresh seeds (autoloop.loop.reserve), when it was
    stopped: bool = False  # the user stopped it (Ctrl-C, SIGTERM, `autoloop stop`), even during the reserve


class Controller:
    def __init__(
        self,
        config: Config,
        project_dir: Path | str = ".",
        *,
        display=None,
        verifier=DEFAULT_VERIFIER,
        chain=None,
    ):
        self.config = config
        self.project_dir = Path(project_dir).resolve()
        self.display = display
        if verifier is DEFAULT_VERIFIER:
            from autoloop.trust.watch import Verifier

            # Bytecode prefixes scoped to this project (.autoloop/pycache), written only by trusted warm-ups.

            verifier = Verifier(cache_root=self.project_dir / STATE_DIR)
        self.verifier = verifier
        self._chain = chain
        self.scheduler: Scheduler | None = None  # set by run(); prepares proposals while trials train
        self.executor = None  # set by run() for the local and ray executors; None: the serial slot
        # `run --ladder-every K`: the scale ladder (autoloop.review.ladder, above the loop) as
        # the CLI hands it in, called with this controller after every K-th keep of a serial run.
        self.ladder_hook = None
        self.abort_requested = False
        self.repo: GitRepo | None = None
        self.store: Store | None = None
        self.run_row: dict | None = None
        self.branch = ""
        self.measurer = Measurer(self)
        self.refs_lock = threading.RLock()
        self.pauses = Pauses()
        self.islands = Islands(self)
        self.requeue = Requeue(self)
        self.noise: NoiseEstimate | None = None  # made by open(), with the store
        self.stops: EarlyStops | None = None  # the night's early-stop calibration, made by open()
        self._serial = None  # the controller's own slot (autoloop.measure.executors.serial)
        self._bound = None  # a slot the serial loop measures on instead (bind_slot)
        self._lock: RunLock | None = None
        # `--notify CMD` (autoloop/loop/notify.py): events go to a background thread, never waited on.
        self.notifier = notifier_for(config, on_failure=self._notify_failed)

    # ------------------------------------------------------------------ paths and setup

    @property
    def tag(self) -> str:
        return self.config.tag

    @property
    def state_dir(self) -> Path:
        return self.project_dir / STATE_DIR

    def trial_dir(self, number: int) -> Path:
        return self.state_dir / self.tag / "trials" / str(number)

    def db_path(self) -> Path:
        path = Path(self.config.db)
        return path if path.is_absolute() else self.project_dir / path

    def git_dir(self) -> Path:
        return Path(self.repo.repo.git_dir)

    def data_dir(self) -> Path:
        return environment.data_dir(self.config)

    def train_script(self) -> Path | None:
        for arg in self.config.train_argv()[1:]:
            if arg.endswith(".py"):
                return self.project_dir / arg
        return None

    def sources_of(self, commit: str) -> tuple[str, dict[str, str]]:
        """(the train script relative to the project, {path: text} of it and the other
        editable files of `commit` named by a literal path): what the evaluator imports,
        never the working tree. An editable file the commit lacks is skipped."""
        script = self.train_script()
        if script is None:
            raise AutoloopError(
                f"the train command {self.config.train_command!r} names no .py file, so the harness cannot rebuild "
                "the model: use a command like 'python train.py', or run with --no-verify"
            )
        relative = script.resolve().relative_to(self.project_dir).as_posix()
        files = {}
        for path in [relative] + [p for p in self.config.editable if p != relative and not any(c in p for c in "*?[")]:
            try:
                files[path] = self.repo.show_file(commit, path)
            except AutoloopError:
                if path == relative:
                    raise
        return relative, files

    def say(self, message: str, style: str | None = None) -> None:
        if self.display is not None:
            self.display.say(message, style)

    def event(self, kind: str, message: str, trial_id: int | None = None) -> None:
        self.store.add_event(self.run_row["id"], kind, message, trial_id=trial_id)
        self.notifier.event(kind, message)  # a pause is news for --notify

    def _notify_failed(self, message: str) -> None:
        """Called once, from the notifier's thread, when the notify command first fails."""
        self.say(message, "yellow")
        if self.store is not None and self.run_row is not None:
            self.store.add_event(self.run_row["id"], "notify_failed", message)

    def _notify_end(self, summary: RunSummary) -> None:
        """The `end` notification (an error on its way out included), then a bounded drain."""
        self.notifier.run_ended(summary, error=sys.exc_info()[1])
        problems = self.notifier.close()
        if problems:
            self.say(problems, "yellow")

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

    # ------------------------------------------------------------------ open and close

    def open(self) -> None:
        script = self.train_script()
        if script is not None and not script.exists():
            raise AutoloopError(
                f"training script {script} does not exist: create it or set train-command in [tool.autoloop]"
            )
        if script is not None and not script.resolve().is_relative_to(self.project_dir):
            raise AutoloopError(
                f"the training script {script} is outside the project folder {self.project_dir}: run autoloop in the "
                "folder that holds it (edits, training and .autoloop/ all refer to that folder)"
            )
        from autoloop.base.redact import register_project

        self.repo = GitRepo.open(self.project_dir)
        register_project(self.project_dir)  # its .env values are never stored, logged, shown or sent
        self.repo.head()  # a repository with no commits is refused before anything is written into it
        self._refuse_an_empty_new_run()
        self.state_dir.mkdir(exist_ok=True)
        self.store = Store(self.db_path())
        self._lock = RunLock.for_folder(self.project_dir).acquire(self.tag, self.project_dir)  # one loop per working tree
        try:
            recovery.reap_helpers(self)
            self._exclude_runtime_files()
            env = environment.collect(self.config)
            existing = self.store.get_run(self.tag)
            if existing is None:
                branch, base, _ = self.repo.ensure_branch(self.tag)
                self.run_row = self.store.create_run(
                    self.tag,
                    branch=branch,
                    repo=str(self.project_dir),
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
                self.store.bind_waiting_ideas(self.run_row)  # ideas seeded with --tag before the run existed
            else:
                self.run_row = existing
                self.branch = existing["branch"]
                environment.check_comparability(self, env)
                recovery.recover(self)
                self.repo.ensure_branch(self.tag)
                self.store.update_run(existing["id"], status=RunStatus.ACTIVE, stop_requested=0, pause_reason=None,
                                      config=_config_dict(self.config))
            self.run_row = self.store.get_run(self.tag)
            self.noise = NoiseEstimate(self.store, self.run_row["id"])
            self.stops = EarlyStops(self.store, self.run_row["id"], self.config)
            environment.record_rules(self, existing)
        except BaseException:
            self.close()
            raise

    def _refuse_an_empty_new_run(self) -> None:
        """`--max-trials 0` only recovers a run a dead controller left: on a new tag it would
        make an empty run that `best`, `report` and `log` then pick by default."""
        if self.config.max_trials != 0:
            return
        db = self.db_path()
        if db.exists():
            with Store(db) as store:
                if store.get_run(self.tag) is not None:
                    return
        raise AutoloopError(
            f"--max-trials 0 only recovers an existing run, and there is no run '{self.tag}' yet: "
            f"give --max-trials 1 or more (or leave it out) to start it"
        )

    def close(self) -> None:
        lock = self._lock
        if lock is not None and lock.held and self.store is not None and self.run_row is not None:
            try:  # an agent still preparing a proposal when the run stops must not outlive it
                recovery.reap_helpers(self)
            except Exception as exc:  # never mask the error that is closing the run
                self.say(f"could not end helper processes ({exc}): the next start does it", "yellow")
        if lock is not None:
            lock.release()
        if self.store is not None:
            self.store.close()

    def best_commit(self) -> str:
        run = self.store.get_run(self.tag)
        return run["best_commit"] or run["base_commit"]

    # ------------------------------------------------------------------ the loop

    def chain(self):
        if self._chain is None:
            self._chain = build_chain(self.config)
        return self._chain

    @property
    def parallel(self) -> bool:
        """Trials run on the executor's workers, one thread each (not the serial inline slot)."""
        return self.executor is not None

    def concurrent_trials(self) -> bool:
        """Whether several trials may train at once (more than one worker): then what one
        trial's training did to a shared file (the db, unsandboxed) cannot be pinned on it."""
        return self.executor is not None and len(self.executor.slots) > 1

    def run(self) -> RunSummary:
        """Run trials until a stop condition; always leaves git on the best commit."""
        self.chain()  # a misconfigured proposer (no model, agent not installed) fails now, before the baseline
        self.chain().check_reachable(self.say)  # so does a model server that is down (one request, nothing written)
        summary = RunSummary(tag=self.tag)
        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                previous[sig] = signal.signal(sig, self.on_signal)
            except ValueError:  # not the main thread (e.g. some test runners)
                pass
        try:
            self.open()
        except BaseException:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            raise
        try:
            preflight.check_before_the_night(self)
            if self.verifier is not None and self.measurer.sandbox.kind == "bwrap":
                self.say(f"sandbox: {self.measurer.describe_sandbox()}")  # what a trial can see, once a night
            self.scheduler = Scheduler(self)
            started = time.time()
            slots = [self.serial_slot()]
            if self.config.executor != "serial":
                from autoloop.measure.executors import make_executor

                self.executor = make_executor(self)
                slots = self.executor.slots
                self.say(f"{self.config.executor} executor: {len(slots)} workers "
                         f"({', '.join(f'{s.name} on {s.device}' for s in slots)}), "
                         f"{self.config.search_mode} search")
            Loop(self, slots, threaded=self.parallel).run(summary, started)
            if reserve.at_the_end(self, summary):  # the headline's runs at fresh seeds (loop.reserve)
                reserve.measure(self, slot=slots[0])
            if not summary.paused:
                # (`autoloop stop` during the reserve counts too: the user asked the night to end)
                user_stop = summary.stopped or self.abort_requested or self.store.stop_requested(self.run_row["id"])
                final = RunStatus.STOPPED if user_stop else RunStatus.FINISHED
                summary.stopped = final is RunStatus.STOPPED
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
                    disk.converge_git_at_exit(self)
            finally:
                self._fill_summary(summary)
                self._notify_end(summary)
                self.close()
        return summary

    def on_signal(self, signum, frame) -> None:
        """Ctrl-C or SIGTERM: the trials in flight are killed and the run stops; a second
        one raises KeyboardInterrupt (stop waiting politely)."""
        if self.abort_requested:
            raise KeyboardInterrupt
        self.abort_requested = True
        self.say("stopping: killing the current trial and resetting to the best commit (Ctrl-C again to force)", "yellow")

    def _fill_summary(self, summary: RunSummary) -> None:
        run_id = self.run_row["id"] if self.run_row else None
        if run_id is None:
            return
        trials = self.store.trials(run_id)
        for t in trials:
            summary.statuses[t["status"]] = summary.statuses.get(t["status"], 0) + 1
        summary.counts = status_counts(trials)
        best = self.store.best_trial(run_id)
        summary.best_metric = best["metric"] if best else None
        summary.best_commit = self.best_commit()
        baseline = [t for t in trials if t["kind"] == Kind.BASELINE.value and t["metric"] is not None]
        summary.baseline_metric = baseline[0]["metric"] if baseline else None
        summary.kept = summary.statuses.get(Status.KEEP.value, 0)
        summary.headline = reserve.headline_of(self.store, self.run_row)

    # ------------------------------------------------------------------ git in the project folder

    def checkout(self, sha: str) -> None:
        """Move the run's branch to `sha` and make the worktree match, keeping the human's
        uncommitted edits to files proposals cannot change (e.g. program.md, to steer a
        running loop). Such files are identical in every trial commit, so keeping the
        local version is exact; a copy goes to .autoloop/ first so a crash cannot lose it."""
        with self.refs_lock:
            saved = {}
            for path in self.repo.dirty_files():
                if matches(path, self.config.editable) or not (self.project_dir / path).is_file():
                    continue
                saved[path] = (self.project_dir / path).read_bytes()
            if saved:
                backup = self.state_dir / self.tag / "local-edits"
                for path, data in saved.items():
                    (backup / path).parent.mkdir(parents=True, exist_ok=True)
                    (backup / path).write_bytes(data)
            self.repo.checkout_commit(self.branch, sha)
            for path, data in saved.items():
                (self.project_dir / path).write_bytes(data)

    def checkout_for_measurement(self, commit: str) -> None:
        """The project folder at `commit` for a run of the serial slot (a no-op when it is)."""
        with self.refs_lock:
            dirty = any(matches(path, self.config.editable) for path in self.repo.dirty_files())
            if self.repo.branch_commit(self.branch) != commit or dirty:
                self.checkout(commit)

    def converge_git(self) -> None:
        """The run's branch and the project folder at the best commit."""
        self.checkout_for_measurement(self.best_commit())

    # ------------------------------------------------------------------ one work item

    def serial_slot(self):
        """The slot the serial loop measures on: the controller's own (training in the
        project folder), or the one `bind_slot` gave it."""
        if self._bound is not None:
            return self._bound
        if self._serial is None:
            from autoloop.measure.executors.serial import SerialSlot

            self._serial = SerialSlot(self)
        return self._serial

    def bind_slot(self, slot) -> None:
        """Measure the serial loop's trials on `slot` (None: the controller's own slot again)."""
        self._bound = slot

    def context(self, slot, item: WorkItem | None = None, lineage: str | None = None) -> trial.TrialContext:
        """The context a work item's trial runs in on `slot`: a resumed trial keeps its own
        lineage (islands), and the incumbent's own measurements (the baseline, re-runs, drift
        checks) belong to no lineage."""
        if item is not None and item.kind is Work.RESUME and self.config.search_mode == "islands":
            row = self.store.trial_by_id(item.derived_from)
            lineage = row.get("lineage") if row and row.get("lineage") not in (None, "main") else lineage
        if item is not None and item.trial_kind in OF_THE_INCUMBENT:
            lineage = None  # the run's own incumbent, shared by every lineage
        worker = None if slot is self._serial else slot.name
        return trial.TrialContext(slot=slot, lineage=lineage, worker=worker)

    def execute(self, item: WorkItem, ctx: trial.TrialContext | None = None) -> dict:
        """Run one work item's trial on `ctx` (default: the serial slot) and return its row."""
        ctx = ctx or self.context(self.serial_slot(), item)
        before = self.store.trials(self.run_row["id"], last=1)
        try:
            if item.kind is Work.RESUME:
                row = self.store.trial_by_id(item.derived_from)
                self.say(f"trial {row['number']} resumes: {row.get('description') or row['kind']}", "yellow")
                row = trial.train_and_decide(self, ctx, row)
            elif item.kind in (Work.PROPOSAL, Work.REPAIR):
                row = trial.execute_proposal(self, ctx, item.proposal, item.parent, derived_from=item.derived_from,
                                             kind=item.trial_kind)
            else:
                row = trial.execute_rerun(self, ctx, item.trial_kind, item.reason, derived_from=item.derived_from)
        except Exception as exc:  # a full disk, wherever it surfaced in the trial's handling
            if not is_disk_full(exc):
                raise
            latest = self.store.trials(self.run_row["id"], last=1)
            ours = bool(latest) and (not before or latest[0]["id"] != before[0]["id"])  # this item's trial
            return disk.pause_for_full_disk(
                self, disk_full_what(exc), latest[0] if ours and disk.failed_for_full_disk(latest[0]) else None)
        line = disk.failed_for_full_disk(row)
        if line is not None:  # training itself ran out of space (e.g. saving its checkpoint)
            return disk.pause_for_full_disk(self, f"trial {row['number']}: {line}", row)
        return row

    # ------------------------------------------------------------------ services for trials and the review

    def proposal_context(self, parent: str, repo: GitRepo | None = None, lineage: str | None = None) -> ProposalContext:
        """What a proposer sees for a proposal on `parent` (the best metric: `lineage`'s
        incumbent, default the run's). `repo`: a GitRepo of the same repository for use
        from another thread (prefetch)."""
        best = self.islands.incumbent(lineage)
        repo = repo or self.repo
        read_parent_file = repo.file_reader(parent)
        return ProposalContext(
            config=self.config, store=self.store, run=self.run_row, repo=repo, parent_commit=parent,
            read_parent_file=read_parent_file, best_metric=best["metric"] if best else None,
        )

    def measure_commit(self, commit: str, seed: int, *, owner: dict, role: str, for_trial: dict | None = None,
                       verify: bool = False, ctx: trial.TrialContext | None = None,
                       early_stop: dict | None = None) -> Measurement:
        """One training run of `commit` at `seed` on `ctx`'s slot (default: the serial slot),
        evaluated by the harness and recorded as a measurement of `owner` (for `autoloop
        ablate` and the decision loop). `early_stop`: the job's early-stop rule (loop.stops)."""
        if ctx is None:  # `autoloop ablate`: the serial slot, compared with the run's incumbent
            ctx = dataclasses.replace(self.context(self.serial_slot()), incumbent=self.islands.incumbent(None))
        best = ctx.incumbent["metric"] if ctx.incumbent else None
        m = self.measurer.measure(commit, seed, owner=owner, role=role, running=for_trial or owner, slot=ctx.slot,
                                  best_metric=best, verify=verify, early_stop=early_stop)
        if m.ok and for_trial is None and owner.get("status") == Status.RUNNING.value:
            self.store.update_trial(owner["id"], metric_source=m.metric_source)
        return m

    def training_started(self, running: dict) -> None:
        """A measurement's training began: the scheduler prepares the next proposal meanwhile."""
        if self.scheduler is not None:
            self.scheduler.prefetch(running)

    def worker_pause(self, reason: str) -> None:
        """A worker found the harness or the data changed under its run: the run pauses
        before the next work item (unless the verifier's own check pauses it first)."""
        self.pauses.from_worker(reason)

    def seeds(self, n: int) -> list[int]:
        """The run's seed sequence: every trial's k-th run uses the k-th seed, so candidate
        and incumbent are compared on the same data order and init stream."""
        return [self.config.seed + k for k in range(n)]

    def decision_config(self) -> DecisionConfig:
        cfg = self.config
        alpha = cfg.alpha if cfg.alpha is not None else default_alpha(cfg.decision_rule)
        return DecisionConfig(rule=cfg.decision_rule, baseline_seeds=cfg.baseline_seeds, max_runs=cfg.max_runs,
                              alpha=alpha, futility=cfg.futility, margin=cfg.keep_margin,
                              reserve_seeds=cfg.reserve_seeds)

    def incumbent_runs(self, incumbent: dict, device: str | None = None) -> dict[int, float]:
        """The incumbent's runs a candidate is paired with: in time mode a faster GPU buys
        more steps, so with several kinds of device only those on the candidate's kind."""
        return runs_of(self.store, incumbent, INCUMBENT_ROLES, device)

    def update_noise(self):
        """Pool the run's repeated measurements into its noise now (autoloop.loop.noise)."""
        return self.noise.update()


def _config_dict(config: Config) -> dict:
    from dataclasses import asdict

    stored = asdict(config)
    stored["notify"] = None  # the user's notify command may hold a webhook's secret: never in the db
    return stored
