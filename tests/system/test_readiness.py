"""``/readyz`` of a gunicorn gateway while Redis and the ASR workers come and go.

Real parts: the embedded redis-server, stopped and started again on the same port; the
docker-compose gateway and worker commands.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from cosyvoice.wire.protocol import encode_chunk

from .. import launcher
from ..helpers import TEST_ENV, read_pcm
from ..launcher import Gateway, WorkerPool, terminate, wait_for
from ..stack import Stream, scrape

pytestmark = pytest.mark.system


@pytest.fixture
def parts(tmp_path, artifacts):
    started: list[Gateway | WorkerPool] = []
    with launcher.redis_server(tmp_path / "redis") as redis_server:
        try:
            yield redis_server, started
        finally:
            launcher.stop(*(part.proc for part in started))
            for part in started:
                assert part.log is not None
                (artifacts / f"readiness-{part.log.name}").write_bytes(part.log.read_bytes())


def one_slot_pool(redis_url: str, workdir: Path, name: str) -> WorkerPool:
    """One worker process of one session, not waited for: the test watches it arrive."""
    return launcher.start_worker_pool(redis_url, capacity=1, logs=workdir, name=name,
                                      wait=False)


def _probe(url: str, status: int) -> dict | None:
    """The /readyz body if it answered ``status`` (a Response is falsy when not ok)."""
    response = requests.get(url + "/readyz", timeout=15)
    return response.json() if response.status_code == status else None


def test_readyz_follows_redis_and_workers_while_healthz_stays_up(parts, tmp_path):
    redis_server, started = parts
    gateway = launcher.start_gateway(redis_server.url, gunicorn=True, processes=2, env=TEST_ENV,
                                     logs=tmp_path, name="gateway")
    started.append(gateway)
    not_ready = _probe(gateway.url, 503)
    assert not_ready is not None and not_ready["reason"].startswith("no ASR worker")
    started.append(one_slot_pool(redis_server.url, tmp_path, "worker-1"))
    ready = wait_for(lambda: _probe(gateway.url, 200), timeout=60)
    assert ready["status"] == "ready" and ready["workers"] == 1 and ready["capacity"] == 1

    # Redis goes away under an open session.
    stream = Stream(gateway.url).connect()
    try:
        errors_before = scrape(gateway.url + "/metrics")["cosyvoice_redis_errors_total"]
        redis_server.stop()
        down = wait_for(lambda: _probe(gateway.url, 503), timeout=30)
        assert down["status"] == "unavailable" and down["reason"].startswith("redis unreachable")
        assert requests.get(gateway.url + "/healthz", timeout=10).status_code == 200
        pcm = read_pcm("weather")[:6400]
        assert stream.send(encode_chunk(pcm, 0, sample_rate=16000)) == {"error": "unavailable",
                                                                        "seq": 0}
        assert stream.errors[-1]["code"] == "unavailable"
        assert scrape(gateway.url + "/metrics")["cosyvoice_redis_errors_total"] > errors_before
    finally:
        stream.close()

    # The same Redis comes back (empty): the worker announces itself again.
    redis_server.start()
    wait_for(lambda: _probe(gateway.url, 200), timeout=60)

    # No worker alive: not ready, though still alive.
    terminate(started[1].proc)
    gone = wait_for(lambda: _probe(gateway.url, 503), timeout=30)
    assert gone["reason"].startswith("no ASR worker")
    assert requests.get(gateway.url + "/healthz", timeout=10).status_code == 200
    started.append(one_slot_pool(redis_server.url, tmp_path, "worker-2"))
    wait_for(lambda: _probe(gateway.url, 200), timeout=60)
