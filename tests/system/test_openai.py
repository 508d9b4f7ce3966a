"""OpenAI's transcription face through the running service (real gateway, a whisper-live
worker, real Redis), driven by the real ``openai`` package: models, every response
format, words with times, streamed deltas, an upload that is not audio, a bad key, a full
service answered 429 and the client's own retry, an upload over the size limit, and the
gateway's sockets served while an upload decodes."""

from __future__ import annotations

import io
import logging
import threading
import time

import openai
import pytest
import requests
import srt
import webvtt

from cosyvoice.client import StreamingClient, transcribe_pcm
from cosyvoice.gateway import tokens
from cosyvoice.gateway.load import retry_after_ms

from .. import launcher
from ..helpers import FIXTURES, TEST_ENV, normalize, read_pcm, reference_text, wer, write_pcm_wav

pytestmark = pytest.mark.system

SECRET = "openai-face-test-secret"
ENV = {**TEST_ENV, "COSYVOICE_ENGINE": "whisper-live", "COSYVOICE_AUTH_SECRET": SECRET,
       "COSYVOICE_OVERLOAD_RETRY_MS": "700", "COSYVOICE_MAX_UPLOAD_MB": "2"}
TWO = FIXTURES / "two_utterances.wav"


@pytest.fixture(scope="module")
def face(module_redis, artifacts):
    """One worker process that decodes one session at a time: a second upload while one
    is decoding finds the service full."""
    svc = launcher.start_service(module_redis.url, processes=1, capacity=1, env=ENV,
                                 logs=artifacts, name="openai")
    yield svc
    svc.stop()


def client(face, key: str | None = None, retries: int = 4) -> openai.OpenAI:
    return openai.OpenAI(base_url=face.url + "/v1", api_key=key or tokens.issue(SECRET),
                         max_retries=retries, timeout=120)


def wav() -> tuple[str, bytes, str]:
    """The two-utterance fixture as an upload (name, bytes, type)."""
    return ("two.wav", TWO.read_bytes(), "audio/wav")


def two_text() -> str:
    return reference_text("two_utterances")


def test_models_list_whisper_1_and_the_native_modes(face):
    with client(face) as c:
        ids = [m.id for m in c.models.list()]
        assert ids[0] == "whisper-1" and "cosyvoice/whisper-live" in ids
        assert c.models.retrieve("whisper-1").owned_by == "cosyvoice"
        with pytest.raises(openai.NotFoundError) as err:
            c.models.retrieve("no-such-model")
    assert err.value.code == "model_not_found"


def test_json_text_and_the_socketio_path_agree(face):
    with client(face) as c:
        r = c.audio.transcriptions.create(model="whisper-1", file=wav(), language="en")
        plain = c.audio.transcriptions.create(model="whisper-1", file=wav(), language="en",
                                              response_format="text")
        probs = c.audio.transcriptions.create(model="whisper-1", file=wav(), language="en",
                                              include=["logprobs"])
    assert wer(two_text(), r.text) <= 0.1
    assert probs.text == r.text and probs.logprobs is not None
    assert [normalize(p.token or "") for p in probs.logprobs] == normalize(r.text).split()
    assert all((p.logprob or 0) <= 0 and bytes(int(b) for b in p.bytes or []).decode() == p.token
               for p in probs.logprobs)
    assert isinstance(r.usage, openai.types.audio.transcription.UsageDuration)
    assert r.usage.seconds >= 1
    assert isinstance(plain, str) and plain == r.text + "\n"
    # the same audio through Socket.IO gives the same finals
    via_socket = transcribe_pcm(face.url, read_pcm("two_utterances"), 16000, pace="fast",
                                token=tokens.issue(SECRET), language="en")
    assert r.text == via_socket.text


def test_verbose_json_has_segments_and_words_with_times(face):
    with client(face) as c:
        v = c.audio.transcriptions.create(model="whisper-1", file=wav(), language="en",
                                          response_format="verbose_json",
                                          timestamp_granularities=["word", "segment"])
        # words only where asked for; segments by default
        segs = c.audio.transcriptions.create(model="whisper-1", file=wav(),
                                             response_format="verbose_json")
    assert v.segments is not None and v.words is not None
    assert v.language == "english"
    assert v.duration == pytest.approx(len(read_pcm("two_utterances")) / 32000, abs=0.01)
    assert len(v.segments) == 2  # one a final: the fixture's two utterances
    assert " ".join(s.text for s in v.segments) == v.text
    assert [normalize(w.word) for w in v.words] == normalize(v.text).split()
    starts = [w.start for w in v.words]
    assert starts == sorted(starts) and all(w.end >= w.start for w in v.words)
    assert v.words[-1].end <= v.duration + 0.01
    assert v.segments[1].start >= v.segments[0].end
    assert segs.segments and not segs.words


def test_subtitles_parse_back(face):
    with client(face) as c:
        s = c.audio.transcriptions.create(model="whisper-1", file=wav(), response_format="srt",
                                          prompt="A weather report, then a phone call.")
        v = c.audio.transcriptions.create(model="whisper-1", file=wav(), response_format="vtt")
    cues = list(srt.parse(s))
    assert len(cues) >= 2 and wer(two_text(), " ".join(q.content for q in cues)) <= 0.1
    captions = webvtt.from_buffer(io.StringIO(v)).captions
    assert wer(two_text(), " ".join(q.text.replace("\n", " ") for q in captions)) <= 0.1


