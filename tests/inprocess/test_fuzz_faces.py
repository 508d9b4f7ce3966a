"""Property-based tests of the faces' parsing and validation, in-process with a real Redis:
OpenAI Realtime events, Deepgram's control messages, query parameters and audio frames,
OpenAI's multipart uploads. (Socket.IO's auth and chunks: test_bad_input.py.)

The property each time: whatever a client sends, the face answers with its documented
error or does what was asked, and nothing escapes as an internal error. The socket the
faces send on is a recorder standing in for gevent-websocket's (what the face sends is
what is checked); the end-to-end fuzz of the real sockets is tests/system/test_fuzz.py.
"""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cosyvoice.faces.deepgram.listen import Listen
from cosyvoice.faces.deepgram.params import ListenError, Params
from cosyvoice.faces.openai import realtime as realtime_api
from cosyvoice.faces.openai import transcriptions as openai_api
from cosyvoice.settings import Settings
from cosyvoice.store import bus as busmod
from cosyvoice.webui import create_app
from cosyvoice.wire.errors import CosyvoiceError
from cosyvoice.wire.live_audio import MAX_CHANNELS

from ..helpers import json_values

pytestmark = [pytest.mark.fast, pytest.mark.inprocess]

FUZZ = settings(deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# each example opens sessions in Redis: fewer than the profile's 10 000 in the full run
FEW = settings(FUZZ, max_examples=min(FUZZ.max_examples, 1_000))


@pytest.fixture(scope="module", autouse=True)
def worker_stand_in(module_redis_client):
    # admission needs worker capacity: this heartbeat stands in for a worker
    busmod.Bus(module_redis_client).heartbeat("fuzz-faces-stand-in", 10**6, 600_000)


@pytest.fixture(scope="module")
def app(module_redis, module_redis_client):
    return create_app(Settings(redis_url=module_redis.url, rate_limit_factor=0,
                               max_sessions_per_client=0),
                      module_redis_client, relay_results=False)


@pytest.fixture(scope="module")
def gateway(app):
    return app.extensions["cosyvoice"]


class Recorder:
    """Stands in for a gevent-websocket socket: keeps what the face sends."""

    def __init__(self):
        self.sent: list[Any] = []
        self.closed = False
        self.environ: dict = {}

    def send(self, message):
        self.sent.append(json.loads(message) if isinstance(message, str) else message)

    def send_frame(self, payload, opcode):
        self.sent.append(("frame", opcode, bytes(payload)))

    OPCODE_CLOSE = 8



# ---- OpenAI Realtime ----------------------------------------------------------------------

REALTIME_TYPES = ["session.update", "transcription_session.update",
                  "input_audio_buffer.append", "input_audio_buffer.commit",
                  "input_audio_buffer.clear"]
REALTIME_REPLIES = {"session.updated", "transcription_session.updated",
                    "input_audio_buffer.committed", "input_audio_buffer.cleared",
                    "conversation.item.input_audio_transcription.delta",
                    "conversation.item.input_audio_transcription.completed",
                    "conversation.item.added", "conversation.item.done",
                    "conversation.item.created",
                    "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped"}
# every error code the Realtime face documents (docs/openai.md)
REALTIME_ERRORS = {"invalid_json", "invalid_event", "unknown_event_type", "invalid_value",
                   "input_audio_buffer_commit_empty", "session_expired"}

turns = st.one_of(json_values, st.none(), st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["server_vad", "semantic_vad", "none", ""]),
    "silence_duration_ms": st.one_of(st.integers(-10, 10_000), json_values),
    "threshold": json_values, "prefix_padding_ms": json_values}))
sessions = st.one_of(json_values, st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["transcription", "realtime"]),
    "audio": st.one_of(json_values, st.fixed_dictionaries({}, optional={
        "input": st.one_of(json_values, st.fixed_dictionaries({}, optional={
            "format": st.one_of(json_values, st.just({"type": "audio/pcm", "rate": 24000})),
            "transcription": st.one_of(json_values, st.fixed_dictionaries({}, optional={
                "model": st.one_of(st.sampled_from(["whisper-1", "gpt-4o-transcribe",
                                                    "cosyvoice/nope"]), json_values),
                "language": st.one_of(st.sampled_from(["en", "zh", "xx", ""]), json_values),
                "prompt": json_values})),
            "turn_detection": turns}))})),
    "input_audio_format": st.one_of(st.just("pcm16"), json_values),
    "input_audio_transcription": json_values,
    "turn_detection": turns,
    "include": json_values}))
events = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(REALTIME_TYPES)}, optional={
        "session": sessions,
        "audio": st.one_of(st.binary(max_size=9600).map(
            lambda b: __import__("base64").b64encode(b).decode()), json_values),
        "event_id": json_values}),
    st.dictionaries(st.text(max_size=12), json_values, max_size=4),
    json_values)


@FEW
@given(batch=st.lists(st.one_of(events.map(json.dumps), st.text(max_size=40)), max_size=6))
@example(batch=['{"type": "input_audio_buffer.append", "audio": "AAA"}',
                '{"type": "input_audio_buffer.commit"}'])
def test_fuzz_realtime_events_get_a_reply_or_a_documented_error(app, gateway, batch):
    ws = Recorder()
    conn = realtime_api.Realtime(gateway, ws)
    with app.test_request_context("/v1/realtime"):  # the face runs in its request
        try:
            for frame in batch:
                conn.handle(frame)
        finally:
            conn.closed = True
            conn._leave()
    for event in ws.sent:
        assert isinstance(event, dict), event
        if event["type"] == "error":
            assert event["error"]["code"] in REALTIME_ERRORS, event
        else:
            assert event["type"] in REALTIME_REPLIES, event
    assert not conn.ws.closed


