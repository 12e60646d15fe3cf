"""What one trial may spend: memory, processes, disk, log and the data feed's memory.

A trial over a limit is `invalid` with the limit named, never the controller's problem:
the runner (autoloop.measure.runner) asks a `ResourceWatch` at every poll and kills the
trial's process group at once when it answers, then deletes its out/ and compile/ (before
it writes another line: the trial may have filled the disk), and the log keeps a head and
a tail (autoloop.measure.logpipe.LogPipe).

How each is bounded, and why this way:

* **Memory**: a watchdog, not an rlimit. It sums, over the trial's processes, the
  resident anonymous and shared memory (RssAnon + RssShmem in /proc/<pid>/status), plus
  what the sandbox's own tmpfs folders (/tmp, /dev/shm) hold, read through
  /proc/<pid>/root: that is RAM too. RSS counts a page that forked processes share once
  in each of them, so a sum over the limit is confirmed by the proportional sum (PSS,
  /proc/<pid>/smaps_rollup: exact, but the kernel walks the page tables to say it).
  RLIMIT_AS breaks CUDA (it reserves tens of GB of address space it never touches),
  and RLIMIT_DATA is per process and counts address
  space, not memory, so a trial of many processes gets many times it and an honest one
  with many threads' arenas could hit it. The cost of a watchdog is its window: between
  two polls (0.2 s) a process can touch perhaps a GB or two more than the limit.
* **Processes**: a watchdog too, counting the trial's processes (the descendants of the
  process the runner started: inside bubblewrap's PID namespace nothing escapes that
  tree; unsandboxed, a double-forked daemon does). RLIMIT_NPROC counts every process of the *user*, the
  controller and the user's shell included, and does not apply to root at all (bubblewrap
  run by root keeps uid 0), so it would bind honest trials or nothing.
* **Disk**: out/ and compile/ (the only folders a sandboxed trial can write on disk),
  walked without following links, bytes and files counted (a file's bytes are the larger
  of its size and its blocks): while the trial runs, whenever the disk's free space or
  free inodes (one statvfs a second) dropped by more than the room left under a limit,
  and every 10 s anyway; and once after it. The limit is the configured one or half of what the disk had free when the
  trial started, whichever is smaller: a trial that fills the disk is over its own limit
  (its fault, `invalid`), while a disk that fills for another reason still pauses the run
  (autoloop.loop.disk).
* **Log**: train.log stops growing at its cap and the trial is killed: a trial that
  prints that much is broken or attacking, and truncating while it runs on would only let
  it burn its budget writing. The log keeps its head and its tail, with a line saying
  where it was cut.
* **Feed**: autoloop.harness.feed refuses a stream over its memory budget and records it.

cgroups v2 would bound memory and processes in the kernel, with no window; they need a
delegated cgroup with the memory and pids controllers, which an ordinary user's session
rarely has (and this project's test machines, cgroup v1, do not), so the watchdog is the
one mechanism everywhere. `cgroup_v2_available` says whether a machine could do it.

Defaults never bind an honest trial on a GPU: a 300 s H100 run of train.py writes a
checkpoint of a few hundred MB and a log of a few MB, holds a few GB of host memory and a
few dozen processes (compile workers).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

# Every reason a limit gives starts so (autoloop.loop.disk tells a trial that filled the
# disk from a disk full for other reasons by it).
LIMIT_PREFIX = "over a trial limit: "
PSS_SECONDS = 1.0  # an RSS sum over the memory limit is confirmed by the PSS sum at most this often
DISK_POLL_SECONDS = 1.0  # out/ and compile/ are looked at most once a second ...
DISK_WALK_SECONDS = 10.0  # ... and walked when the disk's free space or inodes say they may be over, or this often
MIB = 2**20


@dataclass(frozen=True)
class TrialLimits:
    """What one trial may spend; the config's *_mb settings in bytes. memory_bytes None:
    half of this machine's memory (`memory_limit`)."""

    memory_bytes: int | None = None
    processes: int = 1024
    disk_bytes: int = 8192 * MIB
    files: int = 10_000
    log_bytes: int = 64 * MIB
    feed_bytes: int = 256 * MIB

    @classmethod
    def from_config(cls, config) -> "TrialLimits":
        memory = getattr(config, "trial_memory_mb", None)
        return cls(memory_bytes=memory * MIB if memory else None, processes=config.trial_processes,
                   disk_bytes=config.trial_disk_mb * MIB, files=config.trial_files,
                   log_bytes=config.trial_log_mb * MIB, feed_bytes=config.feed_memory_mb * MIB)

    @classmethod
    def from_dict(cls, data: dict | None) -> "TrialLimits":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)

    def memory_limit(self) -> int | None:
        """The memory a trial may hold: the configured bytes, else half of MemTotal (None
        where /proc/meminfo cannot be read: no memory limit)."""
        if self.memory_bytes:
            return self.memory_bytes
        total = machine_memory()
        return total // 2 if total else None


