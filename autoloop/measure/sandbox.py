"""Run trial processes in a bubblewrap sandbox, and build every child's environment.

Code written by a model runs unwatched overnight. The sandbox keeps an eager proposer's
accidents (and most of its gaming) away from what decides: the trial log, git, the harness,
the data, the network, the user's secrets. It is not a security boundary against an attacker
who targets the kernel; see docs/verification.md.

What a sandboxed process sees is an allow-list: nothing is visible unless it is named here
or by the caller. `SandboxPolicy.wrap` builds (bubblewrap applies mounts in argument order,
and a later mount covers an earlier one at or above its path):

1. an empty root (bubblewrap's own tmpfs), made read-only at the end;
2. the system, read-only: `/usr` (programs, shared libraries, the C compiler inductor and
   triton build kernels with), the `/bin`, `/sbin` and `/lib*` links or folders, `/sys`
   (CPU and PCI topology: OpenMP, NUMA, the CUDA driver), a few files of `/etc`
   (ETC_ENTRIES: the dynamic loader's cache, users and groups, time zone, alternatives),
   and every library folder the dynamic loader's configuration names outside `/usr`
   (a GPU driver installed under /opt);
3. a fresh `/dev` with the GPU device nodes (`/dev/nvidia*`, `/dev/dri`) passed through,
   a new `/proc` for the private PID namespace, a private `/tmp` holding an empty HOME;
4. the interpreter and its packages read-only (sys.prefix, sys.base_prefix, the
   executable's folder, every folder on sys.path, PYTHONPATH, LD_LIBRARY_PATH, CUDA_HOME),
   but never a folder that holds the project, the cache folder or a home folder whole: of
   such a folder only the autoloop package itself;
5. what the caller asks, the least deep first, so that the most specific request wins:
   `readonly` paths (a run's project files: `project_files`, what git tracks, never an
   untracked .env, the db or .git), `hidden` paths under them covered (folders by an empty
   read-only tmpfs, files by `/dev/null`), `writable` paths bound read-write (a run's output
   folder and its own compile cache);
6. the hidden tmpfs folders and the root made read-only last: a read-only folder cannot take
   the mount points that later binds under it need.

Nothing else exists inside: not the home folders, `/root`, `/var` (`/var/tmp`), `/opt`,
`/srv`, `/mnt`, `/run` (daemons' sockets), the cache folder (prepared datasets, the embedded
corpus's key), other projects, or the rest of the project folder.

Namespaces: `--unshare-net` (no network: loopback only, nothing listening), `--unshare-pid`
(bubblewrap is PID 1 of the trial: when the trial's main process exits, or bubblewrap is
killed, the kernel kills every process in the namespace, `setsid` daemons included),
`--unshare-ipc`, `--die-with-parent` (the trial dies with the controller) and
`--new-session` (no terminal to inject keystrokes into).

Detection: `detect()` runs the real layout once per process (`bwrap ... true`); where
bubblewrap is missing or cannot make namespaces (macOS, a container without user
namespaces) "auto" gives kind "none" with the reason, "on" is an error.

Environment: `autoloop.base.environment.allowed_environment` builds every child's environment, sandboxed or not, from
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

from autoloop.errors import AutoloopError

MODES = ("auto", "on", "off")
ENV_COMPILE_CACHE = "AUTOLOOP_COMPILE_CACHE"  # as in autoloop/harness/contract.py
PROBE_TIMEOUT_SECONDS = 20
# HOME inside the sandbox: an empty folder in the private /tmp, so tools that write to
# ~/.cache or ~/.nv write somewhere that vanishes with the trial.
SANDBOX_HOME = "/tmp/home"

# The system part of the allow-list (see the module docstring). /etc is a few named entries:
# the dynamic loader's cache and configuration (shared libraries, a GPU driver's folder),
# users and groups (getpass, inductor's cache folder), the time zone, the alternatives links
# (/usr/bin/cc), name lookup of localhost, and Debian's interpreter configuration.
SYSTEM_FOLDERS = ("/usr", "/sys")
SYSTEM_TOP_LEVEL = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_ENTRIES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "passwd", "group", "localtime", "timezone",
               "alternatives", "nsswitch.conf", "hosts", "host.conf")
ETC_PREFIXES = ("python3",)  # Debian's /etc/python3.X (sitecustomize)


@dataclass(frozen=True)
class SandboxPaths:
    """What a sandboxed process may see beyond the system and the interpreter (see
    `SandboxPolicy.wrap`)."""

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
        """The layout of a training or evaluation process: the project's files (what git
        tracks: `project_files`) and the data read-only; its .git, its .autoloop (but for
        `run_dir`, which may lie inside it) and the trial log with its -wal and -shm hidden
        (where the project is no git repository and is bound whole); `run_dir` and the
        compile cache writable."""
        repo = Path(repo_dir)
        hide = [repo / ".git", repo / ".autoloop"]
        if db_path is not None:
            db = repo / db_path
            hide += [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]
        return cls(
            writable=tuple(Path(p) for p in (run_dir, *([compile_cache] if compile_cache else []), *writable)),
            readonly=tuple(Path(p) for p in (*project_files(repo), *([data_dir] if data_dir else []), *readonly)),
            hidden=tuple(Path(p) for p in (*hide, *hidden)),
        )


def project_files(project: Path | str, *, limit: int = 20_000) -> list[Path]:
    """What a trial may read of its project folder: the files git tracks there (the
    experiment), as few paths as cover them exactly (a folder all of whose contents are
    tracked is one path). Never what git does not track (a .env, experiments.db, .autoloop,
    a virtual environment, data), nor a tracked file named like a secret
    (autoloop.base.secret_names.is_secret_file), nor .git. A folder that is no git repository
    (a Ray node's copy of the job's files) is given whole: it holds only those files.
    Over `limit` tracked files, each of the project's top-level entries that holds no
    untracked file is given whole and the rest file by file, up to the limit."""
    from autoloop.base.secret_names import is_secret_file

    root = _resolve(project)

    def listed(*args: str) -> list[str] | None:
        try:
            out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", *args], capture_output=True,
                                 timeout=60, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):
            return None
        return [p for p in out.stdout.decode("utf-8", "surrogateescape").split("\0") if p] if out.returncode == 0 else None

    tracked = listed("--cached")
    others = listed("--others", "--directory")  # untracked and ignored, a folder of them as one entry
    if tracked is None or others is None:
        return [root]
    # A folder is "mixed" when something under it must stay out: an untracked entry, a secret
    # file, or (the root) .git. Only files, and folders that are not mixed, are bound.
    mixed = {""}
    chosen = []
    for rel in others:
        mixed.update(_ancestors(rel.rstrip("/")))
    files = []
    for rel in tracked:
        if is_secret_file(rel.rsplit("/", 1)[-1]):
            mixed.update(_ancestors(rel))
        else:
            files.append(rel)
    seen = set()
    for rel in files:
        parts = rel.split("/")
        top = rel
        for depth in range(1, len(parts)):  # the shallowest folder above `rel` that is not mixed
            folder = "/".join(parts[:depth])
            if folder not in mixed:
                top = folder
                break
        if top not in seen and (root / top).exists():
            seen.add(top)
            chosen.append(root / top)
        if len(chosen) >= limit:
            break
    return chosen


def _ancestors(rel: str) -> list[str]:
    parts = rel.split("/")
    return ["/".join(parts[:depth]) for depth in range(len(parts))]


@dataclass(frozen=True)
class SandboxPolicy:
    """How trial processes run. kind: "bwrap" (sandboxed), "none" (no working bubblewrap
    here; `reason` says why) or "off" (turned off by the user)."""

    kind: str
    reason: str = ""
    bwrap: str | None = None
    version: str | None = None

    def describe(self) -> str:
        """One line for runs.sandbox and the console: what a sandboxed process can see."""
        if self.kind == "bwrap":
            interpreter = ", ".join(dict.fromkeys(str(p) for p in _interpreter_folders()))
            return (f"bwrap {self.version or ''}".rstrip() + ": sees only /usr, /sys, "
                    f"{len(_etc_entries())} /etc entries, the interpreter ({interpreter}), autoloop "
                    f"({_package_dir()}), the project's tracked files and its run folder; no network, "
                    "no home or cache folder, a private PID namespace")
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

        Added to what the caller asks: read-only, the system and what any Python child
        needs (the interpreter, autoloop, the folders on sys.path, PYTHONPATH,
        LD_LIBRARY_PATH, CUDA_HOME), never a folder that holds `cwd`, the cache folder or a
        home folder whole. `cwd` itself is not added: the caller names what of it is seen.
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
        # /tmp: the sandbox's own tmpfs; a host /tmp on the import path (a script run from
        # there) must not replace it, nor bring every other project under /tmp with it.
        readonly = [*readonly, *interpreter_paths(env, keep_out=[Path(cwd), Path("/tmp"), *_private_roots()])]
        args = bwrap_arguments(cwd=cwd, writable=writable, readonly=readonly, hidden=hidden,
                               gpu_nodes=gpu_device_nodes())
        env["HOME"] = SANDBOX_HOME
        env["TMPDIR"] = "/tmp"
        return [self.bwrap or "bwrap", *args, "--", *argv], env


def _resolve(path: Path | str) -> Path:
    return Path(os.path.abspath(os.path.realpath(os.path.expanduser(str(path)))))


def _under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _package_dir() -> Path:
    return Path(__file__).resolve().parents[1]  # autoloop/ itself (this file is autoloop/measure/sandbox.py)


def _private_roots() -> list[Path]:
    """Folders no sandbox may see whole: the home folders and the cache folder (prepared
    datasets, the embedded corpus's key)."""
    from autoloop.harness.contract import cache_root

    roots = [Path("/home"), Path("/root"), cache_root()]
    if os.environ.get("HOME"):
        roots.append(Path(os.environ["HOME"]))
    return roots


def _interpreter_folders() -> list[Path]:
    return [Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix), _resolve(sys.executable).parent]


