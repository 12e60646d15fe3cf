"""The node side of a Ray slot: the actor that holds one GPU and runs one job at a time,
its guardian (no training outlives a lost actor), and the files that travel between the
controller's run folder and the node's (autoloop.measure.executors.ray says how a job goes).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from autoloop.errors import AutoloopError
from autoloop.measure.executors.ray_data import ensure_node_dataset, one_line

# The most of a streamed file (progress.jsonl, train.log) sent per poll.
STREAM_CHUNK_BYTES = 1 << 20
STREAMED_FILES = ("out/progress.jsonl", "train.log")
# Top-level folders of a run folder that are not sent back: the meta-only view of the
# dataset (the controller has the dataset) and the source snapshot (the controller has git).
SKIPPED_DIRS = ("data", "source")


# ---------------------------------------------------------------------------- job and result


def job_types():
    from autoloop.measure.job import JobResult, MeasureJob

    return MeasureJob, JobResult


def with_fields(obj, **changes):
    """`obj` with those of `changes` that are fields of its dataclass replaced."""
    names = {f.name for f in dataclasses.fields(obj)}
    return dataclasses.replace(obj, **{k: v for k, v in changes.items() if k in names})


def make_result(status: str, reason: str | None, **fields) -> Any:
    """A JobResult with the given status and reason, and those fields it has."""
    _, JobResult = job_types()
    names = {f.name for f in dataclasses.fields(JobResult)}
    return JobResult(status=status, reason=reason, **{k: v for k, v in fields.items() if k in names})


# Started by each actor, in a session of its own: when the actor's process is gone it kills
# the process groups the actor listed as running, then removes the actor's scratch folder
# (the node-side run folders, checkpoints included). run_training starts training in a session
# of its own, so without this a killed actor would leave its training running on the GPU.
# Ray kills an ending actor's own children (kill_child_processes_on_worker_exit), which
# killed a guard that was one before it could do either: so the guard leaves the actor's
# children first (it forks, says its pid on stdout, and the first half exits), and watches the
# actor through a pidfd, which a new process reusing the pid cannot satisfy.
_GUARD = r"""
import json, os, select, shutil, sys, time
actor, groups, scratch = int(sys.argv[1]), sys.argv[2], sys.argv[3]
try:
    watch = os.pidfd_open(actor)
except ProcessLookupError:  # gone already
    watch = -1
except (AttributeError, OSError):  # no pidfd here: the pid is polled
    watch = None
child = os.fork()
if child > 0:
    print(child, flush=True)
    os._exit(0)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the pipe was for the pid alone
try:
    from autoloop.base.processes import kill_process_group
except Exception:
    kill_process_group = None
if watch is None:
    while True:
        try:
            os.kill(actor, 0)
        except ProcessLookupError:
            break
        except OSError:
            pass
        time.sleep(0.5)
elif watch >= 0:
    select.select([watch], [], [])  # readable once the actor has ended
try:
    with open(groups) as handle:
        entries = json.load(handle)
except (OSError, ValueError):
    entries = []
for entry in entries:
    try:
        if kill_process_group is not None:
            kill_process_group(int(entry["pgid"]), expected_pid=entry.get("pid"),
                               expected_start_time=entry.get("start_time"), grace=2)
    except Exception:
        pass