def test_stream_deltas_join_to_the_done_text(face):
    with client(face) as c:
        events = list(c.audio.transcriptions.create(model="whisper-1", file=wav(),
                                                    language="en", stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    done = [e for e in events if e.type == "transcript.text.done"]
    assert len(deltas) == 2 and len(done) == 1 and events[-1].type == "transcript.text.done"
    assert "".join(deltas) == done[0].text
    assert wer(two_text(), done[0].text) <= 0.1


def test_what_is_not_audio_is_a_400_in_openais_shape(face):
    with client(face, retries=0) as c:
        with pytest.raises(openai.BadRequestError) as not_audio:
            c.audio.transcriptions.create(
                model="whisper-1", file=("notes.wav", b"this is not audio at all", "audio/wav"))
        with pytest.raises(openai.BadRequestError) as bad_format:
            c.audio.transcriptions.create(model="whisper-1", file=wav(),
                                          response_format="docx")  # type: ignore[call-overload]
        with pytest.raises(openai.BadRequestError) as bad_language:
            c.audio.transcriptions.create(model="whisper-1", file=wav(), language="xx")
    assert not_audio.value.param == "file" and not_audio.value.code == "invalid_audio"
    assert bad_format.value.param == "response_format"
    assert bad_language.value.param == "language"
    assert bad_language.value.code == "unsupported_language"


def test_what_werkzeug_refuses_comes_in_openais_shape_too(face):
    key = {"Authorization": "Bearer " + tokens.issue(SECRET)}
    broken = requests.post(face.url + "/v1/audio/transcriptions", headers={
        **key, "Content-Type": "multipart/form-data"}, data=b"--x\r\nnot a form", timeout=10)
    unknown = requests.get(face.url + "/v1/no/such/path", headers=key, timeout=10)
    assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"
    assert unknown.status_code == 404 and "error" in unknown.json()
    assert requests.get(face.url + "/no/such/page", timeout=10).status_code == 404


def test_a_bad_key_is_a_401(face):
    with client(face, key="not-a-token", retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as err:
            c.audio.transcriptions.create(model="whisper-1", file=wav())
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    assert err.value.code == "invalid_api_key"


def test_over_the_size_limit_is_a_413(face):
    big = b"\0" * (3 * 1024 * 1024)  # COSYVOICE_MAX_UPLOAD_MB is 2 here
    with client(face, retries=0) as c, pytest.raises(openai.APIStatusError) as err:
        c.audio.transcriptions.create(model="whisper-1", file=("big.wav", big, "audio/wav"))
    assert err.value.status_code == 413 and err.value.code == "file_too_large"


def test_a_full_service_answers_429_and_the_client_retries_by_itself(face, caplog):
    """The one place is taken by a Socket.IO session: the upload is refused with 429 and
    retry-after-ms; the stock client waits as told and, once the place is free, succeeds."""
    holder = StreamingClient(face.url, token=tokens.issue(SECRET))
    holder.connect()
    try:
        with client(face, retries=0) as c, pytest.raises(openai.RateLimitError) as err:
            c.audio.transcriptions.create(model="whisper-1", file=wav())
        told = requests.get(face.url + "/load", timeout=10).json()
        release = threading.Timer(1.0, holder.stop)
        release.start()
        caplog.set_level(logging.INFO, logger="openai")
        with client(face, retries=8) as c:
            r = c.audio.transcriptions.create(model="whisper-1", file=wav())
        release.join()
    finally:
        holder.close()
    assert err.value.code == "overloaded"
    # the hint: the client's place in line at the rate sessions ended lately (the
    # module's earlier sessions), what GET /load said then; the setting (700) where none
    # ended lately
    hint = int(err.value.response.headers["retry-after-ms"])
    assert hint == pytest.approx(retry_after_ms(told["drain_per_s"], 1, 700), rel=0.1, abs=60)
    assert told["full"] and told["retry_after_ms"] == pytest.approx(hint, rel=0.1, abs=60)
    assert wer(two_text(), r.text) <= 0.1
    assert any("Retrying request" in m for m in caplog.messages)  # refused at least once


def test_the_gateway_serves_other_requests_while_an_upload_decodes(face, tmp_path):
    """A long upload is decoded and transcribed while the gateway goes on answering
    other requests (health checks, one after the other, none refused or timed out)."""
    upload = tmp_path / "long.wav"
    write_pcm_wav(upload, read_pcm("harvard_long"))
    done = threading.Event()
    answered: list[float] = []

    def probe():
        with requests.Session() as http:
            while not done.is_set():
                http.get(face.url + "/healthz", timeout=5).raise_for_status()
                answered.append(time.monotonic())
                time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        with client(face) as c:
            r = c.audio.transcriptions.create(
                model="whisper-1", file=("long.wav", upload.read_bytes(), "audio/wav"),
                language="en")
    finally:
        done.set()
        prober.join(10)
    assert wer(reference_text("harvard_long"), r.text) <= 0.2
    assert len(answered) >= 10
