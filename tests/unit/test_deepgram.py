"""The Deepgram face's pure parts: the query's rules, a result as Deepgram's alternative,
the handshake's key, and the live audio inputs (linear16 split and resampled, G.711,
a container stream decoded on its thread, and one that is not audio)."""

from __future__ import annotations

from types import SimpleNamespace
from urllib.parse import parse_qs

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from cosyvoice.faces.deepgram.params import ListenError, Params, alternative, credential, plain
from cosyvoice.wire.audio import read_audio
from cosyvoice.wire.live_audio import BadAudio, ContainerInput, RawInput, open_input

from ..helpers import FIXTURES

pytestmark = pytest.mark.unit

GATEWAY = SimpleNamespace(modes=("whisper-live",), languages=("auto", "en", "zh"))


def parse(query: str, live: bool = True) -> Params:
    return Params.parse(parse_qs(query, keep_blank_values=True), GATEWAY, live)  # type: ignore[arg-type]


def test_the_query_as_the_sdk_sends_it():
    p = parse("channels=2&encoding=linear16&endpointing=300&interim_results=true&keyterm="
              "cosyvoice&keyterm=Redis&language=en-US&model=nova-3&punctuate=true&"
              "sample_rate=16000&smart_format=true&utterance_end_ms=1000&vad_events=true")
    assert (p.language, p.encoding, p.sample_rate, p.channels, p.sessions) == (
        "en", "linear16", 16000, 2, 2)
    assert p.interim and p.vad_events and p.punctuate and p.smart_format
    assert p.endpointing == 300 and p.speech_final and p.utterance_end_ms == 1000
    auth = p.session_auth(16000)
    assert auth["endpoint_ms"] == 300 and auth["speech_events"] and auth["format"]
    assert auth["prompt"] == "cosyvoice, Redis." and auth["mode"] == "whisper-live"
    assert parse("endpointing=False").speech_final is False  # any case, as old SDKs send it
    assert parse("endpointing=false").session_auth(16000)["endpoint_ms"] == 5000
    assert parse("channels=2&multichannel=false").sessions == 1
    assert parse("language=multi").language == "auto"
    assert parse("diarize=true").session_auth(16000)["diarize"] == "live"
    assert parse("").session_auth(16000) == {"sample_rate": 16000, "mode": "whisper-live",
                                             "language": "auto", "interim": False,
                                             "format": False}


@pytest.mark.parametrize("query, says", [
    ("encoding=speex", "encoding"),
    ("encoding=linear16", "sample_rate is required"),
    ("encoding=mulaw&sample_rate=4000", "sample_rate must be"),
    ("channels=9", "channels"),
    ("language=xx", "language"),
    ("utterance_end_ms=1000", "interim_results"),
    ("interim_results=true&utterance_end_ms=500", "utterance_end_ms"),
    ("endpointing=soon", "endpointing"),
    ("punctuate=maybe", "punctuate"),
])
def test_a_bad_query_is_a_400_that_says_which_parameter(query, says):
    with pytest.raises(ListenError) as err:
        parse(query)
    assert err.value.status == 400 and says in err.value.message
    status, headers, body = err.value.refusal("rid")
    assert status.startswith("400") and b'"err_code"' in body
    assert ("dg-request-id", "rid") in headers


def test_a_final_as_deepgrams_alternative():
    final = {"text": " Hello, world.", "start": 0.0, "end": 1.0, "speaker": "S2",
             "words": [{"word": " Hello,", "start": 0.1, "end": 0.4, "conf": 0.9},
                       {"word": " world.", "start": 0.5, "end": 0.9, "conf": 0.7}]}
    plain_alt = alternative(final, parse(""))
    assert plain_alt["transcript"] == "hello world"
    assert [w["word"] for w in plain_alt["words"]] == ["hello", "world"]
    assert plain_alt["confidence"] == pytest.approx(0.8)
    assert "punctuated_word" not in plain_alt["words"][0] and "speaker" not in plain_alt["words"][0]
    punctuated = alternative(final, parse("punctuate=true&diarize=true"))
    assert punctuated["transcript"] == "Hello, world."
    assert [(w["punctuated_word"], w["speaker"]) for w in punctuated["words"]] == [
        ("Hello,", 1), ("world.", 1)]
    assert alternative({"text": "", "start": 0, "end": 0}, parse(""))["confidence"] == 0.0
    assert plain("don't!") == "don't" and plain("«Ça»") == "ça"


