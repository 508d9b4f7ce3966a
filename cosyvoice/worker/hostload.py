"""How many of this host's cores other work keeps busy: what a starting worker pool may
count on (``admission.start_capacity``).

A worker process's capacity follows its decode scheduler once it has sessions
(``cosyvoice/asr/admission.py``), but it starts with the engine's measured capacity, and
the first sessions of a burst all arrive before anything is measured. On a host whose cores
are already busy with other work, that start admits twice what fits, and those sessions
stay late until they end. So the worker pool samples the host's CPU time while it loads
its model (and again before it replaces a dead process): the cores this pool may run on
(its CPU affinity), their busy time from ``/proc/stat``, less the pool's own processes'.

Linux only: elsewhere, or where ``/proc`` cannot be read, nothing is known (None) and the
capacity starts as before. Nothing is known either under a CPU quota (a container's cgroup
``cpu.max``, or ``cpu.cfs_quota_us``: a Kubernetes CPU limit): ``/proc/stat`` counts the
whole host's cores there, and other tenants' work on them does not take this pool's
quota. A cpuset (CPU affinity) is seen.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

PROC = "/proc"
CGROUP = "/sys/fs/cgroup"


@dataclass(frozen=True)
class Sample:
    """CPU time counters at one moment (clock ticks): the pool's cores busy and in all,
    and the pool's own processes."""

    at: float
    busy: int
    total: int
    own: int


def cores() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _cpu_ticks(cpus: list[int], stat: str) -> tuple[int, int]:
    """Busy and total ticks of ``cpus`` from ``/proc/stat``'s text."""
    wanted = {f"cpu{c}" for c in cpus}
    busy = total = 0
    for line in stat.splitlines():
        name, *fields = line.split()
        if name not in wanted:
            continue
        values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(values)
        busy += sum(values) - values[3] - values[4]
    return busy, total


def _tree_ticks(root: int) -> int:
    """User and system ticks of ``root`` and every process below it (threads included)."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir(PROC):
        if not entry.isdigit():
            continue
        try:
            with open(f"{PROC}/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        # the command name may hold spaces and parentheses: the fields follow the last ")"
        fields = stat[stat.rindex(")") + 2:].split()
        pid = int(entry)
        parents[pid] = int(fields[1])
        ticks[pid] = int(fields[11]) + int(fields[12])
    total = 0
    for pid, t in ticks.items():
        p = pid
        while p > 1 and p != root:
            p = parents.get(p, 0)
        if p == root:
            total += t
    return total


def quota(cgroup: str = CGROUP, membership: str = "/proc/self/cgroup") -> bool:
    """Whether a CPU quota applies to this process's cgroup: v2's ``cpu.max``, or v1's
    ``cpu.cfs_quota_us`` (the paths from ``membership``, as the process sees them)."""
    try:
        with open(membership) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = ["0::/"]
    files = []
    for line in lines:
        _id, controllers, path = line.split(":", 2)
        if not controllers:
            files.append(f"{cgroup}{path.rstrip('/')}/cpu.max")
        elif "cpu" in controllers.split(","):
            files.append(f"{cgroup}/{controllers}{path.rstrip('/')}/cpu.cfs_quota_us")
    for path in files:
        try:
            with open(path) as f:
                value = f.read().split()[0]
        except (OSError, IndexError):
            continue
        if value != "max" and not value.startswith("-"):
            return True
    return False


def sample(root: int | None = None) -> Sample | None:
    """The counters now; ``root``: the pool's process (this one by default). None: not
    known (not Linux, or under a CPU quota)."""
    if quota():
        return None
    try:
        with open(f"{PROC}/stat") as f:
            busy, total = _cpu_ticks(cores(), f.read())
        own = _tree_ticks(root or os.getpid())
    except (OSError, ValueError, IndexError):
        return None
    return Sample(time.monotonic(), busy, total, own)


def others(before: Sample | None, after: Sample | None) -> float | None:
    """Cores other work kept busy between two samples (the pool's own time left out);
    None: not known."""
    if before is None or after is None or after.total <= before.total:
        return None
    n = len(cores())
    host = n * (after.busy - before.busy) / (after.total - before.total)
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    own = (after.own - before.own) / ticks_per_s / max(after.at - before.at, 1e-3)
    return round(max(0.0, host - own), 2)
