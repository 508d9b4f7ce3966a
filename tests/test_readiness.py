"""``/readyz`` of a gunicorn gateway while Redis and the ASR workers come and go.

Real parts: the embedded redis-server, stopped and started again on the same port; the
docker-compose gateway and worker commands.
"""

from __future__ import annotations

import pytest
import requests

from cosyvoice.embedded_redis import EmbeddedRedis
from cosyvoice.protocol import encode_chunk

from .helpers import read_pcm, terminate, wait_for
from .stack import Stream, scrape, start_gateway, start_worker


@pytest.fixture
def parts(tmp_path, artifacts):
    redis_server = EmbeddedRedis(workdir=str(tmp_path / "redis")).start()
    started = []
    try:
        yield redis_server, started
    finally:
        for part in started:
            terminate(part.proc)
            (artifacts / f"readiness-{part.log.name}").write_bytes(part.log.read_bytes())
        redis_server.stop()


def _probe(url: str, status: int) -> dict | None:
    """The /readyz body if it answered ``status`` (a Response is falsy when not ok)."""
    response = requests.get(url + "/readyz", timeout=15)
    return response.json() if response.status_code == status else None


def test_readyz_follows_redis_and_workers_while_healthz_stays_up(parts, tmp_path):
    redis_server, started = parts
    gateway = start_gateway(redis_server.url, tmp_path, "gateway", processes=2)
    started.append(gateway)
    assert _probe(gateway.url, 503)["reason"].startswith("no ASR worker")
    started.append(start_worker(redis_server.url, tmp_path, "worker-1", capacity=1))
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
        assert stream.send(encode_chunk(pcm, 0, sample_rate=16000)) == {"error": "unavailable", "seq": 0}
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
    started.append(start_worker(redis_server.url, tmp_path, "worker-2", capacity=1))
    wait_for(lambda: _probe(gateway.url, 200), timeout=60)
