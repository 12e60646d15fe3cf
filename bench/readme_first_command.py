"""The README's first command, end to end, as a new user runs it.

    python bench/readme_first_command.py                  # from the repository root
    python bench/readme_first_command.py --burners 2      # beside two CPU burners
    python bench/readme_first_command.py --beside-loop    # beside a second project running its own loop
    python bench/readme_first_command.py --keep /tmp/rfc  # keep the clone, venv and db
    python bench/readme_first_command.py --corpus-key tests --burners 2   # the tests' data

A fresh clone of this repository (what is committed: `git clone` of the checkout), a
fresh virtual environment, then the command exactly as README.md writes it, parsed out
of its first ```bash block (so the README and this check cannot drift), run by bash in
the clone. Then the db says what happened. Prints the wall time of each stage and every
trial (number, kind, status, val_bpb, reason), and the problems found: the command must
end with the baseline and three trials, none of them invalid, crashed, timed out or
interrupted (nothing the user did could cause that). The README states the command's
wall time on a quiet machine and on a busy one; this prints it (`command_seconds`), with
the CPU seconds its processes used (`command_cpu_seconds`: what a quiet machine's wall
time is made of; read from a cgroup of its own where this machine lets the bench make one,
as root on cgroup v1, since getrusage misses the sandboxed runs a pid namespace's init
reaps: `command_cpu_source` says which, and getrusage's figure is a lower bound) and the mean load average while it ran (`load_mean`: other users of a
shared machine count too, so "quiet" is a figure, not a claim).

By default the fresh HOME makes a random corpus key, as a new user's machine does, so two
runs train on two different texts and their figures differ. `--corpus-key tests` (the
tests' fixed key) or 64 hex digits fixes the text: in step mode on a CPU two runs then
give the same figures, quiet or busy, and any difference is the machine's doing.

`--beside-loop` starts a second project first, as a user with two loops has one (the
README: "For two loops side by side, use two clones"): another clone of the repository in
its own folder, with its own experiments.db, the same installation, HOME and caches,
running `autoloop run --workers 2` in time mode (training, evaluating, idle in turns: a
load that comes and goes; its workers import autoloop through the first clone's editable
install) for as long as the first command runs. Its trials are printed too; the
two must not disturb each other's verdicts.

Nothing is downloaded. The fresh environment reuses the packages of the interpreter that
runs this script (torch, numpy, ...): it is made with --system-site-packages, and when
that interpreter is itself a virtual environment (whose packages --system-site-packages
does not reach) a .pth file adds its site-packages. pip runs with --no-index and without
build isolation, which would otherwise fetch setuptools into a throwaway environment.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sqlite3
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPECTED_TRIALS = 4  # the baseline and three trials: `--max-trials 4` in the README


def readme_first_command(readme: str) -> str:
    """The body of README.md's first ```bash block."""
    match = re.search(r"^```bash\n(.*?)^```", readme, flags=re.S | re.M)
    if match is None:
        raise ValueError("README.md has no ```bash block")
    return match.group(1)


def _sh(args: list, *, cwd: Path, env: dict | None = None, log: Path | None = None) -> float:
    """Run a command, fail with its output; returns its wall time."""
    started = time.monotonic()
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True)
    if log is not None:
        log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return time.monotonic() - started


