"""Pure parts, no server: settings, codec, resampler, engines."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import soxr

from cosyvoice.asr import load_model
from cosyvoice.asr.pocketsphinx_engine import clean_word
from cosyvoice.settings import Settings
from cosyvoice.wire.errors import BadChunk, TooLarge, UnsupportedRate
from cosyvoice.wire.protocol import Chunk, decode_chunk, encode_chunk, encode_opus_chunk
from cosyvoice.wire.resample import StreamingResampler

from ..helpers import (
    FIXTURES,
    direct_decode,
    finals,
    fixture_texts,
    read_pcm,
    run_stream,
    wer,
)

pytestmark = [pytest.mark.fast, pytest.mark.unit]

# ---- settings -----------------------------------------------------------------------

def test_settings_read_env_with_types():
    s = Settings.from_env({"COSYVOICE_PORT": "6001", "COSYVOICE_SESSION_GRACE_S": "2.5",
                           "COSYVOICE_REDIS_URL": "redis://x:1/0"})
    assert (s.port, s.session_grace_s, s.redis_url) == (6001, 2.5, "redis://x:1/0")


def test_settings_overrides_win_and_none_is_ignored():
    s = Settings.from_env({"COSYVOICE_PORT": "6001"}, port=7000, engine=None)
    assert s.port == 7000 and s.engine == "whisper-live"


def test_settings_reject_garbage_and_round_trip_through_env():
    with pytest.raises(ValueError, match="COSYVOICE_PORT"):
        Settings.from_env({"COSYVOICE_PORT": "five"})
    s = Settings(port=5123, endpoint_ratio=0.8)
    assert Settings.from_env(s.as_env()) == s


def test_a_cluster_is_named_by_its_seeds_and_seeds_need_the_cluster_setting():
    seeds = "redis://10.0.0.1:7000,redis://10.0.0.2:7000"
    s = Settings.from_env({"COSYVOICE_REDIS_URL": seeds, "COSYVOICE_REDIS_CLUSTER": "true"})
    assert (s.redis_url, s.redis_cluster) == (seeds, True)
    with pytest.raises(ValueError, match="COSYVOICE_REDIS_CLUSTER=true"):
        Settings.from_env({"COSYVOICE_REDIS_URL": seeds})
    with pytest.raises(ValueError, match="needs COSYVOICE_REDIS_URL"):
        Settings.from_env({"COSYVOICE_REDIS_CLUSTER": "true"})
    with pytest.raises(ValueError, match="COSYVOICE_REDIS_URL"):
        Settings.from_env({"COSYVOICE_REDIS_URL": "redis://a:1,ftp://b:2",
                           "COSYVOICE_REDIS_CLUSTER": "true"})


def test_settings_rules_cover_every_checkable_setting_and_accept_the_defaults():
    from cosyvoice.settings import _RULES, SettingsError
    names = {f.name for f in dataclasses.fields(Settings)}
    assert set(_RULES) <= names
    # free text (addresses, paths, secrets, origins) and booleans need no rule
    assert names - set(_RULES) == {"host", "redis_cluster", "abr", "whisper_cpu_bf16",
                                   "whisper_int8_decoder", "whisper_checkpoint", "model_dir",
                                   "allowed_origins", "auth_secret", "api_keys_file"}
    assert Settings().validate() == Settings()
    for env in ({"COSYVOICE_WORKER_CAPACITY": "-1"}, {"COSYVOICE_ENDPOINT_RATIO": "1.5"},
                {"COSYVOICE_DEFAULT_SAMPLE_RATE": "22050"},
                {"COSYVOICE_REDIS_URL": "redis://:6379"},
                {"COSYVOICE_WHISPER_BACKEND": "onnx"}, {"COSYVOICE_FINALS_NICE": "20"}):
        with pytest.raises(SettingsError, match=next(iter(env))):
            Settings.from_env(env)
    for url in ("redis://localhost:6379/0", "rediss://h:1", "unix:///run/redis.sock"):
        assert Settings.from_env({"COSYVOICE_REDIS_URL": url}).redis_url == url


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().port = 1  # type: ignore[misc]  # the write this test expects to fail


# ---- codec --------------------------------------------------------------------------

def test_chunk_round_trip():
    pb = encode_chunk(b"\x01\x02" * 10, 7, last=True, sample_rate=48000, sent_ms=123)
    chunk = decode_chunk(pb, 16000, 1000)
    assert chunk == Chunk(b"\x01\x02" * 10, 7, True, 48000, 123, audio_ms=10 / 48)


def test_opus_chunk_round_trip():
    packets = [bytes([0x08]) + bytes(40)] * 10  # ten 20 ms SILK frames (framing only)
    pb = encode_opus_chunk(packets, 3, bitrate=24000, sent_ms=5)
    chunk = decode_chunk(pb, 8000, 1000)
    assert chunk == Chunk(b"", 3, False, 16000, 5, codec="opus", opus=tuple(packets),
                          bitrate=24000, audio_ms=200.0)
    assert chunk.duration_s == 0.2


def test_rate_zero_means_current_rate():
    assert decode_chunk(encode_chunk(b"\x00\x00", 1), 8000, 1000).sample_rate == 8000


@pytest.mark.parametrize("payload, error", [
    (b"\x12\x05ab", BadChunk),                 # truncated field: betterproto makes a list
    (b"\x08\x08", BadChunk),                   # int where bytes belong
    (12, BadChunk),
    (None, BadChunk),
    (encode_chunk(b"\x00" * 4, 0, sample_rate=44100), UnsupportedRate),
    (encode_chunk(b"\x00" * 96002, 0, sample_rate=48000), TooLarge),
])
def test_decode_rejects(payload, error):
    with pytest.raises(error):
        decode_chunk(payload, 16000, 1000)


# ---- resampling ---------------------------------------------------------------------

def test_streaming_resampler_chunked_equals_one_shot():
    rng = np.random.default_rng(1)
    pcm = (rng.standard_normal(48000) * 3000).astype("<i2").tobytes()
    rs = StreamingResampler(48000, 16000)
    chunked = b"".join(rs.feed(pcm[i:i + 19200]) for i in range(0, len(pcm), 19200)) + rs.flush()
    whole = StreamingResampler(48000, 16000)
    assert chunked == whole.feed(pcm) + whole.flush()
    assert abs(len(chunked) // 2 - 16000) <= 1


# ---- engines ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return load_model("pocketsphinx", Settings())




def test_clean_word_drops_fillers_and_variants():
    assert [clean_word(w) for w in ["<s>", "</s>", "<sil>", "[NOISE]", "++UM++", "read(2)",
                                    "o'clock"]] == [None, None, None, None, None, "read", "o'clock"]


@pytest.mark.parametrize("name", sorted(fixture_texts()))
def test_stream_matches_direct_decode(model, name):
    pcm = read_pcm(name)
    text = " ".join(f["text"] for f in finals(run_stream(model, pcm)[0]))
    ref = fixture_texts()[name]
    assert wer(ref, text) <= wer(ref, direct_decode(pcm)) + 0.01


def test_transcript_does_not_depend_on_decoder_history(model):
    """Decoders are pooled: what one decoded before must not change the next session."""
    pcm = read_pcm("door")
    model.preload(1)
    first, _ = run_stream(model, pcm)
    run_stream(model, read_pcm("shells") + read_pcm("meeting"))
    again, _ = run_stream(model, pcm)
    assert first == again


def test_rebuilt_stream_continues_exactly_from_a_checkpoint(model):
    pcm = (FIXTURES / "two_utterances.wav").read_bytes()[44:]
    results, checkpoints = run_stream(model, pcm)
    assert len(finals(results)) == 2 and checkpoints
    for position, cp in checkpoints.items():
        resumed, _ = run_stream(model, pcm, checkpoint=cp, start=position)
        assert finals(resumed) == finals(results)[cp["utterance"]:]


def _resampled(pcm16: bytes, rate: int) -> bytes:
    x = np.frombuffer(pcm16, dtype="<i2").astype(np.float32) / 32768
    return (np.clip(soxr.resample(x, 16000, rate), -1, 1) * 32767).astype("<i2").tobytes()


def test_48k_sessions_are_resampled_and_recognised(model):
    for name in ("coffee", "door"):
        results = run_stream(model, _resampled(read_pcm(name), 48000), rate=48000)[0]
        text = " ".join(f["text"] for f in finals(results))
        ref = fixture_texts()[name]
        assert wer(ref, text) <= wer(ref, direct_decode(read_pcm(name))) + 0.01


def test_8k_sessions_decode_like_the_recogniser_on_band_limited_audio(model):
    """No 8 kHz model ships: audio is upsampled, and the CMN starts from a narrowband
    prior. Compared with a batch decode of the same band-limited audio (held-out
    fixture: the prior was estimated on others)."""
    pcm8 = _resampled(read_pcm("coffee"), 8000)
    x = np.frombuffer(pcm8, dtype="<i2").astype(np.float32) / 32768
    band_limited = (np.clip(soxr.resample(x, 8000, 16000), -1, 1) * 32767).astype("<i2").tobytes()
    text = " ".join(f["text"] for f in finals(run_stream(model, pcm8, rate=8000)[0]))
    ref = fixture_texts()["coffee"]
    assert wer(ref, text) <= wer(ref, direct_decode(band_limited)) + 0.01


def test_rate_switch_mid_stream_keeps_the_utterance(model):
    pcm16 = read_pcm("meeting")
    x = np.frombuffer(pcm16, dtype="<i2").astype(np.float32) / 32768
    half = len(x) // 2 // 3200 * 3200
    pcm8 = (np.clip(soxr.resample(x[half:], 16000, 8000), -1, 1) * 32767).astype("<i2").tobytes()
    stream = model.stream(16000)
    results = []
    for i in range(0, half * 2, 6400):
        results += stream.feed(pcm16[i:i + 6400])
    for i in range(0, len(pcm8), 3200):
        results += stream.feed(pcm8[i:i + 3200], 8000)
    results += stream.flush()
    stream.close()
    assert len(finals(results)) == 1
    assert wer(fixture_texts()["meeting"], finals(results)[0]["text"]) <= 0.35


def test_long_speech_is_cut_at_the_utterance_cap():
    model = load_model("pocketsphinx", Settings(max_utterance_s=1.0))
    results, _ = run_stream(model, read_pcm("shells"))
    assert len(finals(results)) >= 2
    assert all(f["end"] - f["start"] <= 1.0 + 0.2 + 0.3 for f in finals(results))


def test_null_engine_answers_every_chunk_without_recognising():
    model = load_model("null", Settings())
    results, _ = run_stream(model, b"\x00\x00" * 16000)
    assert [r["type"] for r in results] == ["partial"] * 5 + ["final"]
    assert all(r["text"] == "" for r in results)


def test_endpointer_finds_each_utterance_and_is_freed():
    import gc

    import psutil

    from cosyvoice.asr.endpointer import Endpointer

    pcm = b"\0\0" * 8000 + read_pcm("weather") + b"\0\0" * 24000 + read_pcm("call") + b"\0\0" * 8000
    ep = Endpointer(0.3, 0.9)
    starts: list[float] = []
    ends: list[float] = []
    was = False
    for i in range(0, len(pcm) - ep.frame_bytes + 1, ep.frame_bytes):
        ep.process(pcm[i:i + ep.frame_bytes])
        if ep.in_speech and not was:
            starts.append(ep.speech_start)
        if was and not ep.in_speech:
            ends.append(ep.speech_end)
        was = ep.in_speech
    assert len(starts) == len(ends) == 2
    (s1, e1), (s2, e2) = zip(starts, ends, strict=True)
    assert 0.3 <= s1 < 0.8 and e1 < s2 and e2 - s2 > 1.0
    # PocketSphinx's own Endpointer leaked ~19 KB per instance; streams make one per utterance
    proc = psutil.Process()
    gc.collect()
    before = proc.memory_full_info().uss
    for _ in range(3000):
        Endpointer(0.3, 0.9)
    gc.collect()
    assert proc.memory_full_info().uss - before < 4 * 2**20


# ---- transcripts as files (cosyvoice/text/subtitles.py) ------------------------------------------


def _final(text: str, start: float, end: float, words: bool = True) -> dict:
    tokens = text.split()
    step = (end - start) / max(1, len(tokens))
    return {"type": "final", "text": text, "start": start, "end": end, "engine": "whisper-live",
            "words": [{"word": t, "start": start + k * step, "end": start + (k + 1) * step,
                       "conf": 0.9} for k, t in enumerate(tokens)] if words else []}


@pytest.mark.fast
def test_subtitle_cues_are_readable_ordered_and_carry_every_word():
    from cosyvoice.text import subtitles
    long = " ".join(f"word{k}" for k in range(60))  # 60 words over 24 s
    finals = [_final("Glue the sheet to the dark blue background today.", 0.0, 2.4),
              _final("", 2.5, 2.6),  # a final without text: no cue
              _final(long, 2.5, 26.5),  # starts before the first ends: moved, not overlapping
              _final("no word times here at all", 27.0, 29.0, words=False)]
    cues = subtitles.cues(finals)
    assert " ".join(" ".join(c.lines) for c in cues).split() == \
        " ".join(f["text"] for f in finals).split()
    assert cues[0].lines == ["Glue the sheet to the dark", "blue background today."]
    for k, cue in enumerate(cues):
        assert 1 <= len(cue.lines) <= 2 and all(len(line) <= 42 for line in cue.lines)
        assert 0 < cue.end_ms - cue.start_ms <= 7000
        if k:
            assert cue.start_ms >= cues[k - 1].end_ms
    # utterance times shared out over the characters where the engine gave no word times
    assert cues[-1].start_ms == 27000 and cues[-1].end_ms == 29000
    srt = subtitles.to_srt(finals)
    assert srt.startswith("1\n00:00:00,000 --> 00:00:02,400\nGlue the sheet to the dark\n")
    assert subtitles.to_vtt(finals).startswith("WEBVTT\n\n00:00:00.000 --> 00:00:02.400\n")
    assert subtitles.to_text(finals).splitlines()[0] == finals[0]["text"]
    doc = json.loads(subtitles.to_json(finals))
    assert len(doc["finals"]) == 3 and "type" not in doc["finals"][0]
    assert doc["finals"][0]["words"][0]["word"] == "Glue"
    assert set(doc["finals"][0]["words"][0]) == {"word", "start", "end", "conf"}
    assert doc["finals"][0]["engine"] == "whisper-live"
