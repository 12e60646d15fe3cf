"""The scale ladder on several workers (issue 34): with `--workers N` (or Ray) a rung's runs
go to all the run's workers at once, each worker taking the next (arm, seed) run when it
is free, and the rung's figures are those of the serial ladder at the same seeds.

The fake train.py is tests/test_ladder.py's (val_bpb a known function of its constants and
the seed, so a run's figure does not depend on where or when it trained), with two
constants only the rung sets: SLEEP (each run sleeps, so two workers' runs overlap in
time) and CRASH (the best without the schedule fails at the larger scale). Each run writes
when it started and ended, its folder and its device into its result, read back from the
run folder: overlap is asserted on those intervals, never on a wall-clock threshold."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import copy_run, make_repo
from test_ladder import IDEAS, KNOWN, autoloop, known_night, ladder_known, ten_second_runs

SLEEPY = (KNOWN
          .replace("import random\n", "import random\nimport sys\nimport time\n")
          .replace("LR = 0.01  # 0.02 is right at WIDTH 1 and too high above it\n",
                   "LR = 0.01  # 0.02 is right at WIDTH 1 and too high above it\n"
                   "SLEEP = 0.0  # seconds each run sleeps (the rung sets it: its runs overlap on two workers)\n"
                   "CRASH = 0  # 1: the best without the schedule fails at the larger scale\n")
          .replace('    seed = int(os.environ.get("AUTOLOOP_SEED", "0"))\n',
                   '    started = time.time()\n'
                   '    if CRASH and WIDTH > 1 and SCHEDULE == 0 and LR == 0.02:\n'
                   '        sys.exit("FAIL: a planted crash at the larger scale")\n'
                   '    time.sleep(SLEEP)\n'
                   '    seed = int(os.environ.get("AUTOLOOP_SEED", "0"))\n')
          .replace('"seed": seed, "curve": []}\n',
                   '"seed": seed, "curve": [],\n'
                   '              "ran": {"started": started, "finished": time.time(), "cwd": os.getcwd(),\n'
                   '                      "device": os.environ.get("CUDA_VISIBLE_DEVICES")}}\n'))
assert SLEEPY.count("time.sleep(SLEEP)") == 1 and '"ran": {' in SLEEPY and "CRASH = 0" in SLEEPY
SPEC = "WIDTH=4 SLEEP=0.4 budget=2x"


@pytest.fixture(scope="module")
def sleepy_night(tmp_path_factory, session_cache) -> Path:
    """A serial night of the real controller over SLEEPY: the baseline, both ideas kept."""
    return known_night(tmp_path_factory.mktemp("ladder-workers") / "repo", SLEEPY, session_cache)


def on_workers(repo: Path, workers: int) -> Path:
    """The run's stored config as `autoloop run --workers N` leaves it: the local executor
    (N pretend devices on this CPU), which `autoloop ladder` builds for the rung."""
    from autoloop.store import Store

    with Store(repo / "experiments.db") as store:
        run = store.get_run("k")
        store.update_run(run["id"], config={**run["config"], "executor": "local", "workers": workers})
    return repo


def ladder_runs(repo: Path, tag: str = "k") -> list[dict]:
    """Every ladder run recorded: its arm's trial, seed, status, steps, and what the run itself
    wrote (when it started and ended, its folder, its device), read from its run folder."""
    from autoloop.store import Store

    runs = []
    with Store(repo / "experiments.db") as store:
        for t in store.trials(store.get_run(tag)["id"], kind="ladder"):
            for m in store.measurements(t["id"]):
                result = Path(m["log_path"]).parent / "out" / "result.json"
                ran = json.loads(result.read_text()).get("ran") if result.exists() else None
                runs.append({"trial": t["number"], "arm": t["decision"]["arm"], "seed": m["seed"],
                             "status": m["status"], "reason": m["reason"], "num_steps": m["num_steps"],
                             "ran": ran})
    return runs


def figures(rung) -> dict:
    return {"headline": rung.headline, "seeds": rung.seeds, "status": rung.status,
            "rows": [(r.trial, r.tag, r.effect, r.low, r.high, r.n, r.small_effect, r.reason) for r in rung.rows]}


def overlapping_pairs(runs: list[dict]) -> list[tuple[dict, dict]]:
    """Pairs of runs on different devices (workers) whose recorded intervals overlap."""
    return [(a, b) for i, a in enumerate(runs) for b in runs[i + 1:]
            if a["ran"]["device"] != b["ran"]["device"]
            and a["ran"]["started"] < b["ran"]["finished"] and b["ran"]["started"] < a["ran"]["finished"]]


def assert_no_worker_left(repo: Path, tag: str = "k") -> None:
    """Every worker process the rung started was recorded, has ended, and is gone."""
    from autoloop.base.processes import process_group_alive
    from autoloop.store import Store

    with Store(repo / "experiments.db") as store:
        run_id = store.get_run(tag)["id"]
        assert store.live_processes(run_id) == []
        workers = store.query("SELECT pid, pgid FROM processes WHERE run_id = ? AND what = 'worker'", (run_id,))
    assert workers and not any(process_group_alive(w["pgid"]) for w in workers)


def worker_folders(repo: Path, tag: str) -> set[str]:
    return {str(repo / ".autoloop" / tag / "workers" / name) for name in ("w0", "w1")}


def test_a_rung_on_two_workers_gives_the_serial_figures_with_its_runs_overlapping(sleepy_night, tmp_path):
    serial = copy_run(sleepy_night, tmp_path / "serial")
    parallel = on_workers(copy_run(sleepy_night, tmp_path / "parallel"), 2)
    alone = ladder_known(serial, SPEC, seeds=3)
    said: list[str] = []
    both = ladder_known(parallel, SPEC, seeds=3, say=said.append)

    # The same figures and tags, to the last digit: each run's val_bpb is a function of its seed.
    assert figures(both) == figures(alone)
    assert {r.trial: r.tag for r in both.rows} == {2: "holds", 3: "reverses"} and both.status == "done"
    runs = ladder_runs(parallel)
    assert len(runs) == 12 and {r["status"] for r in runs} == {"ok"}
    # Both workers trained, each in its own worktree on its own (pretend) device; the serial
    # rung trained every run in the project folder.
    assert {r["ran"]["cwd"] for r in runs} == worker_folders(parallel, "k")
    assert {(r["ran"]["cwd"][-2:], r["ran"]["device"]) for r in runs} == {("w0", "0"), ("w1", "1")}
    assert {r["ran"]["cwd"] for r in ladder_runs(serial)} == {str(serial)}
    # They trained at once: runs on the two workers overlap in time (the serial ones never do).
    assert len(overlapping_pairs(runs)) >= 3
    apart = [{**r, "ran": {**r["ran"], "device": str(k)}} for k, r in enumerate(ladder_runs(serial))]
    assert overlapping_pairs(apart) == []
    # Every slot read the rung's config: the budget doubled (the fake reports the steps it got).
    assert {r["num_steps"] for r in runs} == {4}
    # The plan; its wall time once the two workers are known (12 runs in 6 rounds of 2: half
    # the runs' time); then the slowdown from the baseline's first run at the rung.
    plans = [line for line in said if line.startswith(f"the ladder at {SPEC}: 12 runs x ")]
    assert len(plans) == 3 and "not measured yet" in plans[0] and "not measured yet" not in plans[2]
    assert "workers at once" not in plans[0] and all(" min on 2 workers at once" in line for line in plans[1:])
    assert both.plan["workers"] == 2 and both.plan["wall_seconds"] == pytest.approx(both.plan["seconds"] / 2)
    assert both.plan["slowdown"] > 0 and any("2 local workers at once" in line for line in said)
    # The executor was closed with the rung: no worker process is left.
    assert_no_worker_left(parallel)


def test_a_failed_run_on_one_worker_fails_its_arm_and_the_other_runs_go_on(sleepy_night, tmp_path):
    repo = on_workers(copy_run(sleepy_night, tmp_path / "repo"), 2)
    rung = ladder_known(repo, "WIDTH=4 SLEEP=0.4 CRASH=1 budget=2x", seeds=2)
    runs = ladder_runs(repo)
    by_arm: dict[tuple, list] = {}
    for r in runs:
        by_arm.setdefault((r["arm"], r["trial"]), []).append(r)
    failed = [k for k, rs in by_arm.items() if any(r["status"] != "ok" for r in rs)]
    assert len(failed) == 1 and failed[0][0] == "without"
    # Its first run failed; its later seed was never started (as on the serial path) ...
    (crash,) = by_arm[failed[0]]
    assert crash["seed"] == 2_000_001 and "a planted crash" in (crash["reason"] or "")
    # ... while every other arm trained at every seed, on both workers.
    others = [r for k, rs in by_arm.items() if k != failed[0] for r in rs]
    assert len(others) == 6 and {r["status"] for r in others} == {"ok"}
    assert {r["ran"]["cwd"] for r in others} == worker_folders(repo, "k")
    # The change it would have measured (trial 2, the schedule) has no tag and says why; the other has its tag.
    rows = {r.trial: r for r in rung.rows}
    assert rows[2].tag is None and rows[2].reason.startswith("failed at seed 2000001 at the larger scale")
    assert rows[3].tag == "reverses" and rung.status == "done"
    from autoloop.store import Store

    with Store(repo / "experiments.db") as store:
        statuses = {t["decision"]["arm"] + str(t["decision"]["kept_trial"]): t["status"]
                    for t in store.trials(store.get_run("k")["id"], kind="ladder")}
    assert sorted(statuses.values()) == ["crash", "discard", "discard", "discard"]
    assert_no_worker_left(repo)


def test_a_rung_stopped_part_way_on_two_workers_trains_only_the_runs_it_lacks(sleepy_night, tmp_path, monkeypatch):
    from autoloop.base import faults
    from autoloop.store import Store

    repo = on_workers(copy_run(sleepy_night, tmp_path / "repo"), 2)
    # The disk fills up when the third run is recorded: the rung stops there, the run in
    # flight on the other worker ends and is recorded, the executor is closed.
    monkeypatch.setattr(faults, "_hits", {})
    monkeypatch.setenv("AUTOLOOP_FAULT", "enospc@between_measurements:3")
    with pytest.raises(OSError, match="No space left"):
        ladder_known(repo, SPEC, seeds=3)
    monkeypatch.delenv("AUTOLOOP_FAULT")
    first = ladder_runs(repo)
    assert 3 <= len(first) < 12 and {r["status"] for r in first} == {"ok"}
    assert_no_worker_left(repo)
    with Store(repo / "experiments.db") as store:
        assert [r["status"] for r in store.rungs(store.get_run("k")["id"])] == ["running"]

    said: list[str] = []
    rung = ladder_known(repo, SPEC, seeds=3, say=said.append)
    assert any("resuming its unfinished rung" in line for line in said) and rung.status == "done"
    runs = ladder_runs(repo)
    # Every commit at every seed once: the second call trained only the 12 - len(first) it lacked.
    assert len(runs) == 12 == len({(r["trial"], r["seed"]) for r in runs}) and {r["status"] for r in runs} == {"ok"}
    assert {r["ran"]["cwd"] for r in runs if r not in first} == worker_folders(repo, "k")
    assert {r.trial: r.tag for r in rung.rows} == {2: "holds", 3: "reverses"}
    assert_no_worker_left(repo)


def test_a_rung_on_two_ray_workers_trains_its_runs_at_once_and_gives_the_workers_back(sleepy_night, tmp_path,
                                                                                       request):
    request.getfixturevalue("ray_cluster")  # after the autouse fixtures: its nodes use the tests' cache
    import ray

    repo = copy_run(sleepy_night, tmp_path / "repo")
    from autoloop.store import Store

    with Store(repo / "experiments.db") as store:  # as `autoloop run --executor ray --workers 2` leaves it
        run = store.get_run("k")
        store.update_run(run["id"], config={**run["config"], "executor": "ray", "workers": 2})
    said: list[str] = []
    rung = ladder_known(repo, SPEC, seeds=2, say=said.append)
    assert {r.trial: r.tag for r in rung.rows} == {2: "holds", 3: "reverses"} and rung.status == "done"
    runs = ladder_runs(repo)
    assert len(runs) == 8 and {r["status"] for r in runs} == {"ok"} and {r["num_steps"] for r in runs} == {4}
    # Each Ray worker on the GPU it was granted, in a folder on the node (not the project's).
    assert {r["ran"]["device"] for r in runs} == {"0", "1"}
    assert not any(Path(r["ran"]["cwd"]).is_relative_to(repo) for r in runs)
    assert overlapping_pairs(runs) and any("2 ray workers at once" in line for line in said)
    # The executor was closed with the rung: its actors gave their GPUs back (Ray reports it a moment later).
    deadline = time.time() + 60
    while ray.available_resources().get("GPU") != 2 and time.time() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("GPU") == 2


@pytest.mark.slow  # about 50 s here: two `autoloop` processes, each run a worker process (as the serial one is slow)
def test_the_ladder_at_the_end_of_a_night_on_two_workers_uses_them_and_resumes_after_a_kill(tmp_path):
    """`run --workers 2 --ladder`: the end-of-night rung goes to both workers; the controller
    killed mid-rung (SIGKILL, its workers' runs in flight), `autoloop ladder` finishes it."""
    from autoloop.store import Store

    repo = make_repo(tmp_path / "repo", SLEEPY)
    with Store(repo / "experiments.db") as store:
        store.add_idea(*IDEAS[0][:1], sets=IDEAS[0][1], source="human")
    night = ("run", "--tag", "t", "--workers", "2", "--max-steps", "2", "--grace-seconds", "30", "--no-verify",
             "--no-sandbox", "--no-check", "--proposers", "ideas", "--reserve-seeds", "0", "--max-trials", "2",
             "--ladder", "WIDTH=4 SLEEP=0.4", "--ladder-seeds", "2")
    killed = autoloop(repo, *night, fault="between_measurements:3")
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert "the ladder's runs go to 2 local workers at once" in killed.stdout
    assert "[w0] trial 3 training: ladder WIDTH=4 SLEEP=0.4: the baseline (trial 1) at scale" in killed.stdout
    first = ladder_runs(repo, "t")
    assert 0 < len(first) < 6 and {r["ran"]["cwd"] for r in first} <= worker_folders(repo, "t")

    done = autoloop(repo, "ladder", "--tag", "t")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming its unfinished rung" in done.stdout and "2 local workers at once" in done.stdout
    runs = [r for r in ladder_runs(repo, "t") if r["status"] == "ok"]
    assert len(runs) == 6 == len({(r["trial"], r["seed"]) for r in runs})  # 3 commits x 2 seeds, none twice
    assert {r["ran"]["cwd"] for r in runs} == worker_folders(repo, "t")
    assert overlapping_pairs(runs) and {r["num_steps"] for r in runs} == {2}
    with Store(repo / "experiments.db") as store:
        run = store.get_run("t")
        assert [r["status"] for r in store.rungs(run["id"])] == ["done"]
        tags = [t["tag"] for t in store.ladder_tags(store.rungs(run["id"])[0]["id"])]
    assert tags == ["holds"]  # the schedule: -0.05 at both widths
    assert_no_worker_left(repo, "t")


def test_on_n_workers_hours_plans_the_ladder_n_runs_at_a_time_and_the_cost_cap_all_of_them(sleepy_night, tmp_path):
    """--hours: the rung's runs in rounds of N (its wall time); --max-cost: every run (its GPU time)."""
    import dataclasses
    from types import SimpleNamespace

    from autoloop.loop.reserve import ladder_seconds_needed
    from autoloop.store import Store

    repo = copy_run(sleepy_night, tmp_path / "repo")
    config = ten_second_runs(repo)
    with Store(repo / "experiments.db") as store:
        host = SimpleNamespace(config=config, store=store, run_row=store.get_run("k"))
        # 2 kept changes: 3 seeds x 4 commits = 12 runs of 10 s x 2.
        assert ladder_seconds_needed(host) == pytest.approx(12 * 20.0)
        assert ladder_seconds_needed(host, workers=2) == pytest.approx(6 * 20.0)
        assert ladder_seconds_needed(host, workers=5) == pytest.approx(3 * 20.0)  # 5 + 5 + 2: three rounds
        assert ladder_seconds_needed(host, workers=16) == pytest.approx(20.0)
    # The loop's --hours check: a night on two workers has room for a rung that one worker would not.
    from autoloop.loop.reserve import seconds_needed as reserve_seconds
    from autoloop.loop.run import Loop, Pauses

    def stop_reason(slots: int, room: float) -> str | None:
        with Store(repo / "experiments.db") as store:
            host = SimpleNamespace(config=config, store=store, run_row=store.get_run("k"), pauses=Pauses(),
                                   abort_requested=False)
            loop = Loop(host, [object()] * slots, threaded=slots > 1)
            rest = loop.trial_estimate() + reserve_seconds(host)  # the next trial, the headline's runs
            host.config = dataclasses.replace(config, hours=(rest + room) / 3600)
            return loop.stop_reason(time.time(), 0)

    assert stop_reason(2, 6 * 20.0 + 60) is None  # the rung's 6 rounds of 20 s, and a minute to spare
    assert stop_reason(1, 6 * 20.0 + 60).startswith("--hours ")  # one worker needs 12 x 20 s
