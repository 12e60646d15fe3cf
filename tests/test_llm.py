"""The `llm` proposer against a fake OpenAI-compatible server (a real HTTP server on
loopback, the real `openai` client), driving the real controller over the fake
training script: valid edits, rejected answers and their repairs, duplicates, crashes
and their one repair, server failures and fallback, pipelining, accounting and keys."""

from __future__ import annotations

import hashlib
import json
import subprocess
from datetime import datetime
from pathlib import Path

import pytest

from autoloop.config import Config, resolve
from autoloop.loop.controller import Controller
from autoloop.errors import AutoloopError
from autoloop.proposers.seeding import seed_idea
from autoloop.proposers.proposal import InvalidProposal, Proposal, Edit
from autoloop.proposers.answer import parse_answer, resolve_searches
from autoloop.proposers.base import resolve_names
from autoloop.proposers.brief import diff_themes, files_diff, find_duplicate, normalised_diff, theme_summary
from autoloop.measure.runner import child_environment
from autoloop.store import Store
from conftest import FAKE_TRAIN, make_repo
from fakes.fake_openai import Error, FakeOpenAI, Slow, edit_answer

pytest.importorskip("openai")

SECRET = "sk-test-0a1b2c3d4e5f-DO-NOT-STORE"
LR_LINE = "LR = 0.02  # learning rate; range 0.0001..1 log"
WIDTH_LINE = "WIDTH = 64  # model width; power of two"
MODE_LINE = 'MODE = "ok"  # ok | crash | hang | nan | nometric | reported | stubborn_child | fail | enospc | fill'
PROGRAM = "# program.md (test)\nLower val_bpb within the budget. Edit train.py only.\n"


