"""CPU time of a whole process tree, read from /proc by the trusted side.

The budget's start-up rule (autoloop.trust.startup) needs the CPU a trial had used before
its first batch: all of it, not only the process that talks to the feed. A trial may train
in a child, a grandchild or a daemon it leaves behind. Under bubblewrap every such process
stays a descendant of the process the runner spawned (bubblewrap's PID 1 adopts orphans,
and whatever it reaps lands in its cutime), so the sum over the spawned process's
descendants of utime + stime + cutime + cstime is the tree's CPU: a reaped child counts
in its reaper's c-fields, a live one in its own. Without bubblewrap an orphan is adopted
outside the tree and is not counted (docs/verification.md).
"""

from __future__ import annotations

import os

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
MAX_PROCESSES = 100_000  # /proc entries read at most (a machine has hundreds to thousands)


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds with reaped children) of one process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rpartition(b")")[2].split()
        return int(fields[1]), sum(int(f) for f in fields[11:15]) / _CLOCK_TICKS
    except (OSError, ValueError, IndexError):
        return None


def tree_cpu_seconds(root: int | None) -> float | None:
    """CPU seconds used by `root` and all its descendants (the reaped ones included), or None
    where there is no /proc or `root` is gone."""
    if root is None or not os.path.isdir("/proc/self"):
        return None
    stats: dict[int, tuple[int, float]] = {}
    try:
        entries = os.scandir("/proc")
    except OSError:
        return None
    with entries:
        for entry in entries:
            if len(stats) >= MAX_PROCESSES:
                break
            if entry.name.isdigit():
                stat = _stat(entry.name)
                if stat is not None:
                    stats[int(entry.name)] = stat
    if root not in stats:
        return None
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo, seen = 0.0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total
