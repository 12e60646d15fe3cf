"""Proposers: where the next edit to train.py comes from.

Each proposer implements `propose(ctx) -> Proposal | None` (None: nothing to offer now).
The controller asks a chain of them in order and takes the first proposal; a proposer
that fails with `ProposerUnavailable` is skipped for that turn, so a flaky API does not
end the night.
"""

from autoloop.proposers.base import ProposalContext, Proposer, ProposerChain, ProposerUnavailable, build_chain

__all__ = ["ProposalContext", "Proposer", "ProposerChain", "ProposerUnavailable", "build_chain"]