def machine_memory() -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def size(n: float) -> str:
    """Bytes for a reason: 256 MiB, 1.5 GiB."""
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / MIB:.0f} MiB" if n >= MIB else f"{n / 1024:.0f} KiB"


def is_limit_reason(reason: str | None) -> bool:
    return bool(reason) and reason.startswith(LIMIT_PREFIX)


def cgroup_v2_available(root: Path = Path("/sys/fs/cgroup")) -> str | None:
    """None when this machine has a cgroup v2 hierarchy with the memory and pids
    controllers at its root; else why not (the watchdog bounds trials either way)."""
    try:
        controllers = (root / "cgroup.controllers").read_text().split()
    except OSError:
        return f"no cgroup v2 hierarchy at {root} (cgroup v1 or none)"
    missing = [c for c in ("memory", "pids") if c not in controllers]
    return f"the cgroup v2 hierarchy at {root} lacks {', '.join(missing)}" if missing else None


# ---------------------------------------------------------------------------------------
# Reading /proc
# ---------------------------------------------------------------------------------------


def _stat_fields(pid: str) -> tuple[int, int, str] | None:
    """(ppid, pgid, state) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            rest = handle.read().rpartition(b")")[2].split()
        return int(rest[1]), int(rest[2]), rest[0].decode()
    except (OSError, ValueError, IndexError):
        return None


def _children_of(pid: int) -> list[int] | None:
    """The children of every thread of `pid` (/proc/<pid>/task/<tid>/children), [] when it
    is gone, None where the kernel has no such files (CONFIG_PROC_CHILDREN)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    kids: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as handle:
                kids += [int(k) for k in handle.read().split()]
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}/stat"):
                continue  # the thread ended
            return None
        except (OSError, ValueError):
            continue
    return kids


