"""Every chunk validation rule, in-process through Flask-SocketIO's test client.

Redis is real (the session's redis-server); the result relay is not started because
no worker runs here.
"""

from __future__ import annotations

import gevent
import pytest

from cosyvoice.settings import Settings
from cosyvoice.store import bus as busmod
from cosyvoice.store import keys
from cosyvoice.webui import create_app
from cosyvoice.wire.protocol import NAMESPACE, encode_chunk, parse_stored

from ..flask_client import open_test_client

pytestmark = [pytest.mark.fast, pytest.mark.inprocess]

CHUNK = b"\x01\x00" * 3200  # 200 ms at 16 kHz


@pytest.fixture(scope="module")
def app(module_redis, module_redis_client):
    client = module_redis_client
    # Admission control needs worker capacity: this heartbeat stands in for a worker
    # (no worker decodes in these tests; it is removed afterwards).
    busmod.Bus(client).heartbeat("inprocess-stand-in", 100000, 600_000)
    settings = Settings(redis_url=module_redis.url, rate_limit_factor=0)
    yield create_app(settings, client, relay_results=False)
    busmod.Bus(client).remove_worker("inprocess-stand-in")


@pytest.fixture
def client(app):
    c = open_test_client(app, auth={"sample_rate": 16000})
    yield c
    if c.is_connected(NAMESPACE):
        c.disconnect(NAMESPACE)


def session_of(client) -> dict:
    events = [e for e in client.get_received(NAMESPACE) if e["name"] == "session"]
    assert events, "a session event right after connect"
    return events[0]["args"][0]


def send(client, payload):
    return client.emit("audio_chunk", payload, namespace=NAMESPACE, callback=True)


def errors(client) -> list[dict]:
    return [e["args"][0] for e in client.get_received(NAMESPACE) if e["name"] == "error"]


def test_connect_sends_session_event(client, module_redis_client):
    info = session_of(client)
    assert info["resumed"] is False and info["next_seq"] == 0
    assert info["sample_rate"] == 16000 and info["chunk_ms"] == 200
    assert len(info["session"]) >= 16
    assert module_redis_client.hget(keys.session_key(info["session"]), "status") == b"active"


def test_valid_chunks_are_acked_and_appended_in_order(client, module_redis_client):
    sid = session_of(client)["session"]
    for seq in range(5):
        assert send(client, encode_chunk(CHUNK, seq)) == {"seq": seq}
    entries = module_redis_client.xrange(keys.audio_key(sid))
    assert len(entries) == 5
    assert [parse_stored(f[b"pb"]).seq for _id, f in entries] == list(range(5))


@pytest.mark.parametrize("payload, code", [
    (b"\xff\xff\xff", "bad_chunk"),                      # not protobuf
    (b"", "bad_chunk"),                                  # empty payload
    ("hello", "bad_chunk"),                              # text instead of bytes
    ({"pcm": "x"}, "bad_chunk"),                         # JSON instead of bytes
    (b"\x08\x08", "bad_chunk"),                          # wrong wire type for pcm
    (encode_chunk(b"\x01\x00\x02", 0), "bad_chunk"),     # odd PCM length
    (encode_chunk(CHUNK, 0, sample_rate=22050), "unsupported_rate"),
    (encode_chunk(b"\x00" * 32002, 0), "too_large"),     # more than 1 s at 16 kHz
    (b"\x0a" + b"\xff\xff\x1f" + b"\x00" * 600000, "too_large"),
])
def test_bad_chunks_get_their_error_code(client, module_redis_client, payload, code):
    sid = session_of(client)["session"]
    ack = send(client, payload)
    assert ack["error"] == code
    assert [e["code"] for e in errors(client)] == [code]
    assert module_redis_client.xlen(keys.audio_key(sid)) == 0
    # the connection stays usable and nothing is lost
    assert send(client, encode_chunk(CHUNK, 0)) == {"seq": 0}


def test_an_unexpected_failure_in_the_chunk_handler_is_an_internal_error(
        app, client, module_redis_client, monkeypatch):
    """The chunk handler runs without Flask-SocketIO's error wrapper (it is registered
    on python-socketio directly), so it reports its own failures: here, a store that
    answers an append with something no Redis reply turns into."""
    sid = session_of(client)["session"]
    assert send(client, encode_chunk(CHUNK, 0)) == {"seq": 0}
    bus = app.extensions["cosyvoice"].bus

    def nonsense(items):
        return [object() for _ in items]

    monkeypatch.setattr(bus, "append_chunks", nonsense)
    assert send(client, encode_chunk(CHUNK, 1)) == {"error": "internal"}
    assert [e["code"] for e in errors(client)] == ["internal"]
    monkeypatch.undo()
    # what was accepted stays, and the connection goes on
    assert send(client, encode_chunk(CHUNK, 1)) == {"seq": 1}
    assert module_redis_client.xlen(keys.audio_key(sid)) == 2


