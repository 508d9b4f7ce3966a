"""Nothing is left behind: 1000 sessions come and go, abandoned sessions are swept."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from redis.commands.core import Script

from cosyvoice.client import StreamingClient
from cosyvoice.store import bus as busmod
from cosyvoice.store import keys
from cosyvoice.wire.protocol import encode_chunk
from cosyvoice.worker import sweeper

from .. import launcher
from ..helpers import TEST_ENV, read_pcm
from ..launcher import wait_for

pytestmark = pytest.mark.system

SESSION_PREFIXES = ("session:", "audio:", "text:", "lease:", "client:")


def session_keys_in(rds: redis.Redis) -> list[bytes]:
    # SCAN is fine in a test; the service itself never scans
    return [k for k in rds.scan_iter(count=1000) if k.decode().startswith(SESSION_PREFIXES)]


def stored_bytes(rds: redis.Redis) -> int:
    """What the node's keys take, every element counted (``MEMORY USAGE ... SAMPLES 0``).
    Not INFO's ``used_memory_dataset``: that is every allocation less the counted
    overheads, so it also holds the slow log, which on a busy machine fills with up to
    128 slow commands and their arguments (a CI run saw it 100 KB above a fresh node's
    with the same keys)."""
    return sum(rds.memory_usage(k, samples=0) or 0 for k in rds.scan_iter(count=1000))


def cached_scripts(rds: redis.Redis) -> int:
    return int(rds.info("memory")["number_of_cached_scripts"])


@pytest.fixture(scope="module", params=["redis", "cluster"])
def churn_service(request, artifacts):
    """Its own Redis (or the tests' cluster), so the comparison sees only these sessions;
    a short grace and lease renewal so 1000 sessions fit through 8 decoders in reasonable
    time."""
    env = {**TEST_ENV, "COSYVOICE_SESSION_GRACE_S": str(CHURN_GRACE_S),
           "COSYVOICE_LEASE_RENEW_MS": "100", "COSYVOICE_OVERLOAD_RETRY_MS": "100"}
    if request.param == "cluster":
        cluster = request.getfixturevalue("cluster")
        cluster.reset()  # no worker, key or moving slot of an earlier test's service
        svc = launcher.start_service(cluster.url, logs=artifacts, name="churn-cluster",
                                     env={**env, "COSYVOICE_REDIS_CLUSTER": "true"})
        svc.nodes = [n.client() for n in cluster.primaries()]  # type: ignore[attr-defined]
    else:
        redis_url = request.getfixturevalue("module_redis").url
        svc = launcher.start_service(redis_url, logs=artifacts, name="churn", env=env)
        svc.nodes = [redis.Redis.from_url(redis_url)]  # type: ignore[attr-defined]
    yield svc
    svc.stop()
    for node in svc.nodes:  # type: ignore[attr-defined]
        node.close()


CHURN_GRACE_S = 0.3


def _lasting_keys(node: redis.Redis) -> int:
    """Keys other than the sweeper's lock, which comes and goes with the sweeps, the
    day's usage record (``usage:{DAY}``: one key a day, whatever the sessions, kept on
    purpose for ``cosyvoice usage``; a fresh Redis gets it with the first audio) and the
    drain record (``ended``: when the last 200 sessions ended, for GET /load and a
    refusal's retry_after_ms; a fresh Redis gets it with the first session that ends, and
    its size is bounded: the memory check below counts it)."""
    ended = {keys.CONTROL.ended.encode(), keys.CLUSTER_CONTROL.ended.encode()}
    return sum(1 for k in node.scan_iter(count=1000)
               if k != sweeper.SWEEP_LOCK.encode() and not k.startswith(b"usage:{")
               and k not in ended)


def test_a_thousand_sessions_come_and_go_without_a_trace(churn_service):
    """Every node (one Redis, or each primary of a cluster) is back to the keys it had
    before, their memory within 64 KiB of what it was (the drain record, bounded, is
    the only key that may be new), and holds no script but the service's own."""
    service = churn_service
    nodes: list[redis.Redis] = service.nodes
    chunk = read_pcm("weather")[:6400]
    errors: list[Exception] = []
    before = [stored_bytes(n) for n in nodes]
    idle_keys = [_lasting_keys(n) for n in nodes]
    _churn(service, chunk, 250, errors)
    assert errors == []
    wait_for(lambda: not any(session_keys_in(n) for n in nodes), timeout=30, interval=0.5)
    rds = busmod.connect(service.redis_url, blocking=False, cluster=len(nodes) > 1)
    bus = busmod.Bus(rds)
    wait_for(lambda: rds.xlen(bus.k.sessions) == 0, timeout=10)
    registered = {s.script for s in vars(bus).values() if isinstance(s, Script)}
    rds.close()
    assert [_lasting_keys(n) for n in nodes] == idle_keys
    after = [stored_bytes(n) for n in nodes]
    assert all(a - b < 64 * 1024 for a, b in zip(after, before, strict=True)), (before, after)
    # Every script the service runs is one of the bus's, loaded once: none is built per call.
    assert all(cached_scripts(n) <= len(registered) for n in nodes), registered


