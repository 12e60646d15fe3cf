"""The `llm` proposer: code edits from any OpenAI-compatible chat API.

OpenAI, vLLM, Ollama, OpenRouter and the like all serve `/v1/chat/completions`; the
`openai` SDK (optional extra `llm`) talks to each given a base URL, a model
name and a key. The base URL comes from `llm_base_url`, else `$OPENAI_BASE_URL`; the key
from the environment variable named by `llm_api_key_env` (`OPENAI_API_KEY`). A local
server needs no key. The key is never written anywhere: it is not a config field (so it
cannot reach `runs.config`), error texts are scrubbed of it before they are stored, and
the runner strips `*KEY*` variables from the training subprocess's environment.

One proposal:

1. Take the next waiting idea, text-only ones included (linked to the trial).
2. Ask the model with program.md as the system message and the brief (`brief.py`) plus
   the answer format as the user message.
3. Parse the answer (`answer.py`) and check it as the controller will (`materialize` +
   `validate`) and against every diff already tried. A rejected answer goes back to the
   model with the reason, up to `llm_max_repairs` times; after that the proposal is
   handed to the controller marked invalid (`meta["invalid"]`), which records an
   `invalid` trial and commits nothing.
4. A request that fails or times out is retried by the SDK (`llm_retries`, with its
   exponential back-off); then the proposer raises `ProposerUnavailable` so the chain
   falls through, gives the idea back, and is left alone for `llm_retry_wait` seconds,
   doubling up to `llm_retry_max_wait` (autoloop.proposers.outage), so a dead server does
   not cost every later proposal the full retry cycle. `outage` says so to the scheduler
   (the console line, the wait of a model-only night, the stop reason); the first answer
   after failures is a `proposer_back` event.

Before the night (`check_reachable`) one cheap request, the models listing, with a short
timeout: a server that is down, refuses the key or answers an error stops the run in one
line before the baseline, instead of a night that silently falls back or ends.

Accounting: each call's tokens, latency and cost travel in `meta["calls"]` and are
written to the `proposals` table by the controller with the trial's id; failed calls are
written at once without one. Cost is tokens x `llm_prices[model]` ($ per 1M input and
output tokens), null where the model has no price. With `max_cost` set the proposer
refuses to start without a price and stops calling once the run's total reaches it.

Repairs: `repair(ctx, trial)` asks once more for a trial it proposed that crashed with a
plain error, showing the traceback and the crashed files; the result is a whole-file
proposal against the same parent, run as a `repair` trial linked to the crashed one.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from autoloop.config import Config
from autoloop.errors import AutoloopError
from autoloop.proposers.proposal import Edit, InvalidProposal, Proposal, materialize, validate
from autoloop.proposers import brief, memory
from autoloop.proposers.answer import parse_answer, resolve_searches
from autoloop.proposers.base import ProposerUnavailable
from autoloop.proposers.outage import Availability, Outage

# The check before the night: long enough for a loaded local server to list its models,
# short enough that a wrong URL is said at once.
REACH_TIMEOUT_SECONDS = 10.0
# A server that answers these for the listing is up but does not list models: fine.
_NO_LISTING = (404, 405, 501)

ANSWER_FORMAT = """\
# Your answer
Propose ONE change to try next. Answer with a line

DESCRIPTION: <one line: what you change and why>

then one or more edit blocks, each after the line naming its file:

FILE: {path}
<<<<<<< SEARCH
<lines copied exactly from the current file, enough to match one place>
=======
<the lines that replace them>
>>>>>>> REPLACE

