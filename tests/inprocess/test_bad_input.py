"""Bad input and limits, in-process (Flask-SocketIO test client, real Redis), plus fuzzing.

Every case must produce its documented error code, keep the connection usable where the
code says so, and lose nothing already accepted.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import redis
from flask import Flask
from gevent.exceptions import ConcurrentObjectUseError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cosyvoice.gateway import tokens
from cosyvoice.gateway.limits import TokenBucket, parse_auth
from cosyvoice.settings import Settings
from cosyvoice.store import bus as busmod
from cosyvoice.store import keys
from cosyvoice.store.embedded_redis import EmbeddedRedis
from cosyvoice.webui import create_app
from cosyvoice.wire import codecs
from cosyvoice.wire.chunk_pb import AudioChunkProto
from cosyvoice.wire.errors import ERROR_CODES, CosyvoiceError
from cosyvoice.wire.protocol import NAMESPACE, decode_chunk, encode_chunk, encode_opus_chunk

from ..flask_client import open_test_client
from ..helpers import json_values

pytestmark = [pytest.mark.fast, pytest.mark.inprocess]

CHUNK = b"\x01\x00" * 3200  # 200 ms at 16 kHz
SECRET = "test-secret"


@pytest.fixture(scope="module", autouse=True)
def worker_stand_in(module_redis_client):
    # Admission control needs worker capacity: this heartbeat stands in for a worker
    # (no worker decodes in these tests).
    busmod.Bus(module_redis_client).heartbeat("bad-input-stand-in", 10**6, 600_000)


def make_app(server: EmbeddedRedis, client: redis.Redis, **overrides) -> Flask:
    return create_app(Settings(redis_url=server.url, **overrides), client, relay_results=False)


@pytest.fixture(scope="module")
def app(module_redis, module_redis_client):
    return make_app(module_redis, module_redis_client, rate_limit_factor=0,
                    max_sessions_per_client=0)


def connect(app, auth=None):
    return open_test_client(app, auth=auth)


def received(client):
    return client.get_received(NAMESPACE) if client.is_connected(NAMESPACE) else []


def send(client, payload):
    return client.emit("audio_chunk", payload, namespace=NAMESPACE, callback=True)


# ---- connect-time ------------------------------------------------------------------

@pytest.mark.parametrize("auth, code", [
    ("not a dict", "unauthorized"),
    ({"sample_rate": 44100}, "unsupported_rate"),
    ({"sample_rate": "16000"}, "unsupported_rate"),
    ({"session": 12}, "unauthorized"),
    ({"session": "../../etc"}, "unauthorized"),
    ({"last_result": "abc"}, "unauthorized"),
    ({"token": ""}, "unauthorized"),
    ({"pad": "x" * 5000}, "unauthorized"),  # oversized
    ({"network_hint": "fast"}, "unauthorized"),
    ({"codec": "speex"}, "unsupported_codec"),
    ({"codec": "opus", "bitrate": 999}, "unsupported_codec"),
    ({"codec": "opus", "bitrate": "24k"}, "unsupported_codec"),
    ({"bitrate": 24000}, "unsupported_codec"),  # a bitrate without codec opus
    ({"abr": "yes"}, "unauthorized"),
])
def test_malformed_auth_is_refused_with_its_code(app, auth, code):
    client = connect(app, auth=auth)
    assert not client.is_connected(NAMESPACE)
    assert client.refusal["code"] == code and client.refusal["msg"]


def test_unknown_auth_keys_are_ignored(app):
    client = connect(app, auth={"sample_rate": 8000, "future_option": True})
    session = [e for e in received(client) if e["name"] == "session"][0]["args"][0]
    assert session["sample_rate"] == 8000
    client.disconnect(NAMESPACE)


def test_token_auth(module_redis, module_redis_client):
    app = make_app(module_redis, module_redis_client, auth_secret=SECRET, token_ttl_s=60)
    for auth in (None, {"token": "forged"}, {"token": tokens.issue("other-secret")}):
        c = connect(app, auth=auth)
        assert not c.is_connected(NAMESPACE)
        assert c.refusal["code"] == "unauthorized"
    good = connect(app, auth={"token": tokens.issue(SECRET)})
    assert good.is_connected(NAMESPACE)
    good.disconnect(NAMESPACE)


def test_expired_token_is_refused():
    token = tokens.issue(SECRET)
    time.sleep(2.1)  # token timestamps have whole-second resolution
    with pytest.raises(CosyvoiceError) as err:
        tokens.verify(SECRET, token, max_age_s=1)
    assert err.value.code == "unauthorized"


def test_cli_issues_tokens_the_gateway_accepts():
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "cosyvoice", "token", "--subject", "alice"],
                          env={"COSYVOICE_AUTH_SECRET": SECRET, "PATH": ""},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert tokens.verify(SECRET, proc.stdout.strip(), 60) == "alice"


def test_overloaded_when_no_capacity(module_redis, module_redis_client):
    app = make_app(module_redis, module_redis_client)
    bus = busmod.Bus(module_redis_client)
    bus.remove_worker("bad-input-stand-in")
    try:
        bus.heartbeat("tiny-stand-in", 0, 600_000)  # a live worker with no capacity
        c = connect(app)
        assert not c.is_connected(NAMESPACE)
        assert c.refusal["code"] == "overloaded" and c.refusal["retry_after_ms"] > 0
    finally:
        bus.remove_worker("tiny-stand-in")
        bus.heartbeat("bad-input-stand-in", 10**6, 600_000)


def test_sessions_per_client_address_are_limited(module_redis, module_redis_client):
    app = make_app(module_redis, module_redis_client, max_sessions_per_client=2)
    # sessions of earlier tests in this module
    module_redis_client.delete(keys.client_key("127.0.0.1"))
    first, second = connect(app), connect(app)
    assert first.is_connected(NAMESPACE) and second.is_connected(NAMESPACE)
    third = connect(app)
    assert not third.is_connected(NAMESPACE)
    assert third.refusal["code"] == "rate_limited"
    assert first.emit("stop", namespace=NAMESPACE, callback=True)["stopped"] is True
    fourth = connect(app)  # a stopped session frees its slot
    assert fourth.is_connected(NAMESPACE)
    for c in (first, second, fourth):
        c.disconnect(NAMESPACE)


# ---- chunks ------------------------------------------------------------------------

def test_rate_limit_refuses_chunks_beyond_the_budget_and_keeps_the_rest(module_redis,
                                                                        module_redis_client):
    app = make_app(module_redis, module_redis_client, rate_limit_factor=1.0,
                   rate_limit_burst_s=1.0)
    c = connect(app)
    sid = [e for e in received(c) if e["name"] == "session"][0]["args"][0]["session"]
    acks = [send(c, encode_chunk(CHUNK, seq)) for seq in range(5)]  # 1 s of audio: the burst
    assert acks == [{"seq": s} for s in range(5)]
    refused = send(c, encode_chunk(CHUNK, 5))
    assert refused == {"error": "rate_limited", "seq": 5}
    assert module_redis_client.xlen(keys.audio_key(sid)) == 5, "nothing accepted was lost"
    time.sleep(0.25)  # the bucket refills at real time
    assert send(c, encode_chunk(CHUNK, 5)) == {"seq": 5}
    c.disconnect(NAMESPACE)


def test_rate_limit_can_be_turned_off(app):
    c = connect(app)
    assert [send(c, encode_chunk(b"\x00\x00" * 16000, s)) for s in range(40)] == \
        [{"seq": s} for s in range(40)]
    c.disconnect(NAMESPACE)


def test_session_length_is_limited(module_redis, module_redis_client):
    app = make_app(module_redis, module_redis_client, max_session_s=0.5, rate_limit_factor=0)
    c = connect(app)
    assert send(c, encode_chunk(CHUNK, 0)) == {"seq": 0}
    time.sleep(0.6)
    assert send(c, encode_chunk(CHUNK, 1))["error"] == "session_expired"
    c.disconnect(NAMESPACE)


# ---- codecs ------------------------------------------------------------------------------

def _opus(seconds: float = 1.0) -> list[list[bytes]]:
    """Chunks of Opus packets of a tone (the encoder needs no speech to make packets)."""
    t = np.arange(int(16000 * seconds)) / 16000
    tone = (3000 * np.sin(2 * np.pi * 440 * t)).astype("<i2").tobytes()
    return codecs.opus_chunks(tone, 24000)


def _session(client) -> dict:
    return [e for e in received(client) if e["name"] == "session"][0]["args"][0]


def test_the_session_event_offers_the_codecs_and_echoes_the_choice(app):
    c = connect(app, auth={"codec": "opus", "bitrate": 16000})
    session = _session(c)
    assert (session["codec"], session["bitrate"]) == ("opus", 16000)
    offer = session["limits"]["codecs"]
    assert offer["pcm16"] == {"sample_rates": [8000, 16000, 24000, 48000]}
    assert offer["opus"] == {"sample_rate": 16000, "frame_ms": 20,
                             "bitrates": list(Settings().opus_bitrate_list)}
    c.disconnect(NAMESPACE)
    plain = connect(app)
    session = _session(plain)
    assert (session["codec"], session["bitrate"]) == ("pcm16", 0)
    plain.disconnect(NAMESPACE)


def test_opus_chunks_are_stored_and_a_bad_packet_loses_nothing(app, module_redis_client):
    c = connect(app, auth={"codec": "opus"})
    sid = _session(c)["session"]
    chunks = _opus()
    acks = [send(c, encode_opus_chunk(chunk, seq, bitrate=24000))
            for seq, chunk in enumerate(chunks[:3])]
    assert acks == [{"seq": s} for s in range(3)]
    # framing that cannot be (a code 3 packet without its frame count), then no audio
    for bad in ([chunks[3][0], b"\x03"], []):
        assert send(c, encode_opus_chunk(bad, 3, bitrate=24000)) in (
            {"error": "bad_packet", "seq": 3}, {"error": "bad_chunk", "seq": 3})
    errors = [e["args"][0] for e in received(c) if e["name"] == "error"]
    assert [e["code"] for e in errors] == ["bad_packet", "bad_chunk"]
    assert "Opus packet 1" in errors[0]["msg"]
    assert module_redis_client.xlen(keys.audio_key(sid)) == 3, "nothing accepted was lost"
    # the session goes on: the chunk again, well formed, and the next one
    assert send(c, encode_opus_chunk(chunks[3], 3, bitrate=24000)) == {"seq": 3}
    assert send(c, encode_opus_chunk(chunks[4], 4, bitrate=24000, last=True)) == {"seq": 4}
    assert module_redis_client.xlen(keys.audio_key(sid)) == 5
    c.disconnect(NAMESPACE)


@pytest.mark.parametrize("auth, rung", [
    ({"abr": True}, ("pcm16", 0)),  # no hint: the highest
    ({"abr": True, "network_hint": {"effective_type": "2g"}}, ("opus", 12000)),
    ({"abr": True, "network_hint": {"downlink_mbps": 0.065, "rtt_ms": 300}}, ("opus", 24000)),
    ({"abr": True, "codec": "opus", "bitrate": 16000,
      "network_hint": {"effective_type": "4g"}}, ("opus", 16000)),  # as asked: not higher
    ({"abr": True, "codec": "opus", "bitrate": 32000,
      "network_hint": {"effective_type": "2g"}}, ("opus", 12000)),  # lower than asked
    ({"network_hint": {"effective_type": "2g"}}, ("pcm16", 0)),  # does not follow switches
])
def test_a_client_that_follows_switches_starts_on_the_rung_its_hint_allows(
        module_redis, module_redis_client, auth, rung):
    app = make_app(module_redis, module_redis_client, rate_limit_factor=0,
                   max_sessions_per_client=0, abr=True)
    c = connect(app, auth=auth)
    session = _session(c)
    assert (session["codec"], session["bitrate"]) == rung
    c.disconnect(NAMESPACE)


def test_with_abr_off_the_client_gets_what_it_asked_for(module_redis, module_redis_client):
    off = make_app(module_redis, module_redis_client, rate_limit_factor=0,
                   max_sessions_per_client=0, abr=False)
    c = connect(off, auth={"abr": True, "network_hint": {"effective_type": "2g"}})
    session = _session(c)
    assert (session["codec"], session["bitrate"]) == ("pcm16", 0)
    c.disconnect(NAMESPACE)


def test_a_codec_the_server_does_not_take_is_refused(module_redis, module_redis_client):
    pcm_only = make_app(module_redis, module_redis_client, rate_limit_factor=0,
                        max_sessions_per_client=0, codecs="pcm16")
    refused = connect(pcm_only, auth={"codec": "opus"})
    assert refused.refusal["code"] == "unsupported_codec"
    c = connect(pcm_only)
    session = _session(c)
    assert list(session["limits"]["codecs"]) == ["pcm16"]
    sid = session["session"]
    assert send(c, encode_opus_chunk(_opus()[0], 0, bitrate=24000)) == {
        "error": "unsupported_codec", "seq": 0}
    assert send(c, encode_chunk(CHUNK, 0)) == {"seq": 0}
    assert module_redis_client.xlen(keys.audio_key(sid)) == 1
    c.disconnect(NAMESPACE)


def test_an_unknown_codec_number_is_unsupported_codec():
    payload = bytes(AudioChunkProto(pcm=CHUNK, seq=4)) + bytes([0x30, 0x07])  # codec = 7
    with pytest.raises(CosyvoiceError) as raised:
        decode_chunk(payload, 16000, 1000)
    assert (raised.value.code, raised.value.seq) == ("unsupported_codec", 4)


def test_opus_audio_counts_against_the_rate_limit_by_its_length(module_redis,
                                                                module_redis_client):
    app = make_app(module_redis, module_redis_client, rate_limit_factor=1.0,
                   rate_limit_burst_s=1.0)
    c = connect(app, auth={"codec": "opus"})
    chunks = _opus(2.0)
    acks = [send(c, encode_opus_chunk(chunk, seq, bitrate=24000))
            for seq, chunk in enumerate(chunks[:6])]
    # one second of burst: five 200 ms chunks of a seventh of PCM's bytes each
    assert acks == [{"seq": s} for s in range(5)] + [{"error": "rate_limited", "seq": 5}]
    c.disconnect(NAMESPACE)


def test_unknown_events_get_an_error_and_the_connection_stays(app):
    c = connect(app)
    received(c)
    assert c.emit("hello", {"x": 1}, namespace=NAMESPACE, callback=True) == {"error": "bad_chunk"}
    assert [e["args"][0]["code"] for e in received(c) if e["name"] == "error"] == ["bad_chunk"]
    assert send(c, encode_chunk(CHUNK, 0)) == {"seq": 0}
    c.disconnect(NAMESPACE)


def test_token_bucket_refills_at_its_rate():
    bucket = TokenBucket(rate=2.0, burst=1.0, now=0.0)
    assert bucket.take(1.0, now=0.0)
    assert not bucket.take(0.2, now=0.05)
    assert bucket.take(0.2, now=0.1)
    assert not bucket.take(1.1, now=100.0), "never more than the burst"


# ---- fuzzing -----------------------------------------------------------------------

# the tier's hypothesis profile (tests/tiers.py) sets how many examples
FUZZ = settings(deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

protobuf_like = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda pcm, seq, last, rate, sent: encode_chunk(pcm, seq, last=last,
                                                              sample_rate=rate, sent_ms=sent),
              st.binary(max_size=400), st.integers(0, 2**32 - 1), st.booleans(),
              st.sampled_from([0, 8000, 16000, 24000, 48000, 44100, 1, 2**32 - 1]),
              st.integers(0, 2**64 - 1)),
    st.builds(lambda a, b: a + b, st.binary(max_size=20), st.binary(max_size=20)),
    st.builds(lambda packets, seq, last, rate: encode_opus_chunk(packets, seq, bitrate=rate,
                                                                 last=last),
              st.lists(st.binary(max_size=80), max_size=12), st.integers(0, 2**32 - 1),
              st.booleans(), st.integers(0, 2**32 - 1)),
)


@FUZZ
@given(payload=st.one_of(protobuf_like, st.text(max_size=50), st.integers(), st.none(),
                         st.lists(st.integers(), max_size=3)))
def test_fuzz_chunk_validator_only_raises_documented_errors(payload):
    try:
        chunk = decode_chunk(payload, 16000, 1000)
    except CosyvoiceError as err:
        assert err.code in ERROR_CODES and err.code != "internal"
        return
    assert isinstance(chunk.pcm, bytes) and len(chunk.pcm) % 2 == 0
    assert chunk.sample_rate in (8000, 16000, 24000, 48000)
    assert len(chunk.pcm) <= chunk.sample_rate * 2
    assert 0 <= chunk.audio_ms <= 1000
    assert chunk.codec == "pcm16" or (not chunk.pcm and chunk.sample_rate == 16000)


# A top-level number cannot be tested through the test client: its text encoding of the
# CONNECT packet reads a leading number as an ack id. Raw frames like that are sent to the
# real gateway in test_pipeline.py::test_garbage_frames_do_not_hurt_the_gateway.
auth_values = st.one_of(
    st.none(), st.booleans(), st.text(max_size=30), st.lists(json_values, max_size=3),
    st.dictionaries(st.text(max_size=10), json_values, max_size=4),
    st.fixed_dictionaries({}, optional={
        "sample_rate": st.one_of(st.sampled_from([8000, 16000, 24000, 48000]), json_values),
        "session": st.one_of(st.text(alphabet="0123456789abcdef", min_size=24, max_size=24),
                             json_values),
        "last_result": st.one_of(st.from_regex(r"\A\d{1,13}-\d{1,3}\Z"), json_values),
        "token": json_values,
        "network_hint": json_values,
        "codec": st.one_of(st.sampled_from(["pcm16", "opus"]), json_values),
        "bitrate": st.one_of(st.sampled_from([16000, 24000, 32000]), json_values),
        "abr": st.one_of(st.booleans(), json_values),
    }))


@settings(FUZZ, max_examples=min(FUZZ.max_examples, 3_000))
@given(auth=auth_values)
def test_fuzz_connect_handler_only_answers_documented_errors(app, auth):
    client = open_test_client(app, auth=auth, until_session=True)
    if client.is_connected(NAMESPACE):
        events = client.get_received(NAMESPACE)
        names = [e["name"] for e in events]
        assert "session" in names
        for e in events:
            if e["name"] == "error":
                assert e["args"][0]["code"] == "session_expired"  # an unknown session id
        client.disconnect(NAMESPACE)
    else:
        assert client.refusal["code"] in ERROR_CODES and client.refusal["code"] != "internal"


def test_parse_auth_accepts_a_full_valid_dict():
    req = parse_auth({"sample_rate": 48000, "token": "t", "session": "a" * 24,
                      "last_result": "1700000000000-0",
                      "network_hint": {"effectiveType": "4g", "downlink": 10, "rtt": 50}})
    assert (req.sample_rate, req.session, req.last_result) == (48000, "a" * 24, "1700000000000-0")


@pytest.mark.parametrize("error", [
    ValueError("I/O operation on closed file."),
    ConcurrentObjectUseError("This socket is already used by another greenlet"),
])
def test_a_subscriber_broken_under_an_unsubscribe_still_releases_the_session(
        module_redis, module_redis_client, monkeypatch, error):
    # The result subscriber's connection breaking as the client leaves (a reconnect of
    # the same connection by its reading greenlet raised "I/O operation on closed file",
    # or gevent's "already used by another greenlet") once kept the session held past
    # its grace period: the release was skipped.
    app = make_app(module_redis, module_redis_client, rate_limit_factor=0,
                   max_sessions_per_client=0, session_grace_s=5.0)
    gateway = app.extensions["cosyvoice"]
    c = connect(app)
    sid = _session(c)["session"]
    held_ms = module_redis_client.pttl(keys.session_key(sid))

    def broken(*_channels):
        raise error

    monkeypatch.setattr(gateway.relay.channels.subscriber.pubsub, "unsubscribe", broken)
    c.disconnect(NAMESPACE)
    released_ms = module_redis_client.pttl(keys.session_key(sid))
    assert held_ms == -1  # no expiry while a connection holds it
    assert 0 < released_ms <= 5000  # the grace period runs
    assert sid not in gateway.relay.routes
