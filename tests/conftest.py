"""Real services for the tests: redis-server, gateway and worker processes on free ports."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from cosyvoice import bus as busmod
from cosyvoice.embedded_redis import EmbeddedRedis, free_port

from . import tiers
from .helpers import spawn, terminate, wait_for, wait_http

# Disconnected sessions expire after this in the test service (30 s in production).
TEST_GRACE_S = 2.0


def pytest_configure(config):
    tiers.FAST = config.getoption("markexpr") == "fast"


@pytest.fixture(scope="session")
def artifacts() -> Path:
    path = Path(os.environ.get("COSYVOICE_TEST_ARTIFACTS", "test-artifacts")).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def redis_server():
    server = EmbeddedRedis().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def module_redis():
    """A redis-server of the test module's own, for tests that count or fill it."""
    server = EmbeddedRedis().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_client(redis_server) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url)


@dataclass
class Service:
    url: str
    redis_url: str
    gateway: object
    worker: object


def start_service(redis_url: str, artifacts: Path, name: str, processes: int = 2,
                  extra_env: dict | None = None) -> Service:
    port = free_port()
    env = {"COSYVOICE_REDIS_URL": redis_url, "COSYVOICE_PORT": str(port),
           "COSYVOICE_SESSION_GRACE_S": str(TEST_GRACE_S), **(extra_env or {})}
    gateway = spawn(["gateway"], env, artifacts / f"{name}-gateway.log")
    worker = spawn(["worker", "--processes", str(processes)], env,
                   artifacts / f"{name}-worker.log")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/healthz", gateway)
    client = redis.Redis.from_url(redis_url)
    wait_for(lambda: len(busmod.Bus(client).live_workers()) >= processes, timeout=30)
    return Service(url, redis_url, gateway, worker)


def stop_service(service: Service) -> None:
    terminate(service.gateway)
    terminate(service.worker)


@pytest.fixture(scope="session")
def service(redis_server, artifacts):
    svc = start_service(redis_server.url, artifacts, "service")
    yield svc
    stop_service(svc)


def pytest_sessionfinish(session, exitstatus):
    """A skipped test is a failed run: every test here needs only what CI installs."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped and session.exitstatus == 0:
        reporter.write_line(f"{len(skipped)} test(s) skipped: failing the run", red=True)
        session.exitstatus = 1
