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

import json
import logging
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from autoloop.errors import AutoloopError
from autoloop.measure.executors.ray_actor import (
    STREAMED_FILES,
    JobActor,
    inside,
    job_types,
    make_result,
    with_fields,
)
from autoloop.measure.executors.ray_data import dataset_spec, ensure_node_dataset, one_line  # noqa: F401 - its tests

POLL_SECONDS = 0.5
# After an abort: how long run_job may take to stop its process group (the runner's own
# SIGTERM grace plus its wait for the group) before the call is cancelled, and how long
# after that before the actor itself is killed.
ABORT_GRACE_SECONDS = 45.0
CANCEL_GRACE_SECONDS = 15.0
# How long RayExecutor waits for its actors to start before it goes on without waiting
# (a busy cluster may keep them pending; an actor that fails to start is an error at once).
START_TIMEOUT_SECONDS = 120.0
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
            cls = ray.remote(JobActor)
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
                                    f"{one_line(out.stderr.decode(errors='replace'))}")
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
                return make_result("lost", f"worker lost: {type(exc).__name__}: {one_line(_lost_cause(exc))}",
                                   worker=self.name)
            return make_result("crash", f"the Ray worker failed: {type(exc).__name__}: {one_line(exc)}", worker=self.name)
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
        _, JobResult = job_types()
        for rel, content in out["files"].items():
            dest = inside(run_dir, rel)
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.part")
            tmp.write_bytes(content)
            os.replace(tmp, dest)
        data = _as_dict(out["result"])
        data = _replace_path(data, out["run_dir"], str(run_dir))
        result = JobResult.from_json(json.dumps(data) if isinstance(out["result"], str) else data)
        return with_fields(result, worker=self.name, files={})


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
            raise AutoloopError(f"cannot {what}: {type(exc).__name__}: {one_line(exc)}") from None
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
                                    f"{one_line(_lost_cause(exc))}") from None

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
