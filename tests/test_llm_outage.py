"""A model night whose model cannot be reached says so: before the baseline in one line,
during the night on the console, in `status` and the report, with back-off while other
sources go on, and in the stop reason of a night that had only the model.

Real parts: a real git repo, the real CLI, a real local OpenAI-compatible server
(tests/fakes/fake_openai.py) stopped and started again on the same port, a real closed port.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autoloop.cli import app
from autoloop.proposers.outage import backoff_seconds, describe_outage, outages
from autoloop.store import Store
from conftest import FAKE_TRAIN, make_repo
from fakes.fake_openai import Error, FakeOpenAI, edit_answer

pytest.importorskip("openai")

runner = CliRunner()
SECRET = "sk-test-outage-DO-NOT-SHOW"
LR_LINE = "LR = 0.02  # learning rate; range 0.0001..1 log"


@pytest.fixture
def repo(tmp_path, monkeypatch, one_run_per_trial) -> Path:
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.setenv("AUTOLOOP_LLM_RETRIES", "0")
    monkeypatch.setenv("AUTOLOOP_GRACE_SECONDS", "20")
    return make_repo(tmp_path / "repo", FAKE_TRAIN.read_text(), {"program.md": "# program\nLower val_bpb.\n"})


def closed_port() -> int:
    """A port nothing listens on: bound, then closed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(repo: Path, *args: str):
    # --max-trials bounds a night that the code under test fails to stop (e.g. one that never checks the model)
    args = args if "--max-trials" in args else (*args, "--max-trials", "5")
    return runner.invoke(app, ["run", "--repo", str(repo), "--no-verify", "--no-check", "--tag", "t",
                               "--time-budget", "5", "--llm-model", "fake-model", *args])


def trials(repo: Path) -> list[dict]:
    with Store(repo / "experiments.db") as store:
        return store.trials(store.get_run("t")["id"])


def events(repo: Path) -> list[dict]:
    with Store(repo / "experiments.db") as store:
        return store.events(store.get_run("t")["id"])


# ---------------------------------------------------------------------------- the schedule (known answers)


def test_backoff_doubles_from_the_first_wait_up_to_the_most():
    assert [backoff_seconds(n, 60, 300) for n in range(0, 7)] == [0, 60, 120, 240, 300, 300, 300]
    assert [backoff_seconds(n, 0.5, 3) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 3]
    assert backoff_seconds(10_000, 60, 300) == 300  # a night-long outage stays finite


def test_outages_are_read_from_the_events_oldest_first():
    def event(kind, message, when):
        return {"kind": kind, "message": message, "created_at": f"2026-12-05T{when}:00+00:00"}

    found = outages([
        event("proposer_unavailable", "llm: fake at u failed (APIConnectionError: Connection error.)", "19:40"),
        event("proposer_unavailable", "agent: timed out", "19:41"),
        event("proposer_unavailable", "llm: fake at u failed (InternalServerError: 500)", "19:42"),
        event("proposer_back", "llm: fake at u answers again", "19:50"),
        event("proposer_unavailable", "llm: fake at u failed (APITimeoutError)", "20:10"),
    ])
    assert [(o["proposer"], o["failures"], o["until"] is None) for o in found] == [
        ("llm", 2, False), ("agent", 1, True), ("llm", 1, True)]
    assert describe_outage(found[0]) == ("llm was unavailable 19:40 UTC-19:50 UTC (2 failed requests), back since; "
                                         "last error: fake at u failed (InternalServerError: 500)")
    assert describe_outage(found[2]) == "llm unavailable since 20:10 UTC (1 failed request): fake at u failed (APITimeoutError)"


# ---------------------------------------------------------------------------- (a) before the baseline


