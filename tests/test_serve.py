"""`autoloop serve`: the real server in a subprocess on a free port, a real HTTP client,
and a real experiments.db that a writer using the real Store adds trials to while the
tests run (tests/serve_support.py). The slow test drives headless Chromium over the
DevTools protocol (tests/browser_support.py) and saves screenshots of the run page and
the tree into its output folder."""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import re
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import FAKE_TRAIN, bench_module, make_repo
from typer.testing import CliRunner

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("sse_starlette")

from autoloop.trust import untrusted as files  # noqa: E402
from autoloop.review.tree import layout, svg, tree_rows  # noqa: E402
from serve_support import NightWriter, Server, request  # noqa: E402

SCRIPT = "<script>alert(1)</script>"
ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "autoloop" / "serve" / "static"


@pytest.fixture(scope="module")
def night(tmp_path_factory):
    """A real repo and a run with a baseline, a dozen trials, a pending idea and a running
    trial, written through the real Store; the tests add more as they go."""
    repo = make_repo(tmp_path_factory.mktemp("serve") / "repo", FAKE_TRAIN.read_text())
    writer = NightWriter(repo, "live", config={"llm_api_key_env": "SERVE_TEST_KEY",
                                               "agent_command": "agent --api-key agent-secret-123"})
    writer.night(12, keep_every=4)
    writer.store.add_idea("try a longer warmup", sets={"LR": "0.01"}, source="human")
    writer.start("training right now", worker="gpu0", steps=50)
    yield writer
    writer.close()


@pytest.fixture(scope="module")
def server(night):
    with Server(night.repo, env={"SERVE_TEST_KEY": "sk-very-secret-value"}) as srv:
        yield srv


def db_rows(repo: Path, sql: str, params=()) -> list[dict]:
    conn = sqlite3.connect(repo / "experiments.db")
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(sql, params).fetchall()]
    finally:
        conn.close()


class Stream:
    """The page's server-sent events, read from a plain socket on a thread (no client-side
    buffering to wait behind): (arrival time, data) in a queue."""

    def __init__(self, server: Server, tag: str):
        self.events: queue.Queue = queue.Queue()
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        self.sock.sendall(f"GET /api/stream?run={tag} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                          "Accept: text/event-stream\r\n\r\n".encode())
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        buffer = b""
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    text = line.decode(errors="replace").strip()
                    if text.startswith("data:"):
                        self.events.put((time.monotonic(), json.loads(text[5:])))
        except Exception:  # noqa: BLE001 - closed by the test
            pass

    def next(self, timeout: float):
        return self.events.get(timeout=timeout)

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _wait(predicate, seconds: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"not within {seconds} s")


# ---------------------------------------------------------------------------- freshness


def test_a_new_trial_shows_on_the_data_endpoints_within_two_seconds(night, server):
    stream = Stream(server, "live")
    try:
        stream.next(10)  # the stream says where things stand when it opens
        written = time.monotonic()
        trial = night.trial("a fresh idea for the page", "discard", night.best["metric"] + 0.01)
        arrived, change = stream.next(2.0)  # the push: within 2 s of the write
        assert arrived - written < 2.0 and change["db"] is not None

        def shown():
            status, _, page = server.get("/api/runs/live/trials?limit=5")
            return status == 200 and page["rows"][0]["number"] == trial["number"]

        _wait(shown, 2.0 - (time.monotonic() - written))
        assert time.monotonic() - written < 2.0
    finally:
        stream.close()
    _, _, progress = server.get("/api/runs/live/progress")
    assert progress["number"][-1] == trial["number"]
    _, _, summary = server.get("/api/runs/live/summary")
    assert summary["headline"]["trials"] == db_rows(night.repo, "SELECT COUNT(*) AS n FROM trials")[0]["n"]
    _, _, tree = server.get("/api/runs/live/tree")
    assert trial["number"] in {n["number"] for n in tree["nodes"]}


def test_the_run_page_comes_in_one_request_that_leaves_out_what_the_page_has(night, server):
    """The run page's views in one reply, each with a fingerprint; a view the page already
    has (`have=name:fingerprint`) comes without its data until it changes, and each view's
    data is what its own endpoint answers."""
    status, _, first = server.get("/api/runs/live/page?offset=0&limit=5")
    assert status == 200
    parts = first["parts"]
    assert set(parts) == {"summary", "progress", "trials", "live", "events", "ideas", "runs"}
    for name in ("summary", "progress", "live", "events", "ideas"):
        assert parts[name]["data"] == server.get(f"/api/runs/live/{name}")[2], name
    assert parts["trials"]["data"] == server.get("/api/runs/live/trials?offset=0&limit=5")[2]
    assert parts["runs"]["data"] == server.get("/api/runs")[2]["runs"]
    have = ",".join(f"{name}:{part['hash']}" for name, part in parts.items())
    _, _, again = server.get(f"/api/runs/live/page?offset=0&limit=5&have={have}")
    assert {name: "data" in part for name, part in again["parts"].items()} == dict.fromkeys(parts, False)
    assert {name: part["hash"] for name, part in again["parts"].items()} == {n: p["hash"] for n, p in parts.items()}
    trial = night.trial("one more for the bundle", "discard", night.best["metric"] + 0.02)

    def changed():
        _, _, reply = server.get(f"/api/runs/live/page?offset=0&limit=5&have={have}")
        return reply if "data" in reply["parts"]["trials"] else None

    _wait(changed, 2.0)
    reply = changed()
    assert reply["parts"]["trials"]["data"]["rows"][0]["number"] == trial["number"]
    assert reply["parts"]["progress"]["data"]["number"][-1] == trial["number"]
    assert "data" not in reply["parts"]["ideas"]  # the queue did not change
    _, _, only = server.get("/api/runs/live/page?parts=live,ideas")
    assert set(only["parts"]) == {"live", "ideas"}


def test_the_run_page_names_a_part_it_does_not_know_and_a_run_that_is_not_there(server):
    status, _, reply = server.get("/api/runs/live/page?parts=summary,secrets")
    assert status == 400 and reply["error"].startswith("unknown part 'secrets': the parts are summary, progress")
    status, _, reply = server.get("/api/runs/nope/page")
    assert status == 404 and "no run tagged 'nope'" in reply["error"]
    status, _, reply = server.get("/api/runs/live/page?offset=x")
    assert status == 200 and reply["parts"]["trials"]["error"] == "offset and limit must be whole numbers"


def test_nice_lowers_the_servers_cpu_priority_below_the_runs(night, server):
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, server.process.pid) == mine  # by default, as the run's
    with Server(night.repo, "--nice", "7") as guest:
        assert os.getpriority(os.PRIO_PROCESS, guest.process.pid) == min(19, mine + 7)
        assert guest.get("/api/runs/live/summary")[0] == 200


