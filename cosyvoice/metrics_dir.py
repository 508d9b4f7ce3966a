"""The directory where the processes of one server keep their Prometheus metric files.

gunicorn's gateway processes, and the processes of one ASR worker pool, each write their
metrics to files in a shared directory (``PROMETHEUS_MULTIPROC_DIR``); whichever process
answers a scrape adds them up. prometheus_client decides at import time whether it runs
in that mode, so the directory is chosen here, before anything imports prometheus_client
(this module must not import it at the top).

One directory per server: a gateway instance and a worker pool on the same host must not
share one, because each clears its directory when it starts.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

ENV = "PROMETHEUS_MULTIPROC_DIR"
# Directories this process created (gunicorn re-reads its config file on SIGHUP).
_created: set[str] = set()


def choose(role: str) -> tuple[str, bool]:
    """The directory named by ``PROMETHEUS_MULTIPROC_DIR``, or a new temporary one that
    is then exported to this process and its children. Returns (path, created)."""
    path = os.environ.get(ENV)
    if path:
        os.makedirs(path, exist_ok=True)
        return path, path in _created
    path = tempfile.mkdtemp(prefix=f"cosyvoice-{role}-metrics-")
    os.environ[ENV] = path
    _created.add(path)
    return path, True


def clear(path: str) -> None:
    """Forget the metrics of a previous run (counters would otherwise carry over)."""
    for name in glob.glob(os.path.join(path, "*.db")):
        os.remove(name)


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def mark_dead(pid: int, path: str | None = None) -> None:
    """Drop a dead process's live gauges (its counters stay: they must never go back)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, path)


def prune_dead(path: str) -> None:
    """``mark_dead`` every process of this host whose gauge files outlived it."""
    pids = set()
    for name in glob.glob(os.path.join(path, "gauge_live*_*.db")):
        digits = os.path.basename(name)[:-3].rsplit("_", 1)[-1]
        if digits.isdigit():
            pids.add(int(digits))
    for pid in pids:
        if not _alive(pid):
            mark_dead(pid, path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
