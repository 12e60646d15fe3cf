"""The local executor: one worker per GPU of this machine, each in its own git worktree.

Worker k trains in `.autoloop/<tag>/workers/w<k>` (a `git worktree add --detach` of the
repository, checked out at the commit it measures) with `CUDA_VISIBLE_DEVICES` naming its
GPU, so trials never share a device or a working tree. Every job runs in a worker process
(`python -m autoloop.measure.worker`) in its own process group, recorded in the `processes` table,
so a crash of the controller leaves nothing behind that recovery cannot end; a worker
killed mid-job (the OOM killer, a user) returns status "lost" and its trial is
interrupted, its idea back in the queue, while the others go on.

On a machine without a GPU, `workers` gives that many pretend devices ("cpu"): the
scheduling, worktrees and pinning are real, only the devices are not.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from autoloop.errors import AutoloopError
from autoloop.measure.job import JobResult

POLL_SECONDS = 0.2
ABORT_GRACE_SECONDS = 30.0  # a worker asked to stop gets this long to kill its training and say so


def visible_gpus() -> list[tuple[str, str]]:
    """(CUDA_VISIBLE_DEVICES entry, device name) per GPU this process may use."""
    from autoloop.envinfo import nvidia_smi_query

    names = nvidia_smi_query("--query-gpu=index,name")
    gpus = []
    for line in names:
        index, _, name = line.partition(",")
        gpus.append((index.strip(), name.strip()))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        by_index = dict(gpus)
        # Entries may be indices or UUIDs; a UUID keeps its place, named by the first GPU's model.
        default = gpus[0][1] if gpus else "cuda"
        gpus = [(w, by_index.get(w, default)) for w in wanted]
    return gpus


def local_slots(controller, workers: int = 0) -> list[LocalSlot]:
    """One slot per visible GPU (at most `workers`), or `workers` pretend CPU devices."""
    gpus = visible_gpus()
    if gpus:
        if workers and workers > len(gpus):
            raise AutoloopError(f"--workers {workers} but this machine shows {len(gpus)} GPU(s) "
                                f"({', '.join(g for g, _ in gpus)}): trials never share a GPU; pass --workers "
                                f"{len(gpus)} or fewer")
        gpus = gpus[:workers] if workers else gpus
    else:
        if not workers:
            raise AutoloopError("--executor local found no GPU (nvidia-smi shows none): pass --workers N to run "
                                "N workers on pretend devices (CPU training), or use the serial executor")
        gpus = [(str(k), "cpu") for k in range(workers)]
    return [LocalSlot(controller, k, visible, name) for k, (visible, name) in enumerate(gpus)]


class LocalSlot:
    def __init__(self, controller, index: int, cuda_device: str, device: str):
        self.c = controller
        self.index = index
        self.name = f"w{index}"
        self.device = device
        self.device_env = {"CUDA_VISIBLE_DEVICES": cuda_device}
        self.worktree = controller.state_dir / controller.tag / "workers" / self.name
        self._lock = threading.Lock()
        self._ensure_worktree()
        prefix = controller.repo.prefix.rstrip("/")
        self.project_dir = self.worktree / prefix if prefix else self.worktree

    # ------------------------------------------------------------------ the worktree

    def _git(self, *args: str, cwd: Path | None = None) -> str:
        done = subprocess.run(["git", *args], cwd=str(cwd or self.c.repo.toplevel), capture_output=True, text=True)
        if done.returncode != 0:
            raise AutoloopError(f"git {' '.join(args[:2])} failed for worker {self.name}: "
                                f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        return done.stdout.strip()

    def _ensure_worktree(self) -> None:
        if (self.worktree / ".git").exists():
            return
        self.worktree.parent.mkdir(parents=True, exist_ok=True)
        self._git("worktree", "prune")
        self._git("worktree", "add", "--detach", "--force", str(self.worktree), self.c.best_commit())

    def prepare(self, commit: str) -> None:
        """The worktree at `commit`, exactly: a detached checkout touches no branch or ref."""
        with self._lock:
            self._git("checkout", "--quiet", "--force", "--detach", commit, cwd=self.worktree)
            self._git("clean", "--quiet", "-fdx", "--exclude=__pycache__", cwd=self.worktree)

    # ------------------------------------------------------------------ one job

    def run(self, job, run_dir: Path, on_start=None, should_abort=None) -> JobResult:
        run_dir = Path(run_dir)
        job_file, result_file = run_dir / "job.json", run_dir / "job-result.json"
        for stale in (result_file, run_dir / "pids.json", run_dir / "ABORT"):
            stale.unlink(missing_ok=True)
        import dataclasses

        job = dataclasses.replace(job, project_dir=str(self.project_dir), run_dir=str(run_dir),
                                  env={**(job.env or {}), **self.device_env})
        job_file.write_text(job.to_json())
        env = dict(os.environ)
        env.update(self.device_env)
        from autoloop.trust import bytecode
        from autoloop.measure.worker import WARMED_ENV

        env[WARMED_ENV] = json.dumps(bytecode.warmed())
        from autoloop.measure.runner import process_start_time

        proc = subprocess.Popen(
            [sys.executable, "-m", "autoloop.measure.worker", str(job_file), str(result_file)],
            cwd=str(self.project_dir), env=env, stdin=subprocess.DEVNULL,
            stdout=open(run_dir / "worker.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True,
        )
        store, run_id = self.c.store, self.c.run_row["id"]
        record = store.add_process(run_id, "worker", pid=proc.pid, pgid=proc.pid,
                                   pid_start_time=process_start_time(proc.pid), path=str(self.worktree))
        seen_pids = None
        abort_at = None
        try:
            while proc.poll() is None:
                seen_pids = self._forward_pids(run_dir, seen_pids, on_start)
                if abort_at is None and should_abort is not None and should_abort():
                    (run_dir / "ABORT").touch()
                    abort_at = time.monotonic()
                if abort_at is not None and time.monotonic() - abort_at > ABORT_GRACE_SECONDS:
                    _kill_group(proc.pid)
                time.sleep(POLL_SECONDS)
            self._forward_pids(run_dir, seen_pids, on_start)
        except BaseException:
            _kill_group(proc.pid)
            proc.wait()
            raise
        finally:
            store.end_process(record)
        if result_file.exists():
            try:
                result = JobResult.from_json(result_file.read_text())
            except (ValueError, TypeError, KeyError) as exc:
                return _lost(self, f"its result file is unreadable ({exc})")
            result.worker = self.name
            result.device = result.device or self.device
            return result
        if abort_at is not None:
            return JobResult(status="aborted", reason="interrupted by the user", worker=self.name, device=self.device)
        if seen_pids is not None and seen_pids[1]:
            # Its training must not outlive it (unsandboxed, training has a session of its own).
            from autoloop.measure.runner import kill_process_group

            kill_process_group(int(seen_pids[1]), expected_pid=seen_pids[0], expected_start_time=seen_pids[2])
        code = proc.returncode
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        tail = _tail(run_dir / "worker.log")
        return _lost(self, how + (f": {tail}" if tail else ""))

    def _forward_pids(self, run_dir: Path, seen, on_start):
        """Tell the controller each training or evaluation process the worker starts, so
        the trial row names the group that recovery must end."""
        path = run_dir / "pids.json"
        try:
            pids = json.loads(path.read_text())
        except (OSError, ValueError):
            return seen
        key = (pids.get("pid"), pids.get("pgid"), pids.get("start_time"))
        if key != seen and on_start is not None and pids.get("pid"):
            on_start(int(pids["pid"]), int(pids.get("pgid") or pids["pid"]), pids.get("start_time"))
        return key

    def close(self) -> None:
        """The worktree stays (a resumed run reuses it); `git worktree prune` forgets it once deleted."""


def _lost(slot: LocalSlot, how: str) -> JobResult:
    return JobResult(status="lost", reason=f"worker {slot.name} lost: its process {how} before returning a result",
                     worker=slot.name, device=slot.device)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""