def test_the_running_trial_shows_its_live_curve_beside_the_incumbent_at_the_same_seed(night, server):
    running = night.start("watch me train", worker="gpu1", steps=30)
    try:
        def curve_of():
            _, _, live = server.get("/api/runs/live/live")
            return next((r for r in live["running"] if r["number"] == running["number"]), None)

        _wait(lambda: (curve_of() or {}).get("step") == 30, 3.0)
        night.progress(running, 80)
        _wait(lambda: (curve_of() or {}).get("step") == 80, 2.0)  # a progress line alone is a change
        entry = curve_of()
        assert entry["worker"] == "gpu1" and entry["seed"] == night.seed
        assert entry["curve"][-1] == [80, pytest.approx(night.loss(80), abs=1e-4)]
        assert entry["seconds_left"] == pytest.approx(night.time_budget * (1 - 80 / 200))
        reference = entry["reference"]
        assert reference["trial"] == night.best["number"] and reference["seed"] == night.seed
        assert reference["source"] == "progress" and reference["points"][-1][0] == 200
    finally:
        night.finish(running, "discard", night.best["metric"] + 0.02)


def test_every_run_of_the_db_is_served(night, server):
    other = NightWriter(night.repo, "second", git_repo=True)
    try:
        other.baseline(2.0)
        _wait(lambda: "second" in [r["tag"] for r in server.get("/api/runs")[2]["runs"]], 2.0)
        status, _, summary = server.get("/api/runs/second/summary")
        assert status == 200 and summary["best"]["baseline_metric"] == 2.0
        status, _, body = server.get("/api/runs/nope/summary")
        assert status == 404 and "no run tagged 'nope'" in body["error"] and "second" in body["error"]
    finally:
        other.close()


def test_the_trial_page_is_what_show_shows(night, server):
    from autoloop.review.queries import trial_detail
    from autoloop.review.text import format_trial

    number = night.best["number"]
    status, _, page = server.get(f"/api/runs/live/trials/{number}")
    assert status == 200
    detail = trial_detail(night.store, night.store.get_run("live"), number, night.repo)
    expected = format_trial({**detail, "log_tail": None, "log_path": None, "error_tail": None}, with_diff=False)
    assert page["text"] == expected
    assert page["diff"] == detail["diff"] and page["log_tail"] == detail["log_tail"]
    assert page["curve"] and page["curve"][-1][0] == 200
    status, _, body = server.get("/api/runs/live/trials/99999")
    assert status == 404 and "has no trial 99999" in body["error"]


