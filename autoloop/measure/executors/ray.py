"""The Ray executor: measurements run on the GPUs of a Ray cluster, one slot per GPU.

`RayExecutor(address=...)` joins a running cluster (`ray start --head` on one machine,
`ray start --address=...` on the others), or with no address starts a local one. Each
`RaySlot` owns one Ray actor created with `num_gpus=1`: Ray pins that GPU to it
(CUDA_VISIBLE_DEVICES), and the actor's death - its process killed, its node gone - is
told apart from a job that failed. A slot runs one job at a time:

controller side (`RaySlot.run`, in the trial's thread)
    sends the job (MeasureJob as JSON), the controller's dataset name, recipe and
    fingerprint, the harness fingerprint, the commit's tracked files (`git archive`, with
    `repo_dir`) and, for a verify job, the checkpoint's bytes;
    polls the actor every half second: new lines of progress.jsonl and train.log are
    appended to the controller's run folder as they come (the live display and `autoloop
    status` read them there), `should_abort()` is asked, `on_start` is called once the
    remote training process has started;
    writes the files of the node's run folder into the controller's `run_dir` at the end
    (train.log, result.json, progress.jsonl, checkpoint.pt, eval/ or verify/; not the
    meta-only data/ view nor source/), so the JobResult it returns has `files` empty.

node side (`_JobActor.run`)
    writes the commit's files as a node-local project folder (its tracked files when the
    slot knows the repository, then the editable ones, `job.sources`); makes sure the
    dataset is on the node (prepared into the node's cache with `autoloop prepare`'s code
    if it is not) and that its fingerprint is the controller's, and the same for the
    harness's code: different data or a different harness gives a failed result naming
    both fingerprints and the fix, never a measurement on other data; then runs
    `autoloop.measure.worker.run_job` with the job pointed at the node's paths.

How things end:
* the actor dies (process killed, node lost, out of memory): status "lost", reason
  "worker lost: ...", and the slot creates a new actor for its next job. A guardian
  process started by each actor kills the training's process group when the actor dies,
  so a lost worker never leaves a training process holding the GPU.
* abort (`should_abort()` true): the actor is told to stop (run_job kills the training
  and returns "aborted"); if it has not answered after ABORT_GRACE_SECONDS the call is
  cancelled with `ray.cancel` (Ray allows only a cooperative cancel for actor calls), and
  CANCEL_GRACE_SECONDS later the actor is killed. Status "aborted" in every case.
* an error in the node-side code itself: status "crash" with the error.

`on_start` is called with `(None, None, None)`: the training process runs on another
machine, so its pid means nothing to this one and must not be recorded for crash
recovery (which kills recorded process groups); the actor and its guardian clean up.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from autoloop.errors import AutoloopError

POLL_SECONDS = 0.5
# After an abort: how long run_job may take to stop its process group (the runner's own
# SIGTERM grace plus its wait for the group) before the call is cancelled, and how long
# after that before the actor itself is killed.
ABORT_GRACE_SECONDS = 45.0
CANCEL_GRACE_SECONDS = 15.0
# How long RayExecutor waits for its actors to start before it goes on without waiting
# (a busy cluster may keep them pending; an actor that fails to start is an error at once).
START_TIMEOUT_SECONDS = 120.0
# The most of a streamed file (progress.jsonl, train.log) sent per poll.
STREAM_CHUNK_BYTES = 1 << 20
STREAMED_FILES = ("out/progress.jsonl", "train.log")
# Top-level folders of a run folder that are not sent back: the meta-only view of the
# dataset (the controller has the dataset) and the source snapshot (the controller has git).
SKIPPED_DIRS = ("data", "source")
# Ray's unix sockets live under its temp folder: sun_path holds 107 bytes, and Ray adds
# about 60 characters of its own.
MAX_TEMP_DIR_CHARS = 45
# The most a commit's tracked files (git archive) may weigh to be sent to a node.
MAX_PROJECT_BYTES = 256 << 20


def _import_ray():
    try:
        import ray
    except ImportError:
        raise AutoloopError(
            "the Ray executor needs ray, which is not installed: pip install -e '.[ray]' "
            "(on the controller and on every node of the cluster)"
        ) from None
    return ray


def _one_line(text: Any, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------- job and result


def _job_types():
    from autoloop.measure.job import JobResult, MeasureJob

    return MeasureJob, JobResult


def _with_fields(obj, **changes):
    """`obj` with those of `changes` that are fields of its dataclass replaced."""
    names = {f.name for f in dataclasses.fields(obj)}
    return dataclasses.replace(obj, **{k: v for k, v in changes.items() if k in names})


def make_result(status: str, reason: str | None, **fields) -> Any:
    """A JobResult with the given status and reason, and those fields it has."""
    _, JobResult = _job_types()
    names = {f.name for f in dataclasses.fields(JobResult)}
    return JobResult(status=status, reason=reason, **{k: v for k, v in fields.items() if k in names})


def _as_dict(serialized) -> dict:
    return json.loads(serialized) if isinstance(serialized, (str, bytes)) else dict(serialized)


def _replace_path(value, old: str, new: str):
    """`value` (JSON-like) with the path `old` replaced by `new` in every string (the node's
    run folder in a reason or an error tail becomes the controller's)."""
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, list):
        return [_replace_path(v, old, new) for v in value]
    if isinstance(value, dict):
        return {k: _replace_path(v, old, new) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------- the dataset on a node


def dataset_spec(job) -> dict:
    """What a node needs to find or prepare the controller's dataset (controller side):
    its name, its preparation recipe (from the controller's meta.json), its fingerprint."""
    from autoloop.harness.contract import embedded_dataset_name

    data_dir = Path(job.data_dir) if getattr(job, "data_dir", None) else None
    meta: dict = {}
    if data_dir is not None:
        try:
            meta = json.loads((data_dir / "meta.json").read_text())
        except (OSError, ValueError):
            meta = {}
    name = meta.get("name") or (data_dir.name if data_dir is not None else None) or embedded_dataset_name()
    return {
        "name": name,
        "dataset": getattr(job, "dataset", None),
        "recipe": meta.get("recipe"),
        "fingerprint": getattr(job, "data_fingerprint", None) or meta.get("fingerprint"),
        "controller_dir": str(data_dir) if data_dir is not None else None,
        "embedded": name == embedded_dataset_name() and not meta.get("recipe"),
    }


def _prepare_command(spec: dict) -> str:
    recipe = spec.get("recipe") or {}
    source = recipe.get("source") or {}
    if source.get("kind") == "hub":
        from autoloop.prepare import find_hub_dataset

        hub = find_hub_dataset(source.get("repo_id", ""))
        shards = len((source.get("files") or {}).get("train") or [])
        what = f"{hub.key if hub else source.get('repo_id')} --shards {shards}"
    elif source.get("kind") == "local":
        what = source.get("path")
    else:
        what = "NAME_OR_PATH"
    tok = recipe.get("tokenizer", "bpe")
    vocab = f" --vocab-size {recipe['vocab_size']}" if tok == "bpe" and recipe.get("vocab_size") else ""
    return f"autoloop prepare --dataset {what} --tokenizer {tok}{vocab} --name {spec['name']} --force"


def _prepare_on_node(spec: dict, path: Path) -> str | None:
    """Prepare the controller's dataset into the node's cache as `path`, from the recipe in
    the controller's meta.json (autoloop.prepare.prepare_dataset, the code of `autoloop
    prepare`). Returns why it cannot, or None. The embedded corpus is generated from the
    node's own key (autoloop/harness/corpus_key.py): the same corpus only where the
    controller's key was copied; the fingerprint check after says so otherwise."""
    name = spec["name"]
    if spec.get("embedded"):
        from autoloop.harness.data import prepare_embedded

        prepare_embedded(path)
        return None
    recipe = spec.get("recipe") or {}
    source = recipe.get("source") or {}
    from autoloop.prepare import prepare_dataset

    tokenizer = recipe.get("tokenizer", "bpe")
    options: dict = {"tokenizer": tokenizer, "name": name}
    if tokenizer == "bpe":
        options["vocab_size"] = recipe.get("vocab_size")
        if recipe.get("sample_chars"):
            options["sample_chars"] = recipe["sample_chars"]
    if source.get("kind") == "hub":
        from autoloop.prepare import MANIFEST, find_hub_dataset, hub_dir

        hub = find_hub_dataset(source.get("repo_id", ""))
        if hub is None:
            return f"the controller's dataset {name} comes from {source.get('repo_id')}, which this node's autoloop does not know"
        revision = source.get("revision")
        root = hub_dir() / hub.repo_id
        if revision and revision != "unknown" and not (root / MANIFEST).exists():
            # Download the revision the controller's data came from, not today's.
            root.mkdir(parents=True, exist_ok=True)
            (root / MANIFEST).write_text(json.dumps({"repo_id": hub.repo_id, "revision": revision}))
        prepare_dataset(hub.key, shards=len((source.get("files") or {}).get("train") or []) or None, **options)
        return None
    if source.get("kind") == "local":
        where = Path(source.get("path", ""))
        if not where.exists():
            return (f"the controller's dataset {name} was prepared from {where}, which this node does not have: "
                    f"copy the files there, or prepare the same data on the node with `{_prepare_command(spec)}`")
        prepare_dataset(str(where), **options)
        return None
    return (f"the controller's dataset {name} has no preparation recipe in its meta.json (prepared by hand or by an "
            f"older autoloop), so this node cannot prepare it: copy {spec.get('controller_dir')} to {path}")


def _node_lock(path: Path):
    import contextlib
    import fcntl

    @contextlib.contextmanager
    def lock():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / f".{path.name}.ray-lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    return lock()


def _fingerprint_of(path: Path) -> str | None:
    try:
        return json.loads((path / "meta.json").read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def ensure_node_dataset(spec: dict, verified: set | None = None) -> tuple[Path | None, str | None]:
    """The node's copy of the controller's dataset: `(path, None)`, or `(None, why not)`.

    Looked up by name in the node's cache (`cache_root()/data/<name>`, as `autoloop
    prepare` writes it). If absent there, the controller's own folder is used when the
    node sees it with the same fingerprint (a shared file system, or the controller's
    machine); else the dataset is prepared into the node's cache from the recipe in the
    controller's meta.json, as `autoloop prepare` does (the embedded corpus: as on first use).
    The node's fingerprint must be the controller's: a node never measures on other data.
    Its split files are re-hashed once per process (`verified` remembers which).
    """
    from autoloop.harness.data import load_dataset, verify_dataset
    from autoloop.harness.errors import HarnessError
    from autoloop.prepare import prepared_root

    name, wanted = spec["name"], spec.get("fingerprint")
    host = socket.gethostname()
    path = prepared_root() / name
    shared = Path(spec["controller_dir"]) if spec.get("controller_dir") else None
    with _node_lock(path):
        if not (path / "meta.json").exists():
            if shared is not None and shared != path and _fingerprint_of(shared) == wanted and wanted:
                path = shared  # the controller's own folder, seen through a shared file system
            else:
                try:
                    problem = _prepare_on_node(spec, path)
                except (AutoloopError, HarnessError) as exc:
                    problem = f"preparing it failed: {_one_line(exc)}"
                if problem:
                    return None, f"the dataset {name} is not on node {host}: {problem}"
        try:
            ds = load_dataset(path, prepare=False)
        except HarnessError as exc:
            return None, f"the dataset {name} on node {host} cannot be read: {_one_line(exc)}"
        if wanted and ds.fingerprint != wanted:
            if spec.get("embedded"):
                from autoloop.harness.corpus_key import corpus_key_path

                fix = (f"the embedded corpus is generated from the key in the cache folder, so copy the controller's "
                       f"key to {corpus_key_path()} on the node (mode 0600) and remove {path} there, "
                       "or use a prepared dataset (autoloop prepare)")
            else:
                fix = (f"prepare the controller's data on the node (`{_prepare_command(spec)}`) or remove {path} "
                       "there so that it is prepared again")
            return None, (
                f"data fingerprint mismatch on node {host}: its {name} ({path}) has fingerprint {ds.fingerprint[:16]}, "
                f"the controller's has {wanted[:16]}; no measurement on other data: {fix}"
            )
        key = (str(path), ds.fingerprint)
        if verified is not None and key not in verified:
            changed = verify_dataset(ds)
            if changed:
                return None, (f"the dataset {name} on node {host} ({path}) is damaged: its {', '.join(changed)} split(s) "
                              f"no longer match meta.json; remove {path} there so that it is prepared again")
            verified.add(key)
    return path, None


# ---------------------------------------------------------------------------- the actor

# Started by each actor, in a session of its own: when the actor's process is gone (its
# parent changes) it kills the process groups the actor listed as running, then removes
# the actor's scratch folder. run_training starts training in a session of its own, so
# without this a killed actor would leave its training running on the GPU.
_GUARD = r"""
import json, os, shutil, sys, time
actor, groups, scratch = int(sys.argv[1]), sys.argv[2], sys.argv[3]
try:
    from autoloop.measure.runner import kill_process_group
except Exception:
    kill_process_group = None
while os.getppid() == actor:
    time.sleep(0.5)
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
        dest = _inside(root, rel)
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
            _inside(dest, member.name)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:  # pragma: no cover - Python before 3.10.12 / 3.11.4: the names were checked above
            tar.extractall(dest, members=members)


def _inside(root: Path, rel: str) -> Path:
    dest = (root / rel).resolve()
    if not dest.is_relative_to(root.resolve()) or dest == root.resolve():
        raise AutoloopError(f"refusing the file name {rel!r}: it is not inside {root}")
    return dest


class _JobActor:
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
        self._guard = subprocess.Popen(
            [sys.executable, "-c", _GUARD, str(os.getpid()), str(self._groups), str(self.scratch)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )

    # -- called while a job runs (the actor is threaded)

    def info(self) -> dict:
        import ray

        return {"pid": os.getpid(), "host": socket.gethostname(), "node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "scratch": str(self.scratch),
                "guard_pid": self._guard.pid, "device": _device_name()}

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
        MeasureJob, JobResult = _job_types()
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
                                          f"{type(exc).__name__}: {_one_line(exc)}")
        finally:
            with self._lock:
                self._processes = []
                self._groups.write_text("[]")
        if not getattr(result, "device", None):
            if self._device is None:
                self._device = _device_name()
            result = _with_fields(result, device=self._device)
        result = _with_fields(result, worker=self.name, files={})
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
        job = _with_fields(job, **changes)
        from autoloop.measure.worker import run_job

        return run_job(job, project_dir=project, run_dir=run_dir, on_start=self._on_start,
                       should_abort=self._should_abort)


# ---------------------------------------------------------------------------- controller side


_LOST_ERRORS = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError", "NodeDiedError",
                "ObjectLostError", "OwnerDiedError", "ObjectReconstructionFailedError", "LocalRayletDiedError",
                "ActorUnschedulableError", "RaySystemError")


def _is_lost(exc: BaseException) -> bool:
    return any(cls.__name__ in _LOST_ERRORS for cls in type(exc).__mro__)


class RaySlot:
    """One GPU of the cluster: a Ray actor with num_gpus=1, created on first use and again
    after it is lost. See the module docstring for what `run` does."""

    def __init__(self, index: int, *, num_gpus: float, num_cpus: float, env: dict[str, str],
                 work_dir: str | None, repo_dir: str | os.PathLike | None = None):
        self.index = index
        self.name = f"ray-w{index}"
        self.project_dir = None  # remote: the job carries its files
        self.device_env: dict[str, str] = {}
        self._num_gpus, self._num_cpus = num_gpus, num_cpus
        self._env, self._work_dir = dict(env), work_dir
        self.repo_dir = Path(repo_dir) if repo_dir is not None else None
        self._archive: tuple[str, bytes] | None = None  # (commit, git archive) of the last job
        self._actor = None
        self._harness_fps: dict[str, str] = {}
        self.last_state: dict = {}  # the node's last report while a job ran (processes, ...)
        self._device: str | None = None

    # -- the actor

    def _ensure_actor(self):
        ray = _import_ray()
        if self._actor is None:
            cls = ray.remote(_JobActor)
            self._actor = cls.options(num_gpus=self._num_gpus, num_cpus=self._num_cpus, max_concurrency=4,
                                      max_restarts=0).remote(self.name, self._env, self._work_dir)
        return self._actor

    def actor_info(self, timeout: float | None = 60) -> dict:
        """The actor's pid, host, node id, GPU ids and scratch folder (starts it if needed)."""
        ray = _import_ray()
        return ray.get(self._ensure_actor().info.remote(), timeout=timeout)

    def _drop_actor(self) -> None:
        ray = _import_ray()
        actor, self._actor = self._actor, None
        if actor is not None:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass

    # -- the Slot protocol

    @property
    def device(self) -> str:
        """The GPU model of this slot's node (asked once): comparisons pair runs on one kind."""
        if self._device is None:
            try:
                self._device = str(self.actor_info().get("device") or "cpu")
            except Exception:  # noqa: BLE001 - an actor that cannot answer is found lost at its first job
                self._device = "unknown"
        return self._device

    def prepare(self, commit: str) -> None:
        """Nothing to check out: the job carries the commit's files."""

    def close(self) -> None:
        self._drop_actor()

    def _harness_fingerprint(self, job) -> str:
        from autoloop.harness.fingerprint import compute_harness_fingerprint
        from autoloop.trust.integrity import harness_dir

        where = str(getattr(job, "harness_dir", None) or harness_dir())
        if where not in self._harness_fps:
            self._harness_fps[where] = compute_harness_fingerprint(Path(where))
        return self._harness_fps[where]

    def _project_tar(self, commit: str | None) -> bytes | None:
        """The commit's tracked files as a tar (`git archive`), when the slot knows the
        repository: files train.py imports besides the editable ones (job.sources) reach
        the node too."""
        if self.repo_dir is None or not commit:
            return None
        if self._archive is None or self._archive[0] != commit:
            out = subprocess.run(["git", "archive", "--format=tar", commit], cwd=self.repo_dir, capture_output=True)
            if out.returncode != 0:
                raise AutoloopError(f"cannot archive commit {commit[:12]} of {self.repo_dir} for the Ray worker: "
                                    f"{_one_line(out.stderr.decode(errors='replace'))}")
            if len(out.stdout) > MAX_PROJECT_BYTES:
                raise AutoloopError(
                    f"commit {commit[:12]} holds {len(out.stdout) >> 20} MiB of tracked files, more than the "
                    f"{MAX_PROJECT_BYTES >> 20} MiB a Ray worker is sent: keep data and weights out of git")
            self._archive = (commit, out.stdout)
        return self._archive[1]

    def _payload(self, job) -> dict:
        # The run's harness fingerprint when the job carries it, else the controller's harness.
        harness_fp = getattr(job, "harness_fingerprint", None) or self._harness_fingerprint(job)
        checkpoint = None
        if getattr(job, "kind", None) == "verify" and getattr(job, "checkpoint", None):
            path = Path(job.checkpoint)
            try:
                checkpoint = path.read_bytes()
            except OSError as exc:
                raise AutoloopError(f"cannot read the checkpoint {path} to send it to the Ray worker: {exc.strerror}") from None
        return {"job_id": uuid.uuid4().hex, "job": job.to_json(), "dataset": dataset_spec(job),
                "harness_fingerprint": harness_fp, "checkpoint": checkpoint,
                "project_tar": self._project_tar(getattr(job, "commit", None))}

    def run(self, job, run_dir, on_start: Callable | None = None, should_abort: Callable[[], bool] | None = None):
        ray = _import_ray()
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            payload = self._payload(job)
        except AutoloopError as exc:
            return make_result("crash", str(exc), worker=self.name)
        self.last_state = {}
        actor = self._ensure_actor()
        ref = actor.run.remote(payload)
        job_id = payload["job_id"]
        offsets = {name: 0 for name in STREAMED_FILES}
        state_ref = None
        started = False
        abort_at = cancel_at = None
        try:
            while True:
                ready, _ = ray.wait([ref], timeout=POLL_SECONDS)
                if ready:
                    break
                if state_ref is not None and ray.wait([state_ref], timeout=0)[0]:
                    try:
                        state = ray.get(state_ref)
                    except Exception:
                        state = None  # the actor is going: the job's own call says how
                    state_ref = None
                    if state is not None:
                        self.last_state = state
                        self._append_chunks(run_dir, state["chunks"], offsets)
                        if state["started"] and not started:
                            started = True
                            if on_start is not None:
                                on_start(None, None, None)
                if state_ref is None:
                    state_ref = actor.state.remote(dict(offsets))
                now = time.monotonic()
                if abort_at is None and should_abort is not None and should_abort():
                    abort_at = now
                    actor.abort.remote(job_id)
                elif abort_at is not None and cancel_at is None and now - abort_at > ABORT_GRACE_SECONDS:
                    cancel_at = now
                    ray.cancel(ref)
                elif cancel_at is not None and now - cancel_at > CANCEL_GRACE_SECONDS:
                    self._drop_actor()
                    return make_result("aborted", "interrupted by the user (the Ray worker did not stop: it was killed)",
                                       worker=self.name)
        except BaseException:
            # The controller's own callback failed (or it is being interrupted): the remote
            # work must not go on unwatched. Killing the actor makes its guardian kill the training.
            self._drop_actor()
            raise
        try:
            out = ray.get(ref)
        except Exception as exc:
            lost = _is_lost(exc)
            if lost:
                self._drop_actor()
            if abort_at is not None or type(exc).__name__ == "TaskCancelledError":
                return make_result("aborted", "interrupted by the user", worker=self.name)
            if lost:
                return make_result("lost", f"worker lost: {type(exc).__name__}: {_one_line(_lost_cause(exc))}",
                                   worker=self.name)
            return make_result("crash", f"the Ray worker failed: {type(exc).__name__}: {_one_line(exc)}", worker=self.name)
        if out.get("started") and not started and on_start is not None:
            on_start(None, None, None)  # a run too short for the polls to see it start
        return self._finish(out, run_dir)

    def _append_chunks(self, run_dir: Path, chunks: dict[str, bytes], offsets: dict[str, int]) -> None:
        for name, data in chunks.items():
            # The first chunk replaces what a run folder held before (a run the controller did
            # not live to record); a file the node never writes (a verify job's) is left alone.
            (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
            with open(run_dir / name, "ab" if offsets.get(name) else "wb") as handle:
                handle.write(data)
            offsets[name] = offsets.get(name, 0) + len(data)

    def _finish(self, out: dict, run_dir: Path):
        _, JobResult = _job_types()
        for rel, content in out["files"].items():
            dest = _inside(run_dir, rel)
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.part")
            tmp.write_bytes(content)
            os.replace(tmp, dest)
        data = _as_dict(out["result"])
        data = _replace_path(data, out["run_dir"], str(run_dir))
        result = JobResult.from_json(json.dumps(data) if isinstance(out["result"], str) else data)
        return _with_fields(result, worker=self.name, files={})


def _lost_cause(exc: BaseException) -> str:
    # Ray's messages run over many lines; the first line and the exit detail say what happened.
    text = str(exc)
    detail = ""
    for marker in ("Worker exit detail:", "The actor is dead because"):
        at = text.find(marker)
        if at >= 0:
            detail = text[at:].split("\n")[0]
            break
    first = text.strip().split("\n")[0]
    return f"{first} {detail}".strip()


def check_temp_dir(temp_dir: str | os.PathLike) -> str:
    """Ray's temp folder as an absolute path, refused when Ray's socket paths under it
    would not fit in a unix socket address."""
    path = str(Path(temp_dir).expanduser().absolute())
    if len(path) > MAX_TEMP_DIR_CHARS:
        raise AutoloopError(
            f"Ray's temp folder {path} is too long ({len(path)} characters, at most {MAX_TEMP_DIR_CHARS}: Ray's "
            "unix socket paths must fit in 107 bytes): give a shorter one, e.g. under /tmp")
    return path


def slot_count(gpus: int, workers: int | None, where: str = "the Ray cluster") -> int:
    """One slot per GPU, at most `workers`; `workers` CPU slots on a cluster without GPUs."""
    if gpus == 0 and not workers:
        raise AutoloopError(f"{where} has no GPU: add GPU nodes, or give a number of workers to run on CPUs")
    return min(gpus, workers) if gpus and workers else (gpus or workers)


class RayExecutor:
    """Slots on a Ray cluster, one per GPU (see the module docstring).

    address: a running cluster ("auto", "ray://host:10001", "host:6379"); None starts a
        local cluster in this process (stopped again by close()).
    workers: at most this many slots; on a cluster without GPUs, this many CPU slots
        (a cluster with no GPU and no `workers` is refused).
    temp_dir: Ray's temp files, logs and sockets when starting a local cluster (short:
        Ray's unix socket paths must fit in 107 bytes).
    num_cpus, num_gpus: the resources of a local cluster (default: what Ray detects).
    cpus_per_worker: CPUs each actor reserves.
    node_env: environment variables set in each actor (e.g. AUTOLOOP_CACHE_DIR: where a
        node keeps its prepared datasets); node_cache_dir is shorthand for that one.
    work_dir: the parent of each actor's scratch folder on its node (default: the node's tmp).
    repo_dir: the project's git repository: each job then sends the commit's tracked files
        (`git archive`), so modules train.py imports that are not editable reach the node;
        without it the node's project is the job's editable files (job.sources) only.
    """

    def __init__(self, address: str | None = None, workers: int | None = None, temp_dir: str | os.PathLike | None = None,
                 *, num_cpus: int | None = None, num_gpus: int | None = None, cpus_per_worker: float = 1,
                 node_env: dict[str, str] | None = None, node_cache_dir: str | os.PathLike | None = None,
                 work_dir: str | None = None, repo_dir: str | os.PathLike | None = None,
                 num_workers: int | None = None,
                 start_timeout: float = START_TIMEOUT_SECONDS):
        ray = _import_ray()
        workers = workers if workers is not None else num_workers
        if workers is not None and workers < 1:
            raise AutoloopError(f"workers = {workers}: give at least 1, or leave it unset for one worker per GPU")
        self.address = address
        self.started_ray = False
        self._saved_env: dict[str, str | None] = {}
        self.slots: list[RaySlot] = []
        if not ray.is_initialized():
            self._init(ray, address, temp_dir, num_cpus, num_gpus)
        try:
            resources = ray.cluster_resources()
            gpus = int(resources.get("GPU", 0))
            where = f"the Ray cluster at {address}" if address else "the local Ray cluster"
            count = slot_count(gpus, workers, where)
            env = {k: str(v) for k, v in (node_env or {}).items()}
            if node_cache_dir is not None:
                env["AUTOLOOP_CACHE_DIR"] = str(node_cache_dir)
            self.gpus = gpus
            self.slots = [RaySlot(k, num_gpus=1 if gpus else 0, num_cpus=cpus_per_worker, env=env, work_dir=work_dir,
                                  repo_dir=repo_dir) for k in range(count)]
            self._start_actors(ray, start_timeout)
        except BaseException:
            self.close()
            raise

    def _init(self, ray, address, temp_dir, num_cpus, num_gpus) -> None:
        def setenv(name: str, value: str) -> None:
            if name not in self._saved_env:
                self._saved_env[name] = os.environ.get(name)
            os.environ[name] = value

        if os.environ.get("RAY_USAGE_STATS_ENABLED") is None:
            setenv("RAY_USAGE_STATS_ENABLED", "0")
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING}
        if address:
            kwargs["address"] = address
        else:
            if os.environ.get("RAY_AUTH_MODE") is None:
                setenv("RAY_AUTH_MODE", "disabled")  # a cluster of this process only: no token in ~/.ray
            if temp_dir is not None:
                temp_dir = check_temp_dir(temp_dir)
                Path(temp_dir).mkdir(parents=True, exist_ok=True)
                setenv("RAY_TMPDIR", temp_dir)
                kwargs["_temp_dir"] = temp_dir
            kwargs.update(num_cpus=num_cpus, num_gpus=num_gpus)
        try:
            ray.init(**kwargs)
        except Exception as exc:
            self._restore_env()
            what = f"join the Ray cluster at {address}" if address else "start a local Ray cluster"
            raise AutoloopError(f"cannot {what}: {type(exc).__name__}: {_one_line(exc)}") from None
        self.started_ray = True

    def _start_actors(self, ray, timeout: float) -> None:
        """Create the actors now, so that a node that cannot run them (autoloop or ray
        missing there) is an error at start, not a lost trial."""
        refs = {slot._ensure_actor().info.remote(): slot for slot in self.slots}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as exc:
                raise AutoloopError(f"the Ray worker {refs[ref].name} did not start: {type(exc).__name__}: "
                                    f"{_one_line(_lost_cause(exc))}") from None

    def describe(self) -> str:
        kind = f"{self.gpus} GPU(s)" if self.gpus else "no GPU, CPU workers"
        where = "a local cluster" if self.started_ray and not self.address else self.address or "the cluster"
        return f"ray: {len(self.slots)} worker(s) on {where} ({kind})"

    def close(self) -> None:
        for slot in self.slots:
            slot.close()
        if self.started_ray:
            ray = _import_ray()
            ray.shutdown()
            self.started_ray = False
        self._restore_env()

    def _restore_env(self) -> None:
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved_env = {}

    def __enter__(self) -> "RayExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