def interpreter_paths(env: Mapping[str, str], *, keep_out: Iterable[Path | str] = ()) -> list[Path]:
    """What any Python child needs to see: the interpreter, its import path and libraries,
    autoloop. A candidate folder that is `/`, or that holds one of `keep_out` (the project,
    the cache folder, a home folder), is left out: a repository on sys.path (an editable
    install, PYTHONPATH=.) gives only its autoloop package, which is added anyway."""
    package = _package_dir()
    candidates = _interpreter_folders()
    for name in ("PYTHONPATH", "LD_LIBRARY_PATH"):
        candidates += [Path(p) for p in env.get(name, "").split(os.pathsep) if p]
    candidates += [Path(env[name]) for name in ("CUDA_HOME", "CUDA_PATH", "VIRTUAL_ENV", "CONDA_PREFIX")
                   if env.get(name)]
    # Every folder on this interpreter's import path, including those a .pth file adds (a
    # venv that reaches another one's packages, under /tmp, which the sandbox replaces).
    candidates += [Path(p) for p in sys.path if p and os.path.isdir(p)]
    guarded = [_resolve(p) for p in keep_out]
    chosen = [package]
    for path in map(_resolve, candidates):
        if path == Path("/") or path == package.parent or any(_under(g, path) for g in guarded):
            continue  # `package.parent`: the repository of an editable install, of which autoloop is all we need
        chosen.append(path)
    return chosen


