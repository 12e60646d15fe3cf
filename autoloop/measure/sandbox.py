"""Run trial processes in a bubblewrap sandbox, and build every child's environment.

Code written by a model runs unwatched overnight. The sandbox keeps an eager proposer's
accidents (and most of its gaming) away from what decides: the trial log, git, the harness,
the network, the user's secrets. It is not a security boundary against an attacker who
targets the kernel; see docs/verification.md.

The layout `SandboxPolicy.wrap` builds (bubblewrap applies mounts in argument order, and a
later mount covers an earlier one at or above its path):

1. the whole filesystem read-only (`--ro-bind / /`);
2. a fresh `/dev` with the GPU device nodes (`/dev/nvidia*`, `/dev/dri`) passed through,
   a new `/proc` for the private PID namespace, a private `/tmp`;
3. empty read-only folders over `/run` (sockets of daemons: docker, dbus, ssh agents),
   `/home`, `/root` and `$HOME`;
4. then every requested path, the least deep first, so that the most specific request
   wins: `readonly` paths re-exposed read-only (only where they lie under something hidden:
   the repository, the interpreter and the data when they live in a home folder), `hidden`
   folders covered by an empty read-only tmpfs and hidden files by `/dev/null` (a device
   node on a `nodev` mount: opening it fails with "permission denied"), `writable` paths
   bound read-write (a run's output folder and its own compile cache);
5. the hidden tmpfs folders made read-only last: a read-only folder cannot take the mount
   points that later binds under it need.

A hidden path that does not exist when the trial starts is left alone: it lies in a
read-only place, so the trial cannot create it (what the controller writes there later,
e.g. a new experiments.db-wal, is at most readable).

Namespaces: `--unshare-net` (no network: loopback only, nothing listening), `--unshare-pid`
(bubblewrap is PID 1 of the trial: when the trial's main process exits, or bubblewrap is
killed, the kernel kills every process in the namespace, `setsid` daemons included),
`--unshare-ipc`, `--die-with-parent` (the trial dies with the controller) and
`--new-session` (no terminal to inject keystrokes into).

Detection: `detect()` runs the real layout once per process (`bwrap ... true`); where
bubblewrap is missing or cannot make namespaces (macOS, a container without user
namespaces) "auto" gives kind "none" with the reason, "on" is an error.

Environment: `allowed_environment` builds every child's environment, sandboxed or not, from
an allow-list of names, never from a deny-list, so a secret under any name stays behind.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoloop.errors import AutoloopError
from autoloop.measure.openmp import openmp_defaults

MODES = ("auto", "on", "off")
ENV_COMPILE_CACHE = "AUTOLOOP_COMPILE_CACHE"  # as in autoloop/harness/contract.py
PROBE_TIMEOUT_SECONDS = 20
# HOME inside the sandbox: an empty folder in the private /tmp, so tools that write to
# ~/.cache or ~/.nv write somewhere that vanishes with the trial.
SANDBOX_HOME = "/tmp/home"

# Names passed through from the controller's environment. Nothing here holds a secret;
# everything torch, CUDA, the BLAS libraries and the harness need to behave the same
# sandboxed and unsandboxed is here.
ALLOWED_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR",
    "LD_LIBRARY_PATH",  # CUDA libraries on module-based clusters and conda installs
    "CC", "CXX",  # the compilers inductor and triton build kernels with
    "VIRTUAL_ENV", "CONDA_PREFIX", "XDG_CACHE_HOME",
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE",
    "PYTHONNOUSERSITE", "PYTHONWARNINGS", "PYTHONFAULTHANDLER", "PYTHONIOENCODING", "PYTHONUTF8",
    # Harness settings a user may set for the controller and its children alike
    # (autoloop/harness/contract.py); the per-trial contract variables come in `extra`.
    "AUTOLOOP_CACHE_DIR", "AUTOLOOP_COMPILE_CACHE", "AUTOLOOP_DEVICE_TYPE",
})
# Families of tuning variables (thread counts, OPENBLAS_CORETYPE, which GPUs, allocator
# and compile settings). A name in them that still looks like a secret is dropped.
ALLOWED_PREFIXES = (
    "LC_", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "CUDA_", "CUBLAS_", "CUDNN_", "NCCL_",
    "NVIDIA_", "TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "TRITON_",
)
SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")


def allowed_environment(extra: Mapping[str, Any], *, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A child's environment: the allow-listed part of `environ` (default: ours),
    PYTHONUNBUFFERED=1 (the log is written line by line), then `extra`, which the
    controller sets on purpose (the AUTOLOOP_* contract; a None value unsets a name)."""
    environ = os.environ if environ is None else environ
    env = {name: value for name, value in environ.items() if is_allowed(name)}
    env.update(openmp_defaults(env))  # a busy machine's steps are not stretched by spinning threads
    env["PYTHONUNBUFFERED"] = "1"
    for name, value in extra.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(value)
    return env


