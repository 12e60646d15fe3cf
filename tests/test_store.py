"""Tests for autoloop.store on real SQLite files in tmp_path."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from autoloop.errors import AutoloopError
from autoloop.store import MIGRATIONS, IdeaStatus, Kind, MetricSource, Status, Store

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "experiments.db"


@pytest.fixture
def store(db_path: Path):
    s = Store(db_path)
    yield s
    s.close()


@pytest.fixture
def run(store: Store) -> dict:
    return store.create_run("t1", branch="autoloop/t1", config={"budget": 300})


def test_pragmas_and_migrations_recorded(store: Store, db_path: Path):
    assert store.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert store.conn.execute("PRAGMA busy_timeout").fetchone()[0] == 30000
    assert store.applied_migrations() == [name for name, _ in MIGRATIONS]
    store.close()
    # Reopening applies nothing twice.
    again = Store(db_path)
    rows = again.conn.execute("SELECT name FROM _migrations").fetchall()
    assert [r[0] for r in rows] == [name for name, _ in MIGRATIONS]
    again.close()


def test_unknown_migration_is_refused(store: Store, db_path: Path):
    store.conn.execute("INSERT INTO _migrations (name, applied_at) VALUES ('9999_future', 'x')")
    store.close()
    with pytest.raises(AutoloopError, match=r"newer autoloop \(unknown migration '9999_future'\).*upgrade autoloop"):
        Store(db_path)


def test_not_a_database_is_refused(tmp_path: Path):
    path = tmp_path / "notes.txt"
    path.write_text("hello, this is not SQLite\n" * 50)
    with pytest.raises(AutoloopError, match=r"notes.txt is not an autoloop database .*point --db"):
        Store(path)
    assert path.read_text().startswith("hello")  # untouched


def test_foreign_sqlite_database_is_refused(tmp_path: Path):
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE songs (name TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(AutoloopError, match=r"not an autoloop database \(it has tables songs"):
        Store(path)


def test_check_constraints_follow_the_enums(store: Store, run: dict):
    trial = store.new_trial(run["id"], Kind.BASELINE)
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        store.conn.execute("UPDATE trials SET status = 'bogus' WHERE id = ?", (trial["id"],))
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        store.conn.execute("UPDATE trials SET metric_source = 'guessed' WHERE id = ?", (trial["id"],))
    # The Store validates first, naming the allowed values.
    with pytest.raises(ValueError, match="must be one of running, keep"):
        store.update_trial(trial["id"], status="bogus")
    # Every enum value is accepted by the schema.
    for status in Status:
        store.update_trial(trial["id"], status=status)
    for source in MetricSource:
        store.update_trial(trial["id"], metric_source=source)
    for kind in Kind:
        store.new_trial(run["id"], kind)


def test_trial_lifecycle_and_best(store: Store, run: dict):
    base = store.new_trial(run["id"], "baseline", parent_commit="abc")
    assert (base["number"], base["status"], base["lineage"]) == (1, "running", "main")
    assert store.running_trials(run["id"])[0]["id"] == base["id"]
    store.update_trial(base["id"], status=Status.KEEP, metric=1.10, metric_source="verified",
                       result={"val_bpb": 1.10, "curve": []}, edits=[{"path": "train.py"}])
    got = store.get_trial(run["id"], 1)
    assert got["finished_at"] is not None
    assert got["result"] == {"val_bpb": 1.10, "curve": []}
    assert got["edits"] == [{"path": "train.py"}]
    worse = store.new_trial(run["id"], "proposal")
    store.update_trial(worse["id"], status="discard", metric=1.20)
    better = store.new_trial(run["id"], "proposal")
    store.update_trial(better["id"], status="keep", metric=1.05)
    crashed = store.new_trial(run["id"], "proposal")
    store.update_trial(crashed["id"], status="crash", reason="boom")
    assert store.best_trial(run["id"])["number"] == 3
    assert [t["number"] for t in store.trials(run["id"], status=["keep", "discard"])] == [1, 2, 3]
    assert [t["number"] for t in store.trials(run["id"], last=2)] == [3, 4]
    assert [t["number"] for t in store.trials(kind="baseline")] == [1]
    assert store.running_trials() == []
    with pytest.raises(TypeError, match="no column 'val_loss'"):
        store.update_trial(base["id"], val_loss=1.0)


def test_runs_stop_flag_and_duplicate_tag(store: Store, run: dict):
    assert store.get_run("t1")["config"] == {"budget": 300}
    assert store.get_run("nope") is None
    assert not store.stop_requested(run["id"])
    store.request_stop("t1")
    assert store.stop_requested(run["id"])
    store.update_run(run["id"], stop_requested=0, status="paused", pause_reason="GPU busy")
    assert not store.stop_requested(run["id"])
    assert store.get_run("t1")["status"] == "paused"
    with pytest.raises(AutoloopError, match="already exists"):
        store.create_run("t1")
    with pytest.raises(AutoloopError, match=r"no run tagged 'zz'.*runs: t1"):
        store.request_stop("zz")


def test_ideas_are_handed_out_once_by_priority(store: Store, run: dict):
    store.add_idea("low", priority=0)
    store.add_idea("high, for this run", run_id=run["id"], priority=5, sets={"LR": 0.002})
    other = store.create_run("t2")
    store.add_idea("other run's", run_id=other["id"], priority=9)
    store.add_idea("low but newer", priority=0)
    first = store.next_idea(run["id"])
    assert (first["text"], first["status"], first["sets"]) == ("high, for this run", "taken", {"LR": 0.002})
    assert store.next_idea(run["id"])["text"] == "low"
    assert store.next_idea(run["id"])["text"] == "low but newer"
    assert store.next_idea(run["id"]) is None
    trial = store.new_trial(run["id"], "proposal", idea_id=first["id"])
    store.set_idea_status(first["id"], IdeaStatus.DONE, trial_id=trial["id"])
    done = store.ideas(run["id"], status="done")
    assert [(i["text"], i["trial_id"]) for i in done] == [("high, for this run", trial["id"])]


def test_detail_tables(store: Store, run: dict):
    trial = store.new_trial(run["id"], "baseline")
    points = [{"step": s, "seconds": s * 0.1, "loss": 3.0 - s * 0.01, "lr": 1e-3, "grad_norm": 1.0, "extra": 1}
              for s in range(5)]
    assert store.add_curve(trial["id"], points) == 5
    assert [p["step"] for p in store.curve(trial["id"])] == [0, 1, 2, 3, 4]
    store.add_measurement(trial["id"], 1.1, seed=1)
    store.add_measurement(trial["id"], 1.2, seed=2, heldout_metric=1.3)
    assert [m["seed"] for m in store.measurements(trial["id"])] == [1, 2]
    store.add_proposal_record(proposer="llm", run_id=run["id"], trial_id=trial["id"], model="m",
                              prompt_tokens=10, completion_tokens=5, cost_usd=0.01, latency_seconds=1.5)
    store.add_event(run["id"], "env_change", "driver 550 -> 560 accepted")
    store.add_event(run["id"], "paused", "GPU busy", trial_id=trial["id"])
    assert [e["kind"] for e in store.events(run["id"], last=1)] == ["paused"]
    assert store.db["proposals"].count == 1


def test_transaction_rolls_back_and_nests(store: Store, run: dict):
    with pytest.raises(RuntimeError):
        with store.transaction():
            store.new_trial(run["id"], "baseline")
            raise RuntimeError("boom")
    assert store.trials(run["id"]) == []
    with store.transaction():
        store.new_trial(run["id"], "baseline")
        with pytest.raises(RuntimeError):
            with store.transaction():
                store.new_trial(run["id"], "proposal")
                raise RuntimeError("inner only")
    assert [t["kind"] for t in store.trials(run["id"])] == ["baseline"]


def test_trial_numbers_unique_across_connections(db_path: Path):
    setup = Store(db_path)
    run_id = setup.create_run("race")["id"]
    setup.close()
    errors: list[BaseException] = []

    def allocate(count: int) -> None:
        s = Store(db_path)
        try:
            for _ in range(count):
                s.new_trial(run_id, "proposal")
        except BaseException as error:  # surfaced below
            errors.append(error)
        finally:
            s.close()

    threads = [threading.Thread(target=allocate, args=(25,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    check = Store(db_path)
    numbers = [t["number"] for t in check.trials(run_id)]
    assert numbers == list(range(1, 51))
    check.close()


READER = textwrap.dedent(
    """
    import sys, time
    from autoloop.store import Store
    store = Store(sys.argv[1])
    run_id = store.get_run("w")["id"]
    print("READY", flush=True)
    reads = failures = 0
    end = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end:
        try:
            # What a live status display polls.
            store.trials(run_id, last=20)
            store.running_trials(run_id)
            store.best_trial(run_id)
            reads += 1
        except Exception as error:
            failures += 1
            print("FAILED:", error, flush=True)
    print("reads", reads, "failures", failures, flush=True)
    """
)


def test_reader_process_never_sees_locked(db_path: Path):
    writer = Store(db_path)
    run_id = writer.create_run("w")["id"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    reader = subprocess.Popen([sys.executable, "-c", READER, str(db_path), "2.0"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert reader.stdout.readline().strip() == "READY"
        written = 0
        # Write (read-then-write transactions included) for as long as the reader polls.
        while reader.poll() is None:
            trial = writer.new_trial(run_id, "proposal")
            writer.update_trial(trial["id"], status="running", heartbeat_at="now")
            writer.update_trial(trial["id"], status="discard", metric=1.0, result={"x": list(range(50))})
            written += 1
        out = reader.stdout.read()
    finally:
        if reader.poll() is None:
            reader.kill()
        reader.wait()
    assert reader.returncode == 0, out
    assert "FAILED" not in out, out
    reads = int(out.split("reads")[1].split()[0])
    assert reads > 10 and written > 10, out
    assert writer.integrity_check() == ["ok"]
    writer.close()


def test_a_database_of_three_migrations_gains_the_machine_speed(db_path: Path):
    """0005_machine_speed on a database written by the code of 0003: old rows read NULL
    (unknown speed: the pairing treats them as it always did), new rows keep the figure."""
    import sqlite3

    from autoloop import store as store_mod

    conn = sqlite3.connect(db_path)
    conn.execute("CREATE TABLE _migrations (name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)")
    for name, migrate in store_mod.MIGRATIONS[:3]:
        migrate(conn)
        conn.execute("INSERT INTO _migrations VALUES (?, 'then')", (name,))
    conn.execute("INSERT INTO runs (tag, status, created_at, updated_at) VALUES ('old', 'finished', 'x', 'x')")
    conn.execute("INSERT INTO trials (run_id, number, kind, status, created_at) VALUES (1, 1, 'baseline', 'keep', 'x')")
    conn.execute("INSERT INTO measurements (trial_id, seed, metric, created_at) VALUES (1, 1, 2.5, 'x')")
    conn.commit()
    conn.close()
    with Store(db_path) as store:
        assert "0005_machine_speed" in store.applied_migrations()
        old = store.measurements(1)[0]
        assert old["machine_speed"] is None and old["tokens_per_second"] is None
        store.add_measurement(1, 2.4, seed=2, machine_speed=6.25, tokens_per_second=1800.0)
        assert store.measurements(1)[1]["machine_speed"] == 6.25


def test_a_database_from_before_cancelled_ideas_keeps_its_ideas_and_can_cancel_them(db_path: Path, monkeypatch):
    """0006_cancelled_ideas rebuilds the ideas table for the new CHECK vocabulary: the same
    rows and ids, a trial's idea_id still pointing at its idea, foreign keys still enforced."""
    import enum
    import sqlite3

    from autoloop import store as store_mod

    class OldIdeaStatus(str, enum.Enum):  # the vocabulary the first five migrations knew
        PENDING, TAKEN, DONE, DROPPED = "pending", "taken", "done", "dropped"

    monkeypatch.setattr(store_mod, "IdeaStatus", OldIdeaStatus)
    conn = sqlite3.connect(db_path)
    conn.execute("CREATE TABLE _migrations (name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)")
    for name, migrate in store_mod.MIGRATIONS[:5]:
        migrate(conn)
        conn.execute("INSERT INTO _migrations VALUES (?, 'then')", (name,))
    conn.execute("INSERT INTO runs (tag, status, created_at, updated_at) VALUES ('old', 'active', 'x', 'x')")
    for text, status in (("tried", "done"), ("waiting", "pending"), ("later", "pending")):
        conn.execute("INSERT INTO ideas (text, status, created_at) VALUES (?, ?, 'x')", (text, status))
    conn.execute("INSERT INTO trials (run_id, number, kind, status, idea_id, created_at) VALUES (1, 1, 'proposal', 'keep', 1, 'x')")
    conn.execute("UPDATE ideas SET trial_id = 1 WHERE id = 1")
    conn.commit()
    with pytest.raises(sqlite3.IntegrityError):  # the old table refuses the new status
        conn.execute("UPDATE ideas SET status = 'cancelled' WHERE id = 2")
    conn.close()
    monkeypatch.undo()

    with Store(db_path) as store:
        assert "0006_cancelled_ideas" in store.applied_migrations()
        assert [(i["id"], i["text"], i["status"]) for i in store.ideas()] == [
            (1, "tried", "done"), (2, "waiting", "pending"), (3, "later", "pending")]
        assert store.trials(1)[0]["idea_id"] == 1
        assert store.cancel_idea(2)["status"] == "cancelled"
        assert store.next_idea(1)["id"] == 3  # a cancelled idea is never handed out
        assert store.next_idea(1) is None
        assert store.conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        assert store.conn.execute("PRAGMA foreign_key_check").fetchall() == []
        with pytest.raises(sqlite3.IntegrityError):  # still enforced on the rebuilt table
            store.conn.execute("DELETE FROM ideas WHERE id = 1")
        assert store.conn.execute("SELECT name FROM sqlite_master WHERE name = 'ideas_rebuilt'").fetchone() is None
        assert store.conn.execute("SELECT name FROM sqlite_master WHERE name = 'ideas_pending'").fetchone() is not None