def test_a_store_that_raises_fails_its_chunks_and_the_writer_goes_on(
        app, client, module_redis_client, monkeypatch):
    """An exception that is not Redis's, raised by the batched append, is those chunks'
    internal error; the process's chunk writer survives it and stores the next chunk."""
    sid = session_of(client)["session"]
    bus = app.extensions["cosyvoice"].bus

    def broken(items):
        raise RuntimeError("a bug in the store")

    monkeypatch.setattr(bus, "append_chunks", broken)
    assert send(client, encode_chunk(CHUNK, 0)) == {"error": "internal", "seq": 0}
    assert [e["code"] for e in errors(client)] == ["internal"]
    monkeypatch.undo()
    assert send(client, encode_chunk(CHUNK, 0)) == {"seq": 0}
    assert module_redis_client.xlen(keys.audio_key(sid)) == 1


def test_seq_gap_names_the_expected_seq(client, module_redis_client):
    sid = session_of(client)["session"]
    assert send(client, encode_chunk(CHUNK, 0)) == {"seq": 0}
    ack = send(client, encode_chunk(CHUNK, 3))
    assert ack == {"error": "seq_gap", "seq": 3}
    (err,) = errors(client)
    assert err["code"] == "seq_gap" and err["expected"] == 1 and err["seq"] == 3
    assert send(client, encode_chunk(CHUNK, 1)) == {"seq": 1}
    assert module_redis_client.xlen(keys.audio_key(sid)) == 2


def test_duplicate_is_acked_again_and_not_re_added(client, module_redis_client):
    sid = session_of(client)["session"]
    assert send(client, encode_chunk(CHUNK, 0)) == {"seq": 0}
    assert send(client, encode_chunk(CHUNK, 1)) == {"seq": 1}
    assert send(client, encode_chunk(CHUNK, 0)) == {"seq": 0, "duplicate": True}
    assert module_redis_client.xlen(keys.audio_key(sid)) == 2
    assert errors(client) == []


def test_chunk_after_last_is_rejected(client, module_redis_client):
    sid = session_of(client)["session"]
    assert send(client, encode_chunk(CHUNK, 0, last=True)) == {"seq": 0}
    ack = send(client, encode_chunk(CHUNK, 1))
    assert ack["error"] == "bad_chunk"
    assert module_redis_client.xlen(keys.audio_key(sid)) == 1
    # a resend of the last chunk is still a harmless duplicate
    assert send(client, encode_chunk(CHUNK, 0, last=True))["duplicate"] is True


def test_empty_last_chunk_is_accepted(client):
    session_of(client)
    assert send(client, encode_chunk(b"", 0, last=True)) == {"seq": 0}


def test_sample_rate_switch_changes_the_size_limit(client, module_redis_client):
    sid = session_of(client)["session"]
    big = b"\x00\x00" * 48000  # 1 s at 48 kHz: too large at 16 kHz
    assert send(client, encode_chunk(big, 0))["error"] == "too_large"
    assert send(client, encode_chunk(big, 0, sample_rate=48000)) == {"seq": 0}
    assert send(client, encode_chunk(big, 1)) == {"seq": 1}  # 0 = the current rate
    assert module_redis_client.hget(keys.session_key(sid), "rate") == b"48000"


def test_stop_deletes_the_session(client, module_redis_client):
    sid = session_of(client)["session"]
    assert send(client, encode_chunk(CHUNK, 0)) == {"seq": 0}
    ack = client.emit("stop", namespace=NAMESPACE, callback=True)
    assert ack == {"stopped": True, "session": sid}
    assert not any(module_redis_client.exists(k) for k in keys.session_keys(sid))
    assert send(client, encode_chunk(CHUNK, 1))["error"] == "session_expired"


def test_sessions_are_announced_for_workers(client, module_redis_client):
    sid = session_of(client)["session"]
    announced = [f[b"sid"].decode() for _id, f in module_redis_client.xrange(keys.SESSIONS)]
    assert sid in announced


def test_handlers_running_concurrently_keep_seq_order(app, module_redis_client):
    """Chunks of one connection handled at once, each in a greenlet of its own, are
    acked and stored in the order they came."""
    c = open_test_client(app)
    sid = session_of(c)["session"]
    greenlets = [gevent.spawn(send, c, encode_chunk(CHUNK, s)) for s in range(40)]
    gevent.joinall(greenlets, timeout=10)
    assert [g.value for g in greenlets] == [{"seq": s} for s in range(40)]
    entries = module_redis_client.xrange(keys.audio_key(sid))
    assert [parse_stored(f[b"pb"]).seq for _id, f in entries] == list(range(40))
    c.disconnect(NAMESPACE)