def test_the_key_of_the_handshake():
    assert credential({"HTTP_AUTHORIZATION": "Token abc"}) == "abc"
    assert credential({"HTTP_AUTHORIZATION": "bearer jwt"}) == "jwt"  # the SDK's lower case
    assert credential({"HTTP_SEC_WEBSOCKET_PROTOCOL": "token, abc"}) == "abc"
    assert credential({"HTTP_AUTHORIZATION": "Basic x"}) is None
    assert credential({}) is None


def test_linear16_frames_split_anywhere_give_each_channel_its_samples():
    left = np.arange(1000, dtype="<i2")
    right = -np.arange(1000, dtype="<i2")
    data = np.stack([left, right], axis=1).tobytes()
    split = RawInput("linear16", 16000, 2, split=True)
    out = [b"", b""]
    for i in range(0, len(data), 333):  # odd sizes: samples and pairs cut anywhere
        out = [a + b for a, b in zip(out, split.feed(data[i:i + 333]), strict=True)]
    assert out == [left.tobytes(), right.tobytes()]
    mixed = RawInput("linear16", 16000, 2, split=False).feed(data)
    assert mixed == [((left.astype(np.int32) + right) // 2).astype("<i2").tobytes()]


def test_a_rate_sessions_do_not_take_is_resampled_to_16k():
    tone = (8000 * np.sin(np.arange(44100) * 2 * np.pi * 440 / 44100)).astype("<i2")
    raw = RawInput("linear16", 44100, 1, split=False)
    assert raw.rate == 16000
    out = raw.feed(tone.tobytes())[0] + raw.flush()[0]
    assert abs(len(out) // 2 - 16000) <= 2
    assert RawInput("linear16", 8000, 1, split=False).rate == 8000  # taken as it is


def test_g711_is_decoded_by_ffmpeg():
    import av

    pcm = (8000 * np.sin(np.arange(8000) * 2 * np.pi * 300 / 8000)).astype("<i2")
    encoder = av.CodecContext.create("pcm_mulaw", "w")
    encoder.sample_rate, encoder.format, encoder.layout = 8000, "s16", "mono"
    frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = 8000
    ulaw = b"".join(bytes(p) for p in encoder.encode(frame))
    assert len(ulaw) == len(pcm)
    back = np.frombuffer(open_input("mulaw", 8000, 1, False).feed(ulaw)[0], dtype="<i2")
    assert len(back) == len(pcm)
    assert np.corrcoef(back.astype(float), pcm.astype(float))[0, 1] > 0.99


def test_a_container_stream_decodes_as_it_arrives_and_garbage_is_told_early():
    wav = (FIXTURES / "call.wav").read_bytes()
    stream = ContainerInput(split=False)
    got = b""
    for i in range(0, len(wav), 3200):
        stream.write(wav[i:i + 3200])
        got += stream.read()[0]
    assert stream.wait(10.0)
    got += stream.read()[0]
    assert got, "nothing decoded before the end of the stream"
    got += stream.flush()[0]
    assert got == read_audio(FIXTURES / "call.wav")[0]
    garbage = np.random.default_rng(7).integers(0, 256, 40000, dtype=np.uint8).tobytes()
    bad = ContainerInput(split=False)
    bad.write(garbage)  # no end: FFmpeg gives up within its first 32 KB
    assert bad.wait(10.0)
    # the decoder has stopped: more frames are dropped, not a broken pipe (found by the
    # end-to-end fuzz: the error escaped to the connection)
    for _ in range(8):
        bad.write(garbage)
    with pytest.raises(BadAudio):
        bad.read()
    bad.close()


@given(message=st.text(max_size=300))
# found by schemathesis (tests/system/test_openapi.py): a language outside Latin-1 echoed in
# the dg-error header made gevent refuse the response, a 500
@example(message="language '\U000122c3\x14' is not offered on this server")
def test_a_refusal_header_is_one_line_of_latin_1_whatever_the_message(message):
    _status, headers, _body = ListenError(400, "Bad Request", message).refusal("id")
    for _name, value in headers:
        value.encode("latin-1")
        assert "\r" not in value and "\n" not in value
