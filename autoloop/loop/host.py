"""What a trial's code is given: the run it works for, as one typed interface.

The functions of a trial (loop/trial.py, loop/compare.py), its decision (loop/noise.py), the reserve, the
recovery, the pre-run check and the disk and environment guards take a `TrialHost`, which
`autoloop.loop.controller.Controller` implements, so an editor (and a reader) can follow
every `c.` to its type and its one-line meaning. tests/test_layout.py checks that every
loop function's `c` is annotated with it and that the Controller has every member.

Attributes are read when used, not copied: the run row, the display and the abort flag
change while a run goes on. Members set by `open()` are None before it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from autoloop.measure.measurer import MeasureHost

if TYPE_CHECKING:
    from autoloop.decide.rule import DecisionConfig
    from autoloop.gitops import GitRepo
    from autoloop.loop.islands import Islands, Requeue
    from autoloop.loop.noise import NoiseEstimate
    from autoloop.loop.run import Pauses
    from autoloop.loop.scheduler import Scheduler, WorkItem
    from autoloop.loop.stops import EarlyStops
    from autoloop.loop.trial import TrialContext
    from autoloop.measure.measurer import Measurement, Measurer
    from autoloop.proposers import ProposalContext


class TrialHost(MeasureHost, Protocol):
    """MeasureHost's members (the run's settings, records, folders, console and git), and:"""

    branch: str  # autoloop/<tag>
    scheduler: Scheduler | None  # which work item comes next; prepares proposals while trials train
    executor: Any  # the local or Ray executor's slots; None: the serial slot
    measurer: Measurer  # one measurement's controller half
    noise: NoiseEstimate | None  # the run's pooled noise (open() makes it)
    stops: EarlyStops | None  # the night's early-stop calibration (open() makes it)
    islands: Islands  # lineages and migration (islands mode)
    requeue: Requeue  # edits to re-base onto a newer best
    pauses: Pauses  # a pause a trial asked for (a full disk, a drift)
    refs_lock: threading.RLock  # held around every move of git refs and the decision that moves them
    ladder_hook: Any  # `--ladder-every K`: called with the host after every K-th keep (serial runs); None: never

    @property
    def parallel(self) -> bool: ...  # trials run on the executor's workers, a thread each
    def train_script(self) -> Path | None: ...  # train.py of the project, when the command names one
    def checkout(self, sha: str) -> None: ...  # the project folder on `sha`, the branch with it
    def converge_git(self) -> None: ...  # git back in line with the db's decisions

    # ---- trials, measurements and decisions
    def chain(self) -> Any: ...  # the proposer chain (proposers.build_chain)
    def serial_slot(self) -> Any: ...  # the slot the serial loop measures on
    def context(self, slot: Any, item: WorkItem | None = None, lineage: str | None = None) -> TrialContext: ...
    def execute(self, item: WorkItem, ctx: TrialContext | None = None) -> dict: ...  # one work item, its row
    def proposal_context(self, parent: str, repo: GitRepo | None = None,
                         lineage: str | None = None) -> ProposalContext: ...  # what a proposer sees
    def measure_commit(self, commit: str, seed: int, *, owner: dict, role: str, for_trial: dict | None = None,
                       verify: bool = False, ctx: TrialContext | None = None,
                       early_stop: dict | None = None) -> Measurement: ...  # one run of one commit at one seed
    def seeds(self, n: int) -> list[int]: ...  # the run's seed sequence
    def decision_config(self) -> DecisionConfig: ...  # the rule's settings
    def incumbent_runs(self, incumbent: dict, device: str | None = None) -> dict[int, float]: ...  # seed -> bpb
    def update_noise(self) -> Any: ...  # pool the run's repeated measurements now