def is_allowed(name: str) -> bool:
    """Whether a child process may inherit the variable `name` (the allow-list above)."""
    if name in ALLOWED_NAMES:
        return True
    upper = name.upper()
    return name.startswith(ALLOWED_PREFIXES) and not any(marker in upper for marker in SECRET_MARKERS)


@dataclass(frozen=True)
class SandboxPaths:
    """What a sandboxed process may see beyond the read-only system (see `SandboxPolicy.wrap`)."""

    writable: tuple[Path, ...] = ()
    readonly: tuple[Path, ...] = ()
    hidden: tuple[Path, ...] = ()

    @classmethod
    def for_trial(
        cls,
        repo_dir: Path | str,
        run_dir: Path | str,
        *,
        db_path: Path | str | None = None,
        data_dir: Path | str | None = None,
        compile_cache: Path | str | None = None,
        writable: Iterable[Path | str] = (),
        readonly: Iterable[Path | str] = (),
        hidden: Iterable[Path | str] = (),
    ) -> "SandboxPaths":
        """The layout of a training or evaluation process: the repository and the data
        read-only; its .git, its .autoloop (but for `run_dir`, which may lie inside it) and
        the trial log with its -wal and -shm hidden; `run_dir` and the compile cache writable."""
        repo = Path(repo_dir)
        hide = [repo / ".git", repo / ".autoloop"]
        if db_path is not None:
            db = repo / db_path
            hide += [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]
        return cls(
            writable=tuple(Path(p) for p in (run_dir, *([compile_cache] if compile_cache else []), *writable)),
            readonly=tuple(Path(p) for p in (repo, *([data_dir] if data_dir else []), *readonly)),
            hidden=tuple(Path(p) for p in (*hide, *hidden)),
        )


@dataclass(frozen=True)
class SandboxPolicy:
    """How trial processes run. kind: "bwrap" (sandboxed), "none" (no working bubblewrap
    here; `reason` says why) or "off" (turned off by the user)."""

    kind: str
    reason: str = ""
    bwrap: str | None = None
    version: str | None = None

    def describe(self) -> str:
        """One line for runs.sandbox and the console."""
        if self.kind == "bwrap":
            return f"bwrap {self.version or ''}".rstrip() + ": no network, read-only repository, private PID namespace"
        return f"{self.kind}: {self.reason}"

    def wrap(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str],
        cwd: Path | str,
        writable: Iterable[Path | str] = (),
        readonly: Iterable[Path | str] = (),
        hidden: Iterable[Path | str] = (),
    ) -> tuple[list[str], dict[str, str]]:
        """The command line and environment that run `argv` in `cwd` inside the sandbox
        (see the module docstring for the layout); unchanged for kinds "none" and "off".

        Added to what the caller asks: read-only, what any Python child needs (its working
        folder, the interpreter, autoloop, every folder on sys.path, PYTHONPATH, LD_LIBRARY_PATH,
        CUDA_HOME);
        writable: nothing but what the caller names (a run's own output folder and compile
        cache: nothing writable is shared between trials, autoloop.measure.run_folder).
        Writable folders that do not exist yet are created. GPU device nodes are looked up
        now, not at detection: the driver creates some (nvidia-uvm) on first use."""
        env = dict(env)
        argv = [str(part) for part in argv]
        if self.kind != "bwrap":
            return argv, env
        writable = list(writable)
        for path in map(Path, writable):
            if not path.exists():
                path.mkdir(parents=True)
        readonly = [*readonly, *_default_readonly(cwd, env)]
        args = bwrap_arguments(
            cwd=cwd, writable=writable, readonly=readonly, hidden=hidden,
            gpu_nodes=gpu_device_nodes(), homes=_home_folders(),
        )
        env["HOME"] = SANDBOX_HOME
        env["TMPDIR"] = "/tmp"
        return [self.bwrap or "bwrap", *args, "--", *argv], env


