"""The README's first command, end to end, as a new user runs it.

    python bench/readme_first_command.py                  # from the repository root
    python bench/readme_first_command.py --keep /tmp/rfc  # keep the clone, venv and db

A fresh clone of this repository (what is committed: `git clone` of the checkout), a
fresh virtual environment, then the command exactly as README.md writes it, parsed out
of its first ```bash block (so the README and this check cannot drift), run by bash in
the clone. Then the db says what happened. Prints the wall time of each stage and every
trial (number, kind, status, val_bpb, reason), and the problems found: the command must
end with the baseline and three trials, none of them invalid, crashed, timed out or
interrupted (nothing the user did could cause that).

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
import sqlite3
import subprocess
import sys
import sysconfig
import tempfile
import time
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
            "SELECT number, kind, status, metric, reason, description, wall_seconds FROM trials ORDER BY number")]
    finally:
        conn.close()


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


def run(source: Path, work: Path, burners: int = 0) -> dict:
    """Everything, in `work`; returns the figures (timings, trials, problems).

    `burners`: CPU-burning processes (`python -c "while True: pass"`) running beside the
    command, as on a user's busy machine."""
    started = time.monotonic()
    clone, venv, figures = fresh_environment(source, work)
    command = readme_first_command((clone / "README.md").read_text())
    figures["command"] = command
    figures["burners"] = burners
    begun = time.monotonic()
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    try:
        done = subprocess.run(["bash", "-e", "-c", command], cwd=clone, env=child_environment(venv, work),
                              capture_output=True, text=True)
    finally:
        for burner in load:
            burner.kill()
            burner.wait()
    figures["command_seconds"] = time.monotonic() - begun
    figures["command_exit"] = done.returncode
    (work / "command.log").write_text(done.stdout + done.stderr)
    figures["output_tail"] = (done.stdout + done.stderr)[-4000:]
    db = clone / "experiments.db"
    figures["trials"] = trials(db) if db.exists() else []
    figures["problems"] = problems(figures["trials"])
    if done.returncode != 0:
        figures["problems"].insert(0, f"the command exited {done.returncode}")
    figures["total_seconds"] = time.monotonic() - started
    return figures


def report(figures: dict) -> str:
    lines = [f"{name:>18}: {figures[name]:7.1f} s" for name in
             ("clone_seconds", "venv_seconds", "install_seconds", "command_seconds", "total_seconds") if name in figures]
    lines.append(f"{'command exit':>18}: {figures.get('command_exit')} ({figures.get('burners', 0)} CPU burners beside it)")
    for row in figures.get("trials", []):
        metric = f"{row['metric']:.6f}" if row["metric"] is not None else "-"
        wall = f"{row['wall_seconds']:.0f} s" if row["wall_seconds"] is not None else "-"
        lines.append(f"  trial {row['number']}  {row['kind']:<9} {row['status']:<11} {metric:>9}  {wall:>6}  "
                     f"{(row['description'] or '')[:40]:<40}  {row['reason'] or ''}")
    lines.append("problems: " + ("; ".join(figures["problems"]) or "none"))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=ROOT, help="the repository to clone (this one by default)")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (a temporary one by default)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    parser.add_argument("--burners", type=int, default=0,
                        help='CPU-burning processes beside the command (python -c "while True: pass"), e.g. 2')
    args = parser.parse_args()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        figures = run(args.source, args.keep, args.burners)
    else:
        with tempfile.TemporaryDirectory(prefix="readme-first-command-") as tmp:
            figures = run(args.source, Path(tmp), args.burners)
    print(report(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1, default=str))
    return 1 if figures["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
