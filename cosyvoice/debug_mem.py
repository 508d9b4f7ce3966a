"""``DEBUG_MEM=1``: a tracemalloc dumper for hunting memory growth in gateway and worker.

Every ``DEBUG_MEM_INTERVAL_S`` seconds (30) it logs the process's RSS and the 20 source
lines whose allocations grew or shrank most since the previous dump. tracemalloc slows
allocation down noticeably: turn it on to find a leak, not in normal operation.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import tracemalloc

log = logging.getLogger("cosyvoice.debug_mem")

ENV = "DEBUG_MEM"
INTERVAL_ENV = "DEBUG_MEM_INTERVAL_S"
TOP = 20
# Frames kept per allocation: enough to see who called the allocating line.
FRAMES = 25


def enabled(environ=os.environ) -> bool:
    return environ.get(ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def rss_bytes() -> int:
    """Resident set size of this process, from /proc (0 where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class MemoryDumper:
    """Compares tracemalloc snapshots; each ``dump`` logs what changed since the last."""

    def __init__(self, role: str):
        self.role = role
        if not tracemalloc.is_tracing():
            tracemalloc.start(FRAMES)
        self.snapshot = self._take()

    @staticmethod
    def _take() -> tracemalloc.Snapshot:
        return tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)])

    def dump(self) -> list[dict]:
        current = self._take()
        top = [{"where": f"{s.traceback[0].filename}:{s.traceback[0].lineno}",
                "size_diff": s.size_diff, "size": s.size, "count_diff": s.count_diff}
               for s in current.compare_to(self.snapshot, "lineno")[:TOP]]
        self.snapshot = current
        traced, peak = tracemalloc.get_traced_memory()
        log.info("memory: rss %d B, traced %d B", rss_bytes(), traced,
                 extra={"event": "debug_mem", "role": self.role, "rss": rss_bytes(),
                        "traced": traced, "traced_peak": peak, "top": top})
        return top


def start(role: str) -> bool:
    """Starts the dumper in this process when ``DEBUG_MEM`` is on; True if it did.

    Call it in each process to be watched (after fork: threads do not survive it).
    Under gevent the thread is a greenlet, so a dump briefly holds up that process.
    """
    if not enabled():
        return False
    interval = float(os.environ.get(INTERVAL_ENV, "30"))
    dumper = MemoryDumper(role)
    log.info("DEBUG_MEM on: tracemalloc dump every %.0f s", interval,
             extra={"event": "debug_mem", "role": role})

    def loop() -> None:
        while True:
            time.sleep(interval)
            try:
                dumper.dump()
            except Exception:  # noqa: BLE001 - a debugging aid must not kill its host
                log.exception("memory dump failed")

    threading.Thread(target=loop, name="debug-mem", daemon=True).start()
    return True
