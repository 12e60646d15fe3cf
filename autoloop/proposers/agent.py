"""The `agent` proposer: an external coding agent edits a throwaway clone.

`agent_command` is any non-interactive coding-agent command line, e.g. `claude -p`,
`codex exec` or `aider --yes-always --message`. The prompt (program.md and the brief of
`brief.py`, plus instructions) is passed as the command's last argument, or where the
command says `{prompt}` (the text, as one argument) or `{prompt_file}` (a file holding
it).

Isolation: the agent runs in a clone made for this one proposal (`git clone --shared
--no-checkout`, then a detached checkout of the parent commit) in a temporary folder.
The clone's `origin` remote is removed, so a `git push` from the agent has nowhere to
go; everything it commits lands in the clone's own refs and objects, which are deleted
afterwards. The real repository's refs are never touched: only the controller moves
them. The agent never trains: the prompt says so, and nothing it leaves behind runs.

The proposal is the clone's diff against the parent (`git add -A` then `git diff
--cached <parent>`), so changes the agent committed are included; `__pycache__` and
autoloop's runtime files are excluded. The controller validates it like any other
proposal: an edit to a protected or non-editable file makes the trial `invalid`.

The agent runs in its own process group (a new session) with stdin closed, is killed as
a group at `agent_timeout`, and its stdout and stderr are the transcript, saved under
`.autoloop/<tag>/transcripts/`. The temporary folder and then the process (pid, group,
start time) are recorded in the store's `processes` table before anything else happens
to them, and the row is ended once both are gone: a controller killed meanwhile leaves an
agent that keeps running on its own, and the next controller in this working tree ends
it and deletes the folder (`reap_helpers`). The agent usually runs on the prefetch
thread; the Store is shared with it safely (one connection behind an RLock). A command that is not installed is a one-line error when
the chain is built, before the baseline trains; a failure or timeout at run time makes
the chain fall through to the next proposer.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from autoloop.config import Config
from autoloop.errors import AutoloopError
from autoloop.proposers.proposal import Proposal, patch_text
from autoloop.base.processes import process_start_time
from autoloop.proposers import brief, memory
from autoloop.proposers.base import ProposerUnavailable
from autoloop.proposers.outage import Availability, Outage
from autoloop.base.processes import kill_group

KILL_GRACE_SECONDS = 10.0
TEMP_PREFIX = "autoloop-agent-"  # the temporary clone's folder; recovery deletes only such folders
IGNORED = ("__pycache__/", "*.pyc", ".autoloop/", "experiments.db*")
# Contract variables of the training process; the agent must not inherit a trial's.
_CONTRACT_PREFIX = "AUTOLOOP_"

INSTRUCTIONS = """\
# Your task
Make ONE change to the files in the current directory that you expect to lower val_bpb
within the fixed budget, following the research brief above.
- Edit only: {editable}. Do not create or change any other file.
- Do NOT run training or train.py's main: it is trained for you, on the real hardware,
  after you finish. You may check that it compiles (python -m py_compile {first}).