def test_a_database_from_before_the_ladder_keeps_its_trials_and_takes_ladder_trials(db_path: Path, monkeypatch):
    """0007_ladder rebuilds the trials table for Kind's 'ladder': the same rows and ids, every
    reference to them (a measurement, an idea, derived_from) kept and still enforced, the
    indexes made again; the rung and tag tables are there."""
    import enum
    import sqlite3

    from autoloop import store as store_mod

    class OldKind(str, enum.Enum):  # the vocabulary the first six migrations knew
        BASELINE, PROPOSAL, RERUN, DRIFT, ABLATION, REPAIR = ("baseline", "proposal", "rerun", "drift", "ablation",
                                                              "repair")

    monkeypatch.setattr(store_mod, "Kind", OldKind)
    conn = sqlite3.connect(db_path)
    conn.execute("CREATE TABLE _migrations (name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)")
    for name, migrate in store_mod.MIGRATIONS[:6]:
        migrate(conn)
        conn.execute("INSERT INTO _migrations VALUES (?, 'then')", (name,))
    conn.execute("INSERT INTO runs (tag, status, created_at, updated_at) VALUES ('old', 'finished', 'x', 'x')")
    conn.execute("INSERT INTO trials (run_id, number, kind, status, created_at) VALUES (1, 1, 'baseline', 'keep', 'x')")
    conn.execute("INSERT INTO trials (run_id, number, kind, status, derived_from, created_at) "
                 "VALUES (1, 2, 'proposal', 'keep', 1, 'x')")
    conn.execute("INSERT INTO measurements (trial_id, seed, metric, created_at) VALUES (2, 1, 2.5, 'x')")
    conn.commit()
    with pytest.raises(sqlite3.IntegrityError):  # the old table refuses the new kind
        conn.execute("INSERT INTO trials (run_id, number, kind, status, created_at) VALUES (1, 3, 'ladder', 'keep', 'x')")
    conn.close()
    monkeypatch.undo()

    with Store(db_path) as store:
        assert "0007_ladder" in store.applied_migrations()
        assert [(t["number"], t["kind"], t["derived_from"]) for t in store.trials(1)] == [
            (1, "baseline", None), (2, "proposal", 1)]
        assert store.measurements(2)[0]["metric"] == 2.5
        ladder = store.new_trial(1, "ladder", derived_from=2)
        assert ladder["kind"] == "ladder" and ladder["number"] == 3
        rung = store.add_rung(1, "DEPTH=8", overrides={"DEPTH": "8"}, seeds=[5, 6], plan={"runs": 6})
        assert rung["status"] == "running" and rung["overrides"] == {"DEPTH": "8"} and rung["seeds"] == [5, 6]
        store.set_ladder_tag(rung["id"], 2, ladder_trial_id=ladder["id"], tag="holds", effect=-0.05, n=2)
        store.set_ladder_tag(rung["id"], 2, ladder_trial_id=ladder["id"], tag="fades", effect=-0.01, n=2)
        assert [(t["tag"], t["effect"]) for t in store.ladder_tags(rung["id"])] == [("fades", -0.01)]
        with pytest.raises(sqlite3.IntegrityError):
            store.set_ladder_tag(rung["id"], 2, tag="better", effect=0.0, n=1)
        assert store.conn.execute("PRAGMA foreign_key_check").fetchall() == []
        with pytest.raises(sqlite3.IntegrityError):  # still enforced on the rebuilt table
            store.conn.execute("DELETE FROM trials WHERE id = 2")
        assert store.conn.execute("SELECT name FROM sqlite_master WHERE name = 'trials_rebuilt'").fetchone() is None
        assert store.conn.execute("SELECT name FROM sqlite_master WHERE name = 'trials_run_status'").fetchone()


def test_only_a_pending_idea_can_be_cancelled(store: Store, run: dict):
    first, second = store.add_idea("a", sets={"LR": "0.1"}), store.add_idea("b", sets={"LR": "0.2"})
    assert store.next_idea(run["id"])["id"] == first["id"]  # taken: its trial is being prepared
    with pytest.raises(AutoloopError, match=f"idea {first['id']} cannot be cancelled: a proposer has taken it"):
        store.cancel_idea(first["id"])
    store.cancel_idea(second["id"])
    with pytest.raises(AutoloopError, match="cancelled already"):
        store.cancel_idea(second["id"])
    with pytest.raises(AutoloopError, match="there is no idea 99: `autoloop ideas` lists them"):
        store.cancel_idea(99)
    assert [i["status"] for i in store.ideas()] == ["taken", "cancelled"]  # kept, never deleted
