"""Admission control under a burst of connects, across several gateway processes.

Real parts: two gunicorn gateway instances (the docker-compose command; one with two
processes), a worker pool, the embedded redis-server, then a Redis Cluster of three
primaries. Each client is a plain WebSocket
Socket.IO client (tests/stack.py) in its own thread, all released at once.
"""

from __future__ import annotations

import threading

import pytest
import requests

from .. import launcher
from ..helpers import TEST_ENV
from ..launcher import Gateway, WorkerPool, wait_for
from ..stack import Stream

pytestmark = pytest.mark.system

CAPACITY = 3
GATEWAY_ENV = {"COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0", "COSYVOICE_OVERLOAD_RETRY_MS": "1500"}


@pytest.fixture(scope="module", params=["redis", "cluster"])
def admission_service(request, tmp_path_factory, artifacts):
    """Two gateway instances and a worker pool on one Redis, then on the tests' Redis
    Cluster (where admission's script runs on the primary of the control keys)."""
    workdir = tmp_path_factory.mktemp("admission")
    env = {**TEST_ENV, **GATEWAY_ENV}
    if request.param == "cluster":
        cluster = request.getfixturevalue("cluster")
        cluster.reset()  # no worker, key or moving slot of an earlier test's service
        redis_url = cluster.url
        env["COSYVOICE_REDIS_CLUSTER"] = "true"
    else:
        redis_url = request.getfixturevalue("module_redis").url
    parts: list[Gateway | WorkerPool] = []
    gateways: list[Gateway] = []
    try:
        for name, processes in (("gateway-1", 2), ("gateway-2", 1)):
            gateways.append(launcher.start_gateway(redis_url, gunicorn=True,
                                                   processes=processes, env=env, logs=workdir,
                                                   name=name))
            parts.append(gateways[-1])
        parts.append(launcher.start_worker_pool(
            redis_url, capacity=CAPACITY, logs=workdir, name="worker",
            env={"COSYVOICE_REDIS_CLUSTER": "true"} if request.param == "cluster" else None))
        yield [g.url for g in gateways]
    finally:
        launcher.stop(*(part.proc for part in parts))
        for part in parts:
            assert part.log is not None
            (artifacts / f"admission-{request.param}-{part.log.name}").write_bytes(
                part.log.read_bytes())


def burst(urls: list[str], n: int) -> tuple[list[Stream], list[dict]]:
    """``n`` connects released at once, spread over the gateways: (admitted, refusals)."""
    admitted: list[Stream] = []
    refusals: list[dict] = []
    lock = threading.Lock()
    go = threading.Barrier(n)

    def connect(i: int) -> None:
        stream = Stream(urls[i % len(urls)])
        go.wait()
        try:
            stream.connect(timeout=30)
        except ConnectionError:
            with lock:
                refusals.append(stream.refusal)
            stream.close()
            return
        with lock:
            admitted.append(stream)

    threads = [threading.Thread(target=connect, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) + len(refusals) == n
    return admitted, refusals


def readiness(url: str) -> dict:
    response = requests.get(url + "/readyz", timeout=10)
    assert response.status_code == 200
    return response.json()


def test_a_burst_of_connects_admits_exactly_the_capacity(admission_service):
    urls = admission_service
    admitted, refusals = burst(urls, 50)
    try:
        assert len(admitted) == CAPACITY, [r.get("code") for r in refusals]
        assert all(r["code"] == "overloaded" and r["retry_after_ms"] == 1500 for r in refusals)
        # /readyz counts what admission compares, whichever instance answers
        for url in urls:
            ready = readiness(url)
            assert (ready["capacity"], ready["open"]) == (CAPACITY, CAPACITY)
        wait_for(lambda: readiness(urls[0])["load"] == CAPACITY, timeout=20)

        # one session ends: exactly one of the next burst gets in
        admitted.pop().close(stop=True)
        again, refusals = burst(urls, 10)
        assert len(again) == 1 and len(refusals) == 9
        assert all(r["code"] == "overloaded" for r in refusals)
        admitted += again
        assert readiness(urls[1])["open"] == CAPACITY
    finally:
        for stream in admitted:
            stream.close(stop=True)
    wait_for(lambda: readiness(urls[0])["open"] == 0, timeout=20)