def _etc_entries() -> list[Path]:
    etc = Path("/etc")
    entries = [etc / name for name in ETC_ENTRIES]
    try:
        entries += sorted(p for p in etc.iterdir() if p.name.startswith(ETC_PREFIXES))
    except OSError:
        pass
    return [p for p in entries if os.path.lexists(p)]


def loader_folders(conf: Path | str = "/etc/ld.so.conf") -> list[Path]:
    """The library folders the dynamic loader's configuration names (following `include`
    lines): where a GPU driver installed outside /usr keeps libcuda."""
    found: list[Path] = []
    pending, seen = [Path(conf)], set()
    while pending:
        path = pending.pop(0)
        if path in seen:
            continue
        seen.add(path)
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            line = line.split("#", 1)[0].strip()
            if line.startswith("include "):
                pattern = line.split(None, 1)[1]
                base = Path(pattern) if pattern.startswith("/") else path.parent / pattern
                pending += sorted(Path(base.anchor).glob(str(base.relative_to(base.anchor))))
            elif line.startswith("/") and os.path.isdir(line):
                found.append(Path(line))
    return found


def system_mounts(*, loader_conf: Path | str = "/etc/ld.so.conf") -> list[tuple[str, str, str]]:
    """The system part of the allow-list, as (kind, source, destination): kind "link" (a
    merged-/usr link such as /bin -> usr/bin, recreated) or "ro" (bound read-only)."""
    mounts = []
    for top in SYSTEM_TOP_LEVEL:
        if os.path.islink(top):
            mounts.append(("link", os.readlink(top), top))
        elif os.path.isdir(top):
            mounts.append(("ro", top, top))
    mounts += [("ro", p, p) for p in SYSTEM_FOLDERS if os.path.isdir(p)]
    for entry in _etc_entries():
        mounts.append(("ro", str(entry), str(entry)))  # an /etc/alternatives link is bound as its target is
    for folder in loader_folders(loader_conf):
        if not any(_under(_resolve(folder), Path(p)) for p in SYSTEM_FOLDERS):
            mounts.append(("ro", str(_resolve(folder)), str(_resolve(folder))))
    return mounts


