"""Starts cosyvoice for the tests and the benchmarks: Redis, gateways, worker pools.

The one launcher: every test fixture and benchmark that needs a running service starts
it here, so they all run the same commands with the same environment (tests of a command
itself, such as ``cosyvoice serve`` or an installed script, run it as a user would).
The production gateway is ``gunicorn -c gunicorn.conf.py cosyvoice.webui:app`` read
from docker-compose.yml, as docs/deployment.md has operators run it (all settings from
``COSYVOICE_*``); ``cosyvoice gateway`` is the single-process server of
``cosyvoice serve``, quicker to start. A worker pool is docker-compose's
``cosyvoice worker``, sized by ``COSYVOICE_WORKERS``.

Every command runs through this interpreter (``gunicorn …`` as ``python -m gunicorn …``)
from ``root``, the checkout whose code runs (``python -m`` and gunicorn put the working
directory first on ``sys.path``); benchmarks/placement.py passes another checkout as a
baseline. Each process leads a process group of its own, so ``stop`` can kill what its
children leave.

Why in tests/: the fixtures are its main user, benchmarks already read their audio from
tests/fixtures and put the repository root on ``sys.path``, and the installed package must
not carry test machinery. It imports neither pytest nor the test helpers, so a benchmark
needs nothing more than the test extra's PyYAML (for docker-compose.yml).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import requests

from cosyvoice.store import bus as busmod
from cosyvoice.store.embedded_redis import EmbeddedRedis, free_port

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
LOOPBACK = "127.0.0.1"
# Never passed on from the caller's environment, besides its COSYVOICE_* settings: its
# metrics directory (a gateway empties its directory at start), gunicorn's control
# socket directory and the memory dumper. A child that needs one is given it explicitly.
NOT_INHERITED = ("PROMETHEUS_MULTIPROC_DIR", "XDG_RUNTIME_DIR", "DEBUG_MEM",
                 "DEBUG_MEM_INTERVAL_S")

T = TypeVar("T")


# ---- waiting -------------------------------------------------------------------------------

# The reference machine's time for ``_probe`` (2 cores, quiet; the minimum of three runs):
# every wait's deadline is written for that machine and scaled by how much slower this one is.
PROBE_REFERENCE_S = 0.013


def _probe() -> float:
    """A fixed piece of interpreter and C work, timed (the best of three)."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        total = 0
        for i in range(200_000):
            total += i * i % 7
        hashlib.sha256(b"x" * 4_000_000).digest()
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def time_scale() -> float:
    """How much longer than on the reference machine the waits here may take: at least 1,
    this machine's probe time over the reference's, or ``COSYVOICE_TEST_TIME_SCALE``."""
    given = os.environ.get("COSYVOICE_TEST_TIME_SCALE")
    if given:
        return max(1.0, float(given))
    return max(1.0, _probe() / PROBE_REFERENCE_S)


def scaled(seconds: float) -> float:
    """A deadline written for the reference machine, on this one."""
    return seconds * time_scale()


def wait_for(predicate: Callable[[], T | None], timeout: float = 15.0,
             interval: float = 0.05) -> T:
    """The first truthy value of ``predicate()``, polled until ``timeout`` (seconds on the
    reference machine, ``scaled`` here)."""
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"condition not met within {scaled(timeout):.0f}s")


def wait_http(url: str, proc: subprocess.Popen | None = None, timeout: float = 30.0) -> None:
    """Until ``url`` answers 200; fails at once if ``proc`` exits first."""
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {scaled(timeout):.0f}s")


def live_worker_ids(redis_url: str, ca_file: str = "") -> set[str]:
    """The live ASR worker processes on this Redis (several comma-separated seeds: a
    cluster; ``ca_file``: its TLS certificates' CA), by id."""
    client = busmod.connect(redis_url, blocking=False, cluster="," in redis_url,
                            ca_file=ca_file)
    try:
        return {w["id"] for w in busmod.Bus(client).live_workers()}
    finally:
        client.close()