- Committing is optional: your changes are taken from the working tree either way.
- Finish with one line of the form
DESCRIPTION: <what you changed and why, in one line>
"""


def _git(cwd: Path | str, *args: str, check: bool = True) -> str:
    out = subprocess.run(["git", *args], cwd=str(cwd), capture_output=True, text=True)
    if check and out.returncode != 0:
        raise ProposerUnavailable(f"git {' '.join(args[:2])} failed in the agent's clone: {out.stderr.strip()[:300]}")
    return out.stdout


class AgentProposer:
    name = "agent"
    slow = True  # worth preparing while the current trial trains (see autoloop.loop.prefetch)

    def __init__(self, config: Config):
        self.config = config
        if not config.agent_command:
            raise AutoloopError(
                "the agent proposer needs a command: set agent-command in [tool.autoloop] or AUTOLOOP_AGENT_COMMAND, "
                "e.g. 'claude -p'"
            )
        try:
            self.argv = shlex.split(config.agent_command)
        except ValueError as exc:
            raise AutoloopError(f"agent-command {config.agent_command!r} does not parse ({exc}): fix its quoting") from None
        executable = self.argv[0] if self.argv else ""
        if not executable or (shutil.which(executable) is None and not os.access(executable, os.X_OK)):
            raise AutoloopError(
                f"agent command {executable!r} was not found on PATH: install it, or set agent-command "
                f"(now {config.agent_command!r}) to a coding agent that is installed"
            )
        if config.max_cost is not None:
            raise AutoloopError(
                "max-cost cannot be enforced for the agent proposer (its spending is not reported): "
                "unset max-cost, or use the llm proposer with llm-prices"
            )
        self.model = "agent:" + Path(executable).name
        # An agent that fails (exits non-zero, times out) is left alone with the model's
        # back-off (autoloop.proposers.outage) while the other sources go on; its first
        # answer after failures is a `proposer_back` event, so the outage ends where shown.
        self.availability = Availability(config.llm_retry_wait, config.llm_retry_max_wait)

    @property
    def where(self) -> str:
        return f"the agent {self.config.agent_command}"

    @property
    def outage(self) -> Outage | None:
        """Why the agent cannot propose now (None: it can)."""
        return self.availability.outage(self.name, self.where)

    # ------------------------------------------------------------------ proposing

    def propose(self, ctx) -> Proposal:
        idea = brief.take_idea(ctx)
        try:
            prompt, program_hash = self._prompt(ctx, brief.render_context(
                ctx, idea=idea, files_heading="The editable files at the current best commit (as in your directory)"))
            proposal = self._run(ctx, ctx.parent_commit, prompt)
        except BaseException:
            brief.give_back_idea(ctx, idea)
            raise
        proposal.idea_id = idea["id"] if idea else None
        if idea is not None and proposal.description == "agent edit":
            proposal.description = idea["text"]
        proposal.meta["program_hash"] = program_hash
        return proposal

    def repair(self, ctx, trial: dict) -> Proposal | None:
        """One repair of a crashed trial the agent made: it starts from the crashed commit."""
        if not brief.is_repairable(trial) or not trial.get("trial_commit"):
            return None
        crashed = trial["trial_commit"]

        read_crashed = ctx.repo.file_reader(crashed)

        prompt, program_hash = self._prompt(ctx, brief.render_context(
            ctx, read_file=read_crashed, extra=brief.repair_section(trial),
            files_heading=f"The crashed version of the editable files (trial {trial['number']}; as in your directory)"))
        proposal = self._run(ctx, crashed, prompt)
        proposal.description = f"repair of trial {trial['number']}: {proposal.description}"
        proposal.meta["program_hash"] = program_hash
        return proposal

    def _prompt(self, ctx, context: str) -> tuple[str, str | None]:
        program, program_hash = brief.read_program(ctx.repo.project_dir)
        if program is None:
            program = brief.FALLBACK_PROGRAM
        instructions = INSTRUCTIONS.format(editable=", ".join(ctx.config.editable), first=ctx.config.editable[0])
        return f"{program.rstrip()}\n\n{context}\n{instructions}", program_hash

    def _command(self, prompt: str, prompt_file: Path) -> list[str]:
        if any("{prompt}" in a or "{prompt_file}" in a for a in self.argv):
            return [a.replace("{prompt_file}", str(prompt_file)).replace("{prompt}", prompt) for a in self.argv]
        return [*self.argv, prompt]

    def _run(self, ctx, start: str, prompt: str) -> Proposal:
        """Run the agent in a clone checked out at `start`; the proposal is the clone's
        diff against the parent commit."""
        if self.availability.cooling():
            raise ProposerUnavailable(
                f"the agent: cooling down for {self.availability.cooling():.0f} s after it failed", quiet=True)
        started = time.monotonic()
        transcript = self._transcript_path(ctx)
        tmp = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))
        record = ctx.store.add_process(ctx.run["id"], "agent", path=str(tmp),
                                       info={"command": self.config.agent_command})
        try:
            clone = tmp / "work"
            _git(tmp, "clone", "--quiet", "--shared", "--no-checkout", str(ctx.repo.toplevel), str(clone))
            _git(clone, "remote", "remove", "origin")
            _git(clone, "checkout", "--quiet", "--detach", start)
            exclude = clone / ".git" / "info" / "exclude"
            exclude.parent.mkdir(parents=True, exist_ok=True)
            with open(exclude, "a") as handle:
                handle.write("\n".join(IGNORED) + "\n")
            prompt_file = tmp / "prompt.md"
            prompt_file.write_text(prompt)
            transcript.with_suffix(".prompt.md").write_text(prompt)
            # The agent works in the project folder of its clone (a subfolder when the
            # project is one); its diff is relative to that folder, as every proposal is.
            prefix = getattr(ctx.repo, "prefix", "")
            returncode, timed_out = self._execute(
                self._command(prompt, prompt_file), clone / prefix if prefix else clone, transcript,
                on_start=lambda pid, start: ctx.store.update_process(record, pid=pid, pgid=pid, pid_start_time=start))
            latency = time.monotonic() - started
            call = {"proposer": self.name, "model": self.model, "latency_seconds": latency}
            text = transcript.read_text(errors="replace") if transcript.exists() else ""
            if timed_out or returncode != 0:
                what = (f"timed out after {self.config.agent_timeout:g} s" if timed_out
                        else f"exited with status {returncode}: {_last_line(text)}")
                ctx.store.add_proposal_record(run_id=ctx.run["id"], error=f"agent {what}"[:500], **call)
                pause = self.availability.failed(f"it {what}"[:500])
                raise ProposerUnavailable(f"the agent ({self.config.agent_command}) {what}; transcript: {transcript}; "
                                          f"skipping it for {pause:.0f} s")
            self.availability.answered(ctx.store, ctx.run["id"], self.name, self.where)  # it answered: no outage now
            _git(clone, "add", "-A")
            # Bytes, not text: a file the agent left in another encoding must reach validation
            # (which names it), not fail decoding here.
            relative = [f"--relative={prefix}"] if prefix else []
            diff = patch_text(_git_bytes(clone, "diff", "--cached", "--binary", "--no-color", "--no-ext-diff",
                                         *relative, ctx.parent_commit, "--"))
            if not diff.strip():
                ctx.store.add_proposal_record(run_id=ctx.run["id"], error="the agent changed nothing", **call)
                # An answer without an edit: no outage (the proposals table has it), the chain falls through.
                raise ProposerUnavailable(f"the agent ({self.config.agent_command}) changed nothing; transcript: {transcript}",
                                          quiet=True)
            description = _description(text) or _commit_subject(clone, start) or "agent edit"
            proposal = Proposal(description=description, patch=diff, source=self.name, model=self.model)
            duplicate = brief.find_duplicate(diff, ctx.history())
            elsewhere = memory.refused_repeat(ctx, diff) if duplicate is None else None
            if duplicate is not None:
                call["error"] = "duplicate"
                proposal.meta["invalid"] = brief.duplicate_reason(duplicate)
            elif elsewhere is not None:
                call["error"] = "duplicate"
                proposal.meta["invalid"] = memory.elsewhere_reason(elsewhere)
            proposal.meta["calls"] = [call]
            proposal.meta["transcript"] = str(transcript)
            return proposal
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            ctx.store.end_process(record)

    def _execute(self, argv: list[str], cwd: Path, transcript: Path, on_start=None) -> tuple[int | None, bool]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_CONTRACT_PREFIX)}
        # Commits the agent makes stay in the clone; give git an identity so they never fail.
        for variable, value in (("GIT_AUTHOR_NAME", "autoloop agent"), ("GIT_AUTHOR_EMAIL", "agent@autoloop.invalid"),
                                ("GIT_COMMITTER_NAME", "autoloop agent"), ("GIT_COMMITTER_EMAIL", "agent@autoloop.invalid")):
            env.setdefault(variable, value)
        with open(transcript, "wb") as log:
            log.write(f"# autoloop agent: {self.config.agent_command} (prompt: {transcript.with_suffix('.prompt.md').name},"
                      f" in {cwd})\n".encode())
            log.flush()
            try:
                proc = subprocess.Popen(argv, cwd=str(cwd), env=env, stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as exc:
                raise ProposerUnavailable(f"cannot start the agent ({self.config.agent_command}): {exc}") from None
            try:
                if on_start is not None:
                    on_start(proc.pid, process_start_time(proc.pid))
                return proc.wait(timeout=self.config.agent_timeout), False
            except subprocess.TimeoutExpired:
                kill_group(proc, grace=KILL_GRACE_SECONDS)
                return None, True
            except BaseException:
                kill_group(proc, grace=KILL_GRACE_SECONDS)
                raise

    def _transcript_path(self, ctx) -> Path:
        from autoloop.config import STATE_DIR

        folder = Path(ctx.repo.project_dir) / STATE_DIR / ctx.config.tag / "transcripts"
        folder.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{time.monotonic_ns() % 10**6:06d}"
        return folder / f"{stamp}-agent.log"


def reap_helpers(store, run_ids) -> list[str]:
    """End agents (and delete their temporary clones) that a dead controller left behind.

    For every live `processes` row of the runs `run_ids`: the process group is killed when
    its recorded leader is provably the same process (pid and start time), the folder is
    deleted when it is one of ours (a temporary `autoloop-agent-*` folder), and the row is
    ended. Only call it holding the working tree's run lock: then no live controller owns
    these rows. Returns one line per process, for the event log."""
    from autoloop.base.processes import kill_process_group

    done = []
    for run_id in run_ids:
        for row in store.live_processes(run_id):
            killed = False
            if row.get("pgid") and row["pgid"] > 1 and row["pgid"] != os.getpgrp():
                killed = kill_process_group(row["pgid"], expected_pid=row.get("pid"),
                                            expected_start_time=row.get("pid_start_time"), grace=KILL_GRACE_SECONDS)
            path = Path(row["path"]) if row.get("path") else None
            removed = path is not None and path.name.startswith(TEMP_PREFIX) and path.is_dir()
            if removed:
                shutil.rmtree(path, ignore_errors=True)
            store.end_process(row["id"])
            what = ", ".join(part for part, did in (("killed", killed), (f"deleted {path}", removed)) if did)
            done.append(f"{row['what']} (pid {row.get('pid') or '-'}): {what or 'already gone'}")
    return done


def _git_bytes(cwd: Path | str, *args: str) -> bytes:
    out = subprocess.run(["git", *args], cwd=str(cwd), capture_output=True)
    if out.returncode != 0:
        raise ProposerUnavailable(f"git {' '.join(args[:2])} failed in the agent's clone: "
                                  f"{out.stderr.decode(errors='replace').strip()[:300]}")
    return out.stdout


def _description(text: str) -> str | None:
    found = re.findall(r"^[ \t>*#_`-]*DESCRIPTION[*_`]*[ \t]*:[ \t]*(.+?)[ \t]*$", text, re.MULTILINE | re.IGNORECASE)
    return found[-1].strip("*_` ")[:200] if found else None


def _commit_subject(clone: Path, start: str) -> str | None:
    subject = _git(clone, "log", "-1", "--format=%s", f"{start}..HEAD", check=False).strip()
    return subject[:200] or None


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"