Editable files: {editable}. Everything else is read-only and an edit to it is rejected.
The SEARCH text must match the file exactly, in one place. Several blocks apply in order.
"""


def _price_table(config: Config) -> dict[str, tuple[float, float]]:
    """{model: ($ per 1M input tokens, $ per 1M output tokens)} from `llm_prices`."""
    table = {}
    for model, price in (config.llm_prices or {}).items():
        if isinstance(price, dict) and {"input", "output"} <= set(price):
            pair = (price["input"], price["output"])
        elif isinstance(price, (list, tuple)) and len(price) == 2:
            pair = tuple(price)
        else:
            pair = None
        try:
            table[model] = (float(pair[0]), float(pair[1]))  # type: ignore[index]
        except (TypeError, ValueError):
            raise AutoloopError(
                f"llm_prices[{model!r}] = {price!r} is not a price: write [input, output] in $ per 1M tokens, "
                f"e.g. llm-prices = {{ \"{model}\" = [2.0, 8.0] }}"
            ) from None
    return table


class LLMProposer:
    name = "llm"
    slow = True  # worth preparing while the current trial trains (see autoloop.loop.prefetch)

    def __init__(self, config: Config):
        self.config = config
        if not config.llm_model:
            raise AutoloopError(
                "the llm proposer needs a model: set llm-model in [tool.autoloop] or AUTOLOOP_LLM_MODEL "
                "(e.g. gpt-4.1, or the name your vLLM/Ollama server serves)"
            )
        try:
            import openai  # noqa: F401
        except ImportError:
            raise AutoloopError("the llm proposer needs the openai package: pip install -e '.[llm]'") from None
        self.model = config.llm_model
        self.base_url = config.llm_base_url or os.environ.get("OPENAI_BASE_URL") or None
        self._key = os.environ.get(config.llm_api_key_env) or None
        if self._key is None and self.base_url is None:
            raise AutoloopError(
                f"the llm proposer has no API key: export {config.llm_api_key_env}=..., or point llm-base-url "
                "at a local OpenAI-compatible server (vLLM, Ollama) that needs none"
            )
        self.prices = _price_table(config)
        if config.max_cost is not None and self.model not in self.prices:
            raise AutoloopError(
                f"max-cost is set but llm-prices has no price for model {self.model!r}, so spending cannot be "
                f"counted: add llm-prices = {{ \"{self.model}\" = [input, output] }} in $ per 1M tokens"
            )
        self._client = None
        self._lock = threading.Lock()  # the prefetch thread and a repair may call at once
        self._spent: dict[int, float] = {}  # run id -> $ spent (known costs only)
        self.availability = Availability(config.llm_retry_wait, config.llm_retry_max_wait)
        self._exhausted: str | None = None  # max-cost reached: not again in this run
        self._exhausted_at = 0.0
        self._warned_program = False

    # ------------------------------------------------------------------ the API

    def client(self):
        if self._client is None:
            import openai

            self._client = openai.OpenAI(
                api_key=self._key or "unused",  # local servers ignore it; the SDK insists on one
                base_url=self.base_url, timeout=self.config.llm_timeout, max_retries=self.config.llm_retries,
            )
        return self._client

    def _redact(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text

    def cost(self, prompt_tokens: int | None, completion_tokens: int | None) -> float | None:
        price = self.prices.get(self.model)
        if price is None or prompt_tokens is None or completion_tokens is None:
            return None
        return (prompt_tokens * price[0] + completion_tokens * price[1]) / 1e6

    def _spent_so_far(self, ctx) -> float:
        run_id = ctx.run["id"]
        with self._lock:
            if run_id not in self._spent:
                # Earlier invocations of this run count too; later calls are added as made.
                # (A transaction holds the Store's lock: the prefetch thread shares it.)
                with ctx.store.transaction():
                    row = ctx.store.db.execute(
                        "SELECT COALESCE(SUM(cost_usd), 0) FROM proposals WHERE run_id = ?", [run_id]
                    ).fetchone()
                self._spent[run_id] = float(row[0] or 0.0)
            return self._spent[run_id]

    @property
    def where(self) -> str:
        return f"the model {self.model} at {self.base_url or 'the OpenAI API'}"

    @property
    def outage(self) -> Outage | None:
        """Why this proposer cannot propose now (None: it can)."""
        with self._lock:
            if self._exhausted is not None:
                return Outage(self.name, self.where, self._exhausted_at, self._exhausted, self.availability.failures, None)
        return self.availability.outage(self.name, self.where)

    def check_reachable(self) -> str:
        """One cheap request (the models listing): the line to say when the server answers;
        AutoloopError in one line (the URL, the error, the fix) when it does not."""
        import openai

        client = openai.OpenAI(api_key=self._key or "unused", base_url=self.base_url,
                               timeout=min(self.config.llm_timeout, REACH_TIMEOUT_SECONDS), max_retries=1)
        try:
            served = [m.id for m in client.models.list()]
        except openai.APIStatusError as exc:
            if exc.status_code in _NO_LISTING:
                return f"llm: {self.where} answers (it lists no models)"
            raise self._unreachable(exc) from None
        except openai.OpenAIError as exc:
            raise self._unreachable(exc) from None
        if served and self.model not in served:
            shown = ", ".join(served[:8]) + (", ..." if len(served) > 8 else "")
            return (f"llm: warning: {self.where} answers but does not list {self.model!r} (it lists {shown}): "
                    "if its requests fail, set llm-model to one of these")
        return f"llm: {self.where} answers"

    def _unreachable(self, exc: Exception) -> AutoloopError:
        import openai

        error = self._redact(f"{type(exc).__name__}: {exc}")[:300]
        if isinstance(exc, (openai.AuthenticationError, openai.PermissionDeniedError)):
            fix = f"check the key in ${self.config.llm_api_key_env} (llm-api-key-env)"
        else:
            fix = "check that the server is up and that --llm-base-url (llm-base-url) points at it"
        return AutoloopError(f"{self.where} cannot be reached ({error}): {fix}, or drop llm from --proposers; "
                             "nothing was run")

    def _check_available(self, ctx) -> None:
        if self.availability.cooling():
            raise ProposerUnavailable(
                f"{self.model}: cooling down for {self.availability.cooling():.0f} s after failed requests",
                quiet=True,
            )
        if self.config.max_cost is not None:
            spent = self._spent_so_far(ctx)
            if spent >= self.config.max_cost:
                with self._lock:
                    self._exhausted_at = self._exhausted_at or time.time()
                    self._exhausted = f"spent ${spent:.2f} of max-cost ${self.config.max_cost:.2f}"
                raise ProposerUnavailable(f"{self.model}: {self._exhausted}")

    def call(self, ctx, messages: list[dict]) -> tuple[str, dict]:
        """One chat completion: (answer text, accounting for the proposals table)."""
        import openai

        self._check_available(ctx)
        started = time.monotonic()
        try:
            response = self.client().chat.completions.create(model=self.model, messages=messages)
        except openai.OpenAIError as exc:
            latency = time.monotonic() - started
            error = self._redact(f"{type(exc).__name__}: {exc}")[:500]
            pause = self.availability.failed(error)
            ctx.store.add_proposal_record(run_id=ctx.run["id"], proposer=self.name, model=self.model,
                                          latency_seconds=latency, error=error)
            where = self.base_url or "the OpenAI API"
            raise ProposerUnavailable(
                f"{self.model} at {where} failed after {self.config.llm_retries} retries ({error}); "
                f"skipping it for {pause:.0f} s"
            ) from None
        latency = time.monotonic() - started
        self.availability.answered(ctx.store, ctx.run["id"], self.name, self.where, noun="failed request")
        usage = getattr(response, "usage", None)
        prompt_tokens = getattr(usage, "prompt_tokens", None)
        completion_tokens = getattr(usage, "completion_tokens", None)
        cost = self.cost(prompt_tokens, completion_tokens)
        if cost is not None:
            self._spent_so_far(ctx)
            with self._lock:
                self._spent[ctx.run["id"]] += cost
        content = response.choices[0].message.content if response.choices else None
        return content or "", {
            "proposer": self.name, "model": self.model, "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens, "cost_usd": cost, "latency_seconds": latency,
        }

    # ------------------------------------------------------------------ proposing

    def _messages(self, ctx, user: str) -> tuple[list[dict], str | None]:
        program, program_hash = brief.read_program(ctx.repo.project_dir)
        if program is None:
            if not self._warned_program:
                self._warned_program = True
                ctx.store.add_event(ctx.run["id"], "program_missing",
                                    f"no program.md in {ctx.repo.project_dir}: the llm proposer uses a short built-in brief")
            program = brief.FALLBACK_PROGRAM
        answer_format = ANSWER_FORMAT.format(path=ctx.config.editable[0], editable=", ".join(ctx.config.editable))
        return [{"role": "system", "content": program}, {"role": "user", "content": user + "\n" + answer_format}], \
            program_hash

    def propose(self, ctx) -> Proposal:
        self._check_available(ctx)
        idea = brief.take_idea(ctx)
        try:
            messages, program_hash = self._messages(ctx, brief.render_context(ctx, idea=idea))
            proposal = self._converse(ctx, messages, check=lambda p: self._check(ctx, p))
        except BaseException:
            brief.give_back_idea(ctx, idea)
            raise
        proposal.idea_id = idea["id"] if idea else None
        proposal.meta["program_hash"] = program_hash
        return proposal

    def _check(self, ctx, proposal: Proposal) -> Proposal:
        """Validate as the controller will, and refuse what was already tried."""
        resolve_searches(proposal, ctx.read_parent_file)
        files = materialize(proposal, str(ctx.repo.project_dir), ctx.parent_commit, ctx.read_parent_file)
        changed = validate(files, ctx.read_parent_file, editable=ctx.config.editable, protected=ctx.config.protected)
        duplicate = brief.find_duplicate(brief.files_diff(changed, ctx.read_parent_file), ctx.history())
        if duplicate is not None:
            raise InvalidProposal(brief.duplicate_reason(duplicate) + ": propose something different")
        elsewhere = memory.refused_repeat(ctx, brief.files_diff(changed, ctx.read_parent_file))
        if elsewhere is not None:
            raise InvalidProposal(memory.elsewhere_reason(elsewhere))
        return proposal

    def _converse(self, ctx, messages: list[dict], check) -> Proposal:
        """Ask, check, and send a rejected answer back with its reason, a bounded number of times."""
        calls: list[dict] = []
        transcript: list[dict] = list(messages)
        reason = ""
        description = ""
        proposal = None
        try:
            for attempt in range(1 + max(0, self.config.llm_max_repairs)):
                try:
                    answer, call = self.call(ctx, messages)
                except ProposerUnavailable:
                    if not calls:
                        raise
                    # The server went away during repairs: what we have is an invalid answer.
                    reason = f"{reason} (and the model became unreachable while repairing)"
                    break
                calls.append(call)
                transcript.append({"role": "assistant", "content": answer})
                try:
                    proposal = parse_answer(answer, ctx.config.editable[0])
                    description = proposal.description
                    proposal = check(proposal)
                except InvalidProposal as exc:
                    reason = str(exc)
                    call["error"] = f"answer rejected: {reason}"[:500]
                    feedback = (
                        f"Your answer was rejected: {reason}\n"
                        "Answer again in the same format, with the complete change (all edit blocks, "
                        "against the files as shown above, not against your previous answer)."
                    )
                    messages = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": feedback}]
                    transcript.append({"role": "user", "content": feedback})
                    proposal = None
                    continue
                break
        finally:
            path = self._save_transcript(ctx, transcript)
        if proposal is None:
            repairs = len(calls) - 1
            proposal = Proposal(description=description or "LLM answer could not be used", edits=[], source=self.name)
            proposal.meta["invalid"] = f"{reason}" + (f" (after {repairs} repair{'s' * (repairs != 1)})" if repairs else "")
        proposal.source = self.name
        proposal.model = self.model
        proposal.meta["calls"] = calls
        if path is not None:
            proposal.meta["transcript"] = str(path)
        return proposal

    def _save_transcript(self, ctx, transcript: list[dict]) -> Path | None:
        """The conversation, for a human reading why a trial looks the way it does."""
        if len(transcript) <= 2:
            return None
        from autoloop.config import STATE_DIR

        folder = Path(ctx.repo.project_dir) / STATE_DIR / ctx.config.tag / "transcripts"
        folder.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{time.monotonic_ns() % 10**6:06d}"
        path = folder / f"{stamp}-llm.json"
        path.write_text(json.dumps({"model": self.model, "base_url": self.base_url, "messages": transcript}, indent=1))
        return path

    # ------------------------------------------------------------------ repairs

    def repair(self, ctx, trial: dict) -> Proposal | None:
        """One repair of a crashed trial this proposer made, as a whole-file proposal."""
        if not brief.is_repairable(trial) or not trial.get("trial_commit"):
            return None
        crashed = trial["trial_commit"]

        read_crashed = ctx.repo.file_reader(crashed)

        crashed_paths = ctx.repo.changed_paths(ctx.parent_commit, crashed)
        user = brief.render_context(ctx, read_file=read_crashed, extra=brief.repair_section(trial),
                                    files_heading=f"The crashed version of the editable files (trial {trial['number']})")
        messages, program_hash = self._messages(ctx, user)

        def check(proposal: Proposal) -> Proposal:
            resolve_searches(proposal, read_crashed)
            fixed = materialize(proposal, str(ctx.repo.project_dir), crashed, read_crashed)
            files = {path: read_crashed(path) for path in crashed_paths}
            files.update(fixed)
            whole = Proposal(
                description=f"repair of trial {trial['number']}: {proposal.description}",
                edits=[Edit(path=path, content=content) for path, content in sorted(files.items()) if content is not None],
                source=self.name,
            )
            return self._check(ctx, whole)

        proposal = self._converse(ctx, messages, check)
        if proposal.meta.get("invalid"):
            proposal.description = f"repair of trial {trial['number']}: {proposal.description}"
        proposal.meta["program_hash"] = program_hash
        return proposal