def _resolve(path: Path | str) -> Path:
    return Path(os.path.abspath(os.path.realpath(os.path.expanduser(str(path)))))


def _under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _home_folders() -> list[Path]:
    homes = [Path("/home"), Path("/root")]
    home = os.environ.get("HOME")
    if home:
        homes.append(Path(home))
    return [p for p in {_resolve(h) for h in homes} if p.is_dir() and p != Path("/")]


def _default_readonly(cwd: Path | str, env: Mapping[str, str]) -> list[Path]:
    """What any Python child needs to see even when it lives in a home folder."""
    package = Path(__file__).resolve().parents[1]  # autoloop/ itself (this file is autoloop/measure/sandbox.py)
    paths = [Path(cwd), Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix),
             _resolve(sys.executable).parent, package]
    for name in ("PYTHONPATH", "LD_LIBRARY_PATH"):
        paths += [Path(p) for p in env.get(name, "").split(os.pathsep) if p]
    paths += [Path(env[name]) for name in ("CUDA_HOME", "CUDA_PATH", "VIRTUAL_ENV", "CONDA_PREFIX") if env.get(name)]
    # Every folder on this interpreter's import path, including those a .pth file adds (a
    # venv that reaches another one's packages, under /tmp, which the sandbox replaces).
    paths += [Path(p) for p in sys.path if p and os.path.isdir(p)]
    return paths


def bwrap_arguments(
    *,
    cwd: Path | str,
    writable: Iterable[Path | str] = (),
    readonly: Iterable[Path | str] = (),
    hidden: Iterable[Path | str] = (),
    gpu_nodes: Iterable[str] = (),
    homes: Iterable[Path] = (),
) -> list[str]:
    """bubblewrap's options (everything before `--`) for the layout in the module docstring."""
    args = ["--ro-bind", "/", "/", "--dev", "/dev"]
    for node in gpu_nodes:
        args += ["--dev-bind", node, node]
    args += ["--proc", "/proc", "--tmpfs", "/tmp", "--dir", SANDBOX_HOME]

    # Every mount after the base, keyed by path: the most specific request wins, and a
    # path asked for twice keeps the strongest meaning (writable > hidden > read-only >
    # covered: a repository that is someone's whole home folder stays visible).
    wanted: dict[Path, str] = {}
    for path in [Path("/run"), *(_resolve(h) for h in homes)]:
        if path.is_dir():
            wanted[path] = "cover"
    for path in map(_resolve, readonly):
        if path.exists():
            wanted[path] = "ro"
    for path in map(_resolve, hidden):
        if path.exists():
            wanted[path] = "hide-dir" if path.is_dir() else "hide-file"
    for path in map(_resolve, writable):
        if wanted.get(path, "").startswith("hide"):
            raise AutoloopError(f"sandbox: {path} is asked to be both hidden and writable: pick one")
        wanted[path] = "rw"

    # A read-only bind is only needed where the nearest mount above the path is not
    # read-only already (the root, or another read-only bind).
    wanted_with_tmp = {Path("/tmp"): "cover", **wanted}

    def needed(path: Path, kind: str) -> bool:
        if kind != "ro":
            return True
        above = [p for p in wanted_with_tmp if p != path and _under(path, p)]
        return bool(above) and wanted_with_tmp[max(above, key=lambda p: len(p.parts))] != "ro"

    plan = [(path, kind) for path, kind in wanted.items() if needed(path, kind)]
    plan.sort(key=lambda item: (len(item[0].parts), str(item[0])))
    read_only_folders = []
    for path, kind in plan:
        p = str(path)
        if kind in ("cover", "hide-dir"):
            args += ["--tmpfs", p]
            read_only_folders.append(p)
        elif kind == "hide-file":
            args += ["--ro-bind", "/dev/null", p]
        elif kind == "ro":
            args += ["--ro-bind", p, p]
        else:
            args += ["--bind", p, p]
    for p in read_only_folders:
        args += ["--remount-ro", p]

    args += [
        "--unshare-net", "--unshare-pid", "--unshare-ipc", "--die-with-parent", "--new-session",
        "--chdir", str(_resolve(cwd)),
    ]
    return args