def test_the_trial_table_says_adopted_confirmed_and_stopped_early_as_log_does(night, server):
    """Issue 19's tiers and early stops on the page: the table's rows and the trial page carry
    the tier of a keep and the progress at which a clear loser stopped."""
    adopted = night.trial("adopted on its paired mean", "keep", night.best["metric"] - 0.003, runs=2)
    confirmed = night.trial("confirmed by the sequential test", "keep", night.best["metric"] - 0.02, runs=3,
                            confirmed=True)
    stopped = night.trial("a clear loser", "discard", None, reason="discard: clearly worse at 40% of the budget")
    night.store.update_trial(stopped["id"], stopped_at=0.4)
    _, _, page = server.get("/api/runs/live/trials?limit=5")
    rows = {r["number"]: r for r in page["rows"]}
    assert (rows[adopted["number"]]["tier"], rows[confirmed["number"]]["tier"]) == ("adopted", "confirmed")
    assert rows[stopped["number"]]["stopped_at"] == 0.4 and rows[stopped["number"]]["tier"] is None
    _, _, one = server.get(f"/api/runs/live/trials/{confirmed['number']}")
    assert one["tier"] == "confirmed" and one["stopped_at"] is None
    _, _, one = server.get(f"/api/runs/live/trials/{stopped['number']}")
    assert one["stopped_at"] == 0.4


# ---------------------------------------------------------------------------- steering


def test_seeding_from_the_page_puts_the_idea_in_the_db(night, server):
    status, _, reply = server.post("/api/seed", {"description": "lower the lr from the page", "sets": ["LR=0.015"],
                                                 "priority": 3})
    assert status == 200, reply
    idea = db_rows(night.repo, "SELECT * FROM ideas WHERE id = ?", (reply["id"],))[0]
    assert reply["message"] == f"seeded idea {idea['id']}: lower the lr from the page"
    assert idea["text"] == "lower the lr from the page" and json.loads(idea["sets"]) == {"LR": "0.015"}
    assert idea["priority"] == 3 and idea["status"] == "pending" and idea["source"] == "human" and idea["run_id"] is None
    # A patch, as text: checked and stored as `autoloop seed --patch` stores it.
    train = night.repo / "train.py"
    original = train.read_text()
    train.write_text(original.replace("LR = 0.02  #", "LR = 0.021  #", 1))
    try:
        patch = subprocess.run(["git", "diff"], cwd=night.repo, check=True, capture_output=True, text=True).stdout
    finally:
        train.write_text(original)
    assert "+LR = 0.021" in patch
    status, _, reply = server.post("/api/seed", {"description": "a comment", "patch": patch, "tag": "live"})
    assert status == 200, reply
    stored = db_rows(night.repo, "SELECT * FROM ideas WHERE id = ?", (reply["id"],))[0]
    assert stored["patch"] == patch and stored["run_id"] == night.run["id"]


@pytest.mark.parametrize("pair", ["NOPE=1", "LR=abc", "LR", "LR='fast'"])
def test_a_bad_set_gets_the_same_one_line_error_as_the_cli(night, server, pair):
    from autoloop.cli import app

    status, _, reply = server.post("/api/seed", {"description": "bad idea", "sets": [pair]})
    result = CliRunner().invoke(app, ["seed", "bad idea", "--set", pair, "--repo", str(night.repo)])
    assert status == 400 and result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [f"error: {reply['error']}"] and "\n" not in reply["error"]


def test_a_bad_patch_gets_the_cli_error_without_the_temporary_path(night, server):
    status, _, reply = server.post("/api/seed", {"description": "junk", "patch": "this is not a diff\n"})
    assert status == 400 and reply["error"].startswith("the patch is not a usable diff")
    assert "/tmp" not in reply["error"] and "autoloop-seed-" not in reply["error"]


def test_stop_from_the_page_asks_the_run_to_stop(night, server):
    status, _, reply = server.post("/api/runs/live/stop", {})
    try:
        assert status == 200 and reply["message"] == "asked run 'live' to stop after its current trial"
        assert db_rows(night.repo, "SELECT stop_requested FROM runs WHERE tag = 'live'")[0]["stop_requested"] == 1
        status, _, reply = server.post("/api/runs/nope/stop", {})
        assert status == 404 and "no run tagged 'nope'" in reply["error"]
    finally:
        night.store.update_run(night.run["id"], stop_requested=0)


