"""The Redis layer's paths: the gateway's per chunk (one round trip, one write, survives a lost
script cache) and the replay of results after a reconnect."""

from __future__ import annotations

import json

import pytest

from cosyvoice.store import bus as busmod
from cosyvoice.store import keys
from cosyvoice.wire.messages import Published

pytestmark = [pytest.mark.fast, pytest.mark.inprocess]

CHUNK = b"\x01\x02" * 3200 + b"\x00" * 30  # a 200 ms chunk's protobuf size


@pytest.fixture
def gateway_redis_client(redis_server):
    """A Redis client made as the gateway makes its own, with a pool of one connection."""
    client = busmod.connect(redis_server.url, max_connections=1)
    yield client
    client.close()


def watch_writes(client) -> list[int]:
    """Sizes of the writes on the pool's one connection (the real socket does the I/O)."""
    client.ping()
    conn = client.connection_pool.get_connection()
    real = conn._sock
    writes: list[int] = []

    class Watched:
        def sendall(self, data):
            writes.append(len(data))
            return real.sendall(data)

        def __getattr__(self, name):
            return getattr(real, name)

    conn._sock = Watched()
    client.connection_pool.release(conn)
    return writes


def test_a_batch_of_chunks_is_one_write_and_one_round_trip(gateway_redis_client):
    client = gateway_redis_client
    bus = busmod.Bus(client)
    sids = [f"paths-{i}" for i in range(3)]
    for sid in sids:
        bus.create_session(sid, 16000)
    bus.append_chunks([(sids[0], 0, CHUNK, 16000, False)])  # the script is cached now
    writes = watch_writes(client)
    replies = bus.append_chunks([(sid, 0, CHUNK, 16000, False) for sid in sids[1:]] +
                                [(sids[0], 1, CHUNK, 16000, True)])
    assert [r.status for r in replies] == [busmod.AppendStatus.APPENDED] * 3
    assert len(writes) == 1 and writes[0] > 3 * len(CHUNK)
    for sid in sids:
        client.delete(*keys.session_keys(sid))


def test_appends_survive_a_flushed_script_cache(gateway_redis_client):
    client = gateway_redis_client
    bus = busmod.Bus(client)
    bus.create_session("paths-flush", 16000)
    assert bus.append_chunks([("paths-flush", 0, CHUNK, 16000, False)])[0].status == 0
    client.script_flush()
    replies = bus.append_chunks([("paths-flush", 1, CHUNK, 16000, False),
                                 ("paths-flush", 2, CHUNK, 16000, False),
                                 ("paths-flush", 2, CHUNK, 16000, False)])
    assert [(r.status, r.next_seq) for r in replies] == [
        (busmod.AppendStatus.APPENDED, 2), (busmod.AppendStatus.APPENDED, 3),
        (busmod.AppendStatus.DUPLICATE, 3)]
    assert client.xlen(keys.audio_key("paths-flush")) == 3
    client.delete(*keys.session_keys("paths-flush"))


def test_replay_reads_every_result_the_stream_keeps(fresh_redis_client):
    """A client resuming after its last result gets every later result the stream keeps:
    with the stream's length raised, more than a thousand."""
    bus = busmod.Bus(fresh_redis_client, stream_maxlen=3000)
    sid = "replay-all"
    bus.create_session(sid, 16000)
    for batch in range(15):
        results: list[Published] = [
            {"type": "final", "text": f"r{batch * 100 + k}", "utterance": k, "start": 0.0,
             "end": 1.0} for k in range(100)]
        assert bus.publish_results(sid, results, ttl_s=60)
    stored = bus.results_after(sid)
    assert [json.loads(r)["text"] for _, r in stored] == [f"r{k}" for k in range(1500)]
    after = bus.results_after(sid, stored[499][0])
    assert [json.loads(r)["text"] for _, r in after] == [f"r{k}" for k in range(500, 1500)]