def test_a_dead_endpoint_stops_the_run_before_the_baseline_in_one_line(repo):
    url = f"http://127.0.0.1:{closed_port()}/v1"
    result = run_cli(repo, "--proposers", "llm", "--llm-base-url", url)
    assert result.exit_code == 1, result.output
    (line,) = result.output.strip().splitlines()  # one line: no header, no traceback
    assert line.startswith(f"error: the model fake-model at {url} cannot be reached (APIConnectionError")
    assert "--llm-base-url" in line and "drop llm from --proposers" in line and SECRET not in line
    assert not (repo / "experiments.db").exists()  # nothing ran, nothing was written


def test_a_server_that_answers_500_or_refuses_the_key_stops_it_too(repo):
    with FakeOpenAI([edit_answer(LR_LINE, "LR = 0.01")], models=Error(500)) as server:
        result = run_cli(repo, "--proposers", "llm", "--llm-base-url", server.base_url)
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert "cannot be reached (InternalServerError" in result.output and server.requests == []
    with FakeOpenAI([edit_answer(LR_LINE, "LR = 0.01")], models=Error(401, "bad key")) as server:
        result = run_cli(repo, "--proposers", "llm", "--llm-base-url", server.base_url)
    assert result.exit_code == 1 and "AuthenticationError" in result.output and "$OPENAI_API_KEY" in result.output
    assert not (repo / "experiments.db").exists()


@pytest.mark.slow
def test_a_resume_against_a_dead_endpoint_loses_nothing_recorded(repo):
    first = run_cli(repo, "--proposers", "search", "--max-trials", "1")
    assert first.exit_code == 0, first.output
    before = [(t["number"], t["status"], t["metric"]) for t in trials(repo)]
    result = run_cli(repo, "--proposers", "llm,search", "--llm-base-url", f"http://127.0.0.1:{closed_port()}/v1")
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert [(t["number"], t["status"], t["metric"]) for t in trials(repo)] == before


@pytest.mark.slow
def test_a_server_that_lists_other_models_is_said_and_the_night_goes_on(repo):
    with FakeOpenAI([edit_answer(LR_LINE, "LR = 0.01", "lower lr")], models=["other-model"]) as server:
        result = run_cli(repo, "--proposers", "llm", "--llm-base-url", server.base_url, "--max-trials", "2")
    assert result.exit_code == 0, result.output
    assert "does not list 'fake-model' (it lists other-model)" in " ".join(result.output.split())
    assert trials(repo)[1]["proposer"] == "llm"


# ---------------------------------------------------------------------------- (b), (c) during the night


def stop_after_listing(server: FakeOpenAI) -> threading.Thread:
    """The server goes down right after the check before the night has listed its models."""
    def watch():
        while server.listings == 0:
            time.sleep(0.01)
        server.__exit__(None, None, None)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def read_trials(db: Path) -> list[tuple]:
    """(number, proposer) of the trials so far, read-only beside the running controller."""
    import sqlite3

    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as con:
            return con.execute("SELECT number, proposer FROM trials ORDER BY number").fetchall()
    except sqlite3.Error:
        return []


def squeeze(text: str) -> str:
    return " ".join(text.split())  # the console wraps long lines when it is not a terminal


@pytest.fixture
def quick_backoff(monkeypatch):
    monkeypatch.setenv("AUTOLOOP_LLM_RETRY_WAIT", "0.2")
    monkeypatch.setenv("AUTOLOOP_LLM_RETRY_MAX_WAIT", "0.5")