def gpu_device_nodes() -> tuple[str, ...]:
    """The GPU device nodes to pass through: /dev/nvidia* (nvidiactl, nvidia-uvm, the cards,
    nvidia-caps for MIG) and /dev/dri."""
    dev = Path("/dev")
    nodes = sorted(str(p) for p in dev.glob("nvidia*"))
    if (dev / "dri").exists():
        nodes.append(str(dev / "dri"))
    return tuple(nodes)


@functools.lru_cache(maxsize=None)
def _probe(bwrap: str) -> tuple[bool, str, str | None]:
    """(works, why not, version): runs `true` in the real layout once per process."""
    try:
        version = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_SECONDS)
        number = version.stdout.split()[-1] if version.stdout.split() else None
        policy = SandboxPolicy("bwrap", bwrap=bwrap, version=number)
        true = shutil.which("true") or "/bin/true"
        # The real layout with a writable folder of its own: the probe writes nothing of ours.
        with tempfile.TemporaryDirectory(prefix="autoloop-probe-") as scratch:
            argv, env = policy.wrap([true], env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, cwd="/",
                                    writable=[scratch])
            ran = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_SECONDS,
                                 stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as error:
        return False, f"bwrap cannot run here ({error})", None
    if ran.returncode != 0:
        said = " ".join((ran.stderr or ran.stdout or f"exit {ran.returncode}").split())[:200]
        return False, f"bwrap cannot make its namespaces here ({said})", None
    return True, "", number


def detect(mode: str = "auto") -> SandboxPolicy:
    """The sandbox trial processes get: mode "auto" (bubblewrap if it works here, else kind
    "none" with the reason), "on" (bubblewrap or an AutoloopError) or "off" (the user's
    --no-sandbox). The probe runs once per process."""
    if mode not in MODES:
        raise AutoloopError(f"sandbox = {mode!r} is not one of {', '.join(MODES)}: fix the setting")
    if mode == "off":
        return SandboxPolicy("off", "turned off (--no-sandbox or sandbox = \"off\")")
    if not sys.platform.startswith("linux"):
        reason = f"bubblewrap needs Linux (this is {sys.platform})"
        works, version, bwrap = False, None, None
    else:
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            works, reason, version = False, "bwrap not installed (apt-get install bubblewrap)", None
        else:
            works, reason, version = _probe(bwrap)
    if works:
        return SandboxPolicy("bwrap", bwrap=bwrap, version=version)
    if mode == "on":
        raise AutoloopError(f"sandbox = \"on\" but {reason}: install bubblewrap where user namespaces work, "
                            "or set sandbox = \"auto\"")
    return SandboxPolicy("none", reason)