def fresh_environment(source: Path, work: Path) -> tuple[Path, Path, dict]:
    """Clone `source` into work/clone and make work/venv with the clone installed
    (editable, no dependencies, no build isolation). Returns (clone, venv, timings)."""
    clone, venv = work / "clone", work / "venv"
    timings = {"clone_seconds": _sh(["git", "clone", "-q", source, clone], cwd=work)}
    started = time.monotonic()
    _sh([sys.executable, "-m", "venv", "--system-site-packages", venv], cwd=work)
    python = venv / "bin" / "python"
    site = Path(_sh_out([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=work))
    ours = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    if sys.prefix != sys.base_prefix:
        # This interpreter is a virtual environment: --system-site-packages reaches its
        # base Python, not the packages installed here (torch ...). A .pth file appends them.
        (site / "_autoloop_parent_env.pth").write_text("".join(f"{p}\n" for p in dict.fromkeys(ours)))
    # The setuptools that venv bundles (65 on Python 3.11; none from 3.12) predates
    # pyproject's `license = "MIT"` (setuptools >= 77) and shadows ours: without it,
    # the build without isolation uses this interpreter's.
    _sh([python, "-m", "pip", "uninstall", "-q", "-y", "setuptools"], cwd=work)
    timings["venv_seconds"] = time.monotonic() - started
    timings["install_seconds"] = _sh(
        [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation", "-e", "."],
        cwd=clone, env=child_environment(venv, work),
    )
    return clone, venv, timings


def _sh_out(args: list, *, cwd: Path) -> str:
    return subprocess.run([str(a) for a in args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def child_environment(venv: Path, work: Path) -> dict:
    """A new user's shell with the fresh venv activated: none of this checkout's
    PYTHONPATH or AUTOLOOP_* settings, a fresh HOME (no git identity, no caches), and pip
    kept offline."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AUTOLOOP_", "PYTHON", "VIRTUAL_ENV", "PIP_", "CONDA"))}
    home = work / "home"
    home.mkdir(exist_ok=True)
    env.update({
        "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", "VIRTUAL_ENV": str(venv), "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "PIP_NO_INDEX": "1",
        "PIP_NO_BUILD_ISOLATION": "0",  # pip reads this inverted: "0" turns build isolation OFF
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    })
    for name in ("OMP_NUM_THREADS", "AUTOLOOP_TEST_THREADS"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def trials(db: Path) -> list[dict]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(
            "SELECT number, kind, status, metric, reason, description, wall_seconds, started_at, finished_at "
            "FROM trials ORDER BY number")]
    finally:
        conn.close()


def check_warnings(db: Path) -> list[str]:
    """What the run's pre-run check (`autoloop check`, stored on the run) warned about: a
    budget it calls too small to mean anything is a demo that shows nothing."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT check_result FROM runs ORDER BY id LIMIT 1").fetchone()
    finally:
        conn.close()
    result = json.loads(row[0]) if row and row[0] else {}
    return [f"the pre-run check: {part}: {'; '.join(value.get('warnings') or [value.get('message', '')])}"
            for part, value in result.items() if isinstance(value, dict) and value.get("status") in ("warn", "fail")]


def problems(rows: list[dict]) -> list[str]:
    """What is wrong with the run the README's first command made (empty: nothing)."""
    found = []
    if len(rows) != EXPECTED_TRIALS:
        found.append(f"{len(rows)} trials, expected the baseline and {EXPECTED_TRIALS - 1} more")
    if not rows or rows[0]["kind"] != "baseline" or rows[0]["status"] != "keep" or rows[0]["metric"] is None:
        found.append("trial 1 is not a measured baseline")
    for row in rows:
        if row["status"] not in ("keep", "discard"):
            found.append(f"trial {row['number']} is {row['status']}: {row['reason']}")
    return found


# The second project runs on two workers: their git worktrees import autoloop through the
# README's editable install, which points into the first clone (issue 22, item 6).
BESIDE_WORKERS = 2
BESIDE_COMMAND = ["autoloop", "run", "--tag", "beside", "--no-check", "--workers", str(BESIDE_WORKERS)]
BESIDE_FLAGS = ("--time-budget", "20")  # the bench's: time mode, training, evaluating, idle in turns
BESIDE_TRIALS = 1000  # the bench's: it runs until the first command is done


def start_beside_loop(source: Path, work: Path, venv: Path, max_trials: int = BESIDE_TRIALS,
                      flags: tuple[str, ...] = BESIDE_FLAGS,
                      settings: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    """A second project (another clone, its own folder and db) running a loop of its own
    with the same installation and HOME, for `max_trials` trials, with `flags` added to
    BESIDE_COMMAND and `settings` (AUTOLOOP_* variables) in its user's environment; returns
    the process and its folder."""
    other = work / "beside"
    _sh(["git", "clone", "-q", source, other], cwd=work)
    env = {**child_environment(venv, work), **(settings or {})}
    env.update({"GIT_AUTHOR_NAME": "beside", "GIT_AUTHOR_EMAIL": "b@example.com", "GIT_COMMITTER_NAME": "beside",
                "GIT_COMMITTER_EMAIL": "b@example.com"})
    log = open(work / "beside.log", "w")
    proc = subprocess.Popen(BESIDE_COMMAND + list(flags) + ["--max-trials", str(max_trials)], cwd=other, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    log.close()
    return proc, other


def stop_beside_loop(proc: subprocess.Popen) -> str | None:
    """Ctrl-C, as a user stops a loop (it kills its trials and resets git); then for sure.
    Returns when the Ctrl-C was sent (the db's clock: UTC ISO-8601), or None if the loop had
    already ended by itself."""
    import signal

    if proc.poll() is not None:
        return None
    sent = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return sent


STOPPED_BY_CTRL_C = "interrupted by the user"  # the reason of a trial the loop's Ctrl-C ended


def beside_problems(rows: list[dict], stopped_at: str | None, max_trials: int = BESIDE_TRIALS) -> list[str]:
    """The second project's trials must not fail because of the first.

    A loop given fewer trials than the first command lasts (`max_trials`: the slow README
    test's, to keep CI short) may end by itself: then it must have run all of them.

    Only one failure is not a problem: a trial ended by the Ctrl-C that stops the loop
    when the first command is done (`stopped_at`, from `stop_beside_loop`). Such a trial
    says so (interrupted, by the user), started before the Ctrl-C and finished after it,
    and there are at most as many as the loop has workers. Any other status than keep or
    discard is a problem, the last trials' included: a crash, a timeout, an invalid
    result, a lost worker, a trial left running, or a loop that ended before it was
    stopped (`stopped_at` None)."""
    found = [] if rows else ["the second project ran no trial"]
    if rows and stopped_at is None and len(rows) < max_trials:
        found.append("its loop had ended before the first command was done")
    stop = _when(stopped_at)
    in_flight = [r for r in rows if stop is not None and r["status"] == "interrupted"
                 and (r["reason"] or "").startswith(STOPPED_BY_CTRL_C)
                 and _when(r.get("started_at")) is not None and _when(r["started_at"]) <= stop
                 and _when(r.get("finished_at")) is not None and _when(r["finished_at"]) >= stop]
    excused = {r["number"] for r in in_flight[:BESIDE_WORKERS]}
    for row in rows:
        if row["status"] not in ("keep", "discard") and row["number"] not in excused:
            found.append(f"trial {row['number']} is {row['status']}: {row['reason'] or 'no reason recorded'}")
    return found


def _training_started(clone: Path) -> bool:
    """The command's first training run has begun: its run folder exists."""
    return any(clone.glob(".autoloop/*/trials/*/runs/*"))


def cpu_group(name: str) -> Path | None:
    """A cgroup v1 cpuacct group of its own, nested in this process's (so a counter above,
    as tests/conftest.py's per-test one, still counts what runs in it); None where none can
    be made (cgroup v2, not root)."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "cpuacct" in controllers.split(","):
                group = Path("/sys/fs/cgroup/cpuacct") / path.lstrip("/") / name
                group.mkdir()
                try:  # a group one may make but not join (delegation): find out here, not in the child
                    _join(group)
                    (group.parent / "cgroup.procs").write_text(str(os.getpid()))
                except OSError:
                    _remove(group)
                    return None
                return group
    except (OSError, ValueError):
        pass
    return None


def in_group(group: Path, argv: list[str]) -> list[str]:
    """`argv` run in `group`: a shell joins it, then becomes the command, so everything the
    command starts inherits the group (no preexec_fn, which is unsafe beside threads)."""
    return ["bash", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group), *argv]


def _join(group: Path) -> None:
    (group / "cgroup.procs").write_text(str(os.getpid()))


def _group_cpu_seconds(group: Path) -> float:
    return int((group / "cpuacct.usage").read_text()) / 1e9


def _remove(group: Path, wait: float = 5.0) -> None:
    """Remove the group once it is empty: a pid namespace's last process may still be on its
    way out when the command has returned; a process left behind keeps it."""
    deadline = time.monotonic() + wait
    while True:
        try:
            group.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)


def _when(stamp: str | None) -> datetime | None:
    return datetime.fromisoformat(stamp) if stamp else None


def _sample_load(into: list[float], stop: threading.Event, every: float = 15.0) -> None:
    """The one-minute load average every `every` seconds until `stop` (how busy the
    machine was while the command ran: other users' work counts too)."""
    while True:
        into.append(os.getloadavg()[0])
        if stop.wait(every):
            return


def run(source: Path, work: Path, burners: int = 0, beside: bool = False, beside_trials: int = BESIDE_TRIALS,
        beside_flags: tuple[str, ...] = BESIDE_FLAGS, beside_from_training: bool = False,
        beside_settings: dict[str, str] | None = None, corpus_key: bytes | None = None) -> dict:
    """Everything, in `work`; returns the figures (timings, trials, problems).

    `burners`: CPU-burning processes (`python -c "while True: pass"`) running beside the
    command, as on a user's busy machine. `beside`: a second project running its own loop
    beside it (`start_beside_loop`, with `beside_flags` and `beside_settings`), for
    `beside_trials` trials (by default until the command is done); it starts before the command, or with
    `beside_from_training` when the command's first training run starts (a short loop
    then trains and evaluates beside the command's sandboxed runs, not beside its install
    and pre-run check). `corpus_key`: the embedded corpus's key, put in the fresh HOME's
    cache before anything runs (a test's fixed corpus: the same data and, in step mode on
    a CPU, the same verdicts every time); by default the command makes a random one, as on
    a new user's machine."""
    started = time.monotonic()
    clone, venv, figures = fresh_environment(source, work)
    if corpus_key is not None:  # where the fresh shell's autoloop looks for it
        subprocess.run([str(venv / "bin" / "python"), "-c", "import sys\n"
                        "from autoloop.harness.corpus_key import corpus_key_path, write_key\n"
                        "write_key(corpus_key_path(), bytes.fromhex(sys.argv[1]))", corpus_key.hex()],
                       cwd=clone, env=child_environment(venv, work), check=True)
    command = readme_first_command((clone / "README.md").read_text())
    figures["command"] = command
    figures["burners"] = burners
    figures["beside_loop"] = beside
    figures["beside_trials_asked"] = beside_trials if beside else None
    loop = other = None

    def start_loop() -> None:
        nonlocal loop, other
        loop, other = start_beside_loop(source, work, venv, beside_trials, beside_flags, beside_settings)
        figures["beside_started_after_seconds"] = time.monotonic() - begun

    begun = time.monotonic()
    if beside and not beside_from_training:
        start_loop()
        time.sleep(5)  # it is under way (its first baseline run) before the command starts
        begun = time.monotonic()
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    loads, sampling = [], threading.Event()
    sampler = threading.Thread(target=_sample_load, args=(loads, sampling), daemon=True)
    sampler.start()
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    group = cpu_group(f"readme-first-command-{os.getpid()}")
    try:
        argv = ["bash", "-e", "-c", command]
        if group is not None:
            argv = in_group(group, argv)
        with open(work / "command.log", "w") as log:
            done = subprocess.Popen(argv, cwd=clone, env=child_environment(venv, work), stdout=log,
                                    stderr=subprocess.STDOUT)
        while done.poll() is None:
            if beside and loop is None and _training_started(clone):
                start_loop()
            time.sleep(0.5)
        # The command's processes, all reaped by now (training runs included); not the burners.
        cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    finally:
        sampling.set()
        for burner in load:
            burner.kill()
            burner.wait()
        if loop is not None:
            figures["beside_stopped_at"] = stop_beside_loop(loop)
    figures["command_seconds"] = time.monotonic() - begun
    if group is not None:
        figures["command_cpu_seconds"], figures["command_cpu_source"] = _group_cpu_seconds(group), "cgroup"
        _remove(group)
    else:
        figures["command_cpu_seconds"] = (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)
        figures["command_cpu_source"] = "getrusage (a lower bound: it misses sandboxed runs)"
    figures["load_mean"] = sum(loads) / len(loads) if loads else os.getloadavg()[0]
    figures["command_exit"] = done.returncode
    figures["output_tail"] = (work / "command.log").read_text(errors="replace")[-4000:]
    db = clone / "experiments.db"
    figures["trials"] = trials(db) if db.exists() else []
    figures["problems"] = problems(figures["trials"]) + (check_warnings(db) if db.exists() else [])
    if done.returncode != 0:
        figures["problems"].insert(0, f"the command exited {done.returncode}")
    if beside and other is None:
        figures["problems"].append("beside: the second project never started (the command ran no training)")
    if other is not None:
        db = other / "experiments.db"
        figures["beside_trials"] = trials(db) if db.exists() else []
        figures["beside_output_tail"] = (work / "beside.log").read_text()[-3000:]
        figures["problems"] += [f"beside: {p}" for p in beside_problems(figures["beside_trials"],
                                                                              figures["beside_stopped_at"], beside_trials)]
    figures["total_seconds"] = time.monotonic() - started
    return figures


def report(figures: dict) -> str:
    lines = [f"{name:>19}: {figures[name]:7.1f} s" for name in
             ("clone_seconds", "venv_seconds", "install_seconds", "command_seconds", "command_cpu_seconds",
              "total_seconds") if name in figures]
    if "command_cpu_source" in figures:
        lines.append(f"{'command CPU from':>19}: {figures['command_cpu_source']}")
    beside = ", a second project's loop" if figures.get("beside_loop") else ""
    lines.append(f"{'command exit':>19}: {figures.get('command_exit')} ({figures.get('burners', 0)} CPU burners{beside} "
                 f"beside it; load {figures.get('load_mean', 0.0):.1f} on average while it ran, "
                 f"{os.getloadavg()[0]:.1f} at the end)")
    for row in figures.get("trials", []):
        metric = f"{row['metric']:.6f}" if row["metric"] is not None else "-"
        wall = f"{row['wall_seconds']:.0f} s" if row["wall_seconds"] is not None else "-"
        lines.append(f"  trial {row['number']}  {row['kind']:<9} {row['status']:<11} {metric:>9}  {wall:>6}  "
                     f"{(row['description'] or '')[:40]:<40}  {row['reason'] or ''}")
    if figures.get("beside_loop"):
        statuses = [row["status"] for row in figures.get("beside_trials", [])]
        lines.append(f"  beside: {len(statuses)} trials of the second project "
                     f"({', '.join(f'{statuses.count(x)} {x}' for x in sorted(set(statuses)))})")
    lines.append("problems: " + ("; ".join(figures["problems"]) or "none"))
    return "\n".join(lines)


def corpus_key_argument(value: str | None) -> bytes | None:
    """--corpus-key's bytes: None (a random key, made by the command), or corpus_key_bytes."""
    return None if value is None else corpus_key_bytes(value)


def corpus_key_bytes(value: str) -> bytes:
    """A --corpus-key of this bench or bench/night.py: `tests` (the tests' fixed key) or 64
    hex digits; anything else ends the bench with one line saying so."""
    if value == "tests":
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import TEST_CORPUS_KEY

        return TEST_CORPUS_KEY
    try:
        key = bytes.fromhex(value)
    except ValueError:
        key = b""
    if len(key) != 32:
        sys.exit(f"--corpus-key {value!r} is not 32 bytes of hex: give 64 hex digits, or `tests`")
    return key


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=ROOT, help="the repository to clone (this one by default)")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (a temporary one by default)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    parser.add_argument("--burners", type=int, default=0,
                        help='CPU-burning processes beside the command (python -c "while True: pass"), e.g. 2')
    parser.add_argument("--beside-loop", action="store_true",
                        help="a second project running its own `autoloop run` beside the command")
    parser.add_argument("--corpus-key", help="the embedded corpus's key: 64 hex digits, or `tests` for the tests' "
                                             "fixed key (a random one by default, as on a new user's machine)")
    args = parser.parse_args()
    key = corpus_key_argument(args.corpus_key)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        figures = run(args.source, args.keep, args.burners, args.beside_loop, corpus_key=key)
    else:
        with tempfile.TemporaryDirectory(prefix="readme-first-command-") as tmp:
            figures = run(args.source, Path(tmp), args.burners, args.beside_loop, corpus_key=key)
    print(report(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1, default=str))
    return 1 if figures["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
