"""Faults through the running service: dropped connections, dead workers, Redis outages.

The bar each time: the client's final transcript equals a run with no fault, no final
reaches the client twice, and no accepted audio is lost. Each runs with the neural engine
and with PocketSphinx on one Redis, and with the neural engine on a Redis Cluster of
three primaries with a replica each (append-only files on every node), where the Redis
outage is the session's primary failing over to its replica, then that one killed and
restarted, while the session streams.
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import requests
import socketio

from cosyvoice.client import StreamingClient
from cosyvoice.store import bus as busmod
from cosyvoice.store import keys

from .. import launcher
from ..cluster import redis_cluster
from ..helpers import TEST_ENV, kill_owners, normalize, open_sessions, read_pcm
from ..launcher import wait_for
from ..netfault import CuttableProxy

pytestmark = pytest.mark.system

GRACE_S = 5.0
FAULT_ENV = {**TEST_ENV, "COSYVOICE_SESSION_GRACE_S": str(GRACE_S),
             "COSYVOICE_LEASE_TTL_MS": "1500", "COSYVOICE_LEASE_RENEW_MS": "300",
             "COSYVOICE_CLAIM_INTERVAL_MS": "300"}


def speech() -> bytes:
    """Two utterances with a pause: a fault can land between or inside them."""
    return read_pcm("weather") + b"\x00\x00" * 24000 + read_pcm("call") + b"\x00\x00" * 8000


def strip(finals):
    return [(f["utterance"], f["text"], f["start"], f["end"], f["words"]) for f in finals]


@pytest.fixture(scope="module")
def fault_redis():
    with launcher.redis_server(persist=True) as server:
        yield server


@pytest.fixture(scope="module")
def replicated_cluster():
    with redis_cluster(3, replicas=1, persist=True) as cluster:
        yield cluster


@pytest.fixture(scope="module", params=["whisper-live", "pocketsphinx", "cluster"])
def fault_service(request, artifacts):
    """The service under faults, with the neural engine and with PocketSphinx: both must
    rebuild a session from its checkpoint exactly; then the neural engine on a cluster."""
    if request.param == "cluster":
        cluster = request.getfixturevalue("replicated_cluster")
        svc = launcher.start_service(cluster.url, logs=artifacts, name="faults-cluster",
                                     env={**FAULT_ENV, "COSYVOICE_REDIS_CLUSTER": "true"})
        svc.cluster = cluster  # type: ignore[attr-defined]
    else:
        redis_url = request.getfixturevalue("fault_redis").url
        svc = launcher.start_service(redis_url, logs=artifacts, name=f"faults-{request.param}",
                                     env={**FAULT_ENV, "COSYVOICE_ENGINE": request.param})
    yield svc
    svc.stop()


def _unfaulted(service_url: str, **client_args):
    """The speech's finals, stripped, from a run without a fault."""
    client = StreamingClient(service_url, **client_args)
    client.connect()
    client.stream_pcm(speech(), 16000, pace="fast")
    assert client.wait_end(30)
    client.stop()
    client.close()
    assert len(client.result.finals) == 2
    return strip(client.result.finals)


@pytest.fixture(scope="module")
def reference(fault_service):
    return _unfaulted(fault_service.url)


def stream_with(service_url, fault, at_s: float, pace="realtime", **client_args):
    """Stream the speech in real time and inject ``fault`` after ``at_s`` seconds."""
    client = StreamingClient(service_url, **client_args)
    client.connect()
    timer = threading.Timer(at_s, fault)
    timer.start()
    try:
        client.stream_pcm(speech(), 16000, pace=pace)
        assert client.wait_end(40), client.result.errors
        client.stop()
    finally:
        timer.cancel()
        client.close()
    return client.result


def test_dropped_connection_resumes_the_same_session(fault_service, reference):
    port = int(fault_service.url.rsplit(":", 1)[1])
    proxy = CuttableProxy(port)
    try:
        result = stream_with(proxy.url, proxy.cut, at_s=2.5)  # inside the second utterance
    finally:
        proxy.close()
    assert result.resumes == 1
    assert strip(result.finals) == reference
    assert len({f["utterance"] for f in result.finals}) == len(result.finals)


# The codec is the same on every Redis: the Opus cases run on one Redis, with both engines.
ONE_REDIS = pytest.mark.parametrize("fault_service", ["whisper-live", "pocketsphinx"],
                                    indirect=True)


