"""The bubblewrap sandbox around trial processes, and the allow-listed environment.

Tests of the sandbox run real processes in real bubblewrap (through `run_training`, as the
controller does) inside a real git repository in tmp_path, and report what the process
could see and do. They skip, saying why, where bubblewrap cannot run (no bwrap, or a
container without user namespaces): `.ci/run` installs bubblewrap so they run in CI.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import autoloop
from autoloop.measure import sandbox as sb
from autoloop.errors import AutoloopError
from autoloop.base.processes import process_group_alive
from autoloop.measure.runner import run_training
from autoloop.base.environment import allowed_environment
from autoloop.measure.sandbox import SandboxPaths, SandboxPolicy, bwrap_arguments, detect
from tests.conftest import SANDBOX as POLICY
from tests.conftest import make_repo, needs_bwrap

REPO_ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- detection


def test_off_is_the_users_choice():
    policy = detect("off")
    assert policy.kind == "off" and policy.describe().startswith("off: ")
    assert policy.wrap(["python", "x.py"], env={"A": "1"}, cwd="/") == (["python", "x.py"], {"A": "1"})


def test_unknown_mode_is_one_clear_line():
    with pytest.raises(AutoloopError, match="sandbox = 'maybe' is not one of auto, on, off"):
        detect("maybe")


def test_without_bwrap_auto_says_why_and_on_refuses(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    policy = detect("auto")
    assert (policy.kind, policy.describe()) == ("none", "none: bwrap not installed (apt-get install bubblewrap)")
    assert policy.wrap(["true"], env={}, cwd=tmp_path) == (["true"], {})
    with pytest.raises(AutoloopError) as error:
        detect("on")
    assert "bwrap not installed" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the probe runs on Linux only")
def test_a_bwrap_that_cannot_make_namespaces_is_detected(tmp_path, monkeypatch):
    # What bubblewrap says in a container without user namespaces.
    fake = tmp_path / "bwrap"
    fake.write_text(textwrap.dedent("""\
        #!/bin/sh
        if [ "$1" = "--version" ]; then echo "bubblewrap 0.8.0"; exit 0; fi
        echo "bwrap: No permissions to creating new namespace" >&2
        exit 1
    """))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    policy = detect("auto")
    assert policy.kind == "none"
    assert policy.describe() == "none: bwrap cannot make its namespaces here (bwrap: No permissions to creating new namespace)"
    with pytest.raises(AutoloopError, match="sandbox = \"on\" but bwrap cannot make its namespaces here"):
        detect("on")


# ---------------------------------------------------------------------------- environment


def test_environment_comes_from_an_allow_list():
    environ = {
        "PATH": "/usr/bin", "HOME": "/home/me", "LANG": "C.UTF-8", "LC_ALL": "C", "TZ": "UTC", "TERM": "xterm",
        "CUDA_VISIBLE_DEVICES": "1", "NVIDIA_VISIBLE_DEVICES": "all", "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
        "OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "262144", "PYTHONHASHSEED": "0",
        "TORCHINDUCTOR_CACHE_DIR": "/c/i", "TRITON_CACHE_DIR": "/c/t", "PYTHONPYCACHEPREFIX": "/c/pyc",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "AUTOLOOP_CACHE_DIR": "/c",
        # Secrets under every kind of name, and settings of the controller the trial has no business with.
        "MY_SECRET_VAR": "sk-1", "OPENAI_API_KEY": "sk-2", "HF_TOKEN": "hf", "NVIDIA_API_KEY": "nv", "CUDA_AUTH": "x",
        "SSH_AUTH_SOCK": "/tmp/ssh", "AWS_ACCESS_KEY_ID": "a", "DATABASE_URL": "postgres://u:p@h/db",
        "AUTOLOOP_LLM_API_KEY_ENV": "MY_SECRET_VAR", "AUTOLOOP_FAULT": "after_row", "LD_PRELOAD": "/x.so",
    }
    env = allowed_environment({"AUTOLOOP_SEED": 7, "LANG": None}, environ=environ)
    passed = {"PATH", "HOME", "LC_ALL", "TZ", "TERM", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
              "MKL_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "PYTHONHASHSEED", "TORCHINDUCTOR_CACHE_DIR",
              "TRITON_CACHE_DIR", "PYTHONPYCACHEPREFIX", "PYTORCH_CUDA_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG",
              "AUTOLOOP_CACHE_DIR"}
    # LANG: unset on purpose; GOMP_SPINCOUNT: OpenMP's idle threads sleep soon (autoloop/base/openmp.py)
    assert set(env) == passed | {"PYTHONUNBUFFERED", "AUTOLOOP_SEED", "GOMP_SPINCOUNT"}
    assert all(env[name] == environ[name] for name in passed)
    assert env["AUTOLOOP_SEED"] == "7" and env["PYTHONUNBUFFERED"] == "1" and env["GOMP_SPINCOUNT"] == "10000"


@pytest.mark.parametrize("users, expected", [
    ({}, "10000"),  # nobody chose: threads spin 10,000 iterations, not GNU's 300,000
    ({"GOMP_SPINCOUNT": "300000"}, "300000"),  # the user's own count stays
    ({"OMP_WAIT_POLICY": "ACTIVE"}, None),  # so does their wait policy, with no count beside it
])
def test_openmp_threads_sleep_soon_unless_the_user_chose(users, expected):
    from autoloop.base.openmp import apply_openmp_defaults

    env = allowed_environment({}, environ={"PATH": "/usr/bin", **users})
    assert env.get("GOMP_SPINCOUNT") == expected and env.get("OMP_WAIT_POLICY") == users.get("OMP_WAIT_POLICY")
    ours = dict(users)
    apply_openmp_defaults(ours)  # the controller's own process, before it imports torch
    assert ours.get("GOMP_SPINCOUNT") == expected


# ---------------------------------------------------------------------------- the layout


def _at(args: list[str], *op: str) -> int:
    for i in range(len(args) - len(op) + 1):
        if tuple(args[i:i + len(op)]) == op:
            return i
    raise AssertionError(f"{op} not in {args}")


def test_the_layout_is_an_allow_list_with_the_most_specific_mount_last(tmp_path):
    repo = make_repo(tmp_path / "repo", "print('hi')\n")
    (repo / "experiments.db").write_text("")
    (repo / ".env").write_text("KEY=1")
    run_dir = repo / ".autoloop" / "t" / "trials" / "1"
    run_dir.mkdir(parents=True)
    paths = SandboxPaths.for_trial(repo, run_dir, db_path="experiments.db", compile_cache=tmp_path / "cc")
    system = [("link", "usr/bin", "/bin"), ("ro", "/usr", "/usr"), ("ro", "/etc/passwd", "/etc/passwd")]
    args = bwrap_arguments(cwd=repo, writable=paths.writable, readonly=paths.readonly, hidden=paths.hidden,
                           gpu_nodes=["/dev/nvidia0"], system=system)
    r = str(repo.resolve())
    assert ("--ro-bind", "/", "/") not in {tuple(args[i:i + 3]) for i in range(len(args))}  # no whole disk
    assert _at(args, "--symlink", "usr/bin", "/bin") < _at(args, "--ro-bind", "/usr", "/usr") < _at(args, "--dev", "/dev")
    assert _at(args, "--dev", "/dev") < _at(args, "--dev-bind", "/dev/nvidia0", "/dev/nvidia0")
    assert _at(args, "--tmpfs", "/tmp") < _at(args, "--tmpfs", r) < _at(args, "--ro-bind", f"{r}/train.py", f"{r}/train.py")
    assert _at(args, "--ro-bind", f"{r}/train.py", f"{r}/train.py") < _at(args, "--remount-ro", r)  # the project: read-only
    # Only what git tracks: not the db, .env, .git, or .autoloop (whose run folder alone is bound).
    bound = [args[i + 2] for i in range(len(args) - 2) if args[i] in ("--ro-bind", "--bind")]
    tracked = subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True).stdout.split()
    assert {p for p in bound if p.startswith(r + "/")} == {f"{r}/{t}" for t in tracked} | {str(run_dir.resolve())}
    assert _at(args, "--bind", str(run_dir.resolve()), str(run_dir.resolve()))
    assert f"{r}/experiments.db" not in args and f"{r}/.git" not in args and f"{r}/.env" not in args
    assert args[-9:-7] == ["--remount-ro", "/"]  # the root last: nothing the trial can create there
    for flag in ("--unshare-net", "--unshare-pid", "--unshare-ipc", "--die-with-parent", "--new-session"):
        assert flag in args
    assert args[-2:] == ["--chdir", r]


def test_project_files_are_what_git_tracks_and_nothing_else(tmp_path):
    repo = make_repo(tmp_path / "repo", "print('hi')\n")
    deep = repo / "lib" / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (repo / "lib" / "model.py").write_text("x = 1\n")
    (repo / "lib" / "a" / "util.py").write_text("y = 2\n")
    (repo / "conf").mkdir()
    (repo / "conf" / "settings.toml").write_text("a = 1\n")
    (repo / "conf" / "secrets.json").write_text('{"k": "v"}')  # tracked, but named as a secret
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qm", "more"], cwd=repo, check=True)
    (deep / ".env").write_text("PASSWORD=hunter2\n")  # four folders down, untracked
    (repo / "data").mkdir()
    (repo / "data" / "val.txt").write_text("scored text")
    (repo / "experiments.db").write_text("")
    files = {p.relative_to(repo.resolve()).as_posix() for p in sb.project_files(repo)}
    # lib/ holds an untracked .env deep down: its tracked files only; conf/ its settings only.
    assert files == {"train.py", "lib/model.py", "lib/a/util.py", "conf/settings.toml"} | (
        {".gitignore"} if (repo / ".gitignore").exists() else set()), files
    plain = tmp_path / "plain"
    plain.mkdir()
    assert sb.project_files(plain) == [plain.resolve()]  # not a repository: a job's copy, given whole


def test_a_gpu_machines_paths_are_in_the_allow_list(tmp_path, monkeypatch):
    """The GPU's device nodes, its driver's library folder (named by the dynamic loader's
    configuration, here outside /usr), CUDA_HOME and LD_LIBRARY_PATH, all made up on a CPU."""
    driver = tmp_path / "opt" / "nvidia" / "lib64"
    driver.mkdir(parents=True)
    cuda = tmp_path / "cuda"
    (cuda / "lib64").mkdir(parents=True)
    extra = tmp_path / "extra-libs"
    extra.mkdir()
    conf = tmp_path / "ld.so.conf"
    (tmp_path / "ld.so.conf.d").mkdir()
    conf.write_text("include ld.so.conf.d/*.conf\n")
    (tmp_path / "ld.so.conf.d" / "nvidia.conf").write_text(f"# the driver\n{driver}\n/usr/lib/x86_64-linux-gnu\n")
    assert sb.loader_folders(conf)[0] == driver
    system = sb.system_mounts(loader_conf=conf)
    assert ("ro", str(driver.resolve()), str(driver.resolve())) in system
    assert not any(dest == "/usr/lib/x86_64-linux-gnu" for _, _, dest in system)  # under /usr already
    readonly = sb.interpreter_paths({"CUDA_HOME": str(cuda), "LD_LIBRARY_PATH": str(extra)}, keep_out=[tmp_path / "repo"])
    args = bwrap_arguments(cwd=tmp_path, readonly=readonly, system=system,
                           gpu_nodes=["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/dri"])
    for node in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/dri"):
        assert _at(args, "--dev-bind", node, node)
    for folder in (driver, cuda, extra):
        assert _at(args, "--ro-bind", str(folder.resolve()), str(folder.resolve()))


def test_no_folder_that_holds_the_project_the_cache_or_a_home_is_given_whole(tmp_path, monkeypatch):
    project = tmp_path / "work" / "project"
    project.mkdir(parents=True)
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path / "work"), str(tmp_path), "/",
                                      str(Path(autoloop.__file__).resolve().parents[1])])
    monkeypatch.setattr(sys, "path", [*sys.path, "/tmp"])  # a script run from /tmp
    chosen = sb.interpreter_paths({"PYTHONPATH": str(tmp_path / "work")}, keep_out=[project, Path("/tmp")])
    assert Path(autoloop.__file__).resolve().parent in chosen  # autoloop itself
    for whole in (tmp_path / "work", tmp_path, Path("/"), Path("/tmp"), Path(autoloop.__file__).resolve().parents[1]):
        assert whole.resolve() not in chosen, whole
    policy = SandboxPolicy("bwrap", bwrap="bwrap", version="x")
    argv, _ = policy.wrap(["true"], env={"PYTHONPATH": "/tmp"}, cwd=project, readonly=[project])
    assert "/tmp" not in [argv[i + 1] for i in range(len(argv) - 1) if argv[i] == "--ro-bind"]


def test_hidden_and_writable_at_once_is_refused(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(AutoloopError, match="both hidden and writable"):
        bwrap_arguments(cwd=tmp_path, readonly=[tmp_path], writable=[tmp_path / "x"], hidden=[tmp_path / "x"], system=[])


# ---------------------------------------------------------------------------- inside the sandbox


@pytest.fixture
def layout(tmp_path, monkeypatch):
    """A repository as the controller has it during a trial: experiments.db with its WAL
    files, .git, .autoloop with another trial's folder, this trial's run folder, and a home
    folder holding a secret."""
    repo = make_repo(tmp_path / "repo", "print('train')\n")
    for name in ("experiments.db", "experiments.db-wal", "experiments.db-shm"):
        (repo / name).write_text("the trial log")
    other = repo / ".autoloop" / "t" / "trials" / "1"
    other.mkdir(parents=True)
    (other / "checkpoint.pt").write_text("weights")
    run_dir = repo / ".autoloop" / "t" / "trials" / "2"
    run_dir.mkdir(parents=True)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text("machine api password hunter2")
    monkeypatch.setenv("HOME", str(home))
    paths = SandboxPaths.for_trial(repo, run_dir, db_path="experiments.db")
    return {"repo": repo, "run_dir": run_dir, "home": home, "paths": paths}


def run_inside(layout: dict, source: str, *, env: dict | None = None, deadline: float = 60,
               policy: SandboxPolicy = POLICY, **kwargs):
    """Run `source` as the trial script; it writes what it observed to result.json (a dict
    under "seen")."""
    script = layout["run_dir"] / "probe.py"
    script.write_text(textwrap.dedent(source))
    result = layout["run_dir"] / "result.json"
    outcome = run_training(
        [sys.executable, str(script)], cwd=layout["repo"],
        env={"AUTOLOOP_RESULT": str(result), "PYTHONPATH": str(REPO_ROOT), **(env or {})},
        log_path=layout["run_dir"] / "train.log", deadline_seconds=deadline, kill_grace_seconds=1,
        sandbox=policy, sandbox_paths=layout["paths"], **kwargs,
    )
    assert not process_group_alive(outcome.pgid)
    return outcome


REPORT = """
import json, os
def report(**seen):
    with open(os.environ["AUTOLOOP_RESULT"], "w") as f:
        json.dump({"val_bpb": 1.0, "seen": seen}, f)