@pytest.fixture
def repo(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    return make_repo(tmp_path / "repo", FAKE_TRAIN.read_text(), {"program.md": PROGRAM})


def run_llm(repo: Path, server: FakeOpenAI, **flags):
    flags = {"tag": "t", "time_budget": 5, "grace_seconds": 20, "verify": False, "proposers": "llm",
             "llm_model": "fake-model", "llm_base_url": server.base_url, "llm_retries": 0, **flags}
    # verifier=None: the fake script has no model for the harness to evaluate or verify.
    return Controller(resolve(repo, flags), repo, verifier=None).run()


def db(repo: Path) -> Store:
    return Store(repo / "experiments.db")


def rows(repo: Path) -> list[dict]:
    with db(repo) as store:
        return store.trials(store.get_run("t")["id"])


def proposal_records(repo: Path) -> list[dict]:
    with db(repo) as store:
        return [dict(r) for r in store.db.query("SELECT * FROM proposals ORDER BY id")]


def events(repo: Path, kind: str | None = None) -> list[dict]:
    with db(repo) as store:
        return store.events(kind=kind)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def user_message(request: dict) -> str:
    return [m for m in request["messages"] if m["role"] == "user"][-1]["content"]


def first_user_message(request: dict) -> str:
    return [m for m in request["messages"] if m["role"] == "user"][0]["content"]


# ---------------------------------------------------------------------------------------
# Parsing, normalised diffs and themes (no server)
# ---------------------------------------------------------------------------------------


def test_parse_answer_finds_blocks_in_prose_fences_and_think_sections():
    text = (
        "<think>Maybe FILE: program.md? No.\n<<<<<<< SEARCH\nx\n=======\ny\n>>>>>>> REPLACE\n</think>\n"
        "Here is the plan.\n\n**DESCRIPTION:** lower the learning rate and widen\n\n"
        "### train.py\n```python\n<<<<<<< SEARCH\nLR = 0.02\n=======\nLR = 0.01\n>>>>>>> REPLACE\n```\n"
        "And in the same file:\n```python\n<<<<<<<< SEARCH\nWIDTH = 64\n========\nWIDTH = 128\n>>>>>>>> REPLACE\n```\n"
        "`model.py`\n<<<<<<< SEARCH\na = 1\n=======\n>>>>>>> REPLACE\n"
    )
    proposal = parse_answer(text, "train.py")
    assert proposal.description == "lower the learning rate and widen"
    assert [(e.path, e.search, e.replace) for e in proposal.edits] == [
        ("train.py", "LR = 0.02\n", "LR = 0.01\n"),
        ("train.py", "WIDTH = 64\n", "WIDTH = 128\n"),
        ("model.py", "a = 1\n", ""),
    ]


def test_parse_answer_accepts_a_unified_diff_and_rejects_answers_without_edits():
    diff = "--- a/train.py\n+++ b/train.py\n@@ -1 +1 @@\n-LR = 0.02\n+LR = 0.01\n"
    proposal = parse_answer(f"Lower the LR.\n```diff\n{diff}```\n", "train.py")
    assert proposal.patch == diff and proposal.description == "Lower the LR." and not proposal.edits
    with pytest.raises(InvalidProposal, match="no edit"):
        parse_answer("I would lower the learning rate in train.py.", "train.py")
    with pytest.raises(InvalidProposal, match="SEARCH section is empty"):
        parse_answer("<<<<<<< SEARCH\n=======\nx = 1\n>>>>>>> REPLACE\n", "train.py")
    for path in ("/etc/passwd", "../outside.py"):
        with pytest.raises(InvalidProposal, match=f"outside the repository: {path}"):
            parse_answer(f"FILE: {path}\n<<<<<<< SEARCH\na\n=======\nb\n>>>>>>> REPLACE\n", "train.py")


def test_loose_search_matches_trailing_whitespace_only_when_unique():
    source = "A = 1   \nB = 2\nC = 3\nC = 3\n"
    proposal = Proposal("p", edits=[Edit("f.py", search="\nA = 1\nB = 2\n", replace="A = 5\nB = 2\n"),
                                    Edit("f.py", search="C = 3\n", replace="C = 4\n")])
    resolve_searches(proposal, lambda path: source)
    assert proposal.edits[0].search == "A = 1   \nB = 2\n"  # the file's own text
    assert proposal.edits[1].search == "C = 3\n"  # two places: left for materialize to reject


def test_normalised_diff_ignores_algorithm_line_numbers_and_whitespace(fake_repo):
    source = (fake_repo / "train.py").read_text()
    new = source.replace(LR_LINE, "LR = 0.01").replace(WIDTH_LINE, "WIDTH = 128")
    (fake_repo / "train.py").write_text(new)
    git_diff = git(fake_repo, "diff") + "\n"
    ours = files_diff({"train.py": new.replace("WIDTH = 128", "WIDTH = 128   ")}, lambda p: source)
    assert normalised_diff(git_diff) == normalised_diff(ours) != ()
    other = files_diff({"train.py": source.replace(LR_LINE, "LR = 0.03")}, lambda p: source)
    trials = [{"number": 2, "status": "discard", "diff": git_diff, "description": "d", "metric": 1.1}]
    assert find_duplicate(ours, trials)["number"] == 2
    assert find_duplicate(other, trials) is None
    assert find_duplicate(ours, [{**trials[0], "status": "interrupted"}]) is None


def test_themes_group_constants_with_values_and_functions():
    diff = (
        "diff --git a/train.py b/train.py\n--- a/train.py\n+++ b/train.py\n"
        "@@ -10,3 +10,3 @@ import os\n-LR = 0.02  # lr\n+LR = 0.01  # lr\n"
        "@@ -40,4 +40,4 @@ def build_optimizers(model):\n-    lr = 1\n+    lr = 2\n"
    )
    assert diff_themes(diff) == {"LR": "0.01", "build_optimizers()": None}
    trials = [
        {"number": 1, "kind": "baseline", "status": "keep", "diff": None},
        {"number": 2, "kind": "proposal", "status": "discard", "delta": 0.01, "diff": diff, "description": "x"},
        {"number": 3, "kind": "proposal", "status": "keep", "delta": -0.02,
         "diff": diff.replace("0.01  # lr", "0.005  # lr").split("@@ -40")[0], "description": "y"},
    ]
    summary = theme_summary(trials)
    assert summary.splitlines()[0] == "- LR: 2 tried, 1 kept: #2 = 0.01 (discard +0.0100); #3 = 0.005 (keep -0.0200)"
    assert "- build_optimizers(): 1 tried, 0 kept: #2 \"x\" (discard +0.0100)" in summary


def test_auto_chain_uses_the_llm_or_agent_when_configured_else_search():
    assert resolve_names(Config()) == ["ideas", "search"]
    assert resolve_names(Config(llm_model="m")) == ["ideas", "llm", "search"]
    assert resolve_names(Config(agent_command="claude -p")) == ["ideas", "agent", "search"]
    assert resolve_names(Config(proposers=["llm", "auto", "ideas"], llm_model="m")) == ["llm", "search", "ideas"]


# ---------------------------------------------------------------------------------------
# The loop with the fake server
# ---------------------------------------------------------------------------------------


def test_valid_edit_is_committed_trained_and_accounted(repo, tmp_path):
    (repo / "pyproject.toml").write_text('[tool.autoloop]\nllm-prices = { "fake-model" = [2.0, 8.0] }\n')
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qm", "prices")
    with FakeOpenAI([edit_answer(LR_LINE, "LR = 0.01  # learning rate; range 0.0001..1 log", "lower lr")]) as server:
        summary = run_llm(repo, server, max_trials=2)
    assert summary.stop_reason == "reached --max-trials 2"
    trial = rows(repo)[1]
    assert (trial["kind"], trial["status"], trial["proposer"], trial["model"]) == ("proposal", "keep", "llm", "fake-model")
    assert trial["metric"] == pytest.approx(1.0) and trial["description"] == "lower lr"
    assert trial["program_hash"] == hashlib.sha256(PROGRAM.encode()).hexdigest()[:16]
    assert "LR = 0.01" in git(repo, "show", "autoloop/t:train.py")
    # The prompt: program.md as the system message; state, history and the file in the user message.
    request = server.requests[0]
    assert request["model"] == "fake-model"
    assert request["messages"][0] == {"role": "system", "content": PROGRAM}
    prompt = user_message(request)
    assert "| 1 | baseline | running |" in prompt and LR_LINE in prompt and "<<<<<<< SEARCH" in prompt
    assert server.headers[0]["authorization"] == f"Bearer {SECRET}"
    # Accounting: one call, linked to the trial, cost from the TOML prices.
    (record,) = proposal_records(repo)
    assert record["trial_id"] == trial["id"] and record["proposer"] == "llm" and record["error"] is None
    assert record["prompt_tokens"] > 0 and record["completion_tokens"] > 0 and record["latency_seconds"] > 0
    assert record["cost_usd"] == pytest.approx((record["prompt_tokens"] * 2.0 + record["completion_tokens"] * 8.0) / 1e6)
    transcript = Path(events(repo, "transcript")[0]["message"].split(": ", 1)[1])
    assert json.loads(transcript.read_text())["messages"][-1]["content"].startswith("Sure!")


def test_api_key_is_never_stored_nor_given_to_training(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    source = FAKE_TRAIN.read_text().replace(
        "def main() -> None:\n", "def main() -> None:\n    print('ENV', sorted(os.environ))\n")
    repo = make_repo(tmp_path / "repo", source, {"program.md": PROGRAM})
    with FakeOpenAI([Error(401, f"Incorrect API key provided: {SECRET}"),
                     edit_answer(WIDTH_LINE, "WIDTH = 32", "narrower")]) as server:
        # The 401 leaves the model alone for llm_retry_wait (60 s by default, the whole wait of
        # this test when it was the suite's twelfth-longest): a second here.
        run_llm(repo, server, max_trials=2, proposers="llm,ideas", llm_retry_wait=1)
        seed_idea(resolve(repo, {}), repo, "lower lr", sets=["LR=0.01"], patch=None)
        run_llm(repo, server, max_trials=3, tag="t")  # resume: the key is re-read, not stored
    assert len(rows(repo)) >= 3
    logs = list((repo / ".autoloop").rglob("*.log")) + list((repo / ".autoloop").rglob("*.json"))
    assert any("ENV [" in p.read_text() for p in logs if p.name == "train.log")
    for path in [*logs, *repo.glob("experiments.db*")]:
        data = path.read_bytes()
        assert SECRET.encode() not in data, path
        if path.name == "train.log":
            assert b"OPENAI_API_KEY" not in data
    with db(repo) as store:
        assert "OPENAI_API_KEY" == store.get_run("t")["config"]["llm_api_key_env"]
        assert any("***" in (r["error"] or "") for r in proposal_records(repo))
    monkeypatch.setenv("OTHER_SECRET_TOKEN", "x")
    assert not {"OPENAI_API_KEY", "OTHER_SECRET_TOKEN"} & set(child_environment({}))


def test_rejected_answers_are_sent_back_and_repaired(repo):
    script = [
        "I would lower the learning rate a little; that usually helps.",  # no edit at all
        edit_answer("# program.md (test)", "# mine now", "take over the brief", path="program.md"),
        edit_answer(LR_LINE, "LR = = 0.01", "typo"),  # syntax error
        edit_answer("LR = 0.5", "LR = 0.01", "wrong search"),  # not in the file
        edit_answer(LR_LINE, "LR = 0.01", "lower lr, at last"),
    ]
    with FakeOpenAI(script) as server:
        run_llm(repo, server, max_trials=2, llm_max_repairs=4)
    trial = rows(repo)[1]
    assert (trial["status"], trial["description"]) == ("keep", "lower lr, at last")
    feedback = [user_message(r) for r in server.requests[1:]]
    assert "has no edit" in feedback[0]
    assert "edits protected file program.md" in feedback[1]
    assert "syntax error in train.py" in feedback[2]
    assert "search block for train.py is not found" in feedback[3]
    records = proposal_records(repo)
    assert [r["trial_id"] for r in records] == [trial["id"]] * 5
    assert [bool(r["error"]) for r in records] == [True, True, True, True, False]
    assert (repo / "program.md").read_text() == PROGRAM


def test_answers_still_bad_after_repairs_end_invalid_and_nothing_reaches_the_branch(repo):
    base = git(repo, "rev-parse", "HEAD")
    script = [
        "No idea, sorry.", "Still no idea.",
        edit_answer("# program.md (test)", "# mine", "edit the brief", path="program.md"),
        edit_answer("# program.md (test)", "# mine", "edit the brief", path="program.md"),
        edit_answer(LR_LINE, "LR = (0.01", "syntax"), edit_answer(LR_LINE, "LR = (0.01", "syntax"),
    ]
    with FakeOpenAI(script) as server:
        run_llm(repo, server, max_trials=4, llm_max_repairs=1)
    assert len(server.requests) == 6
    invalid = rows(repo)[1:]
    assert [t["status"] for t in invalid] == ["invalid"] * 3
    assert "has no edit" in invalid[0]["reason"] and "(after 1 repair)" in invalid[0]["reason"]
    assert "edits protected file program.md" in invalid[1]["reason"]
    assert "syntax error in train.py" in invalid[2]["reason"]
    assert all(t["trial_commit"] is None and t["diff"] is None for t in invalid)
    assert git(repo, "rev-parse", "autoloop/t") == base
    assert git(repo, "for-each-ref", "refs/autoloop/t/trials") == ""
    assert (repo / "program.md").read_text() == PROGRAM and git(repo, "status", "--porcelain") == ""


def test_a_change_already_tried_is_not_run_again(repo):
    wider = edit_answer(WIDTH_LINE, "WIDTH = 128", "wider")
    same_again = edit_answer(WIDTH_LINE, "WIDTH = 128   ", "wider, again")  # the same normalised diff
    with FakeOpenAI([wider, same_again, same_again]) as server:
        run_llm(repo, server, max_trials=3, llm_max_repairs=1)
    first, second = rows(repo)[1:]
    assert first["status"] == "discard"
    assert second["status"] == "invalid" and f"duplicate of trial {first['number']}" in second["reason"]
    assert "duplicate of trial 2" in user_message(server.requests[2])
    assert second["trial_commit"] is None


def test_server_errors_are_retried_then_the_chain_falls_back(repo):
    seed_idea(resolve(repo, {}), repo, "lower lr", sets=["LR=0.01"], patch=None)
    text = seed_idea(resolve(repo, {}), repo, "try a smaller learning rate", sets=[], patch=None)
    with FakeOpenAI([Error(500), Error(503), edit_answer(LR_LINE, "LR = 0.01", "never reached")]) as server:
        summary = run_llm(repo, server, max_trials=2, proposers="llm,ideas", llm_retries=1)
    assert summary.stop_reason == "reached --max-trials 2"
    assert len(server.requests) == 2  # the first try and one retry; then the cool-down
    trial = rows(repo)[1]
    assert (trial["proposer"], trial["status"], trial["description"]) == ("human", "keep", "lower lr")
    (failed,) = proposal_records(repo)
    assert failed["trial_id"] is None and "InternalServerError" in failed["error"]
    assert "fake-model" in events(repo, "proposer_unavailable")[0]["message"]
    with db(repo) as store:
        assert store.ideas(status="pending")[0]["id"] == text["id"]  # handed back for later


def test_a_timeout_is_retried_then_the_chain_falls_back(repo):
    seed_idea(resolve(repo, {}), repo, "wider", sets=["WIDTH=128"], patch=None)
    slow = Slow(5.0, edit_answer(LR_LINE, "LR = 0.01", "too late"))
    with FakeOpenAI([slow]) as server:
        summary = run_llm(repo, server, max_trials=2, proposers="llm,ideas", llm_retries=1, llm_timeout=0.5)
    assert summary.stop_reason == "reached --max-trials 2" and len(server.requests) == 2
    assert rows(repo)[1]["proposer"] == "human"
    assert "Timeout" in proposal_records(repo)[0]["error"]


def test_a_waiting_text_idea_is_taken_up_and_linked(repo):
    idea = seed_idea(resolve(repo, {}), repo, "try a smaller learning rate", sets=[], patch=None)
    with FakeOpenAI([edit_answer(LR_LINE, "LR = 0.01", "smaller lr, as the human asked")]) as server:
        run_llm(repo, server, max_trials=2, proposers="auto")  # ideas, llm, search
    assert "> try a smaller learning rate" in user_message(server.requests[0])
    trial = rows(repo)[1]
    assert trial["proposer"] == "llm" and trial["idea_id"] == idea["id"]
    with db(repo) as store:
        (row,) = store.ideas()
    assert (row["status"], row["trial_id"]) == ("done", trial["id"])


def _route(answers: list[str], repair: str):
    """A server script that answers repair requests with `repair` and others in order."""
    queue = list(answers)

    def respond(body):
        if "# Repair: trial" in first_user_message(body):
            return repair
        return queue.pop(0) if len(queue) > 1 else queue[0]

    return respond


def test_a_crash_gets_one_repair_with_its_traceback_as_its_own_trial(repo):
    crashing = (
        "DESCRIPTION: lower lr\n"
        f"FILE: train.py\n<<<<<<< SEARCH\n{LR_LINE}\n=======\nLR = 0.01\n>>>>>>> REPLACE\n"
        f"<<<<<<< SEARCH\n{MODE_LINE}\n=======\nMODE = \"crash\"\n>>>>>>> REPLACE\n"
    )
    repair = edit_answer('MODE = "crash"', MODE_LINE, "restore the mode")
    with FakeOpenAI([_route([crashing, edit_answer(WIDTH_LINE, "WIDTH = 32", "narrower")], repair)]) as server:
        run_llm(repo, server, max_trials=3)
    crashed, repaired = rows(repo)[1:]
    assert crashed["status"] == "crash"
    assert (repaired["kind"], repaired["derived_from"], repaired["status"]) == ("repair", crashed["id"], "keep")
    assert repaired["description"] == f"repair of trial {crashed['number']}: restore the mode"
    assert repaired["metric"] == pytest.approx(1.0)  # the idea (LR) survived the repair
    prompt = next(first_user_message(r) for r in server.requests if "# Repair" in first_user_message(r))
    assert "RuntimeError: CUDA error: an illegal memory access was encountered (pretend)" in prompt and 'MODE = "crash"' in prompt


def test_a_repair_that_crashes_again_is_not_repaired_again(repo):
    crashing = edit_answer(MODE_LINE, 'MODE = "crash"', "crash")
    still = edit_answer('MODE = "crash"', 'MODE = "crash"\nLR = 0.03', "still crashing")
    with FakeOpenAI([_route([crashing, edit_answer(WIDTH_LINE, "WIDTH = 32", "narrower")], still)]) as server:
        run_llm(repo, server, max_trials=4)
    kinds = [(t["kind"], t["status"]) for t in rows(repo)[1:]]
    assert kinds == [("proposal", "crash"), ("repair", "crash"), ("proposal", "discard")]
    assert sum("# Repair" in first_user_message(r) for r in server.requests) == 1


def test_next_proposal_is_prepared_during_training_and_reapplied_or_regenerated(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    source = FAKE_TRAIN.read_text().replace("SLEEP = 0.0", "SLEEP = 1.0")
    repo = make_repo(tmp_path / "repo", source, {"program.md": PROGRAM})
    arrivals = []

    def stamp(answer):
        def respond(body):
            arrivals.append(datetime.now().astimezone())
            return answer
        return respond

    script = [
        stamp(edit_answer(LR_LINE, "LR = 0.015", "lower lr")),  # prepared during the baseline; kept
        stamp(edit_answer(LR_LINE, "LR = 0.03", "stale")),  # prepared during trial 2; no longer applies
        stamp(edit_answer("LR = 0.015", "LR = 0.01", "regenerated on the new best")),  # kept
        stamp(edit_answer(WIDTH_LINE, "WIDTH = 32", "narrower")),  # prepared during trial 3; still applies
    ]
    with FakeOpenAI(script) as server:
        run_llm(repo, server, max_trials=4)
    trials = rows(repo)
    assert [t["description"] for t in trials[1:]] == ["lower lr", "regenerated on the new best", "narrower"]
    assert [t["status"] for t in trials[1:]] == ["keep", "keep", "discard"]
    # The prepared requests arrived while the previous trial was still training.
    for arrival, trial in [(arrivals[0], trials[0]), (arrivals[1], trials[1]), (arrivals[3], trials[2])]:
        assert datetime.fromisoformat(trial["started_at"]) < arrival < datetime.fromisoformat(trial["finished_at"])
    messages = [e["message"] for e in events(repo, "prefetch")]
    assert any(m.startswith("regenerating: 'stale'") for m in messages)
    assert any(m.startswith("re-applied 'narrower'") for m in messages)
    superseded = [r for r in proposal_records(repo) if r["trial_id"] is None]
    assert len(superseded) == 1 and superseded[0]["error"].startswith("superseded")
    assert "LR = 0.015" in user_message(server.requests[2])  # asked again against the new best
    assert "LR = 0.01\n" in git(repo, "show", f"{trials[3]['trial_commit']}:train.py")


def test_a_prepared_proposal_that_never_runs_gives_its_idea_back(repo):
    seed_idea(resolve(repo, {}), repo, "lower lr", sets=["LR=0.01"], patch=None, priority=5)
    text = seed_idea(resolve(repo, {}), repo, "try something bold", sets=[], patch=None)
    with FakeOpenAI([edit_answer(WIDTH_LINE, "WIDTH = 32", "bold")]) as server:
        run_llm(repo, server, max_trials=2, proposers="ideas,llm")
    assert len(server.requests) == 1  # prepared during the baseline, pre-empted by the human's idea
    assert rows(repo)[1]["proposer"] == "human"
    with db(repo) as store:
        assert [i["id"] for i in store.ideas(status="pending")] == [text["id"]]
    (record,) = proposal_records(repo)
    assert record["trial_id"] is None and record["error"] == "superseded: the run stopped before it ran"


def test_max_cost_refuses_to_start_without_prices_and_stops_spending(repo):
    with FakeOpenAI([edit_answer(LR_LINE, "LR = 0.01", "lower lr")]) as server:
        with pytest.raises(AutoloopError, match="llm-prices has no price for model 'fake-model'"):
            run_llm(repo, server, max_cost=1.0)
        assert not (repo / "experiments.db").exists() and server.requests == []
        summary = run_llm(repo, server, max_cost=1e-9, llm_prices='{"fake-model": [1000, 1000]}', max_trials=5)
    # One paid call, then the run stops before its next trial would spend more (autoloop.loop.cost).
    assert len(server.requests) == 1 and len(rows(repo)) == 2
    assert summary.stop_reason.startswith("--max-cost 1e-09: spent $")
    assert proposal_records(repo)[0]["cost_usd"] > 1e-9


def test_configuration_errors_are_one_line_before_anything_runs(repo, monkeypatch):
    with pytest.raises(AutoloopError, match="needs a model"):
        Controller(resolve(repo, {"tag": "t", "proposers": "llm"}), repo).run()
    monkeypatch.delenv("OPENAI_API_KEY")
    with pytest.raises(AutoloopError, match="export OPENAI_API_KEY"):
        Controller(resolve(repo, {"tag": "t", "proposers": "llm", "llm_model": "m"}), repo).run()
    with pytest.raises(AutoloopError, match="is not a price"):
        Controller(resolve(repo, {"tag": "t", "proposers": "llm", "llm_model": "m", "llm_base_url": "http://x/v1",
                                  "llm_prices": '{"m": "cheap"}'}), repo).run()
    assert not (repo / "experiments.db").exists()


# ---------------------------------------------------------------------------- results with uncertainty


def _decision(diff: float, se: float, n: int, near_miss: bool = False) -> dict:
    low, high = diff - 2.3 * se, diff + 2.3 * se
    return {"action": "discard", "mean_diff": diff, "se": se, "low": low, "high": high, "n": n,
            "near_miss": near_miss, "distinguishable": not low <= 0 <= high}


def test_the_brief_shows_means_with_uncertainty_and_what_is_not_distinguishable(fake_repo):
    """What an LLM or agent reads about past results: means ± se with the number of runs,
    'not distinguishable from the incumbent' instead of a bare delta, near misses as
    such, and the run's measured noise."""
    from autoloop.gitops import GitRepo
    from autoloop.proposers import ProposalContext
    from autoloop.proposers.brief import render_context

    source = (fake_repo / "train.py").read_text()

    def diff_to(value: str) -> str:
        return files_diff({"train.py": source.replace(LR_LINE, f"LR = {value}")}, lambda p: source)

    store = Store(fake_repo / "experiments.db")
    repo = GitRepo.open(fake_repo)
    try:
        run = store.create_run("n", branch="autoloop/n", base_commit=repo.head(), best_commit=repo.head(),
                               noise_sd=0.0061, noise_pair_sd=0.0042, noise_df=9)
        t = store.new_trial(run["id"], "baseline", description="baseline")
        store.update_trial(t["id"], status="keep", metric=2.6, metric_sd=0.0035, n_runs=3)
        for value, status, diff, se, n, near in [("0.03", "discard", 0.0015, 0.0024, 4, False),
                                                 ("0.015", "discard", -0.0020, 0.0021, 4, True),
                                                 ("0.012", "keep", -0.0300, 0.0020, 2, False)]:
            t = store.new_trial(run["id"], "proposal", description=f"lr {value}", diff=diff_to(value),
                                best_before=2.6)
            store.update_trial(t["id"], status=status, metric=2.6 + diff, metric_sd=se, n_runs=n, delta=diff,
                               decision=_decision(diff, se, n, near))
        ctx = ProposalContext(config=resolve(fake_repo, {"tag": "n"}), store=store, run=store.get_run("n"),
                              repo=repo, parent_commit=repo.head(), read_parent_file=repo.file_reader(repo.head()))
        text = render_context(ctx)
    finally:
        store.close()
    assert "Baseline val_bpb 2.6000 ± 0.0035 (mean of 3 runs)" in text
    assert "Best val_bpb 2.5700 ± 0.0020 (mean of 2 runs) (trial 4)" in text
    assert "Measured noise: one run's val_bpb varies by sd 0.0061 between seeds and a paired difference " \
           "from the incumbent by sd 0.0042" in text
    # The theme summary and the table: no bare delta for noise-aware trials.
    assert "#2 = 0.03 (discard +0.0015 ± 0.0024, not distinguishable from the incumbent)" in text
    assert "#3 = 0.015 (discard -0.0020 ± 0.0021, near miss: not distinguishable from the incumbent)" in text
    assert "#4 = 0.012 (keep -0.0300 ± 0.0020)" in text
    assert "- LR: 3 tried, 1 kept, 1 near miss:" in text
    assert "| 2 | proposal | discard | 2.6015 ± 0.0024 (4) | +0.0015 ± 0.0024, not distinguishable from the " \
           "incumbent |" in text
    assert "| # | kind | status | val_bpb | vs incumbent | description | reason |" in text
    assert '"not distinguishable from the incumbent" means the difference lies within the measured noise' in text
    assert "+0.001500" not in text  # no bare delta for it anywhere


def test_the_brief_of_an_old_run_reads_as_before():
    trials = [
        {"number": 1, "kind": "baseline", "status": "keep", "metric": 1.09, "diff": None},
        {"number": 2, "kind": "proposal", "status": "discard", "metric": 1.1, "delta": 0.01, "best_before": 1.09,
         "description": "x", "reason": "r"},
    ]
    from autoloop.proposers.brief import trials_table

    assert trials_table(trials) == (
        "| # | kind | status | val_bpb | delta | description | reason |\n|---|---|---|---|---|---|---|\n"
        "| 1 | baseline | keep | 1.090000 | - |  |  |\n| 2 | proposal | discard | 1.100000 | +0.010000 | x | r |")