@ONE_REDIS
def test_a_dropped_opus_session_resumes_and_resends_its_packets(fault_service, opus_reference):
    """What was not acknowledged before the drop goes again as it was encoded."""
    port = int(fault_service.url.rsplit(":", 1)[1])
    proxy = CuttableProxy(port)
    try:
        result = stream_with(proxy.url, proxy.cut, at_s=2.5, codec="opus", bitrate=24000)
    finally:
        proxy.close()
    assert result.resumes == 1
    assert strip(result.finals) == opus_reference


def test_results_published_while_disconnected_are_replayed(fault_service, redis_client_for):
    client = StreamingClient(fault_service.url, reconnect=False)
    client.connect()
    pcm = read_pcm("coffee")
    client.stream_pcm(pcm, 16000, pace="fast")  # everything acked, results still coming
    sid = client.result.session
    client.close()
    rds = redis_client_for(fault_service)
    wait_for(lambda: any(b'"end"' in f[b"r"] for _i, f in rds.xrange(keys.text_key(sid))))
    again = StreamingClient(fault_service.url, reconnect=False)
    again.result.session = sid  # resume as a reconnecting client would, with no result
    again.connect()
    assert again.session_info["resumed"] is True
    assert again.session_info["next_seq"] == len(pcm) // 6400 + (len(pcm) % 6400 > 0)
    assert again.wait_end(10)
    # (whisper-live writes case and punctuation, PocketSphinx does not)
    assert normalize(again.result.text) == "i would like a cup of coffee"
    again.stop()
    again.close()


def test_after_the_grace_period_the_client_hears_session_expired(fault_service):
    first = StreamingClient(fault_service.url, reconnect=False)
    first.connect()
    assert first.send(read_pcm("door")[:6400], 0, wait_ack=True) == {"seq": 0}
    sid = first.result.session
    first.close()
    time.sleep(GRACE_S + 1.5)
    sio = socketio.Client(reconnection=False)
    events = []
    sio.on("error", lambda d: events.append(("error", d)), namespace="/ws")
    sio.on("session", lambda d: events.append(("session", d)), namespace="/ws")
    sio.connect(fault_service.url, namespaces=["/ws"], transports=["websocket"],
                auth={"session": sid})
    wait_for(lambda: any(e == "session" for e, _ in events))
    sio.disconnect()
    assert events[0][0] == "error" and events[0][1]["code"] == "session_expired"
    fresh = events[1][1]
    assert fresh["resumed"] is False and fresh["session"] != sid and fresh["next_seq"] == 0


@pytest.fixture
def redis_client_for():
    clients = []

    def make(service):
        c = busmod.connect(service.redis_url, blocking=False, cluster=_on_cluster(service))
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


def test_killed_worker_mid_utterance_is_invisible_to_the_client(fault_service, reference,
                                                                redis_client_for):
    rds = redis_client_for(fault_service)
    killed: list[int] = []
    result = stream_with(fault_service.url, lambda: kill_owners(rds, killed), at_s=2.6)
    assert killed, "a worker process was killed mid-stream"
    assert strip(result.finals) == reference
    assert [f["utterance"] for f in result.finals] == [0, 1]
    # the pool replaced the killed process
    wait_for(lambda: len(busmod.Bus(rds).live_workers()) >= 2, timeout=30)


@pytest.fixture(scope="module")
def opus_reference(fault_service):
    """The speech as Opus at 24 kbit/s, without a fault."""
    return _unfaulted(fault_service.url, codec="opus", bitrate=24000)


@ONE_REDIS
def test_killed_worker_on_an_opus_session_is_invisible_to_the_client(
        fault_service, opus_reference, redis_client_for):
    """The next owner decodes the Opus audio before the checkpoint again (its decoder's
    state), so its finals equal the lost worker's."""
    rds = redis_client_for(fault_service)
    killed: list[int] = []
    result = stream_with(fault_service.url, lambda: kill_owners(rds, killed), at_s=2.6,
                         codec="opus", bitrate=24000)
    assert killed, "a worker process was killed mid-stream"
    assert strip(result.finals) == opus_reference
    wait_for(lambda: len(busmod.Bus(rds).live_workers()) >= 2, timeout=30)


def _on_cluster(service) -> bool:
    return hasattr(service, "cluster")


