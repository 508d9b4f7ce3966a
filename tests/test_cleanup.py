"""Nothing is left behind: 1000 sessions come and go, abandoned sessions are swept."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from cosyvoice import bus as busmod
from cosyvoice import keys, sweeper
from cosyvoice.client import StreamingClient
from cosyvoice.protocol import encode_chunk

from . import launcher
from .helpers import TEST_ENV, read_pcm
from .launcher import wait_for

pytestmark = pytest.mark.system

SESSION_PREFIXES = ("session:", "audio:", "text:", "lease:", "client:")


def session_keys_in(rds: redis.Redis) -> list[bytes]:
    # SCAN is fine in a test; the service itself never scans
    return [k for k in rds.scan_iter(count=1000) if k.decode().startswith(SESSION_PREFIXES)]


def dataset_bytes(rds: redis.Redis) -> int:
    return int(rds.info("memory")["used_memory_dataset"])


@pytest.fixture(scope="module")
def churn_service(artifacts, module_redis):
    """Its own Redis, so the memory comparison sees only these sessions; a short grace
    and lease renewal so 1000 sessions fit through 8 decoders in reasonable time."""
    svc = launcher.start_service(module_redis.url, logs=artifacts, name="churn", env={
        **TEST_ENV, "COSYVOICE_SESSION_GRACE_S": str(CHURN_GRACE_S),
        "COSYVOICE_LEASE_RENEW_MS": "100", "COSYVOICE_OVERLOAD_RETRY_MS": "100"})
    yield svc
    svc.stop()


CHURN_GRACE_S = 0.3


def test_a_thousand_sessions_come_and_go_without_a_trace(churn_service):
    service = churn_service
    rds = redis.Redis.from_url(service.redis_url)
    before = dataset_bytes(rds)
    chunk = read_pcm("weather")[:6400]
    errors = []

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

    threads = [threading.Thread(target=run, args=(250,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    wait_for(lambda: not session_keys_in(rds), timeout=30, interval=0.5)
    wait_for(lambda: rds.xlen(keys.SESSIONS) == 0, timeout=10)
    after = dataset_bytes(rds)
    assert after - before < 64 * 1024, (before, after)
    rds.close()


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
