"""The proposer interface, the context a proposer sees, and the chain of proposers."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Protocol

from autoloop.config import Config
from autoloop.errors import AutoloopError
from autoloop.proposals import Proposal


class ProposerUnavailable(Exception):
    """The proposer cannot propose right now (API down, tool missing); try the next one."""


@dataclass
class ProposalContext:
    config: Config
    store: object  # autoloop.store.Store
    run: dict  # the runs row
    repo: object  # autoloop.gitops.GitRepo
    parent_commit: str
    read_parent_file: Callable[[str], str | None]
    best_metric: float | None = None
    extra: dict = field(default_factory=dict)

    def history(self) -> list[dict]:
        return self.store.trials(self.run["id"])


class Proposer(Protocol):
    name: str

    def propose(self, ctx: ProposalContext) -> Proposal | None: ...


class ProposerChain:
    """Asks proposers in order; the first proposal wins. Records skips as events."""

    def __init__(self, proposers: list[Proposer]):
        self.proposers = proposers

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.proposers]

    def propose(self, ctx: ProposalContext) -> Proposal | None:
        for proposer in self.proposers:
            try:
                proposal = proposer.propose(ctx)
            except ProposerUnavailable as exc:
                ctx.store.add_event(ctx.run["id"], "proposer_unavailable", f"{proposer.name}: {exc}")
                continue
            if proposal is not None:
                proposal.source = proposal.source if proposal.source != "unknown" else proposer.name
                return proposal
        return None


# name -> "module:factory"; a factory takes the Config and returns a Proposer.
REGISTRY: dict[str, str] = {
    "ideas": "autoloop.proposers.ideas:IdeasProposer",
}


def build_chain(config: Config) -> ProposerChain:
    proposers = []
    for name in config.proposers:
        target = REGISTRY.get(name)
        if target is None:
            raise AutoloopError(f"unknown proposer {name!r}: choose from {', '.join(REGISTRY)}")
        module, _, attr = target.partition(":")
        proposers.append(getattr(importlib.import_module(module), attr)(config))
    return ProposerChain(proposers)