def bwrap_arguments(
    *,
    cwd: Path | str,
    writable: Iterable[Path | str] = (),
    readonly: Iterable[Path | str] = (),
    hidden: Iterable[Path | str] = (),
    gpu_nodes: Iterable[str] = (),
    system: Iterable[tuple[str, str, str]] | None = None,
) -> list[str]:
    """bubblewrap's options (everything before `--`) for the layout in the module docstring.
    `system`: the system mounts (default `system_mounts()`)."""
    args: list[str] = []
    system = system_mounts() if system is None else list(system)
    ro_system = []
    for kind, source, dest in system:
        if kind == "link":
            args += ["--symlink", source, dest]
        else:
            ro_system.append(_resolve(dest))
            args += ["--ro-bind", source, dest]
    args += ["--dev", "/dev"]
    for node in gpu_nodes:
        args += ["--dev-bind", node, node]
    args += ["--proc", "/proc", "--tmpfs", "/tmp", "--dir", SANDBOX_HOME]

    # Every mount after the base, keyed by path: the most specific request wins, and a
    # path asked for twice keeps the strongest meaning (writable > hidden > read-only).
    wanted: dict[Path, str] = {}
    for path in map(_resolve, readonly):
        if path.exists():
            wanted[path] = "ro"
    for path in map(_resolve, hidden):
        if path.exists() and any(_under(path, r) for r, kind in wanted.items() if kind == "ro"):
            wanted[path] = "hide-dir" if path.is_dir() else "hide-file"  # only what a bind would show
    for path in map(_resolve, writable):
        if wanted.get(path, "").startswith("hide"):
            raise AutoloopError(f"sandbox: {path} is asked to be both hidden and writable: pick one")
        wanted[path] = "rw"
    # The working folder exists even where nothing of it is bound, and is read-only: an
    # empty folder (a tmpfs made read-only at the end) under what is bound of it.
    wanted.setdefault(_resolve(cwd), "hide-dir")

    # A read-only bind is only needed where the nearest mount above the path is not
    # read-only already (another read-only bind, or the read-only system).
    above_kinds = {Path("/tmp"): "tmp", **{p: "ro" for p in ro_system}, **wanted}

    def needed(path: Path, kind: str) -> bool:
        if kind != "ro":
            return True
        above = [p for p in above_kinds if p != path and _under(path, p)]
        return not above or above_kinds[max(above, key=lambda p: len(p.parts))] != "ro"

    plan = [(path, kind) for path, kind in wanted.items() if needed(path, kind)]
    plan.sort(key=lambda item: (len(item[0].parts), str(item[0])))
    read_only_folders = []
    for path, kind in plan:
        p = str(path)
        if kind == "hide-dir":
            args += ["--tmpfs", p]
            read_only_folders.append(p)
        elif kind == "hide-file":
            args += ["--ro-bind", "/dev/null", p]
        elif kind == "ro":
            args += ["--ro-bind", p, p]
        else:
            args += ["--bind", p, p]
    for p in [*read_only_folders, "/"]:
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
            argv, env = policy.wrap([true], env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, cwd=scratch,
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