def wait_workers(redis_url: str, count: int, timeout: float = 60.0,
                 besides: frozenset[str] = frozenset(), ca_file: str = "") -> None:
    """Until at least ``count`` ASR worker processes other than ``besides`` send
    heartbeats to this Redis (those of an earlier service on the same Redis may lapse
    meanwhile: counted by id, they neither help nor hinder)."""
    wait_for(lambda: len(live_worker_ids(redis_url, ca_file) - besides) >= count,
             timeout=timeout)


# ---- stopping ------------------------------------------------------------------------------


def stop(*procs: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM to each process, then SIGKILL to the process group of any that has not
    exited within ``timeout`` (``scaled``; the same deadline for all of them)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + scaled(timeout)
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def terminate(proc: subprocess.Popen, timeout: float = 15.0) -> int:
    """``stop`` for one process; its exit status."""
    stop(proc, timeout=timeout)
    return proc.returncode


# ---- Redis ---------------------------------------------------------------------------------


@contextlib.contextmanager
def redis_server(workdir: Path | None = None, persist: bool = False) -> Iterator[EmbeddedRedis]:
    """An embedded redis-server on a free port, stopped on exit; its files in ``workdir``
    (a temporary directory unless given), with an append-only file if ``persist``."""
    server = EmbeddedRedis(workdir=str(workdir) if workdir else None, persist=persist).start()
    try:
        yield server
    finally:
        server.stop()


# ---- processes -----------------------------------------------------------------------------


def compose_command(service: str) -> list[str]:
    """The ``command`` of a docker-compose.yml service."""
    import yaml  # the test extra's; only this needs it

    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    return list(compose["services"][service]["command"])


def child_env(env: dict[str, str]) -> dict[str, str]:
    """This process's environment without any ``COSYVOICE_*`` or ``NOT_INHERITED``
    variable, plus ``env``: a child's settings are exactly what its caller gives."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("COSYVOICE_") and k not in NOT_INHERITED}
    return {**base, **env}


def launch(command: list[str], env: dict[str, str], log: Path | None,
           root: Path = ROOT) -> subprocess.Popen:
    """``python -m <command>`` from ``root`` in a new process group; output appended to
    ``log``, or to this process's own output when there is none."""
    args = [sys.executable, "-m", *command]
    if log is None:
        return subprocess.Popen(args, env=child_env(env), cwd=root, start_new_session=True)
    with open(log, "ab") as out:
        return subprocess.Popen(args, env=child_env(env), cwd=root, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _log_path(logs: Path | None, name: str) -> Path | None:
    return logs / f"{name}.log" if logs is not None else None


@dataclass
class Gateway:
    url: str
    port: int
    proc: subprocess.Popen
    log: Path | None
    home: Path | None  # its HOME, when it has one of its own


def start_gateway(redis_url: str, *, gunicorn: bool = False, processes: int = 1,
                  env: dict[str, str] | None = None, logs: Path | None = None,
                  name: str = "gateway", port: int | None = None, root: Path = ROOT,
                  timeout: float = 60.0) -> Gateway:
    """A gateway on ``port`` of the loopback address (a free one unless given), once its
    ``/healthz`` answers.

    ``gunicorn``: the production command of docker-compose.yml with ``processes``
    processes (``COSYVOICE_GATEWAY_PROCESSES``) and, when there are ``logs``, a HOME of its
    own there (``<name>-home``); otherwise ``cosyvoice gateway``, one process. ``logs``:
    the directory of its log, ``<name>.log``.
    """
    if not gunicorn and processes != 1:
        raise ValueError("`cosyvoice gateway` is one process; use gunicorn for more")
    port = port or free_port()
    settings = {"COSYVOICE_REDIS_URL": redis_url, "COSYVOICE_HOST": LOOPBACK,
                "COSYVOICE_PORT": str(port),
                # The suite's and the benchmarks' clients all come from the loopback
                # address, most without a key: to the fair-share rule they are one client.
                # A test of that rule sets its own share (tests/system/test_fuzz.py).
                "COSYVOICE_CLIENT_SHARE": "1"}
    home = None
    if gunicorn:
        command = compose_command("gateway-1")
        settings["COSYVOICE_GATEWAY_PROCESSES"] = str(processes)
        if logs is not None:
            home = logs / f"{name}-home"
            home.mkdir(parents=True, exist_ok=True)
            settings["HOME"] = str(home)
    else:
        command = ["cosyvoice", "gateway"]
    log = _log_path(logs, name)
    proc = launch(command, {**settings, **(env or {})}, log, root)
    url = f"http://{LOOPBACK}:{port}"
    try:
        wait_http(url + "/healthz", proc, timeout=timeout)
    except (RuntimeError, TimeoutError):
        stop(proc)
        raise
    return Gateway(url, port, proc, log, home)


@dataclass
class WorkerPool:
    proc: subprocess.Popen
    log: Path | None
    processes: int
    metrics_url: str | None = None


def start_worker_pool(redis_url: str, *, processes: int = 1, capacity: int | None = None,
                      metrics: bool = False, env: dict[str, str] | None = None,
                      logs: Path | None = None, name: str = "worker", root: Path = ROOT,
                      wait: bool = True, timeout: float = 60.0) -> WorkerPool:
    """docker-compose's ``cosyvoice worker``: ``processes`` ASR worker processes of
    ``capacity`` sessions each (the settings' default when None), serving ``/metrics`` on
    a free port if ``metrics``. With ``wait``, returns once its processes are live (that
    many live workers that were not live before it started)."""
    settings = {"COSYVOICE_REDIS_URL": redis_url, "COSYVOICE_HOST": LOOPBACK,
                "COSYVOICE_WORKERS": str(processes)}
    if capacity is not None:
        settings["COSYVOICE_WORKER_CAPACITY"] = str(capacity)
    metrics_url = None
    if metrics:
        port = free_port()
        settings["COSYVOICE_WORKER_METRICS_PORT"] = str(port)
        metrics_url = f"http://{LOOPBACK}:{port}/metrics"
    ca_file = (env or {}).get("COSYVOICE_REDIS_CA_FILE", "")
    before = frozenset(live_worker_ids(redis_url, ca_file)) if wait else frozenset()
    proc = launch(compose_command("worker"), {**settings, **(env or {})},
                  _log_path(logs, name), root)
    pool = WorkerPool(proc, _log_path(logs, name), processes, metrics_url)
    if wait:
        try:
            wait_workers(redis_url, processes, timeout, besides=before, ca_file=ca_file)
        except TimeoutError:
            stop(proc)
            raise
    return pool


# ---- a whole service -----------------------------------------------------------------------


@dataclass
class Service:
    """A gateway and a worker pool on one Redis."""

    redis_url: str
    gateway: Gateway
    pool: WorkerPool

    @property
    def url(self) -> str:
        return self.gateway.url

    def stop(self) -> None:
        stop(self.gateway.proc, self.pool.proc)


def start_service(redis_url: str, *, processes: int = 2, capacity: int | None = None,
                  gunicorn: bool = False, gateway_processes: int = 1,
                  env: dict[str, str] | None = None, logs: Path | None = None,
                  name: str = "service", root: Path = ROOT) -> Service:
    """``start_gateway`` and ``start_worker_pool`` with the same ``env``; their logs are
    ``<name>-gateway.log`` and ``<name>-worker.log``."""
    gateway = start_gateway(redis_url, gunicorn=gunicorn, processes=gateway_processes,
                            env=env, logs=logs, name=f"{name}-gateway", root=root)
    try:
        pool = start_worker_pool(redis_url, processes=processes, capacity=capacity, env=env,
                                 logs=logs, name=f"{name}-worker", root=root)
    except BaseException:
        stop(gateway.proc)
        raise
    return Service(redis_url, gateway, pool)