def test_writes_need_the_token_and_refuse_cross_site_requests(night, server):
    before = db_rows(night.repo, "SELECT COUNT(*) AS n FROM ideas")[0]["n"]
    idea = {"description": "sneaky", "sets": ["LR=0.025"]}
    assert server.post("/api/seed", idea, token=False)[0] == 403  # no token
    assert server.post("/api/seed", idea, token=False, headers={"X-Autoloop-Token": "wrong"})[0] == 403
    # The cookie the token link sets.
    status, head, _ = server.get(f"/?token={server.token}")
    assert status == 303 and head["location"] == "/"
    cookie = head["set-cookie"].split(";")[0]
    assert "HttpOnly" in head["set-cookie"] and "SameSite=strict" in head["set-cookie"].replace("Strict", "strict")
    # With the cookie alone (a cross-site form would send no header): refused.
    assert server.post("/api/seed", idea, token=False, headers={"Cookie": cookie})[0] == 403
    # With the cookie and the page's header, but from another origin: refused.
    assert server.post("/api/seed", idea, token=False, headers={
        "Cookie": cookie, "X-Autoloop-Request": "1", "Origin": "http://evil.example"})[0] == 403
    # Not JSON (what an HTML form can send): refused.
    status, _, _ = request(server.base + "/api/seed", method="POST", body=b"description=x",
                           headers={"Content-Type": "application/x-www-form-urlencoded", "X-Autoloop-Token": server.token})
    assert status == 415
    # Too big: refused on its Content-Length, before a byte of the body is read.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
        raw.sendall(f"POST /api/seed HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
                    f"X-Autoloop-Token: {server.token}\r\nContent-Length: 50000000\r\n\r\n".encode())
        answer = b""
        while b"}" not in answer:
            chunk = raw.recv(4096)
            if not chunk:
                break
            answer += chunk
        answer = answer.decode()
    assert answer.startswith("HTTP/1.1 413") and "at most" in answer
    assert db_rows(night.repo, "SELECT COUNT(*) AS n FROM ideas")[0]["n"] == before
    # The page's own way: the cookie, the header, its own origin.
    status, _, reply = server.post("/api/seed", idea, token=False, headers={
        "Cookie": cookie, "X-Autoloop-Request": "1", "Origin": server.base})
    assert status == 200, reply
    assert server.get("/api/session", headers={"Cookie": cookie})[2]["can_write"] is True
    assert server.get("/api/session")[2]["can_write"] is False


def test_a_page_under_another_host_name_is_refused(server):
    """DNS rebinding: evil.example resolving to 127.0.0.1 must not read the page."""
    status, _, body = server.get("/api/runs", headers={"Host": "evil.example"})
    assert status == 421 and "127.0.0.1" in body["error"]
    assert server.get("/api/runs", headers={"Host": f"localhost:{server.port}"})[0] == 200


def test_with_host_every_request_needs_the_token(night):
    with Server(night.repo, "--host", "0.0.0.0") as public:
        printed = "".join(public.output)
        assert "every request needs the token" in printed and public.token in printed
        for path in ("/", "/api/runs", "/api/runs/live/summary", "/static/app.js", "/api/stream?run=live"):
            status, _, _ = public.get(path)
            assert status == 401, path
            assert public.get(path, headers={"X-Autoloop-Token": "not-it"})[0] == 401, path
        assert public.get("/api/runs", headers={"X-Autoloop-Token": public.token})[0] == 200
        status, head, _ = public.get(f"/?token={public.token}")
        assert status == 303
        cookie = head["set-cookie"].split(";")[0]
        assert public.get("/api/runs/live/summary", headers={"Cookie": cookie})[0] == 200
        status, _, html = public.get("/", headers={"Cookie": cookie})
        assert status == 200 and "<title>autoloop</title>" in html


def test_a_port_in_use_is_one_line(night, server):
    from autoloop.cli import app

    result = CliRunner().invoke(app, ["serve", "--repo", str(night.repo), "--port", str(server.port)])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and f"port {server.port}" in lines[-1] and "--port" in lines[-1]


# ---------------------------------------------------------------------------- untrusted text, secrets