def test_redis_outage_loses_nothing_and_service_resumes(request, fault_service, reference,
                                                        redis_client_for):
    """One Redis: it is killed (``kill -9``) and starts again from its append-only file
    (``appendfsync always``: every acked chunk is on disk). A cluster: the primary that
    holds the session hands over to its replica (``CLUSTER FAILOVER``), then that new
    primary is killed the same way and starts again from its own append-only file before
    its peers call it failed; the session goes on through both."""
    down, back = threading.Event(), threading.Event()
    if _on_cluster(fault_service):
        rds = redis_client_for(fault_service)

        def outage():
            sid = open_sessions(rds)[-1]  # the newest: this stream
            cluster = fault_service.cluster
            primary = rds.get_node_from_key(keys.session_key(sid))
            replica = next(n for n in cluster.nodes if n.alive() and n.port != primary.port
                           and n.client().info("replication").get("master_port")
                           == primary.port)
            replica.client().execute_command("CLUSTER", "FAILOVER")
            wait_for(lambda: replica.client().info("replication")["role"] == "master",
                     timeout=20)
            replica.kill()  # the session's primary now
            down.set()
            assert requests.get(fault_service.url + "/healthz", timeout=2).status_code == 200
            time.sleep(0.5)
            replica.restart()
            back.set()
    else:
        fault_redis = request.getfixturevalue("fault_redis")

        def outage():
            fault_redis.kill()
            down.set()
            # liveness stays up while Redis is gone
            assert requests.get(fault_service.url + "/healthz", timeout=2).status_code == 200
            time.sleep(1.5)
            fault_redis.start()
            back.set()

    result = stream_with(fault_service.url, outage, at_s=1.0)
    assert down.is_set() and back.is_set(), "the whole fault ran"
    if not _on_cluster(fault_service):
        assert any(e["code"] == "unavailable" for e in result.errors), "clients were told"
    assert strip(result.finals) == reference
    # and a brand-new session works afterwards
    after = StreamingClient(fault_service.url)
    after.connect()
    after.stream_pcm(read_pcm("weather"), 16000, pace="fast")
    assert after.wait_end(20)
    assert normalize(after.result.text) == "the weather is nice today"
    after.stop()
    after.close()


def test_a_store_that_lost_the_session_is_said_once_and_nothing_is_lost(
        request, fault_service, reference, redis_client_for):
    """One Redis is killed (``kill -9``) and starts again without its data (no persistence);
    on a cluster, so does the primary holding the session (before its peers call it
    failed, so it is still the primary of its slots, empty). The client hears
    ``session_lost`` once, with the seconds of audio that went, the gateway opens a new
    session on the same connection, the client sends its audio again, and the transcript
    is a clean run's; every process lives on."""
    if _on_cluster(fault_service):
        rds = redis_client_for(fault_service)

        def lose():
            sid = open_sessions(rds)[-1]
            primary = rds.get_node_from_key(keys.session_key(sid))
            node = next(n for n in fault_service.cluster.nodes if n.port == primary.port)
            node.kill()  # and back at once without its data: its cluster config stays
            shutil.rmtree(node.workdir / "appendonlydir")
            node.restart()
    else:
        fault_redis = request.getfixturevalue("fault_redis")

        def lose():
            fault_redis.kill()
            for path in fault_redis.dir.iterdir():  # the append-only file goes too
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            fault_redis.start()

    result = stream_with(fault_service.url, lose, at_s=2.5)
    lost = [e for e in result.errors if e["code"] == "session_lost"]
    assert len(lost) == 1, result.errors
    assert 0 <= lost[0]["lost"][0] <= lost[0]["lost"][1] <= len(speech()) / 32000
    assert strip(result.finals) == reference
    assert not result.fatal_errors
    assert fault_service.gateway.proc.poll() is None and fault_service.pool.proc.poll() is None


def test_a_lost_result_subscription_is_restored_and_missed_results_replayed(
        fault_service, reference, redis_client_for):
    rds = redis_client_for(fault_service)
    killed = []

    def kill_subscribers():
        if _on_cluster(fault_service):  # every node's
            killed.append(sum(n.client().client_kill_filter(_type="pubsub")
                              for n in fault_service.cluster.nodes if n.alive()))
        else:
            killed.append(rds.client_kill_filter(_type="pubsub"))

    # twice: once mid-utterance, once around the first final
    timers = [threading.Timer(t, kill_subscribers) for t in (1.2, 2.2)]
    for t in timers:
        t.start()
    try:
        result = stream_with(fault_service.url, lambda: None, at_s=0)
    finally:
        for t in timers:
            t.cancel()
    assert killed and all(n >= 1 for n in killed)
    assert strip(result.finals) == reference
    assert result.ended
