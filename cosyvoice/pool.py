"""The worker pool: loads the model once, forks the worker processes, restarts any that die.

Decoders are created in the parent, before fork, so the model's pages are shared between
the processes (copy-on-write, and memory-mapped where the engine allows). The first
SIGTERM drains every worker process (each hands its sessions over); a second kills them.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from . import bus as busmod
from . import debug_mem
from .asr import Model, capacity_of, load_model
from .settings import Settings
from .worker import Worker

log = logging.getLogger("cosyvoice.worker")


def _run_child(settings: Settings, model: Model) -> int:
    model.after_fork()
    client = busmod.connect(settings.redis_url, max_connections=8, blocking=False,
                            cluster=settings.redis_cluster, ca_file=settings.redis_ca_file)
    worker = Worker(settings, model, client)
    stops = {"n": 0}

    def on_term(signum, frame):
        stops["n"] += 1
        if stops["n"] > 1:
            os._exit(1)
        worker.request_stop()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    log.info("worker %s ready (engine %s, capacity %d)", worker.id, model.name,
             worker.capacity)
    debug_mem.start("worker")
    worker.run()
    return 0


def _fork_child(settings: Settings, model) -> int:
    """Fork a worker process; returns its pid (the child never returns)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _run_child(settings, model)
        except BaseException:  # noqa: BLE001 - a child must never return into the parent
            log.exception("worker process crashed")
        finally:
            logging.shutdown()
            os._exit(code)
    return pid


def run_pool(settings: Settings, processes: int) -> int:
    """Load the model once, fork ``processes`` workers, restart any that die.

    Decoders are created here, before fork, so their model pages are shared between the
    worker processes. The first SIGTERM drains every worker; a second one kills them.
    """
    model = load_model(settings.engine, settings)
    model.preload(capacity_of(settings))  # each worker admits the engine's capacity
    children: dict[int, int] = {}
    state = {"stopping": 0}

    def spawn(slot: int) -> None:
        children[_fork_child(settings, model)] = slot

    def on_term(signum, frame):
        state["stopping"] += 1
        sig = signal.SIGTERM if state["stopping"] == 1 else signal.SIGKILL
        for pid in list(children):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    for slot in range(processes):
        spawn(slot)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        lost = children.pop(pid, None)
        if lost is not None and not state["stopping"]:
            log.warning("worker process %d exited (status %d); starting another", pid, status)
            time.sleep(0.5)
            spawn(lost)
    return 0

