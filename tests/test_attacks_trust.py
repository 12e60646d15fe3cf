"""Issue 23's attacks on the trust boundary (and the poisoned bytecode followed by a far worse
model, and a hunt for the secrets outside the project), through the real sandboxed loop in
one run on from the shared baseline: the other half of tests/test_attacks.py's step-mode
table, in a file of its own so that the other CI worker runs it."""

from __future__ import annotations

import pytest

from tests.test_attacks import (
    MUCH_WORSE, POISON_TORCH_BYTECODE, SECRET_HUNT, TRUST_ATTACKS, _log, assert_invalid, needs_bwrap,
    sandboxed_attack_run,
)


@pytest.mark.slow
@needs_bwrap
def test_trust_attacks_in_step_mode_end_invalid_or_fail_inside_the_sandbox_and_leak_nothing(
        tmp_path, monkeypatch, request, attacked_repo):
    """Issue 23's items 1, 2, 3 and 5, sandboxed, verification on, in one run: every attack
    invalid, a crash, or failed inside the sandbox, and what
    tests.test_attacks.sandboxed_attack_run checks of every attack (none kept, no secret
    anywhere, nothing outside the trials' folders changed, .git/hooks included)."""
    repo = attacked_repo
    sources = {**TRUST_ATTACKS, "poison bytecode": POISON_TORCH_BYTECODE, "much worse": MUCH_WORSE,
               "secret hunt": SECRET_HUNT}
    assert len(sources) == len(TRUST_ATTACKS) + 3  # no attack hides another of the same name
    trials = sandboxed_attack_run(tmp_path, monkeypatch, request, repo, sources)
    # A number no database takes is the trial's problem, not the controller's.
    assert_invalid(trials, "huge tokens")
    assert_invalid(trials, "nan steps")
    # The weights stashed by one trial never reach another.
    assert "STASH FOUND" not in _log(repo, trials["load stash"])
    # The secrets outside the project and deep inside it do not exist in the sandbox.
    assert "HUNT 0 " in _log(repo, trials["secret hunt"]), _log(repo, trials["secret hunt"])[-2000:]