def _descendants_by_scan(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return []
    for name in entries:
        fields_ = _stat_fields(name)
        if fields_ is not None and fields_[2] not in ("Z", "X"):
            children.setdefault(fields_[0], []).append(int(name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, ()))
    return found


def trial_processes(pid: int) -> list[int]:
    """The live processes of a trial: `pid` and its descendants (inside bubblewrap's PID
    namespace every process of the trial is one; zombies do not count). Read from the
    children files of the trial's own processes, a cost that grows with the trial, not with
    the machine; where the kernel has none, from a scan of /proc."""
    found: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        state = _stat_fields(str(p))
        if state is None or state[2] in ("Z", "X"):
            continue
        kids = _children_of(p)
        if kids is None:
            return sorted(_descendants_by_scan(pid)) if _stat_fields(str(pid)) else []
        found.append(p)
        todo.extend(kids)
    return sorted(set(found))


def resident_bytes(pid: int) -> int:
    """RssAnon + RssShmem of a process (0 when it is gone): what it holds of the machine's
    memory that no file on disk backs."""
    total = 0
    try:
        with open(f"/proc/{pid}/status", "rb") as handle:
            for line in handle:
                if line.startswith((b"RssAnon:", b"RssShmem:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


def proportional_bytes(pid: int) -> int:
    """Pss_Anon + Pss_Shmem of a process (/proc/<pid>/smaps_rollup; Pss on kernels without
    them): its share of the anonymous and shared memory, a page shared by n processes (a
    fork's copy-on-write pages) counted 1/n in each. Exact across processes, but the kernel
    walks the page tables to say it (~10 ms for 500 MB), so it only confirms an RSS sum
    that looks over the limit. 0 when the process is gone."""
    found: dict[bytes, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as handle:
            for line in handle:
                key, _, rest = line.partition(b":")
                if key in (b"Pss", b"Pss_Anon", b"Pss_Shmem"):
                    found[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    if b"Pss_Anon" in found:
        return found[b"Pss_Anon"] + found.get(b"Pss_Shmem", 0)
    return found.get(b"Pss", 0)


def private_tmpfs_bytes(pid: int, folders: Iterable[str] = ("tmp", "dev")) -> int:
    """What the tmpfs folders of a sandboxed process's own mount namespace hold (/tmp,
    /dev with /dev/shm), seen through /proc/<pid>/root; folders that are the controller's
    own (an unsandboxed trial's /tmp is the disk) do not count."""
    total, seen = 0, set()
    for folder in folders:
        # One descriptor for both questions: while bubblewrap builds the namespace the path
        # names one folder, then another (its setup tmpfs, the old root), and a stat then a
        # statvfs of the path could ask about two, counting the host's disk as the trial's.
        try:
            fd = os.open(f"/proc/{pid}/root/{folder}", os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            inside = os.fstat(fd).st_dev
            if inside in (os.stat(f"/{folder}").st_dev, os.stat("/").st_dev) or inside in seen:
                continue
            seen.add(inside)
            st = os.fstatvfs(fd)
        except OSError:
            continue
        finally:
            os.close(fd)
        total += (st.f_blocks - st.f_bfree) * st.f_frsize
    return total


def _disk_free(folders: Iterable[Path]) -> tuple[int, int, int] | None:
    """(free bytes, free inodes, inodes in all) of the disk the first folder lies on."""
    for path in folders:
        try:
            usage = os.statvfs(path if path.exists() else path.parent)
        except OSError:
            continue
        return usage.f_bavail * usage.f_frsize, usage.f_favail, usage.f_files
    return None


def _free_bytes(folders: Iterable[Path]) -> int | None:
    free = _disk_free(folders)
    return free[0] if free is not None else None


def folder_usage(root: Path, stop_at_files: int | None = None) -> tuple[int, int]:
    """(bytes, entries) below `root`, links not followed, a file's bytes the larger of its
    size and its blocks; stops counting past `stop_at_files` entries (the walk is bounded)."""
    total = count = 0
    todo = [str(root)]
    while todo:
        try:
            with os.scandir(todo.pop()) as entries:
                for entry in entries:
                    count += 1
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += max(st.st_size, st.st_blocks * 512)
                    if entry.is_dir(follow_symlinks=False):
                        todo.append(entry.path)
                    if stop_at_files is not None and count > stop_at_files:
                        return total, count
        except OSError:
            continue
    return total, count


# ---------------------------------------------------------------------------------------
# The watchdog
# ---------------------------------------------------------------------------------------


class ResourceWatch:
    """Watches one trial against its limits (see the module doc). Made before the spawn
    (it notes the disk's free space then), `attach`ed to the started process, asked
    `check()` at every poll of the runner and `final()` once the trial is gone; both
    return the reason the trial is over a limit, or None.

    `folders`: {"out/": path, "compile/": path}, what the trial may write on disk.
    `log_over`: says whether the log pipe hit its cap."""

    def __init__(self, limits: TrialLimits, folders: dict[str, Path], *, log_over: Callable[[], bool] | None = None,
                 free_bytes: int | None = None, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self.folders = {label: Path(path) for label, path in folders.items()}
        self.log_over = log_over
        self.clock = clock
        self.memory = limits.memory_limit()
        # `free_bytes`: what the disk has free now (default: statvfs of the first folder's disk)
        self.disk_free = free_bytes if free_bytes is not None else _free_bytes(self.folders.values())
        self.disk_limit = limits.disk_bytes
        if self.disk_free is not None and self.disk_free // 2 < self.disk_limit:
            self.disk_limit = self.disk_free // 2
        self.pid: int | None = None
        self._next_disk = 0.0
        self._pss_until = 0.0  # an RSS sum over the limit was found to be within it by PSS: believed until then
        self._walked: tuple[float, int, int, int, int] | None = None  # when, bytes, files, disk free, inodes free
        self.peak = {"memory": 0, "processes": 0, "disk": 0, "files": 0}

    def attach(self, pid: int) -> None:
        self.pid = pid

    def check(self) -> str | None:
        if self.log_over is not None and self.log_over():
            return self._log_reason()
        if self.pid is not None:
            problem = self._processes_and_memory()
            if problem:
                return problem
        now = self.clock()
        if now >= self._next_disk:
            self._next_disk = now + DISK_POLL_SECONDS
            if self._may_be_over(now):
                return self._disk()
        return None

    def _may_be_over(self, now: float) -> bool:
        """Whether out/ and compile/ may have passed a limit since the last walk: the trial
        cannot have written more bytes (or files) than the disk lost free space (or inodes)
        meanwhile; another program freeing space can hide some, so a walk every
        DISK_WALK_SECONDS anyway. A walk of 2,000 files costs ~35 ms: this keeps an honest
        trial's watch at a statvfs a second."""
        if self._walked is None or now - self._walked[0] >= DISK_WALK_SECONDS:
            return True
        free = _disk_free(self.folders.values())
        if free is None:
            return True
        _, used, files, was_free, was_inodes = self._walked
        if was_free - free[0] > self.disk_limit - used:
            return True
        return free[2] == 0 or was_inodes - free[1] > self.limits.files - files

    def final(self) -> str | None:
        """After the trial: the log's cap and the disk once more (what it wrote after the last walk)."""
        if self.log_over is not None and self.log_over():
            return self._log_reason()
        return self._disk()

    def discard(self) -> None:
        """Delete what the trial wrote in the watched folders (it went over a limit), links
        not followed: the folders are removed, whatever lies in them."""
        import shutil

        for path in self.folders.values():
            if path.is_symlink() or path.is_file():
                path.unlink(missing_ok=True)
            elif path.exists():
                shutil.rmtree(path, ignore_errors=True)

    def _log_reason(self) -> str:
        return (f"{LIMIT_PREFIX}train.log grew past {size(self.limits.log_bytes)}, the most a trial may print "
                "(trial-log-mb)")

    def _processes_and_memory(self) -> str | None:
        pids = trial_processes(self.pid)
        self.peak["processes"] = max(self.peak["processes"], len(pids))
        if len(pids) > self.limits.processes:
            return (f"{LIMIT_PREFIX}ran {len(pids)} processes at once, past the {self.limits.processes} a trial may "
                    "run (trial-processes)")
        if self.memory is None:
            return None
        # The sandbox's /tmp and /dev/shm, seen from a process inside it (bubblewrap's
        # first process stays outside the namespaces; its child is inside).
        inner = [p for p in pids if p != self.pid][:1]
        tmpfs = private_tmpfs_bytes(inner[0]) if inner else 0
        held = sum(resident_bytes(p) for p in pids) + tmpfs
        if held > self.memory and len(pids) > 1:
            # RSS counts a page shared by forked processes once in each: the PSS sum says
            # what they hold together (dataloader workers of a big process are not over).
            now = self.clock()
            if now < self._pss_until:
                return None
            held = sum(proportional_bytes(p) for p in pids) + tmpfs
            if held <= self.memory:
                self._pss_until = now + PSS_SECONDS
        self.peak["memory"] = max(self.peak["memory"], held)
        if held > self.memory:
            return (f"{LIMIT_PREFIX}held {size(held)} of memory (resident, its /tmp included), past the "
                    f"{size(self.memory)} a trial may hold (trial-memory-mb)")
        return None

    def _disk(self) -> str | None:
        free = _disk_free(self.folders.values())
        used: dict[str, tuple[int, int]] = {}
        files_left = self.limits.files
        for label, path in self.folders.items():
            used[label] = folder_usage(path, stop_at_files=max(files_left, 0))
            files_left -= used[label][1]
        total = sum(b for b, _ in used.values())
        files = sum(n for _, n in used.values())
        self.peak["disk"], self.peak["files"] = max(self.peak["disk"], total), max(self.peak["files"], files)
        if free is not None:
            self._walked = (self.clock(), total, files, free[0], free[1])
        biggest = max(used, key=lambda label: used[label][0]) if used else "out/"
        if files > self.limits.files:
            most = max(used, key=lambda label: used[label][1])
            return (f"{LIMIT_PREFIX}{most} holds more than {self.limits.files:,} files, the most a trial may write "
                    "(trial-files)")
        if total > self.disk_limit:
            if self.disk_limit < self.limits.disk_bytes:
                return (f"{LIMIT_PREFIX}{biggest} grew to {size(total)}, half of the {size(self.disk_free or 0)} the "
                        "disk had free when the trial started: the trial filled the disk")
            return (f"{LIMIT_PREFIX}{biggest} grew to {size(total)}, past the {size(self.limits.disk_bytes)} a trial "
                    "may write (trial-disk-mb)")
        return None