def test_a_script_in_a_description_is_served_as_data_and_the_page_has_no_html_sinks(night, server):
    trial = night.trial(SCRIPT, "discard", night.best["metric"] + 0.01, reason='<img src=x onerror="alert(2)">')
    _wait(lambda: server.get("/api/runs/live/trials?limit=1")[2]["rows"][0]["number"] == trial["number"], 2.0)
    status, head, page = server.get("/api/runs/live/trials?limit=1")
    assert page["rows"][0]["description"] == SCRIPT and head["content-type"].startswith("application/json")
    assert head["x-content-type-options"] == "nosniff"
    status, head, html = server.get("/")
    csp = head["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "require-trusted-types-for 'script'" in csp
    assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
    assert "<script>" not in html.replace('<script src="/static/vendor/uPlot.iife.min.js" defer></script>', "") \
        .replace('<script src="/static/app.js" defer></script>', "")
    code = "\n".join(line for line in (STATIC / "app.js").read_text().splitlines() if not line.strip().startswith("//"))
    vendored = (STATIC / "vendor" / "uPlot.iife.min.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in code and sink not in vendored, sink
    drawn = svg(layout(tree_rows(night.store, night.run)))
    assert SCRIPT not in drawn and "&lt;script&gt;alert(1)&lt;/script&gt;" in drawn


def test_no_secret_is_served(night, server):
    """The run's config names the key's variable (served) and an agent command holding a
    key (not served); the server's environment holds the key itself (never served)."""
    bodies = []
    for path in ("/api/session", "/api/runs", "/api/runs/live/summary", "/api/runs/live/progress",
                 "/api/runs/live/trials?limit=200", "/api/runs/live/live", "/api/runs/live/events",
                 "/api/runs/live/ideas", "/api/runs/live/tree", f"/api/runs/live/trials/{night.best['number']}"):
        status, _, body = server.get(path)
        assert status == 200, path
        bodies.append(json.dumps(body))
    everything = "\n".join(bodies)
    assert "sk-very-secret-value" not in everything and "agent-secret-123" not in everything
    summary = json.loads(bodies[2])
    assert summary["config"]["llm_api_key_env"] == "SERVE_TEST_KEY" and "agent_command" not in summary["config"]
    assert server.get("/static/../../../etc/passwd")[0] == 404


def test_a_progress_file_that_is_a_link_or_a_fifo_is_not_read(night, server, tmp_path):
    secret = tmp_path / "secret.jsonl"
    secret.write_text(json.dumps({"step": 999, "loss": 0.123}) + "\n")
    linked = night.start("links its progress file", worker="gpu2")
    fifo = night.start("makes its progress file a fifo", worker="gpu3")
    try:
        Path(linked["log_path"]).with_name("progress.jsonl").symlink_to(secret)
        os.mkfifo(Path(fifo["log_path"]).with_name("progress.jsonl"))
        start = time.monotonic()
        status, _, live = server.get("/api/runs/live/live", timeout=5)
        assert status == 200 and time.monotonic() - start < 3  # a fifo never blocks the reader
        shown = {r["number"]: r for r in live["running"]}
        assert shown[linked["number"]]["step"] is None and shown[linked["number"]]["curve"] == []
        assert shown[fifo["number"]]["step"] is None
        assert server.get(f"/api/runs/live/trials/{fifo['number']}", timeout=5)[0] == 200
    finally:
        night.finish(linked, "crash", None)
        night.finish(fifo, "crash", None)


# ---------------------------------------------------------------------------- the parts, with known answers


def test_read_tail_refuses_links_and_special_files_and_caps_the_read(tmp_path):
    regular = tmp_path / "progress.jsonl"
    regular.write_text("".join(json.dumps({"step": i, "loss": 1.0 + i}) + "\n" for i in range(1000)))
    assert files.tail_text(regular, 100).count("\n") <= 3
    assert files.progress_records(regular)[-1] == {"step": 999, "loss": 1000.0}
    link = tmp_path / "link.jsonl"
    link.symlink_to(regular)
    assert files.tail_text(link) is None
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    assert files.tail_text(fifo) is None
    assert files.tail_text(tmp_path) is None and files.tail_text(tmp_path / "missing") is None
    odd = tmp_path / "odd.jsonl"
    odd.write_bytes(b'{"step": 1, "loss": 2.5, "evil": "<script>"}\n\xff\xfe garbage\n[1, 2]\n{"step": "x", "loss": NaN}\n'
                    + b'{"step": 3, "loss": 1e999}\n' + b'{"step": 4, "loss": ' + b"1" * 5000 + b"}\n")
    assert files.progress_records(odd) == [{"step": 1, "loss": 2.5}, {"step": 3}]


def test_the_tree_puts_every_trial_under_the_commit_it_was_proposed_from():
    def row(n, status, parent, commit, kind="proposal", lineage="main"):
        return {"number": n, "kind": kind, "status": status, "lineage": lineage, "parent_commit": parent,
                "trial_commit": commit, "metric": 1.0, "metric_sd": None, "n_runs": 1, "delta": None,
                "description": f"t{n}"}

    rows = [row(1, "keep", "base", "base", kind="baseline"), row(2, "discard", "base", "c2"), row(3, "keep", "base", "c3"),
            row(4, "crash", "c3", "c4"), row(5, "drift", "c3", "c3", kind="drift"), row(6, "keep", "c3", "c6"),
            row(7, "running", "c6", "c7")]
    rows[4]["status"] = "discard"
    tree = layout(rows)
    nodes = {n["number"]: n for n in tree["nodes"] if not n["ghost"]}
    keeps = [n for n in nodes.values() if n["keep"]]
    assert [n["number"] for n in keeps] == [1, 3, 6]
    assert len({n["y"] for n in keeps}) == 1 and nodes[1]["x"] < nodes[3]["x"] < nodes[6]["x"]  # the trunk
    # Leaves hang under their parent commit's column, below it.
    for leaf, parent in ((2, 1), (4, 3), (5, 3), (7, 6)):
        assert abs(nodes[leaf]["x"] - nodes[parent]["x"]) < 20 and nodes[leaf]["y"] > nodes[parent]["y"]
    trunk = [(e["x1"], e["x2"]) for e in tree["edges"] if e["kind"] == "trunk"]
    assert trunk == [(nodes[1]["x"], nodes[3]["x"]), (nodes[3]["x"], nodes[6]["x"])]
    assert tree["keeps"] == 2 and tree["trials"] == 7 and not tree["more"]
    # Islands are lanes: w1's trials start from the baseline, under its ghost in w1's lane.
    islands = rows[:1] + [row(2, "keep", "base", "a2", lineage="w0"), row(3, "keep", "base", "b3", lineage="w1"),
                          row(4, "discard", "b3", "b4", lineage="w1"), row(5, "discard", "base", "b5", lineage="w1")]
    tree = layout(islands)
    lanes = {lane["name"]: lane["y"] for lane in tree["lanes"]}
    assert list(lanes) == ["main", "w0", "w1"]
    nodes = {(n["number"], n["ghost"]): n for n in tree["nodes"]}
    assert nodes[(2, False)]["y"] == lanes["w0"] and nodes[(3, False)]["y"] == lanes["w1"]
    ghost = nodes[(1, True)]
    assert ghost["y"] == lanes["w1"] and ghost["x"] == nodes[(1, False)]["x"]
    assert nodes[(5, False)]["x"] == pytest.approx(ghost["x"], abs=12) and nodes[(5, False)]["y"] > lanes["w1"]
    # At 10,000 trials: capped leaves and a "+N" marker per commit.
    many = rows[:1] + [row(n, "discard", "base", f"d{n}") for n in range(2, 10_002)]
    tree = layout(many)
    assert len(tree["nodes"]) == 1 + tree["leaf_cap"]
    assert tree["more"] == [{"x": tree["more"][0]["x"], "y": tree["more"][0]["y"], "count": 10_000 - tree["leaf_cap"],
                             "parent": "base", "trial": 1, "lane": "main"}]
    shown = sorted(n["number"] for n in tree["nodes"] if not n["keep"])
    assert shown == list(range(10_002 - tree["leaf_cap"], 10_002))  # the newest


def test_the_report_draws_the_same_tree(night, tmp_path):
    pytest.importorskip("matplotlib")
    from autoloop.review.report import build_report

    night.trial(SCRIPT, "keep", night.best["metric"] - 0.001)  # a kept one: its label is drawn too
    report = build_report(night.store, night.store.get_run("live"), tmp_path / "report")
    page = report.html_path.read_text()
    assert "<h2>Experiment tree</h2>" in page and '<svg class="tree"' in page
    tree = report.data["tree"]
    assert svg(tree) in page
    for n in tree["nodes"]:
        if n["keep"]:
            assert f'data-trial="{n["number"]}" data-status="keep"' in page
    assert SCRIPT not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_the_reader_never_holds_the_writer(night):
    """A read-only connection reads while the writer holds its write lock, sees the commit
    through data_version, and cannot write."""
    from autoloop.errors import AutoloopError
    from autoloop.serve.readonly import ReadOnlyStore

    reader = ReadOnlyStore(night.repo / "experiments.db")
    try:
        version = reader.data_version()
        with night.store.transaction():
            night.store.add_event(night.run["id"], "note", "inside a write transaction")
            assert reader.get_run("live")["tag"] == "live"  # WAL: the reader is not blocked
        assert reader.data_version() != version
        with pytest.raises(AutoloopError, match="read-only"):
            reader.add_event(night.run["id"], "note", "from the reader")
        with pytest.raises(sqlite3.OperationalError):
            reader.conn.execute("DELETE FROM events")
    finally:
        reader.close()


def test_the_vendored_chart_library_is_the_release_file_with_its_license():
    vendor = STATIC / "vendor"
    readme = (vendor / "README.md").read_text()
    for name in ("uPlot.iife.min.js", "uPlot.min.css"):
        digest = hashlib.sha256((vendor / name).read_bytes()).hexdigest()
        assert re.search(rf"\| {re.escape(name)} \| {digest} \|", readme), name
    assert "MIT" in (vendor / "uPlot.LICENSE.txt").read_text()
    assert "http" not in (STATIC / "index.html").read_text().replace("http-equiv", "")  # no CDN


# ---------------------------------------------------------------------------- a real browser


@pytest.mark.slow
def test_a_browser_shows_new_trials_without_a_reload(night, server, tmp_path):
    from browser_support import Browser, chromium

    if chromium() is None:
        pytest.skip("no chromium installed (.ci/run installs Debian's chromium)")
    pytest.importorskip("websockets")
    out = Path(os.environ.get("AUTOLOOP_SCREENSHOTS") or tmp_path)
    with Browser(server.link) as browser:  # the token link: its cookie lets this browser steer
        browser.wait_for("document.querySelector('#trials-table tr[data-trial]') !== null", 20)
        browser.navigate(server.base + "/#/r/live")  # the newest run is shown first; other tests may add one
        browser.wait_for("document.querySelector('#run-head .tag') !== null && "
                         "document.querySelector('#run-head .tag').textContent === 'live'", 10)
        browser.wait_for("document.querySelector('#live .card') !== null && document.querySelector('#stats .stat') !== null", 10)
        browser.evaluate("window.__sameDocument = 'yes'")
        # Dollars spent (no priced model, no gpu-hour-price here) as the report's card says them.
        spent = browser.evaluate("[...document.querySelectorAll('#stats .stat')].filter(s => "
                                 "s.querySelector('.label').textContent === 'spent').map(s => s.textContent)")
        assert spent == ["spent$0.00$0.00 model tokens; $0.00 GPU time (no gpu-hour-price set); $0.00 per bpb gained"], spent
        assert browser.evaluate("document.querySelector('#seed-form') !== null")  # the token link's cookie: may steer
        written = time.monotonic()
        trial = night.trial(SCRIPT + " in a browser", "discard", night.best["metric"] + 0.01)
        seconds = browser.wait_for(f"document.querySelector('#trials-table tr[data-trial=\"{trial['number']}\"]') !== null", 10)
        print(f"the new trial showed {time.monotonic() - written:.2f} s after it was written ({seconds:.2f} s of waiting)")
        assert time.monotonic() - written < 4.0
        assert browser.evaluate("window.__sameDocument") == "yes"  # no reload
        row_text = browser.evaluate(f"document.querySelector('tr[data-trial=\"{trial['number']}\"] .description').textContent")
        assert row_text == SCRIPT + " in a browser"
        # A confirmed keep and an early stop are marked as `autoloop log` marks them.
        confirmed = night.trial("confirmed in a browser", "keep", night.best["metric"] - 0.01, runs=3, confirmed=True)
        stopped = night.trial("stopped in a browser", "discard", None, reason="discard: clearly worse")
        night.store.update_trial(stopped["id"], stopped_at=0.35)
        browser.wait_for(f"document.querySelector('tr[data-trial=\"{stopped['number']}\"]') !== null", 10)
        marks = browser.evaluate(f"[document.querySelector('tr[data-trial=\"{confirmed['number']}\"] .tier').textContent, "
                                 f"document.querySelector('tr[data-trial=\"{stopped['number']}\"] .stopped').textContent]")
        assert marks == [" ✓", " stop@35%"], marks
        assert browser.evaluate("document.querySelectorAll('script:not([src])').length") == 0
        assert browser.evaluate("document.body.dataset.cspViolations || '0'") == "0"
        assert browser.evaluate("document.body.dataset.jsErrors || '0'") == "0"
        time.sleep(1.0)
        run_png = browser.screenshot(out / "run-page.png", full_page=False)
        browser.screenshot(out / "run-page-full.png")
        browser.navigate(server.base + "/#/r/live/tree")
        browser.wait_for(f"document.querySelector('#tree-svg a[data-trial=\"{trial['number']}\"]') !== null", 10)
        tree_png = browser.screenshot(out / "tree.png", full_page=False)
        browser.navigate(server.base + f"/#/r/live/t/{trial['number']}")
        browser.wait_for("document.querySelector('#trial-text') && document.querySelector('#trial-text').textContent.length > 0", 10)
        assert SCRIPT in browser.evaluate("document.querySelector('#trial-head').textContent")
        browser.screenshot(out / "trial.png", full_page=False)
        assert [m for m in browser.events if m.get("method") == "Page.javascriptDialogOpening"] == []  # no alert()
    for png in (run_png, tree_png):
        assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshots in {out}")


def test_the_docs_picture_of_the_page_is_made_by_its_script(tmp_path):
    """docs/serve.md's `python scripts/screenshot_serve.py docs/serve.png`, as written."""
    from browser_support import chromium

    if chromium() is None:
        pytest.skip("no chromium installed (.ci/run installs Debian's chromium)")
    pytest.importorskip("websockets")
    assert "python scripts/screenshot_serve.py docs/serve.png" in (ROOT / "docs" / "serve.md").read_text()
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "screenshot_serve.py"), str(tmp_path / "serve.png")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    png = (tmp_path / "serve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000


def test_the_overhead_bench_pairs_rounds_and_gives_the_mean_and_its_standard_error():
    """bench/serve_scale.py's verdict on known inputs: a constant +0.1 s is measured exactly;
    differences of +0.1, -0.1, +0.1, -0.1 average to 0, with a standard deviation of
    0.2/sqrt(3) and so a standard error of half that."""
    bench = bench_module("serve_scale")
    mean, se = bench.paired_difference([1.0, 2.0, 3.0], [1.1, 2.1, 3.1])
    assert mean == pytest.approx(0.1) and se == pytest.approx(0.0, abs=1e-12)
    mean, se = bench.paired_difference([1.0, 2.0, 3.0, 4.0], [1.1, 1.9, 3.1, 3.9])
    assert mean == pytest.approx(0.0, abs=1e-12) and se == pytest.approx(0.2 / math.sqrt(3) / 2)
    assert bench.paired_difference([1.0], [1.5]) == (0.5, float("inf"))  # one pair tells nothing of the noise


def test_replies_are_json_without_nan_and_big_ones_are_gzipped_for_a_browser():
    import gzip

    from starlette.requests import Request

    from autoloop.serve.app import _json

    browser = Request({"type": "http", "method": "GET", "path": "/", "query_string": b"",
                       "headers": [(b"accept-encoding", b"gzip, deflate, br")]})
    big = {"rows": ["x" * 100] * 400}
    reply = _json(big, request=browser)
    assert reply.headers["content-encoding"] == "gzip" and json.loads(gzip.decompress(reply.body)) == big
    assert "content-encoding" not in _json({"small": 1}, request=browser).headers
    assert "content-encoding" not in _json(big).headers  # a client that did not ask
    assert _json({"v": float("nan"), "w": [float("inf"), 1.5]}).body == b'{"v":null,"w":[null,1.5]}'


def test_the_page_survives_seeding_and_another_writer_closing(tmp_path):
    """Issue 35: seeding from the page opened a Store in the server's process, whose plain
    open and close of experiments.db dropped the POSIX locks of the page's own read-only
    connection; when the run's writer then closed, SQLite deleted the WAL under the page,
    and every request answered 500 "database disk image is malformed". The page must
    answer after any writer's open and close and show what later writers add."""
    repo = make_repo(tmp_path / "repo", FAKE_TRAIN.read_text())
    writer = NightWriter(repo, "live")
    writer.night(3, keep_every=2)
    with Server(repo) as srv:
        assert srv.get("/api/runs/live/page")[0] == 200
        status, _, reply = srv.post("/api/seed", {"description": "from the page", "sets": ["LR=0.015"]})
        assert status == 200, reply
        writer.trial("written while the page holds the db", "discard", 1.7)
        writer.close()  # the run's controller exits: the last writer closes
        status, _, page = srv.get("/api/runs/live/page")
        assert status == 200, page
        later = NightWriter(repo, "later")  # a later run in the same db: a new writer opens and closes
        try:
            later.trial("written after the first writer closed", "discard", 1.8)
            later.store.add_idea("seeded from the CLI later", source="human")
        finally:
            later.close()

        def shown(tag: str = "later") -> tuple[set, set]:
            status, _, view = srv.get(f"/api/runs/{tag}/page")
            assert status == 200, view
            parts = view["parts"]
            return ({t["description"] for t in parts["trials"]["data"]["rows"]},
                    {i["text"] for i in parts["ideas"]["data"]["queue"]})

        _wait(lambda: "written after the first writer closed" in shown()[0], 5.0)
        assert "written while the page holds the db" in shown("live")[0]
        assert {"from the page", "seeded from the CLI later"} <= shown()[1]


@pytest.mark.slow
def test_the_page_lists_an_idea_with_a_patch_and_sets_as_both(night, server):
    from browser_support import Browser, chromium

    if chromium() is None:
        pytest.skip("no chromium installed (.ci/run installs Debian's chromium)")
    pytest.importorskip("websockets")
    idea = night.store.add_idea("wider by patch, lower lr", sets={"LR": "0.012"}, source="human",
                                patch="--- a/train.py\n+++ b/train.py\n@@ -1 +1 @@\n-WIDTH = 64\n+WIDTH = 128\n")
    try:
        with Browser(server.link) as browser:
            browser.navigate(server.base + "/#/r/live")
            cell = f"document.querySelector('tr[data-idea=\"{idea['id']}\"] code')"
            browser.wait_for(f"{cell} !== null", 20)
            assert browser.evaluate(f"{cell}.textContent") == "patch, LR=0.012"
            assert browser.evaluate("document.body.dataset.jsErrors || '0'") == "0"
    finally:
        night.store.cancel_idea(idea["id"])  # the module's other tests see the queue as it was