def _churn(service, chunk: bytes, each: int, errors: list[Exception]) -> None:
    """Four clients open ``each`` sessions one after another, send a chunk, and stop
    half of them and just disconnect from the rest."""
    def run(n):
        for i in range(n):
            c = StreamingClient(service.url, reconnect=False)
            try:
                c.connect(overload_retries=100)
                assert c.send(chunk, 0, wait_ack=True) == {"seq": 0}
                if i % 2:
                    c.stop()  # half are stopped, half just disconnect
            except Exception as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)
            finally:
                c.close()

    threads = [threading.Thread(target=run, args=(each,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.fast
def test_the_sweeper_deletes_sessions_nobody_will_end(redis_client):
    bus = busmod.Bus(redis_client)
    abandoned, fresh = "abandoned0000000000000000", "fresh0000000000000000000"
    silence = encode_chunk(b"\0\0" * 3200, 0)
    # a session whose gateway died: no disconnect handler ever set its expiry
    bus.create_session(abandoned, 16000)
    bus.announce(abandoned)
    bus.append_chunks([(abandoned, 0, silence, 16000, False)])
    bus.create_session(fresh, 16000)
    bus.announce(fresh)
    time.sleep(0.6)
    bus.append_chunks([(fresh, 0, silence, 16000, False)])
    assert sweeper.sweep(bus, "sweeper-test", idle_s=0.5, force=True) == 1
    assert not any(redis_client.exists(k) for k in keys.session_keys(abandoned))
    assert redis_client.exists(keys.audio_key(fresh))
    assert abandoned not in [a.sid for a in bus.announcements()]
    bus.delete_session(fresh)


@pytest.mark.fast
def test_a_kept_alive_session_is_not_swept_and_a_deleted_one_stays_deleted(redis_client):
    """A client's keepalive counts as activity for the sweeper; a keepalive that comes
    after its session was deleted does not bring the session's hash back."""
    bus = busmod.Bus(redis_client)
    kept = "keptalive000000000000000"
    bus.create_session(kept, 16000)
    bus.announce(kept)
    bus.append_chunks([(kept, 0, encode_chunk(b"\0\0" * 3200, 0), 16000, False)])
    time.sleep(0.6)
    bus.touch_session(kept)  # no audio for 0.6 s, but the client said it is there
    sweeper.sweep(bus, "sweeper-test", idle_s=0.5, force=True)
    assert redis_client.exists(keys.session_key(kept))
    assert kept in [a.sid for a in bus.announcements()]
    bus.delete_session(kept)
    bus.touch_session(kept)
    assert not redis_client.exists(keys.session_key(kept))