# ---- Deepgram -----------------------------------------------------------------------------

LISTEN_KEYS = ["model", "language", "encoding", "sample_rate", "channels", "multichannel",
               "interim_results", "endpointing", "utterance_end_ms", "vad_events",
               "punctuate", "smart_format", "diarize", "diarize_model", "keyterm",
               "keywords", "tag", "utterances"]
query_values = st.one_of(
    st.sampled_from(["true", "false", "1", "0", "linear16", "mulaw", "opus", "16000",
                     "48000", "8000", "2", "9", "-1", "300", "en", "en-US", "multi", "zh",
                     "nova-3", "", " "]),
    st.text(max_size=12), st.integers(-10**6, 10**6).map(str))
queries = st.dictionaries(st.one_of(st.sampled_from(LISTEN_KEYS), st.text(max_size=8)),
                          st.lists(query_values, min_size=1, max_size=3), max_size=8)


@FUZZ
@given(query=queries, live=st.booleans())
def test_fuzz_listen_parameters_parse_or_are_a_400(gateway, query, live):
    try:
        params = Params.parse(query, gateway, live=live)
    except ListenError as err:
        assert err.status == 400 and err.message
        return
    assert params.mode in gateway.modes
    assert 1 <= params.channels <= MAX_CHANNELS


controls = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["KeepAlive", "Finalize", "CloseStream",
                                                    "Configure", "Other"])},
                          optional={"channel": json_values,
                                    "keyterms": json_values}).map(json.dumps),
    json_values.map(json.dumps), st.text(max_size=40))
frames = st.one_of(controls, st.binary(max_size=4000))
LISTEN_MESSAGES = {"Results", "SpeechStarted", "UtteranceEnd", "Metadata",
                   "ConfigureFailure", "Error"}


@FEW
@given(frames=st.lists(frames, max_size=6),
       query=st.sampled_from([{"encoding": ["linear16"], "sample_rate": ["16000"]},
                              {"encoding": ["mulaw"], "sample_rate": ["8000"],
                               "channels": ["2"]},
                              {}]))  # no encoding: a container, detected
# found by this test: an empty packet ended the G.711 decoder's stream, so audio after a
# Finalize (or after a frame shorter than a sample) broke a mulaw connection
@example(frames=['{"type": "Finalize"}', b"\xff" * 320],
         query={"encoding": ["mulaw"], "sample_rate": ["8000"], "channels": ["2"]})
@example(frames=[b"\xff", b"\xff" * 320],
         query={"encoding": ["mulaw"], "sample_rate": ["8000"], "channels": ["2"]})
def test_fuzz_listen_frames_are_taken_or_refused_as_documented(gateway, frames, query):
    listen = Listen(gateway, Params.parse(query, gateway))
    ws = Recorder()
    listen.ws = ws
    listen.open("fuzz")
    try:
        for frame in frames:
            if listen.closed:
                break
            listen.handle(frame)
    finally:
        listen.closed = True
        listen.abandon()
    for message in ws.sent:
        if isinstance(message, tuple):  # a close frame: DATA-0000 for undecodable audio
            _frame, opcode, payload = message
            assert opcode == Recorder.OPCODE_CLOSE and payload[2:].startswith(b"DATA-0000")
            continue
        assert message["type"] in LISTEN_MESSAGES, message
        if message["type"] == "Error":
            assert message["code"] in ("INVALID_MESSAGE", "DATA-0000"), message


# ---- OpenAI's multipart uploads -----------------------------------------------------------

FORM_KEYS = ["model", "language", "prompt", "response_format", "temperature",
             "timestamp_granularities[]", "include[]", "stream", "chunking_strategy"]
form_values = st.one_of(
    st.sampled_from(["whisper-1", "gpt-4o-transcribe", "cosyvoice/whisper-live",
                     "cosyvoice/none", "json", "text", "srt", "vtt", "verbose_json",
                     "diarized_json", "word", "segment", "logprobs", "0.5", "2", "nan",
                     "true", "en", "xx", ""]),
    st.text(max_size=20))


@FUZZ
@given(fields=st.dictionaries(st.sampled_from(FORM_KEYS), st.lists(form_values, min_size=1,
                                                                   max_size=2), max_size=6),
       upload=st.one_of(st.none(), st.binary(max_size=200)))
def test_fuzz_upload_fields_parse_or_are_a_documented_error(app, gateway, fields, upload):
    data: dict[str, Any] = dict(fields)
    if upload is not None:
        data["file"] = (io.BytesIO(upload), "audio.wav")
    with app.test_request_context("/v1/audio/transcriptions", method="POST", data=data,
                                  content_type="multipart/form-data"):
        try:
            ask = openai_api.Request.parse(gateway)
        except openai_api.ApiError as err:
            assert err.status in (400, 404), err.message
            assert err.type == "invalid_request_error"
            return
    assert ask.upload and ask.model and ask.format in openai_api.FORMATS
    assert 0 <= ask.temperature <= 1


@FUZZ
@given(upload=st.binary(max_size=2000))
def test_fuzz_an_upload_decodes_or_is_a_400(upload):
    try:
        pcm, rate = openai_api.decode_upload(upload)
    except openai_api.ApiError as err:
        assert err.status == 400 and err.param == "file"
        return
    except CosyvoiceError as err:  # pragma: no cover - would be a wrong error class
        raise AssertionError(err) from err
    assert rate == 16000 and pcm and len(pcm) % 2 == 0