@pytest.mark.slow
def test_a_model_that_goes_down_is_retried_while_search_goes_on_and_its_outage_is_shown(repo, tmp_path, quick_backoff):
    first = FakeOpenAI([Error(500, "never asked: the server is down")])
    with first:
        stop_after_listing(first)
        port = first.server.server_address[1]
        servers: list[FakeOpenAI] = []  # the same server started again, on the same port
        started = threading.Event()

        def restart_once_search_ran():
            while not any(proposer == "search" for _, proposer in read_trials(repo / "experiments.db")):
                time.sleep(0.05)
            servers.append(FakeOpenAI([edit_answer(LR_LINE, "LR = 0.01", "lower lr from the model")], port=port))
            servers[0].__enter__()
            started.set()

        threading.Thread(target=restart_once_search_ran, daemon=True).start()
        result = run_cli(repo, "--proposers", "llm,search", "--llm-base-url", first.base_url, "--max-trials", "6")
    try:
        assert result.exit_code == 0, result.output
        assert started.is_set() and first.requests == [] and servers[0].requests  # down, then back on the same port
        out = squeeze(result.output)
        assert f"llm unavailable: the model fake-model at {first.base_url} was unreachable since" in out
        assert "APIConnectionError" in out and "the other sources go on meanwhile" in out
        assert "llm is back: its requests are answered again" in out
        numbers = {proposer: [n for n, p in read_trials(repo / "experiments.db") if p == proposer]
                   for proposer in ("search", "llm")}
        assert numbers["search"] and numbers["llm"] and min(numbers["search"]) < min(numbers["llm"])
        kinds = [e["kind"] for e in events(repo) if e["kind"].startswith("proposer_")]
        assert kinds[0] == "proposer_unavailable" and "proposer_back" in kinds
        status = squeeze(runner.invoke(app, ["status", "--repo", str(repo)]).output)
        assert "proposer: llm was unavailable" in status and "back since" in status and "APIConnectionError" in status
        report = runner.invoke(app, ["report", "--repo", str(repo), "--out", str(tmp_path / "report")])
        assert report.exit_code == 0, report.output
        html = (tmp_path / "report" / "report.html").read_text()
        assert 'id="outages"' in html and "llm was unavailable" in html
    finally:
        for server in servers:
            server.__exit__(None, None, None)


@pytest.mark.slow
def test_a_model_only_night_waits_for_its_model_then_says_why_it_stopped(repo, monkeypatch, quick_backoff):
    from autoloop.config import resolve
    from autoloop.proposers.seeding import seed_idea

    monkeypatch.setenv("AUTOLOOP_LLM_OUTAGE_WAIT", "3")
    seed_idea(resolve(repo, {}), repo, "try SwiGLU in the MLP", sets=[], patch=None)
    with FakeOpenAI([edit_answer(LR_LINE, "LR = 0.01")]) as server:
        stop_after_listing(server)
        began = time.monotonic()
        result = run_cli(repo, "--proposers", "llm", "--llm-base-url", server.base_url, "--max-trials", "5")
        waited = time.monotonic() - began
    assert result.exit_code == 0, result.output
    out = squeeze(result.output)
    assert "nothing else to propose: waiting" in out
    assert re.search(rf"stopped: no more proposals: the model fake-model at {re.escape(server.base_url)} was "
                     r"unreachable since \d\d:\d\d UTC: APIConnectionError", out), out
    assert "idea queue is empty" not in out
    assert waited >= 3  # it waited for the model (llm-outage-wait) instead of ending at the first failure
    with Store(repo / "experiments.db") as store:
        failed = [r for r in store.db.query("SELECT error FROM proposals") if r["error"]]
        assert len(failed) >= 3  # tried again with back-off, not once
        assert [i["text"] for i in store.ideas(status="pending")] == ["try SwiGLU in the MLP"]
    assert len(trials(repo)) == 1  # the baseline only
    status = squeeze(runner.invoke(app, ["status", "--repo", str(repo)]).output)
    assert "proposer: llm unavailable since" in status and "APIConnectionError" in status
    from autoloop.serve.queries import summary

    with Store(repo / "experiments.db") as store:
        (line,) = summary(store, store.get_run("t"))["outages"]  # the live page's banner
    assert line.startswith("llm unavailable since") and "APIConnectionError" in line


