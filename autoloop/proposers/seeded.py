"""The human's idea queue: `autoloop seed "..." --set NAME=VALUE` or `--patch FILE`.

Ideas live in the db, so ideas seeded while a run is going are picked up at the next
proposal. This proposer takes ideas that carry an edit (constants or a patch), highest
priority first, then oldest; text-only ideas wait for an LLM or agent proposer.
"""

from __future__ import annotations

from autoloop.config import Config
from autoloop.proposers.proposal import Edit, Proposal
from autoloop.errors import AutoloopError
from autoloop.pyconst import Expression, parse_value


class IdeasProposer:
    name = "ideas"

    def __init__(self, config: Config):
        self.config = config

    def propose(self, ctx) -> Proposal | None:
        idea = ctx.store.next_idea(ctx.run["id"], actionable_only=True)
        if idea is None:
            return None
        return idea_proposal(idea, self.config)


def idea_proposal(idea: dict, config: Config) -> Proposal:
    """The proposal an idea row becomes; `autoloop seed` checks this same proposal."""
    edits = []
    if idea.get("sets"):
        # Values are stored as the text the human typed ("2**18", "0.02", "'adamw'").
        values = {name: _value(str(text)) for name, text in idea["sets"].items()}
        edits.append(Edit(path=config.editable[0], sets=values))
    return Proposal(
        description=idea["text"],
        edits=edits,
        patch=idea.get("patch") or None,
        source="human",
        idea_id=idea.get("id"),
    )


def _value(text: str):
    try:
        return parse_value(text)
    except AutoloopError:
        # Written as typed: validation then rejects the edit as a syntax error, so the
        # idea ends as an invalid trial instead of stopping the run.
        return Expression(text)
