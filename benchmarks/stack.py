"""A throwaway cosyvoice stack for the benchmarks: embedded Redis, gateway, worker pool.

Everything is started by tests/launcher.py, the launcher the tests use. The gateway is the
production one, ``gunicorn -c gunicorn.conf.py cosyvoice.webui:app`` with the shipped
settings (1000 connections per process, ``COSYVOICE_GATEWAY_PROCESSES`` processes), so
the benchmarks measure what is deployed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import wave
from pathlib import Path

import redis

from tests import launcher
from tests.launcher import ROOT

FIXTURES = ROOT / "tests" / "fixtures"
# Set by the launcher for each process; the shell's values would only contradict it.
PLACED = ("COSYVOICE_REDIS_URL", "COSYVOICE_HOST", "COSYVOICE_PORT",
          "COSYVOICE_GATEWAY_PROCESSES", "COSYVOICE_WORKERS", "COSYVOICE_WORKER_METRICS_PORT")


# The engine of the benchmarks whose figures were measured with PocketSphinx (capacity,
# latency, memory, placement, soak): whisper-live became the default after them, and
# benchmarks/engines.py measures the engines side by side.
POCKETSPHINX = {"COSYVOICE_ENGINE": "pocketsphinx"}


def read_fixture(name: str) -> bytes:
    with wave.open(str(FIXTURES / f"{name}.wav"), "rb") as w:
        return w.readframes(w.getnframes())


def fixture_names() -> list[str]:
    return [line.split("\t")[0] for line in (FIXTURES / "sentences.tsv").read_text().splitlines()
            if line.strip()]


def shell_settings() -> dict[str, str]:
    """The ``COSYVOICE_*`` variables the benchmark was started with, but for ``PLACED``."""
    return {k: v for k, v in os.environ.items()
            if k.startswith("COSYVOICE_") and k not in PLACED}


class Stack:
    """An embedded Redis, a gateway and a pool of ``processes`` ASR worker processes.

    The gateway runs under gunicorn with ``gateway_processes`` processes; 0 runs
    ``cosyvoice gateway`` instead (one gevent process: the server of the transport
    numbers measured before the benchmarks ran gunicorn). ``root`` is the checkout whose
    code runs (another one: a baseline). Settings: the shell's ``COSYVOICE_*``, then
    WARNING logs, then ``env``.
    """

    def __init__(self, processes: int = 2, env: dict[str, str] | None = None,
                 gateway_processes: int = 1, root: Path = ROOT, metrics: bool = False):
        self.root = root
        self.metrics = metrics  # the worker pools serve /metrics (``pool.metrics_url``)
        self.env = {**shell_settings(), "COSYVOICE_LOG_LEVEL": "WARNING", **(env or {})}
        self._procs: list[subprocess.Popen] = []
        self._exit = contextlib.ExitStack()
        try:
            self.redis = self._exit.enter_context(launcher.redis_server())
            self.client = redis.Redis.from_url(self.redis.url)
            self._exit.callback(self.client.close)
            self._exit.callback(lambda: launcher.stop(*self._procs))  # all at once
            self.gateway = launcher.start_gateway(
                self.redis.url, gunicorn=gateway_processes > 0,
                processes=max(1, gateway_processes), env=self.env, root=root)
            self._procs.append(self.gateway.proc)
            self.pool = self.add_pool(processes)
        except BaseException:
            self._exit.close()
            raise

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def port(self) -> int:
        return self.gateway.port

    @property
    def redis_pid(self) -> int:
        assert self.redis.proc is not None  # it runs until close()
        return self.redis.proc.pid

    def add_pool(self, processes: int) -> launcher.WorkerPool:
        """Another worker pool with the same settings, live when this returns."""
        pool = launcher.start_worker_pool(self.redis.url, processes=processes, env=self.env,
                                          root=self.root, metrics=self.metrics)
        self._procs.append(pool.proc)
        return pool

    def close(self) -> None:
        self._exit.close()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def last_to_final(url: str, n: int, token: str | None = None,
                  timeout: float = 30.0) -> list[float]:
    """``last`` chunk ack -> final (ms) over ``n`` fixture utterances, one real-time session
    at a time (``token``: the client's key)."""
    from cosyvoice.client import StreamingClient

    names = fixture_names()
    out = []
    for i in range(n):
        pcm = read_fixture(names[i % len(names)])
        c = StreamingClient(url, token=token)
        c.connect()
        c.stream_pcm(pcm, 16000, pace="realtime")
        assert c.wait_end(timeout), "no end"
        last_seq = max(c.sent_at)
        ack_t = next(t for t, e, d in c.result.events if e == "ack" and d.get("seq") == last_seq)
        final_t = [t for t, e, d in c.result.events if e == "text" and d["type"] == "final"][-1]
        out.append((final_t - ack_t) * 1000)
        c.stop()
        c.close()
    return out


def percentile(values: list[float], q: float) -> float:
    import numpy as np
    return float(np.percentile(values, q)) if values else float("nan")