def test_check_parts_model_tries_the_endpoint_before_bed(repo, monkeypatch):
    monkeypatch.setenv("AUTOLOOP_LLM_MODEL", "fake-model")
    with FakeOpenAI([edit_answer(LR_LINE, "LR = 0.01")]) as server:
        monkeypatch.setenv("AUTOLOOP_LLM_BASE_URL", server.base_url)
        result = runner.invoke(app, ["check", "--repo", str(repo), "--parts", "model"])
        assert result.exit_code == 0 and server.listings == 1 and server.requests == [], result.output
    assert squeeze(result.output) == f"llm: the model fake-model at {server.base_url} answers"
    url = f"http://127.0.0.1:{closed_port()}/v1"
    monkeypatch.setenv("AUTOLOOP_LLM_BASE_URL", url)
    result = runner.invoke(app, ["check", "--repo", str(repo), "--parts", "model"])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"the model fake-model at {url} cannot be reached (APIConnectionError" in result.output
    monkeypatch.delenv("AUTOLOOP_LLM_MODEL")
    result = runner.invoke(app, ["check", "--repo", str(repo), "--parts", "model"])
    assert result.exit_code == 1 and "no model or agent is configured" in result.output
    assert not (repo / "experiments.db").exists()


def test_the_wait_for_a_model_ends_at_the_runs_deadline_and_names_the_outage(repo):
    """--hours bounds the wait: it ends when the next trial could no longer finish in time
    (no trials yet: a trial is estimated at the budget + 30 s = 35 s), long before the model's
    next try, and the stop reason says what the night was waiting for."""
    from autoloop.config import resolve
    from autoloop.loop.controller import Controller
    from autoloop.loop.run import Loop
    from autoloop.loop.scheduler import Work, WorkItem

    c = Controller(resolve(repo, {"tag": "t", "time_budget": 5, "hours": 0.02, "proposers": "search"}), repo,
                   verifier=None)
    c.open()
    try:
        now = time.time()
        item = WorkItem(Work.WAIT, reason="the model m at u was unreachable since 02:14 UTC: APIConnectionError",
                        wait_until=now + 120)
        reason = Loop(c, [], threaded=False).wait_for_model(item, started=now - 0.02 * 3600 + 40, trials_run=0)
        waited = time.time() - now
    finally:
        c.close()
    assert re.fullmatch(r"--hours 0\.02: the next trial could not finish in the 0\.\d min left; meanwhile "
                        r"the model m at u was unreachable since 02:14 UTC: APIConnectionError", reason), reason
    assert 3 <= waited <= 20  # 40 s left, 35 s needed: about 5 s, not the 120 s until the next try


@pytest.mark.slow
def test_autoloop_stop_ends_a_model_only_nights_wait(repo, quick_backoff, monkeypatch):
    monkeypatch.setenv("AUTOLOOP_LLM_OUTAGE_WAIT", "120")  # a wait the stop must cut short

    def stop_when_it_waits():
        # the second failure: the first came while the baseline trained, this one while the loop waits
        while sum(e["kind"] == "proposer_unavailable" for e in read_events(repo / "experiments.db")) < 2:
            time.sleep(0.05)
        with Store(repo / "experiments.db") as store:
            store.request_stop("t")

    with FakeOpenAI([edit_answer(LR_LINE, "LR = 0.01")]) as server:
        stop_after_listing(server)
        threading.Thread(target=stop_when_it_waits, daemon=True).start()
        began = time.monotonic()
        result = run_cli(repo, "--proposers", "llm", "--llm-base-url", server.base_url)
    assert result.exit_code == 0, result.output
    assert time.monotonic() - began < 100
    assert re.search(r"stopped: stopped by `autoloop stop`; meanwhile the model fake-model at \S+ was unreachable "
                     r"since \d\d:\d\d UTC: APIConnectionError", squeeze(result.output)), result.output


def read_events(db: Path) -> list[dict]:
    import sqlite3

    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as con:
            return [{"kind": k} for (k,) in con.execute("SELECT kind FROM events ORDER BY id")]
    except sqlite3.Error:
        return []


