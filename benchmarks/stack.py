"""Starts a throwaway cosyvoice stack (embedded Redis, gateway, worker pool) for benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis
import requests

from cosyvoice import bus as busmod
from cosyvoice.embedded_redis import EmbeddedRedis, free_port

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"


def read_fixture(name: str) -> bytes:
    import wave
    with wave.open(str(FIXTURES / f"{name}.wav"), "rb") as w:
        return w.readframes(w.getnframes())


def fixture_names() -> list[str]:
    return [line.split("\t")[0] for line in (FIXTURES / "sentences.tsv").read_text().splitlines()
            if line.strip()]


class Stack:
    """``gateway_processes`` > 0 runs the gateway under gunicorn's GeventWebSocketWorker
    with that many processes (the production server); 0 runs ``cosyvoice gateway``."""

    def __init__(self, processes: int = 2, env: dict | None = None, gateway: bool = True,
                 gateway_processes: int = 0, root: Path = ROOT):
        self.root = root  # the checkout whose cosyvoice runs (another one: a baseline)
        self.redis = EmbeddedRedis().start()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "COSYVOICE_REDIS_URL": self.redis.url,
                    "COSYVOICE_PORT": str(self.port), "COSYVOICE_LOG_LEVEL": "WARNING",
                    **(env or {})}
        self.procs: list[subprocess.Popen] = []
        if gateway and gateway_processes > 0:
            self.gateway = self._spawn_command([
                sys.executable, "-m", "gunicorn", "--no-control-socket",
                "-k", "geventwebsocket.gunicorn.workers.GeventWebSocketWorker",
                "-w", str(gateway_processes), "--worker-connections", "4000",
                "-b", f"127.0.0.1:{self.port}", "--log-level", "warning",
                "cosyvoice.webui:app"])
            self._wait_http(self.url + "/healthz")
        elif gateway:
            self.gateway = self._spawn(["gateway"])
            self._wait_http(self.url + "/healthz")
        self.worker = self._spawn(["worker", "--processes", str(processes)])
        self.client = redis.Redis.from_url(self.redis.url)
        self._wait(lambda: len(busmod.Bus(self.client).live_workers()) >= processes)

    def _spawn(self, args):
        return self._spawn_command([sys.executable, "-m", "cosyvoice", *args])

    def _spawn_command(self, command):
        proc = subprocess.Popen(command, env=self.env, cwd=self.root, start_new_session=True)
        self.procs.append(proc)
        return proc

    @staticmethod
    def _wait(pred, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(0.1)
        raise TimeoutError

    def _wait_http(self, url):
        def ok():
            try:
                return requests.get(url, timeout=1).ok
            except requests.RequestException:
                return False
        self._wait(ok)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.redis.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def percentile(values: list[float], q: float) -> float:
    import numpy as np
    return float(np.percentile(values, q)) if values else float("nan")
