"""Placement: new sessions go to the least-loaded live worker process, with real pools.

Sessions are opened the way a gateway opens them (``Bus.create_session`` + ``admit``),
from several threads at once, each with its own Redis connection, as several gateways
would; the worker processes are real pools decoding real audio.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import uuid
from collections import Counter

import psutil
import pytest
import redis

from cosyvoice.store import bus as busmod
from cosyvoice.store import keys
from cosyvoice.wire.protocol import encode_chunk

from .. import launcher
from ..helpers import read_pcm
from ..launcher import wait_for

pytestmark = pytest.mark.system

CAPACITY = 6
# Long enough that a pool's replacement for a killed process is live before the killed
# one's sessions can be taken over (as in production: 5 s lease, 0.5 s restart).
PLACEMENT_ENV = {"COSYVOICE_LEASE_TTL_MS": "3000", "COSYVOICE_LEASE_RENEW_MS": "300",
                 "COSYVOICE_CLAIM_INTERVAL_MS": "300"}


def open_burst(url: str, n: int, gateways: int = 4) -> list[str]:
    """Open ``n`` sessions at once from ``gateways`` threads; each sends 200 ms of speech
    and stays open. Returns the admitted session ids."""
    chunk = read_pcm("weather")[:6400]
    admitted: list[str] = []
    start = threading.Barrier(gateways)

    def gateway(count: int) -> None:
        client = busmod.connect(url, blocking=False, cluster="," in url)
        bus = busmod.Bus(client)
        start.wait()
        for _ in range(count):
            sid = uuid.uuid4().hex[:24]
            bus.create_session(sid, 16000)
            assert bus.admit(sid).admitted
            bus.append_chunks([(sid, 0, encode_chunk(chunk, 0, sample_rate=16000), 16000, False)])
            admitted.append(sid)
        client.close()

    threads = [threading.Thread(target=gateway, args=(n // gateways + (i < n % gateways),))
               for i in range(gateways)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == n
    return admitted


def placement(client: redis.Redis, sessions: list[str]) -> Counter | None:
    """Sessions per live worker process, once every session has a live owner; None
    before that. Leases and the workers' loads (pending announcements) must agree."""
    live = {w["id"]: w["load"] for w in busmod.Bus(client).live_workers()}
    leases = [client.get(keys.lease_key(sid)) for sid in sessions]
    owners = [busmod.text(o) if o is not None else None for o in leases]
    if any(o is None or o not in live for o in owners):
        return None
    counts = Counter(owners)
    if any(counts.get(wid, 0) != load for wid, load in live.items()):
        return None
    return Counter({wid: counts.get(wid, 0) for wid in live})


def settled(client: redis.Redis, sessions: list[str], processes: int) -> Counter:
    """The placement once every session is owned by one of ``processes`` live processes."""
    def placed() -> Counter | None:
        counts = placement(client, sessions)
        return counts if counts is not None and len(counts) == processes else None

    return wait_for(placed, timeout=30, interval=0.1)


def spread(counts: Counter) -> int:
    return max(counts.values()) - min(counts.values())


def pid_of(worker_id: str) -> int:
    return int(worker_id.split("-")[-2])


@pytest.fixture(params=["redis", "cluster"])
def backend(request):
    """(Redis URL, client, the workers' settings): a Redis of the test's own, or the
    tests' Redis Cluster, emptied afterwards."""
    if request.param == "redis":
        server = request.getfixturevalue("fresh_redis")
        yield server.url, request.getfixturevalue("fresh_redis_client"), PLACEMENT_ENV
        return
    cluster = request.getfixturevalue("cluster")
    cluster.reset()  # no worker, key or moving slot of an earlier test's service
    client = busmod.connect(cluster.url, blocking=False, cluster=True)
    yield cluster.url, client, {**PLACEMENT_ENV, "COSYVOICE_REDIS_CLUSTER": "true"}
    client.close()
    for node in cluster.primaries():
        node.client().flushall()


def test_sessions_spread_evenly_over_worker_processes(backend, artifacts):
    url, client, env = backend
    bus = busmod.Bus(client)
    # three processes in two pools: one of two processes, one of one
    pools: list[subprocess.Popen] = []
    try:
        for name, processes in (("placement-a", 2), ("placement-b", 1)):
            pools.append(launcher.start_worker_pool(url, processes=processes,
                                                    capacity=CAPACITY, env=env,
                                                    logs=artifacts, name=name).proc)
        wait_for(lambda: len(bus.live_workers()) == 3, timeout=30)

        # a burst of 10 sessions from four "gateways"
        sessions = open_burst(url, 10)
        counts = settled(client, sessions, 3)
        assert sorted(counts.values()) == [3, 3, 4], counts

        # three sessions of the busiest process end; three new ones go where there is room
        busiest = counts.most_common(1)[0][0]
        ending = [sid for sid in sessions
                  if client.get(keys.lease_key(sid)).decode() == busiest][:3]
        for sid in ending:
            bus.delete_session(sid)  # what the gateway does on `stop`
        sessions = [sid for sid in sessions if sid not in ending]
        wait_for(lambda: placement(client, sessions) is not None, timeout=10)
        sessions += open_burst(url, 3)
        counts = settled(client, sessions, 3)
        assert spread(counts) <= 1, counts

        # kill -9 a process of the two-process pool: the pool starts another, which
        # takes the killed one's sessions over
        pool_a = {p.pid for p in psutil.Process(pools[0].pid).children()}
        victim = max((w for w in counts if pid_of(w) in pool_a), key=lambda w: counts[w])
        os.kill(pid_of(victim), signal.SIGKILL)
        wait_for(lambda: victim not in {w["id"] for w in bus.live_workers()}, timeout=30)
        counts = settled(client, sessions, 3)
        assert victim not in counts and spread(counts) <= 1, counts

        # the one-process pool dies whole: its sessions spread over the other two
        os.killpg(pools[1].pid, signal.SIGKILL)
        pools[1].wait()
        counts = settled(client, sessions, 2)
        assert sorted(counts.values()) == [5, 5], counts
    finally:
        launcher.stop(*pools)