def attempt(fn):
    try:
        return "ok: " + repr(fn())[:80]
    except Exception as error:
        return f"{type(error).__name__}: {error}"
"""


@pytest.fixture
def outside_listener():
    """A TCP server outside the sandbox, on every address, that answers one byte."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("0.0.0.0", 0))
    server.listen(8)
    server.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.sendall(b"x")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


def _external_address() -> str | None:
    """This machine's address on its network (no packet is sent), or None without one."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: routing only
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


@needs_bwrap
def test_no_network(layout, outside_listener):
    targets = [("127.0.0.1", outside_listener)]
    if _external_address():
        targets.append((_external_address(), outside_listener))
    for target in targets:  # the listener does answer outside
        with socket.create_connection(target, timeout=5) as conn:
            assert conn.recv(1) == b"x"
    outcome = run_inside(layout, REPORT + f"""
import socket
def connect(target):
    with socket.create_connection(target, timeout=5) as conn:
        return conn.recv(1)
report(**{{f"{{host}}:{{port}}": attempt(lambda: connect((host, port))) for host, port in {targets!r}}},
       dns=attempt(lambda: socket.getaddrinfo("example.com", 443)))
""")
    assert outcome.status == "ok", outcome.error_tail
    seen = outcome.result["seen"]
    assert len(seen) == len(targets) + 1
    for target, what in seen.items():
        assert not what.startswith("ok"), (target, what)
    assert seen[f"127.0.0.1:{outside_listener}"].startswith("ConnectionRefusedError")


@needs_bwrap
def test_only_the_allow_list_is_visible_and_only_the_run_folder_writable(layout, tmp_path):
    """What a trial sees is an allow-list: the project's tracked files, the system, the
    interpreter; not the db, .git, another trial's folder, an untracked .env four folders
    down, a secret under /var/tmp, the home folder, the cache folder or another project."""
    repo, home = layout["repo"], layout["home"]
    deep = repo / "a" / "b" / "c" / "d"
    deep.mkdir(parents=True)
    (deep / ".env").write_text("PASSWORD=hunter2-deep\n")
    var_tmp = Path("/var/tmp") / f"autoloop-test-{os.getpid()}-{time.time_ns()}"
    var_tmp.mkdir(parents=True)
    (var_tmp / ".env").write_text("OPENAI_API_KEY=sk-outside\n")
    other_project = tmp_path / "other-project"
    other_project.mkdir()
    (other_project / "notes.txt").write_text("another project")
    from autoloop.harness.contract import cache_root

    pycache = Path(autoloop.__file__).resolve().parent / "harness" / "__pycache__" / "planted.cpython-311.pyc"
    pycache.parent.mkdir(exist_ok=True)  # as any import makes it
    try:
        outcome = run_inside(layout, REPORT + f"""
