"""Deepgram's ``/v1/listen`` through the running service (real gateway, a whisper-live
worker pool, real Redis), driven by the real ``deepgram-sdk`` pointed at it through its
own environment setting: interim and final results with the Socket.IO path's text,
``Finalize`` mid-stream, ``KeepAlive`` and the idle close, ``CloseStream``'s
``Metadata``, ``SpeechStarted``/``UtteranceEnd``, two channels live and as a file (and
``cosyvoice transcribe --multichannel``), resume, and the refusals: a bad token (401), a
full client (429), audio that is not audio (close 1008)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import httpx
import numpy as np
import pytest
import requests
from deepgram import DeepgramClient
from deepgram.core.api_error import ApiError
from deepgram.environment import DeepgramClientEnvironment
from websockets.exceptions import ConnectionClosedError, InvalidStatus

from cosyvoice.client import transcribe_pcm
from cosyvoice.gateway import tokens

from .. import launcher
from ..helpers import TEST_ENV, fixture_texts, joined, read_pcm, reference_text, wer, write_pcm_wav
from ..stack import scrape

pytestmark = pytest.mark.system

SECRET = "deepgram-face-test-secret"
IDLE_S = 2.0
ENV = {**TEST_ENV, "COSYVOICE_ENGINE": "whisper-live", "COSYVOICE_AUTH_SECRET": SECRET,
       "COSYVOICE_LISTEN_IDLE_TIMEOUT_S": str(IDLE_S), "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "2"}
STEP = 3200  # bytes: 100 ms of 16 kHz linear16, as a client sends it
SILENCE = b"\0\0" * 16000  # 1 s
CALL = fixture_texts()["call"]
LIVE = {"model": "nova-3", "language": "en-US", "encoding": "linear16", "sample_rate": 16000,
        "channels": 1, "punctuate": True}


@pytest.fixture(scope="module")
def face(module_redis, artifacts):
    # The capacity is fixed (COSYVOICE_WORKER_CAPACITY): these tests are of the face, and
    # the admission that follows measured cost (tests/system/test_admission.py) may lower
    # one process to a single session after a stream sent at twice real time on a slow
    # host, where a two-channel stream (two sessions) is then refused as overloaded.
    svc = launcher.start_service(module_redis.url, processes=1, capacity=6, env=ENV,
                                 logs=artifacts, name="deepgram")
    yield svc
    svc.stop()


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    while HTTP:
        HTTP.pop().close()


HTTP: list[httpx.Client] = []  # the clients' HTTP connections, closed after each test


def client(face, key: str | None = None) -> DeepgramClient:
    host = face.url.split("://", 1)[1]
    env = DeepgramClientEnvironment(base=f"http://{host}", production=f"ws://{host}",
                                    agent=f"ws://{host}", agent_rest=f"http://{host}")
    HTTP.append(httpx.Client(timeout=120))
    return DeepgramClient(api_key=key or tokens.issue(SECRET), environment=env,
                         httpx_client=HTTP[-1])


def send(ws, pcm: bytes, step: int = STEP, speed: float = 2.0) -> None:
    """``pcm`` in frames of ``step`` bytes at ``speed`` times real time (16 kHz mono), as
    a live source sends it (interim results come on the service's clock)."""
    for i in range(0, len(pcm), step):
        ws.send_media(pcm[i:i + step])
        time.sleep(step / 32000 / speed)


def until(ws, done) -> list[Any]:
    """Messages until ``done(message)``; the connection must stay open until then."""
    seen: list[Any] = []
    for message in ws:
        seen.append(message)
        if done(message):
            return seen
    raise AssertionError(f"the stream closed after {[m.type for m in seen]}")


def finals_of(seen: list[Any]) -> list[Any]:
    return [m for m in seen if m.type == "Results" and m.is_final]


def texts(seen: list[Any]) -> list[str]:
    return [t for t in (m.channel.alternatives[0].transcript for m in finals_of(seen)) if t]


def test_interim_and_final_results_with_the_socketio_text(face):
    audio = joined(["weather", "call"]) + SILENCE
    with client(face).listen.v1.connect(**LIVE, interim_results=True, vad_events=True,
                                        utterance_end_ms=1000) as ws:
        send(ws, audio)
        ws.send_close_stream()
        seen = until(ws, lambda m: m.type == "Metadata")
        with pytest.raises(StopIteration):  # closed (1000) after the Metadata
            next(iter(ws))
    kinds = [m.type for m in seen]
    results = [m for m in seen if m.type == "Results"]
    assert any(not m.is_final for m in results), "no interim results"
    via_socket = transcribe_pcm(face.url, audio, 16000, pace="fast", language="en",
                                token=tokens.issue(SECRET))
    assert texts(seen) == [f["text"].strip() for f in via_socket.finals if f["text"].strip()]
    assert wer(reference_text("two_utterances"), " ".join(texts(seen))) <= 0.1
    finals = finals_of(seen)
    for m in finals:  # the finals tile the audio, with real confidences and word times
        alt = m.channel.alternatives[0]
        assert m.channel_index == [0, 1] and m.metadata.request_id and m.metadata.model_uuid
        if alt.transcript:
            assert 0 < alt.confidence <= 1 and all(0 < w.confidence <= 1 for w in alt.words)
            assert all(m.start <= w.start < w.end <= m.start + m.duration + 0.01
                       for w in alt.words)
            assert [w.word for w in alt.words] == [w.word.lower() for w in alt.words]
            assert alt.words[-1].punctuated_word.endswith(".")
    starts = [round(m.start, 3) for m in finals]
    ends = [round(m.start + m.duration, 3) for m in finals]
    assert starts[1:] == ends[:-1] and starts[0] == 0
    assert sum(m.speech_final for m in finals) == 2  # both ended by a pause
    # SpeechStarted before each utterance's first words, UtteranceEnd after its final
    started = [i for i, k in enumerate(kinds) if k == "SpeechStarted"]
    ended = [i for i, k in enumerate(kinds) if k == "UtteranceEnd"]
    worded = [i for i, m in enumerate(seen) if m.type == "Results"
              and m.channel.alternatives[0].transcript]
    assert len(started) == 2 and started[0] < worded[0]
    first_final = kinds.index("Results", 0)
    assert len(ended) >= 1 and ended[0] > first_final and ended[0] < started[1] + 3
    first_words = next(m for m in finals if m.channel.alternatives[0].transcript)
    assert seen[ended[0]].last_word_end == pytest.approx(
        first_words.channel.alternatives[0].words[-1].end, abs=0.01)
    metadata = seen[-1]
    assert metadata.transaction_key == "deprecated" and metadata.channels == 1
    assert metadata.duration == pytest.approx(len(audio) / 32000, abs=0.01)
    assert metadata.request_id == finals[0].metadata.request_id


def test_finalize_gives_a_from_finalize_final_and_the_stream_goes_on(face):
    with client(face).listen.v1.connect(**LIVE, endpointing=False) as ws:
        send(ws, read_pcm("weather"))  # no pause after it: only Finalize ends it
        ws.send_finalize()
        first = until(ws, lambda m: m.type == "Results" and m.from_finalize)
        send(ws, read_pcm("call") + SILENCE)
        ws.send_close_stream()
        rest = until(ws, lambda m: m.type == "Metadata")
    assert texts(first) and wer("the weather is nice today", " ".join(texts(first))) <= 0.1
    assert not any(m.speech_final for m in finals_of(first + rest))  # endpointing=false
    assert wer(CALL, " ".join(texts(rest))) <= 0.15
    assert not any(m.from_finalize for m in finals_of(rest))


def test_keepalive_holds_an_idle_stream_and_without_it_the_stream_closes(face):
    with client(face).listen.v1.connect(**LIVE) as ws:
        for _ in range(int(IDLE_S * 2 / 0.5)):  # twice the idle timeout, kept alive
            ws.send_keep_alive()
            time.sleep(0.5)
        # the stream's session is counted as any client's (sampled each second)
        assert scrape(face.url + "/metrics")["cosyvoice_sessions_active"] == 1
        send(ws, read_pcm("weather") + SILENCE)
        ws.send_close_stream()
        seen = until(ws, lambda m: m.type == "Metadata")
    assert wer("the weather is nice today", " ".join(texts(seen))) <= 0.1
    with client(face).listen.v1.connect(**LIVE) as ws:
        started = time.monotonic()
        with pytest.raises(ConnectionClosedError) as closed:
            for _ in ws:
                pass
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011
    assert closed.value.rcvd.reason.startswith("NET-0001")
    # Not before the idle timeout; how soon after it depends on how busy the machine is,
    # so the upper bound only tells a close from none (the watcher checks twice a second).
    assert IDLE_S <= time.monotonic() - started < IDLE_S + 60


def stereo(left: bytes, right: bytes) -> bytes:
    n = max(len(left), len(right)) // 2
    pair = np.zeros((n, 2), dtype="<i2")
    pair[:len(left) // 2, 0] = np.frombuffer(left, dtype="<i2")
    pair[:len(right) // 2, 1] = np.frombuffer(right, dtype="<i2")
    return pair.tobytes()


def test_two_channels_each_get_their_own_text_live_and_as_a_file(face, tmp_path):
    audio = stereo(read_pcm("weather") + SILENCE, SILENCE + read_pcm("call") + SILENCE)
    with client(face).listen.v1.connect(**{**LIVE, "channels": 2}) as ws:
        send(ws, audio, 2 * STEP)
        ws.send_close_stream()
        seen = until(ws, lambda m: m.type == "Metadata")
    by_channel: dict[int, list[str]] = {0: [], 1: []}
    for m in finals_of(seen):
        assert m.channel_index[1] == 2
        if m.channel.alternatives[0].transcript:
            by_channel[m.channel_index[0]].append(m.channel.alternatives[0].transcript)
    assert wer("the weather is nice today", " ".join(by_channel[0])) <= 0.1
    assert wer(CALL, " ".join(by_channel[1])) <= 0.15
    assert seen[-1].channels == 2
    # the same as a two-channel file: the pre-recorded API and the CLI
    path = tmp_path / "call.wav"
    write_pcm_wav(path, audio, channels=2)
    response = client(face).listen.v1.media.transcribe_file(
        request=path.read_bytes(), model="nova-3", multichannel=True, punctuate=True)
    transcripts = [c.alternatives[0].transcript for c in response.results.channels]
    assert transcripts == [" ".join(by_channel[0]), " ".join(by_channel[1])]
    assert response.metadata.channels == 2
    out = subprocess.run(
        [sys.executable, "-m", "cosyvoice", "transcribe", str(path), "--url", face.url,
         "--multichannel", "--output-format", "json", "--pace", "fast"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "COSYVOICE_TOKEN": tokens.issue(SECRET)})
    assert out.returncode == 0, out.stderr
    channels = json.loads(out.stdout)["channels"]
    assert [c["text"] for c in channels] == transcripts


def test_a_cut_connection_resumes_with_the_results_it_missed(face):
    """The client reads the first sentence's final, then loses its connection in the middle
    of the third sentence; the second sentence's final was decoded meanwhile (sent to the
    dead socket, or not yet). A new connection that names the stream (``session``) and
    where its last final ends (``received``) gets the second sentence's final, not the
    first's again, then the third sentence whole."""
    call = read_pcm("call")
    half = len(call) // 2 // STEP * STEP
    dg = client(face)
    with dg.listen.v1.connect(**LIVE) as ws:
        request_id = ws._websocket.response.headers["dg-request-id"]  # as Deepgram's 101
        send(ws, read_pcm("weather") + SILENCE)
        before = until(ws, lambda m: m.type == "Results" and m.is_final
                       and m.channel.alternatives[0].transcript)
        send(ws, read_pcm("door") + SILENCE + call[:half], speed=8.0)
    got = before[-1]
    assert got.metadata.request_id == request_id
    query = {"session": request_id, "received": got.start + got.duration}
    options: Any = {"additional_query_parameters": query}
    with dg.listen.v1.connect(**LIVE, request_options=options) as ws:
        send(ws, call[half:] + SILENCE)
        ws.send_close_stream()
        after = until(ws, lambda m: m.type == "Metadata")
    assert wer("the weather is nice today", " ".join(texts(before))) <= 0.1
    again = texts(after)
    assert len(again) == 2, again  # the missed one, then the cut one whole
    assert wer(fixture_texts()["door"], again[0]) <= 0.15
    assert wer(CALL, again[1]) <= 0.15
    assert after[-1].request_id == request_id
    audio_s = (len(read_pcm("weather")) + len(read_pcm("door")) + len(call)) / 32000 + 3
    assert after[-1].duration == pytest.approx(audio_s, abs=0.05)


def status_of(err: Exception) -> int:
    """A refused handshake's HTTP status: deepgram-sdk 7.17.0 turns it into its
    ``ApiError`` with websockets' old exception; with websockets 14 and later, which no
    longer raise that one, websockets' ``InvalidStatus`` reaches the caller."""
    return err.status_code if isinstance(err, ApiError) else err.response.status_code  # type: ignore[attr-defined,return-value]


def headers_of(err: Exception) -> Any:
    return err.headers if isinstance(err, ApiError) else err.response.headers  # type: ignore[attr-defined]


def test_refusals_at_the_handshake_and_bad_audio(face, tmp_path):
    with pytest.raises((ApiError, InvalidStatus)) as refused:
        with client(face, key="not-a-key").listen.v1.connect(**LIVE):
            pass
    assert status_of(refused.value) == 401
    with pytest.raises((ApiError, InvalidStatus)) as full:  # 3 channels, 2 sessions a client
        with client(face).listen.v1.connect(**{**LIVE, "channels": 3}):
            pass
    assert status_of(full.value) == 429
    assert int(headers_of(full.value)["retry-after"]) >= 1
    bad = requests.get(face.url + "/v1/listen?encoding=speex", timeout=10,
                       headers={"Upgrade": "websocket", "Connection": "Upgrade",
                                "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
                                "Sec-WebSocket-Version": "13",
                                "Authorization": "Token " + tokens.issue(SECRET)})
    assert bad.status_code == 400 and "encoding" in bad.json()["err_msg"]
    garbage = np.random.default_rng(7).integers(0, 256, 64000, dtype=np.uint8).tobytes()
    with client(face).listen.v1.connect(model="nova-3") as ws:  # a container: detected
        with pytest.raises(ConnectionClosedError) as closed:
            send(ws, garbage, 4000)
            for _ in ws:
                pass
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    assert closed.value.rcvd.reason.startswith("DATA-0000")
    # nothing crashed: a WAV stream (a container, detected) is transcribed next
    write_pcm_wav(tmp_path / "weather.wav", read_pcm("weather") + SILENCE)
    header = bytearray((tmp_path / "weather.wav").read_bytes())
    # as a streaming encoder writes it (sox or ffmpeg to a pipe): the sizes are unknown
    assert header[36:40] == b"data"
    header[4:8] = header[40:44] = b"\xff\xff\xff\xff"
    wav = bytes(header)
    with client(face).listen.v1.connect(model="nova-3", punctuate=True) as ws:
        send(ws, wav, 4000)
        ws.send_close_stream()
        seen = until(ws, lambda m: m.type == "Metadata")
    assert wer("the weather is nice today", " ".join(texts(seen))) <= 0.1
    assert face.gateway.proc.poll() is None


