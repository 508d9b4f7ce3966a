"""Turn control per session on ``/ws`` through the running service (real gateway, whisper-live
worker processes, real Redis): finalize mid-stream, interim results off, the endpointing
silence a session asks for, speech_started events, bad turn settings refused, and the idle
timeout with keep-alive."""

from __future__ import annotations

import time

import pytest

from cosyvoice.client import Refused, StreamingClient, transcribe_pcm
from cosyvoice.store import bus as busmod

from .. import launcher
from ..helpers import TEST_ENV, joined, read_pcm, wer
from ..launcher import wait_for

pytestmark = pytest.mark.system

CHUNK = 6400


def said(result) -> list[str]:
    return [f["text"] for f in result.finals if f["text"]]


def test_finalize_mid_stream_gives_a_final_and_the_stream_goes_on(service):
    sentence = read_pcm("weather")
    half = len(sentence) // 2 // CHUNK * CHUNK
    rest = sentence[half:] + b"\0\0" * 16000 + read_pcm("call")
    client = StreamingClient(service.url, language="en")
    try:
        client.connect()
        seq = 0
        for i in range(0, half, CHUNK):
            client.send(sentence[i:i + CHUNK], seq, wait_ack=True)
            seq += 1
        ack = client.send(b"", seq, finalize=True, wait_ack=True)  # no audio: finalize only
        seq += 1
        # the finalized event comes after every result of the audio so far
        wait_for(lambda: client.result.finalized, timeout=30)
        early = said(client.result)
        for i in range(0, len(rest), CHUNK):
            client.send(rest[i:i + CHUNK], seq, last=i + CHUNK >= len(rest), wait_ack=True)
            seq += 1
        assert client.wait_end(60)
    finally:
        client.stop()
        client.close()
    assert ack == {"seq": half // CHUNK}
    assert [f["seq"] for f in client.result.finalized] == [half // CHUNK]
    assert len(early) == 1 and early[0]  # the half sentence, as a final before the rest
    got = said(client.result)
    assert got[0] == early[0] and len(got) >= 2
    assert wer("please call me back in the morning", got[-1]) <= 0.15
    assert not client.result.fatal_errors


def test_a_finalize_where_no_one_speaks_gives_only_its_finalized_event(service):
    client = StreamingClient(service.url)
    try:
        client.connect()
        silence = read_pcm("silence")[:5 * CHUNK]
        for seq in range(5):
            client.send(silence[seq * CHUNK:(seq + 1) * CHUNK], seq, wait_ack=True)
        client.send(b"", 5, finalize=True, wait_ack=True)
        wait_for(lambda: client.result.finalized, timeout=30)
    finally:
        client.stop()
        client.close()
    assert [f["seq"] for f in client.result.finalized] == [5]
    assert not client.result.finals and not client.result.errors


def test_interim_off_sends_finals_only(service):
    pcm = joined(["weather", "coffee"])
    plain = transcribe_pcm(service.url, pcm, 16000, pace="realtime", language="en")
    finals_only = transcribe_pcm(service.url, pcm, 16000, pace="realtime", language="en",
                                 interim=False)
    assert plain.partials  # the same audio has partials when they are asked for
    assert not finals_only.partials
    assert said(finals_only) == said(plain)


def test_a_short_endpointing_silence_splits_where_a_long_one_does_not(service):
    pcm = joined(["weather", "call"], gap_s=0.8)
    short = transcribe_pcm(service.url, pcm, 16000, pace="fast", language="en",
                           endpoint_ms=200)
    long = transcribe_pcm(service.url, pcm, 16000, pace="fast", language="en",
                          endpoint_ms=1500)
    assert len(said(short)) == 2 and len(said(long)) == 1
    assert wer(" ".join(said(short)), said(long)[0]) <= 0.1


def test_speech_started_comes_with_each_utterance(service):
    got = transcribe_pcm(service.url, joined(["weather", "call"]), 16000, pace="fast",
                         language="en", speech_events=True)
    assert len(got.speech_started) == 2
    for event, final in zip(got.speech_started, got.finals, strict=True):
        assert final["start"] <= event["start"] <= final["end"]
    plain = transcribe_pcm(service.url, read_pcm("weather"), 16000, pace="fast")
    assert not plain.speech_started


@pytest.mark.parametrize("auth", [{"endpoint_ms": 5}, {"endpoint_ms": "500"},
                                  {"interim": "no"}])
def test_bad_turn_settings_are_refused(service, auth):
    client = StreamingClient(service.url)
    client.options.update(auth)
    try:
        with pytest.raises(Refused) as err:
            client.connect()
    finally:
        client.close()
    assert err.value.code == "unauthorized"


@pytest.fixture(scope="module")
def idle_service(module_redis, artifacts):
    """A service whose gateway ends sessions idle for 2 s (the engine does not matter)."""
    svc = launcher.start_service(module_redis.url, processes=1, logs=artifacts, name="idle",
                                 env={**TEST_ENV, "COSYVOICE_ENGINE": "null",
                                      "COSYVOICE_IDLE_TIMEOUT_S": "2"})
    yield svc
    svc.stop()


def test_a_silent_client_times_out_and_a_kept_alive_one_goes_on(idle_service):
    silent = StreamingClient(idle_service.url, reconnect=False)
    kept = StreamingClient(idle_service.url)
    client = busmod.connect(idle_service.redis_url)
    try:
        silent.connect()
        kept.connect()
        acks = []
        deadline = time.monotonic() + 5  # more than twice the timeout
        while time.monotonic() < deadline:
            acks.append(kept.keepalive())
            time.sleep(0.5)
        wait_for(lambda: silent.result.errors, timeout=10)
        gone = busmod.Bus(client).session_info(silent.result.session)
        kept.stream_pcm(read_pcm("weather"), 16000, "fast")
        assert kept.wait_end(30)
    finally:
        for c in (silent, kept):
            c.close()
        client.close()
    assert [e["code"] for e in silent.result.errors] == ["idle_timeout"]
    assert gone == {}  # the silent client's session was ended, its data deleted
    assert acks and all(a == {"ok": True} for a in acks)
    assert not kept.result.errors and kept.result.ended
