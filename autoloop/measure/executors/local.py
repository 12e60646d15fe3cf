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
from autoloop.base.processes import signal_group
from autoloop.measure.measurer import MeasureHost

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


def local_slots(controller: MeasureHost, workers: int = 0) -> list[LocalSlot]:
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
    def __init__(self, controller: MeasureHost, index: int, cuda_device: str, device: str):
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
        from autoloop.gitops import GIT

        done = subprocess.run([*GIT, *args], cwd=str(cwd or self.c.repo.toplevel), capture_output=True, text=True)
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
        """Run `job` in a worker process of its own. The worker tells its process starts and
        its result through a pipe only this slot reads (`autoloop.measure.worker.ControlChannel`),
        and hears "abort" on its stdin: nothing travels through a file in the run folder, where
        an unsandboxed training could write. The worker runs from the run folder with
        autoloop's own import root first on its path (autoloop.measure.evaluation), so no file of
        the worktree is imported by trusted code."""
        import dataclasses

        from autoloop.base.processes import kill_process_group, process_start_time
        from autoloop.measure.worker import WARMED_ENV
        from autoloop.trust import bytecode
        from autoloop.trust.import_root import trusted_python_path

        run_dir = Path(run_dir)
        job_file = run_dir / "job.json"
        job = dataclasses.replace(job, project_dir=str(self.project_dir), run_dir=str(run_dir),
                                  env={**(job.env or {}), **self.device_env})
        job_file.write_text(job.to_json())
        env = dict(os.environ)
        env.update(self.device_env)
        env[WARMED_ENV] = json.dumps(bytecode.warmed())
        env["PYTHONPATH"] = trusted_python_path(env, Path(job.cache_root) if job.cache_root else None)
        control_read, control_write = os.pipe()
        with open(run_dir / "worker.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "autoloop.measure.worker", str(job_file), "--control-fd", str(control_write)],
                cwd=str(run_dir), env=env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, pass_fds=(control_write,),
            )
        os.close(control_write)
        store, run_id = self.c.store, self.c.run_row["id"]
        record = store.add_process(run_id, "worker", pid=proc.pid, pgid=proc.pid,
                                   pid_start_time=process_start_time(proc.pid), path=str(self.worktree))
        channel = _Control(control_read)
        started = None  # (pid, pgid, start_time) of the worker's current child, from the channel only
        abort_at = None
        try:
            while True:
                for message in channel.read(POLL_SECONDS):
                    if "started" in message:
                        started = _started(message["started"])
                        if started is not None and on_start is not None:
                            on_start(*started)
                if channel.closed:  # the worker closes its end only by exiting
                    try:
                        proc.wait(timeout=ABORT_GRACE_SECONDS)
                    except subprocess.TimeoutExpired:
                        signal_group(proc.pid, signal.SIGKILL)
                        proc.wait()
                    break
                if proc.poll() is not None:
                    channel.drain()
                    break
                if abort_at is None and should_abort is not None and should_abort():
                    try:
                        proc.stdin.write(b"abort\n")
                        proc.stdin.flush()
                    except OSError:
                        pass
                    abort_at = time.monotonic()
                if abort_at is not None and time.monotonic() - abort_at > ABORT_GRACE_SECONDS:
                    signal_group(proc.pid, signal.SIGKILL)
        except BaseException:
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            channel.close()
            try:
                proc.stdin.close()
            except OSError:
                pass
            store.end_process(record)
        if channel.result is not None:
            try:
                result = JobResult.from_dict(channel.result)
            except (ValueError, TypeError, KeyError) as exc:
                return _lost(self, f"its result is unreadable ({exc})")
            result.worker = self.name
            result.device = result.device or self.device
            return result
        if abort_at is not None:
            return JobResult(status="aborted", reason="interrupted by the user", worker=self.name, device=self.device)
        if started is not None:
            # Its training must not outlive it (it dies with its parent anyway: this is the
            # belt to those braces). Only the group the worker itself reported, and only if
            # its leader is the process that was started then.
            kill_process_group(started[1], expected_pid=started[0], expected_start_time=started[2])
        code = proc.returncode
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        tail = _tail(run_dir / "worker.log")
        return _lost(self, how + (f": {tail}" if tail else ""))

    def close(self) -> None:
        """The worktree stays (a resumed run reuses it); `git worktree prune` forgets it once deleted."""


class _Control:
    """The slot's end of a worker's control pipe: JSON lines, read as they come."""

    MAX_LINE = 16 << 20

    def __init__(self, fd: int):
        self.fd = fd
        self.buffer = b""
        self.closed = False
        self.result: dict | None = None

    def read(self, timeout: float) -> list[dict]:
        import select

        if self.closed:
            return []
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return []
        block = os.read(self.fd, 1 << 16)
        if not block:
            self.closed = True
        self.buffer += block
        messages = []
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict):
                if isinstance(message.get("result"), dict):
                    self.result = message["result"]
                messages.append(message)
        if len(self.buffer) > self.MAX_LINE:
            self.buffer = b""
        return messages

    def drain(self) -> None:
        """What the pipe still holds after the worker exited."""
        while not self.closed:
            if not self.read(0.5):
                if not self.closed:
                    break

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def _started(value) -> tuple[int, int, int | None] | None:
    if not isinstance(value, list) or len(value) != 3 or not all(isinstance(v, int) or v is None for v in value):
        return None
    pid, pgid, start = value
    return (pid, pgid, start) if pid and pgid and pid > 1 and pgid > 1 else None


def _lost(slot: LocalSlot, how: str) -> JobResult:
    return JobResult(status="lost", reason=f"worker {slot.name} lost: its process {how} before returning a result",
                     worker=slot.name, device=slot.device)


def _tail(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""