import os
def write(path):
    with open(path, "w") as f:
        f.write("x")
def read(path):
    with open(path) as f:
        return f.read()
report(
    write_train=attempt(lambda: write("train.py")),
    write_new=attempt(lambda: write("new.py")),
    write_run=attempt(lambda: write({str(layout["run_dir"] / "out.txt")!r})),
    write_pycache=attempt(lambda: write({str(pycache)!r})),
    write_site=attempt(lambda: write(os.path.join({sys.prefix!r}, "planted.pth"))),
    write_root=attempt(lambda: write("/planted")), write_usr=attempt(lambda: write("/usr/planted")),
    read_train=attempt(lambda: read("train.py")),
    db=attempt(lambda: read("experiments.db")), wal=attempt(lambda: read("experiments.db-wal")),
    git=attempt(lambda: os.listdir(".git")), listing=sorted(os.listdir(".")),
    other_trial=attempt(lambda: read(".autoloop/t/trials/1/checkpoint.pt")),
    deep_env=attempt(lambda: read("a/b/c/d/.env")),
    var_tmp=attempt(lambda: os.listdir("/var/tmp")), var_env=attempt(lambda: read({str(var_tmp / ".env")!r})),
    other_project=attempt(lambda: os.listdir({str(other_project)!r})),
    cache=attempt(lambda: os.listdir({str(cache_root())!r})),
    netrc=attempt(lambda: read({str(home / ".netrc")!r})), home=os.environ["HOME"],
    root=attempt(lambda: sorted(os.listdir("/root"))), run=attempt(lambda: os.listdir("/run")),
    top=sorted(os.listdir("/")), etc=sorted(os.listdir("/etc")),
    write_tmp=attempt(lambda: write("/tmp/scratch")), write_home=attempt(lambda: write(os.path.expanduser("~/x"))),
)
""")
    finally:
        for path in (var_tmp / ".env", ):
            path.unlink()
        var_tmp.rmdir()
    assert outcome.status == "ok", outcome.error_tail
    seen = outcome.result["seen"]
    for key in ("write_train", "write_new", "write_pycache", "write_site", "write_root", "write_usr"):
        assert seen[key].startswith("OSError: [Errno 30] Read-only file system"), (key, seen[key])
    assert seen["write_run"].startswith("ok") and seen["read_train"] == "ok: \"print('train')\\n\""
    tracked = subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True).stdout.split()
    assert seen["listing"] == sorted({t.split("/")[0] for t in tracked} | {".autoloop"})  # .autoloop: the run folder's way
    for key in ("db", "wal", "git", "other_trial", "deep_env", "var_tmp", "var_env", "other_project", "cache",
                "netrc", "run"):
        assert seen[key].startswith("FileNotFoundError"), (key, seen[key])
    assert seen["home"] == "/tmp/home" and seen["write_home"].startswith("ok")  # a private HOME
    assert seen["write_tmp"].startswith("ok")
    # The top level: the system's, and the ways to the interpreter, autoloop and the project
    # (wherever this checkout lies: /work here, /check on CI).
    ways = {Path(p).resolve().parts[1] for p in (sys.prefix, sys.base_prefix, autoloop.__file__, repo)}
    assert set(seen["top"]) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "sys", "etc", "dev", "proc",
                                "tmp", *ways}, seen["top"]
    assert "shadow" not in seen["etc"] and set(seen["etc"]) <= {p.name for p in sb._etc_entries()}
    # In /root only the way to what is re-exposed (e.g. a pyenv interpreter) shows.
    needed = {p.resolve().relative_to("/root").parts[0] for p in map(Path, (sys.prefix, sys.base_prefix))
              if Path("/root") in p.resolve().parents}
    assert seen["root"] == f"ok: {sorted(needed)!r}" or (not needed and seen["root"].startswith("FileNotFoundError"))
    # Nothing outside the run folder changed.
    status = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=repo, capture_output=True, text=True)
    assert sorted(status.stdout.split()) == sorted(["!!", ".autoloop/", "!!", "experiments.db", "!!",
                                                     "experiments.db-shm", "!!", "experiments.db-wal", "??", "a/"])
    assert (repo / "experiments.db").read_text() == "the trial log" and not pycache.exists()
    assert (layout["run_dir"] / "out.txt").read_text() == "x"


DAEMON = REPORT + """
import subprocess, sys, time
# A daemon in its own session, as `setsid` makes it: out of the trial's process group.
subprocess.Popen(["setsid", sys.executable, "-c", "import time; time.sleep(600)", os.environ["DAEMON_TAG"]],
                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(0.5)
report(pid=os.getpid())
"""


def processes_with_argument(tag: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if tag.encode() in cmdline and state not in ("Z", "X"):
                found.append(int(entry))
    return found


@needs_bwrap
def test_a_setsid_daemon_dies_with_the_trial(layout):
    from tests.test_runner import our_zombies

    tag = f"daemon-{os.getpid()}-{time.monotonic_ns()}"
    zombies = our_zombies()
    outcome = run_inside(layout, DAEMON, env={"DAEMON_TAG": tag})
    assert outcome.status == "ok", outcome.error_tail
    assert outcome.result["seen"]["pid"] <= 3  # a private PID namespace (bubblewrap is pid 1)
    assert processes_with_argument(tag) == []
    assert our_zombies() <= zombies


@needs_bwrap
def test_the_deadline_kills_the_whole_namespace(layout):
    tag = f"daemon-{os.getpid()}-{time.monotonic_ns()}"
    source = DAEMON.replace("report(pid", "time.sleep(60)\nreport(pid")
    started = time.monotonic()
    outcome = run_inside(layout, source, env={"DAEMON_TAG": tag}, deadline=3)
    assert outcome.status == "timeout" and time.monotonic() - started < 20
    assert processes_with_argument(tag) == []


@needs_bwrap
def test_environment_inside_and_no_configured_key_in_it_or_the_log(layout, monkeypatch):
    secret = "sk-do-not-leak-4242"
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MY_SECRET_VAR", secret)  # llm-api-key-env = "MY_SECRET_VAR"
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    outcome = run_inside(layout, REPORT + "print(dict(os.environ))\nreport(env=dict(os.environ))\n",
                         env={"AUTOLOOP_SEED": "3"})
    assert outcome.status == "ok", outcome.error_tail
    env = outcome.result["seen"]["env"]
    assert "MY_SECRET_VAR" not in env and secret not in json.dumps(env)
    assert secret not in (layout["run_dir"] / "train.log").read_text()
    assert env["HOME"] == "/tmp/home" and env["OPENBLAS_CORETYPE"] == "Haswell" and env["AUTOLOOP_SEED"] == "3"
    assert "AUTOLOOP_TRIAL_MARKER" in env and env["GOMP_SPINCOUNT"] == "10000"


@needs_bwrap
def test_gpu_device_nodes_are_passed_through(layout):
    nodes = sb.gpu_device_nodes()
    if not nodes:
        pytest.skip("no /dev/nvidia* or /dev/dri on this machine")
    outcome = run_inside(layout, REPORT + f"""
import os, stat
report(nodes={{n: stat.S_ISCHR(os.stat(n).st_mode) or os.path.isdir(n) for n in {list(nodes)!r}}})
""")
    assert outcome.status == "ok", outcome.error_tail
    assert all(outcome.result["seen"]["nodes"].values()), outcome.result["seen"]


@needs_bwrap
def test_torch_runs_inside(layout):
    outcome = run_inside(layout, REPORT + """
import torch
x = torch.arange(16, dtype=torch.float32).reshape(4, 4)
cuda = torch.cuda.is_available()
y = (x.cuda() @ x.cuda()).cpu() if cuda else x @ x
report(total=float(y.sum()), cuda=cuda)
""", env={"OMP_NUM_THREADS": "1"})
    assert outcome.status == "ok", outcome.error_tail
    seen = outcome.result["seen"]
    x = [[4 * i + j for j in range(4)] for i in range(4)]
    assert seen["total"] == sum(sum(x[i][k] * x[k][j] for k in range(4)) for i in range(4) for j in range(4))
    if sb.gpu_device_nodes() and Path("/dev/nvidiactl").exists():
        import torch

        assert seen["cuda"] == torch.cuda.is_available()


@needs_bwrap
@pytest.mark.slow
def test_an_honest_trial_gets_the_same_val_bpb_sandboxed(tmp_path, embedded_dataset, session_cache):
    """Step mode, same seed: the sandbox changes nothing a trial computes."""
    repo = make_repo(tmp_path / "repo", (REPO_ROOT / "train.py").read_text())
    env = {"AUTOLOOP_MAX_STEPS": "5", "AUTOLOOP_SEED": "11", "AUTOLOOP_DATA_DIR": str(embedded_dataset.path),
           "AUTOLOOP_COMPILE_CACHE": str(session_cache / "compile"), "PYTHONPATH": str(REPO_ROOT),
           "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "2"}
    metrics = {}
    for policy in (POLICY, detect("off")):
        run_dir = repo / ".autoloop" / "t" / "trials" / policy.kind
        run_dir.mkdir(parents=True)
        paths = SandboxPaths.for_trial(repo, run_dir, db_path="experiments.db", data_dir=embedded_dataset.path,
                                       compile_cache=session_cache / "compile")
        outcome = run_training(
            [sys.executable, "train.py"], cwd=repo, log_path=run_dir / "train.log", deadline_seconds=300,
            env={**env, "AUTOLOOP_RESULT": str(run_dir / "result.json"), "AUTOLOOP_CHECKPOINT": str(run_dir / "model.pt")},
            sandbox=policy, sandbox_paths=paths,
        )
        assert outcome.status == "ok", outcome.error_tail
        assert outcome.result["num_steps"] == 5
        metrics[policy.kind] = outcome.metric
    assert metrics["bwrap"] == metrics["off"]


# ---------------------------------------------------------------------------- the CLI flag


def test_no_sandbox_flag_sets_the_config(fake_repo, monkeypatch):
    from typer.testing import CliRunner

    import autoloop.loop.controller as controller_mod
    from autoloop.cli import app

    seen = []

    class FakeController:
        def __init__(self, config, repo, display=None):
            seen.append(config)
            raise AutoloopError("stopped by the test")

    monkeypatch.setattr(controller_mod, "Controller", FakeController)
    for flags, expected in ((["--no-sandbox"], "off"), ([], "auto")):
        result = CliRunner().invoke(app, ["run", "--repo", str(fake_repo), "--tag", "x", *flags])
        assert "stopped by the test" in result.output
        assert seen[-1].sandbox == expected


# ---------------------------------------------------------------------------- stopping


@needs_bwrap
def test_abort_stops_the_sandbox(layout):
    tag = f"daemon-{os.getpid()}-{time.monotonic_ns()}"
    source = DAEMON.replace("report(pid", "time.sleep(60)\nreport(pid")
    asked = time.monotonic() + 2
    outcome = run_inside(layout, source, env={"DAEMON_TAG": tag}, should_abort=lambda: time.monotonic() > asked)
    assert outcome.status == "aborted" and outcome.wall_seconds < 15
    assert processes_with_argument(tag) == []


def _wait_for(condition, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


@needs_bwrap
def test_killing_bubblewraps_group_ends_the_namespace(layout):
    """What crash recovery does with a recorded pgid: kill_process_group alone, no sweep."""
    from autoloop.base.processes import kill_process_group, process_start_time

    tag = f"daemon-{os.getpid()}-{time.monotonic_ns()}"
    script = layout["run_dir"] / "probe.py"
    script.write_text(DAEMON.replace("report(pid", "time.sleep(60)\nreport(pid"))
    argv, env = POLICY.wrap([sys.executable, str(script)], env=allowed_environment(
        {"DAEMON_TAG": tag, "AUTOLOOP_RESULT": str(layout["run_dir"] / "r.json"), "PYTHONPATH": str(REPO_ROOT)}),
        cwd=layout["repo"], writable=layout["paths"].writable, readonly=layout["paths"].readonly,
        hidden=layout["paths"].hidden)
    proc = subprocess.Popen(argv, env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        assert _wait_for(lambda: processes_with_argument(tag)), "the daemon did not start"
        # No kill without the start time of the leader that was recorded (issue 23, item 6).
        assert not kill_process_group(proc.pid, expected_pid=proc.pid, grace=0.5)
        assert kill_process_group(proc.pid, expected_pid=proc.pid, expected_start_time=process_start_time(proc.pid),
                                  grace=0.5)
        assert _wait_for(lambda: not processes_with_argument(tag), timeout=10)
    finally:
        proc.kill()
        proc.wait()


CONTROLLER = """
import sys
from pathlib import Path
from autoloop.measure.runner import run_training
from autoloop.measure.sandbox import SandboxPaths, detect
run_dir = Path(sys.argv[1])
run_training([sys.executable, str(run_dir / "probe.py")], cwd=sys.argv[2], env={"DAEMON_TAG": sys.argv[3],
             "AUTOLOOP_RESULT": str(run_dir / "r.json")}, log_path=run_dir / "train.log", deadline_seconds=120,
             sandbox=detect("on"), sandbox_paths=SandboxPaths(writable=(run_dir,)))
"""


@needs_bwrap
def test_the_trial_dies_with_a_killed_controller(layout):
    tag = f"daemon-{os.getpid()}-{time.monotonic_ns()}"
    (layout["run_dir"] / "probe.py").write_text(DAEMON.replace("report(pid", "time.sleep(60)\nreport(pid"))
    controller = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER, str(layout["run_dir"]), str(layout["repo"]), tag],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, start_new_session=True,
    )
    try:
        assert _wait_for(lambda: processes_with_argument(tag)), "the daemon did not start"
        controller.kill()  # SIGKILL: nothing of the controller gets to clean up
        controller.wait()
        assert _wait_for(lambda: not processes_with_argument(tag), timeout=10)
    finally:
        controller.kill()
        controller.wait()


# ---------------------------------------------------------------------------- scored text


@needs_bwrap
@pytest.mark.slow
def test_no_scored_text_exists_anywhere_a_trial_can_read(tmp_path, embedded_dataset):
    """The model that rebuilt the evaluation windows from the files they came from (the
    stdlib, when it was the corpus) scored 0.08 bpb against an honest 3.7. Whatever the
    corpus, none of 300 windows of 40 bytes drawn from val and held-out may appear in any
    file a trial can open: the sandbox of a training run (a trial's layout, this
    interpreter), searched whole with grep's fixed-string search."""
    import random

    rng = random.Random(31)
    patterns = []
    for split in ("val", "heldout"):
        tokens = embedded_dataset.split(split)
        text = embedded_dataset.tokenizer.decode(tokens[:400_000])
        drawn = 0
        for _ in range(20_000):  # grep reads a pattern a line: windows without a newline
            start = rng.randrange(0, max(1, len(text) - 40))
            window = text[start:start + 40]
            if b"\n" not in window and len(window) == 40:
                patterns.append(window)
                drawn += 1
            if drawn == 150:
                break
    assert len(patterns) == 300, len(patterns)
    pattern_file = tmp_path / "run" / "patterns.txt"
    pattern_file.parent.mkdir()
    pattern_file.write_bytes(b"\n".join(patterns) + b"\n")
    repo = make_repo(tmp_path / "repo", (REPO_ROOT / "train.py").read_text())
    paths = SandboxPaths.for_trial(repo, pattern_file.parent, db_path="experiments.db")
    outcome = run_training(
        ["grep", "-r", "-l", "-a", "-F", "-f", str(pattern_file), "/", "--exclude-dir=proc", "--exclude-dir=sys",
         "--exclude-dir=dev", f"--exclude={pattern_file.name}", "--exclude=train.log"],
        cwd=repo, env={}, log_path=pattern_file.parent / "train.log", deadline_seconds=900, sandbox=POLICY,
        sandbox_paths=paths, contract=False,
    )
    log = (pattern_file.parent / "train.log").read_text()
    found = [line for line in log.splitlines()[1:] if line.startswith("/") and "grep:" not in line]
    assert not found, f"scored text readable in the sandbox: {found[:10]}"
    assert outcome.returncode == 1, log[-2000:]  # grep's "no match", not an error


def test_the_run_says_in_one_line_what_a_sandbox_sees():
    line = SandboxPolicy("bwrap", bwrap="bwrap", version="0.8.0").describe()
    assert "\n" not in line and line.startswith("bwrap 0.8.0: sees only /usr, /sys, ")
    for part in ("the interpreter (", str(Path(autoloop.__file__).resolve().parent), "the project's tracked files",
                 "run folder", "no network", "no home or cache folder"):
        assert part in line, (part, line)
    assert SandboxPolicy("none", "bwrap not installed").describe() == "none: bwrap not installed"


# ---------------------------------------------------------------------------- whose autoloop


@pytest.fixture(scope="module")
def second_checkout(tmp_path_factory) -> Path:
    """A copy of this autoloop package elsewhere (a second checkout), made once for the
    module: the controller's bytecode templates are per harness, so both tests share one."""
    import shutil

    checkout = tmp_path_factory.mktemp("checkout")
    shutil.copytree(REPO_ROOT / "autoloop", checkout / "autoloop", ignore=shutil.ignore_patterns("__pycache__"))
    return checkout


@pytest.mark.slow
@pytest.mark.parametrize("sandbox", ["auto", "off"])
def test_training_imports_the_controllers_own_autoloop(tmp_path, sandbox, second_checkout):
    """A controller whose autoloop is not the one this interpreter imports by default (a
    second checkout put first on its path, as bench/night.py does from a clone) trains with
    its own harness: the training process imports the package the controller measures and
    fingerprints, not the installed one. Sandboxed, training found no autoloop at all (the
    sandbox shows only the controller's package, and the installed one's import hook points
    elsewhere); unsandboxed, it imported the installed one."""
    if sandbox == "auto" and POLICY.kind != "bwrap":
        pytest.skip(f"bubblewrap cannot run here ({POLICY.describe()})")
    checkout = second_checkout
    anchor = "from autoloop import harness as H\n"
    source = (REPO_ROOT / "train.py").read_text()
    assert anchor in source
    repo = make_repo(tmp_path / "repo", source.replace(anchor, anchor + "print('HARNESS FROM', H.__file__)\n", 1))
    program = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(checkout)!r})
        import autoloop
        assert autoloop.__file__.startswith({str(checkout)!r}), autoloop.__file__
        from autoloop.config import resolve
        from autoloop.loop.controller import Controller
        flags = dict(tag="own", proposers="ideas", decision_rule="strict", baseline_seeds=1, drift_every=0,
                     max_steps=2, max_trials=1, sandbox={sandbox!r})
        Controller(resolve({str(repo)!r}, flags), {str(repo)!r}).run()
    """)
    done = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    logs = sorted((repo / ".autoloop" / "own" / "trials" / "1").rglob("train.log"))
    assert logs, done.stderr[-2000:]
    log = logs[0].read_text()
    lines = [line for line in log.splitlines() if line.startswith("HARNESS FROM ")]
    assert lines, log[-2000:]
    harness = Path(lines[0].split(" ", 2)[2]).resolve()  # through the import root's link
    assert harness == (checkout / "autoloop" / "harness" / "__init__.py").resolve(), lines[0]
    from autoloop.store import Store

    store = Store(repo / "experiments.db")
    try:
        (baseline,) = store.trials(store.get_run("own")["id"])
    finally:
        store.close()
    assert baseline["status"] == "keep", baseline["reason"]
