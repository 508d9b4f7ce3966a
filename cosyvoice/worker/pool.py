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

from .. import debug_mem
from ..asr import Model, capacity_of, load_model
from ..settings import Settings
from ..store import bus as busmod
from . import hostload
from .loop import Worker

log = logging.getLogger("cosyvoice.worker")

# The shortest time the host's other work is sampled over before the workers start (the
# model's load, made this long where it was shorter); shorter says little.
HOST_SAMPLE_S = 0.5
# A dead worker process is replaced this long after (the host is sampled meanwhile).
RESTART_PAUSE_S = 0.5


def _run_child(settings: Settings, model: Model, others: float | None) -> int:
    model.after_fork()
    client = busmod.connect(settings.redis_url, max_connections=8, blocking=False,
                            cluster=settings.redis_cluster, ca_file=settings.redis_ca_file)
    worker = Worker(settings, model, client, host_others=others)
    stops = {"n": 0}

    def on_term(signum, frame):
        stops["n"] += 1
        if stops["n"] > 1:
            os._exit(1)
        worker.request_stop()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    busy = f"; {others:.2f} of {len(hostload.cores())} cores busy with other work" \
        if others is not None else ""
    log.info("worker %s ready (engine %s, capacity %d%s)", worker.id, model.name,
             worker.capacity, busy)
    debug_mem.start("worker")
    worker.run()
    return 0


def _fork_child(settings: Settings, model, others: float | None) -> int:
    """Fork a worker process; returns its pid (the child never returns)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _run_child(settings, model, others)
        except BaseException:  # noqa: BLE001 - a child must never return into the parent
            log.exception("worker process crashed")
        finally:
            logging.shutdown()
            os._exit(code)
    return pid


def _others_since(since: hostload.Sample | None) -> float | None:
    """Cores busy with other work from ``since`` to now, at least ``HOST_SAMPLE_S`` later."""
    if since is not None:
        time.sleep(max(0.0, since.at + HOST_SAMPLE_S - time.monotonic()))
    return hostload.others(since, hostload.sample())


def run_pool(settings: Settings, processes: int) -> int:
    """Load the model once, fork ``processes`` workers, restart any that die.

    Decoders are created here, before fork, so their model pages are shared between the
    worker processes. The first SIGTERM drains every worker; a second one kills them.
    """
    # The host's other work is sampled while the model loads, and again in the pause
    # before each replacement process (cosyvoice/worker/hostload.py): a whisper-live worker
    # starts with the share of the cores it leaves (cosyvoice/asr/admission.py,
    # start_capacity)
    since = hostload.sample()
    model = load_model(settings.engine, settings)
    model.preload(capacity_of(settings))  # each worker admits the engine's capacity
    children: dict[int, int] = {}
    state = {"stopping": 0}

    def spawn(slot: int, others: float | None) -> None:
        children[_fork_child(settings, model, others)] = slot

    def on_term(signum, frame):
        state["stopping"] += 1
        sig = signal.SIGTERM if state["stopping"] == 1 else signal.SIGKILL
        for pid in list(children):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    others = _others_since(since)
    for slot in range(processes):
        spawn(slot, others)
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
            before = hostload.sample()  # the host over the pause before the restart
            time.sleep(RESTART_PAUSE_S)
            spawn(lost, hostload.others(before, hostload.sample()))
    return 0

