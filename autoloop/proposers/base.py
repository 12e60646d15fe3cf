"""The proposer interface, the context a proposer sees, and the chain of proposers."""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Callable, Protocol

from autoloop.config import Config
from autoloop.errors import AutoloopError
from autoloop.proposers.proposal import Proposal


class ProposerUnavailable(Exception):
    """The proposer cannot propose right now (API down, tool missing); try the next one.
    `quiet`: a skip, not a failure (still cooling down after one), so no event is written."""

    def __init__(self, message: str, *, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet


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

    def history(self, last: int | None = None) -> list[dict]:
        """The run's trials at the night's scale (the `last` of them, oldest first): a ladder
        trial's val_bpb is of a larger model or budget (autoloop.review.ladder), and its
        train.py no idea the night tried, so no proposer reads one as evidence."""
        from autoloop.store import Kind

        return [t for t in self.store.trials(self.run["id"], last=last) if t["kind"] != Kind.LADDER.value]


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

    def check_reachable(self, say=None) -> None:
        """Before the night: each proposer that talks to a server (the llm) tries it once,
        raising AutoloopError in one line if it cannot be reached (autoloop.proposers.llm)."""
        for proposer in self.proposers:
            check = getattr(proposer, "check_reachable", None)
            if check is not None:
                line = check()
                if line and say is not None:
                    say(line)

    def propose(self, ctx: ProposalContext) -> Proposal | None:
        for proposer in self.proposers:
            try:
                proposal = proposer.propose(ctx)
            except ProposerUnavailable as exc:
                if not exc.quiet:
                    ctx.store.add_event(ctx.run["id"], "proposer_unavailable", f"{proposer.name}: {exc}")
                continue
            if proposal is not None:
                proposal.source = proposal.source if proposal.source != "unknown" else proposer.name
                return proposal
        return None


# name -> "module:factory"; a factory takes the Config and returns a Proposer.
REGISTRY: dict[str, str] = {
    "ideas": "autoloop.proposers.seeded:IdeasProposer",
    "search": "autoloop.proposers.search:SearchProposer",
    "llm": "autoloop.proposers.llm:LLMProposer",
    "agent": "autoloop.proposers.agent:AgentProposer",
}

# "auto" in the chain: the LLM and/or agent when configured (llm_model, agent_command),
# then search as the fallback for when they are unavailable, or alone when neither is.
AUTO = "auto"


def resolve_names(config: Config) -> list[str]:
    """The chain's proposer names with `auto` expanded; each name once, first place wins."""
    names: list[str] = []
    for name in config.proposers:
        if name == AUTO:
            expanded = [n for n, on in (("llm", config.llm_model), ("agent", config.agent_command)) if on]
            expanded += ["search"] if "search" in REGISTRY else []
        else:
            expanded = [name]
        names.extend(n for n in expanded if n not in names)
    return names


def build_chain(config: Config) -> ProposerChain:
    proposers = []
    for name in resolve_names(config):
        target = REGISTRY.get(name)
        if target is None:
            raise AutoloopError(f"unknown proposer {name!r}: choose from {', '.join([*REGISTRY, AUTO])}")
        module, _, attr = target.partition(":")
        proposers.append(getattr(importlib.import_module(module), attr)(config))
    return ProposerChain(proposers)


def check_models(config: Config, say: Callable[[str], None]) -> None:
    """`autoloop check --parts model`: the configured model and agent tried as `autoloop run`
    tries them before the baseline; AutoloopError in one line when one cannot be reached."""
    names = [n for n in resolve_names(config) if n in ("llm", "agent")]
    if not names:
        raise AutoloopError("no model or agent is configured: set llm-model (AUTOLOOP_LLM_MODEL, with llm-base-url "
                            "for a local server) or agent-command (AUTOLOOP_AGENT_COMMAND)")
    chain = build_chain(dataclasses.replace(config, proposers=names))  # an agent command not found fails here
    chain.check_reachable(say)
    if "agent" in names:
        say(f"agent: the command {config.agent_command!r} is installed")