shutil.rmtree(scratch, ignore_errors=True)
"""


def _device_name() -> str:
    """The name nvidia-smi gives this actor's GPU (Ray's GPU ids are physical indices), else
    "cpu". Not torch: initialising CUDA in the actor would hold GPU memory all along."""
    import ray

    from autoloop.envinfo import nvidia_smi_query

    try:
        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
    except Exception:
        gpu_ids = []
    if not gpu_ids or not shutil.which("nvidia-smi"):
        return "cpu"
    lines = nvidia_smi_query("--query-gpu=name", "-i", gpu_ids[0])
    return lines[0] if lines else "cpu"


def _collect_files(run_dir: Path, skip: dict[str, tuple[int, int]]) -> dict[str, bytes]:
    """The run folder's regular files by relative path, without SKIPPED_DIRS and without
    files the controller sent (`skip`: name -> (size, mtime_ns) as written)."""
    files: dict[str, bytes] = {}
    for path in sorted(run_dir.rglob("*")):
        rel = path.relative_to(run_dir)
        if rel.parts[0] in SKIPPED_DIRS or path.is_symlink() or not path.is_file():
            continue
        name = rel.as_posix()
        st = path.stat()
        if skip.get(name) == (st.st_size, st.st_mtime_ns):
            continue
        files[name] = path.read_bytes()
    return files


def _write_tree(root: Path, files: dict[str, Any]) -> None:
    for rel, content in files.items():
        dest = inside(root, rel)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            dest.write_text(content)
        else:
            dest.write_bytes(content)


def _extract_tar(data: bytes, dest: Path) -> None:
    """A `git archive` of the commit into the node's project folder (regular files and
    folders only, nothing outside `dest`)."""
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
        for member in members:
            inside(dest, member.name)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:  # pragma: no cover - Python before 3.10.12 / 3.11.4: the names were checked above
            tar.extractall(dest, members=members)


def inside(root: Path, rel: str) -> Path:
    dest = (root / rel).resolve()
    if not dest.is_relative_to(root.resolve()) or dest == root.resolve():
        raise AutoloopError(f"refusing the file name {rel!r}: it is not inside {root}")
    return dest


class JobActor:
    """The node side of one slot (a Ray actor holding one GPU); see the module docstring."""

    def __init__(self, name: str, env: dict[str, str], work_dir: str | None):
        os.environ.update(env)
        self.name = name
        base = Path(work_dir).expanduser() if work_dir else None
        if base is not None:
            base.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(tempfile.mkdtemp(prefix=f"autoloop-{name}-", dir=base))
        self._lock = threading.Lock()
        self._aborted: set[str] = set()  # the ids of jobs told to stop
        self._job_id: str | None = None
        self._processes: list[dict] = []
        self._run_dir: Path | None = None
        self._started = [0]  # processes started by the current job
        self._verified: set = set()
        self._device: str | None = None
        self._groups = self.scratch / "groups.json"
        self._groups.write_text("[]")
        first_half = subprocess.Popen(
            [sys.executable, "-c", _GUARD, str(os.getpid()), str(self._groups), str(self.scratch)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        said = first_half.stdout.readline()
        first_half.stdout.close()
        first_half.wait()
        self._guard_pid = int(said) if said.strip().isdigit() else None  # None: the guard did not start

    # -- called while a job runs (the actor is threaded)

    def info(self) -> dict:
        import ray

        return {"pid": os.getpid(), "host": socket.gethostname(), "node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "scratch": str(self.scratch),
                "guard_pid": self._guard_pid, "device": _device_name()}

    def abort(self, job_id: str) -> None:
        # By id: an abort that arrives before its job starts (or after it ended) still
        # stops that job and never the next one.
        with self._lock:
            self._aborted.add(job_id)

    def state(self, offsets: dict[str, int]) -> dict:
        with self._lock:
            processes = list(self._processes)
            run_dir = self._run_dir
        chunks = {}
        if run_dir is not None:
            from autoloop.trust.untrusted import UntrustedFile, open_beneath

            for name in STREAMED_FILES:
                try:  # the progress file is the trial's: never through a link, never a FIFO
                    fd = open_beneath(run_dir, name)
                except (OSError, UntrustedFile):
                    continue
                try:
                    os.lseek(fd, offsets.get(name, 0), os.SEEK_SET)
                    data = os.read(fd, STREAM_CHUNK_BYTES)
                except OSError:
                    continue
                finally:
                    os.close(fd)
                if data:
                    chunks[name] = data
        return {"started": bool(processes), "processes": processes, "chunks": chunks}

    # -- one job

    def _on_start(self, pid: int, pgid: int, start_time: int | None = None) -> None:
        with self._lock:
            self._processes.append({"pid": pid, "pgid": pgid, "start_time": start_time})
            self._started[0] += 1
            tmp = self._groups.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._processes))
            os.replace(tmp, self._groups)

    def _should_abort(self) -> bool:
        with self._lock:
            if self._job_id in self._aborted:
                return True
        try:
            import ray

            return bool(ray.get_runtime_context().is_canceled())
        except Exception:
            return False

    def run(self, payload: dict) -> dict:
        MeasureJob, JobResult = job_types()
        with self._lock:
            self._job_id = payload.get("job_id")
        work = Path(tempfile.mkdtemp(prefix="job-", dir=self.scratch))
        project, run_dir = work / "project", work / "run"
        project.mkdir()
        run_dir.mkdir()
        with self._lock:
            self._processes, self._run_dir = [], run_dir
        started = [0]
        self._started = started
        shipped: dict[str, tuple[int, int]] = {}
        try:
            job = MeasureJob.from_json(payload["job"])
            result = self._run(job, payload, project, run_dir, shipped)
        except Exception as exc:  # the node side's own failure: one line, never a traceback object
            result = make_result("crash", f"the Ray worker on {socket.gethostname()} failed: "
                                          f"{type(exc).__name__}: {one_line(exc)}")
        finally:
            with self._lock:
                self._processes = []
                self._groups.write_text("[]")
        if not getattr(result, "device", None):
            if self._device is None:
                self._device = _device_name()
            result = with_fields(result, device=self._device)
        result = with_fields(result, worker=self.name, files={})
        try:
            files = _collect_files(run_dir, shipped)
        finally:
            with self._lock:
                self._run_dir = None
                self._aborted.discard(self._job_id)
                self._job_id = None
            shutil.rmtree(work, ignore_errors=True)
        return {"result": result.to_json(), "files": files, "run_dir": str(run_dir), "project_dir": str(project),
                "host": socket.gethostname(), "started": started[0]}

    def _run(self, job, payload: dict, project: Path, run_dir: Path, shipped: dict):
        from autoloop.harness.fingerprint import harness_fingerprint

        host = socket.gethostname()
        if payload.get("project_tar"):
            _extract_tar(payload["project_tar"], project)
        _write_tree(project, dict(getattr(job, "sources", None) or {}))
        wanted = payload.get("harness_fingerprint")
        if wanted and harness_fingerprint() != wanted:
            return make_result("crash", (
                f"harness mismatch on node {host}: its autoloop harness has fingerprint {harness_fingerprint()[:16]}, "
                f"the controller's {wanted[:16]}; install the controller's autoloop version on the node"))
        data_dir, problem = ensure_node_dataset(payload["dataset"], self._verified)
        if problem:
            return make_result("crash", problem)
        # The controller's paths mean nothing here: None is the node's own default (its
        # interpreter, harness and cache); what training must not see is on the controller.
        env = {k: v for k, v in (getattr(job, "env", None) or {}).items() if k != "CUDA_VISIBLE_DEVICES"}
        changes: dict[str, Any] = {
            "data_dir": str(data_dir), "harness_dir": None, "pycache_root": None, "integrity_python": None,
            "cache_root": None, "compile_seed": None, "python": None, "hidden": [], "db_path": None,
            "project_dir": str(project), "run_dir": str(run_dir), "env": env,
        }
        if payload.get("checkpoint") is not None:
            checkpoint = run_dir / "out" / "checkpoint.pt"
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            checkpoint.write_bytes(payload["checkpoint"])
            st = checkpoint.stat()
            shipped["out/checkpoint.pt"] = (st.st_size, st.st_mtime_ns)
            changes["checkpoint"] = str(checkpoint)
        job = with_fields(job, **changes)
        from autoloop.measure.worker import run_job

        return run_job(job, project_dir=project, run_dir=run_dir, on_start=self._on_start,
                       should_abort=self._should_abort)