@pytest.mark.slow
def test_the_live_page_shows_an_ongoing_outage_as_text_and_drops_it_when_the_model_is_back(tmp_path):
    from browser_support import Browser, chromium
    from serve_support import NightWriter, Server

    if chromium() is None:
        pytest.skip("no chromium installed (.ci/run installs Debian's chromium)")
    pytest.importorskip("websockets")
    pytest.importorskip("uvicorn")
    night = NightWriter(make_repo(tmp_path / "repo", FAKE_TRAIN.read_text()), "live")
    try:
        night.night(3)
        # what a model's error may say is the model's text: shown as text, never as markup
        night.event("proposer_unavailable", "llm: the model m at http://h/v1 failed (<img src=x onerror=alert(1)>)")
        with Server(night.repo) as server, Browser(server.link) as browser:
            browser.navigate(server.base + "/#/r/live")
            browser.wait_for("document.querySelector('#run-head .outage') !== null", 20)
            text = browser.evaluate("document.querySelector('#run-head .outage').textContent")
            assert text.startswith("Unavailable: llm unavailable since ") and "<img src=x onerror=alert(1)>" in text
            assert browser.evaluate("document.querySelectorAll('#run-head img').length") == 0
            night.event("proposer_back", "llm: the model m at http://h/v1 answers again after 1 failed request")
            night.trial("a proposal once the model was back", "discard", night.best["metric"] + 0.01)
            browser.wait_for("document.querySelector('#run-head .outage') === null", 20)
            assert browser.evaluate("document.body.dataset.jsErrors || '0'") == "0"
    finally:
        night.close()


def test_a_night_the_model_ended_is_finished_whatever_words_its_server_sent(repo, monkeypatch, quick_backoff):
    """Whether the user stopped the night is a flag, not a word in the stop reason: the reason
    quotes the model server's error, and a server that says "stop" did not stop the night
    (a stopped night would not measure its reserve or its ladder either)."""
    from autoloop.config import resolve
    from autoloop.proposers.seeding import seed_idea

    monkeypatch.setenv("AUTOLOOP_LLM_OUTAGE_WAIT", "2")
    seed_idea(resolve(repo, {}), repo, "try SwiGLU in the MLP", sets=[], patch=None)
    words = "upstream stopped: run `autoloop stop` and press Ctrl-C"
    with FakeOpenAI([Error(503, words)] * 50) as server:
        result = run_cli(repo, "--proposers", "llm", "--llm-base-url", server.base_url)
    assert result.exit_code == 0, result.output
    out = squeeze(result.output)
    assert "stopped: no more proposals:" in out and "upstream stopped" in out, out
    with Store(repo / "experiments.db") as store:
        assert store.get_run("t")["status"] == "finished"


def test_a_model_that_only_repeats_itself_ends_the_night_instead_of_asking_forever(repo):
    """A model whose every answer cannot be tried (here: the same edit again and again, which
    no longer applies once kept) costs no training but three model calls a trial (the
    answer and two repairs). On the real CPU night's bench a scripted model that ran out of
    new answers asked 3,400 times in ten minutes; a real one would spend its quota all
    night. After UNTRIED_IN_A_ROW such proposals the night stops and says why."""
    from autoloop.loop.scheduler import UNTRIED_IN_A_ROW

    with FakeOpenAI([edit_answer(LR_LINE, "LR = 0.01", "lower lr")]) as server:
        result = run_cli(repo, "--proposers", "llm", "--llm-base-url", server.base_url, "--max-trials", "60")
    assert result.exit_code == 0, result.output
    out = squeeze(result.output)
    assert f"stopped: no more proposals: the last {UNTRIED_IN_A_ROW} proposals could not be tried" in out, out
    assert "seed ideas with `autoloop seed`" in out
    rows = trials(repo)
    assert [r["status"] for r in rows[:2]] == ["keep", "keep"]  # the baseline, then LR 0.01
    assert len(rows) == 2 + UNTRIED_IN_A_ROW and all(r["status"] == "invalid" for r in rows[2:])
    assert len(server.requests) <= 1 + 3 * UNTRIED_IN_A_ROW
