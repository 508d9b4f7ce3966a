"""Real services for the tests: redis-server, gateway and worker processes on free ports.

Redis fixtures, by whose server they are: ``redis_server`` and ``redis_client`` are the
test session's (shared with ``service``), ``module_redis`` and ``module_redis_client`` a
test module's own (for tests that count or fill it), ``fresh_redis`` and
``fresh_redis_client`` a test's own. All of them start their server with
``launcher.redis_server``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cosyvoice.store.embedded_redis import EmbeddedRedis

from . import launcher, tiers
from .cluster import Cluster, redis_cluster
from .helpers import TEST_ENV


def pytest_configure(config):
    tiers.choose(config.getoption("markexpr") == "fast",
                 config.getoption("hypothesis_profile", None))


def pytest_collection_modifyitems(config, items):
    """Every test is at exactly one level (tests/tiers.py), so ``-m unit`` and the rest
    split the suite without gaps or overlaps, and its module lives in that level's folder
    (``tests/unit/`` and so on)."""
    wrong = [f"{item.nodeid}: {levels or 'none'}" for item in items
             if len(levels := sorted({m.name for m in item.iter_markers()} & tiers.LEVELS)) != 1
             or Path(item.path).parent.name != levels[0]]
    if wrong:
        raise pytest.UsageError("tests need exactly one level marker "
                                f"({', '.join(sorted(tiers.LEVELS))}), and to live in "
                                "its folder:\n" + "\n".join(wrong))


@pytest.fixture(scope="session")
def artifacts() -> Path:
    path = Path(os.environ.get("COSYVOICE_TEST_ARTIFACTS", "test-artifacts")).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with launcher.redis_server() as server:
        yield server


@pytest.fixture(scope="session")
def redis_client(redis_server: EmbeddedRedis) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url)


@pytest.fixture(scope="module")
def module_redis() -> Iterator[EmbeddedRedis]:
    """A redis-server of the test module's own, for tests that count or fill it."""
    with launcher.redis_server() as server:
        yield server


@pytest.fixture(scope="module")
def module_redis_client(module_redis: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(module_redis.url)
    yield client
    client.close()


@pytest.fixture
def fresh_redis() -> Iterator[EmbeddedRedis]:
    """A redis-server of the test's own: nothing another test did is in it."""
    with launcher.redis_server() as server:
        yield server


@pytest.fixture
def fresh_redis_client(fresh_redis: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(fresh_redis.url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def service(redis_server: EmbeddedRedis, artifacts: Path) -> Iterator[launcher.Service]:
    """``cosyvoice gateway`` and a pool of two worker processes on ``redis_server``."""
    svc = launcher.start_service(redis_server.url, env=TEST_ENV, logs=artifacts,
                                 name="service")
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """A Redis Cluster of three primaries (Debian's redis-server 7) on free ports, shared
    by the tests that run the service on a cluster: every deployment's keys are its own
    (a session's under its id, the control keys under ``{cosyvoice}``)."""
    with redis_cluster(3) as c:
        yield c


def pytest_sessionfinish(session, exitstatus):
    """A skipped test is a failed run: every test here needs only what CI installs."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped and session.exitstatus == 0:
        reporter.write_line(f"{len(skipped)} test(s) skipped: failing the run", red=True)
        session.exitstatus = 1
