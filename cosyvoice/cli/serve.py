"""The commands that run the service: ``gateway``, ``worker`` (and ``worker
--calibrate``), and ``serve``, which runs Redis, the gateway and the worker pool on this
machine and stops them together."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable

from ..settings import Settings
from .exits import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
)

# `serve` starts the worker pool once the gateway answers, or after this long regardless
SERVE_GATEWAY_WAIT_S = 30.0

def _process_count(settings: Settings, processes: int | None) -> int:
    n = processes if processes is not None else settings.workers
    return n if n > 0 else (os.cpu_count() or 1)


def cmd_gateway(settings: Settings) -> int:
    from gevent import monkey
    monkey.patch_all()
    from gevent import pywsgi

    from .. import logs
    from ..gateway.wshandler import Handler
    from ..webui import create_app

    logs.setup(settings.log_level)
    if not settings.redis_url:
        raise CliError(EXIT_USAGE, "set COSYVOICE_REDIS_URL or --redis-url")
    app = create_app(settings)
    server = pywsgi.WSGIServer((settings.host, settings.port), app,
                               handler_class=Handler, log=None)
    try:
        server.init_socket()
    except OSError as exc:
        raise CliError(EXIT_FAILED, f"cannot listen on {settings.host}:{settings.port}: "
                                    f"{os.strerror(exc.errno) if exc.errno else exc}") from None

    def on_term(signum, frame):
        import gevent
        gevent.spawn(server.stop, timeout=5)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    print(f"gateway listening on http://{settings.host}:{settings.port}", file=sys.stderr,
          flush=True)
    server.serve_forever()
    return EXIT_OK


def cmd_calibrate(settings: Settings) -> int:
    """Decode the calibration audio as real-time sessions; print the capacity it implies."""
    from ..asr.calibrate import calibrate

    c = calibrate(settings)
    print(f"engine {c.engine}: {c.cost:.3f} CPU-s per audio second per session here, "
          f"{c.reference_cost:.3f} on the reference host (capacity {c.reference_capacity}); "
          f"sessions per worker process here:", file=sys.stderr)
    print(f"COSYVOICE_WORKER_CAPACITY={c.capacity}")
    return 0


def cmd_worker(settings: Settings, processes: int | None) -> int:
    from .. import logs, metrics_dir

    logs.setup(settings.log_level)
    if not settings.redis_url:
        raise CliError(EXIT_USAGE, "set COSYVOICE_REDIS_URL or --redis-url")
    if not settings.worker_metrics_port:
        from ..worker.pool import run_pool
        return run_pool(settings, _process_count(settings, processes))
    # The pool's processes add up their metrics in one directory, chosen before
    # prometheus_client is imported (by .pool, through .worker).
    path, created = metrics_dir.choose("worker")
    metrics_dir.clear(path)
    from .. import metrics
    from ..worker.pool import run_pool
    try:
        metrics.serve_pool(settings.host, settings.worker_metrics_port)
        return run_pool(settings, _process_count(settings, processes))
    finally:
        if created:
            metrics_dir.remove(path)


def cmd_serve(settings: Settings) -> int:
    """Everything on one machine; Ctrl-C stops it all and leaves no process behind."""
    from ..store.embedded_redis import EmbeddedRedis

    embedded = None
    if not settings.redis_url:
        embedded = EmbeddedRedis().start()
        settings = settings.replace(redis_url=embedded.url)
        print(f"embedded redis on {embedded.url}", file=sys.stderr, flush=True)
    env = {**os.environ, **settings.as_env()}
    nproc = _process_count(settings, None)
    stopping = {"n": 0}

    def on_signal(signum, frame):
        stopping["n"] += 1

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    children = [subprocess.Popen([sys.executable, "-m", "cosyvoice", "gateway"], env=env)]
    exited = None
    try:
        # The worker pool starts once the gateway answers: the pool reads how busy the
        # host's cores are while it loads its model (cosyvoice/worker/hostload.py), and a gateway
        # starting beside it would read as other work
        _wait_healthz(settings.host, settings.port, children[0], SERVE_GATEWAY_WAIT_S,
                      lambda: stopping["n"] > 0)
        if not stopping["n"] and children[0].poll() is None:
            children.append(subprocess.Popen([sys.executable, "-m", "cosyvoice", "worker",
                                              "--processes", str(nproc)], env=env))
            print(f"cosyvoice serving on http://{settings.host}:{settings.port}/ "
                  f"({nproc} ASR worker processes, engine {settings.engine})",
                  file=sys.stderr, flush=True)
        while not stopping["n"] and exited is None:
            exited = next((c for c in children if c.poll() is not None), None)
            time.sleep(0.2)
    finally:
        _stop_children(children, stopping)
        if embedded:
            embedded.stop()
    if exited is not None:
        name = "gateway" if exited is children[0] else "worker pool"
        raise CliError(EXIT_FAILED, f"the {name} exited with status {exited.returncode}; "
                                    "stopped everything")
    return EXIT_OK


def _wait_healthz(host: str, port: int, proc: subprocess.Popen, timeout: float,
                  stopped: Callable[[], bool]) -> None:
    """Until the server on ``host:port`` answers ``/healthz``, ``proc`` exits, ``stopped()``
    (Ctrl-C), or ``timeout``."""
    import urllib.request

    host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    host = f"[{host}]" if ":" in host else host
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no HTTP_PROXY
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None and not stopped():
        try:
            with direct.open(f"http://{host}:{port}/healthz", timeout=1):
                return
        except OSError:
            time.sleep(0.2)


def _stop_children(children: list[subprocess.Popen], stopping: dict) -> None:
    for c in children:
        if c.poll() is None:
            c.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for c in children:
        while c.poll() is None and time.monotonic() < deadline and stopping["n"] < 2:
            time.sleep(0.1)
        if c.poll() is None:
            c.kill()
            c.wait()
